"""Mask and conditional emitters and kernels (SPEC §3.7).

A bool operand is stored as one byte (0 or 1) and read by truthiness; comparisons produce i1
values that the store widens to a byte. The op table OPS (where, logical ops, compares,
isnan) is lowered from fucina/kernel_templates/masks.py, which says the truthiness and
compare semantics per lane type; isinf and isfinite are written here (a float test, constant
on integer lanes). Every emitter serves any operand type — f32 (16-bit floats arrive
widened), i64 or a bool byte, scalar or vector — so the one table serves the float domain and
the integer/bool domain of the elementwise generator alike.

Two small kernel families live here too: `mask_reduce` (any/all over one axis, a truthiness
OR/AND — exact, so any grid gives the same bits) and `band_mask` (the two-axis iota compare
of band_mask/band_part/tril/triu). Both are written as scalar loops for the loop vectorizer.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..kernel_templates import masks as _t
from . import irutil as u
from .kernels import KernelKey, register
from .lowering import lower_table

COMPARE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")


def _elem(v):
    return v.type.element if isinstance(v.type, ir.VectorType) else v.type


def _is_int(v) -> bool:
    return isinstance(_elem(v), ir.IntType)


def _i1_like(v, value: bool):
    """An i1 constant (scalar or vector) shaped like v."""
    ty = ir.VectorType(u.I1, v.type.count) if isinstance(v.type, ir.VectorType) else u.I1
    return u.const(ty, int(value))


def _abs(b, x):
    return u.intrinsic(b, "llvm.fabs", x.type, [x])


def _isinf(b, x):
    return _i1_like(x, False) if _is_int(x) else b.fcmp_ordered("==", _abs(b, x), u.const(x.type, float("inf")))


def _isfinite(b, x):
    return _i1_like(x, True) if _is_int(x) else b.fcmp_ordered("<", _abs(b, x), u.const(x.type, float("inf")))


_truthy = lower_table(_t.TEMPLATES, _t.CONSTANTS, ["_truthy"])["_truthy"][1]

OPS = {
    **lower_table(_t.TEMPLATES, _t.CONSTANTS, _t.KERNELS),
    "isinf": (1, _isinf),
    "isfinite": (1, _isfinite),
}


# ---- any / all over one axis ----------------------------------------------------------------

BLOCK = 2048  # outer reductions: columns per work item


@register
@dataclass(frozen=True)
class MaskReduceKey(KernelKey):
    """any | all of the truthiness of x viewed as [A, N, B] (contiguous), over N.

    The axis is cut into segments of length C; work item q = (a, s, block of BLOCK columns)
    writes out[a, s, b] (bool bytes, shape [A, S, B]); a second launch over the partials
    (in_dtype "bool") finishes a split axis. OR/AND are exact: the grid never changes a bit.

    Argument block: x, out, A, N, B, C, S, items per chunk."""
    family = "mask_reduce"
    vectorize_loops = True
    op: str        # any | all
    in_dtype: str  # f32 | f16 | bf16 | i64 | bool
    inner: bool    # B == 1

    def ir(self, symbol: str) -> str:
        return str(_build_reduce(self, symbol))


def _build_reduce(key: MaskReduceKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    A, N, B, C, S, per = (u.arg(b, args, i) for i in range(2, 8))
    ident = u.const(u.I8, 1 if key.op == "all" else 0)

    def combine(acc, v):
        t = b.zext(_truthy(b, v), u.I8)
        return b.and_(acc, t) if key.op == "all" else b.or_(acc, t)

    nblk = u.i64(1) if key.inner else b.sdiv(b.add(B, u.i64(BLOCK - 1)), u.i64(BLOCK))
    items = b.mul(b.mul(A, S), nblk)
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), items)
    acc_slot = u.entry_alloca(b, u.I8, "acc")
    with u.Loop(b, q0, q1, 1, "q") as q:
        blk = b.srem(q, nblk)
        rest = b.sdiv(q, nblk)
        s = b.srem(rest, S)
        a = b.sdiv(rest, S)
        n0 = b.mul(s, C)
        n1 = u.smin(b, b.add(n0, C), N)
        orow = b.mul(b.add(b.mul(a, S), s), B)  # out[a, s, 0]
        if key.inner:
            base = b.gep(x, [b.mul(a, N)], source_etype=u.STORAGE[key.in_dtype])
            b.store(ident, acc_slot)
            with u.Loop(b, n0, n1, 1, "n") as n:
                b.store(combine(b.load(acc_slot), u.load(b, base, n, key.in_dtype)), acc_slot)
            b.store(b.load(acc_slot), b.gep(out, [orow], source_etype=u.I8))
        else:
            b0 = b.mul(blk, u.i64(BLOCK))
            b1 = u.smin(b, b.add(b0, u.i64(BLOCK)), B)
            obase = b.gep(out, [orow], source_etype=u.I8)
            with u.Loop(b, b0, b1, 1, "init") as j:
                b.store(ident, b.gep(obase, [j], source_etype=u.I8))
            with u.Loop(b, n0, n1, 1, "n") as n:
                xrow = b.gep(x, [b.mul(b.add(b.mul(a, N), n), B)], source_etype=u.STORAGE[key.in_dtype])
                with u.Loop(b, b0, b1, 1, "col") as j:
                    p = b.gep(obase, [j], source_etype=u.I8)
                    b.store(combine(b.load(p, typ=u.I8), u.load(b, xrow, j, key.in_dtype)), p)
    b.ret_void()
    return mod


# ---- band mask ------------------------------------------------------------------------------

@register
@dataclass(frozen=True)
class BandMaskKey(KernelKey):
    """out[i, j] = (i - j <= lower) and (j - i <= upper) as bool bytes, for an [R, Cn] output.

    Work item = one row. Argument block: out, R, Cn, lower, upper, rows per chunk (the bounds
    arrive clamped to +-(R + Cn), so `i - lower` and `i + upper` never overflow)."""
    family = "band_mask"
    vectorize_loops = True

    def ir(self, symbol: str) -> str:
        return str(_build_band(symbol))


def _build_band(symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    out = u.arg_ptr(b, args, 0)
    R, Cn, lower, upper, per = (u.arg(b, args, i) for i in range(1, 6))
    r0 = b.mul(c0, per)
    r1 = u.smin(b, b.mul(c1, per), R)
    with u.Loop(b, r0, r1, 1, "row") as i:
        lo = b.sub(i, lower)   # first column in the band (may be < 0)
        hi = b.add(i, upper)   # last column in the band (may be >= Cn)
        row = b.gep(out, [b.mul(i, Cn)], source_etype=u.I8)
        with u.Loop(b, u.i64(0), Cn, 1, "col") as j:
            inside = b.and_(b.icmp_signed(">=", j, lo), b.icmp_signed("<=", j, hi))
            b.store(b.zext(inside, u.I8), b.gep(row, [j], source_etype=u.I8))
    b.ret_void()
    return mod
