"""Activations (SPEC §3.3 UnaryOp, §3.4 leaky_relu/clamp, §3.6 gated and split_gated).

Values: bitwise against a float32 numpy transcription where the formula has no transcendental,
else an ulp bound against float64 (SPEC §0.5; the bound of each op is in BOUND) — on random
data and on the edge values (NaN, ±inf, ±0, subnormals, huge magnitudes). Gradients: against
torch autograd (rtol 1e-5, atol 1e-6) and fu.gradcheck. Thread invariance, 16-bit inputs, bad
input, and the documented divergences from torch (one test lists them).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from fucina.ag.activations import UNARY
from fucina.exec.elementwise import CHUNK
from conftest import assert_bitwise, ulp_diff

f32 = np.float32
RNG = np.random.default_rng(0)

EDGE = np.array([
    np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754944e-38, -1.1754944e-38,
    3.4028235e38, -3.4028235e38, 1e30, -1e30, 1e13, -1e13, 1e10, -1e10, 1048576.0, -1048576.0,
    104.0, -104.0, 89.0, -89.0, 88.5, -88.5, 87.5, -87.5, 20.0, -20.0, 10.0, -10.0, 9.999, -9.999,
    1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1e-7, -1e-7, 8388607.5, 8388608.0, -8388609.0,
    16777217.0, 0.7, -0.7], f32)

# exact float32 formulas (SPEC §3.3), transcribed operation by operation


def _fast_tanh32(x):
    a, b, c, d, e = (f32(v) for v in (2.45550750702956, 0.893229853513558, 0.821226666969744,
                                       2.44506634652299, 0.814642734961073))
    ax, x2 = np.abs(x), x * x
    return x * (a + a * ax + (b + c * ax) * x2) / (d + (d + x2) * np.abs(x + e * x * ax))


def _round32(x):
    big = f32(8388608.0)
    ax = np.abs(x)
    return np.where(ax < big, np.copysign((ax + big) - big, x), x)


EXACT = {
    "relu": lambda x: np.where(x > 0, x, f32(0)),
    "neg": np.negative,
    "abs": np.abs,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: f32(1) / np.sqrt(x),
    "fast_tanh": _fast_tanh32,
    "floor": np.floor,
    "ceil": np.ceil,
    "round": _round32,
    "sign": lambda x: np.where(x > 0, f32(1), np.where(x < 0, f32(-1), x)),
    "reciprocal": lambda x: f32(1) / x,
    "hardswish": lambda x: x * np.minimum(np.maximum(x + f32(3), f32(0)), f32(6)) / f32(6),
}

# float64 references: the float32 algebraic prefix that feeds a transcendental is formed in
# float32 exactly as SPEC writes it (it is part of the formula); the rest is float64.


def _t(v):
    return torch.from_numpy(np.asarray(v, np.float64))


def _sig(v):
    return torch.sigmoid(_t(v)).numpy()


def _two_u32(x):
    with np.errstate(all="ignore"):
        return f32(2) * (f32(0.7978845608028654) * (x + f32(0.044715) * (x * x * x)))


def _gelu64(x):
    with np.errstate(all="ignore"):
        return x.astype(np.float64) * _sig(_two_u32(x))


def ref64(op, x):
    d = x.astype(np.float64)
    with np.errstate(all="ignore"):
        return {
            "exp": lambda: np.exp(d),
            "sigmoid": lambda: _sig(d),
            "silu": lambda: d * _sig(d),
            "log": lambda: np.log(d),
            "log1p": lambda: np.log((f32(1) + x).astype(np.float64)),   # ln(1+x), 1+x rounded
            "softplus": lambda: np.maximum(d, 0) + np.log1p(np.exp(-np.abs(d))),
            "sin": lambda: np.sin(d),
            "cos": lambda: np.cos(d),
            "tanh": lambda: np.tanh(d),
            "gelu": lambda: _gelu64(x),
            "quick_gelu": lambda: d * _sig(f32(1.702) * x),
            "softcap_30": lambda: 30 * np.tanh((x * f32(1 / 30)).astype(np.float64)),
            "softcap_15": lambda: 15 * np.tanh((x * f32(1 / 15)).astype(np.float64)),
            "elu": lambda: np.where(d > 0, d, np.expm1(d)),
            "gelu_erf": lambda: 0.5 * d * torch.special.erfc(-_t(x * f32(0.7071067811865476))).numpy(),
            "erf": lambda: torch.special.erf(_t(d)).numpy(),
        }[op]()


# max error in float32 ulps vs ref64, measured (docs: the module docstring of
# fucina/kernel_templates/activations.py); gelu_erf adds |x|·2^-25 absolute for x < -1 (see its test)
BOUND = {"exp": 1.1, "sigmoid": 1.6, "silu": 2.0, "log": 1.0, "log1p": 1.0, "softplus": 1.9,
         "sin": 1.7, "cos": 1.9, "tanh": 1.4, "gelu": 2.0, "quick_gelu": 2.0, "softcap_30": 1.8,
         "softcap_15": 1.8, "elu": 1.5, "gelu_erf": 2.0, "erf": 1.2}
DOMAIN = {"log": (0, np.inf), "sin": (-2.0 ** 20, 2.0 ** 20), "cos": (-2.0 ** 20, 2.0 ** 20),
          "log1p": (-1, np.inf)}


def rand_bits(rng, n, lo=-np.inf, hi=np.inf):
    """Random float32 bit patterns (finite), every binade alike, within [lo, hi]."""
    v = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(f32)
    return v[np.isfinite(v) & (v >= lo) & (v <= hi)]


def data(rng, op, n=60000):
    lo, hi = DOMAIN.get(op, (-np.inf, np.inf))
    core = rng.uniform(max(lo, -12), min(hi, 12), n).astype(f32)
    return np.concatenate([rand_bits(rng, n, lo, hi), core, (rng.standard_normal(n) * 3).astype(f32)])


# ---- SPEC acceptances ----

def test_acceptance(ctx):
    assert ctx.tensor([-1.0, 0.0, 1.0], ("n",)).relu().numpy().tolist() == [0, 0, 1]
    assert abs(ctx.tensor([1.0], ("n",)).silu().item() - 0.7310586) <= 1e-6
    up, gate = ctx.tensor([2.0], ("n",)), ctx.tensor([1.0], ("n",))
    assert abs(up.swiglu(gate).item() - 2 * 0.7310586) <= 2e-6
    assert abs(ctx.tensor([1.0, 2.0], ("n",)).split_gated("swiglu", "n", "n").item() - 1.4621172) <= 1e-6


def test_every_member_and_alias_exists(ctx1):
    assert len(UNARY) == 29 and len(set(UNARY)) == 29
    x = ctx1.tensor([0.25, -0.5], ("n",))
    aliases = {"softcap_30": "softcap30", "softcap_15": "softcap15"}
    for op in UNARY:
        want = x.unary(op).numpy()
        if op in ("softplus", "gelu_quant"):
            assert not hasattr(x, op)
            continue
        assert_bitwise(getattr(x, aliases.get(op, op))().numpy(), want)
    assert_bitwise(x.unary("softcap30").numpy(), x.unary("softcap_30").numpy())
    assert_bitwise(abs(x).numpy(), x.abs().numpy())


# ---- values ----

@pytest.mark.parametrize("op", sorted(EXACT))
def test_exact_ops_bitwise(ctx1, op):
    a = np.concatenate([(RNG.standard_normal(5000) * 10).astype(f32), rand_bits(RNG, 5000),
                        (np.arange(-40, 41) * 0.25).astype(f32), EDGE])
    with np.errstate(all="ignore"):
        want = EXACT[op](a).astype(f32)
    assert_bitwise(ctx1.tensor(a, ("n",)).unary(op).numpy(), want)


def _check_ulp(op, x, got, bound):
    want = ref64(op, x)
    with np.errstate(all="ignore"):
        w32 = want.astype(f32)
    fin = np.isfinite(w32)
    # references that are not finite in float32: NaN where NaN, the same infinity (overflow)
    assert (np.isnan(got[~fin]) == np.isnan(w32[~fin])).all(), (op, x[~fin], got[~fin], want[~fin])
    inf = np.isinf(w32)
    assert (got[inf] == w32[inf]).all(), (op, x[inf], got[inf])
    with np.errstate(all="ignore"):
        err = ulp_diff(got[fin], want[fin])
    if op == "gelu_erf":  # 1 + erf(v) cancels for x < -1: the erf error is carried absolutely
        slack = np.where(x[fin] < -1, np.abs(x[fin].astype(np.float64)) * 2.0 ** -25, 0.0)
        with np.errstate(all="ignore"):
            spacing = np.spacing(np.abs(w32[fin])).astype(np.float64)
        err = np.maximum(0, np.abs(got[fin] - want[fin]) - slack) / spacing
    assert not np.isnan(err).any(), (op, x[fin][np.isnan(err)][:5])
    worst = int(np.argmax(err))
    assert err[worst] <= bound, (op, x[fin][worst], got[fin][worst], want[fin][worst], err[worst])
    return float(err.max())


@pytest.mark.parametrize("op", sorted(BOUND))
def test_transcendental_ops_within_bound(ctx1, op):
    rng = np.random.default_rng(sorted(BOUND).index(op))
    x = data(rng, op)
    _check_ulp(op, x, ctx1.tensor(x, ("n",)).unary(op).numpy(), BOUND[op])
    e = EDGE
    got = ctx1.tensor(e, ("n",)).unary(op).numpy()
    if op in ("sin", "cos"):  # beyond 2^20 the result is bounded, not accurate (docs/vmath.md)
        far = np.abs(e) > 2.0 ** 20
        assert (np.abs(got[far & np.isfinite(e)]) <= 1).all() and np.isnan(got[~np.isfinite(e)]).all()
        e, got = e[~far], got[~far]
    _check_ulp(op, e, got, BOUND[op])


def test_gelu_erf_documented_bound(ctx1):
    """gelu_erf is SPEC's literal 0.5·x·(1 + erf(x/√2)): within 2 ulp for x >= -1; below, the
    cancellation in 1 + erf leaves an absolute error under |x|·2^-25 (as in any float32
    evaluation of the formula, ggml's and torch's included)."""
    x = np.linspace(-1, 20, 200001).astype(f32)
    assert _check_ulp("gelu_erf", x, ctx1.tensor(x, ("n",)).gelu_erf().numpy(), 2.0) <= 2.0


def test_gelu_quant_is_ggml_f16_table(ctx1):
    """Every f16 input in (-10, 10) exhaustively: y = f16(gelu(f16(x))); the float32 tanh-gelu
    inside is within 2 ulp, so f16(y) may differ from the correctly rounded table entry by one
    f16 ulp only where gelu lands within 2 float32 ulp of an f16 rounding boundary."""
    h = np.arange(0, 2 ** 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h) & (np.abs(h) < 10)]
    x = h.astype(f32)
    got = ctx1.tensor(x, ("n",)).unary("gelu_quant").numpy()
    want = _gelu64(x).astype(np.float16).astype(f32)
    diff = got != want
    assert diff.sum() <= 4, x[diff]
    step = np.spacing(np.abs(want[diff]).astype(np.float16)).astype(f32)
    assert (np.abs(got[diff] - want[diff]) <= step).all()
    assert (got.astype(np.float16).astype(f32) == got).all()        # results are f16 values
    # the clamps, and f32 inputs between f16 values
    y = np.array([-10.0, -10.5, -1e30, 10.0, 11.5, 1e30, -np.inf, np.inf], f32)
    assert_bitwise(ctx1.tensor(y, ("n",)).unary("gelu_quant").numpy(),
                   np.array([0, 0, 0, 10, 11.5, 1e30, 0, np.inf], f32))
    r = RNG.uniform(-9.9, 9.9, 20000).astype(f32)
    want_r = _gelu64(r.astype(np.float16).astype(f32)).astype(np.float16).astype(f32)
    assert (ctx1.tensor(r, ("n",)).unary("gelu_quant").numpy() != want_r).mean() < 1e-3


def test_denormal_results_are_accurate(ctx1):
    """silu/gelu/quick_gelu/sigmoid keep their bound where sigmoid(v) is far below 2^-126 and
    the result is normal or denormal (the exp term is carried scaled; one final rounding)."""
    for op, lo, hi in [("silu", -104, -80), ("gelu", -11, -9), ("quick_gelu", -61, -45),
                       ("sigmoid", -104, -80)]:
        x = np.linspace(lo, hi, 30001).astype(f32)
        got = ctx1.tensor(x, ("n",)).unary(op).numpy()
        want = ref64(op, x)
        spacing = np.maximum(np.spacing(np.abs(want).astype(f32)).astype(np.float64), 2.0 ** -149)
        assert (np.abs(got - want) / spacing).max() <= BOUND[op], op


def test_sigmoid_silu_scaled_tail_and_saturation(ctx1):
    """sigmoid and silu carry e^-|x| times 2^31 with |x| clamped at 109.6 (see
    codegen/vsigmoid.py): every float32 in [-112, -80] (normal, denormal and underflowing
    results, the clamp) is within the bound; above 17.4 sigmoid is 1 and silu is x itself, up
    to FLT_MAX (silu's numerator clamp at 2^90 included); below -109.2 both are zero."""
    x = -np.arange(f32(80).view(np.uint32), f32(112).view(np.uint32), dtype=np.uint32).view(f32)
    for op in ("sigmoid", "silu"):
        _check_ulp(op, x, ctx1.tensor(x, ("n",)).unary(op).numpy(), BOUND[op])
    big = np.concatenate([np.geomspace(17.4, 3e38, 5000).astype(f32), np.array(
        [2.0 ** 90, np.nextafter(f32(2.0 ** 90), f32(0)), np.nextafter(f32(2.0 ** 90), f32(np.inf)),
         2.0 ** 97, 2.0 ** 98, 3.4028235e38], f32)])
    t = ctx1.tensor(big, ("n",))
    assert_bitwise(t.silu().numpy(), big)
    assert (t.sigmoid().numpy() == 1).all()
    tiny = np.array([-109.2, -109.6, -110.0, -200.0, -1e10, -3.4028235e38], f32)
    t = ctx1.tensor(tiny, ("n",))
    assert (t.silu().numpy() == 0).all() and (t.sigmoid().numpy() == 0).all()


def test_leaky_relu_and_clamp_bitwise(ctx1):
    a = np.concatenate([(RNG.standard_normal(3000) * 3).astype(f32), EDGE,
                        np.array([-1, 1, -0.5, 0.5], f32)])
    x = ctx1.tensor(a, ("n",))
    with np.errstate(all="ignore"):
        assert_bitwise(x.leaky_relu(0.1).numpy(), np.where(a > 0, a, f32(0.1) * a))
        for lo, hi in [(-1.0, 1.0), (-0.5, 0.5), (0.0, 0.0), (2.0, 1.0)]:
            t = np.where(a < f32(lo), f32(lo), a)
            assert_bitwise(x.clamp(lo, hi).numpy(), np.where(t > f32(hi), f32(hi), t))
        assert_bitwise(x.clamp_min(-0.5).numpy(), np.where(a < f32(-0.5), f32(-0.5), a))
        assert_bitwise(x.clamp_max(0.5).numpy(), np.where(a > f32(0.5), f32(0.5), a))
    # torch parity, NaN propagating
    ta = torch.from_numpy(a)
    assert_bitwise(x.clamp(-1.0, 1.0).numpy(), torch.clamp(ta, -1.0, 1.0).numpy())
    assert_bitwise(x.leaky_relu(0.1).numpy(), F.leaky_relu(ta, 0.1).numpy())


# ---- gradients ----

def _tq(t):
    return t * torch.sigmoid(1.702 * t)


def _fast_tanh_t(t):
    a, b, c, d, e = 2.45550750702956, 0.893229853513558, 0.821226666969744, 2.44506634652299, 0.814642734961073
    ax = t.abs()
    return t * (a + a * ax + (b + c * ax) * t * t) / (d + (d + t * t) * (t + e * t * ax).abs())


TORCH = {
    "relu": torch.relu, "exp": torch.exp, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "sigmoid": torch.sigmoid, "silu": F.silu, "log": torch.log, "log1p": torch.log1p,
    "softplus": F.softplus, "neg": torch.neg, "abs": torch.abs, "sin": torch.sin, "cos": torch.cos,
    "tanh": torch.tanh, "fast_tanh": _fast_tanh_t, "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "quick_gelu": _tq, "softcap_30": lambda t: 30 * torch.tanh(t / 30),
    "softcap_15": lambda t: 15 * torch.tanh(t / 15),
    "gelu_quant": lambda t: F.gelu(t, approximate="tanh"),   # its backward is tanh-gelu's
    "elu": F.elu, "gelu_erf": F.gelu, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "sign": torch.sign, "reciprocal": torch.reciprocal, "erf": torch.erf,
    "hardswish": F.hardswish,
}
POSITIVE = {"sqrt", "rsqrt", "log", "log1p"}


def _grad_input(rng, op, n):
    if op in POSITIVE:
        return rng.uniform(0.2, 4.0, n).astype(f32)
    x = (rng.standard_normal(n) * 2.5).astype(f32)
    x = np.where(np.abs(x) < 0.05, f32(0.3), x)       # away from the kinks at 0
    if op in ("floor", "ceil", "round"):                # and from integers / half-integers
        x = np.floor(x * 2) / 2 + f32(0.2)
    return x.astype(f32)


@pytest.mark.parametrize("op", UNARY)
def test_unary_gradient_against_torch_and_fd(ctx1, op):
    rng = np.random.default_rng(UNARY.index(op))
    a_np, w_np = _grad_input(rng, op, 2000), rng.standard_normal(2000).astype(f32)
    a, w = ctx1.variable(a_np, ("n",)), ctx1.tensor(w_np, ("n",))
    y = a.unary(op)
    (y * w).sum_all().backward()
    exact = op == "fast_tanh"   # no torch builtin: its formula in float64 autograd
    ta = torch.tensor(a_np.astype(np.float64) if exact else a_np, requires_grad=True)
    ty = TORCH[op](ta)
    (ty * torch.from_numpy(w_np.astype(np.float64) if exact else w_np)).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    if op != "gelu_quant":  # torch's vectorized GELU takes erf from an Abramowitz-Stegun fit
        atol = 2e-6 if op == "gelu_erf" else 1e-6            # (~1.5e-7 absolute, times x)
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=atol)
    if op == "gelu_quant":      # the forward is f16-quantized: finite differences see steps
        return
    small = ctx1.variable(a_np[:6], ("n",))
    ws = ctx1.tensor(w_np[:6], ("n",))
    assert fu.gradcheck(lambda v: (v.unary(op) * ws).sum_all(), [small]).checked == 6


