"""Grouped attention kernels (SPEC §3.12): the fused training forward and backward, the
decode step and a row dot.

  forward   FlashAttention-2's forward, one launch: a chunk is one head's tile of BQ queries;
            over the key tiles of BK keys it may attend, s = q·kᵀ into a stack tile, the
            online softmax per row (running max m and sum l; p = e^(z − m), the running o
            rescaled by e^(m_old − m)), o += p·v; then out = o / l, lse = m + ln l.
  backward  its backward, one launch: a chunk is one head and one of two parts of the key
            tiles; per key tile (dk, dv on the stack) over the query tiles that may attend it:
            s = q·kᵀ, p = e^(z − lse), dv += pᵀ·dout, dp = dout·vᵀ, ds = p·(dp − D)·scale,
            dk += dsᵀ·q, dq[part] += ds·k. The caller adds the two parts of dq and the G query
            heads' dk, dv in a fixed order.
  rowdot    D[head, q] = Σ_d a[q, head, :]·b[q, head, :] (the backward's D = Σ dout·out).
  decode    one query row per head against keys [max(0, T − w), T) of an f32 or f16 cache (w = 0:
            all), W keys at a time: their W scores side by side, an online softmax over the
            blocks (no scratch sized by T: a decode step's buffers do not depend on the
            position, so the step can be recorded and replayed).

In the fused kernels, the row of query i (absolute position T − S + i) sees keys [lo, hi) of a
key tile: causal, keys up to its own position; with a window w > 0, only the last w of those;
columns outside are masked; z = s·scale (+ bias[i, key] when the forward has a bias). Their
products are micro-GEMMs between stack tiles (_mm): one FMA chain per element in a fixed order.
Sums and maxima fold in the fixed order of rows.fold_pass, and each result element is written
by one chunk only, so no bit depends on the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import gemm
from . import irutil as u
from . import vmath
from .emit import fold, lane_tree
from .kernels import KernelKey, register
from .rows import accs_of, exp_sum, fadd, finite, fmax, fold_pass, long_step, map_pass, max_of
from .target import host

OPS = ("forward", "backward", "rowdot", "decode")


@register
@dataclass(frozen=True)
class AttentionKey(KernelKey):
    """op in OPS; bias: an additive [q, kv] f32 bias on the scaled scores (forward); kv: the
    dtype of the keys and values (decode reads an f16 cache as it is); d: the head size
    (decode: see _decode); bq, bk: the fused kernels' query and key tiles."""

    family = "attention"
    op: str
    bias: bool = False
    kv: str = "f32"
    d: int = 0      # decode: the head size and the cache's elements per position, when fixed
    row: int = 0    # at build time (0: both runtime arguments)
    bq: int = 0
    bk: int = 0

    def ir(self, symbol: str) -> str:
        if self.op not in OPS:
            raise ValueError(f"attention kernel: unknown op {self.op!r}")
        return u.module(symbol, {"forward": _fwd, "backward": _bwd, "rowdot": _rowdot,
                                 "decode": _decode}[self.op], self)


def _rows(b, c0, c1, per, R):
    return b.mul(c0, per), u.smin(b, b.mul(c1, per), R)


def _clamp(b, v, lo, hi):
    v = b.select(b.icmp_signed("<", v, lo), lo, v)
    return b.select(b.icmp_signed(">", v, hi), hi, v)


def _scores(key, b, sb, biasb, scales, W):
    """z(c, mask, lanes): the scaled (and biased) scores of a row, W lanes at a time (scales:
    the scale splat to W) or the lanes of a map_pass wide step."""
    def z(c, m, lanes=W):
        sc = scales if lanes == W else u.splat(b, b.extract_element(scales, u.i64(0)), lanes)
        v = b.fmul(u.load(b, sb, c, "f32", lanes, m), sc)
        if key.bias:
            v = b.fadd(v, u.load(b, biasb, c, "f32", lanes, m))
        return v
    return z


def _zero_outside(b, row, lo, hi, kb, W):
    zero = u.const(ir.VectorType(u.F32, W), 0.0)
    map_pass(b, u.i64(0), lo, W, lambda c, m: u.store(b, zero, row, c, "f32", m))
    map_pass(b, hi, kb, W, lambda c, m: u.store(b, zero, row, c, "f32", m))


