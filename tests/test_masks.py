"""Masks, comparisons and conditionals (SPEC §3.7): values bitwise against numpy/torch on random
data and on NaN, +-inf, +-0 and subnormals; gradients against torch autograd and fu.gradcheck;
bitwise thread invariance; bad input; ownership under exec scopes."""
import math
import operator

import numpy as np
import pytest
import torch

import fucina as fu
from fucina.ag.masks import SPLIT_AT, band_mask
from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from fucina.exec.elementwise import CHUNK
from conftest import assert_bitwise as _assert_bitwise


def assert_bitwise(got, want):
    """conftest's bitwise check, extended to 1-byte bool arrays (whose bytes must be 0 or 1)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.bool_ or want.dtype == np.bool_:
        assert got.shape == want.shape, (got.shape, want.shape)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert np.ascontiguousarray(got).view(np.uint8).max(initial=0) <= 1, "a bool byte other than 0/1"
        bad = got != want
        assert not bad.any(), f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[:3].tolist()}"
        return
    _assert_bitwise(got, want)

# the special values overflow f16/bf16 and NaN/inf go through integer casts on purpose
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, -1e-40,
                     1.17549435e-38, 3.4e38, -3.4e38, 0.5, 2.0, 65504.0, 1e-7], np.float32)
OPS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
       "gt": operator.gt, "ge": operator.ge}
TORCH_OPS = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}
FLOATS = ("f32", "f16", "bf16")


def pairs():
    """Every (special, special) pair plus random values, as two float32 arrays."""
    a, b = np.meshgrid(SPECIALS, SPECIALS, indexing="ij")
    rng = np.random.default_rng(0)
    r = rng.standard_normal((2, 200)).astype(np.float32)
    r[1, :50] = r[0, :50]  # plenty of exact ties
    return np.concatenate([a.ravel(), r[0]]), np.concatenate([b.ravel(), r[1]])


def stored(t) -> np.ndarray:
    """What a float tensor holds, as float32 (16-bit storage widened exactly)."""
    if t.dtype == "bf16":
        return bf16_bits_to_f32(t.data_const())
    return np.asarray(t.data_const(), np.float32)


def rounded(v, dtype) -> np.float32:
    """v rounded to float32, then once to `dtype` (R-9 rounding), as a float32."""
    with np.errstate(over="ignore"):
        v32 = np.array([v], np.float32)
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return v32.astype(np.float16).astype(np.float32)[0]
    if dtype == "bf16":
        return bf16_bits_to_f32(f32_to_bf16_bits(v32))[0]
    return v32[0]


def value(t) -> np.ndarray:
    """A tensor's values: float dtypes as float32 (exact), others as they are."""
    return stored(t) if t.dtype in FLOATS else t.numpy()


def truthy(a):
    a = np.asarray(a)
    return a != 0 if a.dtype != np.bool_ else a  # numpy: NaN != 0 is True


def torch_of(t) -> torch.Tensor:
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[t.dtype]
    return torch.from_numpy(stored(t).copy()).to(dt)


# ---- acceptance (SPEC §3.7) -----------------------------------------------------------------

def test_acceptance_compare_and_masked_fill(ctx):
    x = ctx.tensor([-1.0, 0.0, 2.0], ("i",))
    neg = x.compare("lt", 0)
    assert neg.dtype == "bool" and neg.tags == ("i",) and not neg.requires_grad
    assert neg.numpy().tolist() == [True, False, False]
    assert x.masked_fill(neg, 0).numpy().tolist() == [0.0, 0.0, 2.0]


def test_acceptance_counting_idiom(ctx):
    """`neg.sum_all().item() == 1` as i64 (SPEC §3.7 counting idiom)."""
    neg = ctx.tensor([-1.0, 0.0, 2.0], ("i",)).compare("lt", 0)
    n = neg.sum_all()
    assert n.dtype == "i64" and n.item() == 1


def test_relu_three_ways_agree_exactly(ctx):
    rng = np.random.default_rng(3)
    a = np.concatenate([rng.standard_normal(3000).astype(np.float32),
                        np.array([0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf], np.float32)])
    x = ctx.tensor(a, ("i",))
    r1 = x.relu().numpy()
    r2 = x.masked_fill(x.compare("lt", 0), 0).numpy()
    r3 = x.maximum(ctx.zeros(a.shape, ("i",))).numpy()
    # -0.0: relu gives +0 (select on x > 0), masked_fill keeps -0 (not < 0), maximum keeps -0
    # (tie goes to the first operand) -- equal as numbers, so compare as values, then as bits
    # away from zero
    assert np.array_equal(r1, r2) and np.array_equal(r1, r3)
    nz = a != 0
    assert_bitwise(r1[nz], r2[nz])
    assert_bitwise(r1[nz], r3[nz])
    assert_bitwise(r1[nz], torch.relu(torch.from_numpy(a)).numpy()[nz])


