"""Elementwise ops with their backward rules (SPEC §3.1–§3.3): forward through the exec
layer, then one finish_op tail that records the VJP when an operand requires grad."""
from __future__ import annotations

import functools

from .. import axes
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..errors import GradientCastUnsupported
from .engine import finish_op, needs_graph


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
    saved = (op, ctx, tags, shape, vx, vy, out, x.tags, x._raw.shape, y.tags, y._raw.shape)
    return finish_op(op, out, tags, (x, y), lambda needs: functools.partial(binary_grads, saved, needs))


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


def with_scalar(op: str, x, s: float, reflected: bool):
    """x op s (or s op x when reflected); the scalar is a by-value kernel parameter."""
    r = x._raw
    ctx = r.ctx
    dtype = ew.compute_dtype_of(op, (r.dtype,))
    operands = (s, r) if reflected else (r, s)
    out = ew.run(ctx, op, dtype, r.shape, operands)

    def vjp(needs):
        def run(g):
            if op == "add":
                return (g,)
            if op == "sub":
                return (ew.run(ctx, "neg", "f32", r.shape, (g,)) if reflected else g,)
            if op == "mul":
                return (ew.run(ctx, "mul", "f32", r.shape, (g, s)),)
            if op == "div":
                if reflected:  # d(s/x) = -s/x^2
                    return (ew.run(ctx, "div_grad_b", "f32", r.shape, (g, s, r)),)
                return (ew.run(ctx, "div", "f32", r.shape, (g, s)),)
            if op == "pow":
                if reflected:  # d(s^x) = ln(s) s^x
                    return (ew.run(ctx, "pow_grad_exp", "f32", r.shape, (g, s, out)),)
                return (ew.run(ctx, "pow_grad_base", "f32", r.shape, (g, r, s)),)
            if op in ("maximum", "minimum"):  # symmetric: a tie splits g/2 either way
                return (ew.run(ctx, op + "_grad", "f32", r.shape, (g, r, s)),)
            raise AssertionError(f"{op} has no scalar backward rule")
        return run

    return finish_op(op, out, x.tags, (x,), vjp)


# unary op -> (backward kernel, reads the forward "x" or output "y"); None = a plain kernel below
_UNARY_GRAD = {
    "relu": ("relu_grad", "x"), "tanh": ("tanh_grad", "y"), "sigmoid": ("sigmoid_grad", "y"),
    "sqrt": ("sqrt_grad", "y"), "exp": ("mul", "y"), "log": ("div", "x"), "neg": None,
}


def unary(op: str, x):
    r = x._raw
    ctx = r.ctx
    dtype = ew.compute_dtype_of(op, (r.dtype,))
    out = ew.run(ctx, op, dtype, r.shape, (r,))

    def vjp(needs):
        def run(g):
            rule = _UNARY_GRAD[op]
            if rule is None:
                return (ew.run(ctx, "neg", "f32", r.shape, (g,)),)
            kernel, reads = rule
            return (ew.run(ctx, kernel, "f32", r.shape, (g, r if reads == "x" else out)),)
        return run

    return finish_op(op, out, x.tags, (x,), vjp)


def cast(x, dtype: str):
    """to(dtype): a copy; f32 <-> f16/bf16 is differentiable (identity on the f32 gradient)."""
    r = x._raw
    if dtype not in ("f32", "f16", "bf16") and needs_graph(x):
        raise GradientCastUnsupported(
            f"to: a tensor that requires grad casts only to f32/f16/bf16, got {r.dtype} -> {dtype}")
    out = ew.cast(r.ctx, r, dtype)
    if dtype not in ("f32", "f16", "bf16"):
        return finish_op("to", out, x.tags, (), None)
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