def test_hardswish_is_torchs_bit_for_bit(ctx1):
    """The one-template activation: forward and backward bitwise torch's (x·t/6 with a true
    division; the derivative 0 up to -3 inclusive, g from 3, else g·(x/3 + 1/2), so NaN at
    NaN as torch's vectorized path gives — its scalar tail gives g there)."""
    x_np = np.concatenate([(RNG.standard_normal(20000) * 4).astype(f32), EDGE,
                           np.array([-3, 3, 2.9999998, -2.9999998, -3.0000002], f32)])
    g_np = RNG.standard_normal(x_np.size).astype(f32)
    x = ctx1.variable(x_np, ("n",))
    y = x.hardswish()
    (y * ctx1.tensor(g_np, ("n",))).sum_all().backward()
    tx = torch.from_numpy(x_np.copy()).requires_grad_()
    ty = F.hardswish(tx)
    ty.backward(torch.from_numpy(g_np))
    assert_bitwise(y.numpy(), ty.detach().numpy())
    assert_bitwise(x.grad().numpy(), tx.grad.numpy())


def test_gradients_at_kinks_and_zero_derivatives(ctx1):
    x = ctx1.variable([-2.0, -0.0, 0.0, 3.0], ("n",))
    for op, want in [("relu", [0, 0, 0, 1]), ("abs", [-1, 0, 0, 1]), ("floor", [0, 0, 0, 0]),
                     ("sign", [0, 0, 0, 0]), ("round", [0, 0, 0, 0]), ("ceil", [0, 0, 0, 0]),
                     ("elu", [np.exp(f32(-2)), 1, 1, 1])]:
        x.zero_grad()
        x.unary(op).sum_all().backward()
        np.testing.assert_array_equal(x.grad().numpy(), np.array(want, f32), err_msg=op)
    for lo, hi, want in [(-2.0, 0.0, [1, 1, 1, 0]), (0.0, 3.0, [0, 1, 1, 1])]:   # inclusive bounds
        x.zero_grad()
        x.clamp(lo, hi).sum_all().backward()
        assert x.grad().numpy().tolist() == want
    x.zero_grad()
    x.leaky_relu(0.25).sum_all().backward()
    assert x.grad().numpy().tolist() == [0.25, 0.25, 0.25, 1]