def test_band_mask_acceptance(ctx):
    causal = band_mask(ctx, ("q", "k"), (5, 5), None, 0)
    assert causal.dtype == "bool" and causal.tags == ("q", "k")
    assert_bitwise(causal.numpy(), np.tril(np.ones((5, 5), bool)))
    W = 3
    sw = band_mask(ctx, ("q", "k"), (6, 6), W - 1, 0).numpy()
    i, j = np.indices((6, 6))
    assert_bitwise(sw, (j <= i) & (i - j < W))
    assert not band_mask(ctx, ("q", "k"), (4, 7), -2, 1).numpy().any()   # contradictory
    assert not band_mask(ctx, ("q", "k"), (4, 7), 1, -2).numpy().any()
    assert band_mask(ctx, ("q", "k"), (4, 7), None, None).numpy().all()
    assert fu.Tensor.band_mask(ctx, ("a", "b"), (2, 3), 0, 0).numpy().tolist() == \
        [[True, False, False], [False, True, False]]


@pytest.mark.parametrize("shape", [(1, 1), (3, 9), (9, 3), (40, 70000)])
def test_band_mask_every_bound(ctx, shape):
    R, C = shape
    i, j = np.indices(shape)
    bounds = [None, 0, 1, 2, -1, -3, R + C + 5, -(R + C + 5), 2 ** 70, -(2 ** 70)]
    if R * C > 1000:
        bounds = [None, 0, 5, -5, 69990]
    for lo in bounds:
        for up in bounds:
            want = np.ones(shape, bool)
            if lo is not None:
                want &= (i - j) <= lo
            if up is not None:
                want &= (j - i) <= up
            assert_bitwise(band_mask(ctx, ("r", "c"), shape, lo, up).numpy(), want)


# ---- compare --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_compare_tensors_specials_and_random(ctx, dtype):
    a, b = pairs()
    x, y = ctx.tensor(a, ("i",), dtype), ctx.tensor(b, ("i",), dtype)
    xa, yb = stored(x), stored(y)
    for op, f in OPS.items():
        got = x.compare(op, y)
        assert got.dtype == "bool" and got.tags == ("i",)
        assert_bitwise(got.numpy(), f(xa, yb))
        assert_bitwise(got.numpy(), TORCH_OPS[op](torch_of(x), torch_of(y)).numpy())


def test_compare_mixed_float_dtypes_via_f32(ctx):
    a, b = pairs()
    x, y = ctx.tensor(a, ("i",)), ctx.tensor(b, ("i",), "bf16")
    for op, f in OPS.items():
        assert_bitwise(x.compare(op, y).numpy(), f(a, stored(y)))
        assert_bitwise(y.compare(op, x).numpy(), f(stored(y), a))


@pytest.mark.parametrize("dtype", FLOATS)
def test_compare_scalar(ctx, dtype):
    a, _ = pairs()
    x = ctx.tensor(a, ("i",), dtype)
    xa = stored(x)
    for s in [0, 0.0, -0.0, 1, -1.5, 1e-45, 1e-40, math.inf, -math.inf, math.nan, 0.1, 1e300, -10 ** 400]:
        with np.errstate(over="ignore"):
            s32 = np.float32(-math.inf if s == -10 ** 400 else s)
        for op, f in OPS.items():
            assert_bitwise(x.compare(op, s).numpy(), f(xa, s32))
    if dtype == "f32":  # f32 agrees with torch (the scalar rounds to f32 there too)
        for s in [0.0, -0.0, 0.1, math.nan, math.inf, 1e-45]:
            for op in OPS:
                assert_bitwise(x.compare(op, s).numpy(), TORCH_OPS[op](torch.from_numpy(a), s).numpy())


def test_compare_f16_scalar_divergence_documented(ctx):
    """Divergence: f16/bf16 compare via f32 (SPEC), so the number is rounded to f32, not to
    the tensor's dtype as torch does: f16(0.1) == 0.1 is False here, True in torch."""
    x = ctx.tensor([0.1], ("i",), "f16")
    assert x.compare("eq", 0.1).numpy().tolist() == [False]
    assert torch.tensor([0.1], dtype=torch.float16).eq(0.1).tolist() == [True]
    assert x.compare("eq", float(np.float16(0.1))).numpy().tolist() == [True]


