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


# ---- transposed operands: register tiles -----------------------------------------------------
# When an input's stride-1 axis is not the output's, the kernel walks V x V register tiles
# (codegen.elementwise._build_tiled). Each case below is checked against numpy and bit for bit
# against the in-order kernel that served these layouts before (tiles switched off).

from fucina.codegen.elementwise import BLOCK, TILE  # noqa: E402
from fucina.exec import elementwise as ew  # noqa: E402

STORE = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16, "i64": np.int64, "bool": np.uint8}


def raw_random(ctx, rng, shape, dtype):
    """A contiguous raw tensor of random storage bits: every NaN payload, subnormal and
    infinity of a float format (i64: the full range; bool: 0/1)."""
    t = ctx.empty(tuple(shape), dtype)
    n = int(np.prod(shape))
    st = STORE[dtype]
    if dtype == "bool":
        vals = rng.integers(0, 2, n, dtype=st)
    else:
        vals = rng.integers(np.iinfo(st).min, np.iinfo(st).max, n, dtype=st, endpoint=True)
    np.frombuffer(t.buf, st, count=n)[:] = vals
    return t


def raw_normal(ctx, rng, shape, dtype="f32"):
    """Normal values with the special values sprinkled in (for ops checked against numpy)."""
    a = rng.standard_normal(shape).astype(np.float32).ravel()
    a[rng.integers(0, a.size, a.size // 8)] = rng.choice(SPECIALS, a.size // 8)
    return ctx.from_numpy(a.reshape(shape), None, dtype)


def storage_bits(raw):
    a = np.ascontiguousarray(raw.storage_view())
    return a.view({8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[a.itemsize])


def check_tiled(monkeypatch, fn, want, payloads=True, walk="_tile_axes"):
    """fn() -> a raw result: equal to numpy's `want` (NaNs alike) and, bit for bit, to the
    in-order kernel's result (the `walk` planner switched off: the tiles, or _walk_order's
    reordered axes), NaN payloads included unless `payloads` is False: from two NaN operands
    x86 returns the first source's payload, and LLVM may commute an fadd, so which one comes
    out is the instruction selector's choice in any kernel."""
    got = fn()
    assert_bitwise(got.to_numpy(), want)
    with monkeypatch.context() as m:
        m.setattr(ew, walk, lambda shape, strides: None)
        m.setattr(ew, "_plans", {})
        m.setattr(ew, "_runs", {})
        ref = fn()
    same = storage_bits(got) == storage_bits(ref)
    if not payloads and got.dtype != "i64":
        same |= np.isnan(got.to_numpy()) & np.isnan(ref.to_numpy())
    assert same.all(), f"{(~same).sum()} elements differ from the in-order kernel"
    return got


def key_roles(op, out_dtype, shape, operands, out=None):
    k = ew.key_of(op, out_dtype, shape, operands, out)
    return k.out_role, k.roles


SOURCES = [(1, 7), (7, 300), (16, 16), (17, 33), (33, 17), (1023, 17), (65, 130), (130, 1023)]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i64", "bool"])
@pytest.mark.parametrize("rows,cols", SOURCES)
def test_transposed_copy_every_dtype(ctx, monkeypatch, dtype, rows, cols):
    """materialize of a transposed [rows, cols]: tiles when the source rows are >= TILE long."""
    rng = np.random.default_rng(rows * cols)
    src = raw_random(ctx, rng, (rows, cols), dtype)
    x = src.permute((1, 0))
    walk = ("linear", ("unit",)) if rows == 1 else ("tile", ("trans",)) if cols >= TILE \
        else ("linear", ("strided",))
    assert key_roles("copy", dtype, x.shape, [x]) == walk
    got = check_tiled(monkeypatch, lambda: ew.materialize(ctx, x), x.to_numpy())
    if dtype in ("f32", "i64", "bool"):  # a plain copy: every bit, NaN payloads too
        assert np.array_equal(storage_bits(got), storage_bits(src).T)


@pytest.mark.parametrize("src_dt,dst_dt", [("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"),
                                           ("f16", "f32"), ("bf16", "f16"), ("f32", "i64"),
                                           ("i64", "f32"), ("f32", "bool"), ("bool", "bf16")])
def test_transposed_cast(ctx, monkeypatch, src_dt, dst_dt):
    """to(dtype) of a transposed view equals the cast of its contiguous copy (the linear walk)."""
    rng = np.random.default_rng(8)
    for rows, cols in [(33, 17), (65, 130)]:
        src = raw_random(ctx, rng, (rows, cols), src_dt)
        if src_dt == "f32" and dst_dt == "i64":  # in range: the saturation is not the point here
            src = raw_normal(ctx, rng, (rows, cols))
        x = src.permute((1, 0))
        assert ew.key_of("copy", dst_dt, x.shape, [x]).out_role == "tile"
        flat = ctx.empty(x.shape, src_dt)  # x's storage bits in order, copied by numpy
        np.frombuffer(flat.buf, STORE[src_dt], count=x.numel)[:] = storage_bits(x).ravel()
        want = ew.cast(ctx, flat, dst_dt).to_numpy()
        check_tiled(monkeypatch, lambda: ew.cast(ctx, x, dst_dt), want)


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_with_transposed_operands(ctx, monkeypatch, op):
    """Every tile role against numpy: unit, trans, zero along B (a column), zero along A (a
    row), and a by-value scalar, at sizes with partial tiles and several chunks."""
    rng = np.random.default_rng(9)
    for R, C in [(37, 45), (130, 67)]:
        a = raw_normal(ctx, rng, (R, C))
        bt = raw_normal(ctx, rng, (C, R)).permute((1, 0))       # [R, C], stride-1 along R
        ct = raw_normal(ctx, rng, (C, R)).permute((1, 0))
        col = raw_normal(ctx, rng, (R, 1)).view((R, C), (1, 0))  # one value per row
        row = raw_normal(ctx, rng, (1, C)).view((R, C), (0, 1))  # one value per column
        cases = [((a, bt), ("unit", "trans")), ((bt, a), ("trans", "unit")),
                 ((bt, ct), ("trans", "trans")), ((bt, col), ("trans", "zero")),
                 ((row, bt), ("unit", "trans")), ((bt, 0.75), ("trans", "param"))]
        for operands, roles in cases:
            assert key_roles(op, "f32", (R, C), operands) == ("tile", roles)
            with np.errstate(all="ignore"):
                want = BINARY[op](*[x.to_numpy() if isinstance(x, fu.exec.RawTensor) else np.float32(x)
                                    for x in operands]).astype(np.float32)
            check_tiled(monkeypatch, lambda: ew.run(ctx, op, "f32", (R, C), operands), want, False)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "i64"])
def test_binary_transposed_other_dtypes(ctx, monkeypatch, dtype):
    rng = np.random.default_rng(10)
    a = raw_random(ctx, rng, (40, 50), dtype)
    bt = raw_random(ctx, rng, (50, 40), dtype).permute((1, 0))
    assert key_roles("add", dtype, (40, 50), (a, bt))[0] == "tile"
    if dtype == "i64":
        with np.errstate(all="ignore"):
            want = a.to_numpy() + bt.to_numpy()
    else:  # widen, add in f32, narrow: the same op on contiguous operands
        want = ew.run(ctx, "add", dtype, (40, 50), (a, ew.materialize(ctx, bt))).to_numpy()
    check_tiled(monkeypatch, lambda: ew.run(ctx, "add", dtype, (40, 50), (a, bt)), want, False)


def test_permutes_3d_4d(ctx, monkeypatch):
    """Every permutation of a 3-D and a 4-D tensor (each walk: in order, or tiles with outer
    axes and axes merged around the tile plane), f32 and bf16, through Tensor.permute."""
    import itertools

    rng = np.random.default_rng(11)
    for shape in [(33, 5, 20), (2, 17, 3, 20)]:
        tags = tuple("abcd"[:len(shape)])
        for dtype in ("f32", "bf16"):
            a = rng.standard_normal(shape).astype(np.float32)
            t = ctx.tensor(a, tags, dtype=dtype)
            ref = t.numpy()
            for perm in itertools.permutations(range(len(shape))):
                x = t.permute(tuple(tags[p] for p in perm))
                got = check_tiled(monkeypatch, lambda: ew.materialize(ctx, x._raw),
                                  np.transpose(ref, perm))
                assert got.is_contiguous()


def test_tile_roles_mixed_in_one_kernel(ctx, monkeypatch):
    """where(cond, x, y) over [i, j, k] with x stride-1 along i and y along j: tiles of the
    (i, k) plane with j outside, cond a unit operand (bool), y read element by element."""
    rng = np.random.default_rng(12)
    I, J, K = 20, 3, 18
    c = raw_random(ctx, rng, (I, J, K), "bool")
    x = raw_normal(ctx, rng, (K, J, I)).permute((2, 1, 0))
    y = raw_normal(ctx, rng, (I, K, J)).permute((0, 2, 1))
    assert ew.key_of("where", "f32", (I, J, K), (c, x, y)).roles == ("unit", "trans", "strided")
    want = np.where(c.to_numpy(), x.to_numpy(), y.to_numpy())
    check_tiled(monkeypatch, lambda: ew.run(ctx, "where", "f32", (I, J, K), (c, x, y)), want)
    col = raw_normal(ctx, rng, (I, J, 1)).view((I, J, K), (J, 1, 0))  # stride 0 along k: zero
    assert ew.key_of("add", "f32", (I, J, K), (x, col)).roles == ("trans", "zero")
    check_tiled(monkeypatch, lambda: ew.run(ctx, "add", "f32", (I, J, K), (x, col)),
                x.to_numpy() + col.to_numpy(), False)


def test_tiles_fall_back_when_their_arguments_do_not_fit(ctx):
    """A rank-6 where() of three unmergeable operands: the tiled argument block (output strides
    included) would exceed the launch's MAX_ARGS ints, so the in-order walk serves it."""
    from fucina.runtime import MAX_ARGS

    rng = np.random.default_rng(15)
    shape = (17, 2, 3, 2, 3, 5)
    x = raw_normal(ctx, rng, shape[::-1]).permute((5, 4, 3, 2, 1, 0))  # stride 1 along axis 0

    def padded(dtype):  # every axis one longer, then narrowed: no two axes merge
        big = raw_random(ctx, rng, tuple(d + 1 for d in shape), dtype)
        return big.view(shape, big.strides)

    c, y = padded("bool"), padded("f32")
    k = ew.key_of("where", "f32", shape, (c, x, y))
    assert (k.out_role, k.rank) == ("linear", 6)
    assert 1 + 3 + 6 * (1 + 4) > MAX_ARGS
    got = ew.run(ctx, "where", "f32", shape, (c, x, y)).to_numpy()
    assert_bitwise(got, np.where(c.to_numpy(), x.to_numpy(), y.to_numpy()))


def test_transposed_destination(ctx, monkeypatch):
    """out= a transposed view: the tile plane follows the output's stride-1 axis; in place
    (out also an input, as einsum's accumulate does) reads each element before writing it."""
    rng = np.random.default_rng(13)
    R, C = 45, 70
    src = raw_normal(ctx, rng, (R, C))
    dst_t = ctx.empty((C, R))
    dst = dst_t.permute((1, 0))  # [R, C] with stride 1 along R
    assert key_roles("copy", "f32", (R, C), [src], out=dst) == ("tile", ("trans",))
    check_tiled(monkeypatch, lambda: ew.run(ctx, "copy", "f32", (R, C), [src], out=dst), src.to_numpy())
    before = dst.to_numpy()
    ew.run(ctx, "add", "f32", (R, C), (dst, src), out=dst)
    with np.errstate(all="ignore"):
        want = before + src.to_numpy()
    assert_bitwise(dst.to_numpy(), want)
    assert_bitwise(dst_t.to_numpy(), want.T)


def test_tiles_need_a_full_tile_along_the_read_axis(ctx):
    """Shorter than TILE along the input's stride-1 axis, the in-order walk stays: each line it
    reads is reused by the next outputs."""
    for n in (2, TILE - 1):
        x = ctx.empty((4096, n)).permute((1, 0))
        assert key_roles("copy", "f32", x.shape, [x]) == ("linear", ("strided",))
    x = ctx.empty((4096, TILE)).permute((1, 0))
    assert key_roles("copy", "f32", x.shape, [x]) == ("tile", ("trans",))
    q = ctx.empty((64, 16, 128)).permute((1, 0, 2))  # [seq, head, d] -> [head, seq, d]: rows of d
    assert key_roles("copy", "f32", q.shape, [q]) == ("linear", ("unit",))


def test_row_streams_of_a_walk():
    """_streams counts the rows an operand is fed from at once: a [seq, head, d] source walked
    in [head, seq, d] order jumps a page per row (seq of them); walked in its own order the
    [head, seq, d] result is written as head sequential streams; broadcast axes open none."""
    S, H, D = 1024, 16, 64
    assert ew._streams((H, S, D), (D, H * D, 1), D) == S
    assert ew._streams((S, H, D), (H * D, D, 1), D) == 1
    assert ew._streams((S, H, D), (D, S * D, 1), D) == H
    assert ew._streams((S, H, D), (0, S * D, 1), D) == H
    assert ew._walk_order((H, S, D), [(D, H * D, 1), (S * D, D, 1)]) == (1, 0, 2)
    assert ew._walk_order((S, H, D), [(D, S * D, 1), (H * D, D, 1)]) is None
    assert ew._walk_order((H, S, 8), [(8, H * 8, 1), (S * 8, 8, 1)]) is None  # short rows


def check_walk(monkeypatch, fn, want):
    return check_tiled(monkeypatch, fn, want, walk="_walk_order")


def test_walk_follows_the_input_when_the_output_order_scatters_its_rows(ctx, monkeypatch):
    """A [seq, head, d] copied into [head, seq, d] walks the source in order (the output
    written as head streams), a [head, seq, d] merged into [seq, head·d] keeps the output's
    order; 4-D and 5-D permutes, a two-operand add with a broadcast, a cast and an out= view
    reorder the same way; every result is numpy's and the output-order walk's, bit for bit."""
    rng = np.random.default_rng(21)
    S, H, D = 300, 6, 40
    q = raw_normal(ctx, rng, (S, H, D))
    qv = q.permute((1, 0, 2))
    assert key_roles("copy", "f32", qv.shape, [qv]) == ("unit", ("unit",))
    check_walk(monkeypatch, lambda: ew.materialize(ctx, qv), q.to_numpy().transpose(1, 0, 2))
    o = raw_normal(ctx, rng, (H, S, D)).permute((1, 0, 2))
    assert key_roles("copy", "f32", o.shape, [o]) == ("linear", ("unit",))
    check_walk(monkeypatch, lambda: ew.materialize(ctx, o), o.to_numpy())
    b4 = raw_normal(ctx, rng, (3, S, 2, D))
    for perm, role in [((1, 0, 2, 3), "linear"), ((2, 1, 0, 3), "unit"), ((0, 2, 1, 3), "unit")]:
        v = b4.permute(perm)
        assert key_roles("copy", "f32", v.shape, [v])[0] == role
        check_walk(monkeypatch, lambda: ew.materialize(ctx, v), b4.to_numpy().transpose(perm))
    b5 = raw_normal(ctx, rng, (2, 90, 2, 3, 24))
    v5 = b5.permute((3, 1, 2, 0, 4))
    assert key_roles("copy", "f32", v5.shape, [v5])[0] == "unit"
    check_walk(monkeypatch, lambda: ew.materialize(ctx, v5), b5.to_numpy().transpose(3, 1, 2, 0, 4))
    bias = raw_normal(ctx, rng, (1, S, D)).view((H, S, D), (0, D, 1))  # broadcast over heads
    assert key_roles("add", "f32", qv.shape, (qv, bias)) == ("unit", ("unit", "unit"))
    with np.errstate(all="ignore"):
        want = qv.to_numpy() + bias.to_numpy()
    check_walk(monkeypatch, lambda: ew.run(ctx, "add", "f32", qv.shape, (qv, bias)), want)
    check_walk(monkeypatch, lambda: ew.cast(ctx, qv, "bf16"), ew.cast(ctx, q, "bf16").to_numpy()
               .transpose(1, 0, 2))
    dst = ctx.empty((H, S, D))
    check_walk(monkeypatch, lambda: ew.run(ctx, "copy", "f32", qv.shape, [qv], out=dst),
               qv.to_numpy())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_tiled_thread_count_never_changes_bits(ctx1, ctx2, dtype):
    rng = np.random.default_rng(14)
    R, C = 1000, 3 * BLOCK + 5
    a = rng.standard_normal((C, R)).astype(np.float32)
    b = rng.standard_normal((R, C)).astype(np.float32)
    outs = []
    for c in (ctx1, ctx2):
        x = c.tensor(a, ("c", "r"), dtype=dtype).permute(("r", "c"))
        y = c.tensor(b, ("r", "c"), dtype=dtype)
        assert ew.key_of("add", dtype, (R, C), (y._raw, x._raw)).out_role == "tile"
        _, chunks, cost, _ = ew.plan_of("add", dtype, (R, C), (y._raw, x._raw))
        assert c.threads == 1 or c.team_for(chunks, cost) is not None  # really split at 2
        outs.append([x.contiguous().data_const().copy(), (y + x).data_const().copy(),
                     x.to("f32" if dtype == "bf16" else "bf16").data_const().copy()])
    for p, q in zip(*outs):
        assert np.array_equal(p.view(np.uint8), q.view(np.uint8))
    want = ctx1.tensor(a, ("c", "r"), dtype=dtype).data_const().T  # a copy moves bits unchanged
    assert np.array_equal(outs[0][0], want)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "i64", "bool"])
