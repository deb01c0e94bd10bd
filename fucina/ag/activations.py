"""Activations with their backward rules (SPEC §3.3 UnaryOp, §3.4 leaky_relu/clamp, §3.6 gated).

Every op is one fused forward kernel and, per operand that needs a gradient, one fused backward
kernel (formulas: fucina/kernel_templates/activations.py, lowered by codegen/). A rule reads
the forward input x or the forward output y, as SPEC's table says; only that tensor is kept
by the node. f16/bf16 inputs run widen → f32 →
narrow once in the same kernel and are no-grad (finish_op raises UnsupportedGradient).
"""
from __future__ import annotations

from .. import axes
from ..errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidShape,
                      UnsupportedGradient)
from ..exec import elementwise as ew
from ..kernel_templates.activations import UNARY_RULES
from . import engine
from .checks import real, same_ctx
from .elementwise import aligned, unbroadcast
from .engine import finish_op

# the closed UnaryOp enum, in SPEC §3.3 order (then hardswish)
_SPELLINGS = {"softcap30": "softcap_30", "softcap15": "softcap_15"}  # the method aliases' names

# op -> (backward kernel, what it reads: "x" the input, "y" the output, None only g);
# None = derivative 0 almost everywhere (the gradient is zeros). Written beside the formulas.
_UNARY_GRAD = UNARY_RULES
UNARY = tuple(UNARY_RULES)

GATED = ("glu", "swiglu", "geglu", "situ")
SPLIT_GATED = ("swiglu", "glu")
INFERENCE_ONLY_GATED = ("swiglu_clamp10",)


def _float_dtype(op: str, x) -> str:
    """The operand's dtype, if it is a float one (f32/f16/bf16); DTypeError otherwise."""
    dt = x._raw.dtype
    if dt not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: expected a float tensor (f32, f16 or bf16), got {dt}")
    return dt


def canonical(op) -> str:
    """The UnaryOp name for `op` (a member or the softcap30/softcap15 spelling); ValueError else."""
    if isinstance(op, str):
        op = _SPELLINGS.get(op, op)
        if op in _UNARY_GRAD:
            return op
    raise InvalidArgument(f"unary: expected one of {UNARY}, got {op!r}")


def unary(op: str, x):
    """The UnaryOp `op` (a canonical name) of x; returns finish_op's (raw, tags, node)."""
    r = x._raw
    ctx = r.ctx
    if op == "neg" and r.dtype == "i64":  # integer negation (wrapping), kept from the arithmetic table
        return finish_op(op, ew.run(ctx, "neg", "i64", r.shape, (r,)), x.tags, (), None)
    dtype = _float_dtype(op, x)
    out = ew.run(ctx, op, dtype, r.shape, (r,))
    rule = _UNARY_GRAD[op]
    shape = r.shape

    def vjp(needs):  # the closure keeps only what the rule reads (x or y), not both
        if rule is None:
            return lambda g: (ctx.full_raw(shape, 0.0, "f32"),)
        kernel, reads = rule
        saved = () if reads is None else (r if reads == "x" else out,)
        return lambda g: (ew.run(ctx, kernel, "f32", shape, (g, *saved)),)

    return finish_op(op, out, x.tags, (x,), vjp)


def leaky_relu(x, slope: float):
    r = x._raw
    ctx = r.ctx
    out = ew.run(ctx, "leaky_relu", _float_dtype("leaky_relu", x), r.shape, (r, slope))
    return finish_op("leaky_relu", out, x.tags, (x,), lambda needs: lambda g: (
        ew.run(ctx, "leaky_relu_grad", "f32", r.shape, (g, r, slope)),))


def clamp(op: str, x, lo: float, hi: float):
    r = x._raw
    ctx = r.ctx
    out = ew.run(ctx, "clamp", _float_dtype(op, x), r.shape, (r, lo, hi))
    return finish_op(op, out, x.tags, (x,), lambda needs: lambda g: (
        ew.run(ctx, "clamp_grad", "f32", r.shape, (g, r, lo, hi)),))


