"""RNG kernels (SPEC §4): counter-based splitmix64 fills, dropout and multinomial draws.

Every output is a pure function of (seed, its element index): element i of a stream uses
`at(seed, i)` (or the pair `at(seed, 2p), at(seed, 2p + 1)` for Box–Muller), never a running
state. So a kernel may split its range anywhere — chunks, threads, vector lanes, a masked tail —
and every split gives the same bits. The only sequential kernel is randperm (one chunk).

No instruction here carries fast-math flags, so LLVM never contracts a*b + c into an FMA or
reassociates: each float op rounds exactly where the formula says, which is what lets the tests
transcribe the kernels operation by operation in numpy and compare bitwise.

f64 transcendentals (gaussian_fill_at, gumbel): `log64` is the fdlibm/musl `log` (the one Zig's
compiler_rt ports: x = 2^k (1+f), s = f/(2+f), degree-14 odd polynomial in s); `sincos64` is
musl's `sin`/`cos` for 0 <= x < 2^20·π/2 — `__rem_pio2` (its small-multiple fast paths and its
up-to-three-round medium path), then the `__sin`/`__cos` kernels — written branch-free (every
path computed, the right one selected), in the same operation order, without FMA. Their error
is below 1 ulp of f64; see fucina/rng.py for what that means for the f32 results.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .kernels import KernelKey, register
from .rows import chunk_pass
from .target import host

F64 = ir.DoubleType()
I128 = ir.IntType(128)
MASK64 = (1 << 64) - 1

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
TWO_PI = 6.283185307179586          # f64(2π) = 0x401921FB54442D18 (= 2·f64(π), exact)
TWO_M53 = 2.0 ** -53
PREFETCH = 1024                     # dropout: elements prefetched ahead of the stream

# ---------------------------------------------------------------------------------------------
# constants


def _s64(v: int) -> int:
    """A u64 bit pattern as the signed value LLVM's i64 literal expects."""
    v &= MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shape(ty, elem):
    return ir.VectorType(elem, ty.count) if isinstance(ty, ir.VectorType) else elem


def ci(ty, v: int) -> ir.Constant:
    """An integer constant shaped like `ty` (scalar or vector), u64 values wrapped."""
    elem = ty.element if isinstance(ty, ir.VectorType) else ty
    c = ir.Constant(elem, _s64(v) if elem.width == 64 else v)
    return ir.Constant(ty, [c] * ty.count) if isinstance(ty, ir.VectorType) else c


def cd(ty, v: float) -> ir.Constant:
    """A double constant shaped like `ty` (llvmlite prints it as exact hex)."""
    c = ir.Constant(F64, float(v))
    return ir.Constant(ty, [c] * ty.count) if isinstance(ty, ir.VectorType) else c


def cf(ty, v: float) -> ir.Constant:
    """A float32 constant (the value rounded to f32 first) shaped like `ty`."""
    return u.const(ty, v)


