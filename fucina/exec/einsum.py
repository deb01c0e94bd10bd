"""The one contraction engine: every dot, einsum and their backward passes lower to a batched
GEMM here (matmul.gemm), by viewing each operand as [batch..., rows, k] without copying when
its strides allow, and copying into that order only when they do not.
"""
from __future__ import annotations

import functools
import math

from ..errors import ShapeMismatch, TagError
from . import elementwise as ew
from . import reduce as red
from .matmul import gemm
from .raw import MAX_RANK, RawTensor, contiguous_strides

SKINNY = 16   # an output side this small (and the other 8x wider) is not made the GEMM's N


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


def _grouping(shape, strides, tags, groups):
    """(shape, strides) of one axis per group of tags (a batch tag stays its own axis), or None
    when some group's strides do not chain."""
    out_shape, out_strides = [], []
    for g in groups:
        if isinstance(g, str):
            i = tags.index(g)
            out_shape.append(shape[i])
            out_strides.append(strides[i])
            continue
        idx = [tags.index(t) for t in g]
        m = _merge([shape[i] for i in idx], [strides[i] for i in idx])
        if m is None:
            return None
        out_shape.append(m[0])
        out_strides.append(m[1])
    return tuple(out_shape), tuple(out_strides)


class _Side:
    """How one operand becomes [batch..., G1, G2]: a view (perm None), or a copy into the axis
    order `perm` first, then a view of that contiguous copy."""

    __slots__ = ("perm", "shape", "strides")

    def __init__(self, shape, strides, tags, groups):
        self.perm = None
        v = _grouping(shape, strides, tags, groups)
        if v is None:
            order = [t for g in groups for t in ([g] if isinstance(g, str) else g)]
            self.perm = [tags.index(t) for t in order]
            v = _grouping(tuple(shape[p] for p in self.perm), _contig([shape[p] for p in self.perm]),
                          tuple(order), groups)
        self.shape, self.strides = v

    def apply(self, ctx, x):
        if self.perm is not None:
            x = ew.materialize(ctx, x.permute(self.perm))
        return x.view(self.shape, self.strides)


class _Plan:
    """Everything einsum decides from tags, shapes and strides alone (cached: a training step
    repeats the same few contractions): operand swap, both sides' views, the result's shape and
    the permutation into out_tags order (None when the GEMM lands in it directly)."""

    __slots__ = ("swap", "x", "y", "full", "perm")


@functools.lru_cache(maxsize=4096)
def _plan(xtags, xshape, xstrides, ytags, yshape, ystrides, ydtype, out_tags):
    r = einsum_roles("einsum", xtags, xshape, ytags, yshape, out_tags)
    if r.lsum or r.rsum:
        return None  # private dropped axes are summed away first: the general path
    p = _Plan()
    natural = tuple(r.batch) + tuple(r.lfree) + tuple(r.rfree)
    swapped = tuple(r.batch) + tuple(r.rfree) + tuple(r.lfree)
    lm = math.prod(r.sizes[t] for t in r.lfree)
    rn = math.prod(r.sizes[t] for t in r.rfree)
    # C^T = B^T A^T lands in out order directly (gemm widens 16-bit operands only on its right
    # side) — unless that leaves the GEMM a handful of columns against many rows (a LoRA
    # weight's gradient, [out, r] = gᵀ·u): then the wide product and a copy of its small result
    p.swap = (r.out != natural and r.out == swapped and ydtype == "f32"
              and not (lm <= SKINNY and rn >= 8 * SKINNY))
    if p.swap:
        xtags, xshape, xstrides, ytags, yshape, ystrides = ytags, yshape, ystrides, xtags, xshape, xstrides
        r = einsum_roles("einsum", xtags, xshape, ytags, yshape, r.out)
        natural = swapped
    b = list(r.batch)
    p.x = _Side(xshape, xstrides, xtags, b + [tuple(r.lfree), tuple(r.contract)])
    p.y = _Side(yshape, ystrides, ytags, b + [tuple(r.contract), tuple(r.rfree)])
    p.full = tuple(r.sizes[t] for t in natural)
    p.perm = None if r.out == natural else [natural.index(t) for t in r.out]
    return p


