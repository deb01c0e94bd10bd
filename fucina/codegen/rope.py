"""Rotary position embedding kernels (SPEC §3.11): the cos/sin table and the pair rotation.

table   one work item per position p (args: pos i64[P], ff f32[pairs] or 0, cos, sin, P, pairs,
        D, theta_base (f32 bits)). Every step in f32, exactly as SPEC defines the table:
        pw[i] = powf(theta_base, f32(2i) / f32(D)); theta = f32(i32 p) / pw[i] (then / ff[i]);
        cos[p, i] = cos theta, sin[p, i] = +-sin theta (- iff `inverse`). Tables are
        [P, pairs] row-major.

apply   rows [R, F] contiguous; row r sits at position r / M (the position axis is outermost,
        M rows per position). The rotary span is the D = 2*pairs features starting at `start`
        (0 for half / interleaved, F - D for interleaved_tail); features outside it are copied.
        Pair i is (first, second) = (x[start+i], x[start+i+pairs]) for half, (x[start+2i],
        x[start+2i+1]) for the interleaved modes; first' = first*c - second*s, second' =
        first*s + second*c (no FMA contraction: separately rounded f32 products and sums).
        `negate` uses s = -sin: the inverse rotation (the backward rule).
        Args: x, out, cos, sin, R, F, M, pairs, start, rows per chunk.

A work item is a run of whole rows (how many depends on F alone), so results never depend on
the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import irutil as u
from . import vmath
from .kernels import KernelKey, register
from .vpow import pow as powf

OPS = ("table", "apply")
MODES = ("half", "interleaved", "interleaved_tail")


@register
@dataclass(frozen=True)
class RopeKey(KernelKey):
    """op: table | apply. table: inverse (negated sin), ff (frequency factors given).
    apply: mode in MODES, negate (rotate by -angle)."""

    family = "rope"
    op: str
    mode: str = "half"
    inverse: bool = False
    ff: bool = False
    negate: bool = False

    def ir(self, symbol: str) -> str:
        if self.op not in OPS:
            raise ValueError(f"rope kernel: unknown op {self.op!r}")
        if self.mode not in MODES:
            raise ValueError(f"rope kernel: unknown mode {self.mode!r}")
        mod, b, args, c0, c1 = u.kernel(symbol)
        (_table if self.op == "table" else _apply)(self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _table(key, b, args, c0, c1):
    pos, ff, cs, sn = (u.arg_ptr(b, args, i) for i in range(4))
    pairs, D = u.arg(b, args, 5), u.arg(b, args, 6)
    base = u.arg_f32(b, args, 7)
    fD = b.sitofp(D, u.F32)
    with u.Loop(b, c0, c1, 1, "p") as p:
        pv = b.trunc(u.load(b, pos, p, "i64"), u.I32)
        fp = b.sitofp(pv, u.F32)
        row = b.mul(p, pairs)
        with u.Loop(b, u.i64(0), pairs, 1, "i") as i:
            e = b.fdiv(b.sitofp(b.mul(i, u.i64(2)), u.F32), fD)
            pw = powf(b, base, e)
            th = b.fdiv(fp, pw)
            if key.ff:
                th = b.fdiv(th, u.load(b, ff, i, "f32"))
            s, c = vmath.sincos(b, th)
            if key.inverse:
                s = b.fneg(s)
            j = b.add(row, i)
            u.store(b, c, cs, j, "f32")
            u.store(b, s, sn, j, "f32")


def _apply(key, b, args, c0, c1):
    x, out, cs, sn = (u.arg_ptr(b, args, i) for i in range(4))
    R, F, M, pairs, start, per = (u.arg(b, args, 4 + i) for i in range(6))
    r0 = b.mul(c0, per)
    r1 = u.smin(b, b.mul(c1, per), R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        base = b.mul(r, F)
        xb = b.gep(x, [base], source_etype=u.F32)
        ob = b.gep(out, [base], source_etype=u.F32)
        trow = b.mul(b.sdiv(r, M), pairs)
        cb = b.gep(cs, [trow], source_etype=u.F32)
        sb = b.gep(sn, [trow], source_etype=u.F32)
        # pass-through features: the whole row first, the span is overwritten below
        with u.Loop(b, u.i64(0), F, 1, "j") as j:
            u.store(b, u.load(b, xb, j, "f32"), ob, j, "f32")
        with u.Loop(b, u.i64(0), pairs, 1, "i") as i:
            if key.mode == "half":
                ia = b.add(start, i)
                ib = b.add(ia, pairs)
            else:
                ia = b.add(start, b.mul(i, u.i64(2)))
                ib = b.add(ia, u.i64(1))
            c = u.load(b, cb, i, "f32")
            s = u.load(b, sb, i, "f32")
            if key.negate:
                s = b.fneg(s)
            a1 = u.load(b, xb, ia, "f32")
            a2 = u.load(b, xb, ib, "f32")
            y1 = b.fsub(b.fmul(a1, c), b.fmul(a2, s))
            y2 = b.fadd(b.fmul(a1, s), b.fmul(a2, c))
            u.store(b, y1, ob, ia, "f32")
            u.store(b, y2, ob, ib, "f32")