I64_EDGE = np.array([-(2 ** 63), -(2 ** 63) + 1, -3, -2, -1, 0, 1, 2, 3, 2 ** 53, 2 ** 53 + 1,
                     2 ** 63 - 2, 2 ** 63 - 1], np.int64)


def test_compare_i64_exact(ctx):
    rng = np.random.default_rng(5)
    a = np.concatenate([I64_EDGE, rng.integers(-5, 5, 100)]).astype(np.int64)
    b = np.concatenate([I64_EDGE[::-1], rng.integers(-5, 5, 100)]).astype(np.int64)
    x, y = ctx.tensor(a, ("i",), "i64"), ctx.tensor(b, ("i",), "i64")
    for op, f in OPS.items():
        assert_bitwise(x.compare(op, y).numpy(), f(a, b))
        want = TORCH_OPS[op](torch.from_numpy(a), torch.from_numpy(b)).numpy()
        assert_bitwise(x.compare(op, y).numpy(), want)
    # scalars: exact comparison of integers with any real (Python's int/float comparison is exact)
    scalars = [0, 2, -3, 2 ** 63 - 1, -(2 ** 63), 2 ** 63, -(2 ** 63) - 1, 10 ** 30, 2.0, 2.5, -2.5,
               1e-300, -0.0, math.inf, -math.inf, math.nan, float(2 ** 53), 9.3e18, -9.3e18,
               float(2 ** 63), True, np.int64(7), np.float32(1.5)]
    for s in scalars:
        for op, f in OPS.items():
            want = np.array([f(int(v), s if not isinstance(s, np.floating) else float(s)) for v in a])
            assert_bitwise(x.compare(op, s).numpy(), want)


def test_compare_i64_with_float_is_exact_divergence(ctx):
    """Divergence: an i64 tensor compares with a float exactly; torch promotes to float32."""
    x = ctx.tensor([2 ** 24 + 1], ("i",), "i64")
    assert x.compare("gt", 16777216.0).numpy().tolist() == [True]
    assert x.compare("eq", 16777216.0).numpy().tolist() == [False]
    assert (torch.tensor([2 ** 24 + 1]) > 16777216.0).tolist() == [False]


def test_compare_bool(ctx):
    a = np.array([True, False, True, False])
    b = np.array([True, True, False, False])
    x, y = ctx.tensor(a, ("i",), "bool"), ctx.tensor(b, ("i",), "bool")
    for op, f in OPS.items():
        assert_bitwise(x.compare(op, y).numpy(), f(a, b))
        for s in [0, 1, True, False, 0.5, -1, 2, math.nan]:
            assert_bitwise(x.compare(op, s).numpy(), np.array([f(int(v), s) for v in a]))


def test_compare_strided_operands(ctx):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((33, 40)).astype(np.float32)
    b = rng.standard_normal((40, 33)).astype(np.float32)
    a[::3] = np.nan
    x = ctx.tensor(a, ("r", "c"))
    y = ctx.tensor(b, ("c", "r")).permute(("r", "c"))  # a transposed view
    for op, f in OPS.items():
        assert_bitwise(x.compare(op, y).numpy(), f(a, b.T))
        assert_bitwise(y.compare(op, 0.25).numpy(), f(b.T, np.float32(0.25)))


# ---- logical --------------------------------------------------------------------------------

