"""Activation emitters (SPEC §3.3–§3.6): the UnaryOp family, leaky_relu and clamp, the gated
pairs, and the backward kernel of every rule.

An entry is `name: (arity, emit)` with `emit(builder, *values)` on scalar or vector IR values
(the scalar tail runs the same operations as a vector lane, so both give the same bits).
Backward kernels take the upstream gradient g first, then what the rule reads: the forward
input x or the forward output y (gated rules: the up operand, then the gate). By-value
parameters (a slope, clamp bounds) come last. Everything is branch-free: piecewise
definitions compute every piece and select.

Formulas without a transcendental are evaluated literally, operation by operation as SPEC
writes them, so they are bitwise-equal to a float32 numpy transcription (relu, neg, abs, sqrt,
rsqrt, fast_tanh, floor, ceil, round, sign, reciprocal, leaky_relu, clamp, and their rules).
Transcendentals come from vmath. Algebraic prefixes that feed one (u of the tanh-gelu, 1.702x,
x/30, x·0.7071...) are formed in float32 exactly as SPEC writes them. Where the literal float32
form would cancel or underflow early, an algebraically equal form is used:

  gelu (tanh)   0.5·x·(1 + tanh u) = x·sigmoid(2u)      (no 1 + tanh u cancellation for x < 0)
  softplus      ln(1 + e^±x) = max(x, 0) + log1p(e^-|x|) (the literal form is 0 for x < -17)
  m·sigmoid(v)  one compensated division with e^-|v| carried scaled (_sigmoid and _silu,
                the short form; _mul_sigmoid_precise for gelu, quick_gelu and the gated
                pairs): accurate where sigmoid(v) < 2^-126 (x < -87), down to denormal results
  gated         up·act(gate) is folded into the activation's last rounding

gelu_erf keeps SPEC's literal 0.5·x·(1 + erf(x/√2)) (ggml's and torch's form too): for
x < -1, 1 + erf cancels and the error is absolute, below |x|·2^-25. erf is vmath's (within
1.1 ulp), not a bitwise port of musl's erff.

Measured max error in float32 ulps against float64 (every float32 with 2^-24 <= |x| < 2^8,
both signs, 5.6e8 points, plus 2e7 random bit patterns over the whole range; special values
exact; tests/test_activations.py checks each bound on its own sample):

  exp 1.01   sigmoid 1.50   silu 1.79   log 0.92   log1p 0.92 (of ln(fl(1 + x)))
  softplus 1.77   sin 1.57   cos 1.81 (|x| <= 2^20)   tanh 1.33   gelu 1.84
  quick_gelu 1.74   softcap_30 1.72   softcap_15 1.72   elu 0.94   erf 1.08
  gelu_erf 1.75 (x >= -1; below, absolute error < |x|·2^-25)
  gelu_quant: every f16 input in (-10, 10): 3 of 37376 differ from the correctly rounded
              f16 table by one f16 ulp (the f32 gelu inside is within 2 ulp)
  gated (6e7 random pairs): glu 1.87, swiglu 1.85, geglu 1.81, swiglu_clamp10 1.99,
              situ 3.91 (two tanh and a sigmoid in one product)
"""
from __future__ import annotations

from llvmlite import ir

from . import irutil as u
from .emit import relu, sqrt, vm


def _v():
    """vmath, imported when a kernel is built (not when keys are made)."""
    from . import vmath

    return vmath


def _c(x, value):
    return u.const(x.type, value)


def _select_gt0(b, x, a, other):
    return b.select(b.fcmp_ordered(">", x, _c(x, 0.0)), a, other)


# ---------------------------------------------------------------------------------------------
# forward formulas (also the building blocks of the gated pairs and the backward rules)

def _tanh(b, x):
    return _v().tanh(b, x)


def _exp(b, x):
    return _v().exp(b, x)


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


def _sigmoid(b, x):
    """1/(1 + z) for x >= 0, z/(1 + z) for x < 0, z = e^-|x|, both times 2^S: z·2^S stays
    normal and a denormal result (x < -87.3) is rounded once, by the division."""
    p, s = _exp_scaled(b, x)
    zz = _v().fma(b, s, p, s)                                     # z·2^S, one rounding
    num = b.select(b.fcmp_ordered("<", x, _c(x, 0.0)), zz, _c(x, 2.0 ** _S))
    return _quotient(b, num, zz)


def _silu(b, x):
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


