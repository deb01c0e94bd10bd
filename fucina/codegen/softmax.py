"""Softmax-family row kernels (SPEC §3.9): softmax (scale, additive mask, ALiBi, sinks, causal),
log_softmax, logsumexp and their backward rules, all over rows [R, K] with the op axis contiguous.

One key class, one family; `op` picks the kernel. Per row:

  softmax        pass 1: m = max z (z = x*scale + slope*mask over the row's valid prefix [0, L));
                 a sink joins the max. pass 2: e = exp(z - m) stored to out, S = sum e (+ the sink's
                 exp(s - m) after the fold). pass 3: out *= 1/S on [0, L), out = 0 on [L, K).
  log_softmax    pass 1: m (shifted by 0 when not finite); pass 2: S = sum exp(x - m);
                 pass 3: y = (x - m) - log S.
  logsumexp      passes 1-2 as log_softmax; out[r] = log S + m.
  *_bwd          softmax: d = sum g*y, dx = (y*(g - d))*scale; log_softmax: sg = sum g,
                 dx = g - exp(y)*sg; logsumexp: dx = g[r]*exp(x - lse[r]).

Every sum and max walks the row the same way (`fold_pass`): 4 vector accumulators striding by
4 vectors, then single vectors into the first, a masked tail into the second, then the fixed
combine (0 op 1) op (2 op 3) and the fixed lane tree. The order depends on the row length only,
and a row never spans two work items, so any thread count gives the same bits. The row max is a
plain vmaxps: a NaN logit makes the row sum NaN, so the whole row comes out NaN regardless.

Row geometry passed at run time (so one kernel serves every shape): the mask's row offset is
sum_i ((r / in_i) % dim_i) * stride_i over up to MASK_DIMS coalesced outer axes; the head of
row r is (r / hin) % H (ALiBi slope and sink), its query index (r / qin) % Q (causal:
L = offset + q + 1). Each such digit is divided out once per work item and then carried from
row to row (`Digit`).

Argument block (forward softmax): x, out, mask, slopes, sinks, R, K, scale (f32 bits), rows per
chunk, MASK_DIMS x (in, dim, stride), hin, H, qin, Q, offset.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from . import vmath
from .emit import fold
from .rows import accs_of, exp_sum, fadd, fmax, fold_pass, map_pass, max_of, row_max_sum
from .kernels import KernelKey, register
from .target import host

MASK_DIMS = 3
OPS = ("softmax", "log_softmax", "logsumexp", "softmax_bwd", "log_softmax_bwd", "logsumexp_bwd")


# ---------------------------------------------------------------------------------------------
# the key

@register
@dataclass(frozen=True)
class SoftmaxKey(KernelKey):
    """op in OPS; the option fields matter for op == "softmax" only.

    mask: none | f32 | f16 | bf16 (its dtype); mask_col: unit (stride 1 along the row) | zero
    (one value per row); alibi: slope per head; sinks: one extra logit per head; causal."""

    family = "softmax"
    op: str
    mask: str = "none"
    mask_col: str = "unit"
    alibi: bool = False
    sinks: bool = False
    causal: bool = False

    def ir(self, symbol: str) -> str:
        if self.op not in OPS:
            raise ValueError(f"softmax kernel: unknown op {self.op!r}")
        return u.module(symbol, {"softmax": _softmax, "log_softmax": _lse, "logsumexp": _lse,
                                 "softmax_bwd": _softmax_bwd, "log_softmax_bwd": _log_softmax_bwd,
                                 "logsumexp_bwd": _logsumexp_bwd}[self.op], self)


class Digit:
    """(r / inner) % dim for consecutive rows r: two divisions at the first row, then per row an
    increment, two compares and two selects (no division in the row loop)."""

    def __init__(self, b, r0, inner, dim):
        self.b, self.inner, self.dim = b, inner, dim
        self.rem, self.idx = u.entry_alloca(b, u.I64), u.entry_alloca(b, u.I64)
        b.store(b.srem(r0, inner), self.rem)
        b.store(b.srem(b.sdiv(r0, inner), dim), self.idx)

    def value(self):
        return self.b.load(self.idx)

    def step(self):
        b = self.b
        rem = b.add(b.load(self.rem), u.i64(1))
        wrap = b.icmp_signed("==", rem, self.inner)
        b.store(b.select(wrap, u.i64(0), rem), self.rem)
        idx = b.add(b.load(self.idx), b.zext(wrap, u.I64))
        b.store(b.select(b.icmp_signed("==", idx, self.dim), u.i64(0), idx), self.idx)


def _rows(b, c0, c1, per, R):
    return b.mul(c0, per), u.smin(b, b.mul(c1, per), R)


def _softmax(key, b, args, c0, c1):
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    x, out, mask, slopes, sinks = (u.arg_ptr(b, args, i) for i in range(5))
    R, K = u.arg(b, args, 5), u.arg(b, args, 6)
    scale = u.arg_f32(b, args, 7)
    per = u.arg(b, args, 8)
    mdims = [tuple(u.arg(b, args, 9 + 3 * i + j) for j in range(3)) for i in range(MASK_DIMS)]
    a = 9 + 3 * MASK_DIMS
    hin, H, qin, Q, off = (u.arg(b, args, a + i) for i in range(5))
    r0, r1 = _rows(b, c0, c1, per, R)
    scales = u.splat(b, scale, W)
    mx = accs_of(b, vt, float("-inf"))
    sx = accs_of(b, vt, 0.0)
    digits = []
    if key.mask != "none":
        mdig = [(Digit(b, r0, inner, dim), stride) for inner, dim, stride in mdims]
        digits += [d for d, _ in mdig]
    if key.alibi or key.sinks:
        hdig = Digit(b, r0, hin, H)
        digits.append(hdig)
    if key.causal:
        qdig = Digit(b, r0, qin, Q)
        digits.append(qdig)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        xb = b.gep(x, [row], source_etype=u.F32)
        ob = b.gep(out, [row], source_etype=u.F32)
        head = hdig.value() if (key.alibi or key.sinks) else None
        L = K
        if key.causal:
            L = b.add(off, b.add(qdig.value(), u.i64(1)))
        slope = u.load(b, slopes, head, "f32") if key.alibi else None
        mrow = mconst = None
        if key.mask != "none":
            moff = u.i64(0)
            for d, stride in mdig:
                moff = b.add(moff, b.mul(d.value(), stride))
            mrow = b.gep(mask, [moff], source_etype=u.STORAGE[key.mask])
            if key.mask_col == "zero":
                mv = u.load(b, mrow, u.i64(0), key.mask)
                mconst = u.splat(b, b.fmul(slope, mv) if slope is not None else mv, W)
        slopes_v = u.splat(b, slope, W) if slope is not None else None

        def z(c, m):
            v = b.fmul(u.load(b, xb, c, "f32", W, m), scales)
            if key.mask == "none":
                return v
            if mconst is not None:
                return b.fadd(v, mconst)
            mv = u.load(b, mrow, c, key.mask, W, m)
            if slopes_v is not None:
                mv = b.fmul(slopes_v, mv)
            return b.fadd(v, mv)

        m = max_of(b, u.i64(0), L, W, mx, z)
        sink = None
        if key.sinks:
            sink = u.load(b, sinks, head, "f32")
            m = fmax(b, m, sink)
        S = exp_sum(b, u.i64(0), L, W, sx, z, u.splat(b, m, W), ob)
        if sink is not None:
            S = b.fadd(S, vmath.exp(b, b.fsub(sink, m)))
        inv = u.splat(b, b.fdiv(u.const(u.F32, 1.0), S), W)
        map_pass(b, u.i64(0), L, W, lambda c, msk: u.store(
            b, b.fmul(u.load(b, ob, c, "f32", W, msk), inv), ob, c, "f32", msk))
        if key.causal:
            map_pass(b, L, K, W, lambda c, msk: u.store(b, u.const(vt, 0.0), ob, c, "f32", msk))
        for d in digits:
            d.step()


def _lse(key, b, args, c0, c1):
    """args: x, out, R, K, rows per chunk. logsumexp writes out[R]; log_softmax out[R, K]."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    R, K, per = (u.arg(b, args, i) for i in (2, 3, 4))
    r0, r1 = _rows(b, c0, c1, per, R)
    mx = accs_of(b, vt, float("-inf"))
    sx = accs_of(b, vt, 0.0)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        xb = b.gep(x, [row], source_etype=u.F32)
        m, S = row_max_sum(b, xb, K, W, mx, sx)
        logs = vmath.log(b, S)
        if key.op == "logsumexp":
            u.store(b, b.fadd(logs, m), out, r, "f32")
        else:
            ob = b.gep(out, [row], source_etype=u.F32)
            ms, ls = u.splat(b, m, W), u.splat(b, logs, W)

            def y(c, msk):
                return b.fsub(b.fsub(u.load(b, xb, c, "f32", W, msk), ms), ls)
            map_pass(b, u.i64(0), K, W, lambda c, msk: u.store(b, y(c, msk), ob, c, "f32", msk))