def _rowdot(key, b, args, c0, c1):
    """args: a, b, D, R (= seq·H), d, H, seq, per; row r = q·H + h -> D[h·seq + q]."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    x, y, D = (u.arg_ptr(b, args, i) for i in range(3))
    R, d, H, seq, per = (u.arg(b, args, i) for i in range(3, 8))
    r0, r1 = _rows(b, c0, c1, per, R)
    sx = accs_of(b, vt, 0.0)
    with u.Loop(b, r0, r1, 1, "r") as r:
        xb = b.gep(x, [b.mul(r, d)], source_etype=u.F32)
        yb = b.gep(y, [b.mul(r, d)], source_etype=u.F32)
        for p in sx:
            b.store(u.const(vt, 0.0), p)
        fold_pass(b, u.i64(0), d, W, sx, lambda c, m: b.fmul(
            u.load(b, xb, c, "f32", W, m), u.load(b, yb, c, "f32", W, m)), fadd, 0.0)
        q, h = b.sdiv(r, H), b.srem(r, H)
        u.store(b, fold(b, sx, fadd), D, b.add(b.mul(h, seq), q), "f32")


def _key_sums(b, vecs):
    """W vectors of W lanes -> one vector whose lane j is the sum of vecs[j]'s lanes, by a
    fixed tree: each level pairs neighbouring vectors and adds the low half of every key's
    lanes to its high half, so the keys' partial sums stay side by side (W − 1 adds in all,
    instead of a horizontal fold per key)."""
    W = len(vecs)
    cur, n, s = list(vecs), 1, W   # n keys per vector, s lanes per key
    while len(cur) > 1:
        half, nxt = s // 2, []
        for x, y in zip(cur[0::2], cur[1::2]):
            lo, hi = [], []
            for kb in range(2 * n):
                base = (0 if kb < n else W) + (kb % n) * s
                lo += [base + i for i in range(half)]
                hi += [base + half + i for i in range(half)]
            nxt.append(b.fadd(b.shuffle_vector(x, y, ir.Constant(ir.VectorType(u.I32, W), lo)),
                              b.shuffle_vector(x, y, ir.Constant(ir.VectorType(u.I32, W), hi))))
        cur, n, s = nxt, 2 * n, half
    return cur[0]


def _decode(key, b, args, c0, c1):
    """args: q, k, v, out, lse, T, w, G, d, scale, row (k/v elements per position); chunk = head h,
    reading KV head h // G. q and out are [H, d] rows, lse [H].

    Keys go W at a time (one per lane): W dot products accumulate side by side over d, one
    tree (_key_sums) turns them into a vector of W scores, and an online softmax takes the
    block (m' = max(m, block max), l = l·e^(m − m') + Σ p, o = o·e^(m − m') + Σ p_j·v_j,
    the W products added in key order). In the last, partial block, lanes past T read key
    T − 1 and get p = 0. With key.d and key.row set (the model's head size and cache row),
    the full blocks address their W rows at constant offsets from one pointer and unroll d;
    the arithmetic and its order are the same, so are the bits."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    q, k, v, out, lse = (u.arg_ptr(b, args, i) for i in range(5))
    T, w, G, d = (u.arg(b, args, i) for i in range(5, 9))
    scale = u.arg_f32(b, args, 9)
    row = u.arg(b, args, 10)
    kv = key.kv
    static = key.d > 0 and key.d % W == 0
    if static:
        d, row = u.i64(key.d), u.i64(key.row)
    lo = b.select(b.icmp_signed(">", w, u.i64(0)), b.sub(T, w), u.i64(0))
    lo = b.select(b.icmp_signed("<", lo, u.i64(0)), u.i64(0), lo)
    accs = [u.entry_alloca(b, vt) for _ in range(W)]
    mslot, lslot = u.entry_alloca(b, u.F32), u.entry_alloca(b, u.F32)
    ninf = u.const(u.F32, float("-inf"))
    zero = u.const(vt, 0.0)
    with u.Loop(b, c0, c1, 1, "h") as h:
        qb = b.gep(q, [b.mul(h, d)], source_etype=u.F32)
        ob = b.gep(out, [b.mul(h, d)], source_etype=u.F32)
        head = b.mul(b.sdiv(h, G), d)
        kh, vh = (b.gep(x, [head], source_etype=u.STORAGE[kv]) for x in (k, v))
        map_pass(b, u.i64(0), d, W, lambda c, msk: u.store(b, zero, ob, c, "f32", msk))
        b.store(ninf, mslot)
        b.store(u.const(u.F32, 0.0), lslot)

        def over_d(body, fixed):   # body(c, mask) over the head's d values
            if fixed:
                for c in range(0, key.d, W):
                    body(u.i64(c), None)
            else:
                map_pass(b, u.i64(0), d, W, body)

        def block(t0, fixed):
            """Keys t0 .. t0 + W − 1 (fixed: all below T, rows at constant offsets)."""
            if fixed:   # byte offsets from one pointer: the loads take them as displacements
                esz = u.ITEMSIZE[kv]
                kb0, vb0 = (b.gep(x, [b.mul(t0, u.i64(key.row * esz))], source_etype=u.I8)
                            for x in (kh, vh))
                krows, vrows = ([b.gep(base, [u.i64(j * key.row * esz)], source_etype=u.I8)
                                 for j in range(W)] for base in (kb0, vb0))
            else:
                last = b.sub(T, u.i64(1))
                krows, vrows = ([b.gep(x, [b.add(b.mul(u.smin(b, b.add(t0, u.i64(j)), last), row),
                                                 head)], source_etype=u.STORAGE[kv])
                                 for j in range(W)] for x in (k, v))
            for a in accs:
                b.store(zero, a)

            def dots(c, msk):
                qv = u.load(b, qb, c, "f32", W, msk)
                for a, kr in zip(accs, krows):
                    b.store(u.intrinsic(b, "llvm.fma", vt, [qv, u.load(b, kr, c, kv, W, msk),
                                                            b.load(a)]), a)
            over_d(dots, fixed)
            s = b.fmul(_key_sums(b, [b.load(a) for a in accs]), u.splat(b, scale, W))
            valid = u.tail_mask(b, u.smin(b, b.sub(T, t0), u.i64(W)), W)
            s = b.select(valid, s, u.const(vt, float("-inf")))
            m = b.load(mslot)
            m2 = fmax(b, m, lane_tree(b, s, fmax))
            alpha = vmath.exp(b, b.fsub(m, m2))
            p = b.select(valid, vmath.exp(b, b.fsub(s, u.splat(b, m2, W))), zero)
            b.store(b.fadd(b.fmul(b.load(lslot), alpha), lane_tree(b, p, fadd)), lslot)
            b.store(m2, mslot)
            ps = [u.splat(b, b.extract_element(p, u.i64(j)), W) for j in range(W)]
            av = u.splat(b, alpha, W)

            def accumulate(c, msk):
                o = b.fmul(u.load(b, ob, c, "f32", W, msk), av)
                for pj, vr in zip(ps, vrows):
                    o = u.intrinsic(b, "llvm.fma", vt, [pj, u.load(b, vr, c, kv, W, msk), o])
                u.store(b, o, ob, c, "f32", msk)
            over_d(accumulate, fixed)

        full = b.add(lo, b.mul(b.sdiv(b.sub(T, lo), u.i64(W)), u.i64(W)))
        with u.Loop(b, lo, full, W, "t") as t0:
            block(t0, static)
        with b.if_then(b.icmp_signed("<", full, T)):
            block(full, False)
        m = b.load(mslot)
        l = b.load(lslot)
        some = b.fcmp_ordered(">", l, u.const(u.F32, 0.0))
        inv = u.splat(b, b.select(some, b.fdiv(u.const(u.F32, 1.0), l), u.const(u.F32, 0.0)), W)
        map_pass(b, u.i64(0), d, W, lambda c, msk: u.store(
            b, b.fmul(u.load(b, ob, c, "f32", W, msk), inv), ob, c, "f32", msk))
        u.store(b, b.select(some, b.fadd(m, vmath.log(b, l)), ninf), lse, h, "f32")


# ---------------------------------------------------------------------------------------------
# the fused training kernels (FlashAttention-2): one launch per forward, one per backward

NB = 2   # output vectors per micro-tile: MR x NB accumulators (8 x 2 zmm on AVX-512)


def _pad(n, m):
    return -(-n // m) * m


def _mm(b, n, nvec, K, a_at, b_at, init, fin, cols=None, krange=None):
    """A micro-GEMM between the kernel's tiles: rows [0, n) in groups of MR (the last group
    may run past n: callers keep those rows in bounds and never use them), nvec W-wide output
    vectors in blocks of NB; acc = init(row, v), then acc = fma(a_at(row, k), b_at(k, v), acc)
    for k = 0 .. K − 1 in order, then fin(row, v, acc). One FMA chain per element in a fixed
    order, so the bits depend on the shapes alone. cols(i0), when given, bounds the columns a
    group of rows from i0 needs: blocks past it are skipped (their outputs left as they were).
    krange(i0), when given, is the [lo, hi) of k outside which a_at is 0 for every row of the
    group from i0 (the causal mask's zeros): the chain runs over it alone, so the diagonal
    tiles skip the products of masked pairs (an FMA adding a zero product leaves a finite sum
    as it was)."""
    W, R = host().f32_lanes, gemm.mr()
    vt = ir.VectorType(u.F32, W)
    for v0 in range(0, nvec, NB):
        vs = range(v0, min(v0 + NB, nvec))
        accs = [[u.entry_alloca(b, vt) for _ in vs] for _ in range(R)]
        with u.Loop(b, u.i64(0), n, R, "mr") as i0:
            if cols is not None:
                do, skip = b.append_basic_block("mr.do"), b.append_basic_block("mr.skip")
                b.cbranch(b.icmp_signed("<", u.i64(v0 * W), cols(i0)), do, skip)
                b.position_at_end(do)
            rows = [b.add(i0, u.i64(r)) for r in range(R)]
            for r in range(R):
                for a, v in zip(accs[r], vs):
                    b.store(init(rows[r], v), a)

            def step(k):
                bv = [b_at(k, v) for v in vs]
                for r in range(R):
                    av = u.splat(b, a_at(rows[r], k), W)
                    for a, x in zip(accs[r], bv):
                        b.store(vmath.fma(b, av, x, b.load(a)), a)

            ks, ke = u.i64(0), K
            if krange is not None:
                lo, hi = krange(i0)
                ke = _clamp(b, hi, u.i64(0), K)
                ks = _clamp(b, lo, u.i64(0), ke)
            u.unrolled(b, ks, ke, gemm.UNROLL, step, "mk")
            for r in range(R):
                for a, v in zip(accs[r], vs):
                    fin(rows[r], v, b.load(a))
            if cols is not None:
                b.branch(skip)
                b.position_at_end(skip)


class _Tiles:
    """The compile-time tile of a fused kernel (key.d, key.bq queries, key.bk keys), its stack
    buffers, and the products and row passes both kernels run."""

    def __init__(self, key, b, T):
        W = host().f32_lanes
        self.b, self.W = b, W
        self.ntiles = b.sdiv(b.add(T, u.i64(key.bk - 1)), u.i64(key.bk))
        self.vt = ir.VectorType(u.F32, W)
        self.D, self.BQ, self.BK = key.d, key.bq, key.bk
        self.DV = -(-self.D // W)               # vectors along d
        self.DP = self.DV * W                   # a stack row of d values
        self.KV = self.BK // W                  # vectors along a key tile
        self.RQ = _pad(self.BQ, gemm.mr())      # stack rows: whole micro-tiles
        self.RK = _pad(self.BK, gemm.mr())
        self.dmask = [None if (v + 1) * W <= self.D
                      else u.tail_mask(b, u.i64(self.D - v * W), W) for v in range(self.DV)]

    def buffer(self, rows, width):
        """A stack tile of `rows` rows of `width`, with a row of slack: a micro-tile's rows
        past the tile may read (never use) a little beyond its end."""
        return gemm.panel_buffer(self.b, (rows + 1) * width)

    def fill(self, buf, n, value):
        b = self.b
        x = u.const(self.vt, value)
        map_pass(b, u.i64(0), n, self.W, lambda c, m: u.store(b, x, buf, c, "f32", m))

    def zero_d(self, buf, off):
        """The D values at buf[off ..] set to 0."""
        for v in range(self.DV):
            u.store(self.b, u.const(self.vt, 0.0), buf, self.b.add(off, u.i64(v * self.W)),
                    "f32", self.dmask[v])

    def panel(self, xT, kvh, k0):
        """The [D, BK] panel of the key tile at k0 in a [KVH, key tiles, D, BK] operand."""
        b = self.b
        tile = b.add(b.mul(kvh, self.ntiles), b.sdiv(k0, u.i64(self.BK)))
        return b.gep(xT, [b.mul(tile, u.i64(self.D * self.BK))], source_etype=u.F32)

    def scores(self, dst, x, xrow, nq, xT, cols=None):
        """dst[i, j] = Σ_d x[xrow(i) + d]·xT[d·BK + j] (in d order) for the rows i < nq of
        the query tile (rounded up to MR) and the BK columns of the key tile; xT is the tile's
        panel (self.panel). Whole-vector loads, no masks: a partial tile's columns past nk
        hold anything, and so do their scores, which no row pass or product reads (on AVX2
        the masks took registers from the accumulators and spilled them)."""
        b, W = self.b, self.W
        _mm(b, nq, self.KV, u.i64(self.D),
            lambda i, d: u.load(b, x, b.add(xrow(i), d), "f32"),
            lambda d, v: u.load(b, xT, b.add(b.mul(d, u.i64(self.BK)), u.i64(v * W)), "f32", W),
            lambda i, v: u.const(self.vt, 0.0),
            lambda i, v, acc: u.store(b, acc, dst, self.at(i, v), "f32"), cols)

    def col(self, i, j):
        """Element offset of column j of stack row i of a score tile."""
        return self.b.add(self.b.mul(i, u.i64(self.BK)), j)

    def at(self, i, v, width=None):
        """Element offset of vector v of stack row i (rows of BK values, or of `width`)."""
        return self.b.add(self.b.mul(i, u.i64(width or self.BK)), u.i64(v * self.W))

    def rows_into(self, acc, n, K, a_at, x, xrow, krange=None):
        """acc[r, :D] += Σ_k a_at(r, k)·x[xrow(k) + :D] for the stack rows r < n (k in order,
        over krange's span: see _mm): a product whose B rows are d values in memory (v, k, q or
        dout rows)."""
        b, W = self.b, self.W
        _mm(b, n, self.DV, K, a_at,
            lambda k, v: u.load(b, x, b.add(xrow(k), u.i64(v * W)), "f32", W, self.dmask[v]),
            lambda r, v: u.load(b, acc, self.at(r, v, self.DP), "f32", W),
            lambda r, v, s: u.store(b, s, acc, self.at(r, v, self.DP), "f32"), krange=krange)

    def keys_of(self, pos, k0, nk, causal, window):
        """krange(i0) of _mm over a key tile's columns for the rows from i0: from the first
        row's lo to the last row's hi (rows past the tile: a wider, safe span)."""
        R = gemm.mr()
        return lambda i0: (self.bounds(pos(i0), k0, nk, causal, window)[0],
                           self.bounds(pos(self.b.add(i0, u.i64(R - 1))), k0, nk, causal,
                                       window)[1])

    def queries_of(self, qpos0, k0, nq, causal, window):
        """krange(j0) of _mm over a query tile (queries at absolute positions qpos0 + i) for
        the keys k0 + j0 .. k0 + j0 + MR − 1: the queries that may attend one of them (causal:
        from the first key's position on; a window w: below the last key's position + w, as
        self.bounds masks them)."""
        b, R = self.b, gemm.mr()

        def krange(j0):
            first = b.sub(b.add(k0, j0), qpos0)
            lo = b.select(causal, first, u.i64(0))
            whi = b.add(b.add(first, u.i64(R)), b.sub(window, u.i64(1)))
            hi = b.select(b.icmp_signed(">", window, u.i64(0)), whi, nq)
            return lo, hi
        return krange

    def needed(self, pos, k0, nk, causal, window):
        """cols(i0) of _mm for a score tile: the keys the rows from i0 (at absolute positions
        pos(i0) ..) attend lie below the last row's hi."""
        R = gemm.mr()
        return lambda i0: self.bounds(pos(self.b.add(i0, u.i64(R - 1))), k0, nk, causal,
                                      window)[1]

    def bounds(self, pos, k0, nk, causal, window):
        """[lo, hi) of the key tile at k0 that the query at absolute position pos attends."""
        b = self.b
        hi = b.select(causal, _clamp(b, b.sub(b.add(pos, u.i64(1)), k0), u.i64(0), nk), nk)
        wlo = _clamp(b, b.sub(b.add(b.sub(pos, window), u.i64(1)), k0), u.i64(0), hi)
        lo = b.select(b.icmp_signed(">", window, u.i64(0)), wlo, u.i64(0))
        return lo, hi


def _fwd(key, b, args, c0, c1):
    """args: q, kT [KVH, key tiles, D, BK], v, out [S, H·D] (row stride H·D), lse [H, S], bias
    [S, ·] (key.bias), S, T, H, KVH, scale, causal, window, query tiles, bias row stride, then
    q's row and head strides and v's (elements: [S, H, D] has H·D and D, a head-major copy [H,
    S, D] has D and S·D). Chunk = (head h, query tile), h outer. The tile's queries run over
    the key tiles they may attend: s = q·kᵀ (stack), the online softmax per row (running max m,
    sum l; p = e^(z − m) over s, alpha = e^(m_old − m)), o = alpha·o + p·v (the FMA chain
    starts from the rescaled o); at the end out = o / l, lse = m + ln l (0 and −inf for a row
    that attended nothing)."""
    q, kT, v, out, lse, bias = (u.arg_ptr(b, args, i) for i in range(6))
    S, T, H, KVH = (u.arg(b, args, i) for i in range(6, 10))
    scale = u.arg_f32(b, args, 10)
    causal = b.icmp_signed("!=", u.arg(b, args, 11), u.i64(0))
    window, nqb, bstride = (u.arg(b, args, i) for i in range(12, 15))
    q_rs, q_hs, v_rs, v_hs = (u.arg(b, args, i) for i in range(15, 19))
    t = _Tiles(key, b, T)
    W, D, BQ, BK, DP = t.W, t.D, t.BQ, t.BK, t.DP
    s = t.buffer(t.RQ, BK)
    o = t.buffer(t.RQ, DP)
    mrow, lrow, arow = (t.buffer(t.RQ, 1) for _ in range(3))
    scales = u.splat(b, scale, W)
    mx, sx = accs_of(b, t.vt, float("-inf")), accs_of(b, t.vt, 0.0)
    ninf, zero1, one = (u.const(u.F32, x) for x in (float("-inf"), 0.0, 1.0))
    HD, off = b.mul(H, u.i64(D)), b.sub(T, S)
    with u.Loop(b, c0, c1, 1, "c") as c:
        h, qt = b.sdiv(c, nqb), b.srem(c, nqb)
        q0 = b.mul(qt, u.i64(BQ))
        nq = u.smin(b, u.i64(BQ), b.sub(S, q0))
        kvh = b.sdiv(h, b.sdiv(H, KVH))
        last = b.sub(S, u.i64(1))
        hd = b.mul(h, u.i64(D))
        qh = b.mul(h, q_hs)
        qrow = lambda i: b.add(b.mul(u.smin(b, b.add(q0, i), last), q_rs), qh)  # noqa: E731
        t.fill(mrow, u.i64(t.RQ), float("-inf"))
        t.fill(lrow, u.i64(t.RQ), 0.0)
        t.fill(arow, u.i64(t.RQ), 1.0)
        t.fill(o, u.i64(t.RQ * DP), 0.0)
        kend = b.select(causal, u.smin(b, T, b.add(off, b.add(q0, nq))), T)
        wstart = b.add(b.sub(b.add(off, q0), window), u.i64(1))
        wstart = b.select(b.icmp_signed("<", wstart, u.i64(0)), u.i64(0), wstart)
        kstart = b.select(b.and_(causal, b.icmp_signed(">", window, u.i64(0))), wstart, u.i64(0))
        kfirst = b.mul(b.sdiv(kstart, u.i64(BK)), u.i64(BK))
        pos = lambda i: b.add(off, b.add(q0, i))  # noqa: E731  (absolute position)
        with u.Loop(b, kfirst, kend, BK, "k0") as k0:
            nk = u.smin(b, u.i64(BK), b.sub(kend, k0))
            t.scores(s, q, qrow, nq, t.panel(kT, kvh, k0),
                     t.needed(pos, k0, nk, causal, window))
            with u.Loop(b, u.i64(0), nq, 1, "r") as i:
                lo, hi = t.bounds(pos(i), k0, nk, causal, window)
                sb = b.gep(s, [b.mul(i, u.i64(BK))], source_etype=u.F32)
                biasb = (b.gep(bias, [b.add(b.mul(b.add(q0, i), bstride), k0)],
                               source_etype=u.F32) if key.bias else None)
                z = _scores(key, b, sb, biasb, scales, W)
                m_old, l_old = u.load(b, mrow, i, "f32"), u.load(b, lrow, i, "f32")
                m_new = fmax(b, max_of(b, lo, hi, W, mx, z), m_old)
                fin = finite(b, m_new)
                shift = b.select(fin, m_new, zero1)
                alpha = b.select(fin, vmath.exp(b, b.fsub(m_old, shift)), one)
                tile_sum = exp_sum(b, lo, hi, W, sx, z, u.splat(b, shift, W), sb)
                _zero_outside(b, sb, lo, hi, nk, W)
                u.store(b, b.fadd(b.fmul(l_old, alpha), tile_sum), lrow, i, "f32")
                u.store(b, m_new, mrow, i, "f32")
                u.store(b, alpha, arow, i, "f32")
            vrow = lambda j: b.add(b.mul(b.add(k0, j), v_rs), b.mul(kvh, v_hs))  # noqa: E731
            _mm(b, nq, t.DV, nk,
                lambda i, j: u.load(b, s, t.col(i, j), "f32"),
                lambda j, vv: u.load(b, v, b.add(vrow(j), u.i64(vv * W)), "f32", W, t.dmask[vv]),
                lambda i, vv: b.fmul(u.load(b, o, t.at(i, vv, DP), "f32", W),
                                     u.splat(b, u.load(b, arow, i, "f32"), W)),
                lambda i, vv, acc: u.store(b, acc, o, t.at(i, vv, DP), "f32"),
                krange=t.keys_of(pos, k0, nk, causal, window))
        with u.Loop(b, u.i64(0), nq, 1, "r") as i:
            m, l = u.load(b, mrow, i, "f32"), u.load(b, lrow, i, "f32")
            some = b.fcmp_ordered(">", l, zero1)
            inv = u.splat(b, b.select(some, b.fdiv(one, l), zero1), W)
            u.store(b, b.select(some, b.fadd(m, vmath.log(b, l)), ninf), lse,
                    b.add(b.mul(h, S), b.add(q0, i)), "f32")
            orow = b.add(b.mul(b.add(q0, i), HD), hd)
            for vv in range(t.DV):
                x = b.fmul(u.load(b, o, t.at(i, vv, DP), "f32", W), inv)
                u.store(b, x, out, b.add(orow, u.i64(vv * W)), "f32", t.dmask[vv])


def _bwd(key, b, args, c0, c1):
    """args: q, k, kT, vT [KVH, key tiles, D, BK], dout, lse and Dr [H, S] (Dr = Σ_d
    dout·out per row), dq [parts, ...], dk, dv [G, T, KVH, D], S, T, H, KVH, scale, causal,
    window, split, parts, kv (0: no dk, dv), then the row and head strides of q, dout and each
    part of dq (one layout), and of k (as the forward's q and v). Chunk = (head h, part),
    h outer: part 0 takes key tiles [0, split), part 1 [split, ·) (parts = 1: all). Per key
    tile (its dk, dv on the stack) the query tiles that may attend it, in order: s = q·kᵀ,
    p = e^(z − lse), dv += pᵀ·dout, dp = dout·vᵀ, ds = p·(dp − Dr)·scale, dk += dsᵀ·q,
    dq[part] += ds·k. Each chunk owns its rows of dq[part] and dk, dv[h mod G]: the caller adds
    the parts and the group's heads in a fixed order, so no result depends on the thread
    count."""
    q, k, kT, vT, g, lse, Dr, dq, dk, dv = (u.arg_ptr(b, args, i) for i in range(10))
    S, T, H, KVH = (u.arg(b, args, i) for i in range(10, 14))
    scale = u.arg_f32(b, args, 14)
    causal = b.icmp_signed("!=", u.arg(b, args, 15), u.i64(0))
    window, split, parts = (u.arg(b, args, i) for i in range(16, 19))
    kv = b.icmp_signed("!=", u.arg(b, args, 19), u.i64(0))
    q_rs, q_hs, k_rs, k_hs = (u.arg(b, args, i) for i in range(20, 24))
    t = _Tiles(key, b, T)
    W, D, BQ, BK, DP = t.W, t.D, t.BQ, t.BK, t.DP
    p = t.buffer(t.RQ, BK)
    ds = t.buffer(t.RQ, BK)
    dka = t.buffer(t.RK, DP)
    dva = t.buffer(t.RK, DP)
    spare = t.buffer(0, DP)
    t.fill(spare, u.i64(DP), 0.0)
    scales = u.splat(b, scale, W)
    G = b.sdiv(H, KVH)
    HD, KD, off = b.mul(H, u.i64(D)), b.mul(KVH, u.i64(D)), b.sub(T, S)
    nkt = b.sdiv(b.add(T, u.i64(BK - 1)), u.i64(BK))
    with u.Loop(b, c0, c1, 1, "c") as c:
        h, part = b.sdiv(c, parts), b.srem(c, parts)
        kvh, gi = b.sdiv(h, G), b.srem(h, G)
        qh = b.mul(h, q_hs)
        last = b.sub(S, u.i64(1))
        qrow = lambda i: b.add(b.mul(u.smin(b, i, last), q_rs), qh)  # noqa: E731
        dqh = b.gep(dq, [b.mul(part, b.mul(S, HD))], source_etype=u.F32)
        with u.Loop(b, u.i64(0), S, 1, "z") as i:
            t.zero_d(dqh, qrow(i))
        first = b.icmp_signed("==", part, u.i64(0))
        kt0 = b.select(first, u.i64(0), split)
        kt1 = b.select(b.and_(first, b.icmp_signed(">", parts, u.i64(1))), split, nkt)
        with u.Loop(b, kt0, kt1, 1, "kt") as kt:
            k0 = b.mul(kt, u.i64(BK))
            nk = u.smin(b, u.i64(BK), b.sub(T, k0))
            t.fill(dka, u.i64(t.RK * DP), 0.0)
            t.fill(dva, u.i64(t.RK * DP), 0.0)
            qlo = b.select(causal, b.sub(k0, off), u.i64(0))
            qlo = b.select(b.icmp_signed("<", qlo, u.i64(0)), u.i64(0), qlo)
            whi = u.smin(b, S, b.sub(b.add(b.add(k0, nk), window), b.add(off, u.i64(1))))
            qhi = b.select(b.and_(causal, b.icmp_signed(">", window, u.i64(0))), whi, S)
            krow = lambda j: b.add(b.mul(b.add(k0, j), k_rs), b.mul(kvh, k_hs))  # noqa: E731
            with u.Loop(b, b.mul(b.sdiv(qlo, u.i64(BQ)), u.i64(BQ)), qhi, BQ, "q0") as q0:
                nq = u.smin(b, u.i64(BQ), b.sub(S, q0))
                rowq = lambda i: qrow(b.add(q0, i))  # noqa: E731
                # a query row within the tile (i < nq), unclamped: the products over queries
                # (krange inside [0, nq)) then step a pointer instead of clamping and
                # multiplying per query (4 integer ops per 12 FMAs kept their loops at the
                # dispatch width)
                inq = lambda i: b.add(b.mul(b.add(q0, i), q_rs), qh)  # noqa: E731
                pos = lambda i: b.add(off, b.add(q0, i))  # noqa: E731
                t.scores(p, q, rowq, nq, t.panel(kT, kvh, k0),
                         t.needed(pos, k0, nk, causal, window))
                with u.Loop(b, u.i64(0), nq, 1, "r") as i:
                    lo, hi = t.bounds(pos(i), k0, nk, causal, window)
                    lv = u.load(b, lse, b.add(b.mul(h, S), b.add(q0, i)), "f32")
                    hi = b.select(finite(b, lv), hi, lo)   # a row that attended nothing: p = 0
                    sb = b.gep(p, [b.mul(i, u.i64(BK))], source_etype=u.F32)
                    z = _scores(key, b, sb, None, scales, W)
                    ls = u.splat(b, lv, W)

                    def p_of(col, m, lanes=W):   # p = e^(z − lse), long_step vectors a step
                        l = ls if lanes == W else u.splat(b, lv, lanes)
                        u.store(b, vmath.exp(b, b.fsub(z(col, m, lanes), l)), sb, col, "f32", m)
                    map_pass(b, lo, hi, W, p_of, long_step(W))
                    _zero_outside(b, sb, lo, hi, u.i64(BK), W)
                queries = t.queries_of(pos(u.i64(0)), k0, nq, causal, window)
                with b.if_then(kv):    # dv += pᵀ·dout
                    t.rows_into(dva, nk, nq, lambda j, i: u.load(b, p, t.col(i, j), "f32"),
                                g, inq, queries)
                t.scores(ds, g, rowq, nq, t.panel(vT, kvh, k0))
                with u.Loop(b, u.i64(0), nq, 1, "r") as i:
                    dr = u.splat(b, u.load(b, Dr, b.add(b.mul(h, S), b.add(q0, i)), "f32"), W)
                    pb = b.gep(p, [b.mul(i, u.i64(BK))], source_etype=u.F32)
                    gb = b.gep(ds, [b.mul(i, u.i64(BK))], source_etype=u.F32)
                    for vv in range(t.KV):
                        col = u.i64(vv * W)
                        x = b.fmul(b.fmul(u.load(b, pb, col, "f32", W),
                                          b.fsub(u.load(b, gb, col, "f32", W), dr)), scales)
                        u.store(b, x, gb, col, "f32")
                with b.if_then(kv):    # dk += dsᵀ·q
                    t.rows_into(dka, nk, nq, lambda j, i: u.load(b, ds, t.col(i, j), "f32"),
                                q, inq, queries)
                # dq[part] += ds·k; a micro-tile's rows past nq add into the spare row (plain
                # loads and stores: AVX2's masked store is microcoded, 12 of them a block)

                def dq_row(i):
                    return b.select(b.icmp_signed("<", i, nq),
                                    b.gep(dqh, [inq(i)], source_etype=u.F32), spare)

                _mm(b, nq, t.DV, nk,
                    lambda i, j: u.load(b, ds, t.col(i, j), "f32"),
                    lambda j, vv: u.load(b, k, b.add(krow(j), u.i64(vv * W)), "f32", W,
                                         t.dmask[vv]),
                    lambda i, vv: u.load(b, dq_row(i), u.i64(vv * W), "f32", W, t.dmask[vv]),
                    lambda i, vv, acc: u.store(b, acc, dq_row(i), u.i64(vv * W), "f32",
                                               t.dmask[vv]),
                    krange=t.keys_of(pos, k0, nk, causal, window))
            with b.if_then(kv):
                dst = b.mul(gi, b.mul(T, KD))
                with u.Loop(b, u.i64(0), nk, 1, "w") as j:
                    row = b.add(dst, b.add(b.mul(b.add(k0, j), KD), b.mul(kvh, u.i64(D))))
                    for vv in range(t.DV):
                        for acc, x in ((dka, dk), (dva, dv)):
                            u.store(b, u.load(b, acc, t.at(j, vv, DP), "f32", W), x,
                                    b.add(row, u.i64(vv * W)), "f32", t.dmask[vv])
