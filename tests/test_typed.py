"""Typed (non-f32) math and casts (SPEC R-9, R-10, R-11), bitwise against Python-int and
numpy transcriptions of the rules, with edge values; torch parity where torch agrees and named
tests for the documented divergences (SPEC §7.1 #9)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fucina as fu
from conftest import assert_bitwise
from fucina.exec.elementwise import CHUNK  # elements per chunk: sizes below span several

# building f16 sources from huge f32 edge values overflows to inf on purpose
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
EDGE = [I64_MIN, I64_MIN + 1, -(1 << 32) - 1, -1000, -7, -3, -2, -1, 0, 1, 2, 3, 7, 1000,
        1 << 32, (1 << 62) + 5, I64_MAX - 1, I64_MAX]
DTYPES = ("f32", "f16", "bf16", "i64", "bool")
DIVISIONS = ("div_trunc", "div_floor", "rem", "mod")


# ---- Python-int transcriptions of R-10 / R-11 -----------------------------------------------

def wrap(v: int) -> int:
    """Two's-complement i64 wrap of an exact Python int."""
    return ((v + (1 << 63)) % (1 << 64)) - (1 << 63)


def py_div(op: str, x: int, y: int) -> int:
    q_floor, m = divmod(x, y)  # Python: toward -inf, remainder with the divisor's sign
    q_trunc = q_floor + 1 if (m != 0 and (x < 0) != (y < 0)) else q_floor
    return wrap({"div_trunc": q_trunc, "div_floor": q_floor, "mod": m, "rem": x - y * q_trunc}[op])


def f_to_i64(v: float) -> int:
    """Truncate toward zero, saturate at the i64 bounds, NaN -> 0."""
    if math.isnan(v):
        return 0
    if v >= 2.0 ** 63:
        return I64_MAX
    if v < -(2.0 ** 63):
        return I64_MIN
    return int(v)


