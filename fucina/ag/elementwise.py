"""Elementwise ops with their backward rules (SPEC §3.1–§3.3): forward through the exec
layer, then one finish_op tail that records the VJP when an operand requires grad."""
from __future__ import annotations

import numbers

import numpy as np

import functools

from .. import axes
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..errors import ContextMismatch, DTypeError, GradientCastUnsupported, InvalidArgumentType
from ..exec.dtypes import BLOCKS, check as check_dtype
from ..exec.raw import RawTensor
from . import engine
from .checks import real
from .engine import finish_op, needs_graph
from .typed import block_cast


def unbroadcast(ctx, g, out_tags, in_tags, in_shape):
    """The gradient of a broadcast operand: g summed over the axes the operand lacked or had
    at size 1 (innermost first), laid out in the operand's own tags and shape."""
    if out_tags == in_tags and g.shape == in_shape:
        return g
    tags = list(out_tags)
    cur = g
    for pos in reversed(range(len(out_tags))):
        t = out_tags[pos]
        if t not in in_tags or (in_shape[in_tags.index(t)] == 1 and cur.shape[pos] != 1):
            cur = red.reduce_axis(ctx, "sum", cur, pos)
            tags.pop(pos)
    strides = tuple(cur.strides[tags.index(t)] if t in tags else 0 for t in in_tags)
    return ew.materialize(ctx, cur.view(in_shape, strides))


def binary(op: str, x, y, tags, shape, vx, vy):
    """x op y for two tensors already aligned (vx, vy: views at the result shape)."""
    ctx = vx.ctx
    dtype = ew.compute_dtype_of(op, (vx.dtype, vy.dtype))
    out = ew.run(ctx, op, dtype, shape, (vx, vy))
    return finish_op(op, out, tags, (x, y), lambda needs: functools.partial(
        binary_grads, (op, ctx, tags, shape, *kept(op, vx, vy, out, needs), x.tags, x._raw.shape,
                       y.tags, y._raw.shape), needs))


def keeps(op: str, needs) -> tuple:
    """Which of (x, y, out) binary_grads reads for these needs: a saved tensor stays alive
    until the backward, so an add keeps nothing and a mul only the other operand of each
    gradient it owes."""
    if op in ("add", "sub"):
        return False, False, False
    if op == "mul":
        return needs[1], needs[0], False
    if op == "div":
        return needs[1], True, False
    if op == "pow":
        return True, True, needs[1]
    return True, True, False


def kept(op: str, vx, vy, out, needs) -> tuple:
    """(x, y, out) as binary_grads reads them for these needs (keeps), None for the rest."""
    kx, ky, ko = keeps(op, needs)
    return (vx if kx else None), (vy if ky else None), (out if ko else None)


def binary_grads(saved, needs, g):
    """The VJP of every pointwise binary op; `saved` is what the forward kept."""
    op, ctx, tags, shape, vx, vy, out, xt, xs, yt, ys = saved
    ga = gb = None
    if op == "add":
        ga, gb = g, g
    elif op == "sub":
        ga, gb = g, (ew.run(ctx, "neg", "f32", shape, (g,)) if needs[1] else None)
    elif op == "mul":
        ga = ew.run(ctx, "mul", "f32", shape, (g, vy)) if needs[0] else None
        gb = ew.run(ctx, "mul", "f32", shape, (g, vx)) if needs[1] else None
    elif op == "div":
        ga = ew.run(ctx, "div", "f32", shape, (g, vy)) if needs[0] else None
        gb = ew.run(ctx, "div_grad_b", "f32", shape, (g, vx, vy)) if needs[1] else None
    elif op in ("maximum", "minimum"):
        k = op + "_grad"
        ga = ew.run(ctx, k, "f32", shape, (g, vx, vy)) if needs[0] else None
        gb = ew.run(ctx, k, "f32", shape, (g, vy, vx)) if needs[1] else None
    elif op == "pow":
        ga = ew.run(ctx, "pow_grad_base", "f32", shape, (g, vx, vy)) if needs[0] else None
        gb = ew.run(ctx, "pow_grad_exp", "f32", shape, (g, vx, out)) if needs[1] else None
    return (unbroadcast(ctx, ga, tags, xt, xs) if needs[0] else None,
            unbroadcast(ctx, gb, tags, yt, ys) if needs[1] else None)


