"""float32 pow with the domain of Zig's std.math.pow, computed through float64 so it is
correctly rounded in all but rare ties (the float64 log2/exp2 below have ~1e-15 relative
error, far under half a float32 ulp).

Special cases, in order: pow(x, ±0) = 1 for any x; pow(1, y) = 1 for any y; NaN otherwise
propagates; a negative finite base with a non-integer exponent gives NaN; zeros, infinities
and |x| = 1 with infinite y follow C99/IEEE pow (which Zig and numpy share).
"""
from __future__ import annotations

import math

from llvmlite import ir

from . import irutil as u

F64 = ir.DoubleType()


def _ty(x, elem):
    return ir.VectorType(elem, x.type.count) if isinstance(x.type, ir.VectorType) else elem


def _c(ty, v):
    elem = ty.element if isinstance(ty, ir.VectorType) else ty
    c = ir.Constant(elem, v)
    return ir.Constant(ty, [c] * ty.count) if isinstance(ty, ir.VectorType) else c


def _fma(b, a, x, c):
    return u.intrinsic(b, "llvm.fma", a.type, [a, x, c])


def _log2_pos(b, xd):
    """log2 of a positive finite float64 (every float32 input is normal as a double)."""
    dt, it = xd.type, _ty(xd, u.I64)
    bits = b.bitcast(xd, it)
    e = b.sub(b.lshr(bits, _c(it, 52)), _c(it, 1023))
    m = b.bitcast(b.or_(b.and_(bits, _c(it, (1 << 52) - 1)), _c(it, 1023 << 52)), dt)  # [1, 2)
    big = b.fcmp_ordered(">", m, _c(dt, math.sqrt(2.0)))
    m = b.select(big, b.fmul(m, _c(dt, 0.5)), m)
    e = b.select(big, b.add(e, _c(it, 1)), e)
    s = b.fdiv(b.fsub(m, _c(dt, 1.0)), b.fadd(m, _c(dt, 1.0)))  # |s| <= 0.1716
    s2 = b.fmul(s, s)
    p = _c(dt, 1.0 / 17.0)
    for k in (15, 13, 11, 9, 7, 5, 3, 1):  # atanh series: log m = 2 s (1 + s2/3 + s2^2/5 + ...)
        p = _fma(b, p, s2, _c(dt, 1.0 / k))
    ln_m = b.fmul(b.fmul(p, s), _c(dt, 2.0))
    return _fma(b, ln_m, _c(dt, 1.0 / math.log(2.0)), b.sitofp(e, dt))


def _exp2(b, t):
    """2^t for float64 t, clamped to [-300, 300] (far outside float32's range either way)."""
    dt, it = t.type, _ty(t, u.I64)
    t = u.intrinsic(b, "llvm.maxnum", dt, [u.intrinsic(b, "llvm.minnum", dt, [t, _c(dt, 300.0)]),
                                           _c(dt, -300.0)])
    n = u.intrinsic(b, "llvm.roundeven", dt, [t])
    f = b.fmul(b.fsub(t, n), _c(dt, math.log(2.0)))  # |f| <= 0.347
    p = _c(dt, 1.0 / math.factorial(13))
    for k in range(12, -1, -1):
        p = _fma(b, p, f, _c(dt, 1.0 / math.factorial(k)))
    scale = b.bitcast(b.shl(b.add(b.fptosi(n, it), _c(it, 1023)), _c(it, 52)), dt)
    return b.fmul(p, scale)


def pow(b: ir.IRBuilder, x, y):
    """x ** y for float32 scalars or vectors (same type)."""
    ft, dt, it = x.type, _ty(x, F64), _ty(x, u.I32)
    zero, one = u.const(ft, 0.0), u.const(ft, 1.0)
    inf = u.const(ft, math.inf)
    nan = u.const(ft, math.nan)
    ax = u.intrinsic(b, "llvm.fabs", ft, [x])
    ay = u.intrinsic(b, "llvm.fabs", ft, [y])
    y_int = b.fcmp_ordered("==", u.intrinsic(b, "llvm.floor", ft, [y]), y)
    small = b.fcmp_ordered("<", ay, u.const(ft, 16777216.0))  # above 2^24 every float is even
    y_odd = b.and_(b.and_(y_int, small),
                   b.icmp_unsigned("==", b.and_(b.fptosi(b.select(small, y, zero), it), u.const(it, 1)),
                                   u.const(it, 1)))
    # the general case: |x|^y through float64, sign from an odd integer exponent
    axd = b.fpext(b.select(b.fcmp_ordered(">", ax, zero), ax, one), dt)
    mag = b.fptrunc(_exp2(b, b.fmul(b.fpext(y, dt), _log2_pos(b, axd))), ft)
    neg = b.fcmp_ordered("<", x, zero)
    r = b.select(b.and_(neg, y_odd), b.fneg(mag), mag)
    r = b.select(b.and_(neg, b.not_(y_int)), nan, r)
    # infinite exponent: compare |x| with 1
    y_inf = b.fcmp_ordered("==", ay, inf)
    y_pos = b.fcmp_ordered(">", y, zero)
    big = b.fcmp_ordered(">", ax, one)
    r = b.select(y_inf, b.select(b.fcmp_ordered("==", ax, one), one,
                                 b.select(b.xor(big, y_pos), zero, inf)), r)
    # zero or infinite base: magnitude 0 or inf by the sign of y, signed for odd integer y
    x_zero = b.fcmp_ordered("==", ax, zero)
    x_inf = b.fcmp_ordered("==", ax, inf)
    edge_mag = b.select(b.xor(x_zero, y_pos), inf, zero)
    edge_mag = b.select(b.and_(y_odd, neg), b.fneg(edge_mag), edge_mag)
    x_zero_signed = b.and_(x_zero, y_odd)  # keep -0's sign: pow(-0, 3) = -0, pow(-0, -3) = -inf
    edge_mag = b.select(x_zero_signed, u.intrinsic(b, "llvm.copysign", ft, [b.select(y_pos, zero, inf), x]),
                        edge_mag)
    r = b.select(b.and_(b.or_(x_zero, x_inf), b.not_(y_inf)), edge_mag, r)
    # NaNs propagate, then the two rules that beat NaN
    r = b.select(b.or_(b.fcmp_unordered("uno", x, x), b.fcmp_unordered("uno", y, y)), nan, r)
    r = b.select(b.fcmp_ordered("==", x, one), one, r)
    return b.select(b.fcmp_ordered("==", y, zero), one, r)
