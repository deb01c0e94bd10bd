"""Training around the optimizers: clipping and gradient scaling (SPEC T-11, T-7) against
torch.nn.utils.clip_grad_norm_ and the SPEC formula, LrSchedule + warmup_cosine_factor (T-12),
OptimizerSet (T-10), the canonical step (T-1 acceptance) and gradient accumulation (T-13)."""
import math

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise
from test_optim_sum_squares import ref_sum_squares

F = np.float32
RNG = np.random.default_rng(11)


def f32(x):
    return float(np.float32(x))


def grads_into(ctx, opt_params, arrays):
    for w, g in zip(opt_params, arrays):
        w.zero_grad()
        w.backward(grad=ctx.tensor(g, w.tags))


def make_params(ctx, shapes, scale=1.0):
    arrays = [np.asarray(RNG.standard_normal(s) * scale, F) for s in shapes]
    tags = [tuple("abcd"[:len(s)]) for s in shapes]
    return [ctx.variable(a, t) for a, t in zip(arrays, tags)], arrays


SHAPES = [(3, 4), (70_000,), (5,), ()]


# ---------------------------------------------------------------------------------------------
# T-11 / T-7: norms, clipping, scaling

@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_against_torch_and_spec(ctx, max_norm):
    params, _ = make_params(ctx, SHAPES)
    gs = [np.asarray(RNG.standard_normal(s) * 3, F) for s in SHAPES]
    grads_into(ctx, params, gs)
    opt = fu.optim.AdamW()
    for p in params:
        opt.add_param(p)
    sq = [ref_sum_squares(g) for g in gs]
    acc = 0.0
    for s in sq:
        acc += s
    assert opt.grad_squared_norm() == acc
    total = opt.clip_grad_norm(max_norm)
    want_total = f32(math.sqrt(acc))
    assert total == want_total
    coef = np.float32(max_norm) / (np.float32(want_total) + np.float32(1e-6))
    for p, g in zip(params, gs):
        want = g * coef if coef < 1 else g
        assert_bitwise(p.grad().numpy(), np.asarray(want, F))
    # torch: same pre-clip norm (it accumulates in f32: close), same clipped gradients
    tps = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    for tp, g in zip(tps, gs):
        tp.grad = torch.from_numpy(g.copy())
    tnorm = torch.nn.utils.clip_grad_norm_(tps, max_norm)
    assert total == pytest.approx(float(tnorm), rel=2e-6)  # torch sums squares in f32
    for p, tp in zip(params, tps):
        np.testing.assert_allclose(p.grad().numpy(), tp.grad.numpy(), rtol=2e-6, atol=0)


def test_clip_skips_params_without_grad_and_returns_zero(ctx):
    params, _ = make_params(ctx, [(4,), (6,)])
    opt = fu.optim.SGD()
    for p in params:
        opt.add_param(p)
    assert opt.clip_grad_norm(1.0) == 0.0
    assert opt.grad_squared_norm() == 0.0
    g = np.full(6, 2.0, F)
    grads_into(ctx, params[1:], [g])
    assert opt.grad_squared_norm() == 24.0
    assert opt.clip_grad_norm(1.0) == f32(math.sqrt(24.0))
    assert params[0].grad() is None


def test_scale_gradients_in_place(ctx):
    params, _ = make_params(ctx, [(3,), (40,)])
    gs = [RNG.standard_normal(s).astype(F) for s in ((3,), (40,))]
    grads_into(ctx, params, gs)
    opt = fu.optim.Adam()
    for p in params:
        opt.add_param(p)
    view = params[1].grad_view()._raw
    opt.scale_gradients(1 / 3)
    for p, g in zip(params, gs):
        assert_bitwise(p.grad().numpy(), g * np.float32(1 / 3))
    assert params[1].grad_view()._raw is view  # no copy: the accumulator itself was scaled


def test_leaves_of_one_sum_are_each_scaled_once(ctx):
    """`a + b` hands both operands one gradient; each leaf owns a copy, scaled exactly once."""
    a = ctx.variable(np.ones(4, F), ("i",))
    b = ctx.variable(np.ones(4, F), ("i",))
    w = ctx.tensor(np.array([1.0, 2.0, 3.0, 4.0], F), ("i",))
    ((a + b) * w).sum_all().backward()
    assert a.grad_view()._raw.addr != b.grad_view()._raw.addr
    opt = fu.optim.SGD()
    opt.add_param(a)
    opt.add_param(b)
    norm = opt.clip_grad_norm(1.0)
    assert norm == f32(math.sqrt(2 * 30.0))
    coef = np.float32(1.0) / (np.float32(norm) + np.float32(1e-6))
    for t in (a, b):
        assert_bitwise(t.grad().numpy(), w.numpy() * coef)


