"""Elementwise kernels against numpy: every op, every layout class, 1 and 2 threads."""
import numpy as np
import pytest

import fucina as fu
from fucina.exec.elementwise import CHUNK
from conftest import assert_bitwise, ulp_diff

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38,
                     1.5, -2.5, 1e-38], np.float32)


def torch_maximum(a, b):
    """torch.maximum: NaN wins, and on a tie (+0 vs -0) the first operand (numpy takes the second)."""
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.where(a >= b, a, b))


def torch_minimum(a, b):
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), np.where(a <= b, a, b))


BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "maximum": torch_maximum, "minimum": torch_minimum,
}


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def layouts(rng):
    """(name, left array+tags, right array+tags, numpy right broadcast) per layout class."""
    a = rand(rng, 5, 37)
    yield "contiguous", (a, ("r", "c")), (rand(rng, 5, 37), ("r", "c"))
    yield "scalar", (a, ("r", "c")), (rand(rng, 1), ("c",))
    yield "tail_broadcast", (a, ("r", "c")), (rand(rng, 37), ("c",))
    yield "column", (a, ("r", "c")), (rand(rng, 5), ("r",))
    yield "outer", (rand(rng, 5), ("r",)), (rand(rng, 37), ("c",))


def np_align(arr, tags, out_tags):
    """numpy twin of tag broadcasting: insert size-1 axes for the tags the operand lacks."""
    order = [tags.index(t) for t in out_tags if t in tags]
    arr = np.transpose(arr, order)
    shape, it = [], iter(arr.shape)
    for t in out_tags:
        shape.append(next(it) if t in tags else 1)
    return arr.reshape(shape)


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_every_layout_bitwise(ctx, op):
    rng = np.random.default_rng(1)
    for name, (a, ta), (b, tb) in layouts(rng):
        x, y = ctx.tensor(a, ta), ctx.tensor(b, tb)
        out = getattr(x, op)(y)
        want_tags = ta + tuple(t for t in tb if t not in ta)
        assert out.tags == want_tags, name
        with np.errstate(all="ignore"):
            want = BINARY[op](np_align(a, ta, want_tags), np_align(b, tb, want_tags))
        assert_bitwise(out.numpy(), want.astype(np.float32))


def test_binary_transposed_operand(ctx):
    """An ARBITRARY (strided) operand: tags in the other order force a transposed walk."""
    rng = np.random.default_rng(2)
    a, b = rand(rng, 33, 19), rand(rng, 19, 33)
    x, y = ctx.tensor(a, ("i", "j")), ctx.tensor(b, ("j", "i"))
    assert ctx.classify(y.permute(("i", "j"))) == fu.LayoutClass.ARBITRARY
    assert_bitwise((x - y).numpy(), a - b.T)
    assert_bitwise((y.permute(("i", "j")) * 3.0).numpy(), b.T * np.float32(3.0))


def test_layout_classes(ctx):
    x = ctx.tensor(np.ones((4, 8), np.float32), ("a", "b"))
    bias = ctx.tensor(np.ones(8, np.float32), ("b",))
    assert ctx.classify(x) == fu.LayoutClass.CONTIGUOUS
    assert ctx.classify(ctx.tensor([2.0], ("a",))) == fu.LayoutClass.SCALAR
    raw = bias._raw.view((4, 8), (0, 1))
    assert raw.layout_class() == fu.LayoutClass.TAIL_BROADCAST
    assert x.narrow("b", 1, 3)._raw.layout_class() == fu.LayoutClass.ARBITRARY


@pytest.mark.parametrize("op", ["maximum", "minimum", "add", "sub", "mul", "div"])
def test_binary_special_values(ctx, op):
    a, b = np.meshgrid(SPECIALS, SPECIALS)
    a, b = a.ravel().copy(), b.ravel().copy()
    got = getattr(ctx.tensor(a, ("n",)), op)(ctx.tensor(b, ("n",))).numpy()
    with np.errstate(all="ignore"):
        want = BINARY[op](a, b)
    assert_bitwise(got, want)