def _mul_sigmoid_precise(b, m, v, outer=None):
    """(outer·)m·sigmoid(v), the precise form (gelu 1.84, quick_gelu 1.74, the gated pairs
    1.81–1.99 ulp measured; more operations than _silu, and it takes the error of m·z out,
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


GELU_C = 0.7978845608028654   # sqrt(2/pi)
GELU_A = 0.044715
GELU_3A = 3 * 0.044715        # the derivative's 3·0.044715, one float32 constant


def _gelu_u(b, x):
    """u = 0.7978845608028654·(x + 0.044715·x³), x³ as x·x·x, in float32 as SPEC writes it."""
    x3 = b.fmul(b.fmul(x, x), x)
    return b.fmul(_c(x, GELU_C), b.fadd(x, b.fmul(_c(x, GELU_A), x3)))


def _two_u(b, x):
    uu = _gelu_u(b, x)
    return b.fadd(uu, uu)


def _gelu_s(b, x):
    """s = sigmoid(2u) = (1 + tanh u)/2."""
    return _sigmoid(b, _two_u(b, x))


def _gelu(b, x):
    return _mul_sigmoid_precise(b, x, _two_u(b, x))


def _gelu_deriv(b, x):
    """0.5(1+t) + 0.5·x·(1−t²)·c·(1 + 3·0.044715·x²) with 0.5(1+t) = s, 0.5(1−t²) = 2s(1−s)."""
    s = _gelu_s(b, x)
    one = _c(x, 1.0)
    poly = b.fadd(one, b.fmul(_c(x, GELU_3A), b.fmul(x, x)))
    k = b.fmul(b.fmul(_c(x, 2.0), b.fmul(s, b.fsub(one, s))), b.fmul(_c(x, GELU_C), poly))
    return b.fadd(s, b.fmul(x, k))


def _quick_gelu(b, x):
    return _mul_sigmoid_precise(b, x, b.fmul(_c(x, 1.702), x))


def _softplus(b, x):
    """max(x, 0) + log1p(e^-|x|) (= x + ln(1+e^-x) for x > 0, ln(1+e^x) otherwise)."""
    v = _v()
    z = v.exp(b, b.fneg(v.fabs(b, x)))
    return b.fadd(_select_gt0(b, x, x, _c(x, 0.0)), v.log1p(b, z))


def _fast_tanh(b, x):
    """NAM's rational tanh, operation by operation as SPEC (and the reference) write it."""
    v = _v()
    ax = v.fabs(b, x)
    x2 = b.fmul(x, x)
    A, B, C, D, E = FAST_TANH
    num = b.fadd(b.fadd(_c(x, A), b.fmul(_c(x, A), ax)),
                 b.fmul(b.fadd(_c(x, B), b.fmul(_c(x, C), ax)), x2))
    w = b.fadd(x, b.fmul(b.fmul(_c(x, E), x), ax))
    den = b.fadd(_c(x, D), b.fmul(b.fadd(_c(x, D), x2), v.fabs(b, w)))
    return b.fdiv(b.fmul(x, num), den)


FAST_TANH = (2.45550750702956, 0.893229853513558, 0.821226666969744, 2.44506634652299,
             0.814642734961073)


def _sgn(b, x):
    """1, -1 or 0 (0 also for NaN): the sign(0) = 0 of the |.| derivatives."""
    return b.select(b.fcmp_ordered(">", x, _c(x, 0.0)), _c(x, 1.0),
                    b.select(b.fcmp_ordered("<", x, _c(x, 0.0)), _c(x, -1.0), _c(x, 0.0)))


def _fast_tanh_deriv(b, x):
    """Quotient rule on y = x·N/D: N = a + a|x| + (b + c|x|)x², D = d + (d + x²)|w|,
    w = x + e·x|x|: y' = ((N + x N')·D − x N D') / D² with N' = sgn(x)(a + c x²) + 2x(b + c|x|),
    w' = 1 + 2e|x|, D' = 2x|w| + (d + x²) sgn(w) w'."""
    v = _v()
    A, B, C, D, E = FAST_TANH
    one, two = _c(x, 1.0), _c(x, 2.0)
    ax = v.fabs(b, x)
    x2 = b.fmul(x, x)
    sx = _sgn(b, x)
    bc = b.fadd(_c(x, B), b.fmul(_c(x, C), ax))
    n = b.fadd(b.fadd(_c(x, A), b.fmul(_c(x, A), ax)), b.fmul(bc, x2))
    dn = b.fadd(b.fmul(sx, b.fadd(_c(x, A), b.fmul(_c(x, C), x2))), b.fmul(b.fmul(two, x), bc))
    w = b.fadd(x, b.fmul(b.fmul(_c(x, E), x), ax))
    aw = v.fabs(b, w)
    dx2 = b.fadd(_c(x, D), x2)
    den = b.fadd(_c(x, D), b.fmul(dx2, aw))
    dw = b.fadd(one, b.fmul(_c(x, 2.0 * E), ax))
    dden = b.fadd(b.fmul(b.fmul(two, x), aw), b.fmul(b.fmul(dx2, _sgn(b, w)), dw))
    top = b.fsub(b.fmul(b.fadd(n, b.fmul(x, dn)), den), b.fmul(b.fmul(x, n), dden))
    return b.fdiv(top, b.fmul(den, den))


