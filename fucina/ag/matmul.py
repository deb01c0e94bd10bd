"""Contractions with their backward rules (SPEC A-4…A-9): dot and einsum through one engine,
matmul kinds, add_dot. Backward is the einsum closure: each operand's gradient is itself an
einsum of the upstream gradient with the other operand, so both stay on the GEMM."""
from __future__ import annotations

from typing import TYPE_CHECKING

import functools

from .. import axes
from ..errors import (ActiveExecScopeRequired, DTypeError, InvalidArgument, InvalidArgumentType,
                      ShapeMismatch, TagError)
from ..exec import einsum as es
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..exec import matmul as mm
from ..exec.matmul import gemm
from ..exec.matmul_bf16 import gemm_bf16
from ..exec.dtypes import BLOCKS
from .checks import same_ctx
from .elementwise import add_scaled_grads
from .engine import finish_op, needs_graph
from .matmul_bf16 import bf16_dot
from .quant import quantized_dot, refuse_einsum



if TYPE_CHECKING:
    from .tensor import Tensor

def _check_dtypes(op, x, y):
    if x._raw.dtype != "f32":
        raise DTypeError(f"{op}: left operand: expected f32, got {x._raw.dtype}")
    if y._raw.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: right operand: expected f32, f16 or bf16, got {y._raw.dtype}")


def einsum(x, y, out_tags, op: str = "einsum"):
    refuse_einsum(op, y)
    _check_dtypes(op, x, y)
    a, b = x._raw, y._raw
    out_tags = tuple(out_tags)
    out = es.einsum(a.ctx, a, x.tags, b, y.tags, out_tags)
    return finish_op(op, out, out_tags, (x, y),
                     lambda needs: functools.partial(_einsum_grads, _einsum_saved(
                         a, x.tags, b, y.tags, out_tags, needs), needs), dtypes_ok=True,
                     into=True)


def _einsum_saved(a, xt, b, yt, out_tags, needs) -> tuple:
    """What the VJP reads: dX reads Y, dY reads X, so an operand is kept only when the other
    one needs a gradient (x·W with W frozen keeps W, not the activation x)."""
    return (a.ctx, a if needs[1] else None, a.shape, xt, b if needs[0] else None, b.shape, yt,
            out_tags)


def _einsum_grads(saved, needs, g, acc=(None, None)):
    """dX = einsum(g, Y -> X's tags), dY = einsum(X, g -> Y's tags); a summed-away private axis
    gets the gradient broadcast back over it. acc: the engine's accumulators to add into."""
    ctx, a, a_shape, xt, b, b_shape, yt, out_tags = saved
    gx = _grad_for(ctx, g, out_tags, b, yt, a_shape, xt, acc[0]) if needs[0] else None
    gy = _grad_for(ctx, a, xt, g, out_tags, b_shape, yt, acc[1]) if needs[1] else None
    return gx, gy


def _grad_for(ctx, p, pt, q, qt, target_shape, tt, into=None):
    """einsum of p and q onto the tags tt (of a target of target_shape), broadcast over target
    axes neither has; added into `into` (contiguous, tt order) when given and nothing is
    broadcast (then `into` is the result)."""
    have = set(pt) | set(qt)
    kept = tuple(t for t in tt if t in have)
    if q.dtype != "f32":
        q = ew.cast(ctx, q, "f32")
    if p.dtype != "f32":
        p = ew.cast(ctx, p, "f32")
    if into is not None and kept == tt:
        return es.einsum(ctx, p, pt, q, qt, kept, out=into, accumulate=True)
    r = es.einsum(ctx, p, pt, q, qt, kept)
    if kept == tt:
        return r
    strides = es._contig(r.shape)
    full = tuple(target_shape[tt.index(t)] for t in tt)
    st = tuple(strides[kept.index(t)] if t in kept else 0 for t in tt)
    return ew.materialize(ctx, r.view(full, st))


def dot(x, y, tag: str):
    if y._raw.dtype in BLOCKS:  # SPEC A-8: a frozen block-quantized weight, gradient to x only
        return quantized_dot(x, y, tag)
    out_tags = axes.dot_tags("dot", x.tags, x._raw.shape, y.tags, y._raw.shape, tag)
    return einsum(x, y, out_tags, op="dot")


