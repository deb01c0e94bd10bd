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


# ---------------------------------------------------------------------------------------------
# SPEC §3.8 + R-11: the rest of the reduction family

import math

import torch

from fucina.codegen.reduce import BLOCK
from conftest import bits


def _t(a, grad=False):
    return torch.tensor(np.asarray(a, np.float32), requires_grad=grad)


def test_spec_acceptances(ctx):
    x = ctx.tensor([[1, 2], [3, 4]], ("row", "col"))
    assert x.sum("col").numpy().tolist() == [3, 7]
    assert x.variance("col", 0).numpy().tolist() == [0.25, 0.25]
    assert x.variance("col", ddof=0).tags == ("row",)
    assert x.sum_all().item() == 10.0
    v = ctx.variable([[1, 2, 3], [4, 5, 6]], ("r", "c"))
    m = ctx.tensor([[True, False, True], [False, True, False]], ("r", "c"), dtype="bool")
    s = v.sum("c", mask=m)
    assert s.numpy().tolist() == [4, 5]
    assert v.mean("c", mask=m).numpy().tolist() == [2, 5]
    s.sum_all().backward()
    assert v.grad().numpy().reshape(-1).tolist() == [1, 0, 1, 0, 1, 0]


# ---- sum_many ---------------------------------------------------------------------------------

def test_sum_many_innermost_first_and_grad(ctx):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    x = ctx.variable(a, ("a", "b", "c", "d"))
    s = x.sum_many(("b", "d"))
    assert s.tags == ("a", "c")
    # innermost first: d, then b — bitwise the sequential sums
    assert_bitwise(s.numpy(), x.sum("d").sum("b").numpy())
    assert np.abs(s.numpy() - a.astype(np.float64).sum((1, 3))).max() <= 1e-6 * 24
    assert_bitwise(x.sum_many(("d", "b")).numpy(), s.numpy())
    w = rng.standard_normal((3, 5)).astype(np.float32)
    (s * ctx.tensor(w, ("a", "c"))).sum_all().backward()
    ta = _t(a, True)
    (ta.sum((1, 3)) * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert x.sum_many(("a", "b", "c", "d")).tags == ()
    with pytest.raises(fu.TagError):
        x.sum_many(("b", "q"))
    with pytest.raises(fu.TagError):
        x.sum_many(("b", "b"))


# ---- prod -------------------------------------------------------------------------------------

def test_prod_values_and_grad_rules(ctx):
    # rows: zero-free, exactly one zero, two zeros, a negative zero
    a = np.array([[1.5, -2.0, 0.5, 3.0], [2.0, 0.0, -1.5, 4.0], [0.0, 3.0, 0.0, 2.0],
                  [2.0, -0.0, 1.0, 0.5]], np.float32)
    x = ctx.variable(a, ("r", "c"))
    p = x.prod("c")
    np.testing.assert_array_equal(p.numpy(), np.prod(a.astype(np.float64), 1).astype(np.float32))
    w = np.array([0.5, -1.0, 2.0, 1.5], np.float32)
    (p * ctx.tensor(w, ("r",))).sum_all().backward()
    ta = _t(a, True)
    (ta.prod(1) * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    g = x.grad().numpy()
    assert g[1].tolist() == [0, 2.0 * -1.5 * 4.0 * -1.0, 0, 0]  # whole g·Π(others) to the zero
    assert g[2].tolist() == [0, 0, 0, 0]                          # two zeros: no gradient
    x.zero_grad()
    assert fu.gradcheck(lambda v: (v.prod("c") * ctx.tensor(w, ("r",))).sum_all(), [x]).checked == 16
    # over the outer axis
    b = np.random.default_rng(2).uniform(0.5, 1.5, (6, 5)).astype(np.float32)
    b[2, 1] = 0.0
    y = ctx.variable(b, ("r", "c"))
    y.prod("r").sum_all().backward()
    tb = _t(b, True)
    tb.prod(0).sum().backward()
    np.testing.assert_allclose(y.grad().numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [7, 1000, SPLIT_AT + 3])
def test_prod_long_axis(ctx1, ctx2, n):
    a = np.random.default_rng(n).uniform(0.999, 1.001, n).astype(np.float32)
    outs = [c.tensor(a, ("n",)).prod("n").item() for c in (ctx1, ctx2)]
    assert bits(np.float32(outs[0])) == bits(np.float32(outs[1]))
    assert abs(outs[0] - np.prod(a.astype(np.float64))) <= 1e-6 * n * abs(outs[0])


# ---- variance ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 33, 2), (130, 3), (1, 1)])
@pytest.mark.parametrize("ddof", [0, 1])
def test_variance_values_and_grad(ctx, shape, ddof):
    rng = np.random.default_rng(len(shape) + ddof)
    a = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    tags = tags_of(shape)
    x = ctx.variable(a, tags)
    for ax, tag in enumerate(tags):
        n = shape[ax]
        v = x.variance(tag, ddof)
        want = a.astype(np.float64).var(ax, ddof=ddof) if n > ddof else np.full(v.shape, np.nan)
        got = v.numpy()
        assert got.dtype == np.float32
        if n > ddof:
            assert np.abs(got - want).max() <= 1e-6 * n * max(1.0, np.abs(want).max())
        else:
            assert np.isnan(got).all()  # n - ddof == 0: 0/0, like torch
        if n <= ddof:
            continue
        w = rng.standard_normal(v.shape).astype(np.float32)
        x.zero_grad()
        (v * ctx.tensor(w, v.tags)).sum_all().backward()
        ta = _t(a, True)
        (ta.var(ax, correction=ddof) * torch.from_numpy(w)).sum().backward()
        np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_variance_gradcheck_and_errors(ctx):
    a = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    x = ctx.variable(a, ("r", "c"))
    assert fu.gradcheck(lambda v: (v.variance("c", 1) * v.variance("r", 0).sum_all()).sum_all(), [x]).checked == 12
    for bad in (2, -1, 0.5, True, "1", None):
        with pytest.raises(ValueError):
            x.variance("c", bad)
    with pytest.raises(TypeError):
        x.variance("c")  # ddof is required
    with pytest.raises(fu.TagError):
        x.variance("q", 0)
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1, 2], ("n",), dtype="i64").variance("n", 0)


