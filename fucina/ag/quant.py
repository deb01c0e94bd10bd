"""Ops on block-quantized tensors (SPEC R-9, A-8, §3.16, T-24): the frozen quantized weight of
`dot`, `get_rows` (embedding lookup: gather + dequantize) and the row-axis `concat`.

    y = x.dot(w_q, "in")                 # w_q [out, in] quantized; gradient to x only
    e = emb_q.get_rows("vocab", ids, "seq")
    w = w1_q.concat("out", w2_q)         # same dtype, same inner dim; bytes copied

A quantized tensor is a frozen constant: it never carries a gradient, so `dot` records a
backward for x alone, dx = g · dequant(w) (w decoded at backward time, then the f32 GEMM).
"""
from __future__ import annotations

import functools

import numpy as np

from .. import axes
from ..errors import (DTypeError, GradientQuantizedMatmulUnsupported, IndexOutOfBounds,
                      InvalidArgumentType, InvalidShape, ShapeMismatch, TagError,
                      UnsupportedGradient)
from ..exec import elementwise as ew
from ..exec import quant as xq
from ..exec.dtypes import BLOCKS
from ..exec.matmul import gemm
from ..exec.raw import contiguous_strides
from .checks import same_ctx
from .engine import finish_op, needs_graph


# ---------------------------------------------------------------------------------------------
# dot with a quantized right operand (SPEC A-8)

def refuse_einsum(op: str, y) -> None:
    """einsum (and einsum_many, built on it) takes no quantized right operand: SPEC A-8 says
    TagError, use dot. (A quantized left operand fails einsum's f32 dtype check.)"""
    if y._raw.dtype in BLOCKS:
        raise TagError(f"{op}: the right operand is a {y._raw.dtype} (block-quantized) tensor; "
                       f"expected f32/f16/bf16 — a quantized weight contracts only through dot, "
                       f"x.dot(w, tag), with w stored [free, contract]")


_dots: dict = {}


def quantized_dot(x, w, tag: str):
    """x.dot(w, tag) for a block-quantized w: (raw, tags, node). w must be rank 2 stored
    [free, contract] (the contraction along its blocks) with its free tag absent from x (no
    batch tags); x is f32 of any rank. Result tags: x's tags without `tag`, then w's free tag.
    What the tags and layouts decide (the checks, the axis order, the rows view, the result's
    shape and tags) is remembered per (tags, layouts, tag): a decode step's ~200 dots each
    cost a lookup, not the checks (12.5 -> ~5 µs a call at one token)."""
    op = "dot"
    xr, wr = x._raw, w._raw
    rows, (perm, _, oshape, ostrides, tags) = _dot_plan(op, x, w, tag)
    out = xq.matmul(xr.ctx, rows, wr).view(oshape, ostrides)
    saved = (xr.ctx, wr, perm, xr.shape)
    return finish_op(op, out, tags, (x,), lambda needs: functools.partial(_dx, saved))


def _dot_plan(op, x, w, tag):
    """(x's rows [M, K] with unit stride along K, (perm, the rows' view of x or None, the
    result's shape, strides and tags)) of x.dot(w, tag), checked on the first call for its
    key and remembered (_dots)."""
    xr, wr = x._raw, w._raw
    key = (x.tags, xr.lay, w.tags, wr.lay, tag)
    hit = _dots.get(key)
    if hit is None or needs_graph(w):
        free, perm = _check_dot(op, x, w, tag)
        rows = _rows(xr.ctx, xr.permute(perm))
        view = (rows.shape, rows.strides) if rows.buf is xr.buf else None
        lead = tuple(xr.shape[i] for i in perm[:-1])
        oshape = lead + (wr.shape[0],)
        tags = tuple(x.tags[i] for i in perm[:-1]) + (free,)
        _dots[key] = hit = (perm, view, oshape, contiguous_strides(oshape), tags)
        return rows, hit
    perm, view = hit[:2]
    return (xr.view(*view) if view is not None else _rows(xr.ctx, xr.permute(perm))), hit