def _gelu_quant(b, x):
    """ggml GGML_GELU_FP16: x <= -10 -> 0, x >= 10 -> x, else f16(gelu(f16(x)))."""
    half = u.vec(u.F16, x.type.count if isinstance(x.type, ir.VectorType) else None)
    xr = b.fpext(b.fptrunc(x, half), x.type)
    y = b.fpext(b.fptrunc(_gelu(b, xr), half), x.type)
    y = b.select(b.fcmp_ordered(">=", x, _c(x, 10.0)), x, y)
    return b.select(b.fcmp_ordered("<=", x, _c(x, -10.0)), _c(x, 0.0), y)


SQRT1_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
TWO_OVER_SQRT_PI = 1.1283791670955126


def _gelu_erf(b, x):
    """0.5·x·(1 + erf(x·0.7071067811865476)) (the reference's operation order)."""
    e = _v().erf(b, b.fmul(x, _c(x, SQRT1_2)))
    return b.fmul(b.fmul(_c(x, 0.5), x), b.fadd(_c(x, 1.0), e))


def _gelu_erf_deriv(b, x):
    """0.5(1 + erf(x/√2)) + x·e^(−x²/2)·0.3989422804014327."""
    v = _v()
    cdf = b.fmul(_c(x, 0.5), b.fadd(_c(x, 1.0), v.erf(b, b.fmul(x, _c(x, SQRT1_2)))))
    pdf = v.exp(b, b.fmul(b.fneg(b.fmul(x, x)), _c(x, 0.5)))
    return b.fadd(cdf, b.fmul(b.fmul(x, pdf), _c(x, INV_SQRT_2PI)))


def _round(b, x):
    """Half to even. SPEC's (|x| + 2^23) − 2^23 with copysign, |x| ≥ 2^23 / NaN / inf → x,
    is exactly IEEE roundTiesToEven (llvm.roundeven, one vrndscaleps)."""
    return _v().roundeven(b, x)


def _sign(b, x):
    """1 if x > 0, −1 if x < 0, else x (±0 kept, NaN propagates)."""
    return b.select(b.fcmp_ordered(">", x, _c(x, 0.0)), _c(x, 1.0),
                    b.select(b.fcmp_ordered("<", x, _c(x, 0.0)), _c(x, -1.0), x))


def _softcap(cap):
    def emit(b, x):
        return b.fmul(_c(x, cap), _tanh(b, b.fmul(x, _c(x, 1.0 / cap))))
    return emit


def _intrinsic(name):
    def emit(b, x):
        return u.intrinsic(b, name, x.type, [x])
    return emit


# ---------------------------------------------------------------------------------------------
# parameterized (SPEC §3.4): the parameter is a by-value kernel argument

def _leaky_relu(b, x, slope):
    return _select_gt0(b, x, x, b.fmul(slope, x))


def _clamp(b, x, lo, hi):
    """min(max(x, lo), hi) with NaN propagating (torch.clamp)."""
    t = b.select(b.fcmp_ordered("<", x, lo), lo, x)
    return b.select(b.fcmp_ordered(">", t, hi), hi, t)


def _clamp_grad(b, g, x, lo, hi):
    inside = b.and_(b.fcmp_ordered(">=", x, lo), b.fcmp_ordered("<=", x, hi))
    return b.select(inside, g, _c(g, 0.0))


# ---------------------------------------------------------------------------------------------
# gated pairs (SPEC §3.6): src(up) · act(gate)

def _situ_src(b, up):
    return b.fmul(_c(up, 25.0), _tanh(b, b.fmul(up, _c(up, 0.04))))


def _situ_act(b, g):
    return b.fmul(b.fmul(_c(g, 4.0), _tanh(b, b.fmul(g, _c(g, 0.25)))), _sigmoid(b, g))


