"""Indexing, assembly and functional updates (SPEC §3.16), with their backward rules.

Every op returns a new tensor; narrow, select and step-1 slice are views of the source's
storage, everything else is a copy. Index-driven ops go through exec/gather_scatter.py (one
generated kernel family; puts and gather backwards accumulate duplicates in serial index order,
bitwise for any thread count); range-driven ones (concat, pad, roll, flip, set_slice ...) are
strided copies. Backward rules follow the SPEC table: a gather's gradient is a scatter-add of g
into zeros, a put's source gets g gathered at its indices (every writer of a slot receives that
slot's g, SPEC §7.1 item 2), overwritten or zeroed positions pass 0 to self.
"""
from __future__ import annotations

import functools
import itertools
import numbers
from dataclasses import dataclass

import numpy as np

from .. import axes
from ..errors import (DTypeError, EmptySelection, IndexOutOfBounds, InvalidArgumentType,
                      InvalidShape, ShapeMismatch, TagError, UnsupportedGradient)
from ..exec import elementwise as ew
from ..exec import gather_scatter as gs
from ..exec import reduce as red
from ..exec.raw import MAX_RANK, contiguous_layout
from .checks import real, require_scope, same_ctx
from .elementwise import view
from .engine import finish_op

__all__ = ["SliceRange", "concat", "stack"]


@dataclass(frozen=True)
class SliceRange:
    """numpy basic slicing along one axis: start (negative counts from the end), end (None =
    the axis size), step > 0. Out-of-range bounds clamp; an empty range gives an empty axis."""

    start: int | None = 0
    end: int | None = None
    step: int = 1


# ---------------------------------------------------------------------------------------------
# operand checks