def add_scaled_dot_into(base, x, y, tag: str, s: float):
    """base.add(x.dot(y, tag).scale(s)) written over base's own buffer, in the product's GEMM
    pass: each sum is rounded as s·sum and added to base's value as the tile stores it (the two
    ops' roundings, so the same bits) — no buffer for the product, none for the sum, no pass
    over either. The caller guarantees base is never read again (its buffer now holds the
    result) and checked tags and shapes; x and y are f32 and base a contiguous f32 that no
    other view sees (engine.sole_view). Gradients: g to base, s·g through the dot's rule.
    Returns finish_op's triple."""
    a, b, r = x._raw, y._raw, base._raw
    ctx = r.ctx
    out_tags = base.tags
    es.einsum(ctx, a, x.tags, b, y.tags, out_tags, out=r, accumulate=True, scale=s)
    saved = (ctx, s, r.shape)

    def make_vjp(needs):
        dot_saved = _einsum_saved(a, x.tags, b, y.tags, out_tags, needs[1:])
        return functools.partial(_add_scaled_dot_grads, saved, dot_saved, needs)

    return finish_op("add_scaled_dot", r, out_tags, (base, x, y), make_vjp)


def _add_scaled_dot_grads(saved, dot_saved, needs, g):
    """add_scaled's gradients for base and the product, then the dot's rule on the latter."""
    ctx, s, shape = saved
    gb, gs = add_scaled_grads(ctx, shape, s, (needs[0], needs[1] or needs[2]), g)
    gx, gy = _einsum_grads(dot_saved, needs[1:], gs) if gs is not None else (None, None)
    return gb, gx, gy


def lora_linear(x, w, a, bm, s: float, bf16: bool = False):
    """x.dot(w, in) + (x.dot(a, in).dot(bm, rank)).scale(s) (lora.Adapter.project): w [out,
    in] frozen, a [rank, in], bm [out, rank], every tag and shape checked by the caller, all
    f32; x [seq, in] with `in` its last axis. The rank product s·(xa·bmᵀ) is added in the
    base GEMM's tile stores (gemm's rank_add: the bits of the separate pass), and the backward
    adds dxa·a into dx in the tile stores of dx = g·w the same way: one node, no [seq, out]
    or [seq, in] pass for the rank side. Each gradient is the unfused ops' (the same GEMMs and
    roundings); dx's two parts reach x's accumulator together, when this node runs.
    bf16: the base is x.dot_bf16(w, in) instead (w bf16 or f32; forward and dx through
    exec.matmul_bf16 with the rank term in its tile stores), the adapters' products f32.
    Returns finish_op's triple."""
    xr, wr, ar, br = x._raw, w._raw, a._raw, bm._raw
    ctx = xr.ctx
    in_tag = a.tags[1]
    out_tags = axes.dot_tags("dot", x.tags, xr.shape, w.tags, wr.shape, in_tag)
    xa_tags = axes.dot_tags("dot", x.tags, xr.shape, a.tags, ar.shape, in_tag)
    xa = es.einsum(ctx, xr, x.tags, ar, a.tags, xa_tags)
    bt = ew.materialize(ctx, br.permute((1, 0)))                # [rank, out]: rows along out
    if bf16:
        y = gemm_bf16(ctx, xr, wr.permute((1, 0)), rank_add=(xa, bt, s))
    else:
        y = es.einsum(ctx, xr, x.tags, wr, w.tags, out_tags, rank_add=(xa, bt, s))

    def make_vjp(needs):
        kept = (xr if needs[1] else None, xa if needs[2] else None)
        return functools.partial(_lora_linear_grads, (ctx, kept, x.tags, w, a, bm, bt, s,
                                                      out_tags, xa_tags, y.shape, bf16), needs)
    return finish_op("lora_linear", y, out_tags, (x, a, bm), make_vjp, into=True)


def _lora_linear_grads(saved, needs, g, acc=(None, None, None)):
    """The unfused chain's gradients: s·g (add_scaled's), dxa = (s·g)·bm, dbm = xaᵀ·(s·g),
    da = dxaᵀ·x, and dx = [acc +] g·w + dxa·a with the rank part in dx's tile stores. dxa
    reads bm through the forward's [rank, out] copy bt where the GEMM would copy bm so first
    (the same kernel on the same [rank, out] values: the bits of the chain, one launch less)."""
    ctx, (xr, xa), xt, w, a, bm, bt, s, out_tags, xa_tags, shape, bf16 = saved
    wr, ar, br = w._raw, a._raw, bm._raw
    _, gs = add_scaled_grads(ctx, shape, s, (False, True), g)
    gxa = None
    if needs[0] or needs[1]:
        if gs.rank == 2 and mm.copies_b(gs, br):
            br = bt.permute((1, 0))
        gxa = es.einsum(ctx, gs, out_tags, br, bm.tags, xa_tags)
    gb = es.einsum(ctx, xa, xa_tags, gs, out_tags, bm.tags) if needs[2] else None
    ga = es.einsum(ctx, xr, xt, gxa, xa_tags, a.tags) if needs[1] else None
    gx = None
    if needs[0]:
        into = {} if acc[0] is None else {"out": acc[0], "accumulate": True}
        if bf16:
            gx = gemm_bf16(ctx, g, wr, rank_add=(gxa, ar, 1.0), **into)
        else:
            gx = es.einsum(ctx, g, out_tags, wr, w.tags, xt, rank_add=(gxa, ar, 1.0), **into)
    return gx, ga, gb


