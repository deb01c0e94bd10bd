"""In-place and consuming helpers (SPEC R-7)."""
import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(5)


def test_add_axis_vector_in_place(ctx):
    a, b = RNG.standard_normal((40, 33)).astype(np.float32), RNG.standard_normal(33).astype(np.float32)
    x = ctx.tensor(a, ("r", "c"))
    addr = x.data_const().__array_interface__["data"][0]
    assert x.add_axis_vector_in_place(ctx.tensor(b, ("c",)), "c") is x
    assert_bitwise(x.numpy(), a + b)
    assert x.data_const().__array_interface__["data"][0] == addr
    with pytest.raises(fu.TagError, match="last axis"):
        x.add_axis_vector_in_place(ctx.tensor(np.zeros(40, np.float32), ("r",)), "r")
    with pytest.raises(fu.ShapeMismatch):
        x.add_axis_vector_in_place(ctx.tensor(np.zeros(5, np.float32), ("c",)), "c")


@pytest.mark.parametrize("op", ["relu", "tanh", "sigmoid", "exp"])
def test_add_axis_vector_unary_in_place_matches_two_ops(ctx, op):
    a, b = RNG.standard_normal((7, 50)).astype(np.float32), RNG.standard_normal(50).astype(np.float32)
    want = getattr(ctx.tensor(a, ("r", "c")) + ctx.tensor(b, ("c",)), op)().numpy()
    x = ctx.tensor(a, ("r", "c"))
    x.add_axis_vector_unary_in_place(op, ctx.tensor(b, ("c",)), "c")
    assert_bitwise(x.numpy(), want)
    with pytest.raises(ValueError):
        x.add_axis_vector_unary_in_place("nope", ctx.tensor(b, ("c",)), "c")


def test_add_scaled_in_place(ctx):
    a, b = RNG.standard_normal(100).astype(np.float32), RNG.standard_normal(100).astype(np.float32)
    x = ctx.tensor(a, ("n",))
    x.add_scaled_in_place(ctx.tensor(b, ("n",)), -0.25)
    assert_bitwise(x.numpy(), a + np.float32(-0.25) * b)
    with pytest.raises(fu.ShapeMismatch):
        x.add_scaled_in_place(ctx.tensor(b[:5], ("n",)), 1.0)


def test_take_reuses_storage_only_when_unique(ctx):
    x = ctx.tensor([1.0, 2.0], ("n",))
    addr = x._raw.addr
    y = x.take_scale_no_grad(3.0)
    assert y.numpy().tolist() == [3.0, 6.0] and y._raw.addr == addr
    with pytest.raises(fu.UseAfterRelease):
        x.numpy()
    view = y.data_const()  # someone still reads the storage: the result must not overwrite it
    z = y.take_add_no_grad(ctx.tensor([1.0, 1.0], ("n",)))
    assert z.numpy().tolist() == [4.0, 7.0] and z._raw.addr != addr
    assert view.tolist() == [3.0, 6.0]
    with ctx.exec_scope():
        borrow = z * 1.0
        with pytest.raises(fu.ActiveExecScopeUnsupported):
            borrow.take_scale_no_grad(2.0)


def test_grad_operands_refused_and_bias_add(ctx):
    w = ctx.variable([1.0, 2.0], ("c",))
    with pytest.raises(fu.UnsupportedGradient):
        w.add_scaled_in_place(ctx.tensor([1.0, 1.0], ("c",)), 1.0)
    with pytest.raises(fu.UnsupportedGradient):
        w.take_scale_no_grad(2.0)
    x = ctx.variable([[1.0, 2.0], [3.0, 4.0]], ("r", "c"))
    y = x.bias_add([10, 20], "c")
    assert y.numpy().tolist() == [[11, 22], [13, 24]]
    (y * y).sum_all().backward()
    assert x.grad().numpy().tolist() == [[22, 44], [26, 48]]
    with pytest.raises(fu.ShapeMismatch):
        x.bias_add([1, 2, 3], "c")


def test_writes_into_read_only_storage_are_refused(ctx, tmp_path):
    """A memory-mapped GGUF tensor is read-only: an in-place op raises instead of faulting, and
    the file's bytes stay as they were."""
    a = RNG.standard_normal((4, 8)).astype(np.float32)
    fu.gguf.write(tmp_path / "w.gguf", {"w": ctx.tensor(a, ("r", "c"))}, {})
    f = fu.gguf.read(tmp_path / "w.gguf", ctx)
    w = f.tensors["w"]
    one = ctx.tensor(np.ones(w._raw.shape, np.float32), w.tags)
    with pytest.raises(fu.ReadOnlyStorage, match="add_scaled: expected a writable destination"):
        w.add_scaled_in_place(one, 1.0)
    with pytest.raises(fu.ReadOnlyStorage):
        w.add_axis_vector_in_place(ctx.tensor(np.ones(w._raw.shape[-1], np.float32), w.tags[-1:]),
                                   w.tags[-1])
    assert_bitwise(w.numpy(), a)
