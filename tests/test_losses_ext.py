"""L-4 elementwise losses (mse, huber, bce, kl_div) and L-5 composed losses (nll_loss,
cosine_similarity) against torch, finite differences, the documented divergences (SPEC §7.1
items 5, 6) and thread invariance."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

pytestmark = pytest.mark.filterwarnings("ignore:reduction. .mean. divides:UserWarning")

RNG = np.random.default_rng(11)
SHAPE = (3, 5, 4)
TAGS = ("a", "b", "c")


def _inputs(kind):
    """(x, t) float32 arrays suited to the loss."""
    if kind in ("mse", "huber"):
        return (RNG.standard_normal(SHAPE) * 2).astype(np.float32), \
            (RNG.standard_normal(SHAPE) * 2).astype(np.float32)
    if kind == "bce_logits":
        return (RNG.standard_normal(SHAPE) * 3).astype(np.float32), \
            RNG.uniform(0, 1, SHAPE).astype(np.float32)
    if kind == "bce":
        return RNG.uniform(0.05, 0.95, SHAPE).astype(np.float32), \
            RNG.uniform(0, 1, SHAPE).astype(np.float32)
    if kind == "kl":
        return np.log(RNG.uniform(0.05, 1, SHAPE)).astype(np.float32), \
            RNG.uniform(0.05, 1, SHAPE).astype(np.float32)
    if kind == "kl_log":
        return np.log(RNG.uniform(0.05, 1, SHAPE)).astype(np.float32), \
            np.log(RNG.uniform(0.05, 1, SHAPE)).astype(np.float32)
    raise AssertionError(kind)


def _fu(kind, x, t, reduction):
    if kind == "mse":
        return x.mse_loss(t, reduction=reduction)
    if kind == "huber":
        return x.huber_loss(t, delta=1.5, reduction=reduction)
    if kind == "bce_logits":
        return x.bce_loss(t, reduction=reduction, from_logits=True)
    if kind == "bce":
        return x.bce_loss(t, reduction=reduction)
    if kind == "kl":
        return x.kl_div_loss(t, reduction=reduction)
    return x.kl_div_loss(t, reduction=reduction, log_target=True)


def _torch(kind, x, t, reduction):
    if kind == "mse":
        return F.mse_loss(x, t, reduction=reduction)
    if kind == "huber":
        return F.huber_loss(x, t, delta=1.5, reduction=reduction)
    if kind == "bce_logits":
        return F.binary_cross_entropy_with_logits(x, t, reduction=reduction)
    if kind == "bce":
        return F.binary_cross_entropy(x, t, reduction=reduction)
    if kind == "kl":
        return F.kl_div(x, t, reduction=reduction)
    return F.kl_div(x, t, reduction=reduction, log_target=True)


KINDS = ["mse", "huber", "bce_logits", "bce", "kl", "kl_log"]


def test_acceptance(ctx):
    x = ctx.tensor(np.array([1.0, 2.0], np.float32), ("i",))
    t = ctx.tensor(np.array([3.0, 2.0], np.float32), ("i",))
    assert x.mse_loss(t).item() == 2.0
    assert x.mse_loss(t, reduction="sum").item() == 4.0
    none = x.mse_loss(t, reduction="none")
    assert none.tags == ("i",)
    np.testing.assert_array_equal(none.numpy(), [4.0, 0.0])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_against_torch(ctx, kind, reduction):
    x_np, t_np = _inputs(kind)
    x, t = ctx.variable(x_np, TAGS), ctx.variable(t_np, TAGS)
    loss = _fu(kind, x, t, reduction)
    tx = torch.tensor(x_np, requires_grad=True)
    tt = torch.tensor(t_np, requires_grad=True)
    tl = _torch(kind, tx, tt, reduction)
    if reduction == "none":
        assert loss.tags == TAGS
        np.testing.assert_allclose(loss.numpy(), tl.detach().numpy(), rtol=1e-5, atol=1e-6)
        w = RNG.standard_normal(SHAPE).astype(np.float32)
        (loss * ctx.tensor(w, TAGS)).sum_all().backward()
        (tl * torch.from_numpy(w)).sum().backward()
    else:
        assert loss.tags == ()
        np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5, atol=1e-6)
        loss.backward()
        tl.backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(t.grad().numpy(), tt.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_target_with_permuted_tags(ctx):
    x_np, t_np = _inputs("huber")
    x = ctx.variable(x_np, TAGS)
    t = ctx.variable(np.ascontiguousarray(t_np.transpose(2, 0, 1)), ("c", "a", "b"))
    loss = x.huber_loss(t, delta=0.7, reduction="sum")
    tx, tt = torch.tensor(x_np, requires_grad=True), torch.tensor(t_np, requires_grad=True)
    tl = F.huber_loss(tx, tt, delta=0.7, reduction="sum")
    np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5)
    loss.backward()
    tl.backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.grad().numpy(), tt.grad.numpy().transpose(2, 0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(ctx1, kind):
    x_np, t_np = _inputs(kind)
    x_np, t_np = x_np[:2, :2, :2], t_np[:2, :2, :2]
    x, t = ctx1.variable(x_np, TAGS), ctx1.variable(t_np, TAGS)
    # the bce prob path's target gradient and kl's target gradient are fine away from 0 / 1
    res = fu.gradcheck(lambda a, b: _fu(kind, a, b, "sum"), [x, t])
    assert res.checked == 16


def test_errors(ctx):
    x = ctx.variable(np.zeros((2, 3), np.float32), ("a", "b"))
    t = ctx.tensor(np.zeros((2, 3), np.float32), ("a", "b"))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(fu.InvalidShape):
            x.huber_loss(t, delta=bad)
        with pytest.raises(ValueError):
            x.huber_loss(t, delta=bad)
    for fn in (lambda: x.mse_loss(t, reduction="batchmean"),
               lambda: x.kl_div_loss(t, reduction="batchmean"),
               lambda: x.bce_loss(t, reduction="avg"),
               lambda: x.nll_loss("b", [0, 1], reduction="x")):
        with pytest.raises(ValueError):
            fn()
    with pytest.raises(fu.TagError):
        x.mse_loss(ctx.tensor(np.zeros((2, 3), np.float32), ("a", "c")))
    with pytest.raises(fu.ShapeMismatch):
        x.mse_loss(ctx.tensor(np.zeros((2, 1), np.float32), ("a", "b")))
    with pytest.raises(fu.IndexOutOfBounds):
        x.nll_loss("b", [0, 3])
    with pytest.raises(fu.IndexOutOfBounds):
        x.nll_loss("b", [-1, 0])
    with pytest.raises(fu.InvalidDataLength):
        x.nll_loss("b", [0, 1, 2])


# ---- SPEC §7.1 documented divergences ----

def test_divergence_bce_prob_clamp(ctx):
    """Item 5: p clamped to [1e-7, 1 − 1e-7]; input gradient 0 outside the open interval
    (torch clamps the log at −100 and gives huge boundary gradients)."""
    x_np = np.array([0.0, 1.0, 1e-9, 0.5, -0.2, 1.3], np.float32)
    y_np = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], np.float32)
    x, y = ctx.variable(x_np, ("i",)), ctx.tensor(y_np, ("i",))
    loss = x.bce_loss(y, reduction="none")
    # the bounds as float32 (1 − 1e-7 rounds to 1 − 2⁻²³), 1 − p in float32 like the kernel
    p32 = np.clip(x_np, np.float32(1e-7), np.float32(1 - 1e-7))
    p, q = p32.astype(np.float64), (np.float32(1) - p32).astype(np.float64)
    want = -(y_np * np.log(p) + (1 - y_np) * np.log(q))
    np.testing.assert_allclose(loss.numpy(), want, rtol=1e-4)
    loss.sum_all().backward()
    g = x.grad().numpy()
    assert (g[[0, 1, 2, 4, 5]] == 0).all() and g[3] == pytest.approx(-2.0, rel=1e-5)
    tx = torch.tensor(x_np[:3], requires_grad=True)
    tl = F.binary_cross_entropy(tx, torch.tensor(y_np[:3]), reduction="none")
    assert tl[0].item() == pytest.approx(100.0)       # torch: log clamped at −100
    assert loss.numpy()[0] == pytest.approx(-np.log(1e-7), rel=1e-4)   # ours: ≈ 16.1
    tl.sum().backward()
    assert np.abs(tx.grad.numpy()).max() > 1e6          # torch: huge boundary gradients


def test_divergence_kl_no_batchmean(ctx):
    """Item 6: no batchmean; mean is the total-element mean (torch's 'mean' too, not batchmean)."""
    x_np, t_np = _inputs("kl")
    x, t = ctx.tensor(x_np, TAGS), ctx.tensor(t_np, TAGS)
    with pytest.raises(ValueError):
        x.kl_div_loss(t, reduction="batchmean")
    tx, tt = torch.tensor(x_np), torch.tensor(t_np)
    ours = x.kl_div_loss(t).item()
    np.testing.assert_allclose(ours, F.kl_div(tx, tt, reduction="mean").item(), rtol=1e-5)
    bm = F.kl_div(tx, tt, reduction="batchmean").item()
    assert abs(ours - bm) > 1e-3 * abs(bm)
    np.testing.assert_allclose(ours * x_np.size / SHAPE[0], bm, rtol=1e-5)


def test_kl_zero_target(ctx):
    x = ctx.tensor(np.array([-1.0, -2.0], np.float32), ("i",))
    t = ctx.tensor(np.array([0.0, 0.5], np.float32), ("i",))
    got = x.kl_div_loss(t, reduction="none").numpy()
    assert got[0] == 0.0
    assert got[1] == pytest.approx(0.5 * (np.log(0.5) + 2.0), rel=1e-6)


# ---- L-5 composed ----

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("class_axis", [0, 2])
def test_nll_against_torch(ctx, reduction, class_axis):
    logits = RNG.standard_normal(SHAPE).astype(np.float32)
    x_np = (logits - np.log(np.exp(logits).sum(class_axis, keepdims=True))).astype(np.float32)
    K = SHAPE[class_axis]
    rest = [d for i, d in enumerate(SHAPE) if i != class_axis]
    lab = RNG.integers(0, K, rest)
    x = ctx.variable(x_np, TAGS)
    with ctx.exec_scope():
        loss = x.nll_loss(TAGS[class_axis], lab, reduction=reduction)
        tx = torch.tensor(x_np, requires_grad=True)
        tl = F.nll_loss(tx.movedim(class_axis, -1).reshape(-1, K), torch.from_numpy(lab.reshape(-1)),
                        reduction=reduction)
        if reduction == "none":
            assert loss.tags == tuple(t for i, t in enumerate(TAGS) if i != class_axis)
            np.testing.assert_allclose(loss.numpy().reshape(-1), tl.detach().numpy(), rtol=1e-6)
            w = RNG.standard_normal(rest).astype(np.float32)
            (loss * ctx.tensor(w, loss.tags)).sum_all().backward()
            (tl * torch.from_numpy(w.reshape(-1))).sum().backward()
        else:
            np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5)
            loss.backward()
            tl.backward()
        np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_cosine_similarity_against_torch(ctx):
    a_np = RNG.standard_normal(SHAPE).astype(np.float32)
    b_np = RNG.standard_normal(SHAPE).astype(np.float32)
    a, b = ctx.variable(a_np, TAGS), ctx.variable(b_np, TAGS)
    w = RNG.standard_normal((3, 4)).astype(np.float32)
    with ctx.exec_scope():
        cs = a.cosine_similarity(b, "b")
        assert cs.tags == ("a", "c")
        ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
        tc = F.cosine_similarity(ta, tb, dim=1)
        np.testing.assert_allclose(cs.numpy(), tc.detach().numpy(), rtol=1e-5, atol=1e-6)
        (cs * ctx.tensor(w, ("a", "c"))).sum_all().backward()
        (tc * torch.from_numpy(w)).sum().backward()
        np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(b.grad().numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_composed_gradcheck(ctx1):
    a = ctx1.variable(RNG.standard_normal((2, 3)).astype(np.float32), ("r", "c"))
    b = ctx1.variable(RNG.standard_normal((2, 3)).astype(np.float32), ("r", "c"))
    with ctx1.exec_scope():
        assert fu.gradcheck(lambda u, v: u.cosine_similarity(v, "c").sum_all(), [a, b]).checked == 12
        assert fu.gradcheck(lambda u: u.nll_loss("c", [2, 0]), [a]).checked == 6


def test_composed_need_scope_under_grad(ctx):
    x = ctx.variable(np.zeros((2, 3), np.float32), ("a", "b"))
    y = ctx.variable(np.ones((2, 3), np.float32), ("a", "b"))
    with pytest.raises(fu.ActiveExecScopeRequired):
        x.nll_loss("b", [0, 1])
    with pytest.raises(fu.ActiveExecScopeRequired):
        x.cosine_similarity(y, "b")
    # no-grad use works unscoped
    c = ctx.tensor(np.zeros((2, 3), np.float32), ("a", "b"))
    assert c.nll_loss("b", [0, 1]).item() == 0.0
    with fu.no_grad():
        np.testing.assert_allclose(x.cosine_similarity(y, "b").numpy(), [0.0, 0.0])


def test_thread_invariance(ctx1, ctx2):
    x_np = (RNG.standard_normal((64, 3000)) * 2).astype(np.float32)
    t_np = RNG.uniform(0.01, 0.99, (64, 3000)).astype(np.float32)
    for call in (lambda x, t: x.mse_loss(t), lambda x, t: x.huber_loss(t, delta=0.5),
                 lambda x, t: x.bce_loss(t, from_logits=True),
                 lambda x, t: x.kl_div_loss(t, reduction="sum")):
        outs = []
        for c in (ctx1, ctx2):
            x, t = c.variable(x_np, ("r", "c")), c.variable(t_np, ("r", "c"))
            loss = call(x, t)
            loss.backward()
            outs.append((loss.numpy(), x.grad().numpy(), t.grad().numpy()))
        for u, v in zip(*outs):
            assert_bitwise(u, v)
