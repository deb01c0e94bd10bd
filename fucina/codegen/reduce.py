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

Argument block: x, out, A, N, B, C, S, items per chunk, divisor (f32 bits; used by post="div").
Output layout: [A, S, B] partials (S == 1 on the final pass).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import nan_max, nan_min
from .kernels import KernelKey, register
from .target import host

UNROLL = 4
BLOCK = 2048  # outer reductions: columns per work item (8 KiB of f32 accumulators)

IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
COMBINE = {"sum": lambda b, x, y: b.fadd(x, y), "max": nan_max, "min": nan_min}


@register
@dataclass(frozen=True)
class ReduceKey(KernelKey):
    family = "reduce"
    op: str        # sum | max | min
    in_dtype: str  # f32 | f16 | bf16 (widened); partials and results are f32
    post: str      # none | div (mean: divide the final value by the divisor argument)
    inner: bool    # B == 1

    def ir(self, symbol: str) -> str:
        return str(_build(self, symbol))


def _hreduce(b, v, combine):
    """Fold a vector to a scalar by halves: a fixed tree, the same on every call."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, h), list(range(h))))
        hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, h), list(range(h, n))))
        v, n = combine(b, lo, hi), h
    return b.extract_element(v, u.i64(0))


def _build(key: ReduceKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    combine = COMBINE[key.op]
    ident = IDENTITY[key.op]
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, C, S, per = (u.arg(b, args, i) for i in range(2, 8))
    divisor = u.arg_f32(b, args, 8)
    nblk = u.i64(1) if key.inner else b.sdiv(b.add(B, u.i64(BLOCK - 1)), u.i64(BLOCK))
    items = b.mul(b.mul(A, S), nblk)
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), items)

    def finish(v):
        if key.post != "div":
            return v
        return b.fdiv(v, divisor if v.type == u.F32 else u.splat(b, divisor, W))

    with u.Loop(b, q0, q1, 1, "q") as q:
        blk = b.srem(q, nblk)
        rest = b.sdiv(q, nblk)
        s = b.srem(rest, S)
        a = b.sdiv(rest, S)
        n0 = b.mul(s, C)
        length = u.smin(b, C, b.sub(N, n0))
        if key.inner:
            base = b.gep(x, [b.add(b.mul(a, N), n0)], source_etype=u.STORAGE[key.in_dtype])
            accs = [u.entry_alloca(b, vt) for _ in range(UNROLL)]
            for p in accs:
                b.store(u.const(vt, ident), p)
            big = b.sub(length, b.srem(length, u.i64(UNROLL * W)))
            with u.Loop(b, u.i64(0), big, UNROLL * W, "j") as j:
                for t, p in enumerate(accs):
                    v = u.load(b, base, b.add(j, u.i64(t * W)), key.in_dtype, W)
                    b.store(combine(b, b.load(p), v), p)
            full = b.sub(length, b.srem(length, u.i64(W)))
            with u.Loop(b, big, full, W, "k") as j:
                v = u.load(b, base, j, key.in_dtype, W)
                b.store(combine(b, b.load(accs[0]), v), accs[0])
            tail = b.sub(length, full)
            with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                mask = u.tail_mask(b, tail, W)
                v = u.load(b, base, full, key.in_dtype, W, mask, ident)
                b.store(combine(b, b.load(accs[1]), v), accs[1])
            v01 = combine(b, b.load(accs[0]), b.load(accs[1]))
            v23 = combine(b, b.load(accs[2]), b.load(accs[3]))
            total = _hreduce(b, combine(b, v01, v23), combine)
            u.store(b, finish(total), out, q, "f32")
        else:
            # Rows stream in memory order; the block's accumulators live in the output (L1-sized),
            # and each output still folds its column serially over n, so the order is fixed.
            b0 = b.mul(blk, u.i64(BLOCK))
            width = u.smin(b, u.i64(BLOCK), b.sub(B, b0))
            obase = b.gep(out, [b.add(b.mul(rest, B), b0)], source_etype=u.F32)
            full = b.sub(width, b.srem(width, u.i64(W)))
            tail = b.sub(width, full)
            mask = u.tail_mask(b, tail, W)
            with u.Loop(b, u.i64(0), full, W, "init") as j:
                u.store(b, u.const(vt, ident), obase, j, "f32")
            with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                u.store(b, u.const(vt, ident), obase, full, "f32", mask)
            row0 = b.add(b.mul(b.add(b.mul(a, N), n0), B), b0)
            with u.Loop(b, u.i64(0), length, 1, "n") as n:
                xrow = b.gep(x, [b.add(row0, b.mul(n, B))], source_etype=u.STORAGE[key.in_dtype])
                with u.Loop(b, u.i64(0), full, W, "j") as j:
                    acc = u.load(b, obase, j, "f32", W)
                    u.store(b, combine(b, acc, u.load(b, xrow, j, key.in_dtype, W)), obase, j, "f32")
                with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
                    acc = u.load(b, obase, full, "f32", W, mask)
                    v = u.load(b, xrow, full, key.in_dtype, W, mask, ident)
                    u.store(b, combine(b, acc, v), obase, full, "f32", mask)
            if key.post == "div":
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

    Work item q = (a, block of W columns); each lane scans its column serially over n."""

    family = "argext"
    op: str        # max | min
    in_dtype: str

    def ir(self, symbol: str) -> str:
        return str(_build_arg(self, symbol))


def _build_arg(key: ArgKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    vt, it = ir.VectorType(u.F32, W), ir.VectorType(u.I64, W)
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, per = (u.arg(b, args, i) for i in range(2, 6))
    nblk = b.sdiv(b.add(B, u.i64(W - 1)), u.i64(W))
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), b.mul(A, nblk))
    best_p, idx_p = u.entry_alloca(b, vt), u.entry_alloca(b, it)
    with u.Loop(b, q0, q1, 1, "q") as q:
        a = b.sdiv(q, nblk)
        b0 = b.mul(b.srem(q, nblk), u.i64(W))
        mask = u.tail_mask(b, u.smin(b, u.i64(W), b.sub(B, b0)), W)
        base = b.add(b.mul(a, b.mul(N, B)), b0)
        b.store(u.load(b, x, base, key.in_dtype, W, mask), best_p)
        b.store(u.const(it, 0), idx_p)
        with u.Loop(b, u.i64(1), N, 1, "n") as n:
            v = u.load(b, x, b.add(base, b.mul(n, B)), key.in_dtype, W, mask)
            best = b.load(best_p)
            beats = b.fcmp_ordered(">" if key.op == "max" else "<", v, best)
            nan_first = b.and_(b.fcmp_unordered("uno", v, v), b.fcmp_ordered("ord", best, best))
            take = b.or_(beats, nan_first)
            b.store(b.select(take, v, best), best_p)
            b.store(b.select(take, u.splat(b, n, W), b.load(idx_p)), idx_p)
        u.store(b, b.load(idx_p), out, b.add(b.mul(a, B), b0), "i64", mask)
    b.ret_void()
    return mod
