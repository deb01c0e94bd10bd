"""reshape, split_axis and merge_axes: row-major element order (numpy's reshape), a view of a
contiguous tensor and a copy of a strided one, gradients reshaped back (torch), errors."""
import numpy as np
import pytest
import torch

import fucina as fu

RNG = np.random.default_rng(8)


def test_values_views_and_copies(ctx):
    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    x = ctx.tensor(a, ("b", "s", "d"))
    y = x.reshape(("b", "sd"), (2, 12))
    np.testing.assert_array_equal(y.numpy(), a.reshape(2, 12))
    assert y.data_const().ctypes.data == x.data_const().ctypes.data     # a view
    p = x.permute(("d", "b", "s"))
    z = p.reshape(("db", "s"), (8, 3))                                  # strided: a copy
    np.testing.assert_array_equal(z.numpy(), a.transpose(2, 0, 1).reshape(8, 3))
    h = x.split_axis("d", ("two", "half"), (2, 2))
    assert h.tags == ("b", "s", "two", "half")
    np.testing.assert_array_equal(h.numpy(), a.reshape(2, 3, 2, 2))
    m = h.merge_axes(("s", "two"), "st")
    np.testing.assert_array_equal(m.numpy(), a.reshape(2, 6, 2))
    i = ctx.tensor(np.arange(6), ("n",), dtype="i64").reshape(("r", "c"), (2, 3))
    np.testing.assert_array_equal(i.numpy(), np.arange(6).reshape(2, 3))


def test_gradients_against_torch(ctx):
    a = RNG.standard_normal((4, 6)).astype(np.float32)
    w = RNG.standard_normal((6, 4)).astype(np.float32)
    x = ctx.variable(a, ("seq", "hd"))
    y = x.permute(("hd", "seq")).split_axis("hd", ("head", "d"), (2, 3)).merge_axes(("d", "seq"), "ds")
    (y * ctx.tensor(w.reshape(2, 12), ("head", "ds"))).sum_all().backward()
    t = torch.tensor(a, requires_grad=True)
    ty = t.T.reshape(2, 3, 4).reshape(2, 12)
    (ty * torch.from_numpy(w.reshape(2, 12))).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy())
    np.testing.assert_array_equal(x.grad().numpy(), t.grad.numpy())
    v = ctx.variable(a, ("r", "c"))
    fu.gradcheck(lambda u: (u.reshape(("x", "y"), (3, 8)) ** 2).sum_all(), [v])


def test_errors(ctx):
    x = ctx.tensor(np.zeros((2, 3, 4), np.float32), ("b", "s", "d"))
    with pytest.raises(fu.InvalidShape, match="24"):
        x.reshape(("a", "c"), (5, 5))
    with pytest.raises(fu.TagError):
        x.reshape(("a", "a"), (4, 6))
    with pytest.raises(fu.InvalidShape, match="non-negative"):
        x.reshape(("a", "c"), (-1, 24))
    with pytest.raises(fu.InvalidShape, match="holds 0 elements"):
        x.reshape(("a", "c"), (0, 24))
    with pytest.raises(fu.InvalidShape, match="sizes"):
        x.split_axis("d", ("p", "q"), (3, 2))
    with pytest.raises(fu.TagError, match="adjacent"):
        x.merge_axes(("b", "d"), "bd")
    with pytest.raises(fu.TagError):
        x.split_axis("nope", ("p", "q"), (2, 2))
