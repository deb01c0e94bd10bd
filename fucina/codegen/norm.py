"""Normalization row kernels (SPEC §3.10): layer_norm, rms_norm (+ weight, + residual) and
standardize_axis, forward and one-pass backward, over rows [R, K] with the normalized axis
contiguous. Only the first n columns of a row are normalized (n = K except standardize_axis
with valid_len); columns [n, K) are written as 0 and get 0 gradient.

Forward, per row (c = x - mu when centered, c = x for rms):
  pass 1 (centered only): mu = sum x / n
  pass 2: v = sum c^2 / div                 (div = n - ddof)
          inside:  D = sqrt(v + eps)        outside: s = sqrt(v), D = s + eps
          inv = 1 / D; saved per row: mu, inv (and s for outside)
  pass 3: y = (x - mu) * inv [* w [+ b]] [+ residual]
Backward, per row (gw = g * w, or g without a weight; invS = inv inside, 1/s outside):
  pass 1: a = sum gw (centered only), t = sum gw * c
  pass 2: dx = (gw - a/n) * inv - k * c,  k = t * inv^2 * invS / div   (rms: no a/n term)
          weight/bias: the chunk's partials p_w += g * (c * inv), p_b += g
The backward's work items are chunks of `per` rows (per fixed by K alone); each owns one
[parts, K] block of partials, zeroed at its start and summed over its rows in order. The exec
layer folds the blocks in chunk order, so every sum here has an order fixed by the problem size.

accumulation="f64" (standardize_axis) keeps every row sum, the mean, the variance and the
forward's (x - mean) * inv in f64 (the saved statistics are f32; the backward's sums are f64).
l2_normalize is the rms form with div = 1.

group_norm has its own kernels (GroupNormKey, below): statistics per (batch item, channel
group) over [item, time, channel] data read in place, one normalize + affine pass; backward
likewise.

Argument blocks
  fwd: x, out, w, b, residual, mean, inv, std, R, K, n, eps bits, div bits, rows per chunk
  bwd: x, g, w, mean, inv, std, dx, partials, R, K, n, eps bits, div bits, rows per chunk
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from . import vmath
from .emit import fold, lane_tree, sqrt
from .kernels import KernelKey, register
from .rows import UNROLL, fadd, fold_passes, map_pass
from .target import host

F64 = ir.DoubleType()


@register
@dataclass(frozen=True)
class NormKey(KernelKey):
    """op: fwd | bwd; center: subtract the mean (layer_norm, standardize) or not (rms);
    affine: none | w | wb; residual: + residual (fwd); eps_mode: inside | outside the sqrt;
    acc: f32 | f64 row sums."""

    family = "norm"
    op: str
    center: bool
    affine: str = "none"
    residual: bool = False
    eps_mode: str = "inside"
    acc: str = "f32"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        (_forward if self.op == "fwd" else _backward)(self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _slots(b, ty):
    return [u.entry_alloca(b, ty) for _ in range(UNROLL)]


def _zero(b, accs, ty):
    for p in accs:
        b.store(u.const(ty, 0.0), p)


def _forward(key, b, args, c0, c1):
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    acc_s = F64 if key.acc == "f64" else u.F32
    acc_v = ir.VectorType(acc_s, W)
    x, out, w, bias, res, mean_o, inv_o, std_o = (u.arg_ptr(b, args, i) for i in range(8))
    R, K, n = (u.arg(b, args, i) for i in (8, 9, 10))
    eps, div = u.arg_f32(b, args, 11), u.arg_f32(b, args, 12)
    per = u.arg(b, args, 13)
    r0, r1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), R)

    def wide(v):
        return b.fpext(v, acc_v if isinstance(v.type, ir.VectorType) else acc_s) if key.acc == "f64" else v

    def narrow(v):
        if key.acc != "f64":
            return v
        return b.fptrunc(v, vt if isinstance(v.type, ir.VectorType) else u.F32)

    one = u.const(acc_s, 1.0)
    accs = _slots(b, acc_v)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        xb, ob = (b.gep(p, [row], source_etype=u.F32) for p in (x, out))
        if key.center:
            _zero(b, accs, acc_v)
            fold_passes(b, u.i64(0), n, W, [accs], lambda c, m: [wide(u.load(b, xb, c, "f32", W, m))],
                        [fadd], [0.0])
            mu_w = b.fdiv(fold(b, accs, fadd), b.sitofp(n, acc_s))
            mu = narrow(mu_w)
            u.store(b, mu, mean_o, r, "f32")
            mus = u.splat(b, mu_w, W)

            def cen(c, m):
                return b.fsub(wide(u.load(b, xb, c, "f32", W, m)), mus)
        else:
            def cen(c, m):
                return wide(u.load(b, xb, c, "f32", W, m))
        _zero(b, accs, acc_v)

        def sq(c, m):
            v = cen(c, m)
            return [b.fmul(v, v)]
        fold_passes(b, u.i64(0), n, W, [accs], sq, [fadd], [0.0])
        v = b.fdiv(fold(b, accs, fadd), wide(div))
        if key.eps_mode == "inside":
            D = sqrt(b, b.fadd(v, wide(eps)))
        else:
            s = sqrt(b, v)
            u.store(b, narrow(s), std_o, r, "f32")
            D = b.fadd(s, wide(eps))
        inv_w = b.fdiv(one, D)
        inv = narrow(inv_w)
        u.store(b, inv, inv_o, r, "f32")
        invs = u.splat(b, inv_w, W)

        def body(c, m):
            y = narrow(b.fmul(cen(c, m), invs))  # f64 accumulation: (x - mean) * inv in f64 too
            if key.affine != "none":
                y = b.fmul(y, u.load(b, w, c, "f32", W, m))
            if key.affine == "wb":
                y = b.fadd(y, u.load(b, bias, c, "f32", W, m))
            if key.residual:
                y = b.fadd(y, u.load(b, b.gep(res, [row], source_etype=u.F32), c, "f32", W, m))
            u.store(b, y, ob, c, "f32", m)
        map_pass(b, u.i64(0), n, W, body)
        map_pass(b, n, K, W, lambda c, m: u.store(b, u.const(vt, 0.0), ob, c, "f32", m))


def _backward(key, b, args, c0, c1):
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    acc_s = F64 if key.acc == "f64" else u.F32
    acc_v = ir.VectorType(acc_s, W)
    x, g, w, mean, invp, stdp, dx, part = (u.arg_ptr(b, args, i) for i in range(8))
    R, K, n = (u.arg(b, args, i) for i in (8, 9, 10))
    div = u.arg_f32(b, args, 12)
    per = u.arg(b, args, 13)
    nparts = {"none": 0, "w": 1, "wb": 2}[key.affine]

    def wide(v):
        return b.fpext(v, acc_v if isinstance(v.type, ir.VectorType) else acc_s) if key.acc == "f64" else v

    def narrow(v):
        if key.acc != "f64":
            return v
        return b.fptrunc(v, vt if isinstance(v.type, ir.VectorType) else u.F32)

    sa, st = _slots(b, acc_v), _slots(b, acc_v)
    with u.Loop(b, c0, c1, 1, "q") as q:
        pw = b.gep(part, [b.mul(q, b.mul(K, u.i64(max(nparts, 1))))], source_etype=u.F32)
        pb = b.gep(pw, [K], source_etype=u.F32)
        if nparts:
            map_pass(b, u.i64(0), b.mul(K, u.i64(nparts)), W,
                     lambda c, m: u.store(b, u.const(vt, 0.0), pw, c, "f32", m))
        r0 = b.mul(q, per)
        r1 = u.smin(b, b.add(r0, per), R)
        with u.Loop(b, r0, r1, 1, "r") as r:
            row = b.mul(r, K)
            xb, gb, ob = (b.gep(p, [row], source_etype=u.F32) for p in (x, g, dx))
            inv = u.load(b, invp, r, "f32")
            if key.eps_mode == "outside":  # d std / d var at std = 0 taken as 0 (as torch does)
                sd = u.load(b, stdp, r, "f32")
                inv_s = b.select(b.fcmp_ordered("==", sd, u.const(u.F32, 0.0)), u.const(u.F32, 0.0),
                                 b.fdiv(u.const(u.F32, 1.0), sd))
            else:
                inv_s = inv
            mus = u.splat(b, u.load(b, mean, r, "f32"), W) if key.center else None

            def terms(c, m):
                gv = u.load(b, gb, c, "f32", W, m)
                gw = b.fmul(gv, u.load(b, w, c, "f32", W, m)) if nparts else gv
                xv = u.load(b, xb, c, "f32", W, m)
                cv = b.fsub(xv, mus) if key.center else xv
                return gv, gw, cv

            def sums(c, m):
                _, gw, cv = terms(c, m)
                gw = wide(gw)
                return [gw, b.fmul(gw, wide(cv))]

            _zero(b, sa, acc_v)
            _zero(b, st, acc_v)
            fold_passes(b, u.i64(0), n, W, [sa, st], sums, [fadd, fadd], [0.0, 0.0])
            t = fold(b, st, fadd)
            inv_w = wide(inv)
            k = b.fdiv(b.fmul(t, b.fmul(b.fmul(inv_w, inv_w), wide(inv_s))), wide(div))
            ks, invs = u.splat(b, narrow(k), W), u.splat(b, inv, W)
            abar = None
            if key.center:
                abar = u.splat(b, narrow(b.fdiv(fold(b, sa, fadd), b.sitofp(n, acc_s))), W)

            def body(c, m):
                gv, gw, cv = terms(c, m)
                d = b.fsub(gw, abar) if key.center else gw
                u.store(b, b.fsub(b.fmul(d, invs), b.fmul(ks, cv)), ob, c, "f32", m)
                if nparts:
                    xhat = b.fmul(cv, invs)
                    u.store(b, b.fadd(u.load(b, pw, c, "f32", W, m), b.fmul(gv, xhat)), pw, c, "f32", m)
                if nparts == 2:
                    u.store(b, b.fadd(u.load(b, pb, c, "f32", W, m), gv), pb, c, "f32", m)
            map_pass(b, u.i64(0), n, W, body)
            map_pass(b, n, K, W, lambda c, m: u.store(b, u.const(vt, 0.0), ob, c, "f32", m))


# ---------------------------------------------------------------------------------------------
# group_norm over [*batch, time, channel], read in place

# the pointers that advance with the batch item, by their per-item stride: None the data's T·C
# f32, 6 and 2 that many f32 rows of C (table, coef), nq the f64 partials' nq·C
ITEM_STRIDES = {"x": None, "g": None, "dx": None, "table": 6, "coef": 2, "part": "nq",
                "part2": "nq"}
# rows of the per-channel table the forward leaves for the backward (f32 [6, C]) and of the
# backward's coefficients (f32 [2, C])
MEAN_HI, MEAN_LO, INV, XOFF, SCALE, SHIFT = range(6)
BETA, GAMMA = range(2)
# channel vectors walked together over a chunk's rows (tc), by the vector registers (32 zmm
# with AVX-512, 16 ymm with AVX2): for the f64 statistics (each f32 vector two f64 ones, two
# sums each) and the backward's sums (whose f32 blocks need more registers). With 16 registers
# a panel of 4 kept 16 f64 accumulators, one spilled through the stack and the rest rotated by
# register copies every row: Zen 3, group_norm stats of [8, 1024, 64] at 1 thread 124 -> 66 µs
# (1 vector: 92 µs)
PANEL = {32: {True: 4, False: 2}, 16: {True: 2, False: 2}}
BLOCK_CHANNELS = 64   # the combines' chunks: blocks of max(1, 64 // Cg) whole groups
# the fused ops: their ops in order, each over its whole grid, in one launch
FUSED = {"forward": ("stats", "combine", "apply"),
         "backward": ("grad_sums", "grad_combine", "grad_apply"),
         "backward_params": ("grad_sums", "grad_combine")}


def group_block(b, Cg):
    """Groups per combine chunk (the exec layer computes the same number)."""
    gpb = b.sdiv(u.i64(BLOCK_CHANNELS), Cg)
    return b.select(b.icmp_signed("<", gpb, u.i64(1)), u.i64(1), gpb)


@register
@dataclass(frozen=True)
class GroupNormKey(KernelKey):
    """group_norm (SPEC §3.10) on N items of T x C data read in place (item n at n·T·C),
    channels in G groups of Cg; statistics per (item, group), each item on exactly the grid
    and in exactly the order it would have alone (so an item's bits do not depend on the
    batch).

    layout: tc (element (t, c) at t·C + c: vectors run across channels) or ct (at c·T + t:
    vectors run along time, one channel at a time). The data passes run over time chunks of
    `per` rows (fixed by C), nq per item, N·nq in all (chunk j: item j / nq, time chunk
    j mod nq); combine and grad_combine over blocks of whole groups, each block doing every
    item in order (first the block's chunk partials summed per channel, then group by group).
    The table, coefficients and partials are per item. forward, backward and
    backward_params (FUSED) run their ops in one launch, for callers that would run every
    chunk on one thread anyway.
      stats        per channel c and chunk q, in f64: Σ d and Σ d² (fused multiply-add),
                   d = x - K_c with K_c = x(0, c)
      combine      per channel: m_c = K_c + Σd·(1/T), M2_c = Σd² - (Σd)²·(1/T); per group,
                   channels in order: mean = Σ m_c·(1/Cg), var = max(Σ (M2_c + T·(m_c -
                   mean)²)·(1/n), 0) (biased), inv = 1/sqrt(var + eps), all f64. Table per
                   channel: hi = f32(mean), lo = f32(mean - hi), inv, xoff = -lo·inv,
                   scale = inv·w, shift = b - lo·scale
      apply        y = (x - hi)·scale + shift  (x - hi is exact near the mean; one rounding more)
      grad_sums    per channel and chunk: Σ g and Σ g·x̂, x̂ = (x - hi)·inv + xoff; g·x̂ and
                   the sums of four rows (tc) or four vectors (ct) in f32, in order, then
                   accumulated in f64
      grad_combine per channel: db = Σ g, dw = Σ g·x̂ per item, then over the items in
                   order in f64 (db = db_0 + db_1 + ...), rounded to f32 once; per item
                   and group, channels in order:
                   A = Σ w·db, B = Σ w·dw; beta = -inv²·B·(1/n), gamma = -inv·A·(1/n) -
                   lo·beta (f64)
      grad_apply   dx = g·scale + ((x - hi)·beta + gamma)
    n = T·Cg; without w, w = 1; without b, b = 0. K_c is one of channel c's values, so
    (m_c - K_c)² <= T·var_c: the cancellation in M2_c costs at most a factor T of f64's
    precision. Every sum's order is fixed by the shape. In a chunk (tc): channels in panels of
    PANEL vectors sum the rows in order, the channels left over (C mod PANEL·W, one vector at a
    time) put rows t0 + 4k + s into accumulator s (the last (t1 - t0) mod 4 rows into 0) and
    combine (0 + 1) + (2 + 3); ct: the walk of rows.fold_passes. The chunk partials, stored
    [nq, C], are summed per channel in chunk order; a group's channels go c0 + 4k + s into
    accumulator s, combined the same way. weight, bias: whether w and b are given (combines).

    Argument block: x, y (fwd) or g (bwd), dx, w, b, partials (f64 [2, N, nq, C]), table
    (f32 [N, 6, C]), coef (f32 [N, 2, C]), dw, db, T, C, Cg, rows per chunk, nq, eps bits,
    N."""

    family = "group_norm"
    op: str
    layout: str = "tc"
    weight: bool = False
    bias: bool = False

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        _GroupNorm(self, b, args).emit(c0, c1)
        b.ret_void()
        return str(mod)


def _fold_rows(b, t0, t1, value, steps, dt, slots):
    """Fold value(t) (a list of vectors, each by its step) over rows [t0, t1), each into
    `slots` accumulators of type dt: rows t0 + slots·k + s into accumulator s, the last
    (t1 - t0) mod slots rows into accumulator 0; four slots combine as (0 + 1) + (2 + 3)."""
    accs = [[u.entry_alloca(b, dt) for _ in range(slots)] for _ in steps]
    for a in accs:
        _zero(b, a, dt)

    def update(s, t):
        for a, v, step in zip(accs, value(t), steps):
            b.store(step(b, b.load(a[s]), v), a[s])
    big = b.sub(t1, b.srem(b.sub(t1, t0), u.i64(slots)))
    with u.Loop(b, t0, big, slots, "t4") as t:
        for s in range(slots):
            update(s, b.add(t, u.i64(s)))
    if slots == 1:
        return [b.load(a[0]) for a in accs]
    with u.Loop(b, big, t1, 1, "t1") as t:
        update(0, t)
    return [b.fadd(b.fadd(b.load(a[0]), b.load(a[1])), b.fadd(b.load(a[2]), b.load(a[3])))
            for a in accs]


def _fold_blocks(b, start, stop, step, W, value, count, dt, tail):
    """f64 sums (vector type dt) of value(i, mask) (`count` f32 vectors) over i = start,
    start + step, ... < stop: each block of four steps summed in f32 in order, then added in
    f64; the remaining single steps added in f64; with `tail`, the last
    stop mod step elements as one masked vector of W lanes."""
    n = b.sub(stop, start)
    big = b.sub(stop, b.srem(n, u.i64(UNROLL * step)))
    accs = [u.entry_alloca(b, dt) for _ in range(count)]
    for a in accs:
        b.store(u.const(dt, 0.0), a)

    def add(vs):
        for a, v in zip(accs, vs):
            b.store(b.fadd(b.load(a), b.fpext(v, dt)), a)
    with u.Loop(b, start, big, UNROLL * step, "b4") as i:
        ps = value(i, None)
        for s in range(1, UNROLL):
            ps = [b.fadd(p, v) for p, v in zip(ps, value(b.add(i, u.i64(s * step)), None))]
        add(ps)
    full = b.sub(stop, b.srem(n, u.i64(step))) if tail else stop
    with u.Loop(b, big, full, step, "b1") as i:
        add(value(i, None))
    if tail:
        rest = b.sub(stop, full)
        with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
            m = u.tail_mask(b, rest, W)
            add([b.select(m, v, u.const(v.type, 0.0)) for v in value(full, m)])
    return [b.load(a) for a in accs]


def _sq_add(b, acc, d):
    return vmath.fma(b, d, d, acc)


class _GroupNorm:
    """The group_norm kernels: the argument block unpacked once, one method per op."""

    def __init__(self, key, b, args):
        self.key, self.b = key, b
        self.W = host().f32_lanes
        self.dt = ir.VectorType(F64, self.W)
        (self.x, self.g, self.dx, self.w, self.bias, self.part, self.table, self.coef,
         self.dw, self.db) = (u.arg_ptr(b, args, i) for i in range(10))
        self.y = self.g                               # the forward's output takes g's slot
        self.T, self.C, self.Cg, self.per, self.nq = (u.arg(b, args, i) for i in range(10, 15))
        self.eps = u.arg_f32(b, args, 15)
        self.N = u.arg(b, args, 16)
        self.qC = b.mul(self.C, self.nq)
        self.part2 = b.gep(self.part, [b.mul(self.qC, self.N)], source_etype=F64)
        self.TC = b.mul(self.T, self.C)
        self.param_accs = None
        self.G = b.sdiv(self.C, self.Cg)
        self.gpb = group_block(b, self.Cg)
        one = u.const(F64, 1.0)   # reciprocals of T, Cg and n = T·Cg (the combines multiply)
        self.Tf = b.sitofp(self.T, F64)
        self.rT, self.rCg, self.rn = (b.fdiv(one, b.sitofp(v, F64))
                                      for v in (self.T, self.Cg, b.mul(self.T, self.Cg)))

    def emit(self, c0, c1):
        """One op over chunks [c0, c1) of its grid; a fused op runs its ops one after another,
        each over its whole grid (launched as a single chunk)."""
        ops = FUSED.get(self.key.op)
        if ops is None:
            self.run(self.key.op, c0, c1)
            return
        b = self.b
        blocks = b.sdiv(b.sub(b.add(self.G, self.gpb), u.i64(1)), self.gpb)
        for op in ops:
            self.run(op, u.i64(0), blocks if op.endswith("combine") else b.mul(self.N, self.nq))

    def run(self, op, c0, c1):
        b = self.b
        if op.endswith("combine"):   # chunks: blocks of gpb groups, every item in each
            with u.Loop(b, c0, c1, 1, "gb") as gb:
                g0 = b.mul(gb, self.gpb)
                g1 = u.smin(b, b.add(g0, self.gpb), self.G)
                self.chunk_totals(b.mul(g0, self.Cg), b.mul(g1, self.Cg), op)
                with u.Loop(b, u.i64(0), self.N, 1, "n") as n, self.item(n):
                    with u.Loop(b, g0, g1, 1, "g") as g:
                        getattr(self, op)(b.mul(g, self.Cg), b.mul(b.add(g, u.i64(1)), self.Cg))
            return
        with u.Loop(b, c0, c1, 1, "j") as j:   # chunks: (item, time chunk), item-major
            with self.item(b.sdiv(j, self.nq)):
                q = b.srem(j, self.nq)
                t0 = b.mul(q, self.per)
                getattr(self, op)(q, t0, u.smin(b, b.add(t0, self.per), self.T))

    @contextlib.contextmanager
    def item(self, n):
        """The per-item pointers (ITEM_STRIDES) moved to item n for the body's emission."""
        b = self.b
        saved = {name: getattr(self, name) for name in ITEM_STRIDES}
        units = {None: (self.TC, u.F32), 6: (b.mul(self.C, u.i64(6)), u.F32),
                 2: (b.mul(self.C, u.i64(2)), u.F32), "nq": (self.qC, F64)}
        for name, unit in ITEM_STRIDES.items():
            stride, ty = units[unit]
            setattr(self, name, b.gep(saved[name], [b.mul(n, stride)], source_etype=ty))
        self.y = self.g
        try:
            yield
        finally:
            for name, v in saved.items():
                setattr(self, name, v)
            self.y = self.g

    # ---- access ----
    def f64(self, v):
        return self.b.fpext(v, self.dt if isinstance(v.type, ir.VectorType) else F64)

    def f32(self, v):
        vector = isinstance(v.type, ir.VectorType)
        return self.b.fptrunc(v, ir.VectorType(u.F32, self.W) if vector else u.F32)

    def row_ptr(self, base, row):
        return self.b.gep(base, [self.b.mul(u.i64(row), self.C)], source_etype=u.F32)

    def chan(self, base, rows, c, m):
        """Rows `rows` of a [k, C] f32 table at channel c: vectors over channels c.. (tc) or
        channel c's values splat (ct)."""
        b = self.b
        if self.key.layout == "tc":
            return [u.load(b, self.row_ptr(base, r), c, "f32", self.W, m) for r in rows]
        return [u.splat(b, u.load(b, self.row_ptr(base, r), c, "f32"), self.W) for r in rows]

    def load_x(self, base, i, m):
        return u.load(self.b, base, i, "f32", self.W, m)

    def at_f64(self, base, i):
        return self.b.gep(base, [i], source_etype=F64)

    def load_f64(self, base, i, m):
        """f64 vector at base[i..] (masked: only the lanes of m, the others 0)."""
        b, p = self.b, self.at_f64(base, i)
        if m is None:
            v = b.load(p, typ=self.dt)
            v.align = 8
            return v
        return u.intrinsic(b, "llvm.masked.load", self.dt,
                           [p, ir.Constant(u.I32, 8), m, u.const(self.dt, 0.0)],
                           types=[self.dt, u.PTR])

    def store_f64(self, v, base, i, m):
        """An f64 vector at base[i..] (masked: only the lanes of m)."""
        b, p = self.b, self.at_f64(base, i)
        if m is None:
            b.store(v, p).align = 8
        else:
            u.intrinsic(b, "llvm.masked.store", u.VOID, [v, p, ir.Constant(u.I32, 8), m],
                        types=[v.type, u.PTR])

    # ---- walks over a chunk's rows ----
    def map_rows(self, t0, t1, rows, f):
        """f(i, mask, k) at element index i of every (row, channel) of the chunk, vector by
        vector; k: the table/coef rows `rows` ((base, row) pairs) at the vector's channels."""
        b = self.b

        def consts(c, m):
            return [v for base, r in rows for v in self.chan(base, [r], c, m)]
        if self.key.layout == "tc":   # 4 rows per load of the channel constants
            big = b.sub(t1, b.srem(b.sub(t1, t0), u.i64(UNROLL)))

            def block(t, n):
                def body(c, m):
                    k = consts(c, m)
                    for s in range(n):
                        f(b.add(b.mul(b.add(t, u.i64(s)), self.C), c), m, k)
                map_pass(b, u.i64(0), self.C, self.W, body)
            with u.Loop(b, t0, big, UNROLL, "t4") as t:
                block(t, UNROLL)
            with u.Loop(b, big, t1, 1, "t1") as t:
                block(t, 1)
            return
        with u.Loop(b, u.i64(0), self.C, 1, "c") as c:
            k = consts(c, None)
            base = b.mul(c, self.T)
            map_pass(b, b.add(base, t0), b.add(base, t1), self.W, lambda i, m: f(i, m, k))

    def sum_rows(self, q, t0, t1, rows, value, exact=True):
        """Per channel c, two f64 sums over the chunk's rows of value(i, mask, k) (k: the
        channel constants rows(c, mask)), stored at partials [0|1, q, c]. exact: value gives
        f64 vectors [d, d], summed as Σ d and Σ d² (a fused multiply-add each); else value
        gives f32 vectors, four steps summed in f32 in order, then added in f64.
        tc walks the rows for panels of PANEL[regs][exact] channel vectors, then for the channels
        left one vector at a time; exact sums run over the rows in order in a panel, into four
        accumulators by row mod 4 for a single vector. ct walks each channel's row segment."""
        b, W = self.b, self.W
        steps = (fadd, _sq_add)
        dsts = (self.part, self.part2)
        if self.key.layout == "tc":
            def walk(c, masks, slots):
                cs = [b.add(c, u.i64(j * W)) for j in range(len(masks))]
                ks = [rows(cj, m) for cj, m in zip(cs, masks)]

                def at(t, _=None):
                    row = b.mul(t, self.C)
                    return [v for cj, m, k in zip(cs, masks, ks)
                            for v in value(b.add(row, cj), m, k)]
                if exact:
                    sums = _fold_rows(b, t0, t1, at, steps * len(masks), self.dt, slots)
                else:
                    sums = _fold_blocks(b, t0, t1, 1, W, at, 2 * len(masks), self.dt, tail=False)
                for j, (cj, m) in enumerate(zip(cs, masks)):
                    for v, dst in zip(sums[2 * j:2 * j + 2], dsts):
                        self.store_f64(v, dst, b.add(b.mul(q, self.C), cj), m)
            P = PANEL[host().vector_regs][exact]
            wide = b.sub(self.C, b.srem(self.C, u.i64(P * W)))
            with u.Loop(b, u.i64(0), wide, P * W, "p") as c:
                walk(c, [None] * P, 1)
            map_pass(b, wide, self.C, W, lambda c, m: walk(c, [m], UNROLL))
            return
        with u.Loop(b, u.i64(0), self.C, 1, "c") as c:
            k = rows(c, None)
            base = b.mul(c, self.T)
            start, stop = b.add(base, t0), b.add(base, t1)
            at = lambda i, m: value(i, m, k)  # noqa: E731
            if exact:
                groups = [_slots(b, self.dt), _slots(b, self.dt)]
                for s in groups:
                    _zero(b, s, self.dt)
                fold_passes(b, start, stop, W, groups, at, steps, [0.0, 0.0])
                sums = [fold(b, s, fadd) for s in groups]
            else:
                sums = [lane_tree(b, v, fadd) for v in _fold_blocks(b, start, stop, W, W, at, 2,
                                                                    self.dt, tail=True)]
            j = b.add(b.mul(q, self.C), c)
            for v, dst in zip(sums, dsts):
                b.store(v, self.at_f64(dst, j))

    def chunk_totals(self, c0, c1, op):
        """For channels [c0, c1), a vector of channels at a time, item by item in order: the
        item's sums over its chunks s = Σ_q partials[0|1, n, q, c] (q in order), then
        finish(c, mask, s1, s2, n) (the op's _channels method); grad_combine then writes the
        parameter gradients summed over the items."""
        b = self.b
        finish = getattr(self, op + "_channels")
        accs = [u.entry_alloca(b, self.dt) for _ in range(2)]
        self.param_accs = [u.entry_alloca(b, self.dt) for _ in range(2)]

        def body(c, m):
            with u.Loop(b, u.i64(0), self.N, 1, "n") as n, self.item(n):
                _zero(b, accs, self.dt)
                with u.Loop(b, u.i64(0), self.nq, 1, "q") as q:
                    j = b.add(b.mul(q, self.C), c)
                    for a, src in zip(accs, (self.part, self.part2)):
                        b.store(b.fadd(b.load(a), self.load_f64(src, j, m)), a)
                finish(c, m, b.load(accs[0]), b.load(accs[1]), n)
            if op == "grad_combine":
                self.grad_params(c, m)
        map_pass(b, c0, c1, self.W, body)

    def total(self, which, c):
        return self.b.load(self.at_f64(which, c), typ=F64)

    def first_row(self, c, m):
        """x(0, c..) in f64: one vector load (tc), or one load per lane (ct; lanes past the
        mask read the last channel's)."""
        b = self.b
        if self.key.layout == "tc":
            return self.f64(self.load_x(self.x, c, m))
        last = b.sub(self.C, u.i64(1))
        v = ir.Constant(self.dt, ir.Undefined)
        for lane in range(self.W):
            ch = u.smin(b, b.add(c, u.i64(lane)), last)
            xv = u.load(b, self.x, b.mul(ch, self.T), "f32")
            v = b.insert_element(v, self.f64(xv), u.i64(lane))
        return v

    def over_group(self, c0, c1, value, count=1):
        """`count` f64 sums over the group's channels [c0, c1) of value(c) (scalars): channel
        c0 + 4k + s into accumulator s, the last ones into 0, then (0 + 1) + (2 + 3)."""
        return _fold_rows(self.b, c0, c1, value, [fadd] * count, F64, UNROLL)

    def table_rows(self, *rows):
        return lambda c, m: self.chan(self.table, rows, c, m)

    # ---- forward ----
    def stats(self, q, t0, t1):
        b = self.b

        def shift(c, m):   # K_c = x(0, c)
            if self.key.layout == "tc":
                return self.first_row(c, m)
            return u.splat(b, self.f64(u.load(b, self.x, b.mul(c, self.T), "f32")), self.W)

        def value(i, m, K):
            d = b.fsub(self.f64(self.load_x(self.x, i, m)), K)
            return [d, d]
        self.sum_rows(q, t0, t1, shift, value)

    def combine_channels(self, c, m, d1, d2, n):
        """m_c and M2_c, kept in partials [0|1, 0, c]."""
        b = self.b
        rT = u.splat(b, self.rT, self.W)
        self.store_f64(b.fadd(self.first_row(c, m), b.fmul(d1, rT)), self.part, c, m)
        self.store_f64(b.fsub(d2, b.fmul(b.fmul(d1, d1), rT)), self.part2, c, m)

    def combine(self, c0, c1):
        b = self.b
        mean = b.fmul(self.over_group(c0, c1, lambda c: [self.total(self.part, c)])[0], self.rCg)

        def spread(c):   # M2_c + T·(m_c - mean)²
            dm = b.fsub(self.total(self.part, c), mean)
            return [b.fadd(self.total(self.part2, c), b.fmul(self.Tf, b.fmul(dm, dm)))]
        var = b.fmul(self.over_group(c0, c1, spread)[0], self.rn)
        var = b.select(b.fcmp_ordered("<", var, u.const(F64, 0.0)), u.const(F64, 0.0), var)
        inv = b.fdiv(u.const(F64, 1.0), sqrt(b, b.fadd(var, self.f64(self.eps))))
        hi = self.f32(mean)
        lo = b.fsub(mean, self.f64(hi))
        xoff = self.f32(b.fneg(b.fmul(lo, inv)))
        rows = ((MEAN_HI, hi), (MEAN_LO, self.f32(lo)), (INV, self.f32(inv)), (XOFF, xoff))
        # the group's channels one at a time, as grad_combine's: a group is a few channels,
        # and their masked vector tail cost AVX2 a vmaskmovps per table row (Zen 3, 32 groups
        # of 2 channels, 8 items: the combine 12.8 -> 5.7 µs)
        with u.Loop(b, c0, c1, 1, "c") as c:
            scale = inv
            if self.key.weight:
                scale = b.fmul(inv, self.f64(u.load(b, self.w, c, "f32")))
            shift = b.fneg(b.fmul(lo, scale))
            if self.key.bias:
                shift = b.fadd(self.f64(u.load(b, self.bias, c, "f32")), shift)
            for row, v in rows + ((SCALE, self.f32(scale)), (SHIFT, self.f32(shift))):
                u.store(b, v, self.row_ptr(self.table, row), c, "f32")

    def apply(self, q, t0, t1):
        b, t = self.b, self.table

        def f(i, m, k):
            hi, scale, shift = k
            y = vmath.fma(b, b.fsub(self.load_x(self.x, i, m), hi), scale, shift)
            u.store(b, y, self.y, i, "f32", m)
        self.map_rows(t0, t1, [(t, MEAN_HI), (t, SCALE), (t, SHIFT)], f)

    # ---- backward ----
    def grad_sums(self, q, t0, t1):
        b = self.b

        def value(i, m, k):
            hi, inv, xoff = k
            gv = self.load_x(self.g, i, m)
            xhat = vmath.fma(b, b.fsub(self.load_x(self.x, i, m), hi), inv, xoff)
            return [gv, b.fmul(gv, xhat)]
        self.sum_rows(q, t0, t1, self.table_rows(MEAN_HI, INV, XOFF), value, exact=False)

    def grad_combine_channels(self, c, m, s1, s2, n):
        """Item n's db = Σ g and dw = Σ g·x̂ added to the items' running totals (the first
        item's taken as they are); w·db, w·dw kept in the item's partials [0|1, 0, c]."""
        b = self.b
        first = b.icmp_signed("==", n, u.i64(0))
        for acc, s in zip(self.param_accs, (s1, s2)):
            b.store(b.select(first, s, b.fadd(b.load(acc), s)), acc)
        if self.key.weight:
            wc = self.f64(self.load_x(self.w, c, m))
            s1, s2 = b.fmul(wc, s1), b.fmul(wc, s2)
        self.store_f64(s1, self.part, c, m)
        self.store_f64(s2, self.part2, c, m)

    def grad_params(self, c, m):
        """db and dw: the items' f64 totals, rounded once."""
        b = self.b
        if self.key.bias:
            u.store(b, self.f32(b.load(self.param_accs[0])), self.db, c, "f32", m)
        if self.key.weight:
            u.store(b, self.f32(b.load(self.param_accs[1])), self.dw, c, "f32", m)

    def grad_combine(self, c0, c1):
        b = self.b
        A, B = self.over_group(c0, c1, lambda c: [self.total(self.part, c),
                                                  self.total(self.part2, c)], 2)
        inv = self.f64(u.load(b, self.row_ptr(self.table, INV), c0, "f32"))
        lo = self.f64(u.load(b, self.row_ptr(self.table, MEAN_LO), c0, "f32"))
        beta = b.fneg(b.fmul(b.fmul(b.fmul(inv, inv), B), self.rn))
        gamma = b.fsub(b.fneg(b.fmul(b.fmul(inv, A), self.rn)), b.fmul(lo, beta))
        with u.Loop(b, c0, c1, 1, "c") as c:
            u.store(b, self.f32(beta), self.row_ptr(self.coef, BETA), c, "f32")
            u.store(b, self.f32(gamma), self.row_ptr(self.coef, GAMMA), c, "f32")

    def grad_apply(self, q, t0, t1):
        b, t, k = self.b, self.table, self.coef

        def f(i, m, consts):
            hi, scale, beta, gamma = consts
            inner = vmath.fma(b, b.fsub(self.load_x(self.x, i, m), hi), beta, gamma)
            u.store(b, vmath.fma(b, self.load_x(self.g, i, m), scale, inner), self.dx, i, "f32", m)
        self.map_rows(t0, t1, [(t, MEAN_HI), (t, SCALE), (k, BETA), (k, GAMMA)], f)
