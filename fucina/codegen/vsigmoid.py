"""The compensated sigmoid family: sigmoid(x), silu(x) and m·sigmoid(v) (optionally times an
outer factor), accurate down to denormal results — the primitives the activation templates
(fucina/kernel_templates/activations.py, where the measured bounds are) call by name, like
vmath's.

Each needs integer work on the exponent (e^-|x| carried scaled by a power of two so it stays
normal, a compensated quotient), which is why they are written as IR builders here and not as
templates:

  sigmoid, silu   one compensated division with e^-|v| carried scaled by 2^31 (the short form)
  mul_sigmoid     the precise form (gelu, quick_gelu and the gated pairs): m·sigmoid(v) with
                  the rounding of m·e^-|v| taken out and an outer product folded into the
                  last rounding; accurate where sigmoid(v) < 2^-126 (v < -87)
"""
from __future__ import annotations

from . import irutil as u


def _v():
    """vmath, imported when a kernel is built (not when keys are made)."""
    from . import vmath

    return vmath


def _c(x, value):
    return u.const(x.type, value)


_S = 31          # sigmoid/silu carry e^-|x| times 2^31: normal down to e^-109 (2^-157)
_CLAMP = 109.6   # |x| clamp: there n = round(-|x| log2e) = -158 and 2^(n + S) is +0


def _exp_scaled(b, x):
    """(p, s) with e^-|x| = s (1 + p) 2^-S: s = 2^(n + S) exactly for |x| < 109.17 (n >= -157)
    and +0 beyond, where e^-|x| and x e^-|x| are below 2^-150 (every result underflows);
    p = e^r - 1 by vmath's reduction and polynomial (Estrin order: silu and sigmoid are bound
    by their latency). |x| is clamped, so infinities reduce like any large value; NaN passes."""
    vm_ = _v()
    v = vm_.fmax(b, _c(x, -_CLAMP), b.fneg(vm_.fabs(b, x)))
    n, r = vm_._exp_reduce(b, v)
    return vm_._expm1_poly_estrin(b, r), vm_._pow2i(b, b.add(n, vm_._ci(x, _S)))


def _quotient(b, num, zz):
    """num/(2^S + zz) with one final rounding, 0 <= zz <= 2^S.

    q = num/d, d = fl(2^S + zz); t = num - q·(2^S + zz) (_residual) carries the rounding of
    both d and q, and y = q + t/d with 1/d ~ (1.457 - d·2^-S/2)·2^-S (4.3 % of a correction
    below 1.5 ulp)."""
    vm_ = _v()
    big = _c(num, 2.0 ** _S)
    d = b.fadd(big, zz)
    q = b.fdiv(num, d)
    t = _residual(b, q, big, zz, num)
    inv = vm_.fma(b, d, _c(num, -0.5 * 2.0 ** (-2 * _S)), _c(num, 1.457 * 2.0 ** -_S))
    return vm_.fma(b, t, inv, q)


def sigmoid(b, x):
    """1/(1 + z) for x >= 0, z/(1 + z) for x < 0, z = e^-|x|, both times 2^S: z·2^S stays
    normal and a denormal result (x < -87.3) is rounded once, by the division."""
    p, s = _exp_scaled(b, x)
    zz = _v().fma(b, s, p, s)                                     # z·2^S, one rounding
    num = b.select(b.fcmp_ordered("<", x, _c(x, 0.0)), zz, _c(x, 2.0 ** _S))
    return _quotient(b, num, zz)


def silu(b, x):
    """x/(1 + z) for x >= 0, x·z/(1 + z) for x < 0, z = e^-|x|, both times 2^S (x·z·2^S in
    one fma from the unrounded 1 + p), so x·z stays normal and a denormal result is rounded
    once, by the division. x·2^S overflows beyond 2^97, where silu(x) = x: the numerator
    takes min(x, 2^90) (no inf - inf in the remainder) and a select returns x itself."""
    vm_ = _v()
    p, s = _exp_scaled(b, x)
    xs = b.fmul(x, s)
    huge = _c(x, 2.0 ** 90)
    num = b.select(b.fcmp_ordered("<", x, _c(x, 0.0)), vm_.fma(b, xs, p, xs),
                   b.fmul(vm_.fmin(b, huge, x), _c(x, 2.0 ** _S)))
    y = _quotient(b, num, vm_.fma(b, s, p, s))
    return b.select(b.fcmp_ordered(">", x, huge), x, y)


