"""Scans (SPEC §3.8): cumsum, cumprod, linear_recurrence — exactly serial, so compared bitwise
against float32 serial references (np.add.accumulate / np.multiply.accumulate are serial
float32 loops, checked below against a plain Python loop), and bitwise across thread counts."""

import numpy as np
import pytest
import torch

import fucina as fu
from fucina.codegen.scan import BLOCK
from fucina.codegen.target import host
from conftest import assert_bitwise

W = host().f32_lanes  # inner scans walk W x W tiles: sizes around multiples of W matter


def tags_of(shape):
    return tuple("abcd"[: len(shape)])


def _t(a, grad=False):
    return torch.tensor(np.asarray(a, np.float32), requires_grad=grad)


def serial(op, a, axis, reverse=False):
    """The float32 serial scan along `axis` (reverse: from the end)."""
    ufunc = np.add if op == "cumsum" else np.multiply
    with np.errstate(invalid="ignore", over="ignore"):
        if reverse:
            return np.flip(ufunc.accumulate(np.flip(a, axis), axis=axis), axis)
        return ufunc.accumulate(a, axis=axis)


def linrec_ref(a, b, axis, init=None):
    """h[t] = a[t] * h[t-1] + b[t] in float32, multiply then add, serial over t."""
    a, b = np.moveaxis(a, axis, 0), np.moveaxis(b, axis, 0)
    h = np.zeros(b.shape[1:], np.float32) if init is None else init.astype(np.float32)
    out = np.empty_like(b)
    for t in range(b.shape[0]):
        h = (a[t] * h).astype(np.float32) + b[t]
        out[t] = h
    return np.moveaxis(out, 0, axis)


def test_numpy_accumulate_is_a_serial_float32_loop():
    a = (np.random.default_rng(0).standard_normal(5000) * 1e3).astype(np.float32)
    ref = np.empty_like(a)
    s = np.float32(0)
    for i, v in enumerate(a):
        s = v if i == 0 else np.float32(s + v)
        ref[i] = s
    assert_bitwise(np.add.accumulate(a), ref)
    assert_bitwise(np.cumsum(a), ref)


def test_acceptance_and_signed_zero(ctx):
    assert ctx.tensor([1, 2, 3], ("n",)).cumsum("n").numpy().tolist() == [1, 3, 6]
    z = ctx.tensor([-0.0, -0.0, 0.0], ("n",)).cumsum("n").numpy()
    assert np.signbit(z).tolist() == [True, True, False]  # the first element is x[0] itself
    assert ctx.tensor([2, 3, 4], ("n",)).cumprod("n").numpy().tolist() == [2, 6, 24]
    x = ctx.tensor([[1, 2], [3, 4]], ("r", "c"))
    assert x.cumsum("r").numpy().tolist() == [[1, 2], [4, 6]]
    assert x.cumsum("c").tags == ("r", "c")


SHAPES = [(1,), (5,), (W,), (W + 1,), (3 * W + 5,), (W - 1, W - 1), (W, W), (W + 1, 2 * W + 3),
          (2 * W, 1), (37, 53), (3, 4, 5), (2, 3, 33, 17), (2, BLOCK + 3), (1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_scans_bitwise_serial(ctx, shape, op):
    rng = np.random.default_rng(sum(shape))
    a = rng.standard_normal(shape).astype(np.float32)
    if op == "cumprod":
        a = rng.uniform(0.5, 1.5, shape).astype(np.float32) * rng.choice([1, -1], shape).astype(np.float32)
    x = ctx.tensor(a, tags_of(shape))
    for ax, tag in enumerate(x.tags):
        y = getattr(x, op)(tag)
        assert y.tags == x.tags and y.dtype == "f32"
        assert_bitwise(y.numpy(), serial(op, a, ax))


@pytest.mark.parametrize("shape,tag", [((4 * W + 3, 1000), "b"), ((1000, 4 * W + 3), "a"),
                                       ((3, 2 * BLOCK + 5), "a"), ((1 << 17,), "a"),
                                       ((W + 1, 700, 3), "b")])
def test_scans_bitwise_for_any_thread_count(ctx1, ctx2, shape, tag):
    a = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    d = np.random.default_rng(8).uniform(0.9, 1.0, shape).astype(np.float32)
    outs = []
    for c in (ctx1, ctx2):
        x = c.tensor(a, tags_of(shape))
        outs.append([x.cumsum(tag).numpy(), x.cumprod(tag).numpy(),
                     x.linear_recurrence(tag, c.tensor(d, tags_of(shape))).numpy()])
    for p, q in zip(*outs):
        assert_bitwise(p, q)
    ax = tags_of(shape).index(tag)
    assert_bitwise(outs[0][0], serial("cumsum", a, ax))
    assert_bitwise(outs[0][2], linrec_ref(d, a, ax))


def test_special_values_propagate(ctx):
    a = np.array([[1.0, np.inf, -np.inf, 2.0], [np.nan, 1.0, 2.0, 3.0]], np.float32)
    x = ctx.tensor(a, ("r", "c"))
    assert_bitwise(x.cumsum("c").numpy(), serial("cumsum", a, 1))
    assert_bitwise(x.cumprod("c").numpy(), serial("cumprod", a, 1))


# ---- gradients ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,tag", [((7,), "a"), ((3, 2 * W + 1), "b"), ((2 * W + 1, 3), "a"),
                                       ((2, 5, 4), "b")])