def _softmax_bwd(key, b, args, c0, c1):
    """args: y, g, dx, R, K, scale bits, rows per chunk."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    y, g, dx = (u.arg_ptr(b, args, i) for i in range(3))
    R, K = u.arg(b, args, 3), u.arg(b, args, 4)
    scales = u.splat(b, u.arg_f32(b, args, 5), W)
    per = u.arg(b, args, 6)
    r0, r1 = _rows(b, c0, c1, per, R)
    sx = accs_of(b, vt, 0.0)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        yb, gb, ob = (b.gep(p, [row], source_etype=u.F32) for p in (y, g, dx))
        for p in sx:
            b.store(u.const(vt, 0.0), p)
        fold_pass(b, u.i64(0), K, W, sx, lambda c, m: b.fmul(
            u.load(b, gb, c, "f32", W, m), u.load(b, yb, c, "f32", W, m)), fadd, 0.0)
        d = u.splat(b, fold(b, sx, fadd), W)

        def body(c, m):
            yv = u.load(b, yb, c, "f32", W, m)
            v = b.fmul(b.fmul(yv, b.fsub(u.load(b, gb, c, "f32", W, m), d)), scales)
            u.store(b, v, ob, c, "f32", m)
        map_pass(b, u.i64(0), K, W, body)


def _log_softmax_bwd(key, b, args, c0, c1):
    """args: y, g, dx, R, K, rows per chunk."""
    W = host().f32_lanes
    vt = ir.VectorType(u.F32, W)
    y, g, dx = (u.arg_ptr(b, args, i) for i in range(3))
    R, K, per = (u.arg(b, args, i) for i in (3, 4, 5))
    r0, r1 = _rows(b, c0, c1, per, R)
    sx = accs_of(b, vt, 0.0)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        yb, gb, ob = (b.gep(p, [row], source_etype=u.F32) for p in (y, g, dx))
        for p in sx:
            b.store(u.const(vt, 0.0), p)
        fold_pass(b, u.i64(0), K, W, sx, lambda c, m: u.load(b, gb, c, "f32", W, m), fadd, 0.0)
        sg = u.splat(b, fold(b, sx, fadd), W)

        def body(c, m):
            ey = vmath.exp(b, u.load(b, yb, c, "f32", W, m))
            u.store(b, b.fsub(u.load(b, gb, c, "f32", W, m), b.fmul(ey, sg)), ob, c, "f32", m)
        map_pass(b, u.i64(0), K, W, body)


def _logsumexp_bwd(key, b, args, c0, c1):
    """args: x, lse, g, dx, R, K, rows per chunk; dx = g[r] * exp(x - lse[r])."""
    W = host().f32_lanes
    x, lse, g, dx = (u.arg_ptr(b, args, i) for i in range(4))
    R, K, per = (u.arg(b, args, i) for i in (4, 5, 6))
    r0, r1 = _rows(b, c0, c1, per, R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, K)
        xb, ob = (b.gep(p, [row], source_etype=u.F32) for p in (x, dx))
        ls = u.splat(b, u.load(b, lse, r, "f32"), W)
        gs = u.splat(b, u.load(b, g, r, "f32"), W)
        map_pass(b, u.i64(0), K, W, lambda c, m: u.store(
            b, b.fmul(gs, vmath.exp(b, b.fsub(u.load(b, xb, c, "f32", W, m), ls))), ob, c, "f32", m))