def _sum_away(ctx, x, tags, drop):
    """Sum the private dropped axes first (innermost first)."""
    tags = list(tags)
    for t in sorted(drop, key=tags.index, reverse=True):
        i = tags.index(t)
        x = red.reduce_axis(ctx, "sum", x, i)
        tags.pop(i)
    return x, tuple(tags)


def einsum(ctx, x: RawTensor, xtags: tuple, y: RawTensor, ytags: tuple, out_tags: tuple,
           out: RawTensor | None = None, accumulate: bool = False,
           scale: float = 1.0, rank_add=None) -> RawTensor:
    """result[out_tags] = sum over the other tags of x * y (A-5), contiguous in out_tags order.
    With out= (contiguous, out_tags order) and accumulate=True: out += x.y. scale (an f32
    value): the sums are rounded as scale·sum first (matmul.gemm's scale). rank_add (u [R, r],
    v [r, C], s): then result += s·(u·v) over the result viewed as [R, C] (C its last axis),
    exactly as a gemm(u, v, accumulate=True, scale=s) after it — in the GEMM's tile stores when
    the product lands in out_tags order as a 2-D GEMM (matmul.gemm's rank_add)."""
    out_tags = tuple(out_tags)
    if rank_add is not None:
        res = _einsum_ranked(ctx, x, xtags, y, ytags, out_tags, out, accumulate, scale, rank_add)
        if res is not None:
            return res
        res = einsum(ctx, x, xtags, y, ytags, out_tags, out, accumulate, scale)
        u, v, s = rank_add
        gemm(ctx, u, v, out=res.view((u.shape[0], v.shape[1]), (v.shape[1], 1), res.offset),
             accumulate=True, scale=s)
        return res
    p = _plan(xtags, x.shape, x.strides, ytags, y.shape, y.strides, y.dtype, out_tags)
    if p is None:
        r = einsum_roles("einsum", xtags, x.shape, ytags, y.shape, out_tags)
        x, xtags = _sum_away(ctx, x, xtags, r.lsum)
        y, ytags = _sum_away(ctx, y, ytags, r.rsum)
        return einsum(ctx, x, xtags, y, ytags, out_tags, out, accumulate, scale)
    if p.swap:
        x, y = y, x
    xv, yv = p.x.apply(ctx, x), p.y.apply(ctx, y)
    full = p.full
    if p.perm is None:
        target = None if out is None else out.view(xv.shape[:-1] + yv.shape[-1:],
                                                   _contig(xv.shape[:-1] + yv.shape[-1:]))
        c = gemm(ctx, xv, yv, target, accumulate, scale)
        return c.view(full, _contig(full)) if out is None else out
    c = gemm(ctx, xv, yv, scale=scale)
    shaped = c.view(full, _contig(full)).permute(p.perm)
    if out is None:
        return ew.materialize(ctx, shaped)
    if accumulate:
        return ew.run(ctx, "add", "f32", out.shape, (out, shaped), out=out)
    return ew.run(ctx, "copy", "f32", out.shape, (shaped,), out=out)


def _einsum_ranked(ctx, x, xtags, y, ytags, out_tags, out, accumulate, scale, rank_add):
    """einsum with rank_add in one GEMM, or None when the product is not one 2-D GEMM landing
    in out_tags order."""
    p = _plan(xtags, x.shape, x.strides, ytags, y.shape, y.strides, y.dtype, out_tags)
    if p is None or p.swap or p.perm is not None or len(p.full) != 2:
        return None
    xv, yv = p.x.apply(ctx, x), p.y.apply(ctx, y)
    target = None if out is None else out.view(p.full, _contig(p.full), out.offset)
    c = gemm(ctx, xv, yv, target, accumulate, scale, rank_add=rank_add)
    return c if out is None else out


def _contig(shape):
    return contiguous_strides(tuple(shape))
