"""Activation checkpointing (SPEC T-14, §3.19): gradients bitwise equal to the plain forward,
O(inputs + output) retention, dropout replay, ownership, every error, threads, leaks, memory."""
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise

try:
    from examples import checkpointing as demo
except ImportError:  # pytest started without the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples import checkpointing as demo

RNG = np.random.default_rng(7)
N, D, F = 6, 8, 12


def rnd(*shape, s=1.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


# ---- a real multi-layer block: matmul + bias + gelu/tanh + rms_norm + softmax ----

def layer(h, w1, b1, w2, g, c):
    """h[n, d] -> softmax_d(rms_norm(h + tanh(gelu(h·w1 + b1)·w2)) * g + c); c a constant."""
    a = (h.matmul(w1, "plain", ("n", "f")) + b1).gelu_erf()
    z = a.matmul(w2, "plain", ("n", "d")).tanh()
    y = (h + z).rms_norm("d", 1e-6, weight=g)
    return (y + c).softmax("d", scale=2.0)


def torch_layer(h, w1, b1, w2, g, c):
    a = torch.nn.functional.gelu(h @ w1 + b1)
    z = torch.tanh(a @ w2)
    y = torch.nn.functional.rms_norm(h + z, (h.shape[-1],), g, 1e-6)
    return torch.softmax((y + c) * 2.0, -1)


LAYER_DATA = dict(x=rnd(N, D), w1=rnd(D, F, s=0.4), b1=rnd(F, s=0.1), w2=rnd(F, D, s=0.4),
                  g=1.0 + rnd(D, s=0.1), c=rnd(D, s=0.5), t=rnd(N, D))
LAYER_TAGS = dict(x=("n", "d"), w1=("d", "f"), b1=("f",), w2=("f", "d"), g=("d",), c=("d",), t=("n", "d"))
TRAINABLE = ("x", "w1", "b1", "w2", "g")


def two_layer_loss(ctx, checkpointed, h1_outside=False):
    """The block used twice (shared weights); returns (loss value, output, {name: grad}).
    h1_outside: the first block's output also feeds the loss directly (besides block 2)."""
    v = {k: (ctx.variable if k in TRAINABLE else ctx.tensor)(a, LAYER_TAGS[k]) for k, a in LAYER_DATA.items()}
    run = (lambda *a: fu.checkpoint(layer, *a)) if checkpointed else layer
    with ctx.exec_scope():
        h1 = run(v["x"], v["w1"], v["b1"], v["w2"], v["g"], v["c"])
        h2 = run(h1, v["w1"], v["b1"], v["w2"], v["g"], v["c"])
        loss = (h2 * v["t"]).sum_all() + (h1 if h1_outside else h2).sum("d").mean_all()
        loss.backward()
        out = (loss.item(), h2.numpy())
    return out + ({k: v[k].grad().numpy() for k in TRAINABLE},)


def test_gradients_bitwise_equal_to_the_plain_forward(ctx):
    loss_p, out_p, grads_p = two_layer_loss(ctx, False)
    loss_c, out_c, grads_c = two_layer_loss(ctx, True)
    assert loss_p == loss_c
    assert_bitwise(out_c, out_p)
    for k in TRAINABLE:
        assert_bitwise(grads_c[k], grads_p[k])
        assert np.abs(grads_c[k]).max() > 0


def test_an_input_also_used_outside_sums_its_gradient_in_another_order(ctx):
    """h1 feeds block 2 twice (matmul, residual) and the loss directly: block 2's checkpoint
    hands h1 one gradient (its two parts already summed) where the plain graph adds the three
    parts one by one — the same up to the rounding of float addition order."""
    _, out_p, grads_p = two_layer_loss(ctx, False, h1_outside=True)
    _, out_c, grads_c = two_layer_loss(ctx, True, h1_outside=True)
    assert_bitwise(out_c, out_p)
    for k in TRAINABLE:
        np.testing.assert_allclose(grads_c[k], grads_p[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("h1_outside", [False, True])
def test_real_block_against_torch(ctx, h1_outside):
    loss, out, grads = two_layer_loss(ctx, True, h1_outside)
    tv = {k: torch.tensor(a, requires_grad=k in TRAINABLE) for k, a in LAYER_DATA.items()}
    a = [tv[k] for k in ("w1", "b1", "w2", "g", "c")]
    h1 = torch_layer(tv["x"], *a)
    h2 = torch_layer(h1, *a)
    tl = (h2 * tv["t"]).sum() + (h1 if h1_outside else h2).sum(-1).mean()
    tl.backward()
    assert abs(loss - tl.item()) <= 1e-5
    np.testing.assert_allclose(out, h2.detach().numpy(), rtol=1e-5, atol=1e-6)
    for k in TRAINABLE:
        np.testing.assert_allclose(grads[k], tv[k].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_gradcheck_through_a_checkpoint(ctx):
    x = ctx.variable(rnd(3, 4), ("n", "d"))
    w = ctx.variable(rnd(4, 4, s=0.5), ("k", "d"))
    b = ctx.variable(rnd(4, s=0.1), ("d",))
    r = fu.gradcheck(lambda *a: fu.checkpoint(demo.block, *a).rms_norm("d", 1e-6).sum("d").tanh()
                     .sum_all(), [x, w, b])
    assert r.checked == 12 + 16 + 4


def test_gradients_bitwise_at_one_and_two_threads(ctx1, ctx2):
    runs = [two_layer_loss(c, True) for c in (ctx1, ctx2)]
    assert runs[0][0] == runs[1][0]
    assert_bitwise(runs[0][1], runs[1][1])
    for k in TRAINABLE:
        assert_bitwise(runs[0][2][k], runs[1][2][k])


# ---- SPEC T-14 acceptances and calling forms ----

def test_acceptance_tanh_of_x_dot_w(ctx):
    x = ctx.tensor([1.0, 2.0], ("d",))
    w = ctx.variable([0.5, -0.25], ("d",))
    y = fu.checkpoint(lambda x, w: x.dot(w, "d").tanh(), x, w)
    assert y.requires_grad and y.numpy().tolist() == 0.0
    y.backward()
    assert w.grad().numpy().tolist() == [1.0, 2.0]


def test_acceptance_with_context(ctx):
    x = ctx.variable([1.0, 2.0], ("d",))
    w = ctx.tensor([3.0, 4.0], ("d",))
    y = fu.checkpoint_with_context(lambda alpha, x, w: (x * w).scale(alpha).sum_all(), 0.5, x, w)
    y.backward()
    assert x.grad().numpy().tolist() == [1.5, 2.0]


def test_trailing_tuple_form_is_bitwise_identical(ctx):
    def spread(scale, x, w, b):
        return demo.block(x, w, b).scale(scale)

    def packed(scale, inputs):  # one trailing tuple parameter carrying every input
        x, w, b = inputs
        return demo.block(x, w, b).scale(scale)

    forms = {
        "no checkpoint": lambda x, w, b: spread(1.5, x, w, b),
        "spread": lambda x, w, b: fu.checkpoint_with_context(spread, 1.5, x, w, b),
        "tuple": lambda x, w, b: fu.checkpoint_with_context(packed, 1.5, (x, w, b)),
        "spread, no extra": lambda x, w, b: fu.checkpoint(lambda *a: spread(1.5, *a), x, w, b),
        "list, no extra": lambda x, w, b: fu.checkpoint(lambda t: packed(1.5, t), [x, w, b]),
    }
    results = []
    for run in forms.values():
        x = ctx.variable(LAYER_DATA["x"], ("n", "d"))
        w = ctx.variable(LAYER_DATA["w1"][:, :D], ("k", "d"))
        b = ctx.variable(LAYER_DATA["g"], ("d",))
        with ctx.exec_scope():
            y = run(x, w, b)
            (y * y).sum_all().backward()
            results.append([y.numpy()] + [t.grad().numpy() for t in (x, w, b)])
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert_bitwise(got, want)


def test_input_passed_twice_and_identity_block(ctx):
    x = ctx.variable([1.0, -2.0, 3.0], ("n",))
    (x * x * x).sum_all().backward()
    want = x.grad().numpy()
    x.zero_grad()
    fu.checkpoint(lambda a, b, c: a * b * c, x, x, x).sum_all().backward()
    assert_bitwise(x.grad().numpy(), want)
    x.zero_grad()
    y = fu.checkpoint(lambda a: a, x)  # the block's output is its input: still a fresh copy
    assert y.data_const().__array_interface__["data"][0] != x.data_const().__array_interface__["data"][0]
    y.backward(grad=ctx.tensor([1.0, 2.0, 3.0], ("n",)))
    assert x.grad().numpy().tolist() == [1.0, 2.0, 3.0]


def test_extra_is_kept_by_reference_and_gets_no_gradient(ctx):
    seen = []

    class Layer:  # frozen state a block reads through extra: a constant weight and a config
        def __init__(self):
            self.w = ctx.tensor([2.0, -1.0], ("d",))
            self.shift = 0.25

    def block(layer, x):
        seen.append(layer)
        return (x * layer.w).add_scalar(layer.shift).tanh()

    lay = Layer()
    x = ctx.variable([0.5, 1.5], ("d",))
    fu.checkpoint_with_context(block, lay, x).sum_all().backward()
    assert len(seen) == 2 and seen[0] is lay and seen[1] is lay  # forward + recompute, no copy
    t = np.tanh(np.float32([1.25, -1.25]))
    np.testing.assert_allclose(x.grad().numpy(), (1 - t * t) * np.float32([2.0, -1.0]), rtol=1e-6)
    assert not lay.w.requires_grad


# ---- retention and ownership ----

CHAIN = dict(x=rnd(N, D), w=[rnd(D, D, s=0.3) for _ in range(8)], b=[rnd(D, s=0.1) for _ in range(8)])


def chain(ctx, checkpointed):
    """An 8-block chain (3 ops per block) under a scope: (scope entries, pool buffers) it retains."""
    x = ctx.variable(CHAIN["x"], ("n", "d"))
    params = [(ctx.variable(w, ("k", "d")), ctx.variable(b, ("d",))) for w, b in zip(CHAIN["w"], CHAIN["b"])]

    def block(h, w, b):
        return (h.matmul(w, "plain", ("n", "d")) + b).tanh()

    buffers = ctx.pool.outstanding_buffers()
    scope = ctx.open_exec_scope()
    entries = len(ctx._adopted)
    h = x
    for w, b in params:
        h = fu.checkpoint(block, h, w, b) if checkpointed else block(h, w, b)
    retained = (len(ctx._adopted) - entries, ctx.pool.outstanding_buffers() - buffers)
    h.sum_all().backward()
    grads = [p.grad().numpy() for wb in params for p in wb]
    ctx.close_exec_scope(scope)
    return retained, grads


def test_an_8_block_chain_retains_8_scope_entries_instead_of_24(ctx):
    (plain, grads_p), (ckpt, grads_c) = chain(ctx, False), chain(ctx, True)
    assert plain == (24, 24)
    assert ckpt == (8, 8)
    for got, want in zip(grads_c, grads_p):
        assert_bitwise(got, want)


def test_output_ownership_follows_the_scope(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    y = fu.checkpoint(lambda a: (a * 2.0).tanh(), x)
    assert y.requires_grad and not y.scope_owned
    with ctx.exec_scope():
        z = fu.checkpoint(lambda a: (a * 2.0).tanh(), x)
        assert z.scope_owned
        z.sum_all().backward()
    with pytest.raises(fu.UseAfterRelease):
        z.numpy()
    assert y.numpy().tolist() == pytest.approx(np.tanh([2.0, 4.0]).tolist())


def test_no_input_requiring_grad_is_a_plain_forward(ctx):
    x = ctx.tensor([0.5, -1.0], ("n",))
    c = ctx.tensor([2.0, 3.0], ("n",))
    y = fu.checkpoint(lambda a, b: (a * b).tanh(), x, c)
    assert not y.requires_grad and not y.scope_owned
    assert_bitwise(y.numpy(), (x * c).tanh().numpy())
    with pytest.raises(fu.NoGradientGraph):
        y.sum_all().backward()
    with ctx.exec_scope():
        before = len(ctx._adopted)
        z = fu.checkpoint(lambda a, b: (a * b).tanh(), x, c)
        assert z.scope_owned and len(ctx._adopted) == before + 1 and not z.requires_grad


def test_no_grad_does_not_affect_the_outer_node(ctx):
    x = ctx.variable([0.5, -1.0], ("n",))
    with fu.no_grad():
        y = fu.checkpoint(lambda a: (a * a).tanh(), x)
        assert y.requires_grad and not (x * 1.0).requires_grad
        y.backward(grad=ctx.ones((2,), ("n",)))  # the recompute records its graph under no_grad too
        assert not fu.is_grad_enabled()
    t = np.tanh(np.float32([0.25, 1.0]))
    np.testing.assert_allclose(x.grad().numpy(), (1 - t * t) * 2 * np.float32([0.5, -1.0]), rtol=1e-6)


def test_dropout_inside_a_block_replays_bitwise(ctx):
    def block(h, w, b):
        return demo.block(h, w, b).dropout(0.4, seed=1234)

    grads = []
    for checkpointed in (False, True):
        x = ctx.variable(LAYER_DATA["x"], ("n", "d"))
        w = ctx.variable(LAYER_DATA["w1"][:, :D], ("k", "d"))
        b = ctx.variable(LAYER_DATA["b1"][:D], ("d",))
        with ctx.exec_scope():
            y = fu.checkpoint(block, x, w, b) if checkpointed else block(x, w, b)
            (y * y).sum_all().backward()
            grads.append([y.numpy()] + [t.grad().numpy() for t in (x, w, b)])
    dropped = grads[1][0] == 0
    assert 0 < dropped.sum() < dropped.size
    for got, want in zip(grads[1], grads[0]):
        assert_bitwise(got, want)


# ---- errors ----

def test_checkpoint_output_not_differentiable(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    y = fu.checkpoint(lambda a: a.detach() * 2.0, x)
    assert y.requires_grad  # decided by the inputs; the recompute finds no graph
    with pytest.raises(fu.CheckpointOutputNotDifferentiable, match="no gradient graph"):
        y.sum_all().backward()
    assert not ctx.scopes


def test_checkpoint_missing_input_gradient(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    w = ctx.variable([3.0, 4.0], ("n",))
    y = fu.checkpoint(lambda a, b: a * 2.0, x, w)
    with pytest.raises(fu.CheckpointMissingInputGradient, match="input 1"):
        y.sum_all().backward()


def test_nested_checkpoint_recompute_is_refused_and_the_lock_released(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))

    def inner(a):
        return (a * a).tanh()

    def outer(a):
        return fu.checkpoint(inner, a).scale(2.0)

    y = fu.checkpoint(outer, x)  # forward: grad-free, the inner call is a plain forward
    assert_bitwise(y.numpy(), inner(x.detach()).scale(2.0).numpy())
    with pytest.raises(fu.NestedCheckpointRecompute, match="inside another checkpoint"):
        y.sum_all().backward()
    assert not ctx.scopes
    fu.checkpoint(inner, x).sum_all().backward()  # neither the mutex nor the flag stayed held
    assert x.grad() is not None


def test_trainable_tensor_through_extra_or_a_closure_is_refused(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    w = ctx.variable([3.0, 4.0], ("n",))
    y = fu.checkpoint_with_context(lambda ww, a: a * ww, w, x)
    with pytest.raises(fu.UnsupportedGradient, match="not one of its inputs"):
        y.sum_all().backward()
    assert w.grad() is None and x.grad() is None
    h = w * 2.0  # an outer graph reached through a closure is not back-propagated twice
    z = fu.checkpoint(lambda a: a * h, x)
    with pytest.raises(fu.UnsupportedGradient):
        (z.sum_all() + h.sum_all()).backward()
    assert w.grad() is None


def test_bad_inputs_and_outputs(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    with pytest.raises(TypeError, match="at least one input"):
        fu.checkpoint(lambda: x)
    with pytest.raises(TypeError, match="input 1: expected a Tensor"):
        fu.checkpoint(lambda a, b: a, x, [1.0, 2.0])
    with pytest.raises(TypeError, match="callable"):
        fu.checkpoint(None, x)
    with pytest.raises(fu.DTypeError, match="input 0: expected an f32"):
        fu.checkpoint(lambda a: a, ctx.tensor([1, 2], ("n",), dtype="i64"))
    with pytest.raises(fu.DTypeError, match="input 0: expected an f32"):
        fu.checkpoint(lambda a: a, ctx.variable([1, 2], ("n",), dtype="bf16"))
    with pytest.raises(TypeError, match="must return a Tensor"):
        fu.checkpoint(lambda a: 3.0, x)
    with pytest.raises(fu.DTypeError, match="return an f32"):
        fu.checkpoint(lambda a: a.to("f16"), x)
    with fu.ExecContext(threads=1) as other:
        o = other.tensor([1.0, 2.0], ("n",))
        with pytest.raises(fu.ContextMismatch):
            fu.checkpoint(lambda a, b: a, x, o)
        del o
    with pytest.raises(fu.TagError):  # a failing block leaves no scope open
        fu.checkpoint(lambda a: a.sum("nope"), x)
    assert not ctx.scopes
    calls = []

    def growing(a):  # not deterministic: the recompute returns another shape
        calls.append(1)
        return a if len(calls) == 1 else a.narrow("n", 0, 1)

    y = fu.checkpoint(growing, x)
    with pytest.raises(fu.ShapeMismatch, match="deterministic"):
        y.sum_all().backward()


# ---- threads, leaks, memory ----

def test_recomputes_are_serialized_across_python_threads():
    state = {"inside": 0, "max": 0}
    guard = threading.Lock()
    barrier = threading.Barrier(2)
    results = [None, None]
    w_np = rnd(64, 64, s=0.2)

    def block(x, w):
        if fu.is_grad_enabled():  # the recompute (the forward runs grad-free)
            with guard:
                state["inside"] += 1
                state["max"] = max(state["max"], state["inside"])
            time.sleep(0.02)  # widen the window in which an unserialized recompute would overlap
            with guard:
                state["inside"] -= 1
        return x.matmul(w, "plain", ("n", "d")).tanh()

    def worker(i):
        with fu.ExecContext(threads=1) as c:
            x = c.tensor(np.full((4, 64), i + 1.0, np.float32), ("n", "d"))
            w = c.variable(w_np, ("k", "d"))
            with c.exec_scope():
                y = fu.checkpoint(block, x, w).sum_all()
                barrier.wait()
                y.backward()
            results[i] = w.grad().numpy()
            del x, w, y

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["max"] == 1
    for i in range(2):
        xt = torch.full((4, 64), i + 1.0)
        wt = torch.tensor(w_np, requires_grad=True)
        torch.tanh(xt @ wt).sum().backward()
        np.testing.assert_allclose(results[i], wt.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_no_pooled_buffer_leaks(monkeypatch):
    monkeypatch.setenv("FUCINA_DEBUG", "1")  # the context's close() raises on a leak
    c = fu.ExecContext(threads=2)
    base = c.pool.outstanding_buffers()
    two_layer_loss(c, True)
    x = c.variable([1.0, 2.0], ("n",))
    with pytest.raises(fu.CheckpointMissingInputGradient):
        fu.checkpoint(lambda a, b: a * 2.0, x, c.variable([1.0], ("m",))).sum_all().backward()
    with pytest.raises(fu.NestedCheckpointRecompute):
        fu.checkpoint(lambda a: fu.checkpoint(lambda b: b * b, a), x).sum_all().backward()
    y = fu.checkpoint(lambda a: a * 3.0, x)
    assert c.pool.outstanding_buffers() > base
    del x, y
    assert c.pool.outstanding_buffers() == base + len(c._constants)  # only the cached fill values
    c.close()


def peak_activations(checkpointed, blocks, backward):
    """Peak pool bytes above the parameters of a residual chain (one shared weight), forward
    only or forward + backward, in units of one activation."""
    with fu.ExecContext(threads=1) as c:
        meter = demo.PoolMeter(c)
        x = c.variable(rnd(128, 32), ("n", "d"))
        w = c.variable(rnd(32, 32, s=0.1), ("k", "d"))
        b = c.variable(rnd(32, s=0.1), ("d",))
        meter.reset_peak()
        base = meter.live
        with c.exec_scope():
            h = x
            for _ in range(blocks):
                h = fu.checkpoint(demo.block, h, w, b) if checkpointed else demo.block(h, w, b)
            if backward:
                h.sum_all().backward()
        del x, w, b, h
    return (meter.peak - base) / (128 * 32 * 4)


def test_peak_pool_bytes_grow_by_one_output_per_checkpointed_block():
    for backward in (False, True):
        plain = [peak_activations(False, L, backward) for L in (8, 16)]
        ckpt = [peak_activations(True, L, backward) for L in (8, 16)]
        # 8 more blocks: the plain chain keeps 4 activations each, the checkpointed one 1 (its output)
        assert (plain[1] - plain[0]) / 8 >= 4.0
        assert (ckpt[1] - ckpt[0]) / 8 <= 1.0 + 1e-9
        # on top of the 16 outputs: one block's working set (4), the gradients in flight, and
        # the parameter gradients; the plain chain holds 4 per block
        assert ckpt[1] <= 16 + 10 and plain[1] >= 4 * 16


def test_the_example_trains_identically_with_less_memory():
    res = demo.run(steps=2, blocks=6, batch=64, width=32, threads=1)
    (plain_losses, plain_peak), (ckpt_losses, ckpt_peak) = res[False], res[True]
    assert plain_losses == ckpt_losses and plain_losses[1] < plain_losses[0]
    assert ckpt_peak < plain_peak