def einsum_many(out_tags, operands):
    """A-6: a left fold of binary einsums keeping, at each step, the tags still needed."""
    out_tags = tuple(out_tags)
    if len(operands) < 2:
        raise InvalidArgumentType(f"einsum_many: expected at least 2 operands, got {len(operands)}")
    ctx = operands[0]._raw.ctx
    if needs_graph(*operands) and not ctx.scopes:
        raise ActiveExecScopeRequired(
            "einsum_many: a composed op under gradients needs an open exec scope; "
            "expected `with ctx.exec_scope():` around it")
    acc = operands[0]
    for k in range(1, len(operands)):
        rest = set(out_tags)
        for o in operands[k + 1:]:
            rest |= set(o.tags)
        y = operands[k]
        keep = tuple(t for t in acc.tags + tuple(t for t in y.tags if t not in acc.tags) if t in rest)
        if k == len(operands) - 1:
            keep = out_tags
        acc = acc._einsum(y, keep)
    return acc


def matmul(x, y, kind: str, out_tags):
    """A-7: storage order is the kernel layout; kinds plain / trans_a / trans_b; leading batch
    axes broadcast (stride 0), mixed ranks broadcast."""
    a, b = x._raw, y._raw
    if kind not in ("plain", "trans_a", "trans_b"):
        raise InvalidArgument(f"matmul: expected kind plain, trans_a or trans_b, got {kind!r}")
    if a.dtype != "f32" or b.dtype != "f32":
        raise DTypeError(f"matmul: expected f32 operands, got {a.dtype} and {b.dtype}")
    if a.rank < 2 or b.rank < 2:
        raise TagError(f"matmul: expected operands of rank >= 2, got {a.rank} and {b.rank}")
    if kind == "trans_a" and a.rank == 2 and b.rank == 2:
        raise TagError("matmul: trans_a on two rank-2 operands is not a kind; use dot")
    av = a.permute(list(range(a.rank - 2)) + [a.rank - 1, a.rank - 2]) if kind == "trans_a" else a
    bv = b.permute(list(range(b.rank - 2)) + [b.rank - 1, b.rank - 2]) if kind == "trans_b" else b
    nb = max(a.rank, b.rank) - 2
    batch = _broadcast_batch(av.shape[:-2], bv.shape[:-2], nb)
    av, bv = _expand(av, batch), _expand(bv, batch)
    out_tags = tuple(out_tags)
    shape = batch + (av.shape[-2], bv.shape[-1])
    axes.check_tags(out_tags, len(shape), "matmul")
    out = gemm(a.ctx, av, bv)
    return finish_op("matmul", out, out_tags, (x, y),
                     lambda needs: functools.partial(_matmul_grads, (
                         a.ctx, a.shape, b.shape, av if needs[1] else None,
                         bv if needs[0] else None, kind), needs))


def _broadcast_batch(sa, sb, nb):
    sa = (1,) * (nb - len(sa)) + tuple(sa)
    sb = (1,) * (nb - len(sb)) + tuple(sb)
    out = []
    for i, (p, q) in enumerate(zip(sa, sb)):
        if p != q and p != 1 and q != 1:
            raise ShapeMismatch(f"matmul: batch axis {i} has size {p} and {q}; expected equal or 1")
        out.append(max(p, q))
    return tuple(out)


def _expand(v, batch):
    extra = len(batch) - (v.rank - 2)
    shape = (1,) * extra + v.shape
    strides = (0,) * extra + v.strides
    strides = tuple(0 if d == 1 and i < len(batch) else s for i, (d, s) in enumerate(zip(shape, strides)))
    return v.view(batch + shape[-2:], strides)