def test_parameterized_gradients_against_torch_and_fd(ctx1):
    a_np = (RNG.standard_normal(500) * 2).astype(f32)
    w_np = RNG.standard_normal(500).astype(f32)
    cases = [(lambda v: v.leaky_relu(0.1), lambda t: F.leaky_relu(t, 0.1)),
             (lambda v: v.clamp(-1.0, 1.5), lambda t: torch.clamp(t, -1.0, 1.5)),
             (lambda v: v.clamp_min(-0.5), lambda t: torch.clamp_min(t, -0.5)),
             (lambda v: v.clamp_max(0.5), lambda t: torch.clamp_max(t, 0.5))]
    for f, tf in cases:
        a = ctx1.variable(a_np, ("n",))
        (f(a) * ctx1.tensor(w_np, ("n",))).sum_all().backward()
        ta = torch.tensor(a_np, requires_grad=True)
        (tf(ta) * torch.from_numpy(w_np)).sum().backward()
        assert_bitwise(a.grad().numpy(), ta.grad.numpy())
        small = ctx1.variable(np.array([-2.0, -0.7, 0.3, 0.9, 2.0], f32), ("n",))
        assert fu.gradcheck(lambda v: (f(v) * 1.5).sum_all(), [small]).checked == 5


def test_exact_gradient_formulas_bitwise(ctx1):
    """Rules without a transcendental, against their float32 transcription."""
    x_np = RNG.uniform(0.1, 5, 1000).astype(f32) * np.where(RNG.random(1000) < 0.5, f32(-1), f32(1))
    g_np = RNG.standard_normal(1000).astype(f32)
    pos = np.abs(x_np)
    x, p = ctx1.variable(x_np, ("n",)), ctx1.variable(pos, ("n",))
    g = ctx1.tensor(g_np, ("n",))
    for v, op, want in [
            (x, "reciprocal", g_np * -((f32(1) / x_np) * (f32(1) / x_np))),
            (p, "rsqrt", g_np * (f32(-0.5) / (pos * np.sqrt(pos)))),
            (p, "sqrt", g_np * (f32(0.5) / np.sqrt(pos))),
            (x, "abs", g_np * np.sign(x_np)), (x, "neg", -g_np),
            (x, "relu", np.where(x_np > 0, g_np, f32(0)))]:
        v.zero_grad()
        v.unary(op).backward(grad=g)
        assert_bitwise(v.grad().numpy(), want.astype(f32))


