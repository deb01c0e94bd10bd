"""Typed (non-f32) math and casts (SPEC R-10, R-11): the integer/bool emitter table of the
elementwise generator, the cast emitters every domain shares, and the zero-divisor scan kernel.

The i64 arithmetic (wrapping; divisions by a guarded divisor that never trap on any data) is
written as templates in fucina/kernel_templates/typed.py; reporting a zero divisor is the
host's job (the `zero_scan` kernel, read by fucina.ag.typed).
Cast emitters read their operand's compute type (f32, i64 or a bool byte) and return the
target's; the generator's store narrows f32 to f16/bf16 and an i1 to a bool byte.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..kernel_templates import typed as _t
from . import irutil as u
from . import masks
from .kernels import KernelKey, register
from .lowering import lower_table

def _elem(v):
    return v.type.element if isinstance(v.type, ir.VectorType) else v.type


def _like(v, elem):
    """The type of v with its element type replaced (scalar or vector)."""
    return ir.VectorType(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem


def _is_float(v) -> bool:
    return isinstance(_elem(v), (ir.FloatType, ir.HalfType, ir.DoubleType))


# ---- casts ----------------------------------------------------------------------------------

def _f32_to_i64_sat(b, x, ty):
    """Truncate toward zero, saturate, NaN -> 0 (the semantics of llvm.fptosi.sat, which the
    x86 backend scalarizes): out-of-range and NaN lanes convert a 0.0 instead — fptosi of them
    would be poison — and are patched after one vector convert (vcvttps2qq on AVX-512)."""
    hi = b.fcmp_ordered(">=", x, u.const(x.type, 2.0 ** 63))   # +inf too
    lo = b.fcmp_ordered("<", x, u.const(x.type, -(2.0 ** 63)))  # -inf too; -2^63 itself converts
    nan = b.fcmp_unordered("uno", x, x)
    safe = b.select(b.or_(b.or_(hi, lo), nan), u.const(x.type, 0.0), x)
    r = b.fptosi(safe, ty)
    r = b.select(hi, u.const(ty, (1 << 63) - 1), r)
    return b.select(lo, u.const(ty, -(1 << 63)), r)


def to_i64(b, x):
    """float: truncate toward zero, saturate, NaN -> 0; bool byte: 0/1; i64: itself."""
    ty = _like(x, u.I64)
    if _is_float(x):
        return _f32_to_i64_sat(b, x, ty)
    if _elem(x) == u.I64:
        return x
    return b.zext(b.icmp_unsigned("!=", x, u.const(x.type, 0)), ty)  # a bool byte -> 0/1


def to_f32(b, x):
    """i64: round to nearest even; bool byte: 0.0/1.0; f32: itself (f16/bf16 arrive widened)."""
    if _is_float(x):
        return x
    ty = _like(x, u.F32)
    if _elem(x) == u.I64:
        return b.sitofp(x, ty)  # round to nearest even
    nonzero = b.icmp_unsigned("!=", x, u.const(x.type, 0))
    return b.select(nonzero, u.const(ty, 1.0), u.const(ty, 0.0))


def to_bool(b, x):
    """x != 0; a float NaN is true, -0.0 false."""
    if _is_float(x):
        return b.fcmp_unordered("!=", x, u.const(x.type, 0.0))  # NaN -> true
    return b.icmp_unsigned("!=", x, u.const(x.type, 0))


CASTS = {
    "to_i64": (1, to_i64),
    "to_f32": (1, to_f32),
    "to_bool": (1, to_bool),
}
"""Shared by both domains: codegen/elementwise.py merges them into FLOAT_OPS as well, so a
float source can be cast to i64 or bool (fucina.exec.elementwise.cast picks the op)."""

OPS = {
    **masks.OPS,  # where, compares, logical ops: written for integer and bool operands too
    **CASTS,
    **lower_table(_t.TEMPLATES, _t.CONSTANTS, _t.KERNELS),
}
"""The integer/bool table of the elementwise generator (used when the first non-bool operand
is i64, or every operand is bool): the arithmetic is fucina/kernel_templates/typed.py's."""


# ---- zero-divisor scan ----------------------------------------------------------------------

@register
@dataclass(frozen=True)
class ZeroScanKey(KernelKey):
    """flags[c] = 1 if chunk c of a contiguous i64 array holds a 0, else 0 (one byte per chunk).

    Each chunk writes only its own flag, so there is no race and no atomics; OR is exact, so the
    grid never changes the answer. Written as a scalar loop for the loop vectorizer.
    Argument block: x, n, chunk, flags."""
    family = "zero_scan"
    vectorize_loops = True
    dtype: str = "i64"

    def ir(self, symbol: str) -> str:
        return str(_build_zero_scan(self, symbol))


def _build_zero_scan(key: ZeroScanKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    x, n, chunk, flags = u.arg_ptr(b, args, 0), u.arg(b, args, 1), u.arg(b, args, 2), u.arg_ptr(b, args, 3)
    st = u.STORAGE[key.dtype]
    acc = u.entry_alloca(b, u.I8, "acc")
    with u.Loop(b, c0, c1, 1, "c") as c:
        e0 = b.mul(c, chunk)
        e1 = u.smin(b, b.add(e0, chunk), n)
        b.store(u.const(u.I8, 0), acc)
        with u.Loop(b, e0, e1, 1, "e") as e:
            v = b.load(b.gep(x, [e], source_etype=st), typ=st)
            hit = b.zext(b.icmp_signed("==", v, u.const(st, 0)), u.I8)
            b.store(b.or_(b.load(acc, typ=u.I8), hit), acc)
        b.store(b.load(acc, typ=u.I8), b.gep(flags, [c], source_etype=u.I8))
    b.ret_void()
    return mod
