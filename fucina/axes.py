"""Pure named-axis algebra (SPEC A-1…A-3): result tags and how operands line up with them.

Nothing here touches data; every function raises TagError or ShapeMismatch before any
computation happens.
"""
from __future__ import annotations

import functools

from .errors import ShapeMismatch, TagError
from .exec.raw import MAX_RANK


def check_tags(tags, rank: int, op: str) -> tuple:
    """Tags must be unique strings, one per axis."""
    tags = tuple(tags)
    if len(tags) != rank:
        raise TagError(f"{op}: expected {rank} tags for a rank-{rank} tensor, got {len(tags)}: {tags}")
    for t in tags:
        if not isinstance(t, str):
            raise TagError(f"{op}: expected tags to be strings, got {t!r}")
    if len(set(tags)) != len(tags):
        dup = sorted({t for t in tags if tags.count(t) > 1})
        raise TagError(f"{op}: expected unique tags, got duplicate {dup} in {tags}")
    return tags


def axis_of(tags: tuple, tag: str, op: str) -> int:
    try:
        return tags.index(tag)
    except ValueError:
        raise TagError(f"{op}: tag {tag!r} is not an axis of the operand; its tags are {tags}") from None


@functools.lru_cache(maxsize=4096)
def pointwise(op: str, ltags: tuple, lshape: tuple, rtags: tuple, rshape: tuple):
    """A-2: result tags = left's, then right's new ones; per shared tag equal sizes or one is 1.

    Returns (tags, shape, lmap, rmap): for each result axis the operand's axis index or -1.
    """
    out_tags = ltags + tuple(t for t in rtags if t not in ltags)
    if len(out_tags) > MAX_RANK:
        raise TagError(f"{op}: result would have rank {len(out_tags)} > {MAX_RANK}: {out_tags}")
    lmap = tuple(ltags.index(t) if t in ltags else -1 for t in out_tags)
    rmap = tuple(rtags.index(t) if t in rtags else -1 for t in out_tags)
    shape = []
    for t, li, ri in zip(out_tags, lmap, rmap):
        ld = lshape[li] if li >= 0 else 1
        rd = rshape[ri] if ri >= 0 else 1
        if ld != rd and ld != 1 and rd != 1:
            raise ShapeMismatch(f"{op}: axis {t!r} has size {ld} in the left operand and {rd} in the right; "
                                f"expected equal sizes or 1")
        shape.append(ld if rd == 1 else rd)  # not max: a 0 broadcasts against 1 to 0
    return out_tags, tuple(shape), lmap, rmap


def aligned_strides(amap: tuple, shape: tuple, ashape: tuple, astrides: tuple) -> tuple:
    """The operand's strides viewed at the result shape: 0 where it lacks the axis or has size 1."""
    return tuple(0 if i < 0 or ashape[i] != d else astrides[i] for i, d in zip(amap, shape))


def reduced(tags: tuple, tag: str, op: str) -> tuple[int, tuple]:
    """A-3: the axis index of `tag` and the result tags without it."""
    ax = axis_of(tags, tag, op)
    return ax, tags[:ax] + tags[ax + 1:]


def dot_tags(op: str, ltags: tuple, lshape: tuple, rtags: tuple, rshape: tuple, tag: str) -> tuple:
    """A-4: contract `tag` (in both, equal sizes); other shared tags are batch (equal sizes,
    no broadcasting). Result: batch (left order) + left free + right free."""
    if tag not in ltags or tag not in rtags:
        where = "left" if tag not in ltags else "right"
        raise TagError(f"{op}: contraction tag {tag!r} is not an axis of the {where} operand "
                       f"({ltags if where == 'left' else rtags})")
    rsize = dict(zip(rtags, rshape))
    for t, d in zip(ltags, lshape):
        if t in rsize and rsize[t] != d:
            role = "contraction" if t == tag else "batch"
            raise ShapeMismatch(f"{op}: {role} axis {t!r} has size {d} in the left operand and "
                                f"{rsize[t]} in the right; expected equal sizes")
    batch = tuple(t for t in ltags if t in rtags and t != tag)
    return (batch + tuple(t for t in ltags if t not in rtags)
            + tuple(t for t in rtags if t not in ltags))