def _gated_grads(op, ctx, tags, shape, vu, vg, needs, g):
    """(gradient at the result shape to up, to gate), None where not needed."""
    gu = gg = None
    if needs[0]:
        gu = ew.run(ctx, op + "_grad_up", "f32", shape, (g, vu, vg) if op == "situ" else (g, vg))
    if needs[1]:
        gg = ew.run(ctx, op + "_grad_gate", "f32", shape, (g, vu, vg))
    return gu, gg


def gated(op: str, up, gate):
    """src(up) · act(gate) with A-2 broadcasting; gradients to both, sum-reduced."""
    tags, shape, vu, vg = aligned(op, up, gate)
    ctx = vu.ctx
    dtype = ew.compute_dtype_of(op, (_float_dtype(op, up), _float_dtype(op, gate)))
    out = ew.run(ctx, op, dtype, shape, (vu, vg))
    ut, us, gt, gs = up.tags, up._raw.shape, gate.tags, gate._raw.shape

    def vjp(needs):
        def run(g):
            gu, gg = _gated_grads(op, ctx, tags, shape, vu, vg, needs, g)
            return (unbroadcast(ctx, gu, tags, ut, us) if needs[0] else None,
                    unbroadcast(ctx, gg, tags, gt, gs) if needs[1] else None)
        return run

    return finish_op(op, out, tags, (up, gate), vjp)


def swiglu_clamp10(up, gate):
    """clamp(up, −10, 10) · silu(min(gate, 10)); inference-only (no gradient)."""
    op = "swiglu_clamp10"
    if engine.needs_graph(up, gate):
        raise UnsupportedGradient(f"{op}: inference-only (DeepSeek's clamped SwiGLU for MoE); "
                                  f"expected operands that do not require grad (or fu.no_grad())")
    tags, shape, vu, vg = aligned(op, up, gate)
    dtype = ew.compute_dtype_of(op, (_float_dtype(op, up), _float_dtype(op, gate)))
    return finish_op(op, ew.run(vu.ctx, op, dtype, shape, (vu, vg)), tags, (), None)


def split_gated(op: str, x, tag: str, out_tag: str):
    """Halve axis `tag` into first, second (views); swiglu = silu(first)·second, glu =
    first·sigmoid(second); the result axis is renamed out_tag."""
    r = x._raw
    ctx = r.ctx
    ax = axes.axis_of(x.tags, tag, "split_gated")
    if not isinstance(out_tag, str):
        raise axes.TagError(f"split_gated: expected out_tag to be a string, got {out_tag!r}")
    if out_tag != tag and out_tag in x.tags:
        raise axes.TagError(f"split_gated: out_tag {out_tag!r} is already an axis of {x.tags}")
    n = r.shape[ax]
    if n % 2:
        raise InvalidShape(f"split_gated: expected an even size along {tag!r}, got {n}")
    dtype = _float_dtype("split_gated", x)
    h = n // 2
    first, second = r.narrow(ax, 0, h), r.narrow(ax, h, h)
    vu, vg = (second, first) if op == "swiglu" else (first, second)
    shape = first.shape
    out = ew.run(ctx, op, dtype, shape, (vu, vg))
    tags = x.tags[:ax] + (out_tag,) + x.tags[ax + 1:]

    def vjp(needs):
        def run(g):  # each half's gradient is written straight into its window of one buffer
            full = ctx.empty(r.shape, "f32")
            lo, hi = full.narrow(ax, 0, h), full.narrow(ax, h, h)
            up_win, gate_win = (hi, lo) if op == "swiglu" else (lo, hi)
            ew.run(ctx, op + "_grad_up", "f32", shape, (g, vg), out=up_win)
            ew.run(ctx, op + "_grad_gate", "f32", shape, (g, vu, vg), out=gate_win)
            return (full,)
        return run

    return finish_op("split_gated", out, tags, (x,), vjp)


def _gated_op(name: str, op) -> str:
    if op in INFERENCE_ONLY_GATED:
        raise InvalidArgumentType(f"{name}: {op!r} is inference-only (it exists for the MoE entries); "
                        f"use x.swiglu_clamp10(gate) under no-grad")
    allowed = SPLIT_GATED if name == "split_gated" else GATED
    if op in GATED and op not in allowed:
        raise InvalidArgumentType(f"split_gated: {op!r} has no split form; expected one of {allowed}")
    if op not in allowed:
        raise InvalidArgument(f"{name}: expected one of {allowed}, got {op!r}")
    return op


