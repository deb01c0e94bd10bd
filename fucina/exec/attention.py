"""Grouped attention at the exec layer (SPEC §3.12): a query-tiled, key-tiled online-softmax
forward and a recomputing backward, built from the GEMM kernels and the row kernels of
codegen/attention.py.

Operands: q [S, H, D], k and v [T, KVH, D] (f32, contiguous), query head h reading KV head
h // G (G = H / KVH; any other head mapping is first expanded to one KV head per query head).
The heads are two GEMM batch axes (KVH, G) with a zero stride on G for k and v, so the GQA
sharing costs nothing. Causal queries align to the end of the keys: query i attends keys
[0, T − S + i], with a window w > 0 only [T − S + i − w + 1, T − S + i].

Forward, per block of BQ queries: keys [kstart, kend) — only those some query of the block may
attend — in blocks of BK: s = q·kᵀ, the `online` row kernel (running max m, sum l, p over s,
o rescaled), o (+)= p·v; then `finish` writes out = o / l in place and lse = m + ln l. With at
most BK keys per query block this is one plain softmax pass (no rescale); longer rows are the
online (flash) form whose memory stays O(H·BQ·BK) whatever the sequence length.

Backward (FlashAttention-2 order, key blocks outer): D = Σ_d dout·out per row, then per tile
s = q·kᵀ, p = e^(s·scale − lse) (`probs`), dv += pᵀ·dout, dp = dout·vᵀ, ds = p·(dp − D)·scale
(`dscores`), dq += ds·k, dk += dsᵀ·q; the group axis of dk and dv is summed once per key block.
Every accumulation runs in a fixed tile order and each GEMM's k-sum order is fixed by shape,
so gradients are bitwise identical for any thread count.
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.attention import AttentionKey
from . import elementwise as ew
from . import reduce as exr
from .elementwise import f32_bits
from .matmul import gemm
from .raw import RawTensor

BQ = 128    # queries per block
BK = 512    # keys per block (forward); more keys than this per query block goes online
BKB = 128   # keys per block (backward)
ROW_WORK = 1 << 14


def _per(K: int) -> int:
    return max(1, ROW_WORK // max(K, 1))


class Geometry:
    """Shapes and the attention pattern: which keys query block [q0, q0+n) may attend."""

    def __init__(self, S, H, D, T, KVH, causal, window):
        self.S, self.H, self.D, self.T, self.KVH = S, H, D, T, KVH
        self.G = H // KVH
        self.causal, self.window = causal, window
        self.off = T - S

    def keys(self, q0, n):
        """(kstart, kend) of the keys the queries [q0, q0+n) attend together."""
        if not self.causal:
            return 0, self.T
        kend = min(self.T, self.off + q0 + n)
        kstart = max(0, self.off + q0 - self.window + 1) if self.window else 0
        return kstart, kend

    def bounds(self, q0, k0):
        """(hi0, lo0) of the row kernels: query i of the block at q0 sees block columns
        [lo0 + i, hi0 + i) of the key block at k0 (clamped)."""
        if not self.causal:
            return self.T, -(self.T + self.S)
        hi0 = self.off + q0 + 1 - k0
        lo0 = hi0 - self.window if self.window else -(self.T + self.S)
        return hi0, lo0


# ---------------------------------------------------------------------------------------------
# views: heads as GEMM batch axes (KVH, G)

def _q_view(q, geo, q0, n):
    """q[q0:q0+n] as [KVH, G, n, D]."""
    H, D = geo.H, geo.D
    return q.view((geo.KVH, geo.G, n, D), (geo.G * D, D, H * D, 1), q.offset + q0 * H * D)


def _kv_view(x, geo, k0, n, transposed):
    """k or v rows [k0, k0+n) as [KVH, G, n, D] (or [KVH, G, D, n]), G broadcast."""
    KVH, D = geo.KVH, geo.D
    off = x.offset + k0 * KVH * D
    if transposed:
        return x.view((KVH, geo.G, D, n), (D, 0, 1, KVH * D), off)
    return x.view((KVH, geo.G, n, D), (D, 0, KVH * D, 1), off)


def _t(x):
    """The last two axes swapped (a view)."""
    return x.permute((0, 1, 3, 2))


def _rows(x):
    """A contiguous [KVH, G, a, b] as rows [KVH·G·a, b]."""
    s = x.shape
    return x.view((s[0] * s[1] * s[2], s[3]), (s[3], 1))


def _launch(ctx, op, R, K, cost, *args, bias=False):
    per = _per(K)
    ctx.launch(kernels.get(AttentionKey(op, bias)), -(-R // per), cost, *args[:-1], per, *args[-1])


# ---------------------------------------------------------------------------------------------
# forward

def forward(ctx, q: RawTensor, k: RawTensor, v: RawTensor, geo: Geometry, scale: float,
            bias: RawTensor | None = None, out: RawTensor | None = None,
            lse: RawTensor | None = None) -> tuple[RawTensor, RawTensor]:
    """(out [S, H·D], lse [H, S]) for contiguous f32 q, k, v (k, v with KVH heads); `out` and
    `lse`, when given, are contiguous places of those shapes to write (a batch's slices)."""
    S, H, D = geo.S, geo.H, geo.D
    out = ctx.empty((S, H * D), "f32") if out is None else out
    lse = ctx.empty((H, S), "f32") if lse is None else lse
    sbits = f32_bits(scale)
    for q0 in range(0, S, BQ):
        n = min(BQ, S - q0)
        R = H * n
        kstart, kend = geo.keys(q0, n)
        qv = _q_view(q, geo, q0, n)
        o = ctx.empty((geo.KVH, geo.G, n, D), "f32")
        m = ctx.empty((R,), "f32")
        l = ctx.empty((R,), "f32")
        first = True
        for k0 in range(kstart, kend, BK):
            kb = min(BK, kend - k0)
            s = gemm(ctx, qv, _kv_view(k, geo, k0, kb, True))
            hi0, lo0 = geo.bounds(q0, k0)
            baddr = 0 if bias is None else bias.addr + (q0 * geo.T + k0) * 4
            _launch(ctx, "online", R, kb, R * kb * 8,
                    s.addr, o.addr, m.addr, l.addr, baddr, R, kb, D, sbits, n, hi0, lo0,
                    int(first), (geo.T,), bias=bias is not None)
            gemm(ctx, s, _kv_view(v, geo, k0, kb, False), out=o, accumulate=not first)
            first = False
        _launch(ctx, "finish", R, D, R * D * 8, o.addr, m.addr, l.addr,
                out.addr + q0 * H * D * 4, lse.addr + q0 * 4, R, D, n, (H * D, S))
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

def backward(ctx, q, k, v, out, lse, g, geo: Geometry, scale: float, kv_grads: bool,
             bias: RawTensor | None = None):
    """(dq [S, H, D], dk, dv [T, KVH, D] or None) from the upstream gradient g [S, H·D]."""
    S, H, D, T, KVH, G = geo.S, geo.H, geo.D, geo.T, geo.KVH, geo.G
    sbits = f32_bits(scale)
    Dr = ctx.empty((H, S), "f32")
    ctx.launch(kernels.get(AttentionKey("rowdot")), -(-(S * H) // _per(D)), S * H * D * 8,
               g.addr, out.addr, Dr.addr, S * H, D, H, S, _per(D))
    dq = ctx.empty((S, H, D), "f32")
    dk = dv = None
    if kv_grads:
        dk = ctx.empty((T, KVH, D), "f32")
        dv = ctx.empty((T, KVH, D), "f32")
    qblocks = [(q0, min(BQ, S - q0)) for q0 in range(0, S, BQ)]
    dqs = [None] * len(qblocks)
    for k0 in range(0, T, BKB):
        kb = min(BKB, T - k0)
        dkb = dvb = None
        for j, (q0, n) in enumerate(qblocks):
            kstart, kend = geo.keys(q0, n)
            if k0 >= kend or k0 + kb <= kstart:
                continue   # no query of this block attends a key of this block
            R = H * n
            qv = _q_view(q, geo, q0, n)
            gv = _q_view(g, geo, q0, n)
            s = gemm(ctx, qv, _kv_view(k, geo, k0, kb, True))
            hi0, lo0 = geo.bounds(q0, k0)
            baddr = 0 if bias is None else bias.addr + (q0 * T + k0) * 4
            _launch(ctx, "probs", R, kb, R * kb * 8, s.addr, lse.addr + q0 * 4, baddr, R, kb,
                    sbits, n, hi0, lo0, (T, S), bias=bias is not None)
            if kv_grads:
                dvb = gemm(ctx, _t(s), gv, out=dvb, accumulate=dvb is not None)
            dp = gemm(ctx, gv, _kv_view(v, geo, k0, kb, True))
            _launch(ctx, "dscores", R, kb, R * kb * 12, s.addr, dp.addr, Dr.addr + q0 * 4, R, kb,
                    sbits, n, (S,))
            dqs[j] = gemm(ctx, dp, _kv_view(k, geo, k0, kb, False), out=dqs[j],
                          accumulate=dqs[j] is not None)
            if kv_grads:
                dkb = gemm(ctx, _t(dp), qv, out=dkb, accumulate=dkb is not None)
        if kv_grads:
            _store_kv(ctx, dk, dkb, geo, k0, kb)
            _store_kv(ctx, dv, dvb, geo, k0, kb)
    for (q0, n), blk in zip(qblocks, dqs):
        dst = dq.view((n, KVH, G, D), (H * D, G * D, D, 1), q0 * H * D)
        if blk is None:
            ew.run(ctx, "copy", "f32", dst.shape, [0.0], out=dst)
        else:
            ew.run(ctx, "copy", "f32", dst.shape, [blk.permute((2, 0, 1, 3))], out=dst)
    return dq, dk, dv


def _store_kv(ctx, dst, blk, geo, k0, kb):
    """dst[k0:k0+kb] ([T, KVH, D]) = blk [KVH, G, kb, D] summed over G (zeros if no query
    attended these keys)."""
    KVH, D = geo.KVH, geo.D
    view = dst.view((kb, KVH, D), (KVH * D, D, 1), k0 * KVH * D)
    if blk is None:
        ew.run(ctx, "copy", "f32", view.shape, [0.0], out=view)
        return
    if geo.G > 1:
        blk = exr.reduce_axis(ctx, "sum", blk, 1)     # [KVH, kb, D], heads in a fixed order
        src = blk.permute((1, 0, 2))
    else:
        src = blk.view((KVH, kb, D), (kb * D, D, 1)).permute((1, 0, 2))
    ew.run(ctx, "copy", "f32", view.shape, [src], out=view)