def test_cumsum_grad_is_reversed_suffix_sum(ctx, shape, tag):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    x = ctx.variable(a, tags_of(shape))
    ax = tags_of(shape).index(tag)
    x.cumsum(tag).backward(grad=ctx.tensor(g, tags_of(shape)))
    assert_bitwise(x.grad().numpy(), serial("cumsum", g, ax, reverse=True))
    ta = _t(a, True)
    ta.cumsum(ax).backward(torch.from_numpy(g))
    np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    x.zero_grad()
    wt = ctx.tensor(g, tags_of(shape))
    assert fu.gradcheck(lambda v: (v.cumsum(tag) * wt).sum_all(), [x]).checked == a.size


@pytest.mark.parametrize("tag", ["r", "c"])
def test_cumprod_grad_rules(ctx, tag):
    """Rows (or columns) without zeros: closed form; with one or two zeros: division-free."""
    rng = np.random.default_rng(9)
    a = rng.uniform(0.5, 1.5, (6, 7)).astype(np.float32) * rng.choice([1, -1], (6, 7)).astype(np.float32)
    if tag == "c":
        a[1, 3] = 0.0
        a[2, [0, 5]] = 0.0
        a[3, 6] = 0.0
        a[4, 0] = -0.0
    else:
        a[3, 1] = 0.0
        a[[0, 4], 2] = 0.0
        a[5, 6] = 0.0
    g = rng.standard_normal(a.shape).astype(np.float32)
    x = ctx.variable(a, ("r", "c"))
    ax = ("r", "c").index(tag)
    x.cumprod(tag).backward(grad=ctx.tensor(g, ("r", "c")))
    ta = _t(a, True)
    ta.cumprod(ax).backward(torch.from_numpy(g))
    np.testing.assert_allclose(x.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    # against the O(n^2) definition in float64
    a64, g64 = np.moveaxis(a, ax, 1).astype(np.float64), np.moveaxis(g, ax, 1).astype(np.float64)
    n = a64.shape[1]
    want = np.zeros_like(a64)
    for i in range(n):
        for j in range(i, n):
            others = np.prod(np.delete(a64[:, :j + 1], i, axis=1), axis=1)
            want[:, i] += g64[:, j] * others
    np.testing.assert_allclose(x.grad().numpy(), np.moveaxis(want, 1, ax), rtol=1e-5, atol=1e-5)
    x.zero_grad()
    wt = ctx.tensor(g, ("r", "c"))
    assert fu.gradcheck(lambda v: (v.cumprod(tag) * wt).sum_all(), [x]).checked == 42


def test_cumprod_grad_long_rows(ctx1, ctx2):
    a = np.random.default_rng(1).uniform(0.99, 1.01, (3, 3000)).astype(np.float32)
    a[1, 1500] = 0.0
    g = np.random.default_rng(2).standard_normal(a.shape).astype(np.float32)
    res = []
    for c in (ctx1, ctx2):
        x = c.variable(a, ("r", "c"))
        x.cumprod("c").backward(grad=c.tensor(g, ("r", "c")))
        res.append(x.grad().numpy())
    assert_bitwise(res[0], res[1])
    ta = _t(a, True)
    ta.cumprod(1).backward(torch.from_numpy(g))
    np.testing.assert_allclose(res[0], ta.grad.numpy(), rtol=1e-4, atol=1e-3)


# ---- linear_recurrence -------------------------------------------------------------------------

def test_linear_recurrence_values(ctx):
    rng = np.random.default_rng(4)
    b = rng.standard_normal((3, 2 * W + 3, 5)).astype(np.float32)
    a = rng.uniform(-1, 1, b.shape).astype(np.float32)
    h0 = rng.standard_normal((3, 5)).astype(np.float32)
    x = ctx.tensor(b, ("b", "t", "d"))
    for axis, tag in enumerate(("b", "t", "d")):
        got = x.linear_recurrence(tag, ctx.tensor(a, ("b", "t", "d")))
        assert got.tags == x.tags
        assert_bitwise(got.numpy(), linrec_ref(a, b, axis))
    got = x.linear_recurrence("t", ctx.tensor(a, ("b", "t", "d")), ctx.tensor(h0, ("b", "d")))
    assert_bitwise(got.numpy(), linrec_ref(a, b, 1, h0))
    # decay broadcasts by tag (here one decay per channel, in another tag order)
    ad = rng.uniform(0, 1, 5).astype(np.float32)
    got = x.linear_recurrence("t", ctx.tensor(ad, ("d",)), ctx.tensor(h0.T, ("d", "b")))
    assert_bitwise(got.numpy(), linrec_ref(np.broadcast_to(ad, b.shape), b, 1, h0))
    # an inner time axis (tiles) with an initial state
    bt = np.ascontiguousarray(np.moveaxis(b, 1, 2))
    at = np.ascontiguousarray(np.moveaxis(a, 1, 2))
    got = ctx.tensor(bt, ("b", "d", "t")).linear_recurrence("t", ctx.tensor(at, ("b", "d", "t")),
                                                            ctx.tensor(h0, ("b", "d")))
    assert_bitwise(got.numpy(), linrec_ref(at, bt, 2, h0))


def _torch_linrec(a, b, axis, h0=None):
    a, b = a.movedim(axis, 0), b.movedim(axis, 0)
    h = torch.zeros_like(b[0]) if h0 is None else h0
    out = []
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out).movedim(0, axis)