def add_scaled(x, y, s: float):
    """x.add(y.scale(s)) in one pass (no scaled copy of y): the kernel rounds s·y, then the
    sum — the two ops' roundings — and the gradients are theirs, g and s·g. x and y have the
    same tags and shape (the caller checked), s a real. Returns finish_op's triple."""
    ctx = x._raw.ctx
    shape = x._raw.shape
    out = ew.run(ctx, "add_scaled", "f32", shape, (x._raw, y._raw, s))
    return finish_op("add_scaled", out, x.tags, (x, y),
                     lambda needs: functools.partial(add_scaled_grads, ctx, shape, s, needs))


def add_scaled_grads(ctx, shape, s, needs, g):
    """x + s·y's gradients: g for x, s·g (rounded) for y, each only when needed."""
    return (g if needs[0] else None,
            ew.run(ctx, "mul", "f32", shape, (g, s)) if needs[1] else None)


def with_scalar(op: str, x, s: float, reflected: bool):
    """x op s (or s op x when reflected); the scalar is a by-value kernel parameter."""
    r = x._raw
    ctx = r.ctx
    dtype = ew.compute_dtype_of(op, (r.dtype,))
    operands = (s, r) if reflected else (r, s)
    out = ew.run(ctx, op, dtype, r.shape, operands)

    # what the rule reads, and nothing else: the closure keeps it alive until the backward
    shape = r.shape
    xr = r if (op == "div" and reflected) or (op == "pow" and not reflected) \
        or op in ("maximum", "minimum") else None
    y = out if op == "pow" and reflected else None

    def vjp(needs):
        def run(g):
            if op == "add":
                return (g,)
            if op == "sub":
                return (ew.run(ctx, "neg", "f32", shape, (g,)) if reflected else g,)
            if op == "mul":
                return (ew.run(ctx, "mul", "f32", shape, (g, s)),)
            if op == "div":
                if reflected:  # d(s/x) = -s/x^2
                    return (ew.run(ctx, "div_grad_b", "f32", shape, (g, s, xr)),)
                return (ew.run(ctx, "div", "f32", shape, (g, s)),)
            if op == "pow":
                if reflected:  # d(s^x) = ln(s) s^x
                    return (ew.run(ctx, "pow_grad_exp", "f32", shape, (g, s, y)),)
                return (ew.run(ctx, "pow_grad_base", "f32", shape, (g, xr, s)),)
            if op in ("maximum", "minimum"):  # symmetric: a tie splits g/2 either way
                return (ew.run(ctx, op + "_grad", "f32", shape, (g, xr, s)),)
            raise AssertionError(f"{op} has no scalar backward rule")
        return run

    return finish_op(op, out, x.tags, (x,), vjp)


def cast(x, dtype: str):
    """to(dtype), SPEC R-10: always a copy. f32 -> f32/f16/bf16 and f16/bf16 -> f32 are
    differentiable (backward: the f32 upstream gradient unchanged); any other cast of a tensor
    that requires grad raises GradientCastUnsupported (with grad mode on)."""
    r = x._raw
    differentiable = (r.dtype, dtype) in {("f32", "f32"), ("f32", "f16"), ("f32", "bf16"),
                                          ("f16", "f32"), ("bf16", "f32")}
    if not differentiable and needs_graph(x):
        raise GradientCastUnsupported(
            f"to: a tensor that requires grad casts only f32 -> f32/f16/bf16 or f16/bf16 -> f32, "
            f"got {r.dtype} -> {dtype}; expected .detach() or fu.no_grad() for this cast")
    out = ew.cast(r.ctx, r, dtype)
    if not differentiable:
        return out, x.tags, None
    return finish_op("to", out, x.tags, (x,), lambda needs: lambda g: (g,), dtypes_ok=True)


