"""Softmax family (SPEC §3.9): softmax with every option, log_softmax and logsumexp, against
torch (values and gradients), finite differences, the acceptances, non-finite rows, bad input,
and bitwise thread invariance."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(11)
TAGS = ("h", "q", "k")
SHAPE = (3, 4, 37)  # 37 = two 16-lane vectors + a 5-lane tail


def rand(shape, s=2.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


def alibi_slopes(max_bias, H):
    """SPEC §3.9 ALiBi slopes, in float32 step by step."""
    f = np.float32
    h2 = 2 ** int(np.floor(np.log2(H)))
    m0 = f(2.0) ** (-(f(max_bias) / f(h2)))
    m1 = f(2.0) ** (-((f(max_bias) / f(2.0)) / f(h2)))
    return np.array([m0 ** f(i + 1) if i < h2 else m1 ** f(2 * (i - h2) + 1) for i in range(H)], np.float32)


def causal_mask(Q, K, off):
    q = np.arange(Q)[:, None]
    k = np.arange(K)[None, :]
    return np.where(k <= off + q, 0.0, -np.inf).astype(np.float32)


def torch_softmax(x, scale=1.0, mask=None, slopes=None, sinks=None, causal=None):
    """x [H, Q, K] (torch, requires_grad); mask broadcastable numpy; per-head slopes/sinks."""
    z = x * scale
    if mask is not None:
        m = torch.from_numpy(np.ascontiguousarray(mask))
        if slopes is not None:
            m = m * torch.from_numpy(slopes)[:, None, None]
        z = z + m
    if causal is not None:
        z = z + torch.from_numpy(causal_mask(x.shape[1], x.shape[2], causal))
    if sinks is not None:
        s = torch.from_numpy(np.asarray(sinks, np.float32)).reshape(-1, 1, 1).expand(x.shape[0], x.shape[1], 1)
        return F.softmax(torch.cat([z, s], -1), -1)[..., :-1]
    return F.softmax(z, -1)


def check_vs_torch(ctx, a, fu_fn, torch_fn, tags=TAGS, atol=1e-6):
    """Values against torch; the gradient of sum(y * w) against torch's float64 gradient to
    1e-5 of its largest element (normwise): the softmax term p·Σ(...) rounds in proportion
    to a whole row's sum (log_softmax over 1000 values: torch's float32 gradient and ours are
    off by up to ~1e-6 of the largest, ours no more than torch's), and which elements take
    the error depends on the summation order (8 or 16 lanes), so an element-wise tolerance
    against torch's float32 bits passed or failed by the data."""
    x = ctx.variable(a, tags)
    y = fu_fn(x)
    tx = torch.tensor(a, requires_grad=True)
    ty = torch_fn(tx)
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=atol)
    w = np.asarray(rand(y.shape, 1.0))
    (y * ctx.tensor(w, y.tags)).sum_all().backward()
    t64 = torch.tensor(a.astype(np.float64), requires_grad=True)
    (torch_fn(t64) * torch.from_numpy(w.astype(np.float64))).sum().backward()
    ref = t64.grad.numpy()
    np.testing.assert_allclose(x.grad().numpy(), ref, rtol=0, atol=atol + 1e-5 * np.abs(ref).max())
    return y


# ---------------------------------------------------------------------------------------------
# acceptances (SPEC §3.9, D-6)

def test_acceptance(ctx):
    z = ctx.zeros((2, 2), ("seq", "src"))
    assert z.softmax("src").numpy().reshape(-1).tolist() == [0.5, 0.5, 0.5, 0.5]
    assert z.softmax("src", causal={"query_tag": "seq"}).numpy().reshape(-1).tolist() == [1, 0, 0.5, 0.5]


def test_rows_sum_to_one(ctx):
    a = rand((5, 300), 4.0)
    y = ctx.tensor(a, ("r", "c")).softmax("c")
    assert y.tags == ("r", "c") and y.shape == (5, 300)
    np.testing.assert_allclose(y.numpy().astype(np.float64).sum(1), 1.0, atol=1e-6 * 300)
    assert (y.numpy() >= 0).all()


