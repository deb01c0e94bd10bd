"""Grouped attention at the exec layer (SPEC §3.12): one fused launch for the forward and one
for the backward (FlashAttention-2, codegen/attention.py), plus the decode step.

Operands: q [S, H, D], k and v [T, KVH, D] (f32, contiguous), query head h reading KV head
h // G (G = H / KVH; any other head mapping is first expanded to one KV head per query head).
Causal queries align to the end of the keys: query i attends keys [0, T − S + i], with a
window w > 0 only [T − S + i − w + 1, T − S + i].

The kernels read k (and, backward, v) also as kᵀ, in key tiles of BK: [KVH, tiles, D, BK], a
copy made here; and q, v (backward: q, dout, k) row by row, in place or, when their rows lie
a multiple of 2 KiB apart, from head-major copies (_rows). The forward's chunks are (head,
query tile) and write disjoint rows of out and lse. The backward's are (head, part of the key
tiles): each writes its own dq partial [part, S, H, D] (or [part, H, S, D] beside a head-major
q) and its own dk, dv partial [h mod G, T, KVH, D]; the parts and the group's heads are then
added in a fixed order. So the bits depend on the shapes alone, never on the
thread count.
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.attention import AttentionKey
from . import elementwise as ew
from . import reduce as exr
from .elementwise import f32_bits
from .raw import RawTensor

BQ = 64        # queries per tile
BK = 64        # keys per tile of the backward
FWD_BK = 128   # ... of the forward, whose row passes have a cost per row and tile (the
               # running max and sum): 5 % faster there, and slower in the backward
ROW_WORK = 1 << 14


def _per(K: int) -> int:
    return max(1, ROW_WORK // max(K, 1))


class Geometry:
    """Shapes and the attention pattern."""

    def __init__(self, S, H, D, T, KVH, causal, window):
        self.S, self.H, self.D, self.T, self.KVH = S, H, D, T, KVH
        self.G = H // KVH
        self.causal, self.window = causal, window
        self.off = T - S

    def queries(self, k0, n):
        """[lo, hi) of the queries that may attend keys [k0, k0+n), as the backward kernel
        finds them."""
        if not self.causal:
            return 0, self.S
        lo = max(0, k0 - self.off)
        hi = min(self.S, k0 + n - 1 + self.window - self.off) if self.window else self.S
        return lo, max(lo, hi)


ALIASED_ROWS = 2048   # bytes: rows a multiple of this apart are read from a head-major copy


def _rows(ctx, x, heads, D):
    """(x or a copy, row stride, head stride) of a [rows, heads, D] operand as the fused
    kernels read it: in place, or as a head-major copy [heads, rows, D] when its rows lie a
    multiple of ALIASED_ROWS bytes apart. There a micro-tile's rows (and a key tile's) fall in
    one or two groups of L1 sets, and the kernels reread them from L2. Zen 3, seq 1024, forward
    + backward, one thread: 16 heads of 64 (4 KiB; Gemma-3's 4 of 256, Qwen3's 16 of 128 too)
    ran at 52 GFLOP/s against 65 for 15 or 17 heads, 1.23-1.29x faster with the copies; 8 heads
    of 64 (2 KiB) 1.02-1.07x at one thread, 1.07x at two (A/B pairs). The same products and
    sums: the same bits."""
    rows = x.shape[0]
    if heads * D * 4 % ALIASED_ROWS or heads == 1:
        return x, heads * D, D
    return ew.materialize(ctx, x.view((heads, rows, D), (D, heads * D, 1), x.offset)), D, rows * D


# ---------------------------------------------------------------------------------------------
# forward

def _transposed(ctx, x, geo, BK):
    """k or v [T, KVH, D] as [KVH, key tiles, D, BK]: each key tile a contiguous D x BK panel,
    which the kernels' q·kᵀ and dout·vᵀ read as rows of keys. (A plain [D, T] would put a
    tile's rows T·4 bytes apart: 4 KiB at T = 1024, all in one L1 set.) A last, partial tile's
    columns past T are left as they were: the kernels load them (whole vectors) but no
    result reads a score of a key past T."""
    T, KVH, D = geo.T, geo.KVH, geo.D
    nt, full = -(-T // BK), T // BK
    out = ctx.empty((KVH, nt, D, BK), "f32")
    if full:
        shape = (KVH, full, D, BK)
        ew.run(ctx, "copy", "f32", shape, [x.view(shape, (D, BK * KVH * D, 1, KVH * D), x.offset)],
               out=out.view(shape, (nt * D * BK, D * BK, BK, 1), 0))
    if T > full * BK:
        shape = (KVH, D, T - full * BK)
        ew.run(ctx, "copy", "f32", shape,
               [x.view(shape, (D, 1, KVH * D), x.offset + full * BK * KVH * D)],
               out=out.view(shape, (nt * D * BK, BK, 1), full * D * BK))
    return out


def forward(ctx, q: RawTensor, k: RawTensor, v: RawTensor, geo: Geometry, scale: float,
            bias: RawTensor | None = None, out: RawTensor | None = None,
            lse: RawTensor | None = None) -> tuple[RawTensor, RawTensor]:
    """(out [S, H·D], lse [H, S]) for contiguous f32 q, k, v (k, v with KVH heads); `out` and
    `lse`, when given, are contiguous places of those shapes to write (a batch's slices)."""
    S, H, D, T = geo.S, geo.H, geo.D, geo.T
    out = ctx.empty((S, H * D), "f32") if out is None else out
    lse = ctx.empty((H, S), "f32") if lse is None else lse
    kT = _transposed(ctx, k, geo, FWD_BK)
    q, q_rs, q_hs = _rows(ctx, q, H, D)
    v, v_rs, v_hs = _rows(ctx, v, geo.KVH, D)
    nqt = -(-S // BQ)
    key = AttentionKey("forward", bias is not None, d=D, bq=BQ, bk=FWD_BK)
    ctx.launch(kernels.get(key), H * nqt, 4 * S * T * H * D,
               q.addr, kT.addr, v.addr, out.addr, lse.addr, 0 if bias is None else bias.addr,
               S, T, H, geo.KVH, f32_bits(scale), int(geo.causal), geo.window, nqt, T,
               q_rs, q_hs, v_rs, v_hs)
    return out, lse


def decode(ctx, q: RawTensor, k: RawTensor, v: RawTensor, KVH: int, window: int,
           scale: float) -> tuple[RawTensor, RawTensor]:
    """One query position (a decode step) over every key of k and v (f32 or f16, contiguous
    [T, KVH, D]; the last `window` when window > 0): (out [1, H·D], lse [H, 1]) by one launch,
    a head per chunk. Its arguments are affine in T and no buffer depends on T, which lets a
    decode step be recorded and replayed (fucina/exec/plan.py)."""
    _, H, D = q.shape
    T = k.shape[0]
    out = ctx.empty((1, H * D), "f32")
    lse = ctx.empty((H, 1), "f32")
    ctx.launch(kernels.get(AttentionKey("decode", kv=k.dtype, d=D, row=KVH * D)), H,
               4 * H * T * D * 2,
               q.addr, k.addr, v.addr, out.addr, lse.addr, T, window, H // KVH, D,
               f32_bits(scale), KVH * D)
    return out, lse


# ---------------------------------------------------------------------------------------------
# backward

def _split(geo):
    """(parts, split): the backward's key tiles in two parts of about equal work (the queries
    attending each tile), fixed by the shapes — each head's dq is then two chunks' sum."""
    nkt = -(-geo.T // BK)
    if nkt < 2:
        return 1, nkt
    work = []
    for t in range(nkt):
        lo, hi = geo.queries(t * BK, min(BK, geo.T - t * BK))
        work.append(hi - lo)
    total, run = sum(work), 0
    for t in range(nkt - 1):
        run += work[t]
        if 2 * run >= total:
            return 2, t + 1
    return 2, nkt - 1


def backward(ctx, q, k, v, out, lse, g, geo: Geometry, scale: float, kv_grads: bool):
    """(dq [S, H, D], dk, dv [T, KVH, D] or None) from the upstream gradient g [S, H·D] (a
    bias is inference-only: the op refuses one that needs a gradient)."""
    S, H, D, T, KVH, G = geo.S, geo.H, geo.D, geo.T, geo.KVH, geo.G
    Dr = ctx.empty((H, S), "f32")
    ctx.launch(kernels.get(AttentionKey("rowdot")), -(-(S * H) // _per(D)), S * H * D * 8,
               g.addr, out.addr, Dr.addr, S * H, D, H, S, _per(D))
    kT, vT = _transposed(ctx, k, geo, BK), _transposed(ctx, v, geo, BK)
    q, q_rs, q_hs = _rows(ctx, q, H, D)
    g, _, _ = _rows(ctx, g.view((S, H, D), (H * D, D, 1), g.offset), H, D)
    k, k_rs, k_hs = _rows(ctx, k, KVH, D)
    parts, split = _split(geo)
    head_major = q_hs != D     # dq's parts in q's layout: [parts, H, S, D] beside a copy
    dqp = ctx.empty((parts, H, S, D) if head_major else (parts, S, H, D), "f32")
    dkp = dvp = None
    if kv_grads:
        dkp, dvp = ctx.empty((G, T, KVH, D), "f32"), ctx.empty((G, T, KVH, D), "f32")
    key = AttentionKey("backward", d=D, bq=BQ, bk=BK)
    ctx.launch(kernels.get(key), H * parts, 10 * S * T * H * D,
               q.addr, k.addr, kT.addr, vT.addr, g.addr, lse.addr, Dr.addr, dqp.addr,
               0 if dkp is None else dkp.addr, 0 if dvp is None else dvp.addr,
               S, T, H, KVH, f32_bits(scale), int(geo.causal), geo.window, split, parts,
               int(kv_grads), q_rs, q_hs, k_rs, k_hs)
    if head_major:
        dqp = dqp.view((parts, S, H, D), (H * S * D, D, S * D, 1), dqp.offset)
    dq = ew.materialize(ctx, _sum_first(ctx, dqp))   # one head-major part is still a view
    if not kv_grads:
        return dq, None, None
    return dq, _sum_first(ctx, dkp), _sum_first(ctx, dvp)


def _sum_first(ctx, x):
    """x [n, ...] summed over its first axis in order (x[0] itself when n = 1)."""
    shape = x.shape[1:]
    if x.shape[0] == 1:
        return x.view(shape, x.strides[1:], x.offset)
    if x.shape[0] == 2:
        n = x.numel // 2
        return ew.run(ctx, "add", "f32", shape, [x.view(shape, x.strides[1:], x.offset),
                                                 x.view(shape, x.strides[1:], x.offset + n)])
    return exr.reduce_axis(ctx, "sum", x, 0)
