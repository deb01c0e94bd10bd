"""`fu.custom_vjp` (SPEC §3.21): a user-defined op with a user-defined backward.

The spec's forward and backward work on Tensors (computed without recording a graph); the
node keeps the inputs, the output and `extra` (by reference: what it points to must outlive
backward)."""
from __future__ import annotations

import functools

from ..errors import DTypeError, InvalidArgumentType, MissingBackwardGradient, ShapeMismatch
from .engine import finish_op, no_grad


def custom_vjp(spec, extra, inputs):
    """spec.Output (result tags), spec.forward(ctx, extra, inputs) -> Tensor and
    spec.backward(ctx, extra, inputs, output, gy, needs_grad, out) filling out[i] for each
    needs_grad[i]. Returns (raw, tags, node) for Tensor._result."""
    for member in ("Output", "forward", "backward"):
        if not hasattr(spec, member):
            raise InvalidArgumentType(f"custom_vjp: spec must define {member!r}; {type(spec).__name__} does not")
    inputs = list(inputs)
    if not inputs:
        raise InvalidArgumentType("custom_vjp: expected at least one input tensor")
    for i, t in enumerate(inputs):
        if t._live("custom_vjp").dtype != "f32":
            raise DTypeError(f"custom_vjp: input {i}: expected f32, got {t._raw.dtype}")
    ctx = inputs[0]._raw.ctx
    tags = tuple(spec.Output)
    plain = [t.detach() for t in inputs]
    with no_grad():
        y = spec.forward(ctx, extra, plain)
    if not hasattr(y, "tags") or y.tags != tags:
        raise ShapeMismatch(f"custom_vjp: forward must return a tensor tagged {tags}, "
                            f"got {getattr(y, 'tags', type(y).__name__)}")
    out = y._live("custom_vjp")
    saved = (spec, extra, plain, y.detach(), ctx, tags)
    return finish_op("custom_vjp", out, tags, inputs,
                     lambda needs: functools.partial(_grads, saved, needs))


def _grads(saved, needs, g):
    from .tensor import Tensor

    spec, extra, inputs, y, ctx, tags = saved
    out = [None] * len(inputs)
    with no_grad():
        spec.backward(ctx, extra, inputs, y, Tensor(g, tags), list(needs), out)
    raws = []
    for i, (need, x, gx) in enumerate(zip(needs, inputs, out)):
        if not need:
            raws.append(None)
            continue
        if gx is None:
            raise MissingBackwardGradient(f"custom_vjp: backward left out[{i}] empty; expected the "
                                          f"gradient of input {i} {x.tags}")
        if gx.tags != x.tags or gx.shape != x.shape:
            raise ShapeMismatch(f"custom_vjp: out[{i}]: expected tags {x.tags} shape {x.shape}, "
                                f"got tags {gx.tags} shape {gx.shape}")
        r = gx._live("custom_vjp backward")
        raws.append(r if r.dtype == "f32" else None)
    return tuple(raws)