def test_maximum_matches_torch_on_signed_zeros(ctx):
    import torch
    a, b = np.array([-0.0, 0.0, np.nan, 1], np.float32), np.array([0.0, -0.0, 1, np.nan], np.float32)
    x, y = ctx.tensor(a, ("n",)), ctx.tensor(b, ("n",))
    assert_bitwise(x.maximum(y).numpy(), torch.maximum(torch.from_numpy(a), torch.from_numpy(b)).numpy())
    assert_bitwise(x.minimum(y).numpy(), torch.minimum(torch.from_numpy(a), torch.from_numpy(b)).numpy())


def test_maximum_nan_wins_both_sides(ctx):
    x = ctx.tensor([np.nan, 1.0, 2.0], ("n",))
    y = ctx.tensor([1.0, np.nan, 1.0], ("n",))
    assert np.isnan(x.maximum(y).numpy()[:2]).all() and np.isnan(x.minimum(y).numpy()[:2]).all()


def test_pow_within_two_ulp_and_domain(ctx):
    rng = np.random.default_rng(3)
    base = np.abs(rand(rng, 20000)) * 4
    expo = rand(rng, 20000) * 6
    got = ctx.tensor(base, ("n",)).pow(ctx.tensor(expo, ("n",))).numpy()
    want = np.power(base.astype(np.float64), expo.astype(np.float64))
    ok = np.isfinite(want) & (np.abs(want) > 1e-37) & (np.abs(want) < 3e38)
    assert ulp_diff(got[ok], want[ok]).max() <= 1.0
    a, b = np.meshgrid(SPECIALS, np.array([0, -0.0, 1, -1, 2, 3, -3, 0.5, np.inf, -np.inf, np.nan, 2.5],
                                          np.float32))
    a, b = a.ravel().copy(), b.ravel().copy()
    got = ctx.tensor(a, ("n",)).pow(ctx.tensor(b, ("n",))).numpy()
    with np.errstate(all="ignore"):
        want = np.power(a, b)
    finite = np.isfinite(want) & (want != 0)
    assert ulp_diff(got[finite], want[finite].astype(np.float64)).max() <= 2.0
    assert_bitwise(got[~finite], want[~finite])  # zeros, infinities, NaNs: exact


def test_scalar_variants_and_acceptance(ctx):
    x = ctx.tensor([3.0, 4.0], ("n",))
    assert x.add_scalar(1).pow_scalar(2).scale(0.5).numpy().tolist() == [8.0, 12.5]
    a = np.array([1.5, -2.0, 7.0], np.float32)
    t = ctx.tensor(a, ("n",))
    assert_bitwise(t.scale(0.1).numpy(), a * np.float32(0.1))
    assert_bitwise(t.add_scalar(0.1).numpy(), a + np.float32(0.1))
    assert_bitwise(t.sub_scalar(0.1).numpy(), a - np.float32(0.1))
    assert_bitwise(t.div_scalar(3.0).numpy(), a * (np.float32(1) / np.float32(3)))
    assert_bitwise((2.0 - t).numpy(), np.float32(2) - a)
    assert_bitwise((2.0 / t).numpy(), np.float32(2) / a)
    assert_bitwise((t / 2).numpy(), a / np.float32(2))
    assert_bitwise((-t).numpy(), -a)
    with pytest.raises(TypeError):
        t.scale("2")
    with pytest.raises(TypeError):
        t + "x"


def test_acceptance_broadcast_by_name(ctx):
    x = ctx.tensor([[1, 2], [3, 4]], ("row", "col"))
    b = ctx.tensor([10, 20], ("col",))
    assert (x + b).numpy().ravel().tolist() == [11, 22, 13, 24]
    d = ctx.tensor([1, 2], ("d",))
    bd = ctx.tensor([[1, 2], [3, 4], [5, 6]], ("batch", "d"))
    assert (d + bd).tags == ("d", "batch")


@pytest.mark.parametrize("op", ["relu", "neg", "sqrt"])
def test_exact_unary_bitwise(ctx, op):
    rng = np.random.default_rng(4)
    a = np.concatenate([rand(rng, 1000) * 10, SPECIALS])
    got = getattr(ctx.tensor(a, ("n",)), op)().numpy()
    with np.errstate(all="ignore"):
        want = {"relu": lambda v: np.where(v > 0, v, np.float32(0)), "neg": np.negative,
                "sqrt": np.sqrt}[op](a).astype(np.float32)
    assert_bitwise(got, want)