def view(name: str, x, raw, tags, grad_of):
    """A view op (narrow, permute, contiguous): grad_of(g) maps the gradient back."""
    return finish_op(name, raw, tags, (x,), lambda needs: lambda g: (grad_of(g),))


def aligned(op: str, x, y):
    """A-2: result tags and shape, and both operands viewed at that shape (zero strides)."""
    a, b = x._raw, y._raw
    if x.tags == y.tags and a.shape == b.shape:
        return x.tags, a.shape, a, b
    tags, shape, lmap, rmap = axes.pointwise(op, x.tags, a.shape, y.tags, b.shape)
    return (tags, shape, a.view(shape, axes.aligned_strides(lmap, shape, a.shape, a.strides)),
            b.view(shape, axes.aligned_strides(rmap, shape, b.shape, b.strides)))


# (op, layout, other layout | reflected, tags, other tags | scalar type) ->
# (out layout, out tags, kernel, chunks, cost, argument tail, aligned layout of each operand or None)
_PLANS: dict = {}


class ElementwiseMethods:
    """Tensor methods of the elementwise family (SPEC §3.1–§3.3, R-10 casts)."""

    __slots__ = ()

    # ---- pointwise binary (A-2 broadcasting by name) ----
    def _binary(self, op: str, other, reflected: bool = False):
        """The per-op fast path: a remembered plan for these interned layouts and tags, then
        alloc + launch (+ a node when an operand requires grad, + adoption under a scope).
        Everything that can fail was checked when the plan was made (in _binary_slow)."""
        a = self._raw
        if a is None:
            return self._binary_slow(op, other, reflected)
        ctx = a.ctx
        if type(other) is type(self):
            b = other._raw
            p = _PLANS.get((op, a.lay, None if b is None else b.lay, self.tags, other.tags))
            if p is None or b.ctx is not ctx or ctx.closed:
                return self._binary_slow(op, other, reflected)
            lay, tags, addr, nch, cost, tail, la, lb, size, keep = p
            out = RawTensor(ctx.pool.alloc(size, lay.dtype == "f32"), lay, 0, ctx)
            ctx.launch(addr, nch, cost, out.addr, a.addr, b.addr, *tail)
            na, nb = self._node, other._node
            node = None
            if (na is not None or nb is not None) and not engine._mode.disabled:
                if lay.dtype != "f32":
                    return self._binary_slow(op, other, reflected)
                needs = (na is not None, nb is not None)
                kx, ky, ko = keep[needs]
                va = None if not kx else a if la is None else RawTensor(a.buf, la, a.offset, ctx)
                vb = None if not ky else b if lb is None else RawTensor(b.buf, lb, b.offset, ctx)
                saved = (op, ctx, tags, lay.shape, va, vb, out if ko else None, self.tags,
                         a.lay.shape, other.tags, b.lay.shape)
                node = engine.Node(op, (na, nb), functools.partial(binary_grads, saved, needs))
        elif type(other) is float or type(other) is int:
            p = _PLANS.get((op, a.lay, reflected, self.tags, type(other)))
            if p is None or ctx.closed or (self._node is not None and not engine._mode.disabled):
                return self._binary_slow(op, other, reflected)
            lay, tags, addr, nch, cost, tail, _, _, size, _ = p
            bits = ew.cached_f32_bits(other) if lay.dtype != "i64" else other & 0xFFFFFFFFFFFFFFFF
            out = RawTensor(ctx.pool.alloc(size, lay.dtype == "f32"), lay, 0, ctx)
            x, y = (bits, a.addr) if reflected else (a.addr, bits)
            ctx.launch(addr, nch, cost, out.addr, x, y, *tail)
            node = None
        else:
            return self._binary_slow(op, other, reflected)
        t = type(self)(out, tags, node)
        if ctx.adopting and (node is not None or lay.dtype == "f32"):
            t._scope = ctx.scopes[-1]
            ctx.adopt(t)
        return t

    def _binary_slow(self, op: str, other, reflected: bool):
        """Validate, run (recording a node if needed), and remember the plan for the fast path."""
        a = self._live(op)
        if isinstance(other, type(self)):
            b = other._live(op)
            if b.ctx is not a.ctx:
                raise ContextMismatch(f"{op}: operands belong to two different ExecContexts")
            tags, shape, va, vb = aligned(op, self, other)
            out, tags, node = binary(op, self, other, tags, shape, va, vb)
            addr, nch, cost, tail = ew.plan_of(op, out.dtype, shape, (va, vb))
            _PLANS[(op, a.lay, b.lay, self.tags, other.tags)] = (
                out.lay, tags, addr, nch, cost, tail, None if va is a else va.lay,
                None if vb is b else vb.lay, max(out.lay.nbytes, 64),
                {n: keeps(op, n) for n in ((True, True), (True, False), (False, True))})
            return self._result(out, tags, node)
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            if a.dtype == "i64" and not isinstance(other, numbers.Integral):
                raise DTypeError(f"{op}: expected an integer scalar for an i64 tensor, got {other!r}")
            out, tags, node = with_scalar(op, self, other, reflected)
            if type(other) in (float, int):
                operands = (other, a) if reflected else (a, other)
                addr, nch, cost, tail = ew.plan_of(op, out.dtype, a.shape, operands)
                _PLANS[(op, a.lay, reflected, self.tags, type(other))] = (
                    out.lay, tags, addr, nch, cost, tail, None, None, max(out.lay.nbytes, 64),
                    None)
            return self._result(out, tags, node)
        raise InvalidArgumentType(f"{op}: expected a Tensor or a real number as the other operand, "
                        f"got {type(other).__name__}")

    def add(self, other):
        return self._binary("add", other)

    def sub(self, other):
        return self._binary("sub", other)

    def mul(self, other):
        return self._binary("mul", other)

    def div(self, other):
        return self._binary("div", other)

    def maximum(self, other):
        return self._binary("maximum", other)

    def minimum(self, other):
        return self._binary("minimum", other)

    def pow(self, other):
        return self._binary("pow", other)

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = div
    __pow__ = pow

    def __radd__(self, other):
        return self._binary("add", other, reflected=True)

    def __rsub__(self, other):
        return self._binary("sub", other, reflected=True)

    def __rmul__(self, other):
        return self._binary("mul", other, reflected=True)

    def __rtruediv__(self, other):
        return self._binary("div", other, reflected=True)

    def __rpow__(self, other):
        return self._binary("pow", other, reflected=True)

    def __neg__(self):
        return self.neg()

    # ---- scalar variants (SPEC §3.2) ----
    def scale(self, s: float):
        return self._binary("mul", real("scale", s))

    def add_scalar(self, s: float):
        return self._binary("add", real("add_scalar", s))

    def sub_scalar(self, s: float):
        return self._binary("add", -real("sub_scalar", s))

    def div_scalar(self, s: float):
        """scale(1/s) with 1/s computed in float32, as the reference does."""
        return self._binary("mul", float(np.float32(1.0) / np.float32(real("div_scalar", s))))

    def pow_scalar(self, e: float):
        return self._binary("pow", real("pow_scalar", e))

    def to(self, dtype: str):
        """A copy in `dtype` (SPEC R-10): any pair of f32/f16/bf16/i64/bool; f32 <-> f16/bf16
        and f32 -> f32 are differentiable."""
        r = self._live("to")
        if dtype in BLOCKS or r.dtype in BLOCKS:  # quantize / dequantize (SPEC R-9)
            return block_cast(self, dtype)
        return self._result(*cast(self, check_dtype(dtype, "to")))