def _check_dot(op, x, w, tag):
    """The checks of a quantized dot; (w's free tag, x's axes with `tag` moved last)."""
    xr, wr = x._raw, w._raw
    if needs_graph(w):
        raise GradientQuantizedMatmulUnsupported(
            f"{op}: the {wr.dtype} right operand requires grad; a block-quantized weight is "
            f"frozen (gradient flows to the left operand only), expected a constant")
    if tag in w.tags and (wr.rank != 2 or w.tags[1] != tag):
        raise TagError(f"{op}: a {wr.dtype} right operand must be stored [free, contract] = "
                       f"[out, {tag!r}] (blocks run along the contraction); got tags {w.tags}")
    free = w.tags[0]
    if free in x.tags and free != tag:
        raise TagError(f"{op}: a {wr.dtype} right operand takes no batch tags; its free tag "
                       f"{free!r} is also an axis of the left operand {x.tags}")
    axes.dot_tags(op, x.tags, xr.shape, w.tags, wr.shape, tag)   # presence, then sizes
    if xr.dtype != "f32":
        raise DTypeError(f"{op}: left operand: expected f32 against a {wr.dtype} weight, "
                         f"got {xr.dtype}")
    ax = x.tags.index(tag)
    return free, [i for i in range(xr.rank) if i != ax] + [ax]


def _rows(ctx, v):
    """v (contraction last) as a [M, K] matrix with unit stride along K: a view when its
    leading axes fold into one, else a contiguous copy."""
    K = v.shape[-1]
    M = 1
    for d in v.shape[:-1]:
        M *= d
    if v.strides[-1] == 1 or K == 1:
        lead = [(d, s) for d, s in zip(v.shape[:-1], v.strides[:-1]) if d != 1]
        if not lead:
            return v.view((1, K), (K, 1))
        st = lead[-1][1]
        ok, acc = True, st
        for d, s in reversed(lead):
            ok = ok and s == acc
            acc = s * d
        if ok:
            return v.view((M, K), (st, 1))
    return ew.materialize(ctx, v).view((M, K), (K, 1))


def _dx(saved, g):
    """dx = g · dequant(w), laid out as x."""
    ctx, wr, perm, xshape = saved
    N, K = wr.shape
    g2 = ew.materialize(ctx, g)
    M = g2.numel // N
    d = gemm(ctx, g2.view((M, N), (N, 1)), xq.decode(ctx, wr))
    inv = [perm.index(i) for i in range(len(perm))]
    shape = tuple(xshape[i] for i in perm)
    d = d.view(shape, contiguous_strides(shape)).permute(inv)
    return (ew.materialize(ctx, d),)


# ---------------------------------------------------------------------------------------------
# get_rows and concat (SPEC §3.16)