@pytest.mark.parametrize("n", [SEGMENT, SPLIT_AT + 1, 3 * SEGMENT + 17])
def test_variance_long_axis_bitwise_for_any_thread_count(ctx1, ctx2, n):
    a = (np.random.default_rng(n).standard_normal(n) + 10).astype(np.float32)
    outs = [c.tensor(a, ("n",)).variance("n", 1).item() for c in (ctx1, ctx2)]
    assert bits(np.float32(outs[0])) == bits(np.float32(outs[1]))
    assert abs(outs[0] - a.astype(np.float64).var(ddof=1)) <= 1e-6 * n


# ---- typed reductions (R-11) ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_prod_variance_norm_return_f32(ctx, dtype):
    a = np.random.default_rng(5).uniform(0.5, 1.5, (5, 40)).astype(np.float32)
    x = ctx.tensor(a, ("r", "c"), dtype=dtype)
    w = x.to("f32")
    for f in (lambda t: t.prod("c"), lambda t: t.variance("c", 1), lambda t: t.norm("c", "l2"),
              lambda t: t.max("r"), lambda t: t.mean("c")):
        r = f(x)
        assert r.dtype == "f32"
        assert_bitwise(r.numpy(), f(w).numpy())
    h = ctx.variable(a, ("r", "c"), dtype=dtype)
    with pytest.raises(fu.UnsupportedGradient):
        h.variance("c", 0)