# ---------------------------------------------------------------------------------------------
# plain ops against torch, every axis (the permute + materialise path included)

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_plain_ops_against_torch(ctx, axis):
    a = rand(SHAPE, 3.0)
    tag = TAGS[axis]
    check_vs_torch(ctx, a, lambda x: x.softmax(tag), lambda t: F.softmax(t, axis))
    check_vs_torch(ctx, a, lambda x: x.log_softmax(tag), lambda t: F.log_softmax(t, axis))
    y = check_vs_torch(ctx, a, lambda x: x.logsumexp(tag), lambda t: torch.logsumexp(t, axis))
    assert y.tags == tuple(t for t in TAGS if t != tag)


@pytest.mark.parametrize("K", [1, 5, 16, 64, 65, 1000])
def test_row_lengths(ctx, K):
    """Every branch of the row walk: tail only, one vector, 4-vector blocks, block + tail."""
    a = rand((3, K), 3.0)
    check_vs_torch(ctx, a, lambda x: x.softmax("c", scale=0.5), lambda t: F.softmax(t * 0.5, 1), ("r", "c"))
    check_vs_torch(ctx, a, lambda x: x.log_softmax("c"), lambda t: F.log_softmax(t, 1), ("r", "c"))
    check_vs_torch(ctx, a, lambda x: x.logsumexp("c"), lambda t: torch.logsumexp(t, 1), ("r", "c"))


