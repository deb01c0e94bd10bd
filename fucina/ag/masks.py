"""Masks and conditionals with their backward rules (SPEC §3.7)."""
from __future__ import annotations

import functools

from ..errors import DTypeError, ShapeMismatch
from ..exec import elementwise as ew
from .checks import same_ctx
from .engine import finish_op


def where(x, cond, other):
    """cond ? x : other elementwise; all three the same tags and shape; grad to x and other."""
    a, c, o = x._raw, cond._raw, other._raw
    if not (x.tags == cond.tags == other.tags and a.shape == c.shape == o.shape):
        raise ShapeMismatch(f"where: expected self, cond and other with equal tags and shapes, got "
                            f"{x.tags}{a.shape}, {cond.tags}{c.shape}, {other.tags}{o.shape}")
    if a.dtype != o.dtype:
        raise DTypeError(f"where: expected self and other of one dtype, got {a.dtype} and {o.dtype}")
    out = ew.run(a.ctx, "where", a.dtype, a.shape, (c, a, o))
    saved = (a.ctx, c, a.shape)
    return finish_op("where", out, x.tags, (x, other), lambda needs: functools.partial(_where_grads, saved, needs))


def _where_grads(saved, needs, g):
    ctx, c, shape = saved
    return (ew.run(ctx, "where", "f32", shape, (c, g, 0.0)) if needs[0] else None,
            ew.run(ctx, "where", "f32", shape, (c, 0.0, g)) if needs[1] else None)


class MaskMethods:
    """Tensor methods of the mask family."""

    __slots__ = ()

    def where(self, cond, other):
        """`cond ? self : other` (SPEC §3.7); cond is a bool mask or a float read by truthiness."""
        self._live("where")
        same_ctx("where", self, cond)
        same_ctx("where", self, other)
        return self._result(*where(self, cond, other))