def _hexd(hi: int, lo: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", (hi << 32) | lo))[0]


def _d(decimal: float, hi: int, lo: int) -> float:
    """A libm coefficient given by its decimal and its hex words; the two must agree."""
    v = _hexd(hi, lo)
    assert v == decimal, (decimal, hex(hi), hex(lo))
    return v


# fdlibm / musl log
LN2_HI = _d(6.93147180369123816490e-01, 0x3FE62E42, 0xFEE00000)
LN2_LO = _d(1.90821492927058770002e-10, 0x3DEA39EF, 0x35793C76)
LG = [_d(6.666666666666735130e-01, 0x3FE55555, 0x55555593),
      _d(3.999999999940941908e-01, 0x3FD99999, 0x9997FA04),
      _d(2.857142874366239149e-01, 0x3FD24924, 0x94229359),
      _d(2.222219843214978396e-01, 0x3FCC71C5, 0x1D8E78AF),
      _d(1.818357216161805012e-01, 0x3FC74664, 0x96CB03DE),
      _d(1.531383769920937332e-01, 0x3FC39A09, 0xD078C69F),
      _d(1.479819860511658591e-01, 0x3FC2F112, 0xDF3E5244)]
# musl __sin / __cos (fdlibm k_sin.c / k_cos.c)
S = [_d(-1.66666666666666324348e-01, 0xBFC55555, 0x55555549),
     _d(8.33333333332248946124e-03, 0x3F811111, 0x1110F8A6),
     _d(-1.98412698298579493134e-04, 0xBF2A01A0, 0x19C161D5),
     _d(2.75573137070700676789e-06, 0x3EC71DE3, 0x57B1FE7D),
     _d(-2.50507602534068634195e-08, 0xBE5AE5E6, 0x8A2B9CEB),
     _d(1.58969099521155010221e-10, 0x3DE5D93A, 0x5ACFD57C)]
C = [_d(4.16666666666666019037e-02, 0x3FA55555, 0x5555554C),
     _d(-1.38888888888741095749e-03, 0xBF56C16C, 0x16C15177),
     _d(2.48015872894767294178e-05, 0x3EFA01A0, 0x19CB1590),
     _d(-2.75573143513906633035e-07, 0xBE927E4F, 0x809C52AD),
     _d(2.08757232129817482790e-09, 0x3E21EE9E, 0xBDB4B1C4),
     _d(-1.13596475577881948265e-11, 0xBDA8FAE9, 0xBE8838D4)]
# musl __rem_pio2
INVPIO2 = _d(6.36619772367581382433e-01, 0x3FE45F30, 0x6DC9C883)
PIO2_1 = _d(1.57079632673412561417e+00, 0x3FF921FB, 0x54400000)
PIO2_1T = _d(6.07710050650619224932e-11, 0x3DD0B461, 0x1A626331)
PIO2_2 = _d(6.07710050630396597660e-11, 0x3DD0B461, 0x1A600000)
PIO2_2T = _d(2.02226624879595063154e-21, 0x3BA3198A, 0x2E037073)
PIO2_3 = _d(2.02226624871116645580e-21, 0x3BA3198A, 0x2E000000)
PIO2_3T = _d(8.47842766036889956997e-32, 0x397B839A, 0x252049C1)
TOINT = 1.5 * 2.0 ** 52

# RNG-7 (float32 Cephes, exact operation order of the spec)
LN_POLY = [7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
           -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1]
SIN_POLY = [-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1]
COS_POLY = [2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2]

# ---------------------------------------------------------------------------------------------
# splitmix64


def mix(b, z):
    """The splitmix64 output function (two multiply-xorshift rounds and a final xorshift)."""
    t = z.type
    z = b.mul(b.xor(z, b.lshr(z, ci(t, 30))), ci(t, MIX1))
    z = b.mul(b.xor(z, b.lshr(z, ci(t, 27))), ci(t, MIX2))
    return b.xor(z, b.lshr(z, ci(t, 31)))


def at(b, seed, i0, lanes: int | None = None, stride: int = 1):
    """at(seed, i0 + stride·k) for lanes k = 0..lanes-1 (a scalar when lanes is None):
    one scalar multiply, then a constant per-lane offset k·stride·GAMMA."""
    base = b.add(seed, b.mul(b.add(i0, u.i64(1)), ci(u.I64, GAMMA)))
    if lanes is None:
        return mix(b, base)
    vt = ir.VectorType(u.I64, lanes)
    offs = ir.Constant(vt, [ir.Constant(u.I64, _s64(k * stride * GAMMA)) for k in range(lanes)])
    return mix(b, b.add(u.splat(b, base, lanes), offs))


def u53(b, x, ty):
    """f(x >> 11) as float type `ty` (f64: exact; f32: one rounding), shape of x."""
    return b.sitofp(b.lshr(x, ci(x.type, 11)), _shape(x.type, ty))


# ---------------------------------------------------------------------------------------------
# f64 transcendentals (musl algorithms, branch-free)


def _hi_word(b, x):
    """The high 32 bits of a double (sign included) as i64."""
    bits = b.bitcast(x, _shape(x.type, u.I64))
    return bits, b.lshr(bits, ci(bits.type, 32))


def log64(b, x):
    """ln x (fdlibm/musl `log`, old musl log.c) for positive normal finite x, and -inf for ±0
    (musl's -1/(x·x)): gumbel's -ln(-ln u) reaches ln(-0) when u rounds to 1."""
    bits, hx = _hi_word(b, x)
    it = bits.type
    hx = b.add(hx, ci(it, 0x3FF00000 - 0x3FE6A09E))
    k = b.sub(b.lshr(hx, ci(it, 20)), ci(it, 0x3FF))
    hx = b.add(b.and_(hx, ci(it, 0x000FFFFF)), ci(it, 0x3FE6A09E))
    xr = b.bitcast(b.or_(b.shl(hx, ci(it, 32)), b.and_(bits, ci(it, 0xFFFFFFFF))), x.type)
    t = x.type
    f = b.fsub(xr, cd(t, 1.0))
    hfsq = b.fmul(b.fmul(cd(t, 0.5), f), f)
    s = b.fdiv(f, b.fadd(cd(t, 2.0), f))
    z = b.fmul(s, s)
    w = b.fmul(z, z)

    def horner(coeffs, v):  # c0 + v*(c1 + v*(c2 + ...)), evaluated innermost first
        acc = cd(t, coeffs[-1])
        for c in reversed(coeffs[:-1]):
            acc = b.fadd(cd(t, c), b.fmul(v, acc))
        return acc

    t1 = b.fmul(w, horner([LG[1], LG[3], LG[5]], w))
    t2 = b.fmul(z, horner([LG[0], LG[2], LG[4], LG[6]], w))
    r = b.fadd(t2, t1)
    dk = b.sitofp(k, t)
    y = b.fmul(s, b.fadd(hfsq, r))
    y = b.fadd(y, b.fmul(dk, cd(t, LN2_LO)))
    y = b.fsub(y, hfsq)
    y = b.fadd(y, f)
    y = b.fadd(y, b.fmul(dk, cd(t, LN2_HI)))
    return b.select(b.fcmp_ordered("==", x, cd(t, 0.0)), cd(t, float("-inf")), y)


def _ksin(b, x, y, iy: int):
    """musl __sin(x, y, iy) on |x| <= ~π/4."""
    t = x.type
    z = b.fmul(x, x)
    w = b.fmul(z, z)
    r = b.fadd(cd(t, S[1]), b.fmul(z, b.fadd(cd(t, S[2]), b.fmul(z, cd(t, S[3])))))
    r = b.fadd(r, b.fmul(b.fmul(z, w), b.fadd(cd(t, S[4]), b.fmul(z, cd(t, S[5])))))
    v = b.fmul(z, x)
    if iy == 0:
        return b.fadd(x, b.fmul(v, b.fadd(cd(t, S[0]), b.fmul(z, r))))
    inner = b.fsub(b.fmul(z, b.fsub(b.fmul(cd(t, 0.5), y), b.fmul(v, r))), y)
    return b.fsub(x, b.fsub(inner, b.fmul(v, cd(t, S[0]))))


def _kcos(b, x, y):
    """musl __cos(x, y) on |x| <= ~π/4."""
    t = x.type
    z = b.fmul(x, x)
    w = b.fmul(z, z)
    p1 = b.fmul(z, b.fadd(cd(t, C[0]), b.fmul(z, b.fadd(cd(t, C[1]), b.fmul(z, cd(t, C[2]))))))
    p2 = b.fmul(b.fmul(w, w), b.fadd(cd(t, C[3]), b.fmul(z, b.fadd(cd(t, C[4]), b.fmul(z, cd(t, C[5]))))))
    r = b.fadd(p1, p2)
    hz = b.fmul(cd(t, 0.5), z)
    w = b.fsub(cd(t, 1.0), hz)
    corr = b.fadd(b.fsub(b.fsub(cd(t, 1.0), w), hz), b.fsub(b.fmul(z, r), b.fmul(x, y)))
    return b.fadd(w, corr)


def _exp_field(b, v):
    bits = b.bitcast(v, _shape(v.type, u.I64))
    return b.and_(b.lshr(bits, ci(bits.type, 52)), ci(bits.type, 0x7FF))


def _rem_pio2(b, x, ix):
    """musl __rem_pio2 for 0 < x < 2^20·π/2 (positive x only): (n as i64, y0, y1)."""
    t, it = x.type, ix.type

    def le(v):
        return b.icmp_unsigned("<=", ix, ci(it, v))

    def eq(v):
        return b.icmp_unsigned("==", ix, ci(it, v))

    # small multiples take the fast paths (k fixed by the high word), except near kπ/2
    k = b.select(le(0x4002D97C), cd(t, 1.0), b.select(le(0x400F6A7A), cd(t, 2.0),
                 b.select(le(0x4015FDBC), cd(t, 3.0), cd(t, 4.0))))
    near = b.and_(le(0x400F6A7A), b.icmp_unsigned("==", b.and_(ix, ci(it, 0xFFFFF)), ci(it, 0x921FB)))
    medium = b.or_(b.or_(near, eq(0x4012D97C)), b.or_(eq(0x401921FB), b.icmp_unsigned(">", ix, ci(it, 0x401C463B))))
    fn_med = b.fsub(b.fadd(b.fmul(x, cd(t, INVPIO2)), cd(t, TOINT)), cd(t, TOINT))
    fn = b.select(medium, fn_med, k)
    # round 1 (the fast paths compute exactly this with k: k·pio2_1 is exact, k·pio2_1t rounds alike)
    r = b.fsub(x, b.fmul(fn, cd(t, PIO2_1)))
    w = b.fmul(fn, cd(t, PIO2_1T))
    y0 = b.fsub(r, w)
    ex = b.lshr(ix, ci(it, 20))

    def further(r, hi, lo):
        w = b.fmul(fn, cd(t, hi))
        r2 = b.fsub(r, w)
        w2 = b.fsub(b.fmul(fn, cd(t, lo)), b.fsub(b.fsub(r, r2), w))
        return r2, w2, b.fsub(r2, w2)

    r_2, w_2, y0_2 = further(r, PIO2_2, PIO2_2T)
    r_3, w_3, y0_3 = further(r_2, PIO2_3, PIO2_3T)
    two = b.and_(medium, b.icmp_signed(">", b.sub(ex, _exp_field(b, y0)), ci(it, 16)))
    three = b.and_(two, b.icmp_signed(">", b.sub(ex, _exp_field(b, y0_2)), ci(it, 49)))
    r = b.select(three, r_3, b.select(two, r_2, r))
    w = b.select(three, w_3, b.select(two, w_2, w))
    y0 = b.select(three, y0_3, b.select(two, y0_2, y0))
    y1 = b.fsub(b.fsub(r, y0), w)
    return b.fptosi(fn, _shape(t, u.I64)), y0, y1


def sincos64(b, x):
    """(sin x, cos x) for 0 <= x < 2^20·π/2, as musl's sin and cos compute them."""
    t = x.type
    bits, hx = _hi_word(b, x)
    ix = b.and_(hx, ci(hx.type, 0x7FFFFFFF))
    it = ix.type
    small = b.icmp_unsigned("<=", ix, ci(it, 0x3FE921FB))
    zero = cd(t, 0.0)
    sin_d = b.select(b.icmp_unsigned("<", ix, ci(it, 0x3E500000)), x, _ksin(b, x, zero, 0))
    cos_d = b.select(b.icmp_unsigned("<", ix, ci(it, 0x3E46A09E)), cd(t, 1.0), _kcos(b, x, zero))
    n, y0, y1 = _rem_pio2(b, x, ix)
    ks = _ksin(b, y0, y1, 1)
    kc = _kcos(b, y0, y1)
    q = b.and_(n, ci(n.type, 3))

    def pick(vals):
        out = vals[3]
        for j in (2, 1, 0):
            out = b.select(b.icmp_unsigned("==", q, ci(q.type, j)), vals[j], out)
        return out

    nks, nkc = b.fneg(ks), b.fneg(kc)
    sin_r = pick([ks, kc, nks, nkc])
    cos_r = pick([kc, nks, nkc, ks])
    return b.select(small, sin_d, sin_r), b.select(small, cos_d, cos_r)


# ---------------------------------------------------------------------------------------------
# RNG-7 float32 Cephes pieces (exact operation order)


def ln_poly(b, x):
    """SPEC RNG-7 step 2 for positive normal f32 x."""
    t = x.type
    it = _shape(t, u.I32)
    bits = b.bitcast(x, it)
    e = b.sitofp(b.sub(b.lshr(bits, ci(it, 23)), ci(it, 126)), t)
    m = b.bitcast(b.or_(b.and_(bits, ci(it, 0x007FFFFF)), ci(it, 0x3F000000)), t)
    low = b.fcmp_ordered("<", m, cf(t, 0.7071067811865476))   # compared in f32, as the reference
    e = b.select(low, b.fsub(e, cf(t, 1.0)), e)
    m = b.select(low, b.fadd(m, m), m)
    f = b.fsub(m, cf(t, 1.0))
    z = b.fmul(f, f)
    p = cf(t, LN_POLY[0])
    for c in LN_POLY[1:]:
        p = b.fadd(b.fmul(p, f), cf(t, c))
    y = b.fmul(b.fmul(f, z), p)
    y = b.fadd(y, b.fmul(e, cf(t, -2.12194440e-4)))
    y = b.fsub(y, b.fmul(cf(t, 0.5), z))
    y = b.fadd(f, y)
    return b.fadd(y, b.fmul(e, cf(t, 0.693359375)))


def sin_cos_turn(b, ub):
    """SPEC RNG-7 step 4: (sin 2πu, cos 2πu) for f32 u in [0, 1)."""
    t = ub.type
    it = _shape(t, u.I32)
    t4 = b.fmul(ub, cf(t, 4.0))
    jf = u.intrinsic(b, "llvm.floor", t, [b.fadd(t4, cf(t, 0.5))])
    y = b.fsub(t4, jf)
    arg = b.fmul(y, cf(t, 1.5707963267948966))
    z = b.fmul(arg, arg)
    sp = cf(t, SIN_POLY[0])
    for c in SIN_POLY[1:]:
        sp = b.fadd(b.fmul(sp, z), cf(t, c))
    sin_a = b.fadd(arg, b.fmul(b.fmul(arg, z), sp))
    cp = cf(t, COS_POLY[0])
    for c in COS_POLY[1:]:
        cp = b.fadd(b.fmul(cp, z), cf(t, c))
    cos_a = b.fadd(b.fsub(cf(t, 1.0), b.fmul(cf(t, 0.5), z)), b.fmul(b.fmul(z, z), cp))
    q = b.and_(b.fptoui(jf, it), ci(it, 3))
    swap = b.icmp_unsigned("!=", b.and_(q, ci(it, 1)), ci(it, 0))
    sin_b = b.select(swap, cos_a, sin_a)
    cos_b = b.select(swap, sin_a, cos_a)
    sin_neg = b.icmp_unsigned("!=", b.and_(q, ci(it, 2)), ci(it, 0))
    cos_neg = b.icmp_unsigned("!=", b.and_(b.add(q, ci(it, 1)), ci(it, 2)), ci(it, 0))
    return b.select(sin_neg, b.fneg(sin_b), sin_b), b.select(cos_neg, b.fneg(cos_b), cos_b)


# ---------------------------------------------------------------------------------------------
# loop scaffolding


def _interleave(b, even, odd):
    """[e0, o0, e1, o1, ...] from two vectors of equal length."""
    n = even.type.count
    idx = [k // 2 + (n if k % 2 else 0) for k in range(2 * n)]
    return b.shuffle_vector(even, odd, ir.Constant(ir.VectorType(u.I32, 2 * n), idx))


def _pair_loop(b, args_base, c0, c1, lanes, pairs_fn, store_dtype="f32"):
    """The shared skeleton of the Box–Muller fills.

    Argument block from args_base: out, n, first, seed, pairs per chunk, then kernel-specific.
    Pairs P in [first/2, (first+n-1)/2] are cut into chunks of `per` pairs (a multiple of
    `lanes`, so no vector step crosses a chunk boundary); pair P writes elements 2P - first and
    2P + 1 - first where those fall in [0, n). pairs_fn(P_vector) -> (even, odd) values."""
    out, n, first, seed, per = args_base
    p0 = b.lshr(first, u.i64(1))
    p_end = b.add(b.lshr(b.sub(b.add(first, n), u.i64(1)), u.i64(1)), u.i64(1))
    lo = b.add(p0, b.mul(c0, per))
    hi = b.add(p0, b.mul(c1, per))
    hi = b.select(b.icmp_unsigned("<", hi, p_end), hi, p_end)
    width = 2 * lanes
    with u.Loop(b, u.i64(0), b.sub(hi, lo), lanes, "p") as k:
        pb = b.add(lo, k)
        even, odd = pairs_fn(pb)
        vals = _interleave(b, even, odd)
        obase = b.sub(b.add(pb, pb), first)            # may be -1 on the first step
        inside = b.and_(b.icmp_signed(">=", obase, u.i64(0)),
                        b.icmp_signed("<=", b.add(obase, u.i64(width)), n))
        with b.if_else(inside) as (then, other):
            with then:
                u.store(b, vals, out, obase, store_dtype)
            with other:
                o = b.add(u.splat(b, obase, width), u.iota(width))
                mask = b.and_(b.icmp_signed(">=", o, u.const(o.type, 0)),
                              b.icmp_signed("<", o, u.splat(b, n, width)))
                u.store(b, vals, out, obase, store_dtype, mask)


def _pair_uniforms(b, seed, pb, lanes, ty):
    """For pairs pb..pb+lanes-1: (a >> 11 as ty, b >> 11 as ty) with a = at(seed, 2P),
    b = at(seed, 2P + 1)."""
    p2 = b.add(pb, pb)
    a = at(b, seed, p2, lanes, stride=2)
    bb = at(b, seed, b.add(p2, u.i64(1)), lanes, stride=2)
    return u53(b, a, ty), u53(b, bb, ty)


# ---------------------------------------------------------------------------------------------
# kernels


def _f64_lanes() -> int:
    return host().vector_bits // 64


@register
@dataclass(frozen=True)
class UniformFillKey(KernelKey):
    """RNG-4. args: out f32, n, elements per chunk, seed, lo (f64 bits), hi - lo (f64 bits),
    hi (f32 bits), nextafter(hi, lo) (f32 bits)."""

    family = "rng_uniform"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        out = u.arg_ptr(b, args, 0)
        n, chunk, seed = (u.arg(b, args, i) for i in (1, 2, 3))
        lo64 = b.bitcast(u.arg(b, args, 4), F64)
        span = b.bitcast(u.arg(b, args, 5), F64)
        hi, below = u.arg_f32(b, args, 6), u.arg_f32(b, args, 7)
        lo_v, span_v, hi_v, below_v = (u.splat(b, v, L) for v in (lo64, span, hi, below))

        def emit(i, mask):
            x = at(b, seed, i, L)
            uu = b.fmul(u53(b, x, F64), cd(lo_v.type, TWO_M53))
            v = b.fptrunc(b.fadd(lo_v, b.fmul(span_v, uu)), ir.VectorType(u.F32, L))
            v = b.select(b.fcmp_ordered(">=", v, hi_v), below_v, v)
            u.store(b, v, out, i, "f32", mask)

        chunk_pass(b, c0, c1, n, chunk, L, emit)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class GumbelFillKey(KernelKey):
    """RNG-10 gumbel. args: out f32, n, elements per chunk, seed."""

    family = "rng_gumbel"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = _f64_lanes()
        out = u.arg_ptr(b, args, 0)
        n, chunk, seed = (u.arg(b, args, i) for i in (1, 2, 3))

        def emit(i, mask):
            x = at(b, seed, i, L)
            t = ir.VectorType(F64, L)
            uu = b.fmul(b.fadd(u53(b, x, F64), cd(t, 0.5)), cd(t, TWO_M53))
            v = b.fneg(log64(b, b.fneg(log64(b, uu))))
            u.store(b, b.fptrunc(v, ir.VectorType(u.F32, L)), out, i, "f32", mask)

        chunk_pass(b, c0, c1, n, chunk, L, emit)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class GaussianFillKey(KernelKey):
    """RNG-5/6 (and normal_fill). args: out f32, n, first, seed, pairs per chunk,
    scale (f64 bits of the f32 scale), mean (f32 bits; added in f32 when != 0)."""

    family = "rng_gaussian_f64"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = _f64_lanes()
        base = (u.arg_ptr(b, args, 0),) + tuple(u.arg(b, args, i) for i in (1, 2, 3, 4))
        seed = base[3]
        scale = u.splat(b, b.bitcast(u.arg(b, args, 5), F64), L)
        mean = u.arg_f32(b, args, 6)
        add_mean = u.splat(b, b.fcmp_unordered("!=", mean, u.const(u.F32, 0.0)), L)
        mean_v = u.splat(b, mean, L)
        t = ir.VectorType(F64, L)
        ft = ir.VectorType(u.F32, L)

        def pairs(pb):
            ka, kb = _pair_uniforms(b, seed, pb, L, F64)
            ua = b.fmul(b.fadd(ka, cd(t, 1.0)), cd(t, TWO_M53))
            ub = b.fmul(kb, cd(t, TWO_M53))
            radius = u.intrinsic(b, "llvm.sqrt", t, [b.fmul(cd(t, -2.0), log64(b, ua))])
            s, c = sincos64(b, b.fmul(cd(t, TWO_PI), ub))
            outs = []
            for trig in (c, s):
                v = b.fptrunc(b.fmul(b.fmul(radius, trig), scale), ft)
                outs.append(b.select(add_mean, b.fadd(v, mean_v), v))
            return outs

        _pair_loop(b, base, c0, c1, L, pairs)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class GaussianFastKey(KernelKey):
    """RNG-7. args: out f32, n, first, seed, pairs per chunk, scale (f32 bits)."""

    family = "rng_gaussian_fast"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        base = (u.arg_ptr(b, args, 0),) + tuple(u.arg(b, args, i) for i in (1, 2, 3, 4))
        seed = base[3]
        scale = u.splat(b, u.arg_f32(b, args, 5), L)
        ft = ir.VectorType(u.F32, L)

        def pairs(pb):
            # f32(k + 1) · 2^-53 is the spec's f32((f64(k) + 1) · 2^-53): both are the one
            # rounding of the same exact value (k + 1 <= 2^53 is exact in f64, scaling by
            # 2^-53 is exact in both formats and never reaches f32 denormals)
            p2 = b.add(pb, pb)
            a = at(b, seed, p2, L, stride=2)
            bb = at(b, seed, b.add(p2, u.i64(1)), L, stride=2)
            ka = b.add(b.lshr(a, ci(a.type, 11)), ci(a.type, 1))
            ua = b.fmul(b.sitofp(ka, ft), cf(ft, TWO_M53))
            ub = b.fmul(u53(b, bb, u.F32), cf(ft, TWO_M53))
            radius = u.intrinsic(b, "llvm.sqrt", ft, [b.fmul(cf(ft, -2.0), ln_poly(b, ua))])
            s, c = sin_cos_turn(b, ub)
            return b.fmul(b.fmul(radius, c), scale), b.fmul(b.fmul(radius, s), scale)

        _pair_loop(b, base, c0, c1, L, pairs)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class RandintFillKey(KernelKey):
    """RNG-10 randint. args: out i64, n, elements per chunk, seed, low, span = high - low (u64)."""

    family = "rng_randint"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        out = u.arg_ptr(b, args, 0)
        n, chunk, seed, low, span = (u.arg(b, args, i) for i in (1, 2, 3, 4, 5))
        e0 = b.mul(c0, chunk)
        e1 = u.smin(b, b.mul(c1, chunk), n)
        span128 = b.zext(span, I128)
        with u.Loop(b, e0, e1, 1, "i") as i:
            x = at(b, seed, i)
            off = b.trunc(b.lshr(b.mul(b.zext(x, I128), span128), ir.Constant(I128, 64)), u.I64)
            u.store(b, b.add(low, off), out, i, "i64")
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class RandpermFillKey(KernelKey):
    """RNG-10 randperm (inherently sequential: launch with one chunk). args: out i64, n, seed."""

    family = "rng_randperm"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        out = u.arg_ptr(b, args, 0)
        n, seed = u.arg(b, args, 1), u.arg(b, args, 2)
        with b.if_then(b.icmp_signed("<", c0, c1)):
            with u.Loop(b, u.i64(0), n, 1, "i") as i:
                u.store(b, i, out, i, "i64")
            kp = u.entry_alloca(b, u.I64, "k")
            b.store(b.sub(n, u.i64(1)), kp)

            def body():
                k = b.load(kp)
                c = b.sub(b.sub(n, u.i64(1)), k)
                x = at(b, seed, c)
                prod = b.mul(b.zext(x, I128), b.zext(b.add(k, u.i64(1)), I128))
                j = b.trunc(b.lshr(prod, ir.Constant(I128, 64)), u.I64)
                vk, vj = u.load(b, out, k, "i64"), u.load(b, out, j, "i64")
                u.store(b, vj, out, k, "i64")
                u.store(b, vk, out, j, "i64")
                b.store(b.sub(k, u.i64(1)), kp)

            u.while_loop(b, lambda: b.icmp_signed(">=", b.load(kp), u.i64(1)), body, "swap")
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class DropoutKey(KernelKey):
    """RNG-8. args: x, out (dtype), n, elements per chunk, seed, keep cutoff (u64), scale (f32 bits).
    out[i] = (at(seed, i) >> 11) < cutoff ? x[i]·scale : 0 (scale multiply in f32)."""

    family = "rng_dropout"
    dtype: str   # f32 | f16 | bf16 (widened to f32, narrowed once)

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        n, chunk, seed, cutoff = (u.arg(b, args, i) for i in (2, 3, 4, 5))
        s = u.splat(b, u.arg_f32(b, args, 6), L)
        cut = u.splat(b, cutoff, L)
        zero = u.const(s.type, 0.0)

        def emit(i, mask):
            if mask is None:
                # LLVM folds the load into the masked multiply (vmulps mem {k}{z}); a load that
                # waits for its mask stalls the stream (measured 8 ms vs 3 ms at 16 Mi f32 on
                # Zen 4). Prefetching 1024 elements ahead keeps it bandwidth-bound.
                ahead = b.gep(x, [b.add(i, u.i64(PREFETCH))], source_etype=u.STORAGE[self.dtype])
                u.intrinsic(b, "llvm.prefetch", u.VOID, [ahead, ir.Constant(u.I32, 0),
                            ir.Constant(u.I32, 3), ir.Constant(u.I32, 1)], types=[u.PTR])
            r = at(b, seed, i, L)
            keep = b.icmp_unsigned("<", b.lshr(r, ci(r.type, 11)), cut)
            v = u.load(b, x, i, self.dtype, L, mask)
            u.store(b, b.select(keep, b.fmul(v, s), zero), out, i, self.dtype, mask)

        chunk_pass(b, c0, c1, n, chunk, L, emit)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class MultinomialKey(KernelKey):
    """RNG-9, one work item per row. args: w [R, K] (dtype), out i64 [R, S], scratch f64 [R, K],
    status i64 [R] (0 ok, 1 invalid weights, 2 nonzero classes exhausted), R, K, S, seed,
    rows per chunk. Draw (r, s) uses at(seed, r·S + s)."""

    family = "rng_multinomial"
    dtype: str
    replacement: bool

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        w, out, scratch, status = (u.arg_ptr(b, args, i) for i in range(4))
        R, K, S, seed, per = (u.arg(b, args, i) for i in range(4, 9))
        r0, r1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), R)
        acc_p = u.entry_alloca(b, F64, "acc")
        bad_p = u.entry_alloca(b, u.I1, "bad")
        lo_p, hi_p = u.entry_alloca(b, u.I64, "lo"), u.entry_alloca(b, u.I64, "hi")
        pick_p, last_p = u.entry_alloca(b, u.I64, "pick"), u.entry_alloca(b, u.I64, "last")
        k_p = u.entry_alloca(b, u.I64, "k")
        zero, inf = cd(F64, 0.0), cd(F64, float("inf"))
        with u.Loop(b, r0, r1, 1, "r") as r:
            wrow = b.gep(w, [b.mul(r, K)], source_etype=u.STORAGE[self.dtype])
            crow = b.gep(scratch, [b.mul(r, K)], source_etype=F64)
            orow = b.gep(out, [b.mul(r, S)], source_etype=u.I64)
            b.store(zero, acc_p)
            b.store(ir.Constant(u.I1, 0), bad_p)
            with u.Loop(b, u.i64(0), K, 1, "k") as k:   # validate; prefix sums or a f64 copy
                wk = b.fpext(u.load(b, wrow, k, self.dtype), F64)
                ok = b.and_(b.fcmp_ordered(">=", wk, zero), b.fcmp_ordered("<", wk, inf))
                b.store(b.or_(b.load(bad_p), b.not_(ok)), bad_p)
                acc = b.fadd(b.load(acc_p), wk)
                b.store(acc, acc_p)
                b.store(acc if self.replacement else wk, b.gep(crow, [k], source_etype=F64))
            total0 = b.load(acc_p)
            bad = b.or_(b.load(bad_p), b.not_(b.fcmp_ordered(">", total0, zero)))
            u.store(b, b.zext(bad, u.I64), status, r, "i64")
            with b.if_then(b.not_(bad)):
                with u.Loop(b, u.i64(0), S, 1, "s") as s:
                    x = at(b, seed, b.add(b.mul(r, S), s))
                    uu = b.fmul(u53(b, x, F64), cd(F64, TWO_M53))
                    if self.replacement:
                        self._draw_with(b, crow, wrow, K, b.fmul(uu, total0), orow, s, lo_p, hi_p)
                    else:
                        self._draw_without(b, crow, K, uu, orow, s, status, r, acc_p, pick_p,
                                           last_p, k_p)
        b.ret_void()
        return str(mod)

    def _draw_with(self, b, crow, wrow, K, t, orow, s, lo_p, hi_p):
        """First index with C[idx] > t (binary search), clamped, then stepped down past zeros."""
        b.store(u.i64(0), lo_p)
        b.store(K, hi_p)

        def search():
            lo, hi = b.load(lo_p), b.load(hi_p)
            mid = b.lshr(b.add(lo, hi), u.i64(1))
            above = b.fcmp_ordered(">", b.load(b.gep(crow, [mid], source_etype=F64), typ=F64), t)
            b.store(b.select(above, lo, b.add(mid, u.i64(1))), lo_p)
            b.store(b.select(above, mid, hi), hi_p)

        u.while_loop(b, lambda: b.icmp_signed("<", b.load(lo_p), b.load(hi_p)), search, "bs")
        b.store(u.smin(b, b.load(lo_p), b.sub(K, u.i64(1))), lo_p)

        def zero_here():
            p = b.load(lo_p)
            wz = b.fcmp_ordered("==", u.load(b, wrow, p, self.dtype), u.const(u.F32, 0.0))
            return b.and_(b.icmp_signed(">", p, u.i64(0)), wz)

        u.while_loop(b, zero_here, lambda: b.store(b.sub(b.load(lo_p), u.i64(1)), lo_p), "down")
        u.store(b, b.load(lo_p), orow, s, "i64")

    def _draw_without(self, b, rem, K, uu, orow, s, status, r, total_p, pick_p, last_p, k_p):
        """Walk the remaining weights in order (zeros skipped); first running sum > t wins,
        else the last class with weight left; then remove it from the pool."""
        zero = cd(F64, 0.0)
        t = b.fmul(uu, b.load(total_p))
        acc_p = u.entry_alloca(b, F64, "walk")
        b.store(zero, acc_p)
        b.store(u.i64(-1), pick_p)
        b.store(u.i64(-1), last_p)
        b.store(u.i64(0), k_p)

        def cond():
            return b.and_(b.icmp_signed("<", b.load(k_p), K),
                          b.icmp_signed("<", b.load(pick_p), u.i64(0)))

        def body():
            k = b.load(k_p)
            wk = b.load(b.gep(rem, [k], source_etype=F64), typ=F64)
            with b.if_then(b.fcmp_ordered("!=", wk, zero)):
                acc = b.fadd(b.load(acc_p), wk)
                b.store(acc, acc_p)
                b.store(k, last_p)
                with b.if_then(b.fcmp_ordered(">", acc, t)):
                    b.store(k, pick_p)
            b.store(b.add(k, u.i64(1)), k_p)

        u.while_loop(b, cond, body, "walk")
        pick = b.load(pick_p)
        pick = b.select(b.icmp_signed("<", pick, u.i64(0)), b.load(last_p), pick)
        with b.if_else(b.icmp_signed("<", pick, u.i64(0))) as (none_left, ok):
            with none_left:
                u.store(b, u.i64(2), status, r, "i64")
                u.store(b, u.i64(0), orow, s, "i64")
            with ok:
                slot = b.gep(rem, [pick], source_etype=F64)
                b.store(b.fsub(b.load(total_p), b.load(slot, typ=F64)), total_p)
                b.store(zero, slot)
                u.store(b, pick, orow, s, "i64")


@register
@dataclass(frozen=True)
class Math64Key(KernelKey):
    """The f64 functions above applied elementwise, for the tests and accuracy measurements.
    args: x (f64 stored as 8-byte words), out (same), n, elements per chunk."""

    family = "rng_math64"
    fn: str   # log | sin | cos

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = _f64_lanes()
        x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        n, chunk = u.arg(b, args, 2), u.arg(b, args, 3)
        vt = ir.VectorType(F64, L)

        def emit(i, mask):
            v = b.bitcast(u.load(b, x, i, "i64", L, mask), vt)
            if self.fn == "log":
                y = log64(b, v)
            else:
                s, c = sincos64(b, v)
                y = s if self.fn == "sin" else c
            u.store(b, b.bitcast(y, ir.VectorType(u.I64, L)), out, i, "i64", mask)

        chunk_pass(b, c0, c1, n, chunk, L, emit)
        b.ret_void()
        return str(mod)
