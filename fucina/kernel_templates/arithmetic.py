"""Float arithmetic (SPEC §3.1) and the backward rules of the binary ops — the float table of
the elementwise generator besides activations, losses and masks, one template per kernel
(language: codegen/lowering.py). f16/bf16 operands arrive widened to f32.

Backward kernels take the upstream gradient g first. maximum/minimum propagate NaN (either
operand); their gradient goes to the winner, half to each on an exact tie. pow is the C99/Zig
domain (vpow); the exponent's gradient is 0 where the base is 0 (torch's convention, the true
limit for e >= 0).
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS: dict = {}

KERNELS = {
    "copy": T("x", "x"),
    "neg": T("x", "-x"),
    "add": T("x y", "x + y"),
    "sub": T("x y", "x - y"),
    "mul": T("x y", "x * y"),
    "div": T("x y", "x / y"),
    "maximum": T("x y", "maximum(x, y)"),
    "minimum": T("x y", "minimum(x, y)"),
    "pow": T("x y", "pow(x, y)"),
    "add_scaled": T("x y a", "x + a * y"),                   # x + a·y, a by value
    # backward rules (g first)
    "div_grad_b": T("g x y", "-((g * x) / (y * y))"),
    "maximum_grad": T("g x y", "g if x > y else (g * 0.5 if x == y else 0)"),
    "minimum_grad": T("g x y", "g if x < y else (g * 0.5 if x == y else 0)"),
    "pow_grad_base": T("g x e", "g * (e * pow(x, e - 1))"),
    "pow_grad_exp": T("g x y", "0 if x == 0 else g * (log(x) * y)"),   # y = x^e, the output
    # a reduction's gradient routed to its chosen element: idx, pos i64
    "pick": T("g idx pos", "g if idx == pos else 0"),
}

TEMPLATES = KERNELS