def test_integer_and_bool_sums(ctx):
    a = np.array([[1, -2, 3], [1 << 62, 1 << 62, 5]], np.int64)
    x = ctx.tensor(a, ("r", "c"), dtype="i64")
    s = x.sum("c")
    assert s.dtype == "i64"
    with np.errstate(over="ignore"):
        assert s.numpy().tolist() == a.sum(1).tolist()  # wraps like int64
    assert x.sum("r").numpy().tolist() == [1 + (1 << 62), -2 + (1 << 62), 8]
    t = x.sum_all()
    assert t.dtype == "i64" and t.tags == ()
    with np.errstate(over="ignore"):
        assert t.item() == int(a.sum())
    assert isinstance(t.item(), int)
    # the counting idiom
    xf = ctx.tensor([-1.0, 0.0, 2.0], ("n",))
    neg = xf.compare("lt", 0.0)
    assert neg.dtype == "bool"
    c = neg.sum_all()
    assert c.dtype == "i64" and c.item() == 1 and isinstance(c.item(), int)
    m = ctx.tensor(np.random.default_rng(1).random((70, 300)) < 0.3, ("a", "b"), dtype="bool")
    assert m.sum("b").dtype == "i64"
    assert m.sum("b").numpy().tolist() == m.numpy().sum(1).tolist()
    assert m.sum("a").numpy().tolist() == m.numpy().sum(0).tolist()
    assert m.sum_all().item() == int(m.numpy().sum())
    assert m.sum_many(("a", "b")).item() == int(m.numpy().sum())
    big = np.random.default_rng(2).random(SPLIT_AT + 9) < 0.5
    assert ctx.tensor(big, ("n",), dtype="bool").sum_all().item() == int(big.sum())
    bi = np.random.default_rng(3).integers(-1000, 1000, SPLIT_AT + 9)
    assert ctx.tensor(bi, ("n",), dtype="i64").sum_all().item() == int(bi.sum())
    for t in (x, m):
        with pytest.raises(fu.DTypeError):
            t.mean(t.tags[0])
        with pytest.raises(fu.DTypeError):
            t.mean_all()
        with pytest.raises(fu.DTypeError):
            t.prod(t.tags[0])
        with pytest.raises(fu.DTypeError):
            t.max(t.tags[0])
        with pytest.raises(fu.DTypeError):
            t.cumsum(t.tags[0])
        with pytest.raises(fu.DTypeError):
            t.norm(t.tags[0], "l1")


# ---- masked reductions --------------------------------------------------------------------------

def _masked_ref(a, m, op, axis):
    a64 = a.astype(np.float64)
    if op == "sum":
        return np.where(m, a64, 0).sum(axis)
    if op == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(m, a64, 0).sum(axis) / m.sum(axis)
    if op == "max":
        return np.where(m, a64, -np.inf).max(axis)
    return np.where(m, a64, np.inf).min(axis)


@pytest.mark.parametrize("shape", [(3, 5), (4, 1, 33), (130, 3), (2, 70)])
@pytest.mark.parametrize("mdtype", ["bool", "f32"])
def test_masked_reductions_values(ctx, shape, mdtype):
    rng = np.random.default_rng(sum(shape))
    a = rng.standard_normal(shape).astype(np.float32)
    mb = rng.random(shape) < 0.5
    mb[0] = False  # at least one empty lane on every axis but the first
    tags = tags_of(shape)
    x = ctx.tensor(a, tags)
    mv = mb if mdtype == "bool" else np.where(mb, rng.choice([1.0, -2.0, np.nan], shape), 0.0)
    m = ctx.tensor(mv, tags, dtype=mdtype)
    notm = ctx.tensor(~mb, tags, dtype="bool")
    for ax, tag in enumerate(tags):
        s = x.sum(tag, mask=m)
        # excluded elements contribute the identity: bitwise masked_fill(~mask, 0).sum
        assert_bitwise(s.numpy(), x.masked_fill(notm, 0.0).sum(tag).numpy())
        for op in ("sum", "mean", "max", "min"):
            got = getattr(x, op)(tag, mask=m).numpy()
            want = _masked_ref(a, mb, op, ax)
            assert np.array_equal(np.isnan(got), np.isnan(want))
            ok = np.isfinite(want)
            assert np.all(np.abs(got[ok] - want[ok]) <= 1e-6 * shape[ax])
            assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
            if op in ("max", "min"):
                assert_bitwise(got, want.astype(np.float32))
            e = getattr(x, op)(tag, mask=m, empty=7.5).numpy()
            empty = mb.sum(ax) == 0
            assert (e[empty] == 7.5).all() and np.array_equal(e[~empty], got[~empty])


