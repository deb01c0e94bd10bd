"""cross_entropy (SPEC L-1) against torch, finite differences and its acceptance; a small
classifier trained end to end."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(3)


def test_acceptance(ctx):
    z = ctx.zeros((1, 4), ("b", "c"))
    assert abs(z.cross_entropy("c", [2]).item() - np.log(4)) <= 1e-6
    none = z.cross_entropy("c", [2], reduction="none")
    assert none.tags == ("b",) and abs(none.numpy()[0] - np.log(4)) <= 1e-6


@pytest.mark.parametrize("opts", [
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.2},
    {"ignore_index": 1}, {"ignore_index": 1, "label_smoothing": 0.1, "reduction": "sum"}])
@pytest.mark.parametrize("class_axis", [0, 1, 2])
def test_against_torch(ctx, opts, class_axis):
    shape = [4, 6, 3]
    K = shape[class_axis]
    x_np = (RNG.standard_normal(shape) * 3).astype(np.float32)
    rest = [d for i, d in enumerate(shape) if i != class_axis]
    lab = RNG.integers(0, K, rest)
    tags = ("a", "b", "c")
    x = ctx.variable(x_np, tags)
    loss = x.cross_entropy(tags[class_axis], lab, **opts)
    tx = torch.tensor(x_np, requires_grad=True)
    tl = F.cross_entropy(tx.movedim(class_axis, -1).reshape(-1, K), torch.from_numpy(lab.reshape(-1)),
                         ignore_index=opts.get("ignore_index", -100), reduction=opts.get("reduction", "mean"),
                         label_smoothing=opts.get("label_smoothing", 0.0))
    if opts.get("reduction") == "none":
        w = RNG.standard_normal(rest).astype(np.float32)
        np.testing.assert_allclose(loss.numpy().reshape(-1), tl.detach().numpy(), rtol=1e-5, atol=1e-6)
        (loss * ctx.tensor(w, loss.tags)).sum_all().backward()
        (tl * torch.from_numpy(w.reshape(-1))).sum().backward()
    else:
        np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5, atol=1e-6)
        loss.backward()
        tl.backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_gradcheck_and_thread_invariance(ctx1, ctx2):
    x_np = RNG.standard_normal((3, 5)).astype(np.float32)
    x = ctx1.variable(x_np, ("r", "c"))
    assert fu.gradcheck(lambda v: v.cross_entropy("c", [0, 4, 2], label_smoothing=0.1), [x]).checked == 15
    big = RNG.standard_normal((64, 3000)).astype(np.float32)
    lab = RNG.integers(0, 3000, 64)
    outs = []
    for c in (ctx1, ctx2):
        v = c.variable(big, ("r", "c"))
        loss = v.cross_entropy("c", lab)
        loss.backward()
        outs.append((loss.numpy(), v.grad().numpy()))
    assert_bitwise(outs[0][0], outs[1][0])
    assert_bitwise(outs[0][1], outs[1][1])


def test_backward_writes_over_logits_nobody_else_sees(ctx):
    """The gradient overwrites the logits when no tensor or view but the record holds them (no
    second [rows, classes] buffer: the pool's peak grows by less than one of them), bitwise the
    gradient made beside them; logits the caller still holds are left as they were."""
    R, K, D = 32, 2048, 16
    h_np = RNG.standard_normal((R, D)).astype(np.float32)
    w = ctx.tensor(RNG.standard_normal((D, K)).astype(np.float32), ("d", "c"))
    lab = RNG.integers(0, K, R)
    grads = []
    for keep in (True, False):
        h = ctx.variable(h_np, ("r", "d"))
        logits = h.dot(w, "d")
        before = logits.numpy()
        loss = logits.cross_entropy("c", lab)
        if not keep:
            del logits
        ctx.pool.trim()
        ctx.pool.reset_peak()
        base = ctx.pool.stats()["outstanding_bytes"]
        loss.backward()
        grew = ctx.pool.reset_peak() - base
        grads.append(h.grad().numpy())
        if keep:
            assert grew >= R * K * 4
            assert_bitwise(logits.numpy(), before)
        else:
            assert grew < R * K * 4, grew
    assert_bitwise(grads[1], grads[0])


def test_all_ignored_mean_is_zero(ctx):
    x = ctx.variable([[1.0, 2.0], [3.0, 4.0]], ("r", "c"))
    loss = x.cross_entropy("c", [-100, -100], ignore_index=-100)
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad().numpy().tolist() == [[0, 0], [0, 0]]


def test_python_list_labels_with_the_u64_ignore_index(ctx):
    """fu.llm's IGNORE_INDEX is 2^64 - 1: a plain list mixing it with ids is read as uint64."""
    ign = 2**64 - 1
    x = ctx.tensor(np.array([[1.0, 2.0, 0.5], [3.0, 4.0, 1.0]], np.float32), ("r", "c"))
    got = x.cross_entropy("c", [1, ign], ignore_index=ign).item()
    ref = torch.nn.functional.cross_entropy(torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([1]))
    assert got == pytest.approx(ref.item(), rel=1e-6)


def test_errors(ctx):
    x = ctx.tensor(np.zeros((2, 3), np.float32), ("r", "c"))
    with pytest.raises(fu.InvalidDataLength, match="expected 2 labels"):
        x.cross_entropy("c", [0, 1, 2])
    with pytest.raises(fu.IndexOutOfBounds, match="label 3"):
        x.cross_entropy("c", [0, 3])
    with pytest.raises(fu.InvalidShape):
        x.cross_entropy("c", [0, 1], label_smoothing=1.0)
    with pytest.raises(fu.TagError):
        x.cross_entropy("q", [0, 1])
    with pytest.raises(ValueError):
        x.cross_entropy("c", [0, 1], reduction="avg")
    with pytest.raises(TypeError):
        x.cross_entropy("c", [0, 1], smoothing=0.1)
    assert x.cross_entropy("c", np.array([2**64 - 1, 1], np.uint64), ignore_index=2**64 - 1).item() > 0


def test_classifier_trains_end_to_end():
    """Two spirals, a 2-16-2 tanh MLP, plain SGD written with the ops: loss falls, accuracy rises."""
    rng = np.random.default_rng(0)
    n = 64
    t = np.linspace(0.3, 3.0, n)
    pts = np.concatenate([np.stack([t * np.cos(t), t * np.sin(t)], 1),
                          np.stack([-t * np.cos(t), -t * np.sin(t)], 1)]).astype(np.float32)
    labels = np.array([0] * n + [1] * n)
    with fu.ExecContext(threads=1) as ctx:
        x = ctx.tensor(pts, ("b", "i"))
        w1 = ctx.variable(rng.standard_normal((2, 16)).astype(np.float32), ("i", "h"))
        b1 = ctx.variable(np.zeros(16, np.float32), ("h",))
        w2 = ctx.variable((rng.standard_normal((16, 2)) * 0.5).astype(np.float32), ("h", "c"))
        params = [w1, b1, w2]
        losses = []
        for _ in range(300):
            with ctx.exec_scope():
                logits = (x.dot(w1, "i") + b1).tanh().dot(w2, "h")
                loss = logits.cross_entropy("c", labels)
                losses.append(loss.item())
                loss.backward()
            for p in params:
                g = p.grad()
                p._raw = (p.detach() - g * 0.3)._raw  # SGD on the storage handle (optim arrives later)
                p.zero_grad()
        logits = (x.dot(w1, "i") + b1).tanh().dot(w2, "h")
        acc = float((logits.numpy().argmax(1) == labels).mean())
        del x, w1, b1, w2, params, logits, g, p
    assert losses[-1] < 0.5 * losses[0] and acc >= 0.8, (losses[0], losses[-1], acc)