# ---- gated ----

def _gated_act64(op, g):
    d = g.astype(np.float64)
    with np.errstate(all="ignore"):
        return {"glu": lambda: _sig(d), "swiglu": lambda: d * _sig(d), "geglu": lambda: _gelu64(g),
                "situ": lambda: 4 * np.tanh((g * f32(0.25)).astype(np.float64)) * _sig(d)}[op]()


def _gated_ref64(op, up, g):
    src = 25 * np.tanh((up * f32(0.04)).astype(np.float64)) if op == "situ" else up.astype(np.float64)
    with np.errstate(all="ignore"):
        return src * _gated_act64(op, g)


GATED_BOUND = {"glu": 2.0, "swiglu": 2.0, "geglu": 2.0, "situ": 4.0}
TORCH_GATED = {"glu": lambda u, g: u * torch.sigmoid(g), "swiglu": lambda u, g: u * F.silu(g),
               "geglu": lambda u, g: u * F.gelu(g, approximate="tanh"),
               "situ": lambda u, g: 25 * torch.tanh(u * 0.04) * 4 * torch.tanh(g * 0.25) * torch.sigmoid(g)}


@pytest.mark.parametrize("op", sorted(GATED_BOUND))
def test_gated_values(ctx1, op):
    rng = np.random.default_rng(len(op))
    up = np.concatenate([(rng.standard_normal(100000) * 4).astype(f32), rng.uniform(-200, 200, 20000).astype(f32)])
    g = np.concatenate([(rng.standard_normal(100000) * 4).astype(f32), rng.uniform(-30, 30, 20000).astype(f32)])
    got = ctx1.tensor(up, ("n",)).gated(ctx1.tensor(g, ("n",)), op).numpy()
    assert ulp_diff(got, _gated_ref64(op, up, g)).max() <= GATED_BOUND[op]
    alias = getattr(ctx1.tensor(up, ("n",)), op)(ctx1.tensor(g, ("n",))).numpy()
    assert_bitwise(alias, got)


