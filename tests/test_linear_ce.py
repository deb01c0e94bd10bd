"""linear_cross_entropy (SPEC L-2) against torch's composed F.cross_entropy(x @ w.T, ...):
values and both gradients in every reduction with ignore_index and label smoothing, finite
differences, the single-use record, the memory claim (no second [rows, classes] buffer in the
backward, shown by the pool's peak counter), bitwise thread invariance, bad input; and the
cross-entropy loss reduction as one serial sum in row order (L-1)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(21)


def rand(*shape, s=1.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


def run(ctx, x, w, labels, **opts):
    X, Wt = ctx.variable(x, ("row", "d")), ctx.variable(w, ("class", "d"))
    y = X.linear_cross_entropy(Wt, labels, **opts)
    if y.numel == 1:
        y.backward()
    else:
        y.backward(grad=ctx.tensor(np.linspace(0.5, 1.5, y.numel, dtype=np.float32), y.tags))
    return y.numpy(), X.grad().numpy(), Wt.grad().numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore,smooth", [(None, 0.0), (-100, 0.0), (3, 0.1)])
def test_against_torch(ctx, reduction, ignore, smooth):
    R, D, K = 9, 16, 37
    x, w = rand(R, D), rand(K, D, s=0.5)
    labels = RNG.integers(0, K, R)
    if ignore is not None:
        labels[[1, 4]] = ignore
    opts = dict(reduction=reduction, label_smoothing=smooth)
    if ignore is not None:
        opts["ignore_index"] = ignore
    y, dx, dw = run(ctx, x, w, labels, **opts)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = F.cross_entropy(tx @ tw.T, torch.from_numpy(labels),
                         ignore_index=-100 if ignore is None else ignore,
                         reduction=reduction, label_smoothing=smooth)
    if ty.ndim:
        ty.backward(torch.linspace(0.5, 1.5, ty.numel()))
    else:
        ty.backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_all_ignored_is_zero(ctx):
    y, dx, dw = run(ctx, rand(3, 4), rand(5, 4), [-1, -1, -1], ignore_index=-1)
    assert y == 0.0 and not dx.any() and not dw.any()


def test_gradcheck(ctx1):
    x = ctx1.variable(rand(4, 3), ("row", "d"))
    w = ctx1.variable(rand(6, 3), ("class", "d"))
    fu.gradcheck(lambda a, b: a.linear_cross_entropy(b, [0, 5, 2, 2], label_smoothing=0.2),
                 [x, w], eps=1e-2, abs_tol=2e-3, rel_tol=2e-2)


def test_single_use_record(ctx):
    X, Wt = ctx.variable(rand(4, 8), ("row", "d")), ctx.variable(rand(6, 8), ("class", "d"))
    y = X.linear_cross_entropy(Wt, [0, 1, 2, 3])
    vjp = y._node.vjp      # the record's VJP, as another engine would hold it
    y.backward()
    with pytest.raises(fu.BackwardAlreadyRun):
        y.backward()
    with pytest.raises(fu.LinearCrossEntropyBackwardConsumed, match="already ran"):
        vjp(ctx.tensor(1.0, ())._raw)


def test_backward_allocates_no_second_logits_buffer():
    R, D, K = 256, 64, 8192
    with fu.ExecContext(threads=2) as ctx:
        X, Wt = ctx.variable(rand(R, D), ("row", "d")), ctx.variable(rand(K, D, s=0.1), ("class", "d"))
        labels = RNG.integers(0, K, R)
        y = X.linear_cross_entropy(Wt, labels)
        pool = ctx._ctx.pool if hasattr(ctx, "_ctx") else ctx.pool
        before = pool.stats()["outstanding_bytes"]
        pool.reset_peak()
        y.backward()
        grown = pool.stats()["peak_bytes"] - before
        logits = R * K * 4
        # dW [K, D], dx [R, D] and the scratch of one block of classes are new; the [R, K]
        # gradient is not (it overwrites the saved logits)
        assert K * D * 4 <= grown < K * D * 4 + logits // 4, (grown, logits)


def test_thread_invariance(ctx1, ctx2):
    x, w = rand(70, 48), rand(3000, 48, s=0.3)
    labels = RNG.integers(0, 3000, 70)
    a = run(ctx1, x, w, labels, label_smoothing=0.05)
    b = run(ctx2, x, w, labels, label_smoothing=0.05)
    for u, v in zip(a, b):
        assert_bitwise(u, v)


def test_ce_reduction_is_a_serial_sum_in_row_order(ctx):
    x = rand(1000, 50, s=3.0)
    labels = RNG.integers(0, 50, 1000)
    X = ctx.tensor(x, ("row", "class"))
    per_row = X.cross_entropy("class", labels, reduction="none").numpy()
    want = np.float32(0.0)
    for v in per_row:
        want = np.float32(want + v)
    assert_bitwise(X.cross_entropy("class", labels, reduction="sum").numpy(), np.array(want))
    assert_bitwise(X.cross_entropy("class", labels).numpy(), np.array(np.float32(want / np.float32(1000))))
    Xv, Wv = ctx.tensor(x[:, :8], ("row", "d")), ctx.tensor(rand(50, 8), ("class", "d"))
    per_row = Xv.linear_cross_entropy(Wv, labels, reduction="none").numpy()
    want = np.float32(0.0)
    for v in per_row:
        want = np.float32(want + v)
    assert_bitwise(Xv.linear_cross_entropy(Wv, labels, reduction="sum").numpy(), np.array(want))


def test_bad_input(ctx):
    X = ctx.tensor(rand(4, 8), ("row", "d"))
    W = ctx.tensor(rand(6, 8), ("class", "d"))
    with pytest.raises(fu.TagError, match="shared axis last"):
        X.linear_cross_entropy(ctx.tensor(rand(8, 6), ("d", "class")), [0] * 4)
    with pytest.raises(fu.TagError, match="must not be an axis"):
        X.linear_cross_entropy(ctx.tensor(rand(4, 8), ("row", "d")), [0] * 4)
    with pytest.raises(fu.ShapeMismatch, match="8 'd' features"):
        X.linear_cross_entropy(ctx.tensor(rand(6, 5), ("class", "d")), [0] * 4)
    with pytest.raises(fu.InvalidShape, match="rank >= 2"):
        ctx.tensor(rand(8), ("d",)).linear_cross_entropy(W, [0])
    with pytest.raises(fu.InvalidShape, match="weight of rank 2"):
        X.linear_cross_entropy(ctx.tensor(rand(1, 6, 8), ("x", "class", "d")), [0] * 4)
    with pytest.raises(fu.DTypeError, match="weight of dtype f32"):
        X.linear_cross_entropy(ctx.tensor(rand(6, 8), ("class", "d"), dtype="f16"), [0] * 4)
    with pytest.raises(fu.IndexOutOfBounds, match="outside"):
        X.linear_cross_entropy(W, [0, 1, 6, 2])
    with pytest.raises(fu.InvalidDataLength):
        X.linear_cross_entropy(W, [0, 1])
    with pytest.raises(ValueError, match="reduction"):
        X.linear_cross_entropy(W, [0] * 4, reduction="batchmean")
    with pytest.raises(fu.InvalidShape, match="label_smoothing"):
        X.linear_cross_entropy(W, [0] * 4, label_smoothing=1.0)


def test_tagged_labels_must_follow_the_logits_axis_order(ctx):
    """Labels given as an i64 tensor pair with positions by tag: another axis order (or other
    tags) is refused rather than silently pairing the wrong rows."""
    x = ctx.tensor(rand(2, 3, 5), ("batch", "member", "class"))
    good = ctx.tensor(np.array([[0, 1, 2], [3, 4, 0]]), ("batch", "member"), dtype="i64")
    want = x.cross_entropy("class", [0, 1, 2, 3, 4, 0]).item()
    assert x.cross_entropy("class", good).item() == want
    swapped = ctx.tensor(np.array([[0, 3], [1, 4], [2, 0]]), ("member", "batch"), dtype="i64")
    with pytest.raises(fu.TagError, match="positions"):
        x.cross_entropy("class", swapped)
    with pytest.raises(fu.TagError, match="positions"):
        x.log_softmax("class").nll_loss("class", swapped)
    X = ctx.tensor(rand(3, 4), ("row", "d"))
    with pytest.raises(fu.TagError, match="positions"):
        X.linear_cross_entropy(ctx.tensor(rand(5, 4), ("class", "d")),
                               ctx.tensor(np.array([0, 1, 2]), ("r",), dtype="i64"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batch_axes(ctx, reduction):
    """Every axis before the shared one is a row axis: [batch, seq, d] with labels tagged
    (batch, seq) is the rows flattened in order — torch's values and gradients, and bitwise
    the flat call's."""
    B, S, D, K = 3, 5, 16, 29
    x, w = rand(B, S, D), rand(K, D, s=0.5)
    labels = RNG.integers(0, K, (B, S))
    labels[1, 2] = -100
    X, Wt = ctx.variable(x, ("batch", "seq", "d")), ctx.variable(w, ("class", "d"))
    lab = ctx.tensor(labels, ("batch", "seq"), dtype="i64")
    y = X.linear_cross_entropy(Wt, lab, ignore_index=-100, reduction=reduction)
    g = np.linspace(0.5, 1.5, B * S, dtype=np.float32).reshape(B, S)
    if reduction == "none":
        assert y.tags == ("batch", "seq") and y.shape == (B, S)
        y.backward(grad=ctx.tensor(g, ("batch", "seq")))
    else:
        y.backward()
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = F.cross_entropy((tx @ tw.T).reshape(B * S, K), torch.tensor(labels).reshape(-1),
                         ignore_index=-100, reduction=reduction)
    if reduction == "none":
        ty = ty.reshape(B, S)
        ty.backward(torch.from_numpy(g))
    else:
        ty.backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(X.grad().numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Wt.grad().numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-5)
    flat = run(ctx, x.reshape(B * S, D), w, labels.reshape(-1), ignore_index=-100,
               reduction=reduction) if reduction == "mean" else None
    if flat is not None:
        assert_bitwise(y.numpy(), flat[0])
        assert_bitwise(X.grad().numpy().reshape(B * S, D), flat[1])
        assert_bitwise(Wt.grad().numpy(), flat[2])
    with pytest.raises(fu.TagError, match="positions"):
        X.linear_cross_entropy(Wt, ctx.tensor(labels.T.copy(), ("seq", "batch"), dtype="i64"))
