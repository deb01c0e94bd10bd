"""The public Tensor: constructors, data access, ownership, the pool, and every bad input."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fucina as fu


def test_constructors_and_attributes(ctx):
    x = ctx.tensor([[1, 2], [3, 4]], tags=("row", "col"))
    assert x.tags == ("row", "col") and x.shape == (2, 2) and x.dtype == "f32" and x.numel == 4
    assert x.ctx is ctx and not x.requires_grad and not x.scope_owned
    assert ctx.from_slice(("row", "col"), (2, 2), [1, 2, 3, 4]).numpy().tolist() == [[1, 2], [3, 4]]
    assert ctx.zeros((2, 3), ("a", "b")).numpy().sum() == 0
    assert ctx.ones((2, 3), ("a", "b")).numpy().sum() == 6
    assert ctx.full((2, 3), 7.0, ("a", "b")).numpy().tolist() == [[7.0] * 3] * 2
    s = ctx.tensor(3.0, tags=())
    assert s.item() == 3.0 and s.shape == () and ctx.scalar(2.5).item() == 2.5
    for dt, want in [("f16", np.float16), ("bf16", np.float32), ("i64", np.int64), ("bool", np.bool_)]:
        t = ctx.full((3,), 1, ("n",), dtype=dt)
        assert t.dtype == dt and t.numpy().dtype == want and t.numpy().tolist() == [1, 1, 1]
    # the fill-value cache tells values apart exactly: -0.0 after 0.0, a big int after its float
    assert np.signbit(ctx.full((2,), 0.0, ("n",)).numpy()).tolist() == [False, False]
    assert np.signbit(ctx.full((2,), -0.0, ("n",)).numpy()).tolist() == [True, True]
    big = 2**60 + 1
    assert ctx.full((1,), float(big), ("n",), dtype="i64").numpy().tolist() == [2**60]
    assert ctx.full((1,), big, ("n",), dtype="i64").numpy().tolist() == [big]
    assert np.isnan(ctx.full((1,), float("nan"), ("n",)).numpy()).all()


def test_data_access(ctx):
    x = ctx.tensor([1.0, 2.0], ("n",))
    ro = x.data_const()
    with pytest.raises(ValueError):
        ro[0] = 5
    x.data()[0] = 5
    assert x.numpy().tolist() == [5.0, 2.0]
    with pytest.raises(fu.InvalidShape, match="exactly 1 element"):
        x.item()
    assert x.numpy() is not x.numpy()


def test_release_and_use_after_release(ctx):
    x = ctx.tensor([1.0, 2.0], ("n",))
    x.release()
    with pytest.raises(fu.UseAfterRelease):
        x + x
    with pytest.raises(fu.UseAfterRelease):
        x.numpy()


def test_bad_tags():
    with fu.ExecContext(threads=1) as ctx:
        with pytest.raises(fu.TagError, match="expected 2 tags .* got 1"):
            ctx.tensor([[1, 2]], ("a",))
        with pytest.raises(fu.TagError, match="duplicate"):
            ctx.tensor([[1, 2]], ("a", "a"))
        with pytest.raises(fu.TagError, match="strings"):
            ctx.tensor([1, 2], (3,))
        x = ctx.tensor([[1, 2]], ("a", "b"))
        with pytest.raises(fu.TagError, match="'z'"):
            x.sum("z")
        with pytest.raises(fu.InvalidShape, match="rank <= 8"):
            ctx.tensor(np.zeros((1,) * 9), tuple("abcdefghi"))
        assert issubclass(fu.TagError, TypeError) and issubclass(fu.TagError, fu.FucinaError)


def test_size_mismatch_names_axis_and_sizes(ctx):
    x = ctx.tensor(np.zeros((2, 3)), ("row", "col"))
    y = ctx.tensor(np.zeros(4), ("col",))
    with pytest.raises(fu.ShapeMismatch, match=r"'col' has size 3 .* and 4"):
        x + y
    assert issubclass(fu.ShapeMismatch, fu.TensorError)


def test_bad_data_and_shapes(ctx):
    with pytest.raises(fu.InvalidDataLength, match="expected 4 values .* got 3"):
        ctx.from_slice(("a", "b"), (2, 2), [1, 2, 3])
    with pytest.raises(fu.InvalidShape, match=">= 0"):
        ctx.zeros((2, -1), ("a", "b"))
    with pytest.raises(fu.DTypeError, match="dtype"):
        ctx.tensor([1], ("a",), dtype="f64")
    with pytest.raises(fu.InvalidShape):
        ctx.tensor([1.0, 2.0], ("n",)).narrow("n", 1, 5)


def test_two_contexts_mismatch():
    with fu.ExecContext(threads=1) as c1, fu.ExecContext(threads=1) as c2:
        a, b = c1.tensor([1.0], ("n",)), c2.tensor([1.0], ("n",))
        with pytest.raises(fu.ContextMismatch):
            a + b
        a + a  # the fast path must not let a mismatch through after a plan exists
        with pytest.raises(fu.ContextMismatch):
            a + b


def test_closed_context():
    ctx = fu.ExecContext(threads=1)
    x = ctx.tensor([1.0, 2.0], ("n",))
    x + x
    x * 2.0
    del x
    ctx.close()
    with pytest.raises(fu.ContextClosed):
        ctx.tensor([1.0], ("n",))
    ctx2 = fu.ExecContext(threads=1)
    y = ctx2.tensor([1.0, 2.0], ("n",))
    y + y
    y * 2.0
    with pytest.warns(ResourceWarning, match="still referenced"):
        ctx2.close()
    for f in (lambda: y + y, lambda: y * 2.0, lambda: y.sum("n"), lambda: y.numpy()):
        with pytest.raises(fu.ContextClosed):
            f()


def test_leak_report_raises_in_debug_mode(tmp_path):
    code = ("import fucina as fu\nctx = fu.ExecContext(threads=1)\nx = ctx.tensor([1.0], ('n',))\n"
            "ctx.close()\n")
    env = dict(os.environ, FUCINA_DEBUG="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "leaked 1 pooled buffers" in r.stderr


def test_pool_acceptance_deinit_asap_touches_two_buffers(ctx):
    """SPEC R-2: a 32-op chain of 1 MiB results, each released as soon as the next exists."""
    n = (1 << 20) // 4
    x = ctx.tensor(np.zeros(n, np.float32), ("n",))
    seen = set()
    for _ in range(32):
        x = x.add_scalar(1.0)
        seen.add(x.data_const().__array_interface__["data"][0])
    assert len(seen) == 2 and x.numpy()[0] == 32.0
    held = [x]
    for _ in range(31):
        held.append(held[-1].add_scalar(1.0))
    assert len({h.data_const().__array_interface__["data"][0] for h in held}) == 32
    assert ctx.pool.outstanding_buffers() >= 32
    del held, x
    assert ctx.pool.outstanding_buffers() == 0 and ctx.pool.cached_buffers() >= 2


def test_unknown_operand_type(ctx):
    x = ctx.tensor([1.0], ("n",))
    with pytest.raises(TypeError, match="expected a Tensor or a real number"):
        x + [1.0]
    with pytest.raises(TypeError):
        x.scale(True)
