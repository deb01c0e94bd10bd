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

from llvmlite import ir

from . import irutil as u
from . import vmath
from .kernels import KernelKey, register
from .rows import map_pass
from .target import host
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
    """Vectors along the row: the features outside the span copied W at a time; "half" takes W
    pairs per step (first halves from one vector, second halves from another); the interleaved
    modes take W features (W/2 pairs) per step, each pair's cos and sin duplicated into its two
    lanes and the pair swapped by a shuffle, so both outputs are the same separately rounded
    products, difference and sum as one pair at a time gives."""
    W = host().f32_lanes
    x, out, cs, sn = (u.arg_ptr(b, args, i) for i in range(4))
    R, F, M, pairs, start, per = (u.arg(b, args, 4 + i) for i in range(6))
    D = b.add(pairs, pairs)
    end = b.add(start, D)
    r0 = b.mul(c0, per)
    r1 = u.smin(b, b.mul(c1, per), R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        base = b.mul(r, F)
        xb = b.gep(x, [base], source_etype=u.F32)
        ob = b.gep(out, [base], source_etype=u.F32)
        trow = b.mul(b.sdiv(r, M), pairs)
        cb = b.gep(cs, [trow], source_etype=u.F32)
        sb = b.gep(sn, [trow], source_etype=u.F32)

        def copy(c, m):
            u.store(b, u.load(b, xb, c, "f32", W, m), ob, c, "f32", m)
        map_pass(b, u.i64(0), start, W, copy)        # features outside the span pass through
        map_pass(b, end, F, W, copy)

        def table(i, m, lanes=W):
            c, s = u.load(b, cb, i, "f32", lanes, m), u.load(b, sb, i, "f32", lanes, m)
            return c, (b.fneg(s) if key.negate else s)

        if key.mode == "half":
            xa, oa = (b.gep(p, [start], source_etype=u.F32) for p in (xb, ob))
            xh, oh = (b.gep(p, [b.add(start, pairs)], source_etype=u.F32) for p in (xb, ob))

            def half(i, m):
                c, s = table(i, m)
                a1, a2 = u.load(b, xa, i, "f32", W, m), u.load(b, xh, i, "f32", W, m)
                u.store(b, b.fsub(b.fmul(a1, c), b.fmul(a2, s)), oa, i, "f32", m)
                u.store(b, b.fadd(b.fmul(a1, s), b.fmul(a2, c)), oh, i, "f32", m)
            map_pass(b, u.i64(0), pairs, W, half)
        else:
            xs, os_ = (b.gep(p, [start], source_etype=u.F32) for p in (xb, ob))
            dup = ir.Constant(ir.VectorType(u.I32, W), [j // 2 for j in range(W)])
            swap = ir.Constant(ir.VectorType(u.I32, W), [j ^ 1 for j in range(W)])
            even = ir.Constant(ir.VectorType(u.I1, W), [int(j % 2 == 0) for j in range(W)])

            def pairs_of(j, m):
                i = b.sdiv(j, u.i64(2))                 # W/2 pairs from pair i on
                tm = None if m is None else u.tail_mask(b, b.sub(pairs, i), W // 2)
                c, s = table(i, tm, W // 2)
                c, s = (b.shuffle_vector(v, v, dup) for v in (c, s))
                xv = u.load(b, xs, j, "f32", W, m)
                p = b.fmul(xv, c)                        # lane 2i: a1·c, lane 2i+1: a2·c
                q = b.fmul(b.shuffle_vector(xv, xv, swap), s)   # a2·s, a1·s
                u.store(b, b.select(even, b.fsub(p, q), b.fadd(q, p)), os_, j, "f32", m)
            map_pass(b, u.i64(0), D, W, pairs_of)