def _matmul_grads(saved, needs, g):
    """dA = g·Bᵀ, dB = Aᵀ·g over the broadcast batch; summed over the batch axes an operand
    broadcast along, then laid out as the operand is stored (transposed back for trans kinds)."""
    ctx, a_shape, b_shape, av, bv, kind = saved   # dA reads B only, dB reads A only
    grads = []
    for which, src in ((0, a_shape), (1, b_shape)):
        if not needs[which]:
            grads.append(None)
            continue
        d = gemm(ctx, g, _t(bv)) if which == 0 else gemm(ctx, _t(av), g)
        nb = d.rank - 2
        extra = nb - (len(src) - 2)
        own = (1,) * extra + src[:-2]  # the operand's batch sizes, aligned to the result's
        for ax in reversed(range(nb)):
            if own[ax] == 1 and d.shape[ax] != 1:
                d = red.reduce_axis(ctx, "sum", d, ax)
                d = d.view(d.shape[:ax] + (1,) + d.shape[ax:], d.strides[:ax] + (0,) + d.strides[ax:])
        d = d.view(d.shape[extra:], d.strides[extra:])
        if (which == 0 and kind == "trans_a") or (which == 1 and kind == "trans_b"):
            d = _t(d)
        grads.append(ew.materialize(ctx, d))
    return tuple(grads)


def _t(v):
    return v.permute(list(range(v.rank - 2)) + [v.rank - 1, v.rank - 2])


def add_dot(res, x, y, tag: str):
    """A-9: res + x·y with res[rows, cols], x[rows, tag], y[tag, cols] exactly (addmm)."""
    r, a, b = res._raw, x._raw, y._raw
    for name, t in (("self", res), ("a", x), ("b", y)):
        if t._raw.dtype != "f32":
            raise DTypeError(f"add_dot: operand {name}: expected f32, got {t._raw.dtype}")
    if (len(res.tags) != 2 or len(x.tags) != 2 or len(y.tags) != 2 or x.tags[1] != tag
            or y.tags[0] != tag or x.tags[0] != res.tags[0] or y.tags[1] != res.tags[1]):
        raise TagError(f"add_dot: expected self[rows, cols], a[rows, {tag}], b[{tag}, cols]; got "
                       f"self{res.tags}, a{x.tags}, b{y.tags}")
    out = ew.run(r.ctx, "copy", "f32", r.shape, (r,))
    gemm(r.ctx, a, b, out, accumulate=True)
    return finish_op("add_dot", out, res.tags, (res, x, y),
                     lambda needs: functools.partial(_add_dot_grads, (
                         r.ctx, a if needs[2] else None, b if needs[1] else None), needs))


def _add_dot_grads(saved, needs, g):
    ctx, a, b = saved
    return (g if needs[0] else None,
            gemm(ctx, g, _t(b)) if needs[1] else None,
            gemm(ctx, _t(a), g) if needs[2] else None)


class MatmulMethods:
    """Tensor methods of the contraction family (SPEC A-4…A-9)."""

    __slots__ = ()

    # ---- contractions (A-4…A-9) ----
    def _einsum(self, other, out_tags, op="einsum"):
        self._live(op)
        same_ctx(op, self, other)
        return self._result(*einsum(self, other, out_tags, op))

    def einsum(self, other: "Tensor", out_tags):
        """result[out_tags] = sum over every other tag of self * other (A-5)."""
        return self._einsum(other, out_tags)

    def dot(self, other: "Tensor", tag: str):
        """Contract `tag`; result tags: batch + left free + right free (A-4)."""
        self._live("dot")
        same_ctx("dot", self, other)
        return self._result(*dot(self, other, tag))

    def dot_bf16(self, other: "Tensor", tag: str):
        """dot with a frozen right operand computed in bf16: both sides rounded to bf16, f32
        sums (fucina.ag.matmul_bf16); gradient to self only."""
        self._live("dot_bf16")
        other._live("dot_bf16")
        same_ctx("dot_bf16", self, other)
        return self._result(*bf16_dot(self, other, tag))

    def matmul(self, other: "Tensor", kind: str, out_tags):
        """A-7: plain / trans_a / trans_b on the storage order, bypassing the tag algebra."""
        self._live("matmul")
        same_ctx("matmul", self, other)
        return self._result(*matmul(self, other, kind, out_tags))

    def add_dot(self, a: "Tensor", b: "Tensor", tag: str):
        """A-9: self + a·b (addmm)."""
        self._live("add_dot")
        same_ctx("add_dot", self, a)
        same_ctx("add_dot", self, b)
        return self._result(*add_dot(self, a, b, tag))
