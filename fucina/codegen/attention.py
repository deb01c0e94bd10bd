"""Row kernels of grouped attention (SPEC §3.12). The matrix products (q·kᵀ, p·v and the
backward ones) run on the GEMM kernels; these kernels do everything between them, over score
rows [R, kb] of one (query block, key block) tile, row r = head·Bq + i (query i of the block).

Every row sees keys [lo, hi) of the block: hi = clamp(hi0 + i, 0, kb) (causal: query i attends
keys up to its own position), lo = clamp(lo0 + i, 0, hi) (sliding window); columns outside are
masked. z = s·scale (+ bias[i, c] when the key has a bias).

  online   the online-softmax step of the forward: m' = max(m, max z), alpha = e^(m − m'),
           p = e^(z − m') written over s (0 outside [lo, hi)), l' = l·alpha + Σ p, o *= alpha
           (the caller then adds p·v into o). `first` starts m = −inf, l = 0 and leaves o alone
           (the first p·v overwrites it). A row with nothing to attend keeps alpha = 1, p = 0.
  finish   out = o / l written at the row's place in the [seq, head, d] result, lse = m + ln l
           (0 and −inf for a row that attended nothing).
  probs    backward: p = e^(z − lse) over s, 0 outside [lo, hi).
  dscores  backward: ds = p·(dp − D)·scale written over dp (D = Σ_d dout·out of the row).
  rowdot   D[head, q] = Σ_d a[q, head, :]·b[q, head, :].
  decode   one query row per head against keys [max(0, T − w), T) of an f32 or f16 cache (w = 0:
           all), W keys at a time: their W scores side by side, an online softmax over the
           blocks (no scratch sized by T: a decode step's buffers do not depend on the
           position, so the step can be recorded and replayed).

Sums and maxima fold in the fixed order of rows.fold_pass, and a row never spans two work items,
so the bits do not depend on the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from . import vmath
from .emit import fold, lane_tree
from .kernels import KernelKey, register
from .rows import accs_of, fadd, finite, fmax, fold_pass, map_pass
from .target import host

OPS = ("online", "finish", "probs", "dscores", "rowdot", "decode")


@register
@dataclass(frozen=True)
class AttentionKey(KernelKey):
    """op in OPS; bias: an additive [q, kv] f32 bias on the scaled scores (online, probs);
    kv: the dtype of the keys and values (decode reads an f16 cache as it is); d, row: see
    _decode."""

    family = "attention"
    op: str
    bias: bool = False
    kv: str = "f32"
    d: int = 0      # decode: the head size and the cache's elements per position, when fixed
    row: int = 0    # at build time (0: both runtime arguments)

    def ir(self, symbol: str) -> str:
        if self.op not in OPS:
            raise ValueError(f"attention kernel: unknown op {self.op!r}")
        return u.module(symbol, {"online": _online, "finish": _finish, "probs": _probs,
                                 "dscores": _dscores, "rowdot": _rowdot,
                                 "decode": _decode}[self.op], self)


def _rows(b, c0, c1, per, R):
    return b.mul(c0, per), u.smin(b, b.mul(c1, per), R)


def _clamp(b, v, lo, hi):
    v = b.select(b.icmp_signed("<", v, lo), lo, v)
    return b.select(b.icmp_signed(">", v, hi), hi, v)


def _window(b, i, hi0, lo0, kb):
    """[lo, hi) of the keys row i of the block attends."""
    hi = _clamp(b, b.add(hi0, i), u.i64(0), kb)
    lo = _clamp(b, b.add(lo0, i), u.i64(0), hi)
    return lo, hi


def _scores(key, b, sb, biasb, scales, W):
    """z(c, mask): the scaled (and biased) scores of a row."""
    def z(c, m):
        v = b.fmul(u.load(b, sb, c, "f32", W, m), scales)
        if key.bias:
            v = b.fadd(v, u.load(b, biasb, c, "f32", W, m))
        return v
    return z


def _zero_outside(b, row, lo, hi, kb, W):
    zero = u.const(ir.VectorType(u.F32, W), 0.0)
    map_pass(b, u.i64(0), lo, W, lambda c, m: u.store(b, zero, row, c, "f32", m))
    map_pass(b, hi, kb, W, lambda c, m: u.store(b, zero, row, c, "f32", m))


def _online(key, b, args, c0, c1):
    """args: s, o, m, l, bias, R, kb, d, scale, Bq, hi0, lo0, first, per, bias row stride."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    s, o, mp, lp, bias = (u.arg_ptr(b, args, i) for i in range(5))
    R, kb, d = (u.arg(b, args, i) for i in (5, 6, 7))
    scales = u.splat(b, u.arg_f32(b, args, 8), W)
    Bq, hi0, lo0, first, per, bstride = (u.arg(b, args, i) for i in range(9, 15))
    is_first = b.icmp_signed("!=", first, u.i64(0))
    r0, r1 = _rows(b, c0, c1, per, R)
    mx = accs_of(b, vt, float("-inf"))
    sx = accs_of(b, vt, 0.0)
    ninf = u.const(u.F32, float("-inf"))
    with u.Loop(b, r0, r1, 1, "r") as r:
        i = b.srem(r, Bq)
        lo, hi = _window(b, i, hi0, lo0, kb)
        sb = b.gep(s, [b.mul(r, kb)], source_etype=u.F32)
        biasb = b.gep(bias, [b.mul(i, bstride)], source_etype=u.F32) if key.bias else None
        z = _scores(key, b, sb, biasb, scales, W)
        for p in mx:
            b.store(u.const(vt, float("-inf")), p)
        fold_pass(b, lo, hi, W, mx, z, fmax, float("-inf"))
        m_old = b.select(is_first, ninf, u.load(b, mp, r, "f32"))
        l_old = b.select(is_first, u.const(u.F32, 0.0), u.load(b, lp, r, "f32"))
        m_new = fmax(b, fold(b, mx, fmax), m_old)
        fin = finite(b, m_new)
        shift = b.select(fin, m_new, u.const(u.F32, 0.0))
        alpha = b.select(fin, vmath.exp(b, b.fsub(m_old, shift)), u.const(u.F32, 1.0))
        ms = u.splat(b, shift, W)

        def e(c, msk):
            v = vmath.exp(b, b.fsub(z(c, msk), ms))
            u.store(b, v, sb, c, "f32", msk)
            return v

        for p in sx:
            b.store(u.const(vt, 0.0), p)
        fold_pass(b, lo, hi, W, sx, e, fadd, 0.0)
        _zero_outside(b, sb, lo, hi, kb, W)
        u.store(b, b.fadd(b.fmul(l_old, alpha), fold(b, sx, fadd)), lp, r, "f32")
        u.store(b, m_new, mp, r, "f32")
        with b.if_then(b.not_(is_first)):
            ob = b.gep(o, [b.mul(r, d)], source_etype=u.F32)
            av = u.splat(b, alpha, W)
            map_pass(b, u.i64(0), d, W, lambda c, msk: u.store(
                b, b.fmul(u.load(b, ob, c, "f32", W, msk), av), ob, c, "f32", msk))


