"""Vector math: branch-free float32 transcendentals emitted as LLVM IR (no libm calls).

Every function takes an `ir.IRBuilder` and a value of type `float` or `<W x float>` (any W,
taken from the value's type) and returns a value of the same type. Only instructions that
lower to single AVX-512 instructions are used: fadd/fmul/fdiv, llvm.fma/fabs/copysign,
fcmp+select (min/max), bitcasts and integer shifts/adds for exponent work. The scalar and the
vector form of a function execute the same operations in the same order, so a scalar tail
gives the same bits as a vector lane.

Measured maximum error vs float64 numpy, in float32 ulps of the exact result, over EVERY
float32 of the domain (`python -m tools.vmath_ulp --exhaustive`; the 10^7-point sampled run
and the method are in docs/vmath.md). Bound: 2 ulp; nothing exceeds it.

| function | max ulp | points (all float32 in) | domain where the bound holds                  |
|----------|---------|-------------------------|-----------------------------------------------|
| exp      | 1.013   | 2.24e9 [-110, 95]       | all x; denormal results rounded, not flushed  |
| expm1    | 1.462   | 2.22e9 [-20, 95]        | all x                                         |
| log      | 0.923   | 2.14e9 (0, FLT_MAX]     | all x > 0, denormals included                 |
| log1p    | 1.523   | 3.20e9 [-1, FLT_MAX]    | all x > -1                                    |
| tanh     | 1.332   | 2.19e9 [-12, 12]        | all x                                         |
| sigmoid  | 1.501   | 2.24e9 [-110, 110]      | all x (denormal results for x < -87.3)        |
| erf      | 1.084   | 2.17e9 [-6, 6]          | all x                                         |
| sin      | 1.669   | 2.47e9 [-2^20, 2^20]    | abs(x) <= 2^20 (beyond: in [-1, 1], inexact)  |
| cos      | 1.807   | 2.47e9 [-2^20, 2^20]    | abs(x) <= 2^20 (beyond: in [-1, 1], inexact)  |

Outside the listed intervals each function is a constant, x itself or (sin/cos) bounded.

Special values follow C/numpy float32: NaN in -> NaN out everywhere; exp(-inf)=0,
exp(+inf)=inf; log(0)=-inf, log(x<0)=NaN, log(inf)=inf; log1p(-1)=-inf, log1p(x<-1)=NaN;
tanh(+-inf)=+-1; sigmoid(-inf)=0, sigmoid(inf)=1; erf(+-inf)=+-1; sin/cos(+-inf)=NaN;
signed zeros are kept by the odd functions (expm1, log1p, tanh, erf, sin).

Coefficients are minimax fits (weighted least squares on Chebyshev nodes refined by Lawson
iterations to equal ripple, then rounded to float32 one coefficient at a time, low order first,
re-fitting the remaining ones), stored as exact float32 hex literals.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from llvmlite import ir

from .irutil import intrinsic
from .target import host

F32 = ir.FloatType()
I32 = ir.IntType(32)

# ---------------------------------------------------------------------------------------------
# types and constants


def _with_elem(ty: ir.Type, elem: ir.Type) -> ir.Type:
    """The type shaped like ty (scalar or <W x _>) with element type elem."""
    return ir.VectorType(elem, ty.count) if isinstance(ty, ir.VectorType) else elem


def _int_type(ty: ir.Type) -> ir.Type:
    return _with_elem(ty, I32)


def _elem(ty: ir.Type) -> ir.Type:
    return ty.element if isinstance(ty, ir.VectorType) else ty


def _f32(value) -> float:
    """The float32 nearest to value (a float, int or Fraction), as a Python float (exact in
    the hex-double IR literal). A Fraction is rounded once (no double rounding via float64)."""
    if isinstance(value, Fraction):
        a = abs(value)
        if a == 0:
            return 0.0
        e = a.numerator.bit_length() - a.denominator.bit_length()     # 2^(e-1) <= a < 2^(e+1)
        if a >= Fraction(2) ** e:
            e += 1                                                     # now 2^(e-1) <= a < 2^e
        e = max(e - 24, -149)                                          # 24-bit (or denormal) grid
        n = round(value / Fraction(2) ** e)                            # half to even
        return math.ldexp(float(n), e)
    return float(np.float32(value))


def splat(b: ir.IRBuilder | None, ty: ir.Type, value) -> ir.Constant:
    """A constant of scalar or vector type ty with every lane = value.

    float elements get the value rounded to float32 first (llvmlite prints float constants
    as hex doubles, which must be exactly representable in float32; a Fraction is rounded
    once); double elements take float(value); integer elements take int(value). b is unused
    (kept so call sites read alike).
    """
    elem = _elem(ty)
    if isinstance(elem, ir.FloatType):
        v = _f32(value)
    elif isinstance(elem, ir.DoubleType):
        v = float(value)
    elif isinstance(elem, ir.IntType):
        v = int(value)
    else:
        raise TypeError(f"splat: unsupported element type {elem}")
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [v] * ty.count)
    return ir.Constant(ty, v)


def _c(x: ir.Value, value) -> ir.Constant:
    """A float constant shaped like x."""
    return splat(None, x.type, value)


def _ci(x: ir.Value, value: int) -> ir.Constant:
    """An i32 constant shaped like x (x may be float- or int-typed)."""
    return splat(None, _int_type(x.type), value)


def _hx(s: str) -> float:
    """A coefficient written as a hex float literal; asserts it is a float32 value."""
    v = float.fromhex(s)
    assert _f32(v) == v, s
    return v


# ---------------------------------------------------------------------------------------------
# single-instruction helpers


def _intrinsic(b: ir.IRBuilder, name: str, ty: ir.Type, nargs: int) -> ir.Function:
    elem = _elem(ty)
    base = {"float": "f32", "double": "f64", "half": "f16"}[str(elem)]
    suffix = f"v{ty.count}{base}" if isinstance(ty, ir.VectorType) else base
    full = f"{name}.{suffix}"
    fn = b.module.globals.get(full)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ty, [ty] * nargs), name=full)
    return fn


def fma(b: ir.IRBuilder, a: ir.Value, x: ir.Value, c: ir.Value) -> ir.Value:
    """a*x + c with one rounding (llvm.fma -> vfmadd)."""
    return b.call(_intrinsic(b, "llvm.fma", a.type, 3), [a, x, c])


def fabs(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return b.call(_intrinsic(b, "llvm.fabs", x.type, 1), [x])


def floor(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return b.call(_intrinsic(b, "llvm.floor", x.type, 1), [x])


def roundeven(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Round half to even (llvm.roundeven -> vrndscaleps/vroundps imm 8)."""
    return b.call(_intrinsic(b, "llvm.roundeven", x.type, 1), [x])