def i64_to_f32_bits(v: int) -> int:
    """Correctly rounded (nearest, ties to even) int -> float32, on the integers themselves."""
    if v == 0:
        return 0
    sign = 0x80000000 if v < 0 else 0
    m = abs(v)
    e = m.bit_length() - 1
    if e <= 23:
        q = m << (23 - e)
    else:
        shift = e - 23
        q, r = divmod(m, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
        if q == 1 << 24:
            q >>= 1
            e += 1
    return sign | ((e + 127) << 23) | (q & 0x7FFFFF)


def i64_to_f32(a) -> np.ndarray:
    return np.array([i64_to_f32_bits(int(v)) for v in a], np.uint32).view(np.float32)


def spec_bf16(a) -> np.ndarray:
    """SPEC R-9 f32_to_bf16, transcribed with Python ints."""
    out = []
    for b in np.asarray(a, np.float32).view(np.uint32).tolist():
        if (b & 0x7FFFFFFF) > 0x7F800000:
            out.append(((b >> 16) | 0x0040) & 0xFFFF)
        else:
            out.append((((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFFFFFF) >> 16) & 0xFFFF)
    return np.array(out, np.uint16)


def widen_bf16(h) -> np.ndarray:
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_storage(a, dtype: str) -> np.ndarray:
    """The reference narrowing of an f32 array to `dtype`'s storage (f16: numpy RNE)."""
    a = np.asarray(a, np.float32)
    if dtype == "f32":
        return a
    if dtype == "f16":
        with np.errstate(all="ignore"):
            return a.astype(np.float16)
    return spec_bf16(a)


def values_of(t) -> np.ndarray:
    """A tensor's values as the reference reads them: floats as float32 (exact), else storage."""
    v = np.array(t.data_const())
    if t.dtype == "bf16":
        return widen_bf16(v)
    return v.astype(np.float32) if t.dtype == "f16" else v


def storage(t) -> np.ndarray:
    return np.array(t.data_const())


def same(got, want):
    """Bitwise equality of storage arrays (float NaNs compare equal; bf16 bits exactly)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == np.bool_ or want.dtype == np.bool_:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want), np.argwhere(got != want)[:3].tolist()
    else:
        assert_bitwise(got, want)


def ref_cast(src_dtype: str, vals: np.ndarray, dst: str) -> np.ndarray:
    """SPEC R-10 on the source values, as `dst` storage."""
    if dst == "bool":
        return np.asarray(vals) != 0  # NaN != 0 is True
    if src_dtype in ("f32", "f16", "bf16"):
        if dst == "i64":
            return np.array([f_to_i64(v) for v in vals.tolist()], np.int64)
        return f32_to_storage(vals, dst)
    ints = [int(v) for v in vals.tolist()]  # i64, or bool as 0/1
    if dst == "i64":
        return np.array(ints, np.int64)
    return f32_to_storage(i64_to_f32(ints), dst)


# ---- sources with edge values -----------------------------------------------------------------

def float_edges() -> np.ndarray:
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.99999994, -0.99999994,
               np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1.1754942e-38, 6e-8, -6e-8,
               65504.0, 65520.0, -65520.0, 3.4028235e38, -3.4028235e38,
               2.0 ** 63, -(2.0 ** 63), 9.223371e18, -9.223371e18, 1e19, -1e19, 1e30, -1e30,
               2.0 ** 24 + 2, 123456.789, -98765.4321, 2.0 ** 31, -(2.0 ** 31) - 256]
    rng = np.random.default_rng(3)
    scaled = (rng.standard_normal(300) * 10.0 ** rng.integers(-8, 20, 300)).astype(np.float32)
    raw = rng.integers(0, 2 ** 32, 300, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([np.array(special, np.float32), scaled, raw])


def int_edges() -> np.ndarray:
    rng = np.random.default_rng(4)
    around = [s * ((1 << k) + d) for k in (24, 25, 31, 40, 53, 62) for d in (-1, 0, 1, 3) for s in (1, -1)]
    # ties of the f32 rounding: 2^k + 2^(k-24) (even/odd neighbours), and beyond-tie sticky bits
    ties = [(1 << 40) + (1 << 16) * j for j in (1, 3, 5)] + [(1 << 40) + (1 << 16) + 1, (1 << 40) + (1 << 32) + 1]
    rnd = rng.integers(I64_MIN, I64_MAX, 400, dtype=np.int64, endpoint=True)
    return np.concatenate([np.array(EDGE + around + ties, np.int64), rnd])


def source(ctx, dtype: str):
    """A 1-D tensor of `dtype` with the edge values of its kind (and the values it stored)."""
    if dtype == "bool":
        t = ctx.tensor(np.array([True, False, True, True, False, False, True]), ("n",), dtype="bool")
    elif dtype == "i64":
        t = ctx.tensor(int_edges(), ("n",), dtype="i64")
    else:
        t = ctx.tensor(float_edges(), ("n",), dtype=dtype)
    return t, values_of(t)


# ---- R-10 casts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_cast_every_pair_bitwise(ctx, src, dst):
    t, vals = source(ctx, src)
    out = t.to(dst)
    assert out.dtype == dst and out.tags == t.tags and out.shape == t.shape
    same(storage(out), ref_cast(src, vals, dst))


def test_cast_reference_self_check():
    """The transcriptions agree with numpy where numpy is exact: int64 -> float32 (cvtsi2ss is
    correctly rounded), int64 -> float16 (one rounding either way: |x| >= 2^24 overflows f16)."""
    a = int_edges()
    assert_bitwise(i64_to_f32(a), a.astype(np.float32))
    with np.errstate(all="ignore"):
        assert_bitwise(i64_to_f32(a).astype(np.float16), a.astype(np.float16))


def test_float_to_int_edges(ctx):
    """R-10: truncate toward zero, saturate at the bounds, NaN -> 0 (spelled out)."""
    vals = np.array([2.9, -2.9, 0.5, -0.5, -0.0, np.nan, -np.nan, np.inf, -np.inf, 2.0 ** 63,
                     -(2.0 ** 63), 1e38, -1e38, 9.223371e18, 1e-45], np.float32)
    want = [2, -2, 0, 0, 0, 0, 0, I64_MAX, I64_MIN, I64_MAX, I64_MIN, I64_MAX, I64_MIN,
            9223370937343148032, 0]
    for dt in ("f32", "f16", "bf16"):
        t = ctx.tensor(vals, ("n",), dtype=dt)
        got = t.to("i64").numpy().tolist()
        assert got == [f_to_i64(float(v)) for v in values_of(t)]
        if dt == "f32":
            assert got == want


def test_to_bool_and_back(ctx):
    t = ctx.tensor(np.array([0.0, -0.0, np.nan, 1e-45, -np.inf, 2.0], np.float32), ("n",))
    assert t.to("bool").numpy().tolist() == [False, False, True, True, True, True]
    b = t.to("bool")
    assert b.to("i64").numpy().tolist() == [0, 0, 1, 1, 1, 1]
    for dt in ("f32", "f16", "bf16"):
        assert b.to(dt).numpy().astype(np.float32).tolist() == [0, 0, 1, 1, 1, 1]
    i = ctx.tensor(np.array([0, I64_MIN, -1, 1 << 40], np.int64), ("n",), dtype="i64")
    assert i.to("bool").numpy().tolist() == [False, True, True, True]


def test_bool_bytes_read_by_truthiness(ctx):
    """A bool byte other than 0/1 (written through data()) still casts to exactly 0/1."""
    b = ctx.tensor(np.array([True, False, True]), ("n",), dtype="bool")
    b.data().view(np.uint8)[0] = 7
    assert b.to("i64").numpy().tolist() == [1, 0, 1]
    assert b.to("f32").numpy().tolist() == [1.0, 0.0, 1.0]
    assert b.to("bool").data_const().view(np.uint8).tolist() == [7, 0, 1]  # same dtype: a copy


def test_i64_to_bf16_rounds_through_f32(ctx):
    """i64 -> bf16 is f32_to_bf16(float32(x)) (two roundings, like torch): 2^40 + 2^32 + 1 is a
    hair above a bf16 halfway point, but float32 first rounds it onto the tie, which goes even."""
    x = (1 << 40) + (1 << 32) + 1
    t = ctx.tensor(np.array([x], np.int64), ("n",), dtype="i64")
    assert t.to("bf16").numpy().tolist() == [float(1 << 40)]
    assert torch.tensor([x]).to(torch.bfloat16).float().tolist() == [float(1 << 40)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_same_dtype_is_a_copy(ctx, dtype):
    t, _ = source(ctx, dtype)
    before = storage(t).copy()
    c = t.to(dtype)
    same(storage(c), before)
    t.data()[...] = np.zeros((), t.data().dtype)  # mutating the source leaves the cast alone
    same(storage(c), before)


@pytest.mark.parametrize("src,dst", [("f32", "i64"), ("i64", "f32"), ("f16", "i64"), ("i64", "bf16"),
                                     ("bf16", "bool"), ("bool", "i64"), ("i64", "bool"), ("f32", "f16")])
def test_cast_views_and_threads(ctx1, ctx2, src, dst):
    """Permuted and narrowed sources spanning several 32768-element chunks: same bits on 1 and 2
    threads, and equal to the reference on the view's values."""
    rng = np.random.default_rng(9)
    if src == "i64":
        data = rng.integers(I64_MIN, I64_MAX, (70, 1500), dtype=np.int64, endpoint=True)
    elif src == "bool":
        data = rng.random((70, 1500)) < 0.5
    else:
        data = (rng.standard_normal((70, 1500)) * 10.0 ** rng.integers(-3, 22, (70, 1500))).astype(np.float32)
        data.reshape(-1)[::97] = np.nan
    outs = []
    for ctx in (ctx1, ctx2):
        t = ctx.tensor(data, ("a", "b"), dtype=src)
        v = t.permute(("b", "a")).narrow("a", 3, 60)  # strided on both axes
        out = v.to(dst)
        assert out.tags == ("b", "a") and out.shape == (1500, 60)
        outs.append(storage(out))
        want = ref_cast(src, values_of(v).reshape(-1), dst).reshape(1500, 60)
        same(outs[-1], want)
    same(outs[0], outs[1])


def test_cast_torch_parity(ctx):
    """torch agrees on the defined part of R-10: in-range float -> int, int -> float, bool."""
    f = float_edges()
    f = f[np.isfinite(f) & (np.abs(f) < 9e18)]
    t = ctx.tensor(f, ("n",))
    assert t.to("i64").numpy().tolist() == torch.from_numpy(f).to(torch.int64).tolist()
    assert t.to("bool").numpy().tolist() == torch.from_numpy(f).to(torch.bool).tolist()
    a = int_edges()
    ti = ctx.tensor(a, ("n",), dtype="i64")
    assert_bitwise(ti.to("f32").numpy(), torch.from_numpy(a).to(torch.float32).numpy())
    assert_bitwise(ti.to("f16").numpy(), torch.from_numpy(a).to(torch.float16).numpy())
    assert_bitwise(ti.to("bf16").numpy(), torch.from_numpy(a).to(torch.bfloat16).float().numpy())
    assert ti.to("bool").numpy().tolist() == torch.from_numpy(a).to(torch.bool).tolist()
    finite = float_edges()
    finite = finite[~np.isnan(finite)]  # torch's bf16 NaN is canonical, R-9 keeps the payload
    tb = ctx.tensor(finite, ("n",)).to("bf16")
    assert_bitwise(tb.numpy(), torch.from_numpy(finite).to(torch.bfloat16).float().numpy())


def test_divergence_torch_float_to_int_nan_and_out_of_range(ctx):
    """SPEC R-10 vs torch: torch's float -> int64 of NaN / +-inf / out-of-range values is the C
    cast (undefined behaviour; on x86 the 'integer indefinite' minInt for all of them). Fucina
    saturates and maps NaN to 0. Only our side is asserted."""
    v = np.array([np.nan, np.inf, -np.inf, 1e19, -1e19], np.float32)
    assert ctx.tensor(v, ("n",)).to("i64").numpy().tolist() == [0, I64_MAX, I64_MIN, I64_MAX, I64_MIN]


# ---- casts and gradients ------------------------------------------------------------------------

@pytest.mark.parametrize("mid", ["f32", "f16", "bf16"])
def test_differentiable_casts_pass_the_gradient(ctx, mid):
    x = ctx.variable([1.0, -2.5, 3.25], ("n",))
    w = ctx.tensor([2.0, 3.0, -4.0], ("n",))
    (x.to(mid).to("f32") * w).sum_all().backward()
    g = x.grad()
    assert g.dtype == "f32" and g.numpy().tolist() == [2.0, 3.0, -4.0]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_leaf_widen_gets_f32_gradient(ctx, dtype):
    x = ctx.variable([1.0, -2.5, 3.25], ("n",), dtype=dtype)
    (x.to("f32") * ctx.tensor([2.0, 3.0, -4.0], ("n",))).sum_all().backward()
    g = x.grad()
    assert g.dtype == "f32" and g.numpy().tolist() == [2.0, 3.0, -4.0]


@pytest.mark.parametrize("src,dst", [("f32", "i64"), ("f32", "bool"), ("f16", "bf16"), ("bf16", "f16"),
                                     ("f16", "f16"), ("bf16", "bf16"), ("f16", "i64"), ("bf16", "bool")])
def test_other_casts_of_grad_tensors_raise(ctx, src, dst):
    x = ctx.variable([1.0, 2.0], ("n",), dtype=src)
    with pytest.raises(fu.GradientCastUnsupported):
        x.to(dst)
    with fu.no_grad():
        assert x.to(dst).dtype == dst
    assert x.detach().to(dst).dtype == dst


# ---- R-11 integers ------------------------------------------------------------------------------

def i64(ctx, values, tags=("n",)):
    return ctx.tensor(np.array(values, np.int64), tags, dtype="i64")


def edge_pairs(nonzero_divisor=True):
    xs, ys = [], []
    for x in EDGE:
        for y in EDGE:
            if y != 0 or not nonzero_divisor:
                xs.append(x)
                ys.append(y)
    return xs, ys


def test_int_wrapping_add_sub_mul_neg_max_min(ctx):
    xs, ys = edge_pairs(nonzero_divisor=False)
    x, y = i64(ctx, xs), i64(ctx, ys)
    assert (x + y).numpy().tolist() == [wrap(a + b) for a, b in zip(xs, ys)]
    assert (x - y).numpy().tolist() == [wrap(a - b) for a, b in zip(xs, ys)]
    assert (x * y).numpy().tolist() == [wrap(a * b) for a, b in zip(xs, ys)]
    assert (-x).numpy().tolist() == [wrap(-a) for a in xs]
    assert x.maximum(y).numpy().tolist() == [max(a, b) for a, b in zip(xs, ys)]
    assert x.minimum(y).numpy().tolist() == [min(a, b) for a, b in zip(xs, ys)]
    assert (x * -1).numpy().tolist() == [wrap(-a) for a in xs]
    assert (I64_MAX + x).numpy().tolist() == [wrap(I64_MAX + a) for a in xs]


@pytest.mark.parametrize("op", DIVISIONS)
def test_int_divisions_edge_pairs(ctx, op):
    xs, ys = edge_pairs()
    want = [py_div(op, a, b) for a, b in zip(xs, ys)]
    x, y = i64(ctx, xs), i64(ctx, ys)
    assert getattr(x, op)(y).numpy().tolist() == want
    ex = i64(ctx, EDGE)
    for d in (1, -1, 2, -2, 3, -7, I64_MIN, I64_MAX):  # a Python-int divisor (a kernel parameter)
        assert getattr(ex, op)(d).numpy().tolist() == [py_div(op, a, d) for a in EDGE]


def test_int_division_spec_examples(ctx):
    m = i64(ctx, [I64_MIN])
    assert m.div_trunc(-1).numpy().tolist() == [I64_MIN]  # wraps
    assert m.div_floor(-1).numpy().tolist() == [I64_MIN]
    assert m.rem(-1).numpy().tolist() == [0]
    assert m.mod(-1).numpy().tolist() == [0]
    x, y = i64(ctx, [7, -7, 7, -7]), i64(ctx, [2, 2, -2, -2])
    assert x.div_trunc(y).numpy().tolist() == [3, -3, -3, 3]
    assert x.div_floor(y).numpy().tolist() == [3, -4, -4, 3]
    assert x.rem(y).numpy().tolist() == [1, -1, 1, -1]   # sign of the dividend
    assert x.mod(y).numpy().tolist() == [1, 1, -1, -1]   # sign of the divisor


def test_int_operators_are_python_semantics(ctx):
    xs, ys = edge_pairs()
    x, y = i64(ctx, xs), i64(ctx, ys)
    assert (x // y).numpy().tolist() == [wrap(a // b) for a, b in zip(xs, ys)]
    assert (x % y).numpy().tolist() == [a % b for a, b in zip(xs, ys)]
    nz = [v for v in EDGE if v != 0]
    t = i64(ctx, nz)
    assert (1000 // t).numpy().tolist() == [1000 // v for v in nz]       # reflected
    assert (-1000 % t).numpy().tolist() == [-1000 % v for v in nz]
    assert (I64_MIN // t).numpy().tolist() == [wrap(I64_MIN // v) for v in nz]


def test_int_bitwise(ctx):
    xs, ys = edge_pairs(nonzero_divisor=False)
    x, y = i64(ctx, xs), i64(ctx, ys)
    assert x.bit_and(y).numpy().tolist() == [a & b for a, b in zip(xs, ys)]
    assert x.bit_or(y).numpy().tolist() == [a | b for a, b in zip(xs, ys)]
    assert x.bit_xor(y).numpy().tolist() == [a ^ b for a, b in zip(xs, ys)]
    assert x.bit_and(-256).numpy().tolist() == [a & -256 for a in xs]
    assert x.bit_xor(I64_MIN).numpy().tolist() == [a ^ I64_MIN for a in xs]


def np_div(op, a, b):
    """numpy reference (no zero divisors, no minInt / -1 in the data)."""
    q_floor, m = np.floor_divide(a, b), np.mod(a, b)
    q_trunc = np.where((m != 0) & ((a < 0) != (b < 0)), q_floor + 1, q_floor)
    return {"div_trunc": q_trunc, "div_floor": q_floor, "mod": m, "rem": np.fmod(a, b)}[op]


def random_pairs(shape, seed=5):
    rng = np.random.default_rng(seed)
    a = rng.integers(I64_MIN, I64_MAX, shape, dtype=np.int64, endpoint=True)
    mag = rng.integers(0, 63, shape)
    b = rng.integers(1, 1 << 62, shape, dtype=np.int64) >> mag  # divisors of every size
    b = np.where(b == 0, 1, b) * np.where(rng.random(shape) < 0.5, -1, 1)
    b = np.where((a == I64_MIN) & (b == -1), 1, b)
    return a, b


@pytest.mark.parametrize("op", DIVISIONS)
def test_int_divisions_random_spanning_chunks(ctx, op):
    a, b = random_pairs(3 * CHUNK + 77)
    got = getattr(i64(ctx, a), op)(i64(ctx, b)).numpy()
    assert_bitwise(got, np_div(op, a, b))
    q = i64(ctx, a).div_trunc(i64(ctx, b)).numpy()
    with np.errstate(over="ignore"):  # x == trunc(x / y) * y + rem, and floor likewise with mod
        assert np.array_equal(q * b + i64(ctx, a).rem(i64(ctx, b)).numpy(), a)


@pytest.mark.parametrize("op", DIVISIONS + ("bit_xor",))
def test_int_ops_broadcast_and_views(ctx, op):
    """Every operand role: tail broadcast (unit), column broadcast (zero), a 0-d tensor, a
    transposed (strided) divisor, a narrowed dividend."""
    a, b = random_pairs((40, 300), seed=6)
    ref = (lambda x, y: x ^ y) if op == "bit_xor" else (lambda x, y: np_div(op, x, y))
    x = i64(ctx, a, ("r", "c"))
    f = lambda t, u: getattr(t, op)(u)  # noqa: E731
    assert_bitwise(f(x, i64(ctx, b[0], ("c",))).numpy(), ref(a, b[0][None, :]))
    assert_bitwise(f(x, i64(ctx, b[:, 0], ("r",))).numpy(), ref(a, b[:, :1]))
    assert_bitwise(f(x, i64(ctx, b[3, 4], ())).numpy(), ref(a, b[3, 4]))
    bt = i64(ctx, b.T.copy(), ("c", "r")).permute(("r", "c"))  # a strided view of b
    assert_bitwise(f(x, bt).numpy(), ref(a, b))
    xn = x.narrow("c", 5, 200)
    assert_bitwise(f(xn, bt.narrow("c", 5, 200)).numpy(), ref(a[:, 5:205], b[:, 5:205]))


def test_int_ops_torch_parity(ctx):
    a, b = random_pairs(5000, seed=8)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    x, y = i64(ctx, a), i64(ctx, b)
    assert np.array_equal(x.div_trunc(y).numpy(), torch.div(ta, tb, rounding_mode="trunc").numpy())
    assert np.array_equal(x.div_floor(y).numpy(), torch.div(ta, tb, rounding_mode="floor").numpy())
    assert np.array_equal(x.rem(y).numpy(), torch.fmod(ta, tb).numpy())
    assert np.array_equal(x.mod(y).numpy(), torch.remainder(ta, tb).numpy())
    assert np.array_equal(x.bit_and(y).numpy(), (ta & tb).numpy())
    assert np.array_equal(x.bit_or(y).numpy(), (ta | tb).numpy())
    assert np.array_equal(x.bit_xor(y).numpy(), (ta ^ tb).numpy())
    assert np.array_equal((x * y).numpy(), (ta * tb).numpy())  # torch wraps too
    assert np.array_equal(x.maximum(y).numpy(), torch.maximum(ta, tb).numpy())


def test_divergence_torch_int_true_division_promotes_to_float(ctx):
    """SPEC §7.1 #9: torch's int64 `/` returns float32; Fucina has no integer `/` and names the
    two explicit divisions. (A further divergence, not executed here: torch on CPU dies with
    SIGFPE on minInt // -1; Fucina wraps to minInt.)"""
    a, b = torch.tensor([7, -7]), torch.tensor([2, 2])
    assert (a / b).dtype == torch.float32
    x, y = i64(ctx, [7, -7]), i64(ctx, [2, 2])
    with pytest.raises(fu.DTypeError, match="div_trunc.*div_floor"):
        x / y


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(I64_MIN, I64_MAX), st.integers(I64_MIN, I64_MAX).filter(bool)),
                min_size=1, max_size=40))
def test_int_divisions_property(pairs):
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    with fu.ExecContext(threads=1) as ctx:
        x, y = i64(ctx, xs), i64(ctx, ys)
        for op in DIVISIONS:
            assert getattr(x, op)(y).numpy().tolist() == [py_div(op, a, b) for a, b in zip(xs, ys)]


# ---- zero divisors ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", DIVISIONS)
def test_zero_divisor_raises(ctx, op):
    n = 3 * CHUNK + 5
    a = np.arange(n, dtype=np.int64) - n // 2
    for pos in (0, CHUNK + 7, n - 1):  # the zero in the first, a middle and the last chunk
        b = np.ones(n, np.int64) * 3
        b[pos] = 0
        with pytest.raises(fu.DivisionByZero):
            getattr(i64(ctx, a), op)(i64(ctx, b))
    x = i64(ctx, a)
    with pytest.raises(fu.DivisionByZero):
        getattr(x, op)(0)  # a Python-int divisor
    with pytest.raises(fu.DivisionByZero):
        getattr(x, op)(i64(ctx, 0, ()))  # a 0-d divisor broadcast everywhere
    with pytest.raises(fu.DivisionByZero):
        getattr(i64(ctx, [[5, 6], [7, 8]], ("r", "c")), op)(i64(ctx, [[1, 2], [0, 4]], ("c", "r")).permute(("r", "c")))
    # a zero dividend is fine, and the context keeps working after the error
    assert getattr(i64(ctx, [0, 0]), op)(i64(ctx, [5, -5])).numpy().tolist() == [0, 0]


def test_zero_divisor_reflected_and_operators(ctx):
    t = i64(ctx, [3, 0, 5])
    with pytest.raises(fu.DivisionByZero):
        7 // t
    with pytest.raises(fu.DivisionByZero):
        7 % t
    with pytest.raises(fu.DivisionByZero):
        i64(ctx, [1, 2, 3]) // t
    assert not issubclass(fu.DivisionByZero, TypeError) and issubclass(fu.DivisionByZero, fu.TensorError)


def test_zero_divisor_found_on_both_thread_counts(ctx1, ctx2):
    n = 5 * CHUNK
    for ctx in (ctx1, ctx2):
        b = np.full(n, -2, np.int64)
        b[4 * CHUNK + 1] = 0
        with pytest.raises(fu.DivisionByZero):
            i64(ctx, np.ones(n, np.int64)).div_floor(i64(ctx, b))


def test_shape_errors_come_before_the_divisor_check(ctx):
    x, y = i64(ctx, [1, 2, 3, 4]), i64(ctx, [0, 1, 2])
    with pytest.raises(fu.ShapeMismatch):
        x.div_trunc(y)
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1.0, 2.0], ("n",)).div_trunc(0)