LOGICAL = {"logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}


def test_logical_every_dtype_pair(ctx):
    rng = np.random.default_rng(9)
    base = np.concatenate([SPECIALS, rng.choice([0.0, -0.0, 1.0, np.nan, -2.0], 200).astype(np.float32)])
    other = np.roll(base, 7)
    data = {
        "f32": base, "f16": base, "bf16": base,
        "i64": np.where(np.isfinite(base), base, 5).astype(np.int64),
        "bool": truthy(base),
    }
    odata = {"f32": other, "bf16": other, "i64": np.where(np.isfinite(other), other, -1).astype(np.int64),
             "bool": truthy(other)}
    for da, va in data.items():
        x = ctx.tensor(va, ("i",), da)
        tx = truthy(stored(x)) if da in FLOATS else truthy(va)
        assert_bitwise(x.logical_not().numpy(), ~tx)
        for db, vb in odata.items():
            y = ctx.tensor(vb, ("i",), db)
            ty = truthy(stored(y)) if db in FLOATS else truthy(vb)
            for name, f in LOGICAL.items():
                got = getattr(x, name)(y)
                assert got.dtype == "bool" and got.tags == ("i",)
                assert_bitwise(got.numpy(), f(tx, ty))


def test_logical_against_torch_nan_truthy(ctx):
    a, b = pairs()
    x, y = ctx.tensor(a, ("i",)), ctx.tensor(b, ("i",))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_bitwise(x.logical_and(y).numpy(), torch.logical_and(ta, tb).numpy())
    assert_bitwise(x.logical_or(y).numpy(), torch.logical_or(ta, tb).numpy())
    assert_bitwise(x.logical_xor(y).numpy(), torch.logical_xor(ta, tb).numpy())
    assert_bitwise(x.logical_not().numpy(), torch.logical_not(ta).numpy())


# ---- isnan / isinf / isfinite ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_float_classes(ctx, dtype):
    a, b = pairs()
    x = ctx.tensor(np.concatenate([a, b * np.float32(1e38)]), ("i",), dtype)
    v = stored(x)
    assert_bitwise(x.isnan().numpy(), np.isnan(v))
    assert_bitwise(x.isinf().numpy(), np.isinf(v))
    assert_bitwise(x.isfinite().numpy(), np.isfinite(v))
    t = torch_of(x)
    assert_bitwise(x.isnan().numpy(), torch.isnan(t).numpy())
    assert_bitwise(x.isinf().numpy(), torch.isinf(t).numpy())
    assert_bitwise(x.isfinite().numpy(), torch.isfinite(t).numpy())


def test_integer_classes(ctx):
    for x in (ctx.tensor(I64_EDGE, ("i",), "i64"), ctx.tensor([True, False], ("i",), "bool")):
        n = x.shape[0]
        assert_bitwise(x.isnan().numpy(), np.zeros(n, bool))
        assert_bitwise(x.isinf().numpy(), np.zeros(n, bool))
        assert_bitwise(x.isfinite().numpy(), np.ones(n, bool))


# ---- where ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i64", "bool"])
def test_where_values(ctx, dtype):
    a, b = pairs()
    c = np.arange(a.size) % 3 == 0
    if dtype == "i64":
        a, b = np.nan_to_num(a).astype(np.int64), np.nan_to_num(b).astype(np.int64)
    elif dtype == "bool":
        a, b = truthy(a), truthy(b)
    x, y = ctx.tensor(a, ("i",), dtype), ctx.tensor(b, ("i",), dtype)
    for cond, cv in ((ctx.tensor(c, ("i",), "bool"), c),
                     (ctx.tensor(np.where(c, np.nan, 0.0), ("i",)), c)):  # NaN is truthy
        got = x.where(cond, y)
        assert got.dtype == dtype
        va = stored(x) if dtype in FLOATS else a
        vb = stored(y) if dtype in FLOATS else b
        want = np.where(cv, va, vb)
        if dtype in FLOATS:
            assert_bitwise(stored(got), want)
        else:
            assert_bitwise(got.numpy(), want)


def test_where_grads_against_torch(ctx):
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2, 4, 9)).astype(np.float32)
    c = rng.random((4, 9)) < 0.4
    x, y = ctx.variable(a, ("r", "c")), ctx.variable(b, ("r", "c"))
    cond = ctx.tensor(c, ("r", "c"), "bool")
    gw = rng.standard_normal((4, 9)).astype(np.float32)
    out = x.where(cond, y)
    out.backward(ctx.tensor(gw, ("r", "c")))
    tx, ty = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    tout = torch.where(torch.from_numpy(c), tx, ty)
    tout.backward(torch.from_numpy(gw))
    assert_bitwise(out.numpy(), tout.detach().numpy())
    assert_bitwise(x.grad().numpy(), tx.grad.numpy())
    assert_bitwise(y.grad().numpy(), ty.grad.numpy())
    x.zero_grad(), y.zero_grad()
    fu.gradcheck(lambda x, y: (x.where(cond, y) * x).sum_all(), [x, y])


# ---- masked_fill ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_fill_values(ctx, dtype):
    a, b = pairs()
    m = truthy(b) & (np.arange(a.size) % 2 == 0)
    x = ctx.tensor(a, ("i",), dtype)
    mask = ctx.tensor(m, ("i",), "bool")
    for v in [0.0, 1.5, 0.1, math.nan, math.inf, -math.inf, 1e-45, 70000.0, 1e300, 3]:  # -0.0: below
        got = x.masked_fill(mask, v)
        assert got.dtype == dtype and got.tags == ("i",)
        try:
            want = torch_of(x).masked_fill(torch.from_numpy(m), v).float().numpy()
        except RuntimeError:  # divergence: torch refuses a value beyond the dtype; we round (to inf)
            assert abs(v) > 65504
            want = np.where(m, rounded(v, dtype), stored(x))
        assert_bitwise(stored(got), want)