def test_masked_identities_and_empty(ctx):
    x = ctx.tensor([[1.0, 2.0], [3.0, 4.0]], ("r", "c"))
    m = ctx.tensor([[False, False], [True, False]], ("r", "c"), dtype="bool")
    assert x.sum("c", mask=m).numpy().tolist() == [0.0, 3.0]
    assert x.max("c", mask=m).numpy().tolist() == [-math.inf, 3.0]
    assert x.min("c", mask=m).numpy().tolist() == [math.inf, 3.0]
    mean = x.mean("c", mask=m).numpy()
    assert math.isnan(mean[0]) and mean[1] == 3.0
    assert x.mean("c", mask=m, empty=0.0).numpy().tolist() == [0.0, 3.0]
    assert x.sum("c", mask=m, empty=-1).numpy().tolist() == [-1.0, 3.0]
    i = ctx.tensor([[1, 2], [3, 4]], ("r", "c"), dtype="i64")
    si = i.sum("c", mask=m, empty=-5)
    assert si.dtype == "i64" and si.numpy().tolist() == [-5, 3]
    # a mask is read by truthiness: NaN counts as selected
    fm = ctx.tensor([[np.nan, 0.0], [0.0, -0.0]], ("r", "c"))
    assert x.sum("c", mask=fm).numpy().tolist() == [1.0, 0.0]
    # unmasked: `empty` never applies (no lane is empty)
    assert x.mean("c", empty=9.0).numpy().tolist() == [1.5, 3.5]


def test_masked_gradients(ctx):
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4, 6)).astype(np.float32)
    a[1, 4] = a[1, 1]  # a tie among selected elements: the first selected one wins
    mb = rng.random((4, 6)) < 0.6
    mb[1, [1, 4]] = True
    mb[1, 0] = True
    a[1, 0] = 100.0
    mb[1, 0] = False   # an excluded larger element never receives the gradient
    a[1, 1] = a[1, 4] = 50.0
    mb[3] = False      # an empty lane
    w = rng.standard_normal(4).astype(np.float32)
    for op in ("sum", "mean", "max", "min"):
        x = ctx.variable(a, ("r", "c"))
        m = ctx.tensor(mb, ("r", "c"), dtype="bool")
        (getattr(x, op)("c", mask=m, empty=0.0) * ctx.tensor(w, ("r",))).sum_all().backward()
        ta = _t(a, True)
        tm = torch.from_numpy(mb)
        if op == "sum":
            r = torch.where(tm, ta, 0.0).sum(1)
        elif op == "mean":
            r = torch.where(tm, ta, 0.0).sum(1) / tm.sum(1).clamp(min=1)
        elif op == "max":
            r = torch.where(tm, ta, -math.inf).max(1).values
        else:
            r = torch.where(tm, ta, math.inf).min(1).values
        (torch.where(tm.any(1), r, 0.0) * torch.from_numpy(w)).sum().backward()
        g = x.grad().numpy()
        np.testing.assert_allclose(g, ta.grad.numpy(), rtol=1e-5, atol=1e-6)
        assert (g[3] == 0).all() and (g[~mb] == 0).all()  # empty lanes and excluded: no grad
        if op == "max":
            assert g[1].tolist() == [0, w[1], 0, 0, 0, 0]
        if op in ("sum", "mean"):
            assert fu.gradcheck(lambda v: (getattr(v, op)("c", mask=m, empty=0.0)
                                           * ctx.tensor(w, ("r",))).sum_all(), [x]).checked == 24


def test_masked_errors(ctx):
    x = ctx.tensor(np.zeros((2, 3), np.float32), ("r", "c"))
    with pytest.raises(fu.ShapeMismatch):
        x.sum("c", mask=ctx.tensor(np.ones((3, 2), bool), ("c", "r"), dtype="bool"))
    with pytest.raises(fu.ShapeMismatch):
        x.sum("c", mask=ctx.tensor(np.ones((2, 2), bool), ("r", "c"), dtype="bool"))
    with pytest.raises(fu.ShapeMismatch):
        x.max("c", mask=ctx.tensor(np.ones(3, bool), ("c",), dtype="bool"))
    with pytest.raises(fu.DTypeError):
        x.sum("c", mask=ctx.tensor(np.ones((2, 3), np.int64), ("r", "c"), dtype="i64"))
    with pytest.raises(fu.TagError):
        x.sum("q", mask=ctx.tensor(np.ones((2, 3), bool), ("r", "c"), dtype="bool"))
    with pytest.raises(TypeError):
        x.sum("c", mask=np.ones((2, 3), bool))
    with pytest.raises(TypeError):
        x.sum("c", mask=ctx.tensor(np.ones((2, 3), bool), ("r", "c"), dtype="bool"), empty="x")