_SCALE = 48     # lanes with v < -64 carry e^-|v| times 2^48, so it stays normal down to |v| = 120
_BIG = -64.0
_FLT_MAX = 3.4028234663852886e38


def _exp_neg_abs(b, v):
    """e^-|v| = 2^n (1 + p), by vmath's reduction and polynomial (|v| clamped to 200). Returns
    (neg, big, p, s, zz): v < 0, v < -64, p = e^r − 1, s = 2^k with k = n (+48 where big;
    s = 0 below 2^-126, where every result underflows anyway) and zz = s(1 + p) in ONE fma."""
    vm_ = _v()
    ci = vm_._ci
    neg = b.fcmp_ordered("<", v, _c(v, 0.0))
    big = b.fcmp_ordered("<", v, _c(v, _BIG))
    na = vm_.fmax(b, _c(v, -200.0), b.fneg(vm_.fabs(b, v)))
    n, r = vm_._exp_reduce(b, na)
    p = vm_._expm1_poly(b, r)
    k = b.add(n, b.select(big, ci(v, _SCALE), ci(v, 0)))
    s = b.select(b.icmp_signed("<", k, ci(v, -126)), vm_._float(b, ci(v, 0)), vm_._pow2i(b, k))
    return neg, big, p, s, vm_.fma(b, s, p, s)


def _residual(b, q, base, zz, num):
    """num − q·(base + zz) with one rounding, for q = num/fl(base + zz), base a power of two
    and 0 <= zz <= base: num − q·base is exact (Sterbenz: q·base is within a factor 2 of num)
    and q·zz is folded in by one fma, so fl(base + zz) is never needed exactly (no Fast2Sum).
    NaN when num = ±inf (inf − inf)."""
    vm_ = _v()
    return vm_.fma(b, b.fneg(q), zz, vm_.fma(b, b.fneg(q), base, num))


def mul_sigmoid(b, m, v, outer=None):
    """(outer·)m·sigmoid(v), the precise form (gelu 1.84, quick_gelu 1.74, the gated pairs
    1.81–1.99 ulp measured; more operations than silu, and it takes the error of m·z out,
    which matters once the tanh-gelu's 2u or the outer product is folded in). The division
    takes m·2^k exactly and the (1 + p) factor is applied after it:
    m·z/(1 + z) = q(1 + p) + c(1 + p) ≈ q + (q·p + c),
    c the compensated quotient's correction, so m·z is never rounded on its own. With `outer`
    (the up operand of a gated pair) the product is folded in before the one final rounding:
    outer·q + outer·(q·p + c). Lanes with v < -64 are scaled by 2^48 throughout (no overflow:
    there |m·sigmoid(v)| < |m| e^-64) and scaled back by the last multiply."""
    vm_ = _v()
    one = _c(v, 1.0)
    neg, big, p, s, zz = _exp_neg_abs(b, v)
    d = b.fadd(one, zz)
    num = b.select(neg, b.fmul(m, s), m)                          # m·2^k is exact
    q = b.fdiv(num, d)
    t = _residual(b, q, one, zz, num)
    # m = ±inf makes t NaN, which must not reach q (±inf): -FLT_MAX (one vmaxps; t/d is
    # added to q, which stays ±inf), or 0 where t is multiplied further (outer)
    t = b.select(b.fcmp_ordered("ord", t, t), t, _c(q, 0.0)) if outer is not None \
        else vm_.fmax(b, t, _c(q, -_FLT_MAX))
    c = b.fmul(t, vm_.fma(b, d, _c(v, -0.5), _c(v, 1.457)))      # t/d, 1/d ~ 1.457 − d/2
    w = b.select(neg, vm_.fma(b, q, p, c), c)                     # (not q·0: q may be ±inf)
    if outer is None:
        y = b.fadd(q, w)
    else:  # the correction term takes outer clamped to finite, so an infinite outer gives ±inf
        oc = vm_.fmin(b, _c(v, _FLT_MAX), vm_.fmax(b, _c(v, -_FLT_MAX), outer))
        y = vm_.fma(b, outer, q, b.fmul(oc, w))
    return b.fmul(y, b.select(big, _c(v, 2.0 ** -_SCALE), one))

