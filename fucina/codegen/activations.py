"""Activation emitters (SPEC §3.3): each forward op and the backward kernels its rule uses.

An entry is `name: (arity, emit)` with `emit(builder, *values)` on scalar or vector IR values.
Backward kernels take the upstream gradient g first, then what the rule reads: the forward
input x or the forward output y.
"""
from __future__ import annotations

from . import irutil as u
from .emit import relu, sqrt, vm


def _zero_unless(b, cond, g):
    return b.select(cond, g, u.const(g.type, 0.0))


OPS = {
    "relu": (1, relu),
    "sqrt": (1, sqrt),
    "exp": (1, vm("exp")),
    "log": (1, vm("log")),
    "tanh": (1, vm("tanh")),
    "sigmoid": (1, vm("sigmoid")),
    "relu_grad": (2, lambda b, g, x: _zero_unless(b, b.fcmp_ordered(">", x, u.const(x.type, 0.0)), g)),
    "tanh_grad": (2, lambda b, g, y: b.fmul(g, b.fsub(u.const(y.type, 1.0), b.fmul(y, y)))),
    "sigmoid_grad": (2, lambda b, g, y: b.fmul(g, b.fmul(y, b.fsub(u.const(y.type, 1.0), y)))),
    "sqrt_grad": (2, lambda b, g, y: b.fmul(g, b.fdiv(u.const(y.type, 0.5), y))),
}
