"""Reductions against numpy (float64 reference), and bitwise across thread counts."""
import numpy as np
import pytest

import fucina as fu
from fucina.exec.reduce import SEGMENT, SPLIT_AT
from conftest import assert_bitwise

SHAPES = [(7,), (3, 5), (4, 1, 33), (2, 3, 4, 70), (1, 129), (130, 3)]


def tags_of(shape):
    return tuple("abcd"[: len(shape)])


@pytest.mark.parametrize("shape", SHAPES)
def test_axis_reductions(ctx, shape):
    rng = np.random.default_rng(len(shape))
    a = rng.standard_normal(shape).astype(np.float32)
    x = ctx.tensor(a, tags_of(shape))
    for ax, tag in enumerate(x.tags):
        n = shape[ax]
        s = x.sum(tag)
        assert s.tags == tuple(t for t in x.tags if t != tag)
        assert np.abs(s.numpy() - a.astype(np.float64).sum(ax)).max() <= 1e-6 * n
        m = x.mean(tag).numpy()
        assert np.abs(m - a.astype(np.float64).mean(ax)).max() <= 1e-6 * n
        assert_bitwise(x.max(tag).numpy(), a.max(ax))
        assert_bitwise(x.min(tag).numpy(), a.min(ax))


def test_sum_all_and_acceptance(ctx):
    x = ctx.tensor([[1, 2], [3, 4]], ("row", "col"))
    assert x.sum("col").numpy().tolist() == [3, 7]
    assert x.sum_all().item() == 10.0 and x.sum_all().tags == ()
    assert x.mean_all().item() == 2.5


def test_nan_propagates_through_max_min_sum(ctx):
    x = ctx.tensor([[1, np.nan, 3], [4, 5, 6]], ("r", "c"))
    assert np.isnan(x.max("c").numpy()[0]) and x.max("c").numpy()[1] == 6
    assert np.isnan(x.min("r").numpy()[1]) and np.isnan(x.sum_all().item())


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_inputs_reduce_to_f32(ctx, dtype):
    a = np.random.default_rng(3).standard_normal((6, 40)).astype(np.float32)
    x = ctx.tensor(a, ("r", "c"), dtype=dtype)
    s = x.sum("c")
    assert s.dtype == "f32"
    assert_bitwise(s.numpy(), x.to("f32").sum("c").numpy())


@pytest.mark.parametrize("n", [SEGMENT - 1, SEGMENT, SPLIT_AT - 1, SPLIT_AT, SPLIT_AT + 1,
                               5 * SEGMENT + 3, (1 << 20) + 7])
def test_long_axis_bitwise_for_any_thread_count(ctx1, ctx2, n):
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    res = []
    for c in (ctx1, ctx2):
        x = c.tensor(a, ("n",))
        res.append([x.sum_all().numpy(), x.mean("n").numpy(), x.max("n").numpy()])
    for p, q in zip(*res):
        assert_bitwise(p, q)
    assert abs(res[0][0] - a.astype(np.float64).sum()) <= 1e-6 * n


@pytest.mark.parametrize("shape,tag", [((3, SPLIT_AT + 5), "b"), ((SPLIT_AT + 5, 3), "a"),
                                       ((2, 70000, 5), "b"), ((600, 600), "a"), ((600, 600), "b")])
def test_axis_reductions_bitwise_for_any_thread_count(ctx1, ctx2, shape, tag):
    a = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
    outs = [c.tensor(a, tags_of(shape)).sum(tag).numpy() for c in (ctx1, ctx2)]
    assert_bitwise(outs[0], outs[1])
    ax = tags_of(shape).index(tag)
    assert np.abs(outs[0] - a.astype(np.float64).sum(ax)).max() <= 1e-6 * shape[ax]


def test_reduce_of_a_view(ctx):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = ctx.tensor(a, ("r", "c")).permute(("c", "r"))
    assert_bitwise(x.sum("r").numpy(), a.sum(0))
    assert_bitwise(x.narrow("c", 1, 2).sum("c").numpy(), a[:, 1:3].sum(1))


def test_reduce_errors(ctx):
    x = ctx.tensor([[1, 2]], ("r", "c"))
    with pytest.raises(fu.TagError, match="'q'"):
        x.sum("q")
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1, 2], ("n",), dtype="i64").max("n")