@pytest.mark.parametrize("shape,tag", [((SPLIT_AT + 5,), "a"), ((3, SPLIT_AT + 5), "b"),
                                       ((600, 70), "a"), ((5, BLOCK + 7), "a")])
def test_masked_bitwise_for_any_thread_count(ctx1, ctx2, shape, tag):
    rng = np.random.default_rng(21)
    a = rng.standard_normal(shape).astype(np.float32)
    mb = rng.random(shape) < 0.7
    outs = []
    for c in (ctx1, ctx2):
        x, m = c.tensor(a, tags_of(shape)), c.tensor(mb, tags_of(shape), dtype="bool")
        outs.append([x.sum(tag, mask=m).numpy(), x.mean(tag, mask=m).numpy(),
                     x.max(tag, mask=m).numpy(), x.masked_fill(c.tensor(~mb, tags_of(shape), dtype="bool"),
                                                              0.0).sum(tag).numpy()])
    for p, q in zip(*outs):
        assert_bitwise(p, q)
    assert_bitwise(outs[0][0], outs[0][3])


# ---- norms --------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["l1", "l2", "inf"])
def test_norm_values_and_grads(ctx, order):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    a[2, 3] = 0.0
    p = {"l1": 1, "l2": 2, "inf": math.inf}[order]
    x = ctx.variable(a, ("r", "c"))
    with fu.no_grad():
        for ax, tag in enumerate(("r", "c")):
            got = x.norm(tag, order).numpy()
            want = np.linalg.norm(a.astype(np.float64), ord=p, axis=ax)
            assert np.abs(got - want).max() <= 1e-6 * a.shape[ax] * max(1, want.max())
        assert abs(x.norm_all(order).item() - np.linalg.norm(a.astype(np.float64).ravel(), ord=p)) <= 1e-4
    w = rng.standard_normal(5).astype(np.float32)
    with ctx.exec_scope():
        ((x.norm("c", order) * ctx.tensor(w, ("r",))).sum_all() + x.norm_all(order)).backward()
    ta = _t(a, True)
    ((torch.linalg.vector_norm(ta, p, dim=1) * torch.from_numpy(w)).sum()
     + torch.linalg.vector_norm(ta, p)).backward()
    np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    x.zero_grad()
    assert fu.gradcheck(lambda v: (v.norm("r", order) * v.norm_all(order)).sum_all(), [x]).checked == 35


def test_norm_scope_rule_and_errors(ctx):
    x = ctx.variable([[3.0, -4.0]], ("r", "c"))
    with pytest.raises(fu.ActiveExecScopeRequired):
        x.norm("c", "l2")
    with pytest.raises(fu.ActiveExecScopeRequired):
        x.norm_all("l1")
    with fu.no_grad():  # no-grad use works unscoped
        assert x.norm("c", "l2").numpy().tolist() == [5.0]
    assert ctx.tensor([[3.0, -4.0]], ("r", "c")).norm_all("inf").item() == 4.0
    with ctx.exec_scope():
        assert x.norm("c", "l1").numpy().tolist() == [7.0]
        for bad in ("l3", 3, "L2", None, True):
            with pytest.raises(ValueError):
                x.norm("c", bad)
        with pytest.raises(fu.TagError):
            x.norm("q", "l2")


def test_norm_l2_grad_at_zero_is_nan(ctx):
    """SPEC §3.8: like torch.sqrt((x*x).sum()); torch.linalg.vector_norm returns 0 instead
    (divergence, see the module note below)."""
    x = ctx.variable([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0]], ("r", "c"))
    with ctx.exec_scope():
        x.norm("c", "l2").sum_all().backward()
    g = x.grad().numpy()
    assert np.isnan(g[0]).all()
    np.testing.assert_allclose(g[1], [1 / 3, 2 / 3, 2 / 3], rtol=1e-6)
    t = torch.zeros(3, requires_grad=True)
    torch.sqrt((t * t).sum()).backward()
    assert torch.isnan(t.grad).all()