def test_rank_one(ctx):
    a = rand(50, 3.0)
    check_vs_torch(ctx, a, lambda x: x.softmax("k"), lambda t: F.softmax(t, 0), ("k",))
    y = check_vs_torch(ctx, a, lambda x: x.logsumexp("k"), lambda t: torch.logsumexp(t, 0), ("k",))
    assert y.tags == () and y.item() == pytest.approx(float(torch.logsumexp(torch.from_numpy(a), 0)), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# options

def test_scale_and_mask_against_torch(ctx):
    a = rand(SHAPE)
    m = rand((4, 37))  # [q, k] serves [h, q, k]
    mt = ctx.tensor(m, ("q", "k"))
    check_vs_torch(ctx, a, lambda x: x.softmax("k", scale=0.125, mask=mt),
                   lambda t: torch_softmax(t, 0.125, m))


@pytest.mark.parametrize("mask_tags", [("k",), ("h", "k"), ("h", "q"), ("q", "h", "k"), ("q",)])
def test_mask_broadcast_patterns(ctx, mask_tags):
    """A mask on any subset of self's tags, in any order; without "k" it is one value per row."""
    sizes = dict(zip(TAGS, SHAPE))
    m = rand(tuple(sizes[t] for t in mask_tags))
    mt = ctx.tensor(m, mask_tags)
    order = [mask_tags.index(t) for t in TAGS if t in mask_tags]
    full = np.transpose(m, order).reshape(tuple(sizes[t] if t in mask_tags else 1 for t in TAGS))
    a = rand(SHAPE)
    check_vs_torch(ctx, a, lambda x: x.softmax("k", scale=0.5, mask=mt), lambda t: torch_softmax(t, 0.5, full))


def test_mask_size_one_axes_and_strided_view(ctx):
    a = rand(SHAPE)
    m = rand((3, 1, 37))
    check_vs_torch(ctx, a, lambda x: x.softmax("k", mask=ctx.tensor(m, TAGS)), lambda t: torch_softmax(t, 1.0, m))
    base = rand((37, 4))  # a transposed (non-contiguous) view of the mask
    mt = ctx.tensor(base, ("k", "q")).permute(("q", "k"))
    check_vs_torch(ctx, a, lambda x: x.softmax("k", mask=mt), lambda t: torch_softmax(t, 1.0, base.T))


def test_mask_on_a_non_last_axis(ctx):
    """softmax over "q" (not the last axis): x and the mask go through the row layout."""
    a = rand(SHAPE)
    m = rand((4, 37))
    mt = ctx.tensor(m, ("q", "k"))
    x = ctx.variable(a, TAGS)
    y = x.softmax("q", scale=0.3, mask=mt)
    tx = torch.tensor(a, requires_grad=True)
    ty = F.softmax(tx * 0.3 + torch.from_numpy(m), 1)
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    w = rand(SHAPE)
    (y * ctx.tensor(w, TAGS)).sum_all().backward()
    (ty * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_mask(ctx, dtype):
    a = rand(SHAPE)
    m = rand((4, 37))
    mt = ctx.tensor(m, ("q", "k"), dtype=dtype)
    wide = mt.to("f32").numpy()
    check_vs_torch(ctx, a, lambda x: x.softmax("k", mask=mt), lambda t: torch_softmax(t, 1.0, wide))


def test_mask_with_many_broadcast_axes(ctx):
    """A broadcast pattern with more outer axes than the kernel's mask geometry holds: the mask
    is spelled out in full first (same values)."""
    tags = ("a", "b", "c", "d", "e", "k")
    shape = (2, 3, 2, 3, 2, 20)
    a = rand(shape)
    m = rand((2, 2, 2, 20))
    mt = ctx.tensor(m, ("a", "c", "e", "k"))
    full = m.reshape(2, 1, 2, 1, 2, 20)
    check_vs_torch(ctx, a, lambda x: x.softmax("k", mask=mt),
                   lambda t: F.softmax(t + torch.from_numpy(full), -1), tags)


@pytest.mark.parametrize("H", [3, 4, 6])
def test_alibi_against_torch(ctx, H):
    a = rand((H, 4, 37))
    m = rand((4, 37))
    slopes = alibi_slopes(8.0, H)
    mt = ctx.tensor(m, ("q", "k"))
    check_vs_torch(ctx, a, lambda x: x.softmax("k", scale=0.5, mask=mt, max_bias=8.0, head_tag="h"),
                   lambda t: torch_softmax(t, 0.5, m, slopes=slopes))


def test_alibi_head_axis_not_outermost(ctx):
    """The head axis in the middle of the row axes: slope of row r is slopes[(r / inner) % H]."""
    a = rand((4, 3, 37))  # (q, h, k)
    m = rand((4, 37))
    slopes = alibi_slopes(4.0, 3)
    mt = ctx.tensor(m, ("q", "k"))
    want = lambda t: F.softmax(t + torch.from_numpy(m)[:, None, :] * torch.from_numpy(slopes)[None, :, None], -1)
    check_vs_torch(ctx, a, lambda x: x.softmax("k", mask=mt, max_bias=4.0, head_tag="h"), want, ("q", "h", "k"))


def test_sinks_against_torch(ctx):
    a = rand(SHAPE)
    sinks = [0.5, -1.0, 3.0]
    y = check_vs_torch(ctx, a, lambda x: x.softmax("k", sinks=sinks, head_tag="h"),
                       lambda t: torch_softmax(t, sinks=sinks))
    assert (y.numpy().sum(-1) < 1).all()  # the sink takes its share
    # a single sink without head_tag; also as a tensor
    check_vs_torch(ctx, a, lambda x: x.softmax("k", sinks=[2.0]), lambda t: torch_softmax(t, sinks=[2.0] * 3))
    st = ctx.tensor(np.array(sinks, np.float32), ("h",))
    check_vs_torch(ctx, a, lambda x: x.softmax("k", sinks=st, head_tag="h"), lambda t: torch_softmax(t, sinks=sinks))


@pytest.mark.parametrize("off", [0, 5, 33])
def test_causal_against_torch(ctx, off):
    a = rand(SHAPE)
    y = check_vs_torch(ctx, a, lambda x: x.softmax("k", causal={"query_tag": "q", "source_offset": off}),
                       lambda t: torch_softmax(t, causal=off))
    got = y.numpy()
    for qi in range(4):
        assert (got[:, qi, off + qi + 1:] == 0).all()  # masked tail exactly 0
        np.testing.assert_allclose(got[:, qi, :off + qi + 1].sum(-1), 1.0, atol=1e-6)


def test_every_option_together(ctx):
    a = rand((3, 4, 70))
    m = rand((4, 70))
    slopes = alibi_slopes(2.0, 3)
    sinks = [1.0, 0.0, -2.0]
    mt = ctx.tensor(m, ("q", "k"))
    check_vs_torch(
        ctx, a,
        lambda x: x.softmax("k", scale=0.7, mask=mt, max_bias=2.0, head_tag="h", sinks=sinks,
                            causal={"query_tag": "q", "source_offset": 40}),
        lambda t: torch_softmax(t, 0.7, m, slopes=slopes, sinks=sinks, causal=40))


def test_grad_mode_does_not_change_values(ctx):
    a = rand(SHAPE)
    m = ctx.tensor(rand((4, 37)), ("q", "k"))
    opts = dict(scale=0.5, mask=m, causal={"query_tag": "q", "source_offset": 2})
    with_grad = ctx.variable(a, TAGS).softmax("k", **opts).numpy()
    with fu.no_grad():
        assert_bitwise(ctx.variable(a, TAGS).softmax("k", **opts).numpy(), with_grad)
    assert_bitwise(ctx.tensor(a, TAGS).softmax("k", **opts).numpy(), with_grad)


# ---------------------------------------------------------------------------------------------
# finite differences

def test_gradcheck_every_op_and_option(ctx1):
    a = rand((2, 3, 6), 1.0)
    m = ctx1.tensor(rand((3, 6), 1.0), ("q", "k"))
    cases = [
        lambda x: x.softmax("k"),
        lambda x: x.softmax("q", scale=1.7),
        lambda x: x.softmax("k", scale=0.5, mask=m, max_bias=3.0, head_tag="h"),
        lambda x: x.softmax("k", sinks=[0.5, -0.5], head_tag="h", causal={"query_tag": "q", "source_offset": 1}),
        lambda x: x.log_softmax("k"),
        lambda x: x.log_softmax("h"),
        lambda x: x.logsumexp("k"),
        lambda x: x.logsumexp("q"),
    ]
    for fn in cases:
        x = ctx1.variable(a, TAGS)
        with fu.no_grad():
            y0 = fn(x)
        wy = ctx1.tensor(rand(y0.shape, 1.0), y0.tags)
        assert fu.gradcheck(lambda v, fn=fn: (fn(v) * wy).sum_all(), [x]).checked == a.size


# ---------------------------------------------------------------------------------------------
# determinism

def test_thread_invariance(ctx1, ctx2):
    """Rows spread over many work items (and both threads): every value and gradient bitwise."""
    a = rand((6, 40, 700), 3.0)  # 240 rows, 46 per work item
    m = rand((40, 700))
    g = rand((6, 40, 700))
    outs = []
    for c in (ctx1, ctx2):
        x = c.variable(a, TAGS)
        mt = c.tensor(m, ("q", "k"))
        gt = c.tensor(g, TAGS)
        res = []
        for fn in (lambda v: v.softmax("k", scale=0.3, mask=mt, max_bias=1.0, head_tag="h",
                                       sinks=[0.1] * 6, causal={"query_tag": "q", "source_offset": 600}),
                   lambda v: v.softmax("q"),
                   lambda v: v.log_softmax("k")):
            y = fn(x)
            y.backward(grad=gt)
            res += [y.numpy(), x.grad().numpy()]
            x.zero_grad()
        y = x.logsumexp("k")
        y.backward(grad=c.tensor(g[..., 0], ("h", "q")))
        res += [y.numpy(), x.grad().numpy()]
        outs.append(res)
    for u, v in zip(*outs):
        assert_bitwise(u, v)


# ---------------------------------------------------------------------------------------------
# non-finite rows

def test_logsumexp_non_finite_rows(ctx):
    inf, nan = np.inf, np.nan
    a = np.array([[-inf, -inf, -inf], [1.0, inf, 2.0], [-inf, 0.0, -inf], [inf, inf, 1.0],
                  [1.0, nan, 2.0], [-inf, inf, 0.0], [1e30, 1e30, -1e30]], np.float32)
    got = ctx.tensor(a, ("r", "c")).logsumexp("c").numpy()
    want = torch.logsumexp(torch.from_numpy(a), 1).numpy()
    assert got[0] == -inf and got[1] == inf and got[2] == 0.0 and got[3] == inf and got[5] == inf
    assert np.isnan(got[4])
    assert not np.isnan(got[[0, 1, 2, 3, 5, 6]]).any()  # never NaN without a NaN input
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ls = ctx.tensor(a, ("r", "c")).log_softmax("c").numpy()
    assert np.isnan(ls[0]).all()                                  # x - lse = -inf - (-inf)
    assert ls[1, 0] == -inf and ls[1, 2] == -inf and np.isnan(ls[1, 1])  # finite - inf, inf - inf
    assert ls[2].tolist() == [-inf, 0.0, -inf]
    np.testing.assert_allclose(ls[6], F.log_softmax(torch.from_numpy(a[6]), 0).numpy())


def test_softmax_infinite_logits(ctx):
    inf = np.inf
    a = np.array([[-inf, 0.0, -inf, 1.0], [0.0, 0.0, 0.0, -inf], [-inf] * 4, [1.0, inf, 0.0, 2.0]], np.float32)
    got = ctx.tensor(a, ("r", "c")).softmax("c").numpy()
    want = F.softmax(torch.from_numpy(a), 1).numpy()
    assert got[0, 0] == 0 and got[0, 2] == 0 and got[1, 3] == 0  # -inf logits give exactly 0
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6)
    assert np.isnan(got[2]).all() and np.isnan(want[2]).all()   # an all -inf row is NaN, as in torch
    assert np.isnan(got[3]).all() and np.isnan(want[3]).all()   # a +inf logit: NaN, as in torch
    # a sink keeps an otherwise fully masked row finite: all zeros
    s = ctx.tensor(a[2:3], ("r", "c")).softmax("c", sinks=[0.0]).numpy()
    assert s.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_large_logits_do_not_overflow(ctx):
    a = np.array([[1e4, 1e4 - 1.0, -1e4]], np.float32)
    got = ctx.tensor(a, ("r", "c")).softmax("c").numpy()
    np.testing.assert_allclose(got, F.softmax(torch.from_numpy(a), 1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(ctx.tensor(a, ("r", "c")).logsumexp("c").numpy(),
                               torch.logsumexp(torch.from_numpy(a), 1).numpy(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad input

def test_errors(ctx):
    x = ctx.tensor(np.zeros(SHAPE, np.float32), TAGS)
    with pytest.raises(fu.TagError):
        x.softmax("nope")
    with pytest.raises(fu.TagError):
        x.logsumexp("nope")
    with pytest.raises(fu.TagError):
        x.log_softmax("nope")
    with pytest.raises(fu.TagError):
        x.softmax("k", head_tag="nope", sinks=[0.0])
    with pytest.raises(fu.TagError):
        x.softmax("k", causal={"query_tag": "nope"})
    with pytest.raises(TypeError):
        x.softmax("k", bias=1.0)
    with pytest.raises(TypeError):
        x.softmax("k", causal={"query_tag": "q", "window": 3})
    with pytest.raises(TypeError):
        x.softmax("k", causal={"source_offset": 1})
    # mask not broadcastable into self
    with pytest.raises(fu.ShapeMismatch):
        x.softmax("k", mask=ctx.zeros((4, 36), ("q", "k")))
    with pytest.raises(fu.ShapeMismatch):
        x.softmax("k", mask=ctx.zeros((4, 37, 2), ("q", "k", "other")))
    with pytest.raises(fu.ShapeMismatch):
        ctx.zeros((3, 1, 37), TAGS).softmax("k", mask=ctx.zeros((4, 37), ("q", "k")))
    with pytest.raises(fu.DTypeError):
        x.softmax("k", mask=ctx.zeros((4, 37), ("q", "k"), dtype="bool"))
    with pytest.raises(fu.UnsupportedGradient):
        x.softmax("k", mask=ctx.variable(np.zeros((4, 37), np.float32), ("q", "k")))
    # sinks
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", sinks=[0.0, 1.0], head_tag="h")
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", sinks=[0.0, 1.0, 2.0])
    # causal geometry
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", causal={"query_tag": "q", "source_offset": 34})
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", causal={"query_tag": "q", "source_offset": -1})
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", causal={"query_tag": "k"})
    # ALiBi needs mask and head_tag
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", max_bias=8.0, head_tag="h")
    with pytest.raises(fu.InvalidShape):
        x.softmax("k", max_bias=8.0, mask=ctx.zeros((4, 37), ("q", "k")))
    with pytest.raises(fu.DTypeError):
        ctx.zeros((2, 3), ("r", "c"), dtype="i64").softmax("c")
    # the boundary cases that are fine
    x.softmax("k", causal={"query_tag": "q", "source_offset": 33})
    assert x.softmax("k", scale=0.0).numpy().max() == pytest.approx(1 / 37)