class ActivationMethods:
    """Tensor methods of the activation family."""

    __slots__ = ()

    def unary(self, op: str):
        """The UnaryOp `op` elementwise (SPEC §3.3); ValueError names the valid ops."""
        op = canonical(op)
        self._live(op)
        return self._result(*unary(op, self))

    def relu(self):
        return self.unary("relu")

    def exp(self):
        return self.unary("exp")

    def sqrt(self):
        return self.unary("sqrt")

    def rsqrt(self):
        return self.unary("rsqrt")

    def sigmoid(self):
        return self.unary("sigmoid")

    def silu(self):
        return self.unary("silu")

    def log(self):
        return self.unary("log")

    def log1p(self):
        return self.unary("log1p")

    def neg(self):
        return self.unary("neg")

    def abs(self):
        return self.unary("abs")

    __abs__ = abs

    def sin(self):
        return self.unary("sin")

    def cos(self):
        return self.unary("cos")

    def tanh(self):
        return self.unary("tanh")

    def fast_tanh(self):
        return self.unary("fast_tanh")

    def gelu(self):
        return self.unary("gelu")

    def quick_gelu(self):
        return self.unary("quick_gelu")

    def softcap30(self):
        return self.unary("softcap_30")

    def softcap15(self):
        return self.unary("softcap_15")

    def elu(self):
        return self.unary("elu")

    def gelu_erf(self):
        return self.unary("gelu_erf")

    def floor(self):
        return self.unary("floor")

    def ceil(self):
        return self.unary("ceil")

    def round(self):
        return self.unary("round")

    def sign(self):
        return self.unary("sign")

    def reciprocal(self):
        return self.unary("reciprocal")

    def erf(self):
        return self.unary("erf")

    def hardswish(self):
        """x·min(max(x + 3, 0), 6)/6 (MobileNetV3's, torch.nn.functional.hardswish)."""
        return self.unary("hardswish")

    # ---- parameterized (SPEC §3.4) ----
    def leaky_relu(self, negative_slope: float):
        """x > 0 ? x : negative_slope·x; gradient 1 / negative_slope."""
        s = real("leaky_relu", negative_slope)
        self._live("leaky_relu")
        return self._result(*leaky_relu(self, s))

    def clamp(self, lo: float, hi: float):
        """min(max(x, lo), hi) (NaN propagates); gradient g inside [lo, hi] inclusive, else 0."""
        lo, hi = real("clamp", lo), real("clamp", hi)
        self._live("clamp")
        return self._result(*clamp("clamp", self, lo, hi))

    def clamp_min(self, lo: float):
        lo = real("clamp_min", lo)
        self._live("clamp_min")
        return self._result(*clamp("clamp_min", self, lo, float("inf")))

    def clamp_max(self, hi: float):
        hi = real("clamp_max", hi)
        self._live("clamp_max")
        return self._result(*clamp("clamp_max", self, float("-inf"), hi))

    # ---- gated (SPEC §3.6): self is up, other is the gate ----
    def gated(self, other, op: str):
        """src(self) · act(other) for op in glu, swiglu, geglu, situ (A-2 broadcasting)."""
        op = _gated_op("gated", op)
        self._live(op)
        same_ctx(op, self, other)
        return self._result(*gated(op, self, other))

    def glu(self, other):
        return self.gated(other, "glu")

    def swiglu(self, other):
        return self.gated(other, "swiglu")

    def geglu(self, other):
        return self.gated(other, "geglu")

    def situ(self, other):
        return self.gated(other, "situ")

    def swiglu_clamp10(self, other):
        """clamp(self, −10, 10) · silu(min(other, 10)) — inference-only: UnsupportedGradient if
        an operand requires grad while grad mode is on."""
        self._live("swiglu_clamp10")
        same_ctx("swiglu_clamp10", self, other)
        return self._result(*swiglu_clamp10(self, other))

    def split_gated(self, op: str, tag: str, out_tag: str):
        """Halve axis `tag`: swiglu → silu(first)·second, glu → first·sigmoid(second) (ggml's
        conventions); the halved axis is renamed `out_tag` (may equal `tag`)."""
        op = _gated_op("split_gated", op)
        self._live("split_gated")
        return self._result(*split_gated(op, self, tag, out_tag))