# ---- bad input ----------------------------------------------------------------------------------

def test_int_plain_div_refused(ctx):
    x, y = i64(ctx, [6, 7]), i64(ctx, [2, 3])
    for f in (lambda: x / y, lambda: x / 2, lambda: 2 / x, lambda: x.div(y)):
        with pytest.raises(fu.DTypeError, match="div_trunc") as e:
            f()
        assert "div_floor" in str(e.value) and isinstance(e.value, TypeError)


@pytest.mark.parametrize("op", DIVISIONS + ("bit_and", "bit_or", "bit_xor"))
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "bool"])
def test_integer_only_ops_refuse_other_dtypes(ctx, op, dtype):
    t = ctx.tensor([1.0, 2.0], ("n",), dtype=dtype)
    with pytest.raises(fu.DTypeError):
        getattr(t, op)(t)
    with pytest.raises(fu.DTypeError):
        getattr(t, op)(1)


def test_bool_has_no_arithmetic(ctx):
    b = ctx.tensor([True, False], ("n",), dtype="bool")
    for f in (lambda: b + b, lambda: b - b, lambda: b * b, lambda: b / b, lambda: b * 2,
              lambda: 1 + b, lambda: b.maximum(b), lambda: b.minimum(b), lambda: -b,
              lambda: b ** 2, lambda: b.scale(2.0), lambda: b // b, lambda: b % b):
        with pytest.raises(fu.DTypeError):
            f()
    assert b.to("i64").numpy().tolist() == [1, 0]


def test_int_scalar_and_dtype_mixing_errors(ctx):
    x = i64(ctx, [1, 2])
    with pytest.raises(fu.DTypeError):
        x + 1.5
    with pytest.raises(fu.DTypeError):
        x.div_trunc(1.5)
    with pytest.raises(fu.DTypeError):
        x.div_floor(1 << 64)  # outside i64: never silently wrapped to a (zero) divisor
    with pytest.raises(fu.DTypeError):
        x.bit_and(-(1 << 63) - 1)
    with pytest.raises(TypeError):
        x.mod(True)
    with pytest.raises(fu.DTypeError):
        x.div_trunc(ctx.tensor([1.0, 2.0], ("n",)))
    with pytest.raises(fu.DTypeError):
        x.to("i32")
    with pytest.raises(fu.DTypeError):
        x.pow(x)
    with pytest.raises(fu.DTypeError):
        x.exp()


# ---- f16 / bf16 math: widen -> f32 kernel -> narrow once --------------------------------------

def half_values(dtype, seed):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(2000) * 10.0 ** rng.integers(-6, 6, 2000)).astype(np.float32)
    v[:14] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 6e-8, -6e-8, 65504.0, 3.0, 0.5, 2.0, 1e-40]
    return v


BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "pow")
NP_F32 = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "maximum": np.maximum, "minimum": np.minimum}


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_binary_is_widen_compute_narrow(ctx, dtype, op):
    x = ctx.tensor(half_values(dtype, 1), ("n",), dtype=dtype)
    y = ctx.tensor(np.roll(half_values(dtype, 2), 7), ("n",), dtype=dtype)
    z = getattr(x, op)(y)
    assert z.dtype == dtype
    literal = getattr(x.to("f32"), op)(y.to("f32")).to(dtype)  # cast up, run the f32 op, cast down
    assert_bitwise(storage(z), storage(literal))
    if op in NP_F32:  # and against an independent numpy float32 reference
        with np.errstate(all="ignore"):
            want = f32_to_storage(NP_F32[op](values_of(x), values_of(y)), dtype)
        assert_bitwise(storage(z), want)
    # broadcast roles go through the same path
    row = ctx.tensor(half_values(dtype, 3)[:50], ("c",), dtype=dtype)
    m = ctx.tensor(half_values(dtype, 4)[:400].reshape(8, 50), ("r", "c"), dtype=dtype)
    assert_bitwise(storage(getattr(m, op)(row)),
                   storage(getattr(m.to("f32"), op)(row.to("f32")).to(dtype)))


SCALAR_FORMS = {
    "scale": lambda t: t.scale(1.7), "add_scalar": lambda t: t.add_scalar(-0.3),
    "sub_scalar": lambda t: t.sub_scalar(2.2), "div_scalar": lambda t: t.div_scalar(3.0),
    "pow_scalar": lambda t: t.pow_scalar(2.0), "radd": lambda t: 1.25 + t, "rsub": lambda t: 1.25 - t,
    "rmul": lambda t: 3 * t, "truediv": lambda t: t / 7.0, "rtruediv": lambda t: 7.0 / t,
    "pow": lambda t: t ** 3.0, "rpow": lambda t: 1.5 ** t, "max": lambda t: t.maximum(0.5),
    "min": lambda t: t.minimum(-0.5),
}