@pytest.mark.parametrize("op", sorted(GATED_BOUND))
def test_gated_edge_values(ctx1, op):
    """Every pair of edge values (NaN, ±inf, ±0, subnormals, huge, ...) as (up, gate)."""
    e = EDGE[np.abs(EDGE) < 1e13]
    e = np.concatenate([e, np.array([np.inf, -np.inf, np.nan, -200, -150, -120, -100], f32)])
    up, g = (a.ravel() for a in np.meshgrid(e, e))
    got = ctx1.tensor(up, ("n",)).gated(ctx1.tensor(g, ("n",)), op).numpy()
    with np.errstate(all="ignore"):
        want = _gated_ref64(op, up, g)
        w32 = want.astype(f32)
        act32 = _gated_act64(op, g).astype(f32)
    # inf times an activation that is 0 in float32 (underflow) is NaN as in float32 math, or the
    # float64 product (the scaled evaluation keeps sigmoid(v) for v < -64 where float32 has 0)
    lost = np.isinf(up) & (act32 == 0)
    ok = lost & (np.isnan(got) | (got == w32))
    got, w32, want, up, g = got[~ok], w32[~ok], want[~ok], up[~ok], g[~ok]
    act32 = act32[~ok]
    fin = np.isfinite(w32)
    assert (np.isnan(got[~fin]) == np.isnan(w32[~fin])).all(), (op, up[~fin], g[~fin], got[~fin])
    assert (got[np.isinf(w32)] == w32[np.isinf(w32)]).all()
    # an activation that is itself denormal in float32 (|gate| < 2^-125) is rounded to it
    # before the product, as in float32 math; those lanes are not held to the ulp bound
    fin &= ~(np.abs(act32) < 2.0 ** -126)
    spacing = np.maximum(np.spacing(np.abs(w32[fin])).astype(np.float64), 2.0 ** -149)
    err = np.abs(got[fin] - want[fin]) / spacing
    assert err.max() <= GATED_BOUND[op], (up[fin][err.argmax()], g[fin][err.argmax()])


