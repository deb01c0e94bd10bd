"""Selection (SPEC §3.15): argmax, top_k, sort / argsort, router_top_k; the module also exports
the MoE expert FFN entries of ag/moe.py (SPEC §3.17).

Index outputs are i64 constants: caller-owned even under an exec scope (Tensor._result adopts
only f32 or grad-carrying results), so under a scope `top_k(...).values` is a borrow and
`top_k(...).indices` is not (SPEC R-5). top_k and sort values are differentiable: the
gradient scatters back through the saved indices (added in slot order). The NaN rules are the
reference's, not torch's (SPEC §7.1): NaN never wins argmax and never enters top_k; sort puts
NaN last in either direction.
"""
from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

from .. import axes
from ..errors import (DTypeError, InvalidArgumentType, InvalidDataLength, TagError,
                      UnsupportedGradient)
from ..exec import selection as xs
from .engine import finish_op
from .moe import moe_expert_ffn, moe_expert_ffn_batch

__all__ = ["TopKResult", "moe_expert_ffn", "moe_expert_ffn_batch"]

FLOATS = ("f32", "f16", "bf16")


class TopKResult(NamedTuple):
    """(values, indices) of top_k / sort; `release()` frees both (the reference's one deinit)."""

    values: object
    indices: object

    def release(self) -> None:
        self.values.release()
        self.indices.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _floats(op: str, r) -> None:
    if r.dtype not in FLOATS:
        raise DTypeError(f"{op}: expected a float tensor (f32, f16, bf16), got {r.dtype}")


def _k(op: str, k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an integer k, got {k!r}")
    return int(k)


def _flag(op: str, name: str, v) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentType(f"{op}: expected {name} to be a bool, got {v!r}")
    return v


def _replaced(op: str, tags: tuple, ax: int, out_tag) -> tuple:
    """tags with tags[ax] renamed out_tag (which may equal it, but no other tag)."""
    if not isinstance(out_tag, str):
        raise TagError(f"{op}: expected out_tag to be a string, got {out_tag!r}")
    if out_tag != tags[ax] and out_tag in tags:
        raise TagError(f"{op}: out_tag {out_tag!r} is already an axis of {tags}")
    return tags[:ax] + (out_tag,) + tags[ax + 1:]


def _pair(op: str, x, values, indices, tags, ax: int, n: int) -> TopKResult:
    """Values with the scatter-back rule (f32 grads only, via finish_op) + constant indices."""
    ctx = values.ctx

    def vjp(needs):
        return functools.partial(_scatter_back, ctx, indices, ax, n)

    v = x._result(*finish_op(op, values, tags, (x,), vjp))
    return TopKResult(v, x._result(indices, tags))


def _scatter_back(ctx, indices, ax, n, g):
    return (xs.select_grad(ctx, g, indices, ax, n),)


class SelectionMethods:
    """Tensor methods of the selection family (SPEC §3.15)."""

    __slots__ = ()

    def argmax(self, tag: str):
        """i64 index of the first maximum along `tag` (tag removed); NaN never wins; a row whose
        maximum is -inf gives its first -inf; an all-NaN row gives 0. No gradient."""
        op = "argmax"
        r = self._live(op)
        ax, tags = axes.reduced(self.tags, tag, op)
        _floats(op, r)
        return self._result(xs.argmax(r.ctx, r, ax), tags)

    def top_k(self, tag: str, k: int, out_tag: str) -> TopKResult:
        """The k largest along `tag`, descending, as (values, i64 indices) with `tag` renamed
        `out_tag` (size k). Ties keep the lower index first; NaN and -inf never enter, and
        slots left unfilled hold (-inf, 0). k == 0: InvalidShape; k > dim: IndexOutOfBounds.
        Values are differentiable (the gradient scatters back through the indices)."""
        op = "top_k"
        r = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        tags = _replaced(op, self.tags, ax, out_tag)
        _floats(op, r)
        k = _k(op, k)
        n = r.shape[ax]
        xs.check_k(op, k, n, tag)
        values, indices = xs.top_k(r.ctx, r, ax, k)
        return _pair(op, self, values, indices, tags, ax, n)

    def sort(self, tag: str, descending: bool = False) -> TopKResult:
        """Sorted values along `tag` and the source index of each (i64); NaN last in either
        direction; equal values in no promised order. Values are differentiable."""
        op = "sort"
        r = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        _floats(op, r)
        values, indices = xs.sort(r.ctx, r, ax, _flag(op, "descending", descending))
        return _pair(op, self, values, indices, self.tags, ax, r.shape[ax])

    def argsort(self, tag: str, descending: bool = False):
        """The indices arm of sort alone (i64, no gradient)."""
        op = "argsort"
        r = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        _floats(op, r)
        _, indices = xs.sort(r.ctx, r, ax, _flag(op, "descending", descending))
        return self._result(indices, self.tags)

    def router_top_k(self, expert_tag: str, k: int, selected, weights, normalize_selected: bool = True) -> None:
        """MoE router over rank-2 [row, expert] f32 logits (expert last): per row the top k by
        logit (ties: lower index), their softmax weights over the full row, renormalized to sum
        1 when normalize_selected. Fills the caller's `selected` (ints) and `weights` (floats),
        each of length rows * k, row-major. No gradient (UnsupportedGradient)."""
        op = "router_top_k"
        r = self._live(op)
        if r.rank != 2 or self.tags[1] != expert_tag:
            raise TagError(f"{op}: expected rank-2 [row, expert] logits with {expert_tag!r} last, "
                           f"got tags {self.tags}")
        if self.requires_grad:
            raise UnsupportedGradient(f"{op}: no gradient; expected logits that do not require grad "
                                      f"(detach() them)")
        if r.dtype != "f32":
            raise DTypeError(f"{op}: expected f32 logits, got {r.dtype}")
        k = _k(op, k)
        R, E = r.shape
        xs.check_k(op, k, E, expert_tag)
        for name, out in (("selected", selected), ("weights", weights)):
            if not (hasattr(out, "__len__") and hasattr(out, "__setitem__")):
                raise InvalidArgumentType(f"{op}: expected {name} to be a mutable sequence (list or numpy "
                                f"array), got {type(out).__name__}")
            if len(out) != R * k:
                raise InvalidDataLength(f"{op}: expected {name} of length rows * k = {R * k}, "
                                        f"got {len(out)}")
        sel, w = xs.router_top_k(r.ctx, r, k, _flag(op, "normalize_selected", normalize_selected))
        selected[:] = sel.to_numpy().reshape(-1).tolist()
        weights[:] = w.to_numpy().reshape(-1).tolist()
