"""Loss kernels. The elementwise losses (SPEC L-4) and their derivatives are the op table OPS,
lowered from fucina/kernel_templates/losses.py for the elementwise generator.

Cross-entropy kernels (SPEC L-1): a fused log-softmax + NLL forward that saves per-row
{max, sum of exp} so the backward is one pass over the logits.

Rows are [R, K] with the class axis contiguous. Labels are i64 with -1 for an ignored row.
Forward, per row (rows.row_max_sum: max and sum x in one pass, then the exps):
m = max x, S = sum exp(x - m) (m shifted by 0 when not finite),
loss = ln S + m - (1-eps) x[y] - (eps/K) sum x; ignored rows give 0.
Backward: dx = coef * (exp(x - m) / S - ((1-eps) [c == y] + eps/K)), coef = g_r * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..kernel_templates import losses as _t
from . import irutil as u
from . import vmath
from .lowering import lower_table
from .kernels import KernelKey, register
from .rows import accs_of, map_pass, row_max_sum
from .target import host

OPS = lower_table(_t.TEMPLATES, _t.CONSTANTS, _t.KERNELS)


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
        mx, sx, sx2 = (accs_of(b, vt, 0.0) for _ in range(3))
        with u.Loop(b, r0, r1, 1, "r") as r:
            base = b.gep(x, [b.mul(r, K)], source_etype=u.F32)
            m, S, sumx = row_max_sum(b, base, K, W, mx, sx, sx2)
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

            map_pass(b, u.i64(0), K, W, body)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class SerialSumKey(KernelKey):
    """args: v, out, n — out[0] = (((v0 + v1) + v2) + ...) in f32, one chunk: the loss
    reduction of SPEC L-1 is one serial sum in row order, the same bits for any thread count."""

    family = "serial_sum"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        v, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        n = u.arg(b, args, 2)
        acc = u.entry_alloca(b, u.F32)
        b.store(u.const(u.F32, 0.0), acc)
        with u.Loop(b, u.i64(0), n, 1, "i") as i:
            b.store(b.fadd(b.load(acc), u.load(b, v, i, "f32")), acc)
        u.store(b, b.load(acc), out, u.i64(0), "f32")
        b.ret_void()
        return str(mod)