def test_clip_thread_invariance(ctx1, ctx2):
    out = []
    for c in (ctx1, ctx2):
        ws = [c.variable(np.zeros(s, F), tuple("ab"[:len(s)])) for s in ((300, 301), (7,))]
        gs = [np.random.default_rng(1).standard_normal(s).astype(F) for s in ((300, 301), (7,))]
        grads_into(c, ws, gs)
        opt = fu.optim.SGD()
        for w in ws:
            opt.add_param(w)
        out.append((opt.clip_grad_norm(0.1), [w.grad().numpy() for w in ws]))
    assert out[0][0] == out[1][0]
    for x, y in zip(out[0][1], out[1][1]):
        assert_bitwise(x, y)


# ---------------------------------------------------------------------------------------------
# T-12: schedules

def test_warmup_cosine_acceptance():
    wcf = fu.optim.warmup_cosine_factor
    assert wcf(0, 100, 10, 0.1) == 0.1
    assert wcf(9, 100, 10, 0.1) == 1.0
    assert wcf(100, 100, 10, 0.1) == pytest.approx(0.1, abs=1e-15)
    assert wcf(3, 10, 10, 0.0) == 0.4
    assert wcf(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert wcf(500, 100, 10, 0.1) == pytest.approx(0.1)  # progress is capped at 1
    assert wcf(5, 10, 10, 0.2) == 0.6 and wcf(10, 10, 10, 0.2) == 0.2  # total <= warmup
    assert wcf(0, 10, 0, 0.0) == 1.0


def test_lr_schedule_attach_apply():
    a, b = fu.optim.AdamW(lr=1e-3), fu.optim.SGD(lr=0.1)
    sched = fu.optim.LrSchedule()
    sched.attach(a.config)
    sched.attach(b.config, "lr")
    sched.apply(fu.optim.warmup_cosine_factor(3, 100, 10, 0.1))  # the groups demo: base * 0.4
    assert a.config.lr == f32(1e-3 * 0.4) and b.config.lr == f32(0.1 * 0.4)
    sched.apply(0.5)
    assert a.config.lr == f32(1e-3 * 0.5)  # always from the base, never compounding
    a.config.lr = 2e-3
    sched.attach(a.config)  # re-attach refreshes the base, no duplicate entry
    assert len(sched.entries) == 2
    sched.apply(0.5)
    assert a.config.lr == f32(1e-3) and b.config.lr == f32(0.05)


def test_schedule_drives_the_step(ctx):
    w = ctx.variable(np.zeros(3, F), ("i",))
    opt = fu.optim.SGD(lr=1.0)
    opt.add_param(w)
    sched = fu.optim.LrSchedule()
    sched.attach(opt.config)
    total = 0.0
    for step in range(4):
        f = fu.optim.warmup_cosine_factor(step, 4, 2, 0.0)
        sched.apply(f)
        total += f32(f)
        w.zero_grad()
        w.backward(grad=ctx.tensor(np.ones(3, F), ("i",)))
        opt.step()
    assert w.numpy()[0] == pytest.approx(-total, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# T-10: OptimizerSet

def test_set_global_clip_and_mixed_types(ctx):
    params, arrays = make_params(ctx, [(4, 5), (5,), (30,)])
    gs = [(RNG.standard_normal(a.shape) * 2).astype(F) for a in arrays]
    decay, plain = fu.optim.AdamW(lr=0.01), fu.optim.SGD(lr=0.1, momentum=0.9)
    decay.add_param(params[0])
    plain.add_param(params[1])
    plain.add_param(params[2])
    group = fu.optim.OptimizerSet([decay, plain])
    grads_into(ctx, params, gs)
    assert group.grad_squared_norm() == decay.grad_squared_norm() + plain.grad_squared_norm()
    total = group.clip_grad_norm(1.0)
    tps = [torch.tensor(a.copy(), requires_grad=True) for a in arrays]
    for tp, g in zip(tps, gs):
        tp.grad = torch.from_numpy(g.copy())
    assert total == pytest.approx(float(torch.nn.utils.clip_grad_norm_(tps, 1.0)), rel=2e-6)
    for p, tp in zip(params, tps):  # one global coefficient across both members
        np.testing.assert_allclose(p.grad().numpy(), tp.grad.numpy(), rtol=2e-6)
    group.step()
    tdecay = torch.optim.AdamW([tps[0]], lr=0.01, foreach=False)
    tplain = torch.optim.SGD(tps[1:], lr=0.1, momentum=0.9, foreach=False)
    tdecay.step()
    tplain.step()
    for p, tp in zip(params, tps):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    group.zero_grad()
    assert all(p.grad() is None for p in params)
    grads_into(ctx, params, gs)
    group.scale_gradients(0.5)
    assert_bitwise(params[2].grad().numpy(), gs[2] * np.float32(0.5))


def test_set_rejects_a_param_in_two_members(ctx):
    a = ctx.variable(np.ones(3, F), ("i",))
    b = ctx.variable(np.ones(2, F), ("j",))
    c = ctx.variable(np.ones(2, F), ("k",))
    o1, o2, o3 = fu.optim.SGD(), fu.optim.Adam(), fu.optim.AdamW()
    o1.add_param(a)
    o2.add_param(b)
    o2.add_param(a)  # legal inside o2 alone: the set is what sees it
    o3.add_param(c)
    group = fu.optim.OptimizerSet([o1])
    with pytest.raises(fu.optim.DuplicateParam, match="another optimizer"):
        group.add(o2)
    assert group.members == [o1] and len(group._leaves) == 1  # unchanged
    group.add(o3)
    assert group.members == [o1, o3]
    with pytest.raises(fu.optim.DuplicateParam):
        fu.optim.OptimizerSet([o3, o3])


# ---------------------------------------------------------------------------------------------
# T-1: the canonical step

def test_canonical_step_acceptance(ctx):
    """2×2 linear + CE, AdamW lr 0.05 wd 0.01, 20 steps: the last loss is below the first."""
    x = ctx.tensor(np.array([[1.0, 0.0], [0.0, 1.0]], F), ("batch", "in"))
    labels = [1, 0]
    w1 = ctx.variable(np.array([[0.1, -0.2], [0.3, 0.05]], F), ("in", "class"))
    b1 = ctx.variable(np.zeros(2, F), ("class",))
    opt = fu.optim.AdamW(lr=0.05, weight_decay=0.01)
    opt.add_param(w1)
    opt.add_param(b1)
    sched = fu.optim.LrSchedule()
    sched.attach(opt.config, "lr")
    total, warmup = 20, 2
    losses = []
    for step in range(total):
        sched.apply(fu.optim.warmup_cosine_factor(step, total, warmup, 0.1))
        scope = ctx.open_exec_scope()
        try:
            loss = x.dot(w1, "in").add(b1).tanh().cross_entropy("class", labels)
            losses.append(loss.item())
            loss.backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        finally:
            ctx.close_exec_scope(scope)
    assert losses[-1] < losses[0]
    assert w1.grad() is None


# ---------------------------------------------------------------------------------------------
# T-13: gradient accumulation

def _batch(n, k=5, d=4, seed=0):
    r = np.random.default_rng(seed)
    return r.standard_normal((n, d)).astype(F), r.integers(0, k, n)


def _accumulate(ctx, xs, ys, w0, scale, reduction="mean", ignore_index=None, one_scope=False):
    """N micro-batch loss+backward passes (loss-side normalization `scale`), no step."""
    w = ctx.variable(w0, ("in", "class"))
    outer = ctx.open_exec_scope() if one_scope else None
    for x, y in zip(xs, ys):
        scope = None if one_scope else ctx.open_exec_scope()
        loss = ctx.tensor(x, ("row", "in")).dot(w, "in").cross_entropy(
            "class", y, ignore_index=ignore_index, reduction=reduction)
        loss.scale(scale).backward()
        if scope is not None:
            ctx.close_exec_scope(scope)
    if outer is not None:
        ctx.close_exec_scope(outer)
    return w


def test_accumulated_mean_of_means_matches_big_batch(ctx):
    N, B = 4, 8
    x, y = _batch(N * B)
    w0 = np.random.default_rng(1).standard_normal((4, 5)).astype(F)
    xs, ys = np.split(x, N), np.split(y, N)
    w = _accumulate(ctx, xs, ys, w0, 1.0 / N)
    tw = torch.tensor(w0, requires_grad=True)
    torch.nn.functional.cross_entropy(torch.from_numpy(x) @ tw, torch.from_numpy(y)).backward()
    # equal-size micro-batches: mean of means == the big batch's mean, to ~1e-5 relative
    np.testing.assert_allclose(w.grad().numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_accumulated_grads_are_bitwise_reproducible(ctx1, ctx2):
    N = 3
    x, y = _batch(3 * 7, seed=4)
    w0 = np.random.default_rng(2).standard_normal((4, 5)).astype(F)
    xs, ys = np.split(x, N), np.split(y, N)
    runs = [_accumulate(c, xs, ys, w0, 1.0 / N).grad().numpy() for c in (ctx1, ctx1, ctx2)]
    runs.append(_accumulate(ctx1, xs, ys, w0, 1.0 / N, one_scope=True).grad().numpy())
    for r in runs[1:]:
        assert_bitwise(r, runs[0])


def test_exact_token_mean_with_sum_and_total_valid(ctx):
    """reduction="sum" with loss_scale = 1/total_valid (non-ignored labels across the window,
    counted first) is the true token mean even with unequal supervised counts."""
    x, y = _batch(20, seed=5)
    y[[1, 2, 3, 11, 17]] = -100
    w0 = np.random.default_rng(3).standard_normal((4, 5)).astype(F)
    cuts = [0, 3, 12, 20]  # unequal micro-batches
    xs = [x[a:b] for a, b in zip(cuts, cuts[1:])]
    ys = [y[a:b] for a, b in zip(cuts, cuts[1:])]
    total_valid = int((y != -100).sum())
    w = _accumulate(ctx, xs, ys, w0, 1.0 / total_valid, "sum", ignore_index=-100)
    tw = torch.tensor(w0, requires_grad=True)
    torch.nn.functional.cross_entropy(torch.from_numpy(x) @ tw, torch.from_numpy(y),
                                      ignore_index=-100).backward()
    np.testing.assert_allclose(w.grad().numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-7)
    # mean + 1/N here is a mean of means: not the token mean
    w2 = _accumulate(ctx, xs, ys, w0, 1.0 / 3, "mean", ignore_index=-100)
    assert not np.allclose(w2.grad().numpy(), tw.grad.numpy(), rtol=1e-3)


def test_grad_side_scaling_is_deterministic_and_close(ctx):
    N = 3
    x, y = _batch(3 * 6, seed=6)
    w0 = np.random.default_rng(4).standard_normal((4, 5)).astype(F)
    xs, ys = np.split(x, N), np.split(y, N)
    loss_side = _accumulate(ctx, xs, ys, w0, 1.0 / N).grad().numpy()
    grad_side = []
    for _ in range(2):
        w = _accumulate(ctx, xs, ys, w0, 1.0)
        opt = fu.optim.SGD()
        opt.add_param(w)
        opt.scale_gradients(1.0 / N)
        grad_side.append(w.grad().numpy())
    assert_bitwise(grad_side[0], grad_side[1])
    np.testing.assert_allclose(grad_side[0], loss_side, rtol=1e-6, atol=1e-8)


def test_window_then_one_clip_step_zero_grad(ctx):
    """N micro-batches, then one clip -> step -> zero_grad: the step sees the whole window."""
    N = 2
    x, y = _batch(2 * 5, seed=7)
    w0 = np.random.default_rng(5).standard_normal((4, 5)).astype(F)
    xs, ys = np.split(x, N), np.split(y, N)
    w = _accumulate(ctx, xs, ys, w0, 1.0 / N)
    opt = fu.optim.SGD(lr=0.5)
    opt.add_param(w)
    g = w.grad().numpy()
    norm = opt.clip_grad_norm(0.01)
    opt.step()
    opt.zero_grad()
    coef = np.float32(0.01) / (np.float32(norm) + np.float32(1e-6))
    assert_bitwise(w.numpy(), w0 - np.float32(0.5) * (g * coef))
    assert w.grad() is None and opt.state_of(w)["step"] == 1
