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

Argument blocks
  fwd: x, out, w, b, residual, mean, inv, std, R, K, n, eps bits, div bits, rows per chunk
  bwd: x, g, w, mean, inv, std, dx, partials, R, K, n, eps bits, div bits, rows per chunk
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import sqrt
from .kernels import KernelKey, register
from .emit import fold
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
