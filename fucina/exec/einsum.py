"""The one contraction engine: every dot, einsum and their backward passes lower to a batched
GEMM here (matmul.gemm), by viewing each operand as [batch..., rows, k] without copying when
its strides allow, and copying into that order only when they do not.
"""
from __future__ import annotations

import functools

from ..errors import ShapeMismatch, TagError
from . import elementwise as ew
from . import reduce as red
from .matmul import gemm
from .raw import MAX_RANK, RawTensor


class Roles:
    """A-5: what each tag of a binary contraction is (lists in the order the lowering uses)."""

    __slots__ = ("batch", "contract", "lfree", "rfree", "lsum", "rsum", "sizes", "out")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


@functools.lru_cache(maxsize=4096)
def einsum_roles(op: str, ltags: tuple, lshape: tuple, rtags: tuple, rshape: tuple,
                 out_tags: tuple) -> Roles:
    """Roles by membership: shared+kept = batch, shared+dropped = contraction, private+kept =
    free, private+dropped = summed away first. Result order is exactly out_tags."""
    out_tags = tuple(out_tags)
    for t in out_tags:
        if not isinstance(t, str):
            raise TagError(f"{op}: expected output tags to be strings, got {t!r}")
    if len(set(out_tags)) != len(out_tags):
        raise TagError(f"{op}: expected unique output tags, got {out_tags}")
    for t in out_tags:
        if t not in ltags and t not in rtags:
            raise TagError(f"{op}: output tag {t!r} is in neither operand ({ltags} and {rtags})")
    if len(out_tags) > MAX_RANK:
        raise TagError(f"{op}: result would have rank {len(out_tags)} > {MAX_RANK}")
    sizes = dict(zip(rtags, rshape))
    for t, d in zip(ltags, lshape):
        if t in sizes and sizes[t] != d:
            raise ShapeMismatch(f"{op}: axis {t!r} has size {d} in the left operand and {sizes[t]} "
                                f"in the right; expected equal sizes")
        sizes[t] = d
    kept = set(out_tags)
    return Roles(
        batch=[t for t in out_tags if t in ltags and t in rtags],
        contract=[t for t in ltags if t in rtags and t not in kept],
        lfree=[t for t in out_tags if t in ltags and t not in rtags],
        rfree=[t for t in out_tags if t in rtags and t not in ltags],
        lsum=[t for t in ltags if t not in rtags and t not in kept],
        rsum=[t for t in rtags if t not in ltags and t not in kept],
        sizes=sizes, out=out_tags)


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
    r = einsum_roles("einsum", xtags, x.shape, ytags, y.shape, tuple(out_tags))
    if r.lsum:
        x, xtags = _sum_away(ctx, x, xtags, r.lsum)
    if r.rsum:
        y, ytags = _sum_away(ctx, y, ytags, r.rsum)
    natural = tuple(r.batch) + tuple(r.lfree) + tuple(r.rfree)
    swapped = tuple(r.batch) + tuple(r.rfree) + tuple(r.lfree)
    if r.out != natural and r.out == swapped and y.dtype == "f32":  # C^T = B^T A^T lands in out
        # order directly (gemm widens 16-bit operands only on its right side)
        x, xtags, y, ytags = y, ytags, x, xtags
        r = einsum_roles("einsum", xtags, x.shape, ytags, y.shape, r.out)
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