@pytest.mark.parametrize("op,ref,lo,hi", [
    ("exp", np.exp, -87, 88), ("log", np.log, 1e-30, 1e30),
    ("tanh", np.tanh, -12, 12), ("sigmoid", lambda v: 1 / (1 + np.exp(-v)), -80, 80)])
def test_transcendental_unary_ulp(ctx, op, ref, lo, hi):
    rng = np.random.default_rng(5)
    if op == "log":
        a = np.exp(rng.uniform(np.log(lo), np.log(hi), 50000)).astype(np.float32)
    else:
        a = rng.uniform(lo, hi, 50000).astype(np.float32)
    got = getattr(ctx.tensor(a, ("n",)), op)().numpy()
    want = ref(a.astype(np.float64))
    assert ulp_diff(got, want).max() <= 2.0
    s = getattr(ctx.tensor(SPECIALS, ("n",)), op)().numpy()
    with np.errstate(all="ignore"):
        w64 = ref(SPECIALS.astype(np.float64))
    w = w64.astype(np.float32)
    assert (np.isnan(s) == np.isnan(w)).all()
    edge = np.isinf(w) | (w == 0)  # infinities and zeros must come out exactly
    assert np.array_equal(s[edge], w[edge])
    rest = ~np.isnan(w) & ~edge
    assert ulp_diff(s[rest], w64[rest]).max() <= 2.0


@pytest.mark.parametrize("n", [1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_thread_count_never_changes_bits(ctx1, ctx2, n):
    rng = np.random.default_rng(n)
    a, b = rand(rng, n), rand(rng, n)
    outs = []
    for c in (ctx1, ctx2):
        x, y = c.tensor(a, ("n",)), c.tensor(b, ("n",))
        outs.append([(x + y).numpy(), x.exp().numpy(), x.tanh().numpy(), (x * 0.5).numpy(),
                     x.pow(y).numpy(), x.to("bf16").numpy()])
    for p, q in zip(*outs):
        assert_bitwise(p, q)
    assert_bitwise(outs[0][0], a + b)


def test_multi_axis_chunks_cross_rows(ctx):
    """Chunks start mid-row: the carried multi-index must stay right across chunk edges."""
    rng = np.random.default_rng(6)
    a = rand(rng, 3, 7, CHUNK // 7 + 5)
    bias = rand(rng, 7, 1)[:, 0]
    x, b = ctx.tensor(a, ("a", "b", "c")), ctx.tensor(bias, ("b",))
    assert_bitwise((x * b).numpy(), a * bias[None, :, None])
    xt = x.permute(("c", "a", "b"))
    assert_bitwise((xt + 1.0).numpy(), np.transpose(a, (2, 0, 1)) + np.float32(1))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_math_is_widen_compute_narrow(ctx, dtype):
    rng = np.random.default_rng(7)
    a, b = rand(rng, 300), rand(rng, 300)
    x, y = ctx.tensor(a, ("n",), dtype=dtype), ctx.tensor(b, ("n",), dtype=dtype)
    z = x + y
    assert z.dtype == dtype
    want = (x.to("f32") + y.to("f32")).to(dtype)
    assert_bitwise(z.data_const(), want.data_const())


def test_integer_ops(ctx):
    big = np.iinfo(np.int64).max
    a = np.array([1, -5, big, 7], np.int64)
    b = np.array([2, 3, 1, -7], np.int64)
    x, y = ctx.tensor(a, ("n",), dtype="i64"), ctx.tensor(b, ("n",), dtype="i64")
    with np.errstate(all="ignore"):
        assert np.array_equal((x + y).numpy(), a + b)  # wraps at the top
        assert np.array_equal((x * y).numpy(), a * b)
    assert np.array_equal((x - y).numpy(), a - b)
    assert np.array_equal(x.maximum(y).numpy(), np.maximum(a, b))
    assert np.array_equal((x + 3).numpy(), a + 3)
    with pytest.raises(fu.DTypeError):
        x / y
    with pytest.raises(fu.DTypeError):
        x + 1.5
    with pytest.raises(fu.DTypeError):
        x + ctx.tensor([1.0, 2, 3, 4], ("n",))