def _swiglu_clamp10(b, up, g):
    """clamp(up, −10, 10)·silu(min(g, 10)) (DeepSeek V4's clamped SwiGLU; NaN propagates)."""
    ten = _c(up, 10.0)
    src = _clamp(b, up, _c(up, -10.0), ten)
    gc = b.select(b.fcmp_ordered(">", g, ten), ten, g)
    return _mul_sigmoid_precise(b, gc, gc, src)


def _silu_deriv(b, x):
    """s·(1 + x·(1 − s)) as s + x·s·(1 − s), one fma (1 − s is exact where s >= 1/2)."""
    s = _sigmoid(b, x)
    return _v().fma(b, b.fmul(x, s), b.fsub(_c(x, 1.0), s), s)


def _sigmoid_deriv(b, x):
    s = _sigmoid(b, x)
    return b.fmul(s, b.fsub(_c(x, 1.0), s))


def _situ_src_deriv(b, up):
    """d/du 25·tanh(0.04u) = 25·0.04·(1 − t²)"""
    t = _tanh(b, b.fmul(up, _c(up, 0.04)))
    return b.fmul(_c(up, 25.0 * 0.04), b.fsub(_c(up, 1.0), b.fmul(t, t)))


def _situ_act_deriv(b, g):
    """d/dg 4·tanh(g/4)·s = 4·(0.25(1 − t²)·s + t·s(1 − s))"""
    one = _c(g, 1.0)
    t = _tanh(b, b.fmul(g, _c(g, 0.25)))
    s = _sigmoid(b, g)
    a = b.fmul(b.fmul(_c(g, 0.25), b.fsub(one, b.fmul(t, t))), s)
    c = b.fmul(t, b.fmul(s, b.fsub(one, s)))
    return b.fmul(_c(g, 4.0), b.fadd(a, c))


GATED_ACT = {"glu": _sigmoid, "swiglu": _silu, "geglu": _gelu, "situ": _situ_act}
GATED_ACT_DERIV = {"glu": _sigmoid_deriv, "swiglu": _silu_deriv, "geglu": _gelu_deriv,
                   "situ": _situ_act_deriv}


def _gated(op):
    """src(up)·act(gate) with the product folded into the activation's last rounding."""
    if op == "glu":
        return lambda b, up, g: _mul_sigmoid_precise(b, _c(g, 1.0), g, up)
    if op == "swiglu":
        return lambda b, up, g: _mul_sigmoid_precise(b, g, g, up)
    if op == "geglu":
        return lambda b, up, g: _mul_sigmoid_precise(b, g, _two_u(b, g), up)
    return lambda b, up, g: _mul_sigmoid_precise(
        b, b.fmul(_c(g, 4.0), _tanh(b, b.fmul(g, _c(g, 0.25)))), g, _situ_src(b, up))


def _gated_grad_up(op):
    """g · d(src)/d(up) · act(gate); (g, gate) for the identity sources, (g, up, gate) for situ."""
    act = GATED_ACT[op]
    if op == "situ":
        return 3, lambda b, gr, up, g: b.fmul(gr, b.fmul(_situ_src_deriv(b, up), act(b, g)))
    return 2, lambda b, gr, g: b.fmul(gr, act(b, g))


def _gated_grad_gate(op):
    """g · src(up) · act'(gate)"""
    deriv = GATED_ACT_DERIV[op]
    src = _situ_src if op == "situ" else (lambda b, up: up)
    return 3, lambda b, gr, up, g: b.fmul(gr, b.fmul(src(b, up), deriv(b, g)))


# ---------------------------------------------------------------------------------------------
# the table

def _times(deriv):
    """A backward kernel g · deriv(v)."""
    return 2, lambda b, g, v: b.fmul(g, deriv(b, v))


def _grad_select(b, g, x, d_pos, d_neg):
    """g where x > 0 (times d_pos), else g · d_neg (d_pos/d_neg None means 1)."""
    pos = g if d_pos is None else b.fmul(g, d_pos)
    return _select_gt0(b, x, pos, b.fmul(g, d_neg))


def _one_minus_sq(b, t):
    return b.fsub(_c(t, 1.0), b.fmul(t, t))