def _int(op: str, what: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an integer {what}, got {v!r}")
    return int(v)


def _window(op: str, tag: str, dim: int, start: int, length: int) -> None:
    """A range [start, start + length) of an axis (empty allowed): InvalidShape when negative
    or past the axis (a single out-of-range index is IndexOutOfBounds instead)."""
    if length < 0:
        raise InvalidShape(f"{op}: expected length >= 0 along {tag!r}, got {length}")
    if start < 0 or start + length > dim:
        raise InvalidShape(f"{op}: range [{start}, {start + length}) does not fit axis {tag!r} of "
                           f"size {dim}; expected 0 <= start and start + length <= {dim}")


def _fill_value(op: str, dtype: str, fill):
    """A pad value for `dtype`: an integer for i64, a bool or number (its truthiness) for bool,
    a real number (rounded when stored) for the float dtypes."""
    if dtype == "i64":
        return _int(op, "fill", fill)
    if dtype == "bool":
        return bool(fill) if isinstance(fill, bool) else real(op, fill) != 0
    return real(op, fill)


def _is_tensor(x) -> bool:
    return isinstance(x, GatherScatterMethods)


def _index_tensor(op: str, x, t, what: str = "indices"):
    same_ctx(op, x, t)
    r = t._live(op)
    if r.dtype != "i64":
        raise DTypeError(f"{op}: expected i64 {what}, got {r.dtype}")
    return r


def _selector(op: str, x, indices):
    """index_select's indices (a rank-1 i64 tensor of x's context) checked one by one."""
    x._live(op)
    if not _is_tensor(indices):
        raise InvalidArgumentType(f"{op}: expected an i64 Tensor of indices, got {type(indices).__name__}")
    idx = _index_tensor(op, x, indices)
    if len(idx.shape) != 1:
        raise InvalidShape(f"{op}: expected rank-1 indices, got shape {idx.shape}")
    return idx


def _rows_index(op: str, x, indices):
    """Host indices (list, tuple, range, integer ndarray) or a rank-1 i64 tensor -> i64 [J]."""
    if _is_tensor(indices):
        r = _index_tensor(op, x, indices)
        if r.rank != 1:
            raise InvalidShape(f"{op}: expected rank-1 indices, got shape {r.shape}")
        return r
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise InvalidShape(f"{op}: expected a flat sequence of indices, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidShape(f"{op}: expected at least one index, got none (zero-size tensors are not representable)")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{op}: expected integer indices, got {arr.dtype}")
    return x._raw.ctx.from_numpy(arr.astype(np.int64, copy=False), (arr.size,), "i64", op)


def _like(op: str, x, other, what: str, ax: int | None):
    """other's raw in x's axis order (same tag set); every axis but `ax` of x's size.
    Returns (view, back): g.permute(back) maps a gradient in x's order to other's (back is
    None when the orders already agree)."""
    same_ctx(op, x, other)
    r = other._live(op)
    back = None
    if other.tags != x.tags:
        if set(other.tags) != set(x.tags) or len(other.tags) != len(x.tags):
            raise TagError(f"{op}: expected {what} with the tags {x.tags}, got {other.tags}")
        r = r.permute([other.tags.index(t) for t in x.tags])
        back = [x.tags.index(t) for t in other.tags]
    xs, vs = x._raw.shape, r.shape
    if vs != xs:
        for k, t in enumerate(x.tags):
            if k != ax and vs[k] != xs[k]:
                raise ShapeMismatch(f"{op}: expected {what} of size {xs[k]} along {t!r} (self's), got {vs[k]}")
    return r, back


def _same_dtype(op: str, what: str, a, b) -> None:
    if a.dtype != b.dtype:
        raise DTypeError(f"{op}: expected {what} of dtype {a.dtype} (self's), got {b.dtype}")


def _where(tag: str) -> str:
    return f"axis {tag!r}"


def _back(g, back):
    return g if back is None else g.permute(back)


# ---------------------------------------------------------------------------------------------
# shared bodies

_gather_tags: dict = {}  # (tags, tag, out_tag) -> (axis, result tags, where): resolved once


def _plan_for(plans: dict, key):
    """plans[key], or None when absent or the key is unhashable (a tag that is no string:
    the checks then raise TagError)."""
    try:
        return plans.get(key)
    except TypeError:
        return None


def _gather(op: str, x, tag: str, idx, out_tag: str, rows: bool):
    r = x._live(op)
    ctx = r.ctx
    k = (x.tags, tag, out_tag)
    t = _plan_for(_gather_tags, k)
    if t is None:
        ax = axes.axis_of(x.tags, tag, op)
        tags = x.tags
        if out_tag != tag:
            tags = axes.check_tags(x.tags[:ax] + (out_tag,) + x.tags[ax + 1:], r.rank, op)
        t = _gather_tags[k] = (ax, tags, _where(tag))
    ax, tags, where = t
    out = gs.gather(ctx, r, ax, idx, rows=rows, op=op, where=where)
    if x._node is None:  # no graph to record (the common inference path): skip the closures
        return out, tags, None
    shape = r.shape

    def vjp(needs):
        def run(g):
            gx = gs.zeros(ctx, shape)
            gs.put(ctx, gx, ax, idx, g, "add", rows=rows, op=op + " backward", where=where)
            return (gx,)
        return run
    return finish_op(op, out, tags, (x,), vjp)


def _put(op: str, x, tag: str, idx, src, mode: str, rows: bool):
    """self with rows (rows=True) or elements at idx along tag overwritten / added / zeroed."""
    r = x._live(op)
    ctx = r.ctx
    ax = axes.axis_of(x.tags, tag, op)
    sv, back = (None, None)
    if src is not None:
        sv, back = _like(op, x, src, "the source", ax)
        _same_dtype(op, "the source", r, sv)
        if rows and sv.shape[ax] != idx.shape[0]:
            raise InvalidShape(f"{op}: expected the update to have {idx.shape[0]} positions along "
                               f"{tag!r} (one per index), got {sv.shape[ax]}")
        if not rows and sv.shape != idx.shape:
            raise ShapeMismatch(f"{op}: expected indices shaped like src {sv.shape} (in self's "
                                f"axis order), got {idx.shape}")
    if mode == "add" and r.dtype not in gs.ADD_DTYPES:
        raise DTypeError(f"{op}: expected an f32 or i64 tensor, got {r.dtype}")
    out = gs.copy(ctx, r)
    gs.put(ctx, out, ax, idx, sv, mode, rows=rows, op=op, where=_where(tag))
    where = _where(tag)

    def vjp(needs):
        def run(g):
            gx = gsrc = None
            if needs[0]:
                if mode == "add":
                    gx = g
                else:  # overwritten or zeroed positions pass nothing back to self
                    gx = gs.copy(ctx, g)
                    gs.put(ctx, gx, ax, idx, None, "zero", rows=rows, op=op + " backward", where=where)
            if len(needs) > 1 and needs[1]:  # every writer receives its slot's gradient
                gsrc = _back(gs.gather(ctx, g, ax, idx, rows=rows, op=op + " backward", where=where), back)
            return (gx, gsrc)
        return run
    return finish_op(op, out, x.tags, (x,) if src is None else (x, src), vjp)


def _window_grad(ctx, shape, ax: int, start: int, g):
    """zeros of `shape` with g in positions [start, start + len) of axis ax."""
    n = g.shape[ax]
    return gs.assemble(ctx, shape, "f32", ax, [(0.0, start), (g, n), (0.0, shape[ax] - start - n)])


# concat and stack: every check, the result's layout and the join's launch depend only on the
# call's arguments and the operands' tags and layouts, so they are worked out once per such
# combination (_assembly_plan); a repeated call only looks its plan up, allocates and launches.

_assemblies: dict = {}  # (op, arguments, operand tags and layouts...) -> plan


def _assembly_plan(ax: int, tags, shape, views, backs, squeeze: bool):
    """views[k]: operand k's layout seen in the result's axis order and rank; backs[k]: the
    permutation taking a gradient back to operand k's own order (None: same order); squeeze:
    the joined axis is new (stack), dropped from each gradient window."""
    out = contiguous_layout(views[0].dtype, shape)
    ns = tuple(v.shape[ax] for v in views)
    return ax, tags, out, tuple(views), gs.join_plan(out, ax, views), ns, tuple(backs), squeeze


def _assembled(head: tuple, tensors, plan_of, scoped: bool = False):
    """One node for concat/stack (head: the op's name and arguments): the plan for this call,
    the join, and the gradient rule (operand k gets its window of g). plan_of(head, tensors)
    checks the operands and builds the plan on a miss. scoped: composed in the reference, so
    an exec scope is required under gradients."""
    x = tensors[0]
    r = x._raw
    ctx = None if r is None or r.ctx.closed else r.ctx
    cls = type(x)
    key, raws, graph = list(head), [], False
    for t in tensors:
        r = t._raw
        if ctx is None or type(t) is not cls or r is None or r.ctx is not ctx:
            key = None  # released, closed, of another type or context: plan_of raises
            break
        key += (t.tags, r.lay)
        raws.append(r)
        graph = graph or t._node is not None
    else:
        key = tuple(key)
    plan = _plan_for(_assemblies, key)
    if plan is None:
        plan = plan_of(head, tensors)
        if key is not None:
            _assemblies[key] = plan
    op = head[0]
    if scoped:
        require_scope(op, *tensors)
    ax, tags, out, views, join, ns, _, _ = plan
    if join:  # the views share their operands' addresses
        res = gs.join(ctx, join, raws)
    else:
        res = gs.assemble(ctx, out.shape, out.dtype, ax,
                          [(r.view(v.shape, v.strides), n) for r, v, n in zip(raws, views, ns)])
    if not graph:  # no operand requires grad: nothing to record (finish_op would agree)
        return res, tags, None
    return finish_op(op, res, tags, tensors, functools.partial(_assembly_vjp, plan))


def _assembly_vjp(plan, needs):
    ax, _, _, _, _, ns, backs, squeeze = plan
    offs = itertools.accumulate(ns, initial=0)

    def window(g, off, n, back):
        w = g.narrow(ax, off, n)
        if squeeze:
            w = w.view(w.shape[:ax] + w.shape[ax + 1:], w.strides[:ax] + w.strides[ax + 1:])
        return _back(w, back)

    def run(g):
        return tuple(window(g, off, n, back) if need else None
                     for need, off, n, back in zip(needs, offs, ns, backs))
    return run


def _concat_plan(head, tensors):
    op, tag = head
    x = tensors[0]
    r = x._live(op)
    ax = axes.axis_of(x.tags, tag, op)
    views, backs = [], []
    for t in tensors:
        v, back = _like(op, x, t, "operands", ax)
        _same_dtype(op, "operands", r, v)
        views.append(v.lay)
        backs.append(back)
    shape = r.shape[:ax] + (sum(v.shape[ax] for v in views),) + r.shape[ax + 1:]
    return _assembly_plan(ax, x.tags, shape, views, backs, False)


def _stack_plan(head, tensors):
    op, new_tag, k = head
    x = tensors[0]
    r = x._live(op)
    if not 0 <= k <= r.rank:
        raise IndexOutOfBounds(f"{op}: expected 0 <= axis_index <= {r.rank}, got {k}")
    if r.rank + 1 > MAX_RANK:
        raise InvalidShape(f"{op}: the result would have rank {r.rank + 1} > {MAX_RANK}")
    tags = axes.check_tags(x.tags[:k] + (new_tag,) + x.tags[k:], r.rank + 1, op)
    views, backs = [], []
    for t in tensors:
        v, back = _like(op, x, t, "operands", None)
        _same_dtype(op, "operands", r, v)
        views.append(v.view(v.shape[:k] + (1,) + v.shape[k:], v.strides[:k] + (0,) + v.strides[k:]).lay)
        backs.append(back)
    shape = r.shape[:k] + (len(tensors),) + r.shape[k:]
    return _assembly_plan(k, tags, shape, views, backs, True)


def _stack(new_tag: str, axis_index, tensors):
    op = "stack"
    tensors[0]._live(op)
    return _assembled((op, new_tag, _int(op, "axis_index", axis_index)), tensors, _stack_plan, True)


def _operands(op: str, tensors):
    """The operand tuple of concat/stack: tensors given inline or as one list/tuple."""
    if len(tensors) == 2 and isinstance(tensors[1], (list, tuple)) and _is_tensor(tensors[0]):
        tensors = (tensors[0], *tensors[1])  # method form x.concat(tag, [b, c])
    elif len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if not tensors:
        raise InvalidArgumentType(f"{op}: expected at least one tensor")
    for t in tensors:
        if not isinstance(t, GatherScatterMethods):
            raise InvalidArgumentType(f"{op}: expected Tensor operands, got {type(t).__name__}")
    return tuple(tensors)  # contexts are checked operand by operand (_like)


def concat(tag: str, *tensors):
    """`fu.concat(tag, a, b, ...)`: join along the existing axis `tag` (one node, grad to all)."""
    tensors = _operands("concat", tensors)
    return tensors[0]._result(*_assembled(("concat", tag), tensors, _concat_plan))


def stack(new_tag: str, axis_index: int, *tensors):
    """`fu.stack(new_tag, axis_index, a, b, ...)`: join along a new axis at axis_index."""
    tensors = _operands("stack", tensors)
    return tensors[0]._result(*_stack(new_tag, axis_index, tensors))


def _select(x, tag: str, index):
    """(view, tags, node) of select(); the method adopts it, unbind_into hands it to the caller."""
    op = "select"
    a = x._live(op)
    ax = axes.axis_of(x.tags, tag, op)
    n = a.shape[ax]
    i = _int(op, "index", index)
    if not -n <= i < n:
        raise IndexOutOfBounds(f"{op}: index {i} is out of range for axis {tag!r} of size {n}; "
                               f"expected {-n} <= index < {n}")
    i %= n
    require_scope(op, x)
    v = a.view(a.shape[:ax] + a.shape[ax + 1:], a.strides[:ax] + a.strides[ax + 1:],
               a.offset + i * a.strides[ax])
    ctx, shape = a.ctx, a.shape

    def grad_of(g):
        g1 = g.view(g.shape[:ax] + (1,) + g.shape[ax:], g.strides[:ax] + (0,) + g.strides[ax:])
        return _window_grad(ctx, shape, ax, i, g1)
    return view(op, x, v, x.tags[:ax] + x.tags[ax + 1:], grad_of)


# ---------------------------------------------------------------------------------------------

class GatherScatterMethods:
    """Tensor methods of the indexing family (SPEC §3.16)."""

    __slots__ = ()

    # ---- gathers ----
    def gather(self, tag: str, indices, out_tag: str):
        """Rows of axis `tag` at host `indices` (list / ndarray / i64 tensor); the axis becomes
        `out_tag` of size len(indices). Grad: scatter-add (duplicates accumulate)."""
        op = "gather"
        self._live(op)
        return self._result(*_gather(op, self, tag, _rows_index(op, self, indices), out_tag, True))

    def index_select(self, tag: str, indices, out_tag: str):
        """gather() through a rank-1 i64 tensor; negative indices are out of range."""
        op = "index_select"
        r, idx = self._raw, getattr(indices, "_raw", None)
        if (type(indices) is not type(self) or r is None or idx is None or idx.ctx is not r.ctx
                or r.ctx.closed or idx.lay.dtype != "i64" or len(idx.lay.shape) != 1):
            idx = _selector(op, self, indices)  # the checks in order: one of them raises
        return self._result(*_gather(op, self, tag, idx, out_tag, True))

    def take_along_axis(self, tag: str, indices):
        """out[.., i, ..] = self[.., indices[.., i, ..], ..] along `tag`; indices: i64 with
        self's tags, self's sizes off `tag`. The result has self's tags and indices' sizes."""
        op = "take_along_axis"
        self._live(op)
        if not _is_tensor(indices):
            raise InvalidArgumentType(f"{op}: expected an i64 Tensor of indices, got {type(indices).__name__}")
        ax = axes.axis_of(self.tags, tag, op)
        idx, _ = _like(op, self, indices, "indices", ax)
        _index_tensor(op, self, indices)
        return self._result(*_gather(op, self, tag, idx, tag, False))

    # ---- views ----
    def narrow(self, tag: str, start: int, length: int):
        """A view of `length` positions of axis `tag` from `start` (shares storage)."""
        op = "narrow"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        start, length = _int(op, "start", start), _int(op, "length", length)
        _window(op, tag, a.shape[ax], start, length)
        ctx, shape = a.ctx, a.shape
        return self._result(*view(op, self, a.narrow(ax, start, length), self.tags,
                                  lambda g: _window_grad(ctx, shape, ax, start, g)))

    def select(self, tag: str, index: int):
        """The position `index` of axis `tag` (negative counts from the end), axis removed; a
        view. Composed in the reference: needs an exec scope under gradients."""
        return self._result(*_select(self, tag, index))

    def slice(self, **ranges):
        """numpy basic slicing per tag: `x.slice(row=SliceRange(1, None), col=slice(1, -1))`.
        Steps > 0; all steps 1 gives a view, otherwise a copy. Under gradients, more than one
        sliced axis needs an exec scope (composed in the reference)."""
        op = "slice"
        a = self._live(op)
        if not ranges:
            raise InvalidArgumentType(f"{op}: expected at least one tag=SliceRange(...) argument")
        shape, starts, steps = list(a.shape), [0] * a.rank, [1] * a.rank
        for tag, rg in ranges.items():
            ax = axes.axis_of(self.tags, tag, op)
            if isinstance(rg, SliceRange):
                rg = slice(rg.start, rg.end, rg.step)
            if not isinstance(rg, slice):
                raise InvalidArgumentType(f"{op}: expected a SliceRange for {tag!r}, got {type(rg).__name__}")
            for what in ("start", "stop", "step"):
                if getattr(rg, what) is not None:
                    _int(op, what, getattr(rg, what))
            if rg.step is not None and rg.step <= 0:
                raise InvalidShape(f"{op}: expected a positive step for {tag!r}, got {rg.step}")
            lo, hi, step = rg.indices(a.shape[ax])
            n = len(range(lo, hi, step))
            shape[ax], starts[ax], steps[ax] = n, lo, step
        if len(ranges) > 1:
            require_scope(op, self)
        ctx, full = a.ctx, a.shape

        def window(r):  # the sliced positions of a tensor shaped like self
            return r.view(shape, [s * k for s, k in zip(r.strides, steps)],
                          r.offset + sum(s * k for s, k in zip(r.strides, starts)))

        def grad_of(g):
            gx = gs.zeros(ctx, full)
            gs.copy_into(ctx, window(gx), g)
            return gx
        v = window(a)
        out = v if all(k == 1 for k in steps) else gs.copy(ctx, v)
        return self._result(*view(op, self, out, self.tags, grad_of))

    # ---- assembly ----
    def pad(self, tag: str, before: int, after: int, fill: float = 0.0):
        """`before` and `after` positions of value `fill` around axis `tag` (a copy); the
        border's gradient is dropped."""
        op = "pad"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        before, after = _int(op, "before", before), _int(op, "after", after)
        if before < 0 or after < 0:
            raise InvalidShape(f"{op}: expected before >= 0 and after >= 0, got {before}, {after}")
        value = _fill_value(op, a.dtype, fill)
        n = a.shape[ax]
        shape = a.shape[:ax] + (before + n + after,) + a.shape[ax + 1:]
        out = gs.assemble(a.ctx, shape, a.dtype, ax, [(value, before), (a, n), (value, after)])

        def vjp(needs):
            return lambda g: (g.narrow(ax, before, n),)
        return self._result(*finish_op(op, out, self.tags, (self,), vjp))

    def concat(self, tag: str, *others):
        """self followed by others along the existing axis `tag` (others: tensors with self's
        tags, in any order, and self's sizes off `tag`). One node; gradient to all."""
        return self._result(*_assembled(("concat", tag), _operands("concat", (self, *others)), _concat_plan))

    def stack(self, new_tag: str, axis_index: int, *others):
        """self and others (same tags and sizes) along a new axis `new_tag` inserted at
        position axis_index. Needs an exec scope under gradients (composed in the reference)."""
        return self._result(*_stack(new_tag, axis_index, _operands("stack", (self, *others))))

    def unbind_into(self, tag: str, out_list: list):
        """Fill `out_list` (empty, or of length dim(tag)) with the views select(tag, i); the
        caller owns each. Needs an exec scope under gradients. Returns out_list."""
        op = "unbind_into"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        n = a.shape[ax]
        if not isinstance(out_list, list):
            raise InvalidArgumentType(f"{op}: expected a list to fill, got {type(out_list).__name__}")
        if len(out_list) not in (0, n):
            raise ShapeMismatch(f"{op}: expected an empty list or one of length {n} (dim of {tag!r}), "
                                f"got length {len(out_list)}")
        require_scope(op, self)
        out_list[:] = [type(self)(*_select(self, tag, i)) for i in range(n)]  # caller-owned
        return out_list

    def flip(self, tag: str):
        """Axis `tag` reversed (a copy); gradient: g flipped back."""
        op = "flip"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        out = gs.copy(a.ctx, gs.reversed_view(a, ax))
        ctx = a.ctx

        def vjp(needs):
            return lambda g: (gs.copy(ctx, gs.reversed_view(g, ax)),)
        return self._result(*finish_op(op, out, self.tags, (self,), vjp))

    def roll(self, tag: str, shift: int):
        """out[i] = self[(i - shift) mod n] along `tag`; gradient: g rolled by -shift."""
        op = "roll"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        shift = _int(op, "shift", shift)
        out = _rolled(a, ax, shift)

        def vjp(needs):
            return lambda g: (_rolled(g, ax, -shift),)
        return self._result(*finish_op(op, out, self.tags, (self,), vjp))

    def repeat_axis(self, tag: str, n: int):
        """Axis `tag` tiled n times (n == 1: an identity view); gradient: the copies summed."""
        op = "repeat_axis"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        n = _int(op, "n", n)
        if n < 1:
            raise InvalidShape(f"{op}: expected n >= 1 copies, got {n}")
        if n == 1:
            return self._result(*view(op, self, a, self.tags, lambda g: g))
        d = a.shape[ax]
        shape = a.shape[:ax] + (n * d,) + a.shape[ax + 1:]
        ctx = a.ctx
        out = ctx.empty(shape, a.dtype)
        src = a.view(a.shape[:ax] + (n,) + a.shape[ax:], a.strides[:ax] + (0,) + a.strides[ax:])
        gs.copy_into(ctx, gs.split_view(out, ax, n), src)

        def vjp(needs):
            return lambda g: (red.reduce_axis(ctx, "sum", gs.split_view(ew.materialize(ctx, g), ax, n), ax),)
        return self._result(*finish_op(op, out, self.tags, (self,), vjp))

    # ---- functional updates ----
    def set_slice(self, tag: str, start: int, update):
        """A copy of self with positions [start, start + len) of `tag` replaced by `update`
        (self's tags, self's sizes off `tag`). Grads: self 0 in the range, update its window."""
        op = "set_slice"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        start = _int(op, "start", start)
        u, back = _like(op, self, update, "the update", ax)
        _same_dtype(op, "the update", a, u)
        n, L = a.shape[ax], u.shape[ax]
        _window(op, tag, n, start, L)
        ctx = a.ctx
        out = gs.assemble(ctx, a.shape, a.dtype, ax, _spliced(a, ax, start, L, u))

        def vjp(needs):
            def run(g):
                gx = gs.assemble(ctx, g.shape, "f32", ax, _spliced(g, ax, start, L, 0.0)) if needs[0] else None
                gu = _back(g.narrow(ax, start, L), back) if needs[1] else None
                return gx, gu
            return run
        return self._result(*finish_op(op, out, self.tags, (self, update), vjp))

    def zero_slice(self, tag: str, start: int, length: int):
        """A copy of self with positions [start, start + length) of `tag` set to 0."""
        op = "zero_slice"
        a = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        start, length = _int(op, "start", start), _int(op, "length", length)
        _window(op, tag, a.shape[ax], start, length)
        ctx = a.ctx
        out = gs.assemble(ctx, a.shape, a.dtype, ax, _spliced(a, ax, start, length, 0))

        def vjp(needs):
            return lambda g: (gs.assemble(ctx, g.shape, "f32", ax, _spliced(g, ax, start, length, 0.0)),)
        return self._result(*finish_op(op, out, self.tags, (self,), vjp))

    def set_rows(self, tag: str, indices, update):
        """A copy of self with rows `indices` of `tag` overwritten by the update's rows (in
        order: with duplicates the later one stays, SPEC O-11)."""
        op = "set_rows"
        self._live(op)
        return self._result(*_put(op, self, tag, _rows_index(op, self, indices), update, "store", True))

    def zero_rows(self, tag: str, indices):
        """A copy of self with rows `indices` of `tag` set to 0."""
        op = "zero_rows"
        self._live(op)
        return self._result(*_put(op, self, tag, _rows_index(op, self, indices), None, "zero", True))

    def index_add(self, tag: str, indices, update):
        """A copy of self with the update's rows added at rows `indices` of `tag` (duplicates
        accumulate in index order). Grads: self g, update g's rows at indices."""
        op = "index_add"
        self._live(op)
        return self._result(*_put(op, self, tag, _rows_index(op, self, indices), update, "add", True))

    def scatter_add(self, tag: str, indices, src):
        """A copy of self with src[.., j, ..] added at [.., indices[.., j, ..], ..] along `tag`
        (indices i64 shaped like src); duplicates accumulate in row-major order."""
        return self._result(*_scatter("scatter_add", self, tag, indices, src, "add"))

    def scatter(self, tag: str, indices, src):
        """As scatter_add but overwriting; duplicates keep the last write in row-major order
        (SPEC §7.1 item 2). Grads: self 0 at written slots, each writer its slot's g."""
        return self._result(*_scatter("scatter", self, tag, indices, src, "store"))

    # ---- selection by mask ----
    def masked_select(self, mask, out_tag: str):
        """Rank-1 tensor of the elements where `mask` (self's tags and sizes, not requiring
        grad) is nonzero, in row-major order; nothing selected -> EmptySelection. Needs an exec
        scope under gradients (composed in the reference)."""
        op = "masked_select"
        a = self._live(op)
        if not _is_tensor(mask):
            raise InvalidArgumentType(f"{op}: expected a mask Tensor, got {type(mask).__name__}")
        m, _ = _like(op, self, mask, "a mask", None)
        if mask.requires_grad:
            raise UnsupportedGradient(f"{op}: expected a mask that does not require grad")
        axes.check_tags((out_tag,), 1, op)
        require_scope(op, self)
        ctx = a.ctx
        m = ew.materialize(ctx, m)
        offsets, total = gs.mask_offsets(ctx, m)
        if total == 0:
            raise EmptySelection(f"{op}: the mask selects no element; expected at least one "
                                 f"(zero-size tensors are not representable)")
        out = gs.compact(ctx, "select", m, ew.materialize(ctx, a), offsets, total)

        def vjp(needs):
            return lambda g: (gs.expand(ctx, m, g, offsets),)
        return self._result(*finish_op(op, out, (out_tag,), (self,), vjp))

    def nonzero(self) -> list:
        """Row-major flat indices of the nonzero elements (NaN counts), as a host list."""
        op = "nonzero"
        a = self._live(op)
        ctx = a.ctx
        m = ew.materialize(ctx, a)
        offsets, total = gs.mask_offsets(ctx, m)
        if total == 0:
            return []
        return gs.compact(ctx, "positions", m, None, offsets, total).to_numpy().tolist()


def _spliced(r, ax: int, start: int, length: int, middle):
    """Pieces for assemble(): r before the range, `middle` (a view or a fill value), r after."""
    n = r.shape[ax]
    end = start + length
    return [(r.narrow(ax, 0, start) if start else None, start), (middle, length),
            (r.narrow(ax, end, n - end) if end < n else None, n - end)]


def _rolled(r, ax: int, shift: int):
    n = r.shape[ax]
    s = shift % n
    if s == 0:
        return gs.copy(r.ctx, r)
    return gs.assemble(r.ctx, r.shape, r.dtype, ax, [(r.narrow(ax, n - s, s), s), (r.narrow(ax, 0, n - s), n - s)])


def _scatter(op: str, x, tag: str, indices, src, mode: str):
    x._live(op)
    if not _is_tensor(indices):
        raise InvalidArgumentType(f"{op}: expected an i64 Tensor of indices, got {type(indices).__name__}")
    ax = axes.axis_of(x.tags, tag, op)
    _index_tensor(op, x, indices)
    if not _is_tensor(src):
        raise InvalidArgumentType(f"{op}: expected a src Tensor, got {type(src).__name__}")
    idx, _ = _like(op, x, indices, "indices", ax)
    return _put(op, x, tag, idx, src, mode, False)