def copysign(b: ir.IRBuilder, mag: ir.Value, sign: ir.Value) -> ir.Value:
    return b.call(_intrinsic(b, "llvm.copysign", mag.type, 2), [mag, sign])


def fmin(b: ir.IRBuilder, a: ir.Value, x: ir.Value) -> ir.Value:
    """a < x ? a : x — one vminps. If either is NaN the result is x (so fmin(b, hi, x)
    clamps x from above and lets a NaN x through)."""
    return b.select(b.fcmp_ordered("<", a, x), a, x)


def fmax(b: ir.IRBuilder, a: ir.Value, x: ir.Value) -> ir.Value:
    """a > x ? a : x — one vmaxps. If either is NaN the result is x."""
    return b.select(b.fcmp_ordered(">", a, x), a, x)


def _bits(b, x):
    return b.bitcast(x, _int_type(x.type))


def _float(b, i):
    return b.bitcast(i, _with_elem(i.type, F32))


def _poly(b, x, coeffs):
    """Horner: coeffs[0] + x*(coeffs[1] + x*(...)), one fma per step."""
    acc = _c(x, coeffs[-1])
    for cf in reversed(coeffs[:-1]):
        acc = fma(b, acc, x, _c(x, cf))
    return acc


def _estrin(b, x, coeffs):
    """The same polynomial as _poly in Estrin order: pairs coeffs[2i] + x·coeffs[2i+1], then
    pairs of those with x², x⁴, ...: a dependency chain of about log2(len) FMAs instead of
    len − 1, for one or two more operations and other roundings."""
    terms = [fma(b, _c(x, coeffs[i + 1]), x, _c(x, coeffs[i])) if i + 1 < len(coeffs)
             else _c(x, coeffs[i]) for i in range(0, len(coeffs), 2)]
    power = b.fmul(x, x)
    while len(terms) > 1:
        terms = [fma(b, terms[i + 1], power, terms[i]) if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
        if len(terms) > 1:
            power = b.fmul(power, power)
    return terms[0]


def _pow2i(b, n):
    """2^n as float from an i32 n in [-126, 127] (exponent-field construction)."""
    return _float(b, b.shl(b.add(n, _ci(n, 127)), _ci(n, 23)))


# ---------------------------------------------------------------------------------------------
# exp family

_LOG2E = _f32(1.4426950408889634)
_LN2 = Fraction("0.69314718055994530941723212145817656807550013436025525412068")
_LN2_HI = _f32(_LN2)                                # 0x3f317218
_LN2_LO = _f32(_LN2 - Fraction(_LN2_HI))            # ln2 - _LN2_HI, |.| ~ 1.9e-9
_MAGIC = 12582912.0                                 # 1.5 * 2^23: x + MAGIC rounds x to an integer
_MAGIC_BITS = 0x4B400000

# e^r = 1 + r + r^2 * P(r) on |r| <= ln2/2 (relative error 3.1e-9 = 0.05 ulp)
_EXP_P = [_hx(s) for s in ("0x1.fffffcp-2", "0x1.555492p-3", "0x1.5558b0p-5",
                           "0x1.12399cp-7", "0x1.6a4eccp-10")]


def _exp_reduce(b, x):
    """x = n*ln2 + r, |r| <= ln2/2 (Cody-Waite, FMA). Needs |x| < 2^22 * ln2 (callers clamp).

    n is rounded by the 1.5*2^23 trick, so no float->int conversion is needed (NaN-safe):
    the integer n is the low bits of fma(x, log2e, MAGIC). Returns (n_i32, r)."""
    t = fma(b, x, _c(x, _LOG2E), _c(x, _MAGIC))
    nf = b.fsub(t, _c(x, _MAGIC))
    n = b.sub(_bits(b, t), _ci(x, _MAGIC_BITS))
    r = fma(b, nf, _c(x, -_LN2_HI), x)
    r = fma(b, nf, _c(x, -_LN2_LO), r)
    return n, r


def _expm1_poly(b, r):
    """e^r - 1 = r + r^2 P(r), degree 6."""
    return fma(b, b.fmul(r, r), _poly(b, r, _EXP_P), r)


def _expm1_poly_estrin(b, r):
    """The same e^r - 1 = r + r^2 P(r) with P in Estrin order, P = (c0 + c1 r) + r^2 (c2 +
    c3 r + c4 r^2): as many operations as Horner, a dependency chain of 4 instead of 6, for
    kernels whose throughput is bound by their latency (silu and sigmoid). Not bitwise equal
    to _expm1_poly (the roundings differ)."""
    c0, c1, c2, c3, c4 = _EXP_P
    r2 = b.fmul(r, r)
    lo = fma(b, _c(r, c1), r, _c(r, c0))
    hi = fma(b, _c(r, c4), r2, fma(b, _c(r, c3), r, _c(r, c2)))
    return fma(b, r2, fma(b, hi, r2, lo), r)


def _exp_core(b, x, normal: bool = False, estrin: bool = False):
    """e^x for x in [-104, 89] (x may be NaN); correct overflow, denormals and underflow.
    normal: the caller keeps x in [-87, 88], where 2^n is a normal float, so 2^n is applied in
    one multiply — exact there as both of the two-step route's are: the same values with one
    multiply and four integer ops fewer (erf: gelu_erf ~10 % faster on Zen 3; a NaN's sign may
    follow the other instruction selection). estrin: the polynomial in Estrin order
    (_expm1_poly_estrin), for a caller bound by its latency."""
    n, r = _exp_reduce(b, x)
    y = b.fadd((_expm1_poly_estrin if estrin else _expm1_poly)(b, r), _c(x, 1.0))
    if _scalef(x):
        # y·2^n rounded once by vscalefps (n as a float: the reduction's own n·ln2 multiple)
        nf = b.fsub(fma(b, x, _c(x, _LOG2E), _c(x, _MAGIC)), _c(x, _MAGIC))
        return intrinsic(b, "llvm.x86.avx512.mask.scalef.ps.512", x.type,
                         [y, nf, y, ir.Constant(ir.IntType(16), -1), ir.Constant(ir.IntType(32), 4)],
                         types=[])
    if normal:
        return b.fmul(y, _pow2i(b, n))
    # 2^n in two exact steps so n in [-150, 128] is fine: y*2^n1 stays normal, the second
    # multiply rounds once (to a denormal, 0 or inf as needed).
    n1 = b.ashr(n, _ci(x, 1))
    n2 = b.sub(n, n1)
    return b.fmul(b.fmul(y, _pow2i(b, n1)), _pow2i(b, n2))


def _scalef(x) -> bool:
    """x is a 16-lane f32 vector on an AVX-512 host: 2^n is applied by vscalefps, one
    instruction for the seven of the exponent-field route, and the same value (both round
    y·2^n once, under the same rounding mode)."""
    return (isinstance(x.type, ir.VectorType) and x.type.count == 16
            and x.type.element == ir.FloatType() and host().vector_bits == 512)


def exp(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """e^x. Cody-Waite reduction x = n ln2 + r (2-part ln2, FMA), e^r by a degree-6 minimax
    polynomial, 2^n applied as two exponent-field multiplies (exact denormals/overflow)."""
    xc = fmin(b, _c(x, 89.0), x)          # NaN passes through the clamps
    xc = fmax(b, _c(x, -104.0), xc)
    return _exp_core(b, xc)


def _expm1_core(b, x):
    """e^x - 1 for x in [-18, 89] (x may be NaN): 2^n (1 + p) - 1 = fma(s, p, s - 1).
    n = 128 (x > 88.03) is split as s = 2^127 times 2 so the result overflows correctly."""
    n, r = _exp_reduce(b, x)
    p = _expm1_poly(b, r)
    big = b.icmp_signed(">", n, _ci(x, 127))
    nc = b.select(big, _ci(x, 127), n)
    s = _pow2i(b, nc)
    y = fma(b, s, p, b.fsub(s, _c(x, 1.0)))
    return b.fmul(y, b.select(big, _c(x, 2.0), _c(x, 1.0)))


def expm1(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """e^x - 1, accurate near 0. Same reduction and degree-6 polynomial as exp, recombined as
    2^n * p + (2^n - 1) with one FMA; |x| < 2^-25 (and NaN, +-0) returns x."""
    xc = fmin(b, _c(x, 89.0), x)
    xc = fmax(b, _c(x, -18.0), xc)
    y = _expm1_core(b, xc)
    tiny = b.fcmp_unordered("<", fabs(b, x), _c(x, 2.0 ** -25))
    return b.select(tiny, x, y)


_TANH_SPLIT = 0.625
# tanh a = a + a^3 T(a^2) on [0, 0.625]
_TANH_T = [_hx(s) for s in ("-0x1.555532p-2", "0x1.1106f6p-3", "-0x1.b835a4p-5",
                            "0x1.51f8cep-6", "-0x1.750ce4p-8")]


def tanh(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """tanh x, odd. |x| < 0.625: a + a^3 T(a^2), T degree 4. Otherwise 1 - 2/(e + 2) with
    e = expm1(2|x|) (one division; |x| clamped to 9.5, where the result rounds to 1).
    Both branches are computed and selected."""
    a = fabs(b, x)
    z = b.fmul(a, a)
    small = fma(b, b.fmul(a, z), _poly(b, z, _TANH_T), a)
    ac = fmin(b, _c(x, 9.5), a)
    e = _tanh_expm1(b, b.fadd(ac, ac))
    big = b.fsub(_c(x, 1.0), b.fdiv(_c(x, 2.0), b.fadd(e, _c(x, 2.0))))
    y = b.select(b.fcmp_ordered("<", a, _c(x, _TANH_SPLIT)), small, big)
    return copysign(b, y, x)


def _tanh_expm1(b, x):
    """e^x - 1 for x in [0, 19] (or NaN): n <= 28, no overflow split needed."""
    n, r = _exp_reduce(b, x)
    p = _expm1_poly(b, r)
    s = _pow2i(b, n)
    return fma(b, s, p, b.fsub(s, _c(x, 1.0)))


def sigmoid(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1/(1 + e^-x) in the stable form: z = e^-|x| (as exp); x >= 0: 1/(1+z), x < 0: z/(1+z).
    One division, compensated: the rounding error of d = 1 + z and the division remainder
    are folded back with 1/d ~ 1.457 - d/2 (enough for a correction below one ulp), so only
    z's error and the final rounding remain."""
    na = b.fneg(fabs(b, x))
    na = fmax(b, _c(x, -104.0), na)
    z = _exp_core(b, na)
    num = b.select(b.fcmp_ordered(">=", x, _c(x, 0.0)), _c(x, 1.0), z)
    one = _c(x, 1.0)
    d = b.fadd(z, one)
    d_lo = b.fsub(z, b.fsub(d, one))                   # 1 + z = d + d_lo exactly
    q = b.fdiv(num, d)
    rem = fma(b, b.fneg(q), d, num)                    # num - q d, exact
    t = fma(b, b.fneg(q), d_lo, rem)
    inv = fma(b, d, _c(x, -0.5), _c(x, 1.457))          # ~1/d on [1, 2], 4.3 %
    return fma(b, t, inv, q)


# ---------------------------------------------------------------------------------------------
# log family

_SQRTH_BITS = 0x3F3504F3   # float32 just below sqrt(1/2): mantissas are reduced to [sqrt.5, sqrt2)

# log(1+f) = f - f^2/2 + f^3 Q(f) on f in [sqrt(1/2)-1, sqrt(2)-1] (relative error 0.1 ulp)
_LOG_Q = [_hx(s) for s in ("0x1.555554p-2", "-0x1.000226p-2", "0x1.99a01ap-3",
                           "-0x1.547280p-3", "0x1.22d956p-3", "-0x1.0d8304p-3",
                           "0x1.055e3ap-3", "-0x1.38c408p-4")]


def _reduce_mant(b, xb):
    """From the bits of a positive normal float: (k i32, m) with x = 2^k m, m in [sqrt.5, sqrt2)."""
    ix = b.sub(xb, _ci(xb, _SQRTH_BITS))
    k = b.ashr(ix, _ci(xb, 23))
    m = _float(b, b.add(b.and_(ix, _ci(xb, 0x7FFFFF)), _ci(xb, _SQRTH_BITS)))
    return k, m


def _log1p_poly(b, f):
    """log(1+f) - f = f^2 (f Q(f) - 1/2), degree 10 overall."""
    return b.fmul(b.fmul(f, f), fma(b, _poly(b, f, _LOG_Q), f, _c(f, -0.5)))


def _log_combine(b, kf, f, t):
    """k ln2 + f + t with the large parts added last."""
    lo = fma(b, kf, _c(f, _LN2_LO), t)
    return fma(b, kf, _c(f, _LN2_HI), b.fadd(f, lo))


def _log_specials(b, x, y, zero_at):
    """Patch y for arguments outside (zero_at, inf): == zero_at -> -inf, < zero_at -> NaN,
    +inf -> +inf, NaN -> NaN."""
    inf = _c(x, float("inf"))
    y = b.select(b.fcmp_ordered("<", x, inf), y, x)                       # +inf, NaN
    y = b.select(b.fcmp_ordered("<", x, _c(x, zero_at)), _c(x, float("nan")), y)
    return b.select(b.fcmp_ordered("==", x, _c(x, zero_at)), _c(x, float("-inf")), y)


def log(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """ln x. Denormals are scaled by 2^23 first; x = 2^k m with m in [sqrt.5, sqrt2) from
    the bits; ln m = f - f^2/2 + f^3 Q(f), f = m - 1, Q degree 7; k ln2 added in 2 parts."""
    sub = b.fcmp_ordered("<", x, _c(x, 2.0 ** -126))
    xs = b.select(sub, b.fmul(x, _c(x, 2.0 ** 23)), x)
    k, m = _reduce_mant(b, _bits(b, xs))
    k = b.add(k, b.select(sub, _ci(x, -23), _ci(x, 0)))
    kf = b.sitofp(k, x.type)
    f = b.fsub(m, _c(x, 1.0))
    y = _log_combine(b, kf, f, _log1p_poly(b, f))
    return _log_specials(b, x, y, 0.0)


def log1p(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """ln(1 + x), accurate near 0 (no division). k comes from the bits of u = fl(1 + x);
    the reduced argument f = (1 + x) 2^-k - 1 is formed from x itself with one FMA,
    fma(x, 2^-k, 2^-k - 1), so the rounding of 1 + x is not inherited; then as log.
    For k > 24 (x > 2^24) f = m - 1 from u's bits. |x| < 2^-25 (and NaN, +-0) returns x."""
    u = b.fadd(x, _c(x, 1.0))
    k, m = _reduce_mant(b, _bits(b, u))
    huge = b.icmp_signed(">", k, _ci(x, 24))
    s = _float(b, b.shl(b.sub(_ci(x, 127), b.select(huge, _ci(x, 24), k)), _ci(x, 23)))  # 2^-k
    f = fma(b, x, s, b.fsub(s, _c(x, 1.0)))
    f = b.select(huge, b.fsub(m, _c(x, 1.0)), f)
    kf = b.sitofp(k, x.type)
    y = _log_combine(b, kf, f, _log1p_poly(b, f))
    y = _log_specials(b, u, y, 0.0)
    tiny = b.fcmp_unordered("<", fabs(b, x), _c(x, 2.0 ** -25))
    return b.select(tiny, x, y)


# ---------------------------------------------------------------------------------------------
# erf

_ERF_SPLIT = 0.875
# erf x = x + x P(x^2) on [0, 0.875]
_ERF_P = [_hx(s) for s in ("0x1.06eba8p-3", "-0x1.812740p-2", "0x1.ce2d5cp-4", "-0x1.b7ff90p-6",
                           "0x1.54318cp-8", "-0x1.a4d0c6p-11", "0x1.49fe10p-14")]
# erfc x = exp(-x^2 + L(x)) on [0.875, 4], L = log(erfc x) + x^2
_ERF_L = [_hx(s) for s in ("-0x1.17e63ep-13", "-0x1.20c074p+0", "0x1.73fb60p-2",
                           "-0x1.ab541cp-4", "0x1.6f56bcp-6", "-0x1.95530cp-9",
                           "0x1.a58962p-13")]
# ... evaluated in u = x - 1.25 (exact for x in [0.875, 4]) in Estrin order: near the split,
# where erfc's error weighs most in erf, L's large terms are then one constant and the partial
# sums round less (every float32: 1.14 ulp; Estrin in x 1.26; Horner in x was 1.08)
_ERF_SHIFT = 1.25


def _shifted(coeffs, c):
    """The coefficients in u of the polynomial coeffs (in x) at x = u + c, each the float32
    rounding of its exact value."""
    cs, cf = [Fraction(v) for v in coeffs], Fraction(c)
    return [_f32(float(sum(cs[j] * math.comb(j, k) * cf ** (j - k) for j in range(k, len(cs)))))
            for k in range(len(cs))]


_ERF_LU = _shifted(_ERF_L, _ERF_SHIFT)


def erf(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """erf x, odd. |x| < 0.875: x + x P(x^2), P degree 6. Otherwise 1 - exp(-x^2 + L(|x|)),
    L degree 6 (|x| clamped to 4, where erf rounds to 1); -x^2 + L formed with one FMA.
    Both branches are computed and selected. L (in |x| − 1.25) and the exp's polynomial go in
    Estrin order: in Horner order the branch through the exp was one dependency chain of ~75
    cycles on Zen 3, which bounded erf and gelu_erf by its latency (gelu_erf 0.86-0.99x
    torch); the shorter chains run them 1.13-1.18x faster for a few more operations (53
    instructions per 16 lanes, were 47). On Zen 4's 16 lanes, bound by the double-pumped
    FMAs' throughput rather than by latency, the two orders run within 1-2 % (in-process A/B,
    64 Ki elements in L2)."""
    a = fabs(b, x)
    small = fma(b, a, _poly(b, b.fmul(a, a), _ERF_P), a)
    ac = fmin(b, _c(x, 4.0), a)
    u = b.fsub(ac, _c(x, _ERF_SHIFT))
    e = _exp_core(b, fma(b, b.fneg(ac), ac, _estrin(b, u, _ERF_LU)), normal=True,
                  estrin=True)   # in [-19, 0]
    big = b.fsub(_c(x, 1.0), e)
    y = b.select(b.fcmp_ordered("<", a, _c(x, _ERF_SPLIT)), small, big)
    return copysign(b, y, x)


# ---------------------------------------------------------------------------------------------
# sin / cos

_PIO2 = Fraction("1.57079632679489661923132169163975144209858469968755291048747")
_TWO_OVER_PI = _f32(1 / _PIO2)
_PIO2_1 = _f32(_PIO2)                                       # pi/2 = P1 + P2 + P3 + O(2^-77)
_PIO2_2 = _f32(_PIO2 - Fraction(_PIO2_1))
_PIO2_3 = _f32(_PIO2 - Fraction(_PIO2_1) - Fraction(_PIO2_2))
# sin r = r + r^3 S(r^2), cos r = 1 - r^2/2 + r^4 C(r^2), fitted on |r| <= 0.845: n is rounded
# from x * float32(2/pi), so |r| exceeds pi/4 by up to 4.0e-8 |x| (0.042 at |x| = 2^20).
_R_MAX = 0.845
_SIN_S = [_hx(s) for s in ("-0x1.55553cp-3", "0x1.1103d2p-7", "-0x1.982c76p-13")]
_COS_C = [_hx(s) for s in ("0x1.555544p-5", "-0x1.6c08aep-10", "0x1.98f694p-16")]


def _sincos_reduce(b, a):
    """a >= 0 (or NaN/inf): a = n pi/2 + r, |r| <= pi/4 + 4e-8 a (3-part Cody-Waite, FMA).
    Returns (n_i32, r); n's low bits are exact for a < 2^22 pi/2. r is clamped to
    [-0.845, 0.845] (the fitted interval) so any finite a gives a value in [-1, 1]."""
    t = fma(b, a, _c(a, _TWO_OVER_PI), _c(a, _MAGIC))
    nf = b.fsub(t, _c(a, _MAGIC))
    n = _bits(b, t)                      # low bits = n mod 2^k (MAGIC's low bits are 0)
    r = fma(b, nf, _c(a, -_PIO2_1), a)
    r = fma(b, nf, _c(a, -_PIO2_2), r)
    r = fma(b, nf, _c(a, -_PIO2_3), r)
    r = fmin(b, _c(a, _R_MAX), r)
    r = fmax(b, _c(a, -_R_MAX), r)
    return n, r


def _sincos_polys(b, r):
    z = b.fmul(r, r)
    s = fma(b, b.fmul(r, z), _poly(b, z, _SIN_S), r)
    c = fma(b, z, fma(b, z, _poly(b, z, _COS_C), _c(r, -0.5)), _c(r, 1.0))
    return s, c


def _quadrant(b, n, s, c, sign_bits):
    """Pick +-s or +-c for quadrant n mod 4, xor in extra sign bits."""
    odd = b.icmp_unsigned("!=", b.and_(n, _ci(n, 1)), _ci(n, 0))
    v = b.select(odd, c, s)
    flip = b.shl(b.and_(n, _ci(n, 2)), _ci(n, 30))
    if sign_bits is not None:
        flip = b.xor(flip, sign_bits)
    return _float(b, b.xor(_bits(b, v), flip))


def sin(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """sin x = sign(x) sin|x|. |x| = n pi/2 + r (3-part pi/2, FMA); sin r = r + r^3 S(r^2) and
    cos r = 1 - r^2/2 + r^4 C(r^2), S and C degree 2 in r^2; quadrant by select and sign xor.
    Within 2 ulp for |x| <= 2^20; beyond, finite and in [-1, 1] but not sin x."""
    a = fabs(b, x)
    n, r = _sincos_reduce(b, a)
    s, c = _sincos_polys(b, r)
    sign = b.and_(_bits(b, x), _ci(x, -0x80000000))
    return _quadrant(b, n, s, c, sign)


def cos(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """cos x = cos|x|: same reduction and polynomials as sin, quadrant n + 1. Within 2 ulp
    for |x| <= 2^20; beyond, finite and in [-1, 1] but not cos x."""
    a = fabs(b, x)
    n, r = _sincos_reduce(b, a)
    s, c = _sincos_polys(b, r)
    return _quadrant(b, b.add(n, _ci(x, 1)), s, c, None)


def sincos(b: ir.IRBuilder, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(sin x, cos x) sharing one reduction and one pair of polynomials."""
    a = fabs(b, x)
    n, r = _sincos_reduce(b, a)
    s, c = _sincos_polys(b, r)
    sign = b.and_(_bits(b, x), _ci(x, -0x80000000))
    return _quadrant(b, n, s, c, sign), _quadrant(b, b.add(n, _ci(x, 1)), s, c, None)


FUNCTIONS = {"exp": exp, "expm1": expm1, "log": log, "log1p": log1p, "tanh": tanh,
             "sigmoid": sigmoid, "erf": erf, "sin": sin, "cos": cos}


# ---------------------------------------------------------------------------------------------
# a standalone kernel, for the error tool and the tests


def unary_kernel_ir(fn, name: str, lanes: int) -> str:
    """IR text of `void name(const float* in, float* out, i64 n)` applying fn elementwise:
    a <lanes x float> loop, then a scalar tail loop running the scalar form of fn."""
    mod = ir.Module(name=name)
    ptr = ir.PointerType(F32)
    i64 = ir.IntType(64)
    func = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ptr, ptr, i64]), name=name)
    src, dst, n = func.args
    src.add_attribute("noalias")
    dst.add_attribute("noalias")
    entry = func.append_basic_block("entry")
    vhead = func.append_basic_block("vhead")
    vbody = func.append_basic_block("vbody")
    shead = func.append_basic_block("shead")
    sbody = func.append_basic_block("sbody")
    done = func.append_basic_block("done")
    vty = ir.VectorType(F32, lanes)
    vptr = ir.PointerType(vty)

    b = ir.IRBuilder(entry)
    nvec = b.sub(n, b.srem(n, ir.Constant(i64, lanes)))
    b.branch(vhead)

    b.position_at_end(vhead)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    b.cbranch(b.icmp_signed("<", i, nvec), vbody, shead)

    b.position_at_end(vbody)
    v = b.load(b.bitcast(b.gep(src, [i]), vptr), align=4)
    b.store(fn(b, v), b.bitcast(b.gep(dst, [i]), vptr), align=4)
    inext = b.add(i, ir.Constant(i64, lanes))
    i.add_incoming(inext, vbody)
    b.branch(vhead)

    b.position_at_end(shead)
    j = b.phi(i64)
    j.add_incoming(i, vhead)
    b.cbranch(b.icmp_signed("<", j, n), sbody, done)

    b.position_at_end(sbody)
    s = b.load(b.gep(src, [j]), align=4)
    b.store(fn(b, s), b.gep(dst, [j]), align=4)
    j.add_incoming(b.add(j, ir.Constant(i64, 1)), sbody)
    b.branch(shead)

    b.position_at_end(done)
    b.ret_void()
    return str(mod)