OPS = {
    # UnaryOp forward (neg is the arithmetic table's)
    "relu": (1, relu),
    "exp": (1, vm("exp")),
    "sqrt": (1, sqrt),
    "rsqrt": (1, lambda b, x: b.fdiv(_c(x, 1.0), sqrt(b, x))),
    "sigmoid": (1, _sigmoid),
    "silu": (1, _silu),
    "log": (1, vm("log")),
    "log1p": (1, lambda b, x: _v().log(b, b.fadd(_c(x, 1.0), x))),
    "softplus": (1, _softplus),
    "abs": (1, lambda b, x: _v().fabs(b, x)),
    "sin": (1, vm("sin")),
    "cos": (1, vm("cos")),
    "tanh": (1, vm("tanh")),
    "fast_tanh": (1, _fast_tanh),
    "gelu": (1, _gelu),
    "quick_gelu": (1, _quick_gelu),
    "softcap_30": (1, _softcap(30.0)),
    "softcap_15": (1, _softcap(15.0)),
    "gelu_quant": (1, _gelu_quant),
    "elu": (1, lambda b, x: _select_gt0(b, x, x, _v().expm1(b, x))),
    "gelu_erf": (1, _gelu_erf),
    "erf": (1, vm("erf")),
    "floor": (1, _intrinsic("llvm.floor")),
    "ceil": (1, _intrinsic("llvm.ceil")),
    "round": (1, _round),
    "sign": (1, _sign),
    "reciprocal": (1, lambda b, x: b.fdiv(_c(x, 1.0), x)),

    # UnaryOp backward: (g, x) or (g, y) as noted
    "relu_grad": (2, lambda b, g, x: _select_gt0(b, x, g, _c(g, 0.0))),                  # x
    "sqrt_grad": (2, lambda b, g, y: b.fmul(g, b.fdiv(_c(y, 0.5), y))),                   # y
    "rsqrt_grad": _times(lambda b, x: b.fdiv(_c(x, -0.5), b.fmul(x, sqrt(b, x)))),        # x
    "sigmoid_grad": (2, lambda b, g, y: b.fmul(g, b.fmul(y, b.fsub(_c(y, 1.0), y)))),    # y
    "silu_grad": _times(_silu_deriv),                                                     # x
    "log1p_grad": (2, lambda b, g, x: b.fdiv(g, b.fadd(_c(x, 1.0), x))),                  # x
    "softplus_grad": _times(_sigmoid),                                                    # x
    "abs_grad": _times(_sgn),                                                             # x
    "sin_grad": _times(vm("cos")),                                                        # x
    "cos_grad": _times(lambda b, x: b.fneg(_v().sin(b, x))),                              # x
    "tanh_grad": (2, lambda b, g, y: b.fmul(g, _one_minus_sq(b, y))),                    # y
    "fast_tanh_grad": _times(_fast_tanh_deriv),                                           # x
    "gelu_grad": _times(_gelu_deriv),                                                     # x
    "quick_gelu_grad": _times(lambda b, x: _quick_gelu_deriv(b, x)),                      # x
    "softcap_30_grad": _times(lambda b, x: _one_minus_sq(b, _tanh(b, b.fmul(x, _c(x, 1.0 / 30.0))))),
    "softcap_15_grad": _times(lambda b, y: _one_minus_sq(b, b.fdiv(y, _c(y, 15.0)))),    # y
    "elu_grad": (2, lambda b, g, x: _grad_select(b, g, x, None, _exp(b, x))),             # x
    "gelu_erf_grad": _times(_gelu_erf_deriv),                                             # x
    "reciprocal_grad": _times(lambda b, y: b.fneg(b.fmul(y, y))),                        # y
    "erf_grad": _times(lambda b, x: b.fmul(_c(x, TWO_OVER_SQRT_PI),
                                           _exp(b, b.fneg(b.fmul(x, x))))),              # x

    # parameterized
    "leaky_relu": (2, _leaky_relu),
    "leaky_relu_grad": (3, lambda b, g, x, slope: _grad_select(b, g, x, None, slope)),
    "clamp": (3, _clamp),
    "clamp_grad": (4, _clamp_grad),

    # gated pairs (up, gate), forward-only swiglu_clamp10
    "swiglu_clamp10": (2, _swiglu_clamp10),
}


def _quick_gelu_deriv(b, x):
    """s + 1.702·x·s·(1 − s), s = sigmoid(1.702x)"""
    k = _c(x, 1.702)
    s = _sigmoid(b, b.fmul(k, x))
    return b.fadd(s, b.fmul(b.fmul(b.fmul(k, x), s), b.fsub(_c(x, 1.0), s)))


for _op in GATED_ACT:
    OPS[_op] = (2, _gated(_op))
    OPS[_op + "_grad_up"] = _gated_grad_up(_op)
    OPS[_op + "_grad_gate"] = _gated_grad_gate(_op)
del _op