def _indices(op: str, x, indices):
    """Host indices (list, tuple, range, integer ndarray) or a rank-1 i64 tensor -> i64 raw."""
    if isinstance(indices, type(x)):
        same_ctx(op, x, indices)
        r = indices._raw
        if r.dtype != "i64" or r.rank != 1:
            raise DTypeError(f"{op}: indices: expected a rank-1 i64 tensor, got {r.dtype} "
                             f"{r.shape}")
        return r
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise InvalidShape(f"{op}: indices: expected a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidShape(f"{op}: indices: expected at least one index, got none (zero-size "
                           f"tensors are not representable)")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{op}: indices: expected integers, got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise IndexOutOfBounds(f"{op}: index {int(arr.max())} does not fit in i64")
    return x._raw.ctx.from_numpy(arr.astype(np.int64), (arr.size,), "i64", op)


def _row_axis(op: str, x, tag: str) -> int:
    ax = axes.axis_of(x.tags, tag, op)
    if ax == len(x.tags) - 1:
        raise TagError(f"{op}: {tag!r} is the innermost axis of the {x._raw.dtype} tensor "
                       f"{x.tags}, along which its blocks run; expected a row axis")
    return ax


def _tensors(op: str, x, others):
    """x.concat(tag, b, c) or x.concat(tag, [b, c])."""
    if len(others) == 1 and isinstance(others[0], (list, tuple)):
        others = tuple(others[0])
    for t in others:
        if not isinstance(t, type(x)):
            raise InvalidArgumentType(f"{op}: expected Tensor operands, got {type(t).__name__}")
        same_ctx(op, x, t)
    return (x, *others)


class QuantMethods:
    """Tensor methods of block-quantized tensors (SPEC §3.16). `concat` serves every dtype:
    tensors of other dtypes go on to the gather/scatter family's concat."""

    __slots__ = ()

    def get_rows(self, tag: str, indices, out_tag: str):
        """The f32 rows of a quantized tensor at `indices` along the row axis `tag` (renamed
        out_tag): gather and dequantize in one pass. No gradient (an embedding lookup into a
        frozen table). indices: host integers or a rank-1 i64 tensor; out of range raises
        IndexOutOfBounds."""
        op = "get_rows"
        r = self._live(op)
        if r.dtype not in BLOCKS:
            raise DTypeError(f"{op}: expected a block-quantized tensor, got {r.dtype}; use "
                             f"gather() on dense tensors")
        ax = _row_axis(op, self, tag)
        tags = axes.check_tags(self.tags[:ax] + (out_tag,) + self.tags[ax + 1:], r.rank, op)
        idx = _indices(op, self, indices)
        return self._result(xq.get_rows(r.ctx, r, ax, idx, op, tag), tags)

    def for_matvec(self):
        """This weight with a second copy of its blocks laid out for products with one to 8
        rows (decode steps; two on AVX2; fucina/exec/quant.py interleave): the same values
        and the same bits of every product, matvecs 15-25 % faster on AVX-512, 7-60 % on
        AVX2, twice the bytes held (q5: 6 % more). q4_0 / q4_1 / q5_0 / q5_1 matrices on
        AVX-512 and AVX2 hosts; any other tensor is returned as it is."""
        r = self._live("for_matvec")
        if isinstance(r, xq.GemvBlockRaw) or not xq.interleaves(r):
            return self
        return type(self)(xq.interleave(r.ctx, r), self.tags)

    def dot_q8(self, w, tag: str):
        """self.dot(w, tag) for one row of activations against a q4_0 / q4_1 / q5_0 / q5_1 /
        q8_0 / q2_k .. q6_k weight, the row rounded to 8 bits per group of 4 values and
        multiplied by integer dots (ggml's decode fast path; fucina/codegen/quant_q8.py): each
        activation is off by at most 1/254 of its group's largest |x|. Inference only; other
        weight dtypes, rows of fewer than 128 values and hosts without AVX2 get the exact
        dot."""
        op = "dot_q8"
        r, wr = self._live(op), w._live(op)
        same_ctx(op, self, w)
        if not xq.q8_fits(wr):
            return self.dot(w, tag)
        if needs_graph(self):
            raise UnsupportedGradient(f"{op}: inference only; expected an operand that does not "
                                      f"require grad (use fu.no_grad())")
        row, (_, _, oshape, ostrides, tags) = _dot_plan(op, self, w, tag)
        if row.shape[0] != 1:
            raise ShapeMismatch(f"{op}: expected one row of activations (every axis but "
                                f"{tag!r} of size 1), got shape {r.shape} tags {self.tags}")
        return self._result(xq.matvec_q8(r.ctx, row, wr).view(oshape, ostrides), tags)

    def concat(self, tag: str, *others):
        """Join along the existing axis `tag`. Quantized operands: all of self's dtype and tags
        (in self's order), equal sizes off `tag`, and `tag` a row axis (not the innermost);
        whole rows of blocks are copied. The result is a quantized constant."""
        op = "concat"
        self._live(op)
        parts = _tensors(op, self, others)
        if not any(t._raw.dtype in BLOCKS for t in parts):
            return super().concat(tag, *parts[1:])   # dense: the gather_scatter family
        ax = _row_axis(op, self, tag) if self._raw.dtype in BLOCKS else None
        for k, t in enumerate(parts):
            if t._raw.dtype != self._raw.dtype:
                raise DTypeError(f"{op}: operand {k}: expected {self._raw.dtype} like operand 0 "
                                 f"(quantized tensors join only their own dtype), got "
                                 f"{t._raw.dtype}")
            if t.tags != self.tags:
                raise TagError(f"{op}: operand {k}: expected the tags {self.tags} in that order "
                               f"(a quantized tensor has no transposed views), got {t.tags}")
        for k, t in enumerate(parts):
            for i, (d, e) in enumerate(zip(t._raw.shape, self._raw.shape)):
                if i != ax and d != e:
                    raise ShapeMismatch(f"{op}: operand {k}: axis {self.tags[i]!r} has size {d}; "
                                        f"expected {e} (operand 0's size off {tag!r})")
        out = xq.concat_rows(self._raw.ctx, [t._raw for t in parts], ax, op)
        return self._result(out, self.tags)
