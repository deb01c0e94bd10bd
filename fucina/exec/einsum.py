"""The one contraction engine: every dot, einsum and their backward passes lower to a batched
GEMM here (matmul.gemm), by viewing each operand as [batch..., rows, k] without copying when
its strides allow, and copying into that order only when they do not.
"""
from __future__ import annotations

from .. import axes
from . import elementwise as ew
from . import reduce as red
from .matmul import gemm
from .raw import RawTensor


def _merge(shape, strides):
    """(size, stride) of several axes walked as one, or None if their strides do not chain."""
    size, stride = 1, None
    for d, s in zip(reversed(shape), reversed(strides)):
        if d == 1:
            continue
        if stride is None:
            stride = s
        elif s != stride * size:
            return None
        size *= d
    return size, (stride if stride is not None else 0)


def _group_view(x: RawTensor, tags: tuple, groups):
    """View x as one axis per group of tags (batch tags stay separate axes). Returns the view
    or None when some group's strides do not chain."""
    shape, strides = [], []
    for g in groups:
        if isinstance(g, str):  # a batch tag: its own axis
            i = tags.index(g)
            shape.append(x.shape[i])
            strides.append(x.strides[i])
            continue
        idx = [tags.index(t) for t in g]
        m = _merge([x.shape[i] for i in idx], [x.strides[i] for i in idx])
        if m is None:
            return None
        shape.append(m[0])
        strides.append(m[1])
    return x.view(shape, strides)


def _operand(ctx, x, tags, groups):
    """x as [batch..., G1, G2] per `groups`, copying into that axis order if it must."""
    v = _group_view(x, tags, groups)
    if v is not None:
        return v
    order = [t for g in groups for t in ([g] if isinstance(g, str) else g)]
    xp = ew.materialize(ctx, x.permute([tags.index(t) for t in order]))
    return _group_view(xp, tuple(order), groups)


def _sum_away(ctx, x, tags, drop):
    """Sum the private dropped axes first (innermost first)."""
    tags = list(tags)
    for t in sorted(drop, key=tags.index, reverse=True):
        i = tags.index(t)
        x = red.reduce_axis(ctx, "sum", x, i)
        tags.pop(i)
    return x, tuple(tags)


def einsum(ctx, x: RawTensor, xtags: tuple, y: RawTensor, ytags: tuple, out_tags: tuple,
           out: RawTensor | None = None, accumulate: bool = False) -> RawTensor:
    """result[out_tags] = sum over the other tags of x * y (A-5), contiguous in out_tags order.
    With out= (contiguous, out_tags order) and accumulate=True: out += x.y."""
    r = axes.einsum_roles("einsum", xtags, x.shape, ytags, y.shape, tuple(out_tags))
    if r.lsum:
        x, xtags = _sum_away(ctx, x, xtags, r.lsum)
    if r.rsum:
        y, ytags = _sum_away(ctx, y, ytags, r.rsum)
    natural = tuple(r.batch) + tuple(r.lfree) + tuple(r.rfree)
    swapped = tuple(r.batch) + tuple(r.rfree) + tuple(r.lfree)
    if r.out != natural and r.out == swapped:  # C^T = B^T A^T lands in out order directly
        x, xtags, y, ytags = y, ytags, x, xtags
        r = axes.einsum_roles("einsum", xtags, x.shape, ytags, y.shape, r.out)
        natural = swapped
    b = list(r.batch)
    xv = _operand(ctx, x, xtags, b + [tuple(r.lfree), tuple(r.contract)])
    yv = _operand(ctx, y, ytags, b + [tuple(r.contract), tuple(r.rfree)])
    full = tuple(r.sizes[t] for t in natural)
    if r.out == natural:
        target = None if out is None else out.view(xv.shape[:-1] + yv.shape[-1:],
                                                   _contig(xv.shape[:-1] + yv.shape[-1:]))
        c = gemm(ctx, xv, yv, target, accumulate)
        return c.view(full, _contig(full)) if out is None else out
    c = gemm(ctx, xv, yv)
    c = c.view(full, _contig(full))
    perm = [natural.index(t) for t in r.out]
    shaped = c.permute(perm)
    if out is None:
        return ew.materialize(ctx, shaped)
    if accumulate:
        return ew.run(ctx, "add", "f32", out.shape, (out, shaped), out=out)
    return ew.run(ctx, "copy", "f32", out.shape, (shaped,), out=out)


def _contig(shape):
    from .raw import contiguous_strides

    return contiguous_strides(tuple(shape))
