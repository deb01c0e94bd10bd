"""Selection kernels (SPEC §3.15, §3.17; C5 §5.11 "selection, indexing and the MoE doorway"):
argmax, top-k, sort / argsort, the MoE router, the value gradient of top-k / sort, and the
routed expert FFN.

The exec layer views the (contiguous) input as [A, N, B] and selects along N. Two walkers:

  row   (B == 1)  item = one row; the row is read with full vectors.
  cols  (B > 1)   item = (a, block of W columns); each lane walks its column serially over n,
                  vector loads and stores of W neighbouring columns (masked in the last block).

argmax  seed (-inf, none), strict `>`: per lane the first maximum wins; lanes and unrolled
        accumulators merge by (larger value, then smaller index), so the result is the first
        maximum of the row. NaN never compares greater, so it never wins. A row with no
        winner (every element -inf or NaN) takes its first -inf index, or 0 (all NaN).
top-k   k <= INSERT_MAX descending slots on the stack, seeded (-inf, 0), copied to the output
        when the row is done; the admission threshold (the last slot's value) in a register.
        A value enters only if `>` the threshold (NaN and -inf never do) and goes after every
        slot >= it (ties keep the lower index first).
        Rows: 4 vectors at a time are compared with the threshold; only a vector with an
        admitted lane goes lane by lane through the scalar insertion, so a long row costs
        about one compare per vector once the slots hold large values.
        Columns: a branch-free vector insertion over the slots, run when a lane is admitted.
sort    LSD radix sort, 8-bit digits, of order-preserving u32 keys (descending: the keys
        complemented; NaN: the largest key either way, so NaN sorts last), carrying u32 source
        indices; a pass is skipped when every key shares its digit; rows of <= 32 elements use
        an insertion sort. Stable, so equal values keep ascending index order (SPEC calls sort
        unstable: any tie order is allowed). Mode "topk" writes only the first k entries of a
        descending sort with NaN and -inf entries turned into (-inf, 0): exactly the top-k
        slots, used for large k. Each chunk owns a scratch block [4, N] of u32.
grad    dx = 0, then dx[.., idx[s], ..] += g[.., s, ..] in slot order (one row per item).
router  top-k by logit (the row walker), then w = e^(l - m) / sum_j e^(l_j - m) over the full
        row (m the row max, the sums folded as in codegen/rows.py), then w /= sum of the k
        selected w when asked and that sum is > 0.
moe     the routed expert FFN, in two launches. gate_up: item = (expert group, block of FB
        rows of the expert's gate/up); for every token routed to the expert (4, 2 or 1 at a
        time, one weight row read for all of them) h[pair, f] = act(up_f · x_t, gate_f · x_t),
        act a gated emitter of codegen/activations.py (src(up)·act(gate)). down: item = a
        block of HB output rows; for every group o[pair, r] = down_r · h[pair] (a few rows at
        a time), then y[t, r] = the sum over t's slots, in slot order, of weight ·
        o[pair(t, slot), r]. Every dot product has its own vector accumulator (FMAs in index
        order, a masked tail, the fixed lane tree) whatever the blocking, so one token alone
        and the same token in a batch give the same bits, at any thread count.

Argument blocks are documented at each key.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import lane_tree
from .kernels import KernelKey, register
from .rows import UNROLL, accs_of, map_pass, row_max_sum
from .target import host

NEG_INF = float("-inf")
I64_MAX = (1 << 63) - 1
SMALL_SORT = 32   # rows up to this long are insertion-sorted
INSERT_MAX = 64   # top-k slots kept on the stack; larger k goes to the sort kernel
PREFETCH = 1024   # row walkers: elements ahead of the walk to prefetch
TOKEN_BLOCKS = (4, 2, 1)          # moe: tokens of one expert computed together, with one row
DOWN_ROWS = {4: 2, 2: 4, 1: 4}    # of gate and up, or this many rows of down (one accumulator
#                                   per row and token). More gate/up rows at once measured
#                                   slower: rows 4 KiB apart (hidden 1024) fight over L1 sets.


# ---------------------------------------------------------------------------------------------
# small IR helpers

def _vt(W):
    return ir.VectorType(u.F32, W)


def _it(W):
    return ir.VectorType(u.I64, W)


def _any(b, mask, W):
    """i1: some lane of a <W x i1> mask is on."""
    return b.icmp_unsigned("!=", b.bitcast(mask, ir.IntType(W)), ir.Constant(ir.IntType(W), 0))


def _bits(b, mask, W):
    """The lanes of a <W x i1> mask as the low W bits of an i64."""
    return b.zext(b.bitcast(mask, ir.IntType(W)), u.I64)


def _var(b, ty, init):
    """A mutable local (an entry-block slot mem2reg turns into registers), set to init."""
    p = u.entry_alloca(b, ty)
    b.store(init, p)
    return p


def _stack(b, ty, n: int):
    """A stack array of n values of type ty, allocated once in the entry block."""
    entry = b.function.entry_basic_block
    with b.goto_block(entry):
        if entry.instructions:
            b.position_before(entry.instructions[0])
        return b.alloca(ty, size=u.i64(n))


def _items(b, c0, c1, per, total):
    return b.mul(c0, per), u.smin(b, b.mul(c1, per), total)


# ---------------------------------------------------------------------------------------------
# top-k slots and the row walker

class _Slots:
    """k descending (value, index) slots at ov (f32) and oi (i64), and the admission threshold
    (the last slot's value) in a register."""

    def __init__(self, b, ov, oi, k):
        self.b, self.ov, self.oi, self.k = b, ov, oi, k
        self.last = b.sub(k, u.i64(1))
        self.thr = u.entry_alloca(b, u.F32)
        self.pos = u.entry_alloca(b, u.I64)

    def reset(self):
        b = self.b
        with u.Loop(b, u.i64(0), self.k, 1, "slot0") as s:
            u.store(b, u.const(u.F32, NEG_INF), self.ov, s, "f32")
            u.store(b, u.i64(0), self.oi, s, "i64")
        b.store(u.const(u.F32, NEG_INF), self.thr)

    def insert(self, v, idx):
        """Admit v (f32) with index idx if v > the last slot: after every slot >= v."""
        b, ov, oi = self.b, self.ov, self.oi
        with b.if_then(b.fcmp_ordered(">", v, u.load(b, ov, self.last, "f32"))):
            b.store(self.last, self.pos)

            def cond():
                s = b.load(self.pos)
                above = b.select(b.icmp_signed(">", s, u.i64(0)), b.sub(s, u.i64(1)), u.i64(0))
                return b.and_(b.icmp_signed(">", s, u.i64(0)),
                              b.fcmp_ordered("<", u.load(b, ov, above, "f32"), v))

            def shift():
                s = b.load(self.pos)
                above = b.sub(s, u.i64(1))
                u.store(b, u.load(b, ov, above, "f32"), ov, s, "f32")
                u.store(b, u.load(b, oi, above, "i64"), oi, s, "i64")
                b.store(above, self.pos)

            u.while_loop(b, cond, shift, "ins")
            s = b.load(self.pos)
            u.store(b, v, ov, s, "f32")
            u.store(b, idx, oi, s, "i64")
            b.store(u.load(b, ov, self.last, "f32"), self.thr)

    def admit(self, v, base, W):
        """Every lane of vector v (elements base..base+W-1) above the threshold, in lane order."""
        b = self.b
        bits = _var(b, u.I64, _bits(b, b.fcmp_ordered(">", v, u.splat(b, b.load(self.thr), W)), W))

        def lane():
            m = b.load(bits)
            b.store(b.and_(m, b.sub(m, u.i64(1))), bits)
            i = u.intrinsic(b, "llvm.cttz", u.I64, [m, ir.Constant(u.I1, 1)], types=[u.I64])
            self.insert(b.extract_element(v, i), b.add(base, i))

        u.while_loop(b, lambda: b.icmp_unsigned("!=", b.load(bits), u.i64(0)), lane, "lane")


def _topk_row(b, slots: _Slots, xb, N, dt: str, W: int):
    """Fill the slots from the contiguous row xb[0:N] (dtype dt)."""
    slots.reset()
    step = UNROLL * W
    n4 = b.sub(N, b.srem(N, u.i64(step)))
    with u.Loop(b, u.i64(0), n4, step, "t4") as c:
        vs = [u.load(b, xb, b.add(c, u.i64(t * W)), dt, W) for t in range(UNROLL)]
        for t in range(UNROLL):
            u.prefetch(b, xb, b.add(c, u.i64(PREFETCH + t * W)), dt)
        thr = u.splat(b, b.load(slots.thr), W)
        hit = b.fcmp_ordered(">", vs[0], thr)
        for v in vs[1:]:
            hit = b.or_(hit, b.fcmp_ordered(">", v, thr))
        with b.if_then(_any(b, hit, W)):
            for t, v in enumerate(vs):
                slots.admit(v, b.add(c, u.i64(t * W)), W)
    n1 = b.sub(N, b.srem(N, u.i64(W)))
    with u.Loop(b, n4, n1, W, "t1") as c:
        slots.admit(u.load(b, xb, c, dt, W), c, W)
    rest = b.sub(N, n1)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        slots.admit(u.load(b, xb, n1, dt, W, u.tail_mask(b, rest, W), NEG_INF), n1, W)


# ---------------------------------------------------------------------------------------------
# argmax, top-k, router

@register
@dataclass(frozen=True)
class SelectKey(KernelKey):
    """op: argmax | topk | router; dtype: the input's (f32, f16, bf16; router f32);
    rows: B == 1 (the row walker) or not (the column walker; router is rows only).

    Argument blocks (items: rows A, or A * ceil(B / W) column blocks; `per` items per chunk):
      argmax  x, out (i64 [A, B]), A, N, B, per
      topk    x, values ([A, k, B], dtype), indices (i64 [A, k, B]), A, N, B, k, per
      router  x, weights (f32 [A, k]), selected (i64 [A, k]), A, N, k, per, normalize (0/1)"""

    family = "select"
    op: str
    dtype: str
    rows: bool

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        {"argmax": _argmax, "topk": _topk, "router": _router}[self.op](self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _better(b, va, ia, vb, ib):
    """(v, i) of the better of two candidates: the larger value, on a tie the smaller index."""
    take = b.or_(b.fcmp_ordered(">", vb, va),
                 b.and_(b.fcmp_ordered("==", vb, va), b.icmp_signed("<", ib, ia)))
    return b.select(take, vb, va), b.select(take, ib, ia)


def _argmax_row(b, xb, N, dt, W):
    """The index (i64) of the first maximum of the contiguous row xb[0:N] (see the module doc)."""
    vt, it = _vt(W), _it(W)
    bv = [_var(b, vt, u.const(vt, NEG_INF)) for _ in range(UNROLL)]
    bi = [_var(b, it, u.const(it, I64_MAX)) for _ in range(UNROLL)]
    iota = u.iota(W)

    def step(slot, c, mask=None):
        v = u.load(b, xb, c, dt, W, mask, NEG_INF)
        take = b.fcmp_ordered(">", v, b.load(bv[slot]))
        b.store(b.select(take, v, b.load(bv[slot])), bv[slot])
        b.store(b.select(take, b.add(u.splat(b, c, W), iota), b.load(bi[slot])), bi[slot])

    big = b.sub(N, b.srem(N, u.i64(UNROLL * W)))
    with u.Loop(b, u.i64(0), big, UNROLL * W, "a4") as c:
        for t in range(UNROLL):
            u.prefetch(b, xb, b.add(c, u.i64(PREFETCH + t * W)), dt)
            step(t, b.add(c, u.i64(t * W)))
    full = b.sub(N, b.srem(N, u.i64(W)))
    with u.Loop(b, big, full, W, "a1") as c:
        step(0, c)
    rest = b.sub(N, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        step(1, full, u.tail_mask(b, rest, W))
    v01 = _better(b, b.load(bv[0]), b.load(bi[0]), b.load(bv[1]), b.load(bi[1]))
    v23 = _better(b, b.load(bv[2]), b.load(bi[2]), b.load(bv[3]), b.load(bi[3]))
    v, i = _better(b, *v01, *v23)
    n = W
    while n > 1:  # lanes: halves, low against high
        h = n // 2
        lo = ir.Constant(ir.VectorType(u.I32, h), list(range(h)))
        hi = ir.Constant(ir.VectorType(u.I32, h), list(range(h, n)))
        v, i = _better(b, b.shuffle_vector(v, v, lo), b.shuffle_vector(i, i, lo),
                       b.shuffle_vector(v, v, hi), b.shuffle_vector(i, i, hi))
        n = h
    best = _var(b, u.I64, b.extract_element(i, u.i64(0)))
    with b.if_then(b.icmp_signed("==", b.load(best), u.i64(I64_MAX))):
        # no element beat -inf: the first -inf, else (all NaN) 0
        j = _var(b, u.I64, u.i64(0))

        def cond():
            at = b.load(j)
            safe = u.smin(b, at, b.sub(N, u.i64(1)))
            return b.and_(b.icmp_signed("<", at, N),
                          b.fcmp_unordered("!=", u.load(b, xb, safe, dt), u.const(u.F32, NEG_INF)))

        u.while_loop(b, cond, lambda: b.store(b.add(b.load(j), u.i64(1)), j), "ninf")
        at = b.load(j)
        b.store(b.select(b.icmp_signed("<", at, N), at, u.i64(0)), best)
    return b.load(best)


def _argmax(key, b, args, c0, c1):
    W = host().f32_lanes
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, per = (u.arg(b, args, i) for i in range(2, 6))
    if key.rows:
        r0, r1 = _items(b, c0, c1, per, A)
        with u.Loop(b, r0, r1, 1, "r") as r:
            u.store(b, _argmax_row(b, b.gep(x, [b.mul(r, N)], source_etype=u.STORAGE[key.dtype]),
                                   N, key.dtype, W), out, r, "i64")
        return
    vt, it = _vt(W), _it(W)
    nblk = b.sdiv(b.add(B, u.i64(W - 1)), u.i64(W))
    q0, q1 = _items(b, c0, c1, per, b.mul(A, nblk))
    bv, bi = u.entry_alloca(b, vt), u.entry_alloca(b, it)
    with u.Loop(b, q0, q1, 1, "q") as q:
        a = b.sdiv(q, nblk)
        b0 = b.mul(b.srem(q, nblk), u.i64(W))
        lm = u.tail_mask(b, u.smin(b, u.i64(W), b.sub(B, b0)), W)
        base = b.add(b.mul(a, b.mul(N, B)), b0)
        b.store(u.const(vt, NEG_INF), bv)
        b.store(u.const(it, -1), bi)
        with u.Loop(b, u.i64(0), N, 1, "n") as n:
            v = u.load(b, x, b.add(base, b.mul(n, B)), key.dtype, W, lm, NEG_INF)
            best, idx = b.load(bv), b.load(bi)
            none = b.icmp_signed("<", idx, u.const(it, 0))
            take = b.or_(b.fcmp_ordered(">", v, best), b.and_(none, b.fcmp_ordered("==", v, best)))
            b.store(b.select(take, v, best), bv)
            b.store(b.select(take, u.splat(b, n, W), idx), bi)
        idx = b.load(bi)
        idx = b.select(b.icmp_signed("<", idx, u.const(it, 0)), u.const(it, 0), idx)
        u.store(b, idx, out, b.add(b.mul(a, B), b0), "i64", lm)


def _topk(key, b, args, c0, c1):
    """Slots live on the stack (INSERT_MAX of them; the exec layer sends larger k to the sort
    kernel) and go to the output once the row or column block is done."""
    W = host().f32_lanes
    x, ov, oi = (u.arg_ptr(b, args, i) for i in range(3))
    A, N, B, k, per = (u.arg(b, args, i) for i in range(3, 8))
    st = u.STORAGE[key.dtype]
    if key.rows:
        sv, si = _stack(b, u.F32, INSERT_MAX), _stack(b, u.I64, INSERT_MAX)
        slots = _Slots(b, sv, si, k)
        r0, r1 = _items(b, c0, c1, per, A)
        with u.Loop(b, r0, r1, 1, "r") as r:
            _topk_row(b, slots, b.gep(x, [b.mul(r, N)], source_etype=st), N, key.dtype, W)
            rk = b.mul(r, k)
            with u.Loop(b, u.i64(0), k, 1, "out") as s:
                u.store(b, u.load(b, sv, s, "f32"), ov, b.add(rk, s), key.dtype)
                u.store(b, u.load(b, si, s, "i64"), oi, b.add(rk, s), "i64")
        return
    vt, it = _vt(W), _it(W)
    sv, si = _stack(b, vt, INSERT_MAX), _stack(b, it, INSERT_MAX)

    def sv_at(s):
        return b.gep(sv, [s], source_etype=vt)

    def si_at(s):
        return b.gep(si, [s], source_etype=it)

    nblk = b.sdiv(b.add(B, u.i64(W - 1)), u.i64(W))
    q0, q1 = _items(b, c0, c1, per, b.mul(A, nblk))
    s_p, go = u.entry_alloca(b, u.I64), u.entry_alloca(b, u.I1)
    last = b.sub(k, u.i64(1))
    with u.Loop(b, q0, q1, 1, "q") as q:
        a = b.sdiv(q, nblk)
        b0 = b.mul(b.srem(q, nblk), u.i64(W))
        lm = u.tail_mask(b, u.smin(b, u.i64(W), b.sub(B, b0)), W)
        xbase = b.add(b.mul(a, b.mul(N, B)), b0)
        with u.Loop(b, u.i64(0), k, 1, "init") as s:
            b.store(u.const(vt, NEG_INF), sv_at(s))
            b.store(u.const(it, 0), si_at(s))
        with u.Loop(b, u.i64(0), N, 1, "n") as n:
            v = u.load(b, x, b.add(xbase, b.mul(n, B)), key.dtype, W, lm, NEG_INF)
            with b.if_then(_any(b, b.fcmp_ordered(">", v, b.load(sv_at(last))), W)):
                # branch-free insertion, bottom slot first: slot s takes slot s-1 where v also
                # beats slot s-1, else v where v beats slot s; stops at the first slot no lane beats
                b.store(last, s_p)
                b.store(ir.Constant(u.I1, 1), go)

                def cond():
                    return b.and_(b.load(go), b.icmp_signed(">=", b.load(s_p), u.i64(0)))

                def body():
                    s = b.load(s_p)
                    above = b.select(b.icmp_signed(">", s, u.i64(0)), b.sub(s, u.i64(1)), u.i64(0))
                    cur_v, cur_i = b.load(sv_at(s)), b.load(si_at(s))
                    up_v, up_i = b.load(sv_at(above)), b.load(si_at(above))
                    beats = b.fcmp_ordered(">", v, cur_v)
                    from_up = b.and_(b.fcmp_ordered(">", v, up_v),
                                     u.splat(b, b.icmp_signed(">", s, u.i64(0)), W))
                    b.store(b.select(beats, b.select(from_up, up_v, v), cur_v), sv_at(s))
                    b.store(b.select(beats, b.select(from_up, up_i, u.splat(b, n, W)), cur_i), si_at(s))
                    b.store(_any(b, beats, W), go)
                    b.store(b.sub(s, u.i64(1)), s_p)

                u.while_loop(b, cond, body, "vins")
        obase = b.add(b.mul(a, b.mul(k, B)), b0)
        with u.Loop(b, u.i64(0), k, 1, "out") as s:
            o = b.add(obase, b.mul(s, B))
            u.store(b, b.load(sv_at(s)), ov, o, key.dtype, lm)
            u.store(b, b.load(si_at(s)), oi, o, "i64", lm)


def _router(key, b, args, c0, c1):
    W = host().f32_lanes
    x, wo, so = (u.arg_ptr(b, args, i) for i in range(3))
    A, N, k, per, normalize = (u.arg(b, args, i) for i in range(3, 8))
    vt = _vt(W)
    mx, sx = accs_of(b, vt, NEG_INF), accs_of(b, vt, 0.0)
    total = u.entry_alloca(b, u.F32)
    r0, r1 = _items(b, c0, c1, per, A)
    from .vmath import exp

    with u.Loop(b, r0, r1, 1, "r") as r:
        rk = b.mul(r, k)
        wr, sr = b.gep(wo, [rk], source_etype=u.F32), b.gep(so, [rk], source_etype=u.I64)
        xb = b.gep(x, [b.mul(r, N)], source_etype=u.F32)
        _topk_row(b, _Slots(b, wr, sr, k), xb, N, "f32", W)
        m, S = row_max_sum(b, xb, N, W, mx, sx)
        b.store(u.const(u.F32, 0.0), total)
        with u.Loop(b, u.i64(0), k, 1, "w") as s:
            w = b.fdiv(exp(b, b.fsub(u.load(b, wr, s, "f32"), m)), S)
            u.store(b, w, wr, s, "f32")
            b.store(b.fadd(b.load(total), w), total)
        t = b.load(total)
        norm = b.and_(b.icmp_signed("!=", normalize, u.i64(0)), b.fcmp_ordered(">", t, u.const(u.F32, 0.0)))
        with b.if_then(norm):
            with u.Loop(b, u.i64(0), k, 1, "n") as s:
                u.store(b, b.fdiv(u.load(b, wr, s, "f32"), t), wr, s, "f32")


# ---------------------------------------------------------------------------------------------
# sort

@register
@dataclass(frozen=True)
class SortKey(KernelKey):
    """Sort every row (a, b) of [A, N, B] along N (see the module doc); mode sort | topk.

    Argument block: x, values (dtype), indices (i64), scratch (u32 [chunks, 4, N]), A, N, B,
    rows per chunk, descending (0/1; topk: 1), k (topk: entries written; sort: N)."""

    family = "sort"
    dtype: str
    mode: str = "sort"

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _sort, self)


def _key_of(b, v, flip):
    """The u32 sort key of f32 v: order-preserving bits, complemented by flip (all ones when
    descending), NaN always the largest key."""
    bits = b.bitcast(v, u.I32)
    neg = b.icmp_signed("<", bits, ir.Constant(u.I32, 0))
    ordered = b.select(neg, b.xor(bits, ir.Constant(u.I32, -1)), b.or_(bits, ir.Constant(u.I32, -(1 << 31))))
    return b.select(b.fcmp_unordered("uno", v, v), ir.Constant(u.I32, -1), b.xor(ordered, flip))


def _u32(b, p, i):
    """The address of element i of a u32 array."""
    return b.gep(p, [i], source_etype=u.I32)


def _ld32(b, p, i):
    return b.load(_u32(b, p, i), typ=u.I32)


def _sort(key, b, args, c0, c1):
    W = host().f32_lanes
    x, ov, oi, scratch = (u.arg_ptr(b, args, i) for i in range(4))
    A, N, B, per, desc, kout = (u.arg(b, args, i) for i in range(4, 10))
    dt = key.dtype
    i32 = u.I32
    flip = b.select(b.icmp_signed("!=", desc, u.i64(0)), ir.Constant(i32, -1), ir.Constant(i32, 0))
    cnt = _stack(b, i32, 1024)  # the 4 digit histograms
    zeros = ir.Constant(ir.VectorType(i32, W), [ir.Constant(i32, 0)] * W)
    src_k, src_i, dst_k, dst_i = (u.entry_alloca(b, u.PTR) for _ in range(4))
    key0, run = u.entry_alloca(b, i32), u.entry_alloca(b, i32)
    j_p = u.entry_alloca(b, u.I64)
    with u.Loop(b, c0, c1, 1, "c") as c:
        base = _u32(b, scratch, b.mul(c, b.mul(N, u.i64(4))))
        K0, I0, K1, I1 = (_u32(b, base, b.mul(N, u.i64(i))) for i in range(4))
        r0 = b.mul(c, per)
        r1 = u.smin(b, b.add(r0, per), b.mul(A, B))
        with u.Loop(b, r0, r1, 1, "row") as r:
            a, col = b.sdiv(r, B), b.srem(r, B)
            xrow = b.add(b.mul(a, b.mul(N, B)), col)
            orow = b.add(b.mul(a, b.mul(kout, B)), col)
            with u.Loop(b, u.i64(0), u.i64(1024 // W), 1, "z") as z:
                zs = b.store(zeros, b.bitcast(_u32(b, cnt, b.mul(z, u.i64(W))), ir.PointerType(zeros.type)))
                zs.align = 4
            with u.Loop(b, u.i64(0), N, 1, "key") as n:
                kv = _key_of(b, u.load(b, x, b.add(xrow, b.mul(n, B)), dt), flip)
                b.store(kv, _u32(b, K0, n))
                b.store(b.trunc(n, i32), _u32(b, I0, n))
                for d in range(4):
                    digit = b.and_(b.lshr(kv, ir.Constant(i32, 8 * d)), ir.Constant(i32, 255))
                    p = _u32(b, cnt, b.add(b.zext(digit, u.I64), u.i64(256 * d)))
                    b.store(b.add(b.load(p), ir.Constant(i32, 1)), p)
            for p, v in ((src_k, K0), (src_i, I0), (dst_k, K1), (dst_i, I1)):
                b.store(v, p)
            with b.if_else(b.icmp_signed("<=", N, u.i64(SMALL_SORT))) as (then, otherwise):
                with then:
                    _insertion_sort(b, K0, I0, N, j_p)
                with otherwise:
                    b.store(_ld32(b, K0, u.i64(0)), key0)
                    with u.Loop(b, u.i64(0), u.i64(4), 1, "digit") as d:
                        _radix_pass(b, d, N, (src_k, src_i, dst_k, dst_i), cnt, key0, run)
            si = b.load(src_i)
            with u.Loop(b, u.i64(0), kout, 1, "out") as i:
                j = b.zext(_ld32(b, si, i), u.I64)
                v = u.load(b, x, b.add(xrow, b.mul(j, B)), dt)
                if key.mode == "topk":  # a NaN or -inf entry is an unfilled top-k slot
                    bad = b.fcmp_unordered("ueq", v, u.const(u.F32, NEG_INF))
                    v = b.select(bad, u.const(u.F32, NEG_INF), v)
                    j = b.select(bad, u.i64(0), j)
                o = b.add(orow, b.mul(i, B))
                u.store(b, v, ov, o, dt)
                u.store(b, j, oi, o, "i64")


def _insertion_sort(b, K, I, N, j_p):
    """Stable in-place insertion sort of keys K[0:N] (u32) carrying I."""
    with u.Loop(b, u.i64(1), N, 1, "ins") as i:
        kv, iv = _ld32(b, K, i), _ld32(b, I, i)
        b.store(i, j_p)

        def cond():
            j = b.load(j_p)
            above = b.select(b.icmp_signed(">", j, u.i64(0)), b.sub(j, u.i64(1)), u.i64(0))
            return b.and_(b.icmp_signed(">", j, u.i64(0)), b.icmp_unsigned(">", _ld32(b, K, above), kv))

        def shift():
            j = b.load(j_p)
            above = b.sub(j, u.i64(1))
            b.store(_ld32(b, K, above), _u32(b, K, j))
            b.store(_ld32(b, I, above), _u32(b, I, j))
            b.store(above, j_p)

        u.while_loop(b, cond, shift, "sh")
        j = b.load(j_p)
        b.store(kv, _u32(b, K, j))
        b.store(iv, _u32(b, I, j))


def _radix_pass(b, d, N, ptrs, cnt, key0, run):
    """Scatter the keys (and indices) by digit d (an i64 0..3) from src to dst, then swap;
    skipped when every key has key0's digit (digit d's histogram is one bucket of N)."""
    i32 = u.I32
    src_k, src_i, dst_k, dst_i = ptrs
    shift = b.trunc(b.mul(d, u.i64(8)), i32)
    hist = _u32(b, cnt, b.mul(d, u.i64(256)))

    def bucket(kv):
        return _u32(b, hist, b.zext(b.and_(b.lshr(kv, shift), ir.Constant(i32, 255)), u.I64))

    with b.if_then(b.icmp_signed("!=", b.zext(b.load(bucket(b.load(key0))), u.I64), N)):
        b.store(ir.Constant(i32, 0), run)
        with u.Loop(b, u.i64(0), u.i64(256), 1, "pre") as g:  # exclusive prefix sums
            p = _u32(b, hist, g)
            c = b.load(p)
            b.store(b.load(run), p)
            b.store(b.add(b.load(run), c), run)
        sk, si, dk, di = (b.load(p) for p in ptrs)
        with u.Loop(b, u.i64(0), N, 1, "scatter") as i:
            kv = _ld32(b, sk, i)
            p = bucket(kv)
            pos = b.load(p)
            b.store(b.add(pos, ir.Constant(i32, 1)), p)
            dest = b.zext(pos, u.I64)
            b.store(kv, _u32(b, dk, dest))
            b.store(_ld32(b, si, i), _u32(b, di, dest))
        for p, v in zip(ptrs, (dk, di, sk, si)):
            b.store(v, p)


# ---------------------------------------------------------------------------------------------
# gradient of top-k / sort values

@register
@dataclass(frozen=True)
class SelectGradKey(KernelKey):
    """dx [A, N, B] = 0, then dx[a, idx[a, s, b], b] += g[a, s, b] for s = 0 .. k-1 in order.

    Argument block: g (f32 [A, k, B]), idx (i64 [A, k, B]), dx (f32 [A, N, B]), A, N, k, B,
    rows a per chunk."""

    family = "select_grad"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().f32_lanes
        g, idx, dx = (u.arg_ptr(b, args, i) for i in range(3))
        A, N, k, B, per = (u.arg(b, args, i) for i in range(3, 8))
        a0, a1 = _items(b, c0, c1, per, A)
        with u.Loop(b, a0, a1, 1, "a") as a:
            NB = b.mul(N, B)
            row = b.gep(dx, [b.mul(a, NB)], source_etype=u.F32)
            map_pass(b, u.i64(0), NB, W, lambda c, m: u.store(b, u.const(_vt(W), 0.0), row, c, "f32", m))
            src = b.mul(a, b.mul(k, B))
            with u.Loop(b, u.i64(0), b.mul(k, B), 1, "e") as e:
                j = u.load(b, idx, b.add(src, e), "i64")
                col = b.srem(e, B)
                p = b.add(b.mul(j, B), col)
                u.store(b, b.fadd(u.load(b, row, p, "f32"), u.load(b, g, b.add(src, e), "f32")),
                        row, p, "f32")
        b.ret_void()
        return str(mod)


# ---------------------------------------------------------------------------------------------
# the routed expert FFN

@register
@dataclass(frozen=True)
class MoeKey(KernelKey):
    """phase: gate_up | down; wdtype: the phase's expert weights (f32 | f16); act: the gated op.

    Routing tables (i64): groups [G, 3] = (expert, first pair, pair count), pairs sorted by
    expert; ptok [P] = the token of each pair; slot_pair [T, K] = the pair of each (token, slot).
      gate_up  x (f32 [T, H]), gate, up ([E*F, H]), h (f32 [P, F]), groups, ptok, H, F,
               row blocks per group, FB, items per chunk, items
      down     h, down ([E*H, F]), o (f32 [P, H] scratch), y (f32 [T, H]), groups, slot_pair,
               route weights (f32 [T, K]), H, F, G, T, K, HB, items per chunk, items"""

    family = "moe"
    phase: str
    wdtype: str
    act: str = ""

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        (_moe_gate_up if self.phase == "gate_up" else _moe_down)(self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _dots(b, rows, rdt, vecs, L, W):
    """Every dot product rows[i] · vecs[j] over L elements (rows of dtype rdt, vecs f32): one
    accumulator each, FMAs in index order, a masked tail, then the fixed lane tree."""
    vt = _vt(W)
    accs = [[_var(b, vt, u.const(vt, 0.0)) for _ in vecs] for _ in rows]

    def step(j, mask=None):
        xs = [u.load(b, p, j, "f32", W, mask) for p in vecs]
        for r, acc in zip(rows, accs):
            w = u.load(b, r, j, rdt, W, mask)
            for p, xv in zip(acc, xs):
                b.store(u.intrinsic(b, "llvm.fma", vt, [w, xv, b.load(p)]), p)

    full = b.sub(L, b.srem(L, u.i64(W)))
    with u.Loop(b, u.i64(0), full, W, "dot") as j:
        step(j)
    rest = b.sub(L, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        step(full, u.tail_mask(b, rest, W))
    return [[lane_tree(b, b.load(p), lambda bb, x, y: bb.fadd(x, y)) for p in acc] for acc in accs]


def _blocked(b, start, stop, sizes, body):
    """body(first, n) over [start, stop) in blocks: as many blocks of sizes[0] as fit, then of
    sizes[1], ... (sizes descending, the last 1)."""
    pos = _var(b, u.I64, start)
    for n in sizes:
        def step(n=n):
            at = b.load(pos)
            body(at, n)
            b.store(b.add(at, u.i64(n)), pos)

        u.while_loop(b, lambda n=n: b.icmp_signed("<=", b.add(b.load(pos), u.i64(n)), stop), step, f"blk{n}")


def _group(b, groups, g):
    return [u.load(b, groups, b.add(b.mul(g, u.i64(3)), u.i64(i)), "i64") for i in range(3)]


def _token_rows(b, ptr, stride, index, p, n):
    """Row pointers ptr + index(pair) * stride of the n pairs p, p+1, ..."""
    return [b.gep(ptr, [b.mul(index(b.add(p, u.i64(i))), stride)], source_etype=u.F32) for i in range(n)]


def _moe_gate_up(key, b, args, c0, c1):
    from .activations import OPS

    W = host().f32_lanes
    act = OPS[key.act][1]
    x, wg, wu, h, groups, ptok = (u.arg_ptr(b, args, i) for i in range(6))
    H, F, nrb, FB, per, items = (u.arg(b, args, i) for i in range(6, 12))
    st = u.STORAGE[key.wdtype]
    q0, q1 = _items(b, c0, c1, per, items)
    with u.Loop(b, q0, q1, 1, "q") as q:
        e, p0, m = _group(b, groups, b.sdiv(q, nrb))
        f0 = b.mul(b.srem(q, nrb), FB)
        f1 = u.smin(b, b.add(f0, FB), F)

        def tokens(p, nt):
            xs = _token_rows(b, x, H, lambda pi: u.load(b, ptok, pi, "i64"), p, nt)
            with u.Loop(b, f0, f1, 1, "f") as f:
                off = b.mul(b.add(b.mul(e, F), f), H)
                gate, up = _dots(b, [b.gep(wg, [off], source_etype=st), b.gep(wu, [off], source_etype=st)],
                                 key.wdtype, xs, H, W)
                for t in range(nt):
                    u.store(b, act(b, up[t], gate[t]), h, b.add(b.mul(b.add(p, u.i64(t)), F), f), "f32")

        _blocked(b, p0, b.add(p0, m), TOKEN_BLOCKS, tokens)


def _moe_down(key, b, args, c0, c1):
    W = host().f32_lanes
    vt = _vt(W)
    h, wd, o, y, groups, slot_pair, rw = (u.arg_ptr(b, args, i) for i in range(7))
    H, F, G, T, K, HB, per, items = (u.arg(b, args, i) for i in range(7, 15))
    st = u.STORAGE[key.wdtype]
    acc = u.entry_alloca(b, vt)
    q0, q1 = _items(b, c0, c1, per, items)
    with u.Loop(b, q0, q1, 1, "q") as q:
        r0 = b.mul(q, HB)
        r1 = u.smin(b, b.add(r0, HB), H)
        with u.Loop(b, u.i64(0), G, 1, "g") as g:
            e, p0, m = _group(b, groups, g)

            def tokens(p, nt):
                hs = _token_rows(b, h, F, lambda pi: pi, p, nt)

                def rows(r, nr):
                    ws = [b.gep(wd, [b.mul(b.add(b.mul(e, H), b.add(r, u.i64(i))), F)], source_etype=st)
                          for i in range(nr)]
                    dots = _dots(b, ws, key.wdtype, hs, F, W)
                    for i in range(nr):
                        for t in range(nt):
                            u.store(b, dots[i][t], o, b.add(b.mul(b.add(p, u.i64(t)), H), b.add(r, u.i64(i))), "f32")

                _blocked(b, r0, r1, [DOWN_ROWS[nt], 1], rows)

            _blocked(b, p0, b.add(p0, m), TOKEN_BLOCKS, tokens)
        with u.Loop(b, u.i64(0), T, 1, "t") as t:
            def combine(c, mask):
                b.store(u.const(vt, 0.0), acc)
                with u.Loop(b, u.i64(0), K, 1, "s") as s:
                    ts = b.add(b.mul(t, K), s)
                    p = u.load(b, slot_pair, ts, "i64")
                    w = u.splat(b, u.load(b, rw, ts, "f32"), W)
                    ov = u.load(b, o, b.add(b.mul(p, H), c), "f32", W, mask)
                    b.store(b.fadd(b.load(acc), b.fmul(w, ov)), acc)
                u.store(b, b.load(acc), y, b.add(b.mul(t, H), c), "f32", mask)

            map_pass(b, r0, r1, W, combine)
