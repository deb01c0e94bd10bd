"""Reduction kernels over one axis, with an accumulation order fixed by the problem size.

The exec layer views the (contiguous) input as [A, N, B] and reduces N. The axis is cut into
segments of length C (chosen from N alone); each work item q reduces one segment and writes a
partial, and a second launch over the partials finishes the job. Which thread runs which item
never matters, so results are bitwise identical for any thread count.

  inner (B == 1): item q = (a, s); 4 vector accumulators stride through the segment, a masked
                  tail, then a fixed combine (0+1, 2+3, then the halves) and a fixed lane tree.
  outer (B > 1):  item q = (a, s, block of BLOCK columns); for each n in the segment, in
                  order, out[b] = op(out[b], x[a, n, b]) — vectorized across b, rows read in
                  memory order.
  segmented:      the segments come from an i64 offsets array instead of a fixed length C
                  (segment_sum): segment s is [off[s], off[s+1]); an empty one gives the identity.

What one element contributes is `pre(x)` (|x|, x², (x − c)² with a per-lane centre c — or,
inner and unsplit only, c = the lane's own mean from a first pass in the same item — zeros
read as 1), replaced by the op's identity where a mask operand is falsy (so a masked sum is
bitwise the sum of the masked_fill'ed input). `count` counts truthy elements (or zeros) in i64;
integer sums accumulate in i64 (wrapping). Partials and float results are f32.

Argument block: x, out, A, N, B, C, S, items per chunk, divisor (f32 bits; post="div"),
mask, centre, offsets (0 when unused). Output layout: [A, S, B] partials (S == 1 when final).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import lane_tree, nan_max, nan_min
from .kernels import KernelKey, register
from .rows import chunk_pass
from .target import host

UNROLL = 4
BLOCK = 2048  # outer reductions: columns per work item (8 KiB of f32 accumulators)

IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf"), "prod": 1.0, "count": 0}
COMBINE = {"sum": lambda b, x, y: b.fadd(x, y), "max": nan_max, "min": nan_min,
           "prod": lambda b, x, y: b.fmul(x, y)}
PRE = ("none", "abs", "sq", "dev2", "dev2mean", "nonzero", "zero")


def acc_dtype(op: str, in_dtype: str) -> str:
    """What a reduction accumulates (and returns) in: i64 for counts and integer sums, else f32."""
    return "i64" if op == "count" or in_dtype in ("i64", "bool") else "f32"


def _combine(op: str, acc: str):
    if acc == "i64":
        return lambda b, x, y: b.add(x, y)
    return COMBINE[op]


def _elem(ty):
    return ty.element if isinstance(ty, ir.VectorType) else ty


def truthy(b, v):
    """A mask value as i1: integers/bytes != 0, floats != 0 (NaN is truthy)."""
    if isinstance(_elem(v.type), ir.IntType):
        return b.icmp_unsigned("!=", v, u.const(v.type, 0))
    return b.fcmp_unordered("!=", v, u.const(v.type, 0.0))


def fabs(b, v):
    return u.intrinsic(b, "llvm.fabs", v.type, [v])


def contribution(b, op: str, pre: str, x, m=None, c=None):
    """What one loaded (widened) element, or vector of them, adds to the accumulator."""
    if op == "count":
        pred = b.fcmp_ordered("==", x, u.const(x.type, 0.0)) if pre == "zero" else truthy(b, x)
        if m is not None:
            pred = b.and_(pred, truthy(b, m))
        lanes = x.type.count if isinstance(x.type, ir.VectorType) else None
        return b.zext(pred, u.vec(u.I64, lanes))
    if pre == "abs":
        x = fabs(b, x)
    elif pre == "sq":
        x = b.fmul(x, x)
    elif pre in ("dev2", "dev2mean"):
        d = b.fsub(x, c)
        x = b.fmul(d, d)
    elif pre == "nonzero":
        x = b.select(b.fcmp_ordered("==", x, u.const(x.type, 0.0)), u.const(x.type, 1.0), x)
    if m is not None:
        x = b.select(truthy(b, m), x, u.const(x.type, IDENTITY[op]))
    return x


@register
@dataclass(frozen=True)
class ReduceKey(KernelKey):
    family = "reduce"
    op: str        # sum | max | min | prod | count
    in_dtype: str  # f32 | f16 | bf16 (widened) | i64 | bool
    post: str      # none | div (divide the final value by the divisor argument) | sqrt
    inner: bool    # B == 1
    pre: str = "none"       # see PRE: what each element contributes ("dev2mean": inner, C == N)
    mask: str = ""          # dtype of a mask operand (same shape as x), "" = none
    segmented: bool = False  # segments from an offsets array (segment_sum)

    def ir(self, symbol: str) -> str:
        return str(_build(self, symbol))


def _build(key: ReduceKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    acc = acc_dtype(key.op, key.in_dtype)
    vt = ir.VectorType(u.COMPUTE[acc], W)
    combine = _combine(key.op, acc)
    ident = IDENTITY[key.op]
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, C, S, per = (u.arg(b, args, i) for i in range(2, 8))
    divisor = u.arg_f32(b, args, 8)
    mask_p = u.arg_ptr(b, args, 9) if key.mask else None
    centre = u.arg_ptr(b, args, 10) if key.pre == "dev2" else None
    offs = u.arg_ptr(b, args, 11) if key.segmented else None
    nblk = u.i64(1) if key.inner else b.sdiv(b.add(B, u.i64(BLOCK - 1)), u.i64(BLOCK))
    items = b.mul(b.mul(A, S), nblk)
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), items)

    def finish(v):
        if key.post == "div":
            return b.fdiv(v, divisor if v.type == u.F32 else u.splat(b, divisor, W))
        if key.post == "sqrt":
            return u.intrinsic(b, "llvm.sqrt", v.type, [v])
        return v

    def fetch(idx, c=None, tmask=None, pre=key.pre):
        """The contribution of x[idx : idx+W] (lanes off in tmask contribute the identity)."""
        xv = u.load(b, x, idx, key.in_dtype, W, tmask, ident if acc == "f32" else 0)
        mv = u.load(b, mask_p, idx, key.mask, W, tmask) if key.mask else None
        v = contribution(b, key.op, pre, xv, mv, c)
        if tmask is not None and (key.mask or key.op == "count" or pre != "none"):
            v = b.select(tmask, v, u.const(vt, ident))
        return v

    def lane_total(start, length, c=None, pre=key.pre):
        """One inner lane segment folded to a scalar: 4 accumulators, tail, fixed tree."""
        accs = [u.entry_alloca(b, vt) for _ in range(UNROLL)]
        for p in accs:
            b.store(u.const(vt, ident), p)
        big = b.sub(length, b.srem(length, u.i64(UNROLL * W)))
        with u.Loop(b, u.i64(0), big, UNROLL * W, "j") as j:
            for t, p in enumerate(accs):
                v = fetch(b.add(start, b.add(j, u.i64(t * W))), c, pre=pre)
                b.store(combine(b, b.load(p), v), p)
        full = b.sub(length, b.srem(length, u.i64(W)))
        with u.Loop(b, big, full, W, "k") as j:
            v = fetch(b.add(start, j), c, pre=pre)
            b.store(combine(b, b.load(accs[0]), v), accs[0])
        tail = b.sub(length, full)
        with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
            v = fetch(b.add(start, full), c, u.tail_mask(b, tail, W), pre=pre)
            b.store(combine(b, b.load(accs[1]), v), accs[1])
        v01 = combine(b, b.load(accs[0]), b.load(accs[1]))
        v23 = combine(b, b.load(accs[2]), b.load(accs[3]))
        return lane_tree(b, combine(b, v01, v23), combine)

    with u.Loop(b, q0, q1, 1, "q") as q:
        blk = b.srem(q, nblk)
        rest = b.sdiv(q, nblk)
        s = b.srem(rest, S)
        a = b.sdiv(rest, S)
        if key.segmented:
            n0 = b.load(b.gep(offs, [s], source_etype=u.I64), typ=u.I64)
            n1 = b.load(b.gep(offs, [b.add(s, u.i64(1))], source_etype=u.I64), typ=u.I64)
            length = b.sub(n1, n0)
        else:
            n0 = b.mul(s, C)
            length = u.smin(b, C, b.sub(N, n0))
        if key.inner:
            start = b.add(b.mul(a, N), n0)
            c = None
            if key.pre == "dev2mean":
                # the centre is this (unsplit) lane's own mean: a first pass over the same
                # elements, bitwise the mean kernel's (same tree, same division by f32(N));
                # the second pass then re-reads the lane from cache, not from memory
                mean = b.fdiv(lane_total(start, length, pre="none"), b.sitofp(length, u.F32))
                c = u.splat(b, mean, W)
            elif centre is not None:
                c = u.splat(b, u.load(b, centre, a, "f32"), W)
            u.store(b, finish(lane_total(start, length, c)), out, q, acc)
        else:
            # Rows stream in memory order; the block's accumulators live in the output (L1-sized),
            # and each output still folds its column serially over n, so the order is fixed.
            b0 = b.mul(blk, u.i64(BLOCK))
            width = u.smin(b, u.i64(BLOCK), b.sub(B, b0))
            obase = b.gep(out, [b.add(b.mul(rest, B), b0)], source_etype=u.STORAGE[acc])
            cbase = b.add(b.mul(a, B), b0)
            full = b.sub(width, b.srem(width, u.i64(W)))
            tail = b.sub(width, full)
            mask = u.tail_mask(b, tail, W)
            with u.Loop(b, u.i64(0), full, W, "init") as j:
                u.store(b, u.const(vt, ident), obase, j, acc)
            with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                u.store(b, u.const(vt, ident), obase, full, acc, mask)

            def centre_at(j, tmask=None):
                if centre is None:
                    return None
                return u.load(b, centre, b.add(cbase, j), "f32", W, tmask)

            row0 = b.add(b.mul(b.add(b.mul(a, N), n0), B), b0)
            with u.Loop(b, u.i64(0), length, 1, "n") as n:
                xrow = b.add(row0, b.mul(n, B))
                with u.Loop(b, u.i64(0), full, W, "j") as j:
                    prev = u.load(b, obase, j, acc, W)
                    v = fetch(b.add(xrow, j), centre_at(j))
                    u.store(b, combine(b, prev, v), obase, j, acc)
                with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                    prev = u.load(b, obase, full, acc, W, mask)
                    v = fetch(b.add(xrow, full), centre_at(full, mask), mask)
                    u.store(b, combine(b, prev, v), obase, full, acc, mask)
            if key.post != "none":
                with u.Loop(b, u.i64(0), full, W, "fin") as j:
                    u.store(b, finish(u.load(b, obase, j, "f32", W)), obase, j, "f32")
                with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                    u.store(b, finish(u.load(b, obase, full, "f32", W, mask)), obase, full, "f32", mask)
    b.ret_void()
    return mod


@register
@dataclass(frozen=True)
class ArgKey(KernelKey):
    """First index of the maximum (or minimum) along N of [A, N, B]: strict comparisons, so
    ties keep the earliest; a NaN beats every number and the first NaN wins. i64 result [A, B].
    With a mask only selected elements compete, and a lane with none selected gets -1; with
    absval the values compared are |x| (the inf-norm's argmax).

    Work item q = (a, block of W columns); each lane scans its column serially over n."""

    family = "argext"
    op: str        # max | min
    in_dtype: str
    mask: str = ""
    absval: bool = False

    def ir(self, symbol: str) -> str:
        return str(_build_arg(self, symbol))


def _build_arg(key: ArgKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    vt, it = ir.VectorType(u.F32, W), ir.VectorType(u.I64, W)
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, per = (u.arg(b, args, i) for i in range(2, 6))
    mask_p = u.arg_ptr(b, args, 6) if key.mask else None
    nblk = b.sdiv(b.add(B, u.i64(W - 1)), u.i64(W))
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), b.mul(A, nblk))
    best_p, idx_p = u.entry_alloca(b, vt), u.entry_alloca(b, it)
    with u.Loop(b, q0, q1, 1, "q") as q:
        a = b.sdiv(q, nblk)
        b0 = b.mul(b.srem(q, nblk), u.i64(W))
        mask = u.tail_mask(b, u.smin(b, u.i64(W), b.sub(B, b0)), W)
        base = b.add(b.mul(a, b.mul(N, B)), b0)
        b.store(u.const(vt, IDENTITY[key.op]), best_p)
        b.store(u.const(it, -1), idx_p)
        with u.Loop(b, u.i64(0), N, 1, "n") as n:
            at = b.add(base, b.mul(n, B))
            v = u.load(b, x, at, key.in_dtype, W, mask)
            if key.absval:
                v = fabs(b, v)
            best, idx = b.load(best_p), b.load(idx_p)
            beats = b.fcmp_ordered(">" if key.op == "max" else "<", v, best)
            nan_first = b.and_(b.fcmp_unordered("uno", v, v), b.fcmp_ordered("ord", best, best))
            first = b.icmp_signed("<", idx, u.const(it, 0))
            take = b.or_(first, b.or_(beats, nan_first))
            if mask_p is not None:
                take = b.and_(take, truthy(b, u.load(b, mask_p, at, key.mask, W, mask)))
            b.store(b.select(take, v, best), best_p)
            b.store(b.select(take, u.splat(b, n, W), idx), idx_p)
        u.store(b, b.load(idx_p), out, b.add(b.mul(a, B), b0), "i64", mask)
    b.ret_void()
    return mod


@register
@dataclass(frozen=True)
class FinishKey(KernelKey):
    """Per-lane fix-ups that need a reduction's selected count (i64) — one vector pass over M:

      fill   out = cnt == 0 ? p : v          (an empty masked lane takes `empty`)
      mean   out = cnt == 0 ? p : v / cnt    (masked mean; p = NaN or `empty`; 0 in backward)
      tof32  out = float(cnt)

    Argument block: out, v, cnt, p (f32 bits, or the i64 itself when vdtype is i64), M, chunk."""

    family = "reduce_finish"
    mode: str
    vdtype: str = "f32"  # f32 | i64 (fill only)

    def ir(self, symbol: str) -> str:
        return str(_build_finish(self, symbol))


def _build_finish(key: FinishKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    out, v, cnt = (u.arg_ptr(b, args, i) for i in range(3))
    p = u.arg(b, args, 3) if key.vdtype == "i64" else u.arg_f32(b, args, 3)
    M, chunk = u.arg(b, args, 4), u.arg(b, args, 5)
    ft = ir.VectorType(u.F32, W)

    def body(i, tmask=None):
        c = u.load(b, cnt, i, "i64", W, tmask)
        if key.mode == "tof32":
            r = b.sitofp(c, ft)
        else:
            val = u.load(b, v, i, key.vdtype, W, tmask)
            if key.mode == "mean":
                val = b.fdiv(val, b.sitofp(c, ft))
            r = b.select(b.icmp_signed("==", c, u.const(c.type, 0)), u.splat(b, p, W), val)
        u.store(b, r, out, i, key.vdtype if key.mode == "fill" else "f32", tmask)

    chunk_pass(b, c0, c1, M, chunk, W, body)
    b.ret_void()
    return mod


@register
@dataclass(frozen=True)
class SegSpreadKey(KernelKey):
    """segment_sum's backward: out[a, n, b] = g[a, k, b] for every n of segment k, i.e. each
    segment's gradient broadcast over it. Item q = (a, k).

    Argument block: out, g, offsets, A, K, N, B, items per chunk."""

    family = "segment_spread"
    inner: bool  # B == 1

    def ir(self, symbol: str) -> str:
        return str(_build_spread(self, symbol))


def _build_spread(key: SegSpreadKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    out, g, offs = (u.arg_ptr(b, args, i) for i in range(3))
    A, K, N, B, per = (u.arg(b, args, i) for i in range(3, 8))
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), b.mul(A, K))

    def fill(dst0, length, value_at):
        """out[dst0 + j] = value_at(j) for j < length, vectorized with a masked tail."""
        full = b.sub(length, b.srem(length, u.i64(W)))
        with u.Loop(b, u.i64(0), full, W, "j") as j:
            u.store(b, value_at(j, None), out, b.add(dst0, j), "f32")
        rest = b.sub(length, full)
        with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
            m = u.tail_mask(b, rest, W)
            u.store(b, value_at(full, m), out, b.add(dst0, full), "f32", m)

    with u.Loop(b, q0, q1, 1, "q") as q:
        a = b.sdiv(q, K)
        k = b.srem(q, K)
        n0 = b.load(b.gep(offs, [k], source_etype=u.I64), typ=u.I64)
        n1 = b.load(b.gep(offs, [b.add(k, u.i64(1))], source_etype=u.I64), typ=u.I64)
        if key.inner:
            gv = u.splat(b, u.load(b, g, q, "f32"), W)
            fill(b.add(b.mul(a, N), n0), b.sub(n1, n0), lambda j, m: gv)
        else:
            src = b.mul(q, B)
            with u.Loop(b, n0, n1, 1, "n") as n:
                fill(b.mul(b.add(b.mul(a, N), n), B), B,
                     lambda j, m: u.load(b, g, b.add(src, j), "f32", W, m))
    b.ret_void()
    return mod
