"""Cross-entropy kernels (SPEC L-1): a fused log-softmax + NLL forward that saves per-row
{max, sum of exp} so the backward is one pass over the logits.

Rows are [R, K] with the class axis contiguous. Labels are i64 with -1 for an ignored row.
Forward, per row: m = max x, S = sum exp(x - m) (m shifted by 0 when not finite),
loss = ln S + m - (1-eps) x[y] - (eps/K) sum x; ignored rows give 0.
Backward: dx = coef * (exp(x - m) / S - ((1-eps) [c == y] + eps/K)), coef = g_r * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from . import vmath
from .emit import fold, nan_max
from .kernels import KernelKey, register
from .target import host

UNROLL = 4


def _row_pass(b, base, K, W, accs, step, fill):
    """Walk one row: 4 vectors per step into 4 accumulators, then single vectors into the
    first, then a masked tail (lanes past K read `fill`). `step(acc, v) -> acc` is the fold."""
    big = b.sub(K, b.srem(K, u.i64(UNROLL * W)))
    with u.Loop(b, u.i64(0), big, UNROLL * W, "c4") as c:
        for t, p in enumerate(accs):
            b.store(step(b.load(p), u.load(b, base, b.add(c, u.i64(t * W)), "f32", W)), p)
    full = b.sub(K, b.srem(K, u.i64(W)))
    with u.Loop(b, big, full, W, "c1") as c:
        b.store(step(b.load(accs[0]), u.load(b, base, c, "f32", W)), accs[0])
    rest = b.sub(K, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        v = u.load(b, base, full, "f32", W, u.tail_mask(b, rest, W), fill)
        b.store(step(b.load(accs[1]), v), accs[1])


def _add(b, x, y):
    return b.fadd(x, y)


def _row_stats(b, base, K, W, mx, sx):
    """(m shifted to 0 when not finite, S = sum exp(x - m), sum x) of one row."""
    vt = ir.VectorType(u.F32, W)
    for p in mx:
        b.store(u.const(vt, float("-inf")), p)
    _row_pass(b, base, K, W, mx, lambda acc, v: nan_max(b, acc, v), float("-inf"))
    for p in sx:
        b.store(u.const(vt, 0.0), p)
    _row_pass(b, base, K, W, sx, lambda acc, v: b.fadd(acc, v), 0.0)
    sumx = fold(b, sx, _add)
    m = fold(b, mx, nan_max)
    finite = b.fcmp_ordered("<", vmath.fabs(b, m), u.const(u.F32, float("inf")))
    m_shift = b.select(finite, m, u.const(u.F32, 0.0))
    ms = u.splat(b, m_shift, W)
    for p in sx:
        b.store(u.const(vt, 0.0), p)
    _row_pass(b, base, K, W, sx, lambda acc, v: b.fadd(acc, vmath.exp(b, b.fsub(v, ms))),
              float("-inf"))
    return m_shift, fold(b, sx, _add), sumx


@register
@dataclass(frozen=True)
class CeForwardKey(KernelKey):
    """args: x, labels, loss, m, s, R, K, eps (f32 bits), rows per chunk."""

    family = "ce_forward"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().f32_lanes
        x, labels, loss, mo, so = (u.arg_ptr(b, args, i) for i in range(5))
        R, K = u.arg(b, args, 5), u.arg(b, args, 6)
        eps = u.arg_f32(b, args, 7)
        per = u.arg(b, args, 8)
        r0, r1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), R)
        kf = b.sitofp(K, u.F32)
        vt = ir.VectorType(u.F32, W)
        mx = [u.entry_alloca(b, vt) for _ in range(UNROLL)]
        sx = [u.entry_alloca(b, vt) for _ in range(UNROLL)]
        with u.Loop(b, r0, r1, 1, "r") as r:
            base = b.gep(x, [b.mul(r, K)], source_etype=u.F32)
            m, S, sumx = _row_stats(b, base, K, W, mx, sx)
            u.store(b, m, mo, r, "f32")
            u.store(b, S, so, r, "f32")
            y = u.load(b, labels, r, "i64")
            ignored = b.icmp_signed("<", y, u.i64(0))
            xy = u.load(b, base, b.select(ignored, u.i64(0), y), "f32")
            one = u.const(u.F32, 1.0)
            smooth = b.select(b.fcmp_ordered("==", eps, u.const(u.F32, 0.0)), u.const(u.F32, 0.0),
                              b.fmul(b.fdiv(eps, kf), sumx))
            val = b.fsub(b.fsub(b.fadd(vmath.log(b, S), m), b.fmul(b.fsub(one, eps), xy)), smooth)
            u.store(b, b.select(ignored, u.const(u.F32, 0.0), val), loss, r, "f32")
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class CeBackwardKey(KernelKey):
    """args: x, labels, m, s, g, g row stride (0|1), dx, R, K, eps bits, scale bits, rows per chunk."""

    family = "ce_backward"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().f32_lanes
        x, labels, mp, sp, gp = (u.arg_ptr(b, args, i) for i in range(5))
        gstride = u.arg(b, args, 5)
        dx = u.arg_ptr(b, args, 6)
        R, K = u.arg(b, args, 7), u.arg(b, args, 8)
        eps, scale = u.arg_f32(b, args, 9), u.arg_f32(b, args, 10)
        per = u.arg(b, args, 11)
        r0, r1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), R)
        one = u.const(u.F32, 1.0)
        base_t = b.fdiv(eps, b.sitofp(K, u.F32))
        hit_t = b.fadd(b.fsub(one, eps), base_t)
        with u.Loop(b, r0, r1, 1, "r") as r:
            row = b.mul(r, K)
            xb = b.gep(x, [row], source_etype=u.F32)
            ob = b.gep(dx, [row], source_etype=u.F32)
            y = u.load(b, labels, r, "i64")
            ignored = b.icmp_signed("<", y, u.i64(0))
            coef = b.fmul(u.load(b, gp, b.mul(r, gstride), "f32"), scale)
            coef = b.select(ignored, u.const(u.F32, 0.0), coef)
            inv = b.fdiv(one, u.load(b, sp, r, "f32"))
            ms, invs, coefs = (u.splat(b, v, W) for v in (u.load(b, mp, r, "f32"), inv, coef))
            ys, bt, ht = u.splat(b, y, W), u.splat(b, base_t, W), u.splat(b, hit_t, W)

            def body(c, mask):
                v = u.load(b, xb, c, "f32", W, mask)
                p = b.fmul(vmath.exp(b, b.fsub(v, ms)), invs)
                cols = b.add(u.splat(b, c, W), u.iota(W))
                t = b.select(b.icmp_signed("==", cols, ys), ht, bt)
                u.store(b, b.fmul(coefs, b.fsub(p, t)), ob, c, "f32", mask)

            full = b.sub(K, b.srem(K, u.i64(W)))
            with u.Loop(b, u.i64(0), full, W, "c") as c:
                body(c, None)
            rest = b.sub(K, full)
            with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
                body(full, u.tail_mask(b, rest, W))
        b.ret_void()
        return str(mod)