def test_streaming_stores_give_the_same_bits(ctx1, ctx2, monkeypatch, dtype):
    """A fresh result larger than the last-level cache is written with non-temporal stores; with
    the threshold lowered, small results take that path: same bits as the cached stores, at 1
    and 2 threads, with a tail that is not a whole vector and more than one chunk."""
    n = 3 * ew.CHUNK + 37
    rng = np.random.default_rng(11)
    a_np, b_np = rng.standard_normal((2, n)).astype(np.float32)
    op, out_dtype = ("cmp_gt", "bool") if dtype == "bool" else ("add", dtype)

    def run(ctx):
        a, b = ctx.tensor(a_np, ("n",)), ctx.tensor(b_np, ("n",))
        if dtype in ("bf16", "i64"):
            a, b = a.to(dtype), b.to(dtype)
        r = a.compare("gt", b) if dtype == "bool" else a + b
        return ew.key_of(op, out_dtype, (n,), [a._raw, b._raw]), r.numpy()

    key, plain = run(ctx1)
    assert not key.stream
    monkeypatch.setattr(ew, "_plans", {})
    monkeypatch.setattr(ew, "_runs", {})
    monkeypatch.setattr(ew, "STREAM_BYTES", 1024)
    for ctx in (ctx1, ctx2):
        key, got = run(ctx)
        assert key.stream
        assert_bitwise(got, plain)