def test_divergence_norm_inf_tie_goes_to_first(ctx):
    """Divergence (SPEC §7.1 candidate): the inf-norm's gradient goes to the first |x| maximum
    (max of abs, first occurrence) — torch.linalg.vector_norm splits it among the ties."""
    x = ctx.variable([1.0, -3.0, 3.0], ("n",))
    with ctx.exec_scope():
        x.norm_all("inf").backward()
    assert x.grad().numpy().tolist() == [0.0, -1.0, 0.0]
    t = torch.tensor([1.0, -3.0, 3.0], requires_grad=True)
    torch.linalg.vector_norm(t, math.inf).backward()
    assert t.grad.tolist() == [0.0, -0.5, 0.5]


# ---- segment_sum --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,axis,offsets", [
    ((10,), 0, [0, 3, 3, 10]), ((4, 10), 1, [0, 0, 1, 10, 10]), ((10, 3), 0, [0, 5, 10]),
    ((2, 9, 33), 1, [0, 2, 4, 9]), ((5, 40), 1, [0, 40])])
def test_segment_sum(ctx, shape, axis, offsets):
    rng = np.random.default_rng(len(offsets))
    a = rng.standard_normal(shape).astype(np.float32)
    tags = tags_of(shape)
    x = ctx.variable(a, tags)
    s = x.segment_sum(tags[axis], offsets)
    assert s.tags == tags and s.shape[axis] == len(offsets) - 1
    want = np.stack([np.take(a.astype(np.float64), range(offsets[k], offsets[k + 1]), axis).sum(axis)
                     for k in range(len(offsets) - 1)], axis)
    assert np.abs(s.numpy() - want).max() <= 1e-6 * shape[axis]
    w = rng.standard_normal(s.shape).astype(np.float32)
    (s * ctx.tensor(w, tags)).sum_all().backward()
    seg = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    np.testing.assert_array_equal(x.grad().numpy(), np.take(w, seg, axis))
    if axis == 0:
        ta = _t(a, True)
        tr = torch.segment_reduce(ta, "sum", offsets=torch.tensor(offsets), axis=0)
        np.testing.assert_allclose(s.numpy(), tr.detach().numpy(), rtol=1e-5, atol=1e-6)
        (tr * torch.from_numpy(w)).sum().backward()
        np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy())
    x.zero_grad()
    # the loss is linear in x: a wide step loses nothing to curvature and keeps the f32
    # rounding of a loss of ~500 terms (its sum order follows the vector width) far below
    # the tolerance (eps 1e-3 left AVX2's rounding at 1.5e-3 on one element)
    assert fu.gradcheck(lambda v: (v.segment_sum(tags[axis], offsets) * ctx.tensor(w, tags)).sum_all(),
                        [x], eps=1e-2).checked == a.size


def test_segment_sum_inputs_and_errors(ctx):
    x = ctx.tensor(np.arange(6, dtype=np.float32), ("n",))
    assert x.segment_sum("n", np.array([0, 2, 6])).numpy().tolist() == [1.0, 14.0]
    off = ctx.tensor([0, 1, 6], ("k",), dtype="i64")
    assert x.segment_sum("n", off).numpy().tolist() == [0.0, 15.0]
    for bad in ([0, 7], [1, 6], [0, 4, 2, 6], [0], [], [0.0, 6.0], [[0, 6]]):
        with pytest.raises(fu.InvalidShape):
            x.segment_sum("n", bad)
    with pytest.raises(fu.TagError):
        x.segment_sum("q", [0, 6])


def test_segment_sum_bitwise_for_any_thread_count(ctx1, ctx2):
    n = 3 * SPLIT_AT + 11
    a = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    offs = [0, 5, SPLIT_AT, SPLIT_AT, 2 * SPLIT_AT + 3, n]
    outs = [c.tensor(a, ("n",)).segment_sum("n", offs).numpy() for c in (ctx1, ctx2)]
    assert_bitwise(outs[0], outs[1])
    b = np.random.default_rng(6).standard_normal((3000, 40)).astype(np.float32)
    offs = list(range(0, 3001, 7)) + [3000]
    outs = [c.tensor(b, ("a", "b")).segment_sum("a", offs).numpy() for c in (ctx1, ctx2)]
    assert_bitwise(outs[0], outs[1])