def _finish(key, b, args, c0, c1):
    """args: o, m, l, out, lse, R, d, Bq, per, out row stride, lse head stride.
    Row r = h·Bq + i goes to out + i·ostride + h·d and lse[h·lstride + i]."""
    W = host().f32_lanes
    o, mp, lp, out, lse = (u.arg_ptr(b, args, i) for i in range(5))
    R, d, Bq, per, ostride, lstride = (u.arg(b, args, i) for i in range(5, 11))
    r0, r1 = _rows(b, c0, c1, per, R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        h, i = b.sdiv(r, Bq), b.srem(r, Bq)
        l = u.load(b, lp, r, "f32")
        some = b.fcmp_ordered(">", l, u.const(u.F32, 0.0))
        inv = b.select(some, b.fdiv(u.const(u.F32, 1.0), l), u.const(u.F32, 0.0))
        lse_v = b.select(some, b.fadd(u.load(b, mp, r, "f32"), vmath.log(b, l)),
                         u.const(u.F32, float("-inf")))
        u.store(b, lse_v, lse, b.add(b.mul(h, lstride), i), "f32")
        ob = b.gep(o, [b.mul(r, d)], source_etype=u.F32)
        yb = b.gep(out, [b.add(b.mul(i, ostride), b.mul(h, d))], source_etype=u.F32)
        iv = u.splat(b, inv, W)
        map_pass(b, u.i64(0), d, W, lambda c, msk: u.store(
            b, b.fmul(u.load(b, ob, c, "f32", W, msk), iv), yb, c, "f32", msk))


def _probs(key, b, args, c0, c1):
    """args: s, lse, bias, R, kb, scale, Bq, hi0, lo0, per, bias row stride, lse head stride."""
    W = host().f32_lanes
    s, lse, bias = (u.arg_ptr(b, args, i) for i in range(3))
    R, kb = u.arg(b, args, 3), u.arg(b, args, 4)
    scales = u.splat(b, u.arg_f32(b, args, 5), W)
    Bq, hi0, lo0, per, bstride, lstride = (u.arg(b, args, i) for i in range(6, 12))
    r0, r1 = _rows(b, c0, c1, per, R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        h, i = b.sdiv(r, Bq), b.srem(r, Bq)
        lo, hi = _window(b, i, hi0, lo0, kb)
        sb = b.gep(s, [b.mul(r, kb)], source_etype=u.F32)
        biasb = b.gep(bias, [b.mul(i, bstride)], source_etype=u.F32) if key.bias else None
        z = _scores(key, b, sb, biasb, scales, W)
        lv = u.load(b, lse, b.add(b.mul(h, lstride), i), "f32")
        fin = finite(b, lv)
        hi = b.select(fin, hi, lo)   # a row that attended nothing has p = 0 everywhere
        ls = u.splat(b, lv, W)
        map_pass(b, lo, hi, W, lambda c, m: u.store(
            b, vmath.exp(b, b.fsub(z(c, m), ls)), sb, c, "f32", m))
        _zero_outside(b, sb, lo, hi, kb, W)


def _dscores(key, b, args, c0, c1):
    """args: p, dp, D, R, kb, scale, Bq, per, D head stride."""
    W = host().f32_lanes
    p, dp, D = (u.arg_ptr(b, args, i) for i in range(3))
    R, kb = u.arg(b, args, 3), u.arg(b, args, 4)
    scales = u.splat(b, u.arg_f32(b, args, 5), W)
    Bq, per, dstride = (u.arg(b, args, i) for i in range(6, 9))
    r0, r1 = _rows(b, c0, c1, per, R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        h, i = b.sdiv(r, Bq), b.srem(r, Bq)
        dv = u.splat(b, u.load(b, D, b.add(b.mul(h, dstride), i), "f32"), W)
        pb = b.gep(p, [b.mul(r, kb)], source_etype=u.F32)
        gb = b.gep(dp, [b.mul(r, kb)], source_etype=u.F32)

        def body(c, m):
            pv = u.load(b, pb, c, "f32", W, m)
            v = b.fmul(b.fmul(pv, b.fsub(u.load(b, gb, c, "f32", W, m), dv)), scales)
            u.store(b, v, gb, c, "f32", m)
        map_pass(b, u.i64(0), kb, W, body)


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
