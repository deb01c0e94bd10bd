"""SPEC §7.1: the documented divergences from PyTorch, collected in one place. Each test shows
what torch 2.13 does and what Fucina does instead, so a change on either side is noticed.
Items that concern ops of later issues (scatter, sort, argmax, bce/kl losses, l2_normalize,
pooling, export, APOLLO) join this module with those ops."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu


def test_1_cross_entropy_all_ignored_is_zero_not_nan(ctx):
    x = ctx.variable([[1.0, 2.0], [3.0, 4.0]], ("r", "c"))
    loss = x.cross_entropy("c", [-100, -100], ignore_index=-100)
    t = F.cross_entropy(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([-100, -100]))
    assert torch.isnan(t) and loss.item() == 0.0
    loss.backward()
    assert not x.grad().numpy().any()


def test_8_maximum_nan_wins_and_ties_split_the_gradient(ctx):
    a, b = [np.nan, 1.0, 2.0], [1.0, np.nan, 2.0]
    x, y = ctx.variable(a, ("n",)), ctx.variable(b, ("n",))
    m = x.maximum(y)
    assert np.isnan(m.numpy()[:2]).all()  # as torch, unlike IEEE maxNum
    m.sum_all().backward()
    tx, ty = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    torch.maximum(tx, ty).sum().backward()
    assert x.grad().numpy()[2] == 0.5 and y.grad().numpy()[2] == 0.5
    assert tx.grad[2] + ty.grad[2] == 1.0  # torch also splits; the SPEC pins the even split


def test_9_integer_tensors_have_no_true_division(ctx):
    a = ctx.tensor([7, -7], ("n",), dtype="i64")
    b = ctx.tensor([2, 2], ("n",), dtype="i64")
    assert (torch.tensor([7, -7]) / torch.tensor([2, 2])).dtype == torch.float32
    with pytest.raises(fu.DTypeError, match="div_trunc"):
        a / b
    assert a.div_trunc(b).numpy().tolist() == [3, -3]
    assert a.div_floor(b).numpy().tolist() == [3, -4]


def test_11_relu_of_nan_is_zero_and_log1p_is_literal(ctx):
    x = ctx.tensor([np.nan, -1.0, 2.0], ("n",))
    assert x.relu().numpy().tolist() == [0.0, 0.0, 2.0]
    assert torch.isnan(torch.relu(torch.tensor([np.nan])))[0]
    tiny = ctx.tensor([1e-10], ("n",))
    assert tiny.log1p().numpy()[0] == 0.0  # ln(1 + x) with 1 + x rounded to 1 first
    assert torch.log1p(torch.tensor([1e-10]))[0] > 0
