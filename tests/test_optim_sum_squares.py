"""sum_squares (SPEC T-7): the generated kernel against a numpy transcription of the exact f64
accumulation order (bitwise), against a plain f64 sum (close), for f32/f16/bf16, every tail
length, several chunks, and at 1 and 2 threads (bitwise equal)."""
import numpy as np
import pytest

import fucina as fu
from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

RNG = np.random.default_rng(7)
CHUNK = 1 << 15


def ref_chunk(c: np.ndarray) -> float:
    """One chunk in the T-7 order: acc_j (4 f64 lanes) += w² for elements 4j..4j+3 of each step
    of 16; remaining groups of 4 into acc0; (acc0+acc1)+(acc2+acc3); ((a0+a1)+a2)+a3; then the
    scalar tail. np.cumsum is a strictly sequential sum, so [-1] is the serial accumulation."""
    c = c.astype(np.float64)
    n = len(c)
    big, full = n - n % 16, n - n % 4
    acc = np.zeros((4, 4))
    if big:
        steps = c[:big].reshape(-1, 4, 4) ** 2            # [step, j, lane]
        acc = np.cumsum(np.concatenate([acc[None], steps]), axis=0)[-1]
    if full > big:
        groups = c[big:full].reshape(-1, 4) ** 2
        acc[0] = np.cumsum(np.concatenate([acc[0][None], groups]), axis=0)[-1]
    a = (acc[0] + acc[1]) + (acc[2] + acc[3])
    total = ((a[0] + a[1]) + a[2]) + a[3]
    for w in c[full:]:
        total += w * w
    return float(total)


def ref_sum_squares(x: np.ndarray) -> float:
    """Chunk partials over the fixed 2^15 grid, summed serially in chunk order."""
    x = x.reshape(-1)
    total = 0.0
    for s in range(0, len(x), CHUNK):
        total += ref_chunk(x[s:s + CHUNK])
    return total


def _data(n, dtype):
    a = (RNG.standard_normal(n) * RNG.uniform(0.1, 100)).astype(np.float32)
    if dtype == "f16":
        return a.astype(np.float16).astype(np.float32), a.astype(np.float16)
    if dtype == "bf16":
        bits = f32_to_bf16_bits(a)
        return bf16_bits_to_f32(bits), a
    return a, a


SIZES = [1, 2, 3, 4, 5, 15, 16, 17, 19, 20, 31, 32, 33, 35, 63, 64, 100, 1000, CHUNK - 1, CHUNK,
         CHUNK + 1, CHUNK + 19, 3 * CHUNK + 7, 200_000]


@pytest.mark.parametrize("n", SIZES)
def test_exact_order_f32(ctx, n):
    widened, a = _data(n, "f32")
    got = fu.optim.sum_squares(ctx.tensor(a, ("i",)))
    assert got == ref_sum_squares(widened)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 16, 37, CHUNK + 5, 70_001])
def test_exact_order_16bit(ctx, dtype, n):
    widened, a = _data(n, dtype)
    src = a if dtype == "f16" else a.astype(np.float32)
    got = fu.optim.sum_squares(ctx.tensor(src, ("i",), dtype=dtype))
    assert got == ref_sum_squares(widened)


@pytest.mark.parametrize("n", [5, 1000, 3 * CHUNK + 3])
def test_close_to_a_plain_sum(ctx, n):
    a = RNG.standard_normal(n).astype(np.float32)
    got = fu.optim.sum_squares(ctx.tensor(a, ("i",)))
    want = float(np.sum(a.astype(np.float64) ** 2))
    assert got == pytest.approx(want, rel=1e-13)


def test_shapes_and_views(ctx):
    a = RNG.standard_normal((37, 129)).astype(np.float32)
    x = ctx.tensor(a, ("r", "c"))
    assert fu.optim.sum_squares(x) == ref_sum_squares(a)
    # a non-contiguous view is materialised (row-major order) first
    assert fu.optim.sum_squares(x.permute(("c", "r"))) == ref_sum_squares(np.ascontiguousarray(a.T))
    assert fu.optim.sum_squares(ctx.tensor(2.5, ())) == 6.25


def test_special_values(ctx):
    a = np.array([1.0, np.inf, 2.0], np.float32)
    assert fu.optim.sum_squares(ctx.tensor(a, ("i",))) == np.inf
    a = np.array([1.0, np.nan] + [1.0] * 40, np.float32)
    assert np.isnan(fu.optim.sum_squares(ctx.tensor(a, ("i",))))
    big = np.full(64, 3e38, np.float32)  # f64 accumulation does not overflow where f32 would
    assert fu.optim.sum_squares(ctx.tensor(big, ("i",))) == pytest.approx(64 * 9e76, rel=1e-6)


def test_thread_invariance(ctx1, ctx2):
    a = RNG.standard_normal(5 * CHUNK + 11).astype(np.float32)
    v1 = fu.optim.sum_squares(ctx1.tensor(a, ("i",)))
    v2 = fu.optim.sum_squares(ctx2.tensor(a, ("i",)))
    assert v1 == v2 == ref_sum_squares(a)


def test_many_tensors_fold_in_order(ctx1, ctx2):
    """The chunks of all the tensors of one dtype go in one launch (a table of chunks); with
    the dtypes interleaved, every tensor's partials still land in its own slots and fold in
    order, at 1 and 2 threads. Empty tensors have no chunks (the f16 group has one that is not
    empty; a group of only empty ones launches nothing)."""
    from fucina.exec import optim as xo

    cases = [(3, "f32"), (CHUNK + 1, "bf16"), (17, "f32"), (2 * CHUNK, "f16"), (0, "f32"),
             (CHUNK + 19, "f32"), (5, "bf16"), (0, "f16"), (0, "f16")]
    data = [_data(n, dt) for n, dt in cases]
    want = [ref_sum_squares(v) for v, _ in data]
    acc = 0.0
    for w in want:
        acc += w
    for ctx in (ctx1, ctx2):
        raws = [ctx.tensor(a, ("i",), dtype=dt)._raw for (_, a), (_, dt) in zip(data, cases)]
        each, total = xo.sum_squares_many(ctx, raws)
        assert each == want
        assert total == acc
        empty = [ctx.tensor(np.zeros(0, np.float32), ("i",))._raw for _ in range(2)]
        assert xo.sum_squares_many(ctx, empty) == ([0.0, 0.0], 0.0)


def test_scaling_many_tensors_is_one_rounded_multiply(ctx1, ctx2):
    """A clip's scaling (one launch over a table of chunks) multiplies each element by
    f32(factor), one rounding: numpy's f32 product, bitwise, at 1 and 2 threads."""
    from fucina.exec import optim as xo

    arrays = [RNG.standard_normal(n).astype(np.float32) for n in (1, 33, CHUNK + 7, 0, 3 * CHUNK)]
    for ctx in (ctx1, ctx2):
        raws = [ctx.tensor(a, ("i",))._raw for a in arrays]
        xo.scale_many(raws, 0.3)
        for r, a in zip(raws, arrays):
            got = r.to_numpy()
            assert got.view(np.uint32).tolist() == (a * np.float32(0.3)).view(np.uint32).tolist()


def test_errors(ctx):
    with pytest.raises(fu.DTypeError, match="sum_squares"):
        fu.optim.sum_squares(ctx.tensor([1, 2], ("i",), dtype="i64"))
    with pytest.raises(TypeError, match="sum_squares"):
        fu.optim.sum_squares(np.ones(3, np.float32))