@pytest.mark.parametrize("shape,tag", [((SPLIT_AT + 1,), "a"), ((3, SPLIT_AT - 1), "b"),
                                       ((3, SPLIT_AT + 5), "b"), ((SPLIT_AT + 5, 3), "a"),
                                       ((2, 70000, 5), "b"), ((7, BLOCK + 7), "a"),
                                       ((5, 2 * BLOCK + 1), "b")])
def test_every_reduction_bitwise_for_any_thread_count(ctx1, ctx2, shape, tag):
    """The accumulation order is fixed by the size: 1 and 2 threads give the same bits at
    sizes around the segment length, the split threshold and the outer column block."""
    rng = np.random.default_rng(31)
    a = rng.uniform(0.9, 1.1, shape).astype(np.float32) * rng.choice([1, -1], shape).astype(np.float32)
    mb = rng.random(shape) < 0.8
    tags = tags_of(shape)
    other = [t for t in tags if t != tag]
    outs = []
    for c in (ctx1, ctx2):
        x, m = c.tensor(a, tags), c.tensor(mb, tags, dtype="bool")
        with fu.no_grad():
            r = [x.prod(tag), x.variance(tag, 0), x.variance(tag, 1), x.mean(tag, mask=m),
                 x.max(tag, mask=m), x.min(tag, mask=m), x.sum(tag, mask=m), m.sum(tag),
                 x.norm(tag, "l1"), x.norm(tag, "l2"), x.norm(tag, "inf"), x.norm_all("l2"),
                 x.sum_many(tuple(other) + (tag,)), x.sum_all(), x.mean_all()]
        outs.append([t.numpy() for t in r])
    for p, q in zip(*outs):
        assert_bitwise(p, q)
    ax = tags.index(tag)
    n = shape[ax]
    assert np.abs(outs[0][1] - a.astype(np.float64).var(ax)).max() <= 1e-6 * n
    assert np.abs(outs[0][6] - np.where(mb, a.astype(np.float64), 0).sum(ax)).max() <= 1e-6 * n
    assert np.abs(outs[0][9] - np.sqrt((a.astype(np.float64) ** 2).sum(ax))).max() <= 1e-6 * n


def test_more_gradchecks(ctx):
    rng = np.random.default_rng(12)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    x = ctx.variable(a, ("a", "b", "c"))
    w = ctx.tensor(rng.standard_normal(4).astype(np.float32), ("b",))
    assert fu.gradcheck(lambda v: (v.sum_many(("a", "c")) * w).sum_all(), [x]).checked == 60
    m = ctx.tensor(rng.random((3, 4, 5)) < 0.5, ("a", "b", "c"), dtype="bool")
    for op in ("max", "min"):
        assert fu.gradcheck(lambda v: (getattr(v, op)("c", mask=m, empty=0.0) * w).sum_all(),
                            [x]).checked == 60


@pytest.mark.parametrize("shape,axis", [((5, 37), 1), ((64, SPLIT_AT + 3), 1), ((3, SPLIT_AT - 1), 1),
                                        ((1, 1), 1), ((40, 129), 1)])
def test_fused_variance_equals_the_two_pass_form(ctx, shape, axis):
    """An unsplit inner lane computes μ and Σ(x − μ)² in one kernel; the bits are those of the
    mean launch followed by the deviation launch."""
    from fucina.exec import reduce as red

    a = (np.random.default_rng(3).standard_normal(shape) + 5).astype(np.float32)
    r = ctx.tensor(a, tags_of(shape))._raw
    fused, mu = red.variance(ctx, r, axis, 1)
    assert mu is None  # these shapes take the fused path
    mu = red.reduce_axis(ctx, "sum", r, axis, mean=True)
    two = red.reduce_axis(ctx, "sum", r, axis, pre="dev2", centre=mu, post="div",
                          divisor=float(shape[axis] - 1))
    assert_bitwise(fused.to_numpy(), two.to_numpy())