NEG_ZERO_SCRIPT = """
import numpy as np, fucina as fu
with fu.ExecContext(threads=1) as ctx:
    for dtype in ("f32", "f16", "bf16"):
        x = ctx.tensor([1.0, 2.0], ("i",), dtype)
        m = ctx.tensor([True, False], ("i",), "bool")
        for v in (0.0, -0.0, 0.0, -0.0):
            got = np.signbit(x.masked_fill(m, v).numpy()[0])
            assert got == np.signbit(v), (dtype, v, got)
print("ok")
"""


def test_masked_fill_signed_zero_values():
    """The fill value is a by-value kernel parameter: +0.0 and -0.0 must stay distinct in any
    order of use. Run in a child process: a layer that conflates equal-comparing floats in a
    cache (0.0 == -0.0) would otherwise leak the wrong zero into this process's later tests."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", NEG_ZERO_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_masked_fill_integer_and_bool(ctx):
    a = I64_EDGE
    m = np.arange(a.size) % 2 == 1
    x = ctx.tensor(a, ("i",), "i64")
    mask = ctx.tensor(m, ("i",), "bool")
    for v in [0, -1, 2 ** 63 - 1, -(2 ** 63), np.int64(5)]:
        want = torch.from_numpy(a).masked_fill(torch.from_numpy(m), int(v)).numpy()
        assert_bitwise(x.masked_fill(mask, v).numpy(), want)
    b = ctx.tensor(m, ("i",), "bool")
    assert_bitwise(b.masked_fill(mask.logical_not(), 1).numpy(), np.ones(a.size, bool))
    assert_bitwise(b.masked_fill(mask, 0).numpy(), np.zeros(a.size, bool))
    assert_bitwise(b.masked_fill(mask.logical_not(), True).numpy(), np.ones(a.size, bool))
    assert_bitwise(b.masked_fill(mask.logical_not(), math.nan).numpy(), np.ones(a.size, bool))  # truthy
    f = ctx.tensor(np.zeros(a.size, np.float32), ("i",))
    assert_bitwise(f.masked_fill(mask, True).numpy(), m.astype(np.float32))
    with pytest.raises(fu.DTypeError):
        x.masked_fill(mask, 1.5)


def test_masked_fill_truthy_float_mask_and_broadcast(ctx):
    rng = np.random.default_rng(13)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    x = ctx.tensor(a, ("h", "q", "k"))
    fm = np.array([[0.0, np.nan, -0.0, 2.0, 0.0]] * 4, np.float32)  # NaN truthy, -0 falsy
    got = x.masked_fill(ctx.tensor(fm, ("q", "k")), -1.0).numpy()
    assert_bitwise(got, np.where(truthy(fm)[None], np.float32(-1.0), a))
    # a causal mask [q, k] serves scores [h, q, k], whatever the axis order
    causal = band_mask(ctx, ("k", "q"), (5, 4), None, 0)  # i along k, j along q: True iff q <= k
    want = np.where(np.tril(np.ones((5, 4), bool)).T[None], -np.inf, a).astype(np.float32)
    assert_bitwise(x.masked_fill(causal, -math.inf).numpy(), want)
    row = ctx.tensor(np.array([[True], [False], [True]]), ("h", "q"), "bool")  # size-1 axis broadcasts
    want = np.where(np.array([True, False, True])[:, None, None], np.float32(7), a)
    assert_bitwise(x.masked_fill(row, 7.0).numpy(), want)


def test_masked_fill_grads(ctx):
    rng = np.random.default_rng(15)
    a = rng.standard_normal((6, 7)).astype(np.float32)
    m = rng.random((6, 7)) < 0.5
    gw = rng.standard_normal((6, 7)).astype(np.float32)
    x = ctx.variable(a, ("r", "c"))
    mask = ctx.tensor(m, ("r", "c"), "bool")
    out = x.masked_fill(mask, 3.0)
    assert out.requires_grad
    out.backward(ctx.tensor(gw, ("r", "c")))
    tx = torch.tensor(a, requires_grad=True)
    tx.masked_fill(torch.from_numpy(m), 3.0).backward(torch.from_numpy(gw))
    assert_bitwise(x.grad().numpy(), tx.grad.numpy())
    x.zero_grad()
    fu.gradcheck(lambda x: (x.masked_fill(mask, 3.0) * x).sum_all(), [x])
    # broadcast mask: the gradient is zero on every filled element
    x.zero_grad()
    col = ctx.tensor(m[0], ("c",), "bool")
    x.masked_fill(col, 0.0).backward(ctx.tensor(gw, ("r", "c")))
    tx.grad = None
    tx.masked_fill(torch.from_numpy(m[0]), 0.0).backward(torch.from_numpy(gw))
    assert_bitwise(x.grad().numpy(), tx.grad.numpy())


# ---- any / all ------------------------------------------------------------------------------

def _any_all_data(rng, shape, dtype):
    a = rng.choice(np.array([0.0, -0.0, 0.0, 0.0, 1.0, np.nan, 1e-45], np.float32), shape)
    a[..., 0] = 0  # some all-false lanes
    if a.ndim > 1:
        a[0] = 0.0
        a[-1] = 1.0  # an all-true lane
    if dtype == "i64":
        return np.nan_to_num(a * 3).astype(np.int64)
    if dtype == "bool":
        return truthy(a)
    return a


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i64", "bool"])
def test_any_all_axes(ctx, dtype):
    rng = np.random.default_rng(17)
    for shape in [(7,), (3, 5), (4, 1, 33), (2, 3, 4, 9), (130, 3)]:
        a = _any_all_data(rng, shape, dtype)
        x = ctx.tensor(a, tuple("abcd"[:len(shape)]), dtype)
        v = truthy(stored(x) if dtype in FLOATS else a)
        for ax, tag in enumerate(x.tags):
            an, al = x.any(tag), x.all(tag)
            assert an.dtype == al.dtype == "bool"
            assert an.tags == al.tags == tuple(t for t in x.tags if t != tag)
            assert_bitwise(an.numpy(), v.any(ax))
            assert_bitwise(al.numpy(), v.all(ax))
        assert x.any_all().tags == () and x.any_all().dtype == "bool"
        assert x.any_all().item() == bool(v.any()) and x.all_all().item() == bool(v.all())
    t = torch.from_numpy(np.array([[0.0, np.nan], [0.0, -0.0]], np.float32))
    x = ctx.tensor(t.numpy(), ("r", "c"))
    assert_bitwise(x.any("c").numpy(), torch.any(t, 1).numpy())
    assert_bitwise(x.all("r").numpy(), torch.all(t, 0).numpy())


def test_any_all_long_axis_and_strided(ctx):
    n = SPLIT_AT * 3 + 17  # split into segments, second pass over the partials
    a = np.zeros(n, np.float32)
    x = ctx.tensor(a, ("i",))
    assert x.any_all().item() is False and x.any("i").item() is False
    for pos in (0, 16383, 16384, n - 1):
        a2 = a.copy()
        a2[pos] = np.nan
        x = ctx.tensor(a2, ("i",))
        assert x.any_all().item() is True and x.any("i").item() is True
        ones = ctx.tensor(np.where(a2 == a2, 1.0, 0.0).astype(np.float32), ("i",))
        assert ones.all_all().item() is False and ones.all("i").item() is False
    assert ctx.tensor(np.ones((2, n), np.float32), ("r", "i")).all("i").numpy().tolist() == [True, True]
    rng = np.random.default_rng(19)
    b = (rng.random((40, 30)) < 0.05).astype(np.float32)
    y = ctx.tensor(b, ("c", "r")).permute(("r", "c"))  # strided input
    assert_bitwise(y.any("c").numpy(), truthy(b.T).any(1))
    assert_bitwise(y.all("r").numpy(), truthy(b.T).all(0))


# ---- band_part / tril / triu ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i64", "bool"])
def test_band_part_values(ctx, dtype):
    rng = np.random.default_rng(21)
    a = rng.standard_normal((3, 5, 4)).astype(np.float32)  # tags (r, b, c): r and c not adjacent
    if dtype == "i64":
        a = (a * 10).astype(np.int64)
    elif dtype == "bool":
        a = a > 0
    x = ctx.tensor(a, ("r", "b", "c"), dtype)
    va = stored(x) if dtype in FLOATS else a
    tv = torch.from_numpy(np.moveaxis(va, 1, 0).copy())  # (b, r, c)
    zero = np.zeros((), va.dtype)
    for off in (-4, -1, 0, 1, 2, 10):
        assert_bitwise(value(x.tril("r", "c", off)), np.moveaxis(torch.tril(tv, off).numpy(), 0, 1))
        assert_bitwise(value(x.triu("r", "c", off)), np.moveaxis(torch.triu(tv, off).numpy(), 0, 1))
    i, j = np.indices((3, 4))
    for lo, up in [(None, 0), (1, 0), (0, 1), (2, 2), (-1, 2), (1, -3)]:
        keep = np.ones((3, 4), bool)
        if lo is not None:
            keep &= i - j <= lo
        if up is not None:
            keep &= j - i <= up
        got = x.band_part("r", "c", lo, up)
        assert got.tags == x.tags and got.dtype == dtype
        assert_bitwise(value(got), np.where(keep[:, None, :], va, zero))
    # column tag first: rows run along "c"
    got = x.tril("c", "r")
    assert_bitwise(value(got), np.where((np.arange(3)[:, None, None] <= np.arange(4)[None, None, :]), va, zero))


def test_band_part_specials_keep_bits(ctx):
    a = SPECIALS[:16].reshape(4, 4)
    x = ctx.tensor(a, ("r", "c"))
    want = torch.tril(torch.from_numpy(a)).numpy()
    assert_bitwise(x.tril("r", "c").numpy(), want)
    assert np.isnan(a[1, 2]) and x.tril("r", "c").numpy()[1, 2] == 0  # NaN above the band is zeroed


def test_band_part_grads(ctx):
    rng = np.random.default_rng(23)
    a = rng.standard_normal((2, 5, 6)).astype(np.float32)
    gw = rng.standard_normal((2, 5, 6)).astype(np.float32)
    x = ctx.variable(a, ("h", "q", "k"))
    tx = torch.tensor(a, requires_grad=True)
    for ours, theirs in [(lambda t: t.tril("q", "k", 1), lambda t: torch.tril(t, 1)),
                         (lambda t: t.triu("q", "k", -1), lambda t: torch.triu(t, -1)),
                         (lambda t: t.band_part("q", "k", 1, 2),
                          lambda t: torch.tril(torch.triu(t, -1), 2))]:
        x.zero_grad()
        tx.grad = None
        out = ours(x)
        assert out.requires_grad
        out.backward(ctx.tensor(gw, ("h", "q", "k")))
        theirs(tx).backward(torch.from_numpy(gw))
        assert_bitwise(out.numpy(), theirs(tx).detach().numpy())
        assert_bitwise(x.grad().numpy(), tx.grad.numpy())
    x.zero_grad()
    fu.gradcheck(lambda x: (x.band_part("q", "k", 2, 0) * x).sum_all(), [x])


# ---- thread invariance ----------------------------------------------------------------------

def test_thread_invariance(ctx1, ctx2):
    n = 5 * CHUNK + 123
    rng = np.random.default_rng(29)
    a = rng.standard_normal(n).astype(np.float32)
    a[rng.random(n) < 0.01] = np.nan
    b = rng.standard_normal(n).astype(np.float32)
    z = np.zeros(SPLIT_AT * 2 + 5, np.float32)
    z[-1] = 1.0
    g = rng.standard_normal((300, 700)).astype(np.float32)
    res = []
    for c in (ctx1, ctx2):
        x, y = c.tensor(a, ("i",)), c.tensor(b, ("i",))
        big = c.tensor(g, ("r", "c"))
        m = x.compare("gt", y)
        res.append([m.numpy(), x.compare("le", 0.5).numpy(), m.logical_xor(y).numpy(), x.isnan().numpy(),
                    x.masked_fill(m, -2.0).numpy(), x.where(m, y).numpy(),
                    c.tensor(a[:n - n % 3].reshape(-1, 3), ("r", "c")).any("r").numpy(),
                    c.tensor(z, ("i",)).any_all().numpy(), c.tensor(z, ("i",)).all("i").numpy(),
                    big.tril("r", "c", 3).numpy(), band_mask(c, ("r", "c"), (300, 700), 5, 7).numpy()])
    for u, v in zip(*res):
        assert_bitwise(u, v)


# ---- bad input ------------------------------------------------------------------------------

def test_bad_input(ctx):
    x = ctx.tensor(np.zeros((2, 3), np.float32), ("r", "c"))
    y = ctx.tensor(np.zeros((2, 4), np.float32), ("r", "c"))
    with pytest.raises(fu.ShapeMismatch, match=r"\(2, 3\).*\(2, 4\)"):
        x.compare("lt", y)
    with pytest.raises(fu.TagError):
        x.compare("lt", ctx.tensor(np.zeros((2, 3), np.float32), ("r", "k")))
    with pytest.raises(ValueError, match="compare"):
        x.compare("lesser", 0)
    with pytest.raises(TypeError):
        x.compare("lt", "0")
    with pytest.raises(fu.DTypeError):
        x.compare("lt", ctx.tensor(np.zeros((2, 3), np.int64), ("r", "c"), "i64"))
    with pytest.raises(fu.ShapeMismatch, match=r"\(2, 3\).*\(2, 4\)"):
        x.logical_and(y)
    m = x.compare("eq", 0)
    for bad in (lambda: m + m, lambda: m * 2, lambda: m - m, lambda: -m):
        with pytest.raises((fu.DTypeError, TypeError)):
            bad()
    with pytest.raises((fu.ShapeMismatch, fu.TagError)):
        x.masked_fill(ctx.tensor(np.zeros((3,), bool), ("k",), "bool"), 0.0)
    with pytest.raises(fu.ShapeMismatch):
        x.masked_fill(ctx.tensor(np.zeros((4,), bool), ("c",), "bool"), 0.0)
    with pytest.raises(TypeError):
        x.masked_fill(m, "0")
    with pytest.raises((fu.ShapeMismatch, fu.TagError)):
        x.where(ctx.tensor(np.zeros((3, 2), bool), ("c", "r"), "bool"), x)
    with pytest.raises(fu.ShapeMismatch):
        x.where(m, y)
    with pytest.raises(fu.DTypeError):
        x.where(m, ctx.tensor(np.zeros((2, 3), np.float32), ("r", "c"), "f16"))
    with pytest.raises(fu.TagError):
        x.any("k")
    with pytest.raises(fu.TagError):
        x.tril("r", "r")
    with pytest.raises(fu.TagError):
        x.band_part("r", "k", 0, 0)
    with pytest.raises(TypeError):
        x.tril("r", "c", 0.5)
    with pytest.raises(TypeError):
        x.band_part("r", "c", 1.0, None)
    with pytest.raises(fu.InvalidShape):
        band_mask(ctx, ("a", "b"), (-1, 3), None, 0)
    with pytest.raises(fu.InvalidShape):
        band_mask(ctx, ("a", "b", "c"), (2, 2, 2), None, 0)
    with pytest.raises(fu.TagError):
        band_mask(ctx, ("a",), (2, 2), None, 0)
    with pytest.raises(fu.TagError):
        band_mask(ctx, ("a", "a"), (2, 2), None, 0)
    with pytest.raises(TypeError):
        x.compare("lt", 0, strict=True)
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(fu.ContextMismatch):
            x.compare("lt", other.tensor(np.zeros((2, 3), np.float32), ("r", "c")))
        with pytest.raises(fu.ContextMismatch):
            x.masked_fill(other.tensor(np.zeros((2, 3), bool), ("r", "c"), "bool"), 0.0)
    finally:
        other.close()


def test_masks_do_not_carry_gradients(ctx):
    x = ctx.variable([1.0, -2.0, np.nan], ("i",))
    for m in (x.compare("lt", 0), x.isnan(), x.logical_not(), x.logical_or(x), x.any("i"), x.all_all()):
        assert m.dtype == "bool" and not m.requires_grad
    # a mask computed from a variable gates that variable's gradient, and nothing flows into it
    y = x.masked_fill(x.isnan(), 0.0)
    y.sum_all().backward()
    assert x.grad().numpy().tolist() == [1.0, 1.0, 0.0]


# ---- exec scopes (R-5) ----------------------------------------------------------------------

def test_mask_producers_are_caller_owned_under_a_scope(ctx):
    x = ctx.variable(np.array([[-1.0, 0.0], [2.0, np.nan]], np.float32), ("r", "c"))
    with ctx.exec_scope():
        masks = [x.compare("lt", 0), x.compare("eq", x), x.isnan(), x.isinf(), x.isfinite(),
                 x.logical_not(), x.logical_and(x), x.logical_or(x), x.logical_xor(x),
                 x.any("c"), x.all("r"), x.any_all(), x.all_all(),
                 band_mask(ctx, ("r", "c"), (2, 2), None, 0)]
        filled = x.masked_fill(masks[0], 0.0)
        chosen = x.where(masks[2], x)
        banded = x.tril("r", "c")
        typed = ctx.tensor([1, 2], ("i",), "i64").masked_fill(ctx.tensor([True, False], ("i",), "bool"), 0)
        for m in masks:
            assert m.dtype == "bool" and not m.scope_owned
        for t in (filled, chosen, banded):  # f32 / grad-carrying results are borrows
            assert t.scope_owned
        assert not typed.scope_owned and typed.dtype == "i64"
    for m in masks:  # still alive after the scope closed
        m.numpy()
    assert masks[0].numpy().tolist() == [[True, False], [False, False]]
    typed.numpy()
    with pytest.raises(RuntimeError, match="scope"):
        filled.numpy()
    with pytest.raises(RuntimeError, match="scope"):
        banded.numpy()