@pytest.mark.parametrize("op", sorted(GATED_BOUND))
@pytest.mark.parametrize("layout", ["same", "gate_broadcast", "up_broadcast"])
def test_gated_gradients_against_torch_and_fd(ctx1, op, layout):
    rng = np.random.default_rng(7)
    shapes = {"same": ((4, 6), (4, 6)), "gate_broadcast": ((4, 6), (6,)), "up_broadcast": ((6,), (4, 6))}
    us, gs = shapes[layout]
    tags = {2: ("b", "d"), 1: ("d",)}
    out_shape, out_tags = ((6, 4), ("d", "b")) if layout == "up_broadcast" else ((4, 6), ("b", "d"))
    up_np, g_np = (rng.standard_normal(us) * 2).astype(f32), (rng.standard_normal(gs) * 2).astype(f32)
    w_np = rng.standard_normal(out_shape).astype(f32)
    up, g = ctx1.variable(up_np, tags[len(us)]), ctx1.variable(g_np, tags[len(gs)])
    w = ctx1.tensor(w_np, out_tags)
    y = up.gated(g, op)
    assert y.tags == out_tags
    (y * w).sum_all().backward()
    tu, tg = torch.tensor(up_np, requires_grad=True), torch.tensor(g_np, requires_grad=True)
    ty = TORCH_GATED[op](tu[:, None], tg.T) if layout == "up_broadcast" else TORCH_GATED[op](tu, tg)
    (ty * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(up.grad().numpy(), tu.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g.grad().numpy(), tg.grad.numpy(), rtol=1e-5, atol=1e-5)
    if layout == "gate_broadcast":
        r = fu.gradcheck(lambda a, b: (a.gated(b, op) * w).sum_all(), [up, g])
        assert r.checked == 30
    # only the operand that requires grad receives one
    c = ctx1.tensor(g_np, tags[len(gs)])
    up.zero_grad()
    up.gated(c, op).sum_all().backward()
    assert up.grad() is not None


def test_swiglu_clamp10_is_inference_only(ctx1):
    up = np.array([-30, -10.5, -3, 0, 2, 9.5, 12, np.nan, 5], f32)
    g = np.array([1, 2, -3, 4, 10.5, 30, -0.5, 1, np.nan], f32)
    got = ctx1.tensor(up, ("n",)).swiglu_clamp10(ctx1.tensor(g, ("n",))).numpy()
    gc = np.minimum(g.astype(np.float64), 10)
    want = np.clip(up.astype(np.float64), -10, 10) * gc * _sig(gc)
    assert (np.isnan(got) == np.isnan(want)).all()
    fin = ~np.isnan(want)
    assert ulp_diff(got[fin], want[fin]).max() <= 2.0
    v = ctx1.variable(up, ("n",))
    with pytest.raises(fu.UnsupportedGradient):
        v.swiglu_clamp10(ctx1.tensor(g, ("n",)))
    with fu.no_grad():
        assert_bitwise(v.swiglu_clamp10(ctx1.tensor(g, ("n",))).numpy(), got)
    for call in (lambda: v.gated(v, "swiglu_clamp10"), lambda: v.split_gated("swiglu_clamp10", "n", "n")):
        with pytest.raises(TypeError):
            call()


@pytest.mark.parametrize("op", ["swiglu", "glu"])
def test_split_gated_against_torch(ctx1, op):
    rng = np.random.default_rng(3)
    x_np = (rng.standard_normal((3, 10, 4)) * 2).astype(f32)
    w_np = rng.standard_normal((3, 5, 4)).astype(f32)
    x = ctx1.variable(x_np, ("a", "h", "c"))
    y = x.split_gated(op, "h", "half")
    assert y.tags == ("a", "half", "c") and y.shape == (3, 5, 4)
    (y * ctx1.tensor(w_np, ("a", "half", "c"))).sum_all().backward()
    tx = torch.tensor(x_np, requires_grad=True)
    first, second = tx.chunk(2, dim=1)
    ty = F.silu(first) * second if op == "swiglu" else F.glu(tx, dim=1)
    (ty * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    # the two halves are views: the result equals gated on explicit copies
    f, s = ctx1.tensor(x_np[:, :5], ("a", "h", "c")), ctx1.tensor(x_np[:, 5:], ("a", "h", "c"))
    assert_bitwise(y.numpy(), (s.swiglu(f) if op == "swiglu" else f.glu(s)).numpy())
    small = ctx1.variable(x_np[:1, :, :2].copy(), ("a", "h", "c"))
    ws = ctx1.tensor(w_np[:1, :, :2].copy(), ("a", "h", "c"))
    assert fu.gradcheck(lambda v: (v.split_gated(op, "h", "h") * ws).sum_all(), [small]).checked == 20


def test_split_gated_last_axis_and_tags(ctx1):
    x = ctx1.tensor(np.arange(12, dtype=f32).reshape(2, 6) / 4, ("t", "f"))
    y = x.split_gated("glu", "f", "f")
    assert y.tags == ("t", "f") and y.shape == (2, 3)
    with pytest.raises(fu.TagError):
        x.split_gated("glu", "f", "t")
    with pytest.raises(fu.TagError):
        x.split_gated("glu", "missing", "o")


# ---- dtypes, layouts, threads ----

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_inputs_widen_compute_narrow_once(ctx1, dtype):
    a = np.concatenate([(RNG.standard_normal(999) * 3).astype(f32), EDGE[np.abs(EDGE) < 6e4]])
    x = ctx1.tensor(a, ("n",), dtype=dtype)
    wide = x.to("f32")
    for op in UNARY:
        got = x.unary(op)
        assert got.dtype == dtype
        assert_bitwise(got.data_const(), wide.unary(op).to(dtype).data_const())
    y = ctx1.tensor(a[::-1].copy(), ("n",), dtype=dtype)
    for op in GATED_BOUND:
        assert_bitwise(x.gated(y, op).data_const(), wide.gated(y.to("f32"), op).to(dtype).data_const())
    assert_bitwise(x.clamp(-1, 1).data_const(), wide.clamp(-1, 1).to(dtype).data_const())
    assert_bitwise(x.leaky_relu(0.2).data_const(), wide.leaky_relu(0.2).to(dtype).data_const())
    v = ctx1.variable(a[:8], ("n",), dtype=dtype)
    with pytest.raises(fu.UnsupportedGradient):
        v.gelu()
    with pytest.raises(fu.UnsupportedGradient):
        v.split_gated("swiglu", "n", "n")
    with fu.no_grad():
        assert v.gelu().dtype == dtype


def test_strided_views(ctx1):
    a_np = (RNG.standard_normal((6, 9)) * 2).astype(f32)
    a = ctx1.variable(a_np, ("i", "j"))
    v = a.narrow("j", 1, 5).permute(("j", "i"))
    want = np.ascontiguousarray(a_np[:, 1:6].T)
    for op in ("gelu", "tanh", "relu", "softplus", "sigmoid", "silu"):  # scalar loop == vector lane
        assert_bitwise(v.unary(op).numpy(), ctx1.tensor(want, ("j", "i")).unary(op).numpy())
    a.zero_grad()
    v.silu().sum_all().backward()
    tw = torch.tensor(a_np, requires_grad=True)
    F.silu(tw[:, 1:6].T).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_thread_count_never_changes_bits(ctx1, ctx2):
    n = 3 * CHUNK + 17
    rng = np.random.default_rng(11)
    a, b = (rng.standard_normal(n) * 4).astype(f32), (rng.standard_normal(n) * 4).astype(f32)
    outs = []
    for c in (ctx1, ctx2):
        x, y = c.variable(a, ("n",)), c.tensor(b, ("n",))
        res = [x.unary(op).numpy() for op in UNARY]
        res += [x.clamp(-1, 1).numpy(), x.leaky_relu(0.1).numpy(), x.detach().swiglu_clamp10(y).numpy()]
        res += [x.gated(y, op).numpy() for op in GATED_BOUND]
        for op in ("gelu", "silu", "gelu_erf", "fast_tanh"):
            x.zero_grad()
            (x.unary(op) * y).sum_all().backward()
            res.append(x.grad().numpy())
        for op in GATED_BOUND:
            x.zero_grad()
            y.gated(x, op).sum_all().backward()
            res.append(x.grad().numpy())
        outs.append(res)
    for p, q in zip(*outs):
        assert_bitwise(p, q)


# ---- bad input ----

def test_bad_input(ctx1):
    x = ctx1.tensor([1.0, 2.0, 3.0], ("n",))
    with pytest.raises(ValueError, match="gelu_erf"):      # the message lists the valid names
        x.unary("swish")
    with pytest.raises(ValueError):
        x.unary(3)
    i = ctx1.tensor([1, 2], ("n",), dtype="i64")
    for call in (lambda: i.relu(), lambda: i.unary("gelu"), lambda: i.clamp(0, 1),
                 lambda: i.leaky_relu(0.1), lambda: i.gated(i, "swiglu"), lambda: i.split_gated("glu", "n", "n")):
        with pytest.raises(fu.DTypeError):
            call()
    assert i.neg().numpy().tolist() == [-1, -2]          # integer negation stays
    with pytest.raises(fu.DTypeError):
        ctx1.tensor([True, False], ("n",), dtype="bool").sigmoid()
    with pytest.raises(fu.InvalidShape):
        x.split_gated("swiglu", "n", "n")
    with pytest.raises(TypeError):
        ctx1.tensor([1.0, 2.0], ("n",)).split_gated("geglu", "n", "n")
    with pytest.raises(TypeError):
        ctx1.tensor([1.0, 2.0], ("n",)).split_gated("situ", "n", "n")
    with pytest.raises(ValueError):
        x.gated(x, "reglu")
    with pytest.raises(TypeError):
        x.gated(2.0, "glu")
    with pytest.raises(TypeError):
        x.clamp("a", 1.0)
    with pytest.raises(TypeError):
        x.leaky_relu(None)
    with pytest.raises(fu.ShapeMismatch):
        x.swiglu(ctx1.tensor([1.0, 2.0], ("n",)))
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(fu.ContextMismatch):
            x.glu(other.tensor([1.0, 2.0, 3.0], ("n",)))
    finally:
        other.close()


# ---- documented divergences from torch (SPEC §7.1 item 11 and the notes of §3.3) ----

def test_documented_divergences_from_torch(ctx1):
    def fu_(op, vals):
        return ctx1.tensor(np.array(vals, f32), ("n",)).unary(op).numpy()

    def to_(f, vals):
        return f(torch.tensor(vals, dtype=torch.float32)).numpy()

    # 1. relu(NaN) = 0 (torch propagates NaN); relu(-0) = +0 (torch keeps -0)
    assert fu_("relu", [np.nan]).tolist() == [0.0] and np.isnan(to_(torch.relu, [np.nan])).all()
    assert np.signbit(to_(torch.relu, [-0.0]))[0] and not np.signbit(fu_("relu", [-0.0]))[0]
    # 2. log1p is ln(1 + x) with 1 + x rounded first: tiny x gives 0 (torch: x)
    assert fu_("log1p", [1e-10]).tolist() == [0.0] and to_(torch.log1p, [1e-10])[0] == f32(1e-10)
    # 3. sign(NaN) is NaN (numpy's convention; torch gives 0)
    assert np.isnan(fu_("sign", [np.nan])).all() and to_(torch.sign, [np.nan]).tolist() == [0.0]
    # 4. gelu_erf(+inf) = +inf (torch's AVX-512 vectorized path gives NaN; its AVX2 and scalar
    #    paths inf)
    inf16 = [np.inf] * 16
    assert (fu_("gelu_erf", inf16) == np.inf).all()
    assert all(np.isnan(v) or v == np.inf for v in to_(F.gelu, inf16))
    # 5. softplus has no threshold (torch switches to x above 20): equal values in float32 anyway
    big = [20.5, 30.0, 88.0]
    np.testing.assert_array_equal(fu_("softplus", big), to_(F.softplus, big))
    # 6. the relu gradient at NaN is 0 (torch: 1, since NaN <= 0 is false there)
    v = ctx1.variable([np.nan], ("n",))
    v.relu().sum_all().backward()
    t = torch.tensor([np.nan], requires_grad=True)
    torch.relu(t).sum().backward()
    assert v.grad().numpy().tolist() == [0.0] and t.grad.tolist() == [1.0]
    # 7. erf / gelu_erf use vmath's erf (within 1.1 ulp), not a bitwise port of musl's erff;
    #    torch.erf agrees within rtol 1e-5 / atol 1e-6; torch's vectorized GELU evaluates erf
    #    with an Abramowitz-Stegun fit (Vectorized<float>::erf, ~1.5e-7 absolute), so gelu_erf
    #    agrees within atol 2e-6.
    x = np.linspace(-6, 6, 10001).astype(f32)
    np.testing.assert_allclose(fu_("erf", x), to_(torch.erf, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fu_("gelu_erf", x), to_(F.gelu, x), rtol=1e-5, atol=2e-6)
