"""Reductions with their backward rules (SPEC §3.8): sum/mean broadcast the gradient back,
max/min send it to the first occurrence of the extremum."""
from __future__ import annotations

import numpy as np

from ..exec import elementwise as ew
from ..exec import reduce as red
from .. import axes
from .engine import finish_op


def _spread(g, shape, axis):
    """A view of g (shape without `axis`) broadcast back over `axis` (stride 0)."""
    strides = list(g.strides)
    strides.insert(axis, 0)
    return g.view(shape, strides)


def reduce_axis(op: str, x, axis: int, tags, mean: bool = False):
    r = x._raw
    ctx = r.ctx
    out = red.reduce_axis(ctx, op, r, axis, mean)
    shape, n = r.shape, r.shape[axis]

    def vjp(needs):
        def run(g):
            gx = _spread(g, shape, axis)
            if op == "sum":
                return (ew.run(ctx, "div", "f32", shape, (gx, float(n))) if mean else gx,)
            idx = red.arg_extreme(ctx, op, r, axis)
            pos = ctx.from_numpy(np.arange(n, dtype=np.int64), (n,), "i64", "backward")
            pstrides = [0] * len(shape)
            pstrides[axis] = 1
            return (ew.run(ctx, "pick", "f32", shape,
                           (gx, _spread(idx, shape, axis), pos.view(shape, pstrides))),)
        return run

    return finish_op("mean" if mean else op, out, tags, (x,), vjp)


def reduce_all(op: str, x, mean: bool = False):
    r = x._raw
    ctx = r.ctx
    out = red.reduce_all(ctx, op, r, mean)
    shape, n = r.shape, r.numel

    def vjp(needs):
        def run(g):
            gx = g.view(shape, (0,) * len(shape))
            return (ew.run(ctx, "div", "f32", shape, (gx, float(n))) if mean else gx,)
        return run

    return finish_op("mean_all" if mean else "sum_all", out, (), (x,), vjp)


class ReduceMethods:
    """Tensor methods of the reduction family (SPEC §3.8, A-3)."""

    __slots__ = ()

    # ---- reductions (A-3) ----
    def _reduce(self, op: str, tag: str, mean: bool = False):
        name = "mean" if mean else op
        self._live(name)
        ax, tags = axes.reduced(self.tags, tag, name)
        return self._result(*reduce_axis(op, self, ax, tags, mean))

    def sum(self, tag: str):
        return self._reduce("sum", tag)

    def mean(self, tag: str):
        return self._reduce("sum", tag, mean=True)

    def max(self, tag: str):
        return self._reduce("max", tag)

    def min(self, tag: str):
        return self._reduce("min", tag)

    def sum_all(self):
        self._live("sum_all")
        return self._result(*reduce_all("sum", self))

    def mean_all(self):
        self._live("mean_all")
        return self._result(*reduce_all("sum", self, mean=True))