@pytest.mark.parametrize("tag", ["t", "d"])
def test_linear_recurrence_grads(ctx, tag):
    rng = np.random.default_rng(5)
    b = rng.standard_normal((2, W + 3, 4)).astype(np.float32)
    a = rng.uniform(-1, 1, (W + 3, 4)).astype(np.float32)
    h0 = rng.standard_normal((2, 4) if tag == "t" else (2, W + 3)).astype(np.float32)
    g = rng.standard_normal(b.shape).astype(np.float32)
    axis = ("b", "t", "d").index(tag)
    x = ctx.variable(b, ("b", "t", "d"))
    d = ctx.variable(a, ("t", "d"))
    itags = ("b", "d") if tag == "t" else ("b", "t")
    i = ctx.variable(h0, itags)
    x.linear_recurrence(tag, d, i).backward(grad=ctx.tensor(g, ("b", "t", "d")))
    tb, ta, ti = _t(b, True), _t(a, True), _t(h0, True)
    _torch_linrec(ta.expand(2, -1, -1), tb, axis, ti).backward(torch.from_numpy(g))
    for mine, theirs in ((x, tb), (d, ta), (i, ti)):
        np.testing.assert_allclose(mine.grad().numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-5)
    # the backward scan itself: gh[t] = a[t+1] gh[t+1] + g[t], serial — bitwise
    aa = np.broadcast_to(a, b.shape)
    sh = np.zeros_like(b)
    sl = [slice(None)] * 3
    src = list(sl)
    src[axis] = slice(1, None)
    dst = list(sl)
    dst[axis] = slice(0, -1)
    sh[tuple(dst)] = aa[tuple(src)]
    want = np.flip(linrec_ref(np.flip(sh, axis), np.flip(g, axis), axis), axis)
    assert_bitwise(x.grad().numpy(), want)
    for v in (x, d, i):
        v.zero_grad()
    w = ctx.tensor(g, ("b", "t", "d"))
    r = fu.gradcheck(lambda u, v, s: (u.linear_recurrence(tag, v, s) * w).sum_all(), [x, d, i])
    assert r.checked == b.size + a.size + h0.size


def test_linear_recurrence_no_initial_grad(ctx):
    b = np.array([[1.0, 2.0, 3.0]], np.float32)
    x = ctx.variable(b, ("r", "t"))
    d = ctx.variable([0.5], ("r",))
    y = x.linear_recurrence("t", d)
    assert y.numpy().tolist() == [[1.0, 2.5, 4.25]]
    y.sum_all().backward()
    tb, td = _t(b, True), _t([0.5], True)
    _torch_linrec(td[:, None].expand(1, 3), tb, 1).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), tb.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(d.grad().numpy(), td.grad.numpy(), rtol=1e-6)


def test_scan_errors(ctx):
    x = ctx.tensor(np.ones((2, 3), np.float32), ("r", "t"))
    with pytest.raises(fu.TagError):
        x.cumsum("q")
    with pytest.raises(fu.TagError):
        x.cumprod("q")
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1, 2], ("n",), dtype="i64").cumsum("n")
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1, 2], ("n",), dtype="f16").cumprod("n")
    with pytest.raises(fu.TagError):
        x.linear_recurrence("q", ctx.tensor([1.0], ("t",)))
    with pytest.raises(fu.TagError):  # a decay tag self lacks
        x.linear_recurrence("t", ctx.tensor([[1.0]], ("t", "z")))
    with pytest.raises(fu.ShapeMismatch):
        x.linear_recurrence("t", ctx.tensor([1.0, 2.0], ("t",)))
    with pytest.raises(fu.TagError):  # initial must not carry the time axis
        x.linear_recurrence("t", ctx.tensor([1.0], ("t",)), ctx.tensor([[0.0]], ("r", "t")))
    with pytest.raises(fu.ShapeMismatch):
        x.linear_recurrence("t", ctx.tensor([1.0], ("t",)), ctx.tensor([0.0, 0.0, 0.0], ("r",)))
    with pytest.raises(TypeError):
        x.linear_recurrence("t", 0.5)
    with pytest.raises(fu.DTypeError):
        x.linear_recurrence("t", ctx.tensor([1.0], ("t",), dtype="f16"))