@pytest.mark.parametrize("form", list(SCALAR_FORMS))
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_scalar_variants_are_widen_compute_narrow(ctx, dtype, form):
    f = SCALAR_FORMS[form]
    x = ctx.tensor(half_values(dtype, 5), ("n",), dtype=dtype)
    z = f(x)
    assert z.dtype == dtype
    assert_bitwise(storage(z), storage(f(x.to("f32")).to(dtype)))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_math_is_no_grad(ctx, dtype):
    x = ctx.variable([1.0, 2.0], ("n",), dtype=dtype)
    c = ctx.tensor([3.0, 4.0], ("n",), dtype=dtype)
    for f in (lambda: x + c, lambda: c * x, lambda: x.maximum(c), lambda: x ** c, lambda: x / c,
              lambda: x * 2.0, lambda: x.scale(2.0), lambda: 1.0 - x, lambda: x.pow_scalar(2.0)):
        with pytest.raises(fu.UnsupportedGradient):
            f()
    with fu.no_grad():
        assert (x + c).numpy().astype(np.float32).tolist() == [4.0, 6.0]


# ---- thread invariance --------------------------------------------------------------------------

def test_typed_ops_thread_invariant(ctx1, ctx2):
    a, b = random_pairs((3, 40000), seed=11)  # 120000 elements: four chunks
    rng = np.random.default_rng(12)
    f = (rng.standard_normal((3, 40000)) * 1e19).astype(np.float32)
    res = []
    for ctx in (ctx1, ctx2):
        x, y = i64(ctx, a, ("r", "c")), i64(ctx, b, ("r", "c"))
        ft = ctx.tensor(f, ("r", "c"))
        outs = [getattr(x, op)(y) for op in DIVISIONS]
        outs += [x.div_floor(i64(ctx, b[0], ("c",))), x.bit_or(y), x * y]
        outs += [ft.to(d) for d in ("i64", "f16", "bf16", "bool")] + [x.to(d) for d in ("f32", "bf16", "bool")]
        res.append([storage(o) for o in outs])
    for u, v in zip(*res):
        same(u, v)
