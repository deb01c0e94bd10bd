"""Zero-sized axes (issue 20 item 4): an empty batch flows through construction, elementwise
ops (with broadcasting), reductions, softmax, concat/narrow/gather/index_select/slice, dot and
matmul, reshape and norms, forward and backward, with values, shapes and gradients equal to
torch's. No kernel is launched for empty work. Where torch refuses (max/argmax/min over an
empty axis) we raise InvalidShape naming the op."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from fucina.runtime import _rt

f32 = np.float32


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(f32)


def close(got, want):
    """Same shape and values (nan where torch has nan)."""
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def check(ctx, inputs, f_fu, f_torch):
    """Forward values and shape, then the gradient of sum(y * w) for a random w, per input.
    inputs: (array, tags) pairs; every one is a variable (a leaf that requires grad)."""
    vs = [ctx.variable(a, tags) for a, tags in inputs]
    ts = [torch.tensor(a, requires_grad=True) for a, _ in inputs]
    y, yt = f_fu(*vs), f_torch(*ts)
    close(y.numpy(), yt.detach().numpy())
    w = rand(y.shape, 1)
    y.mul(ctx.tensor(w, y.tags)).sum_all().backward()
    (yt * torch.tensor(w)).sum().backward()
    for v, t in zip(vs, ts):
        want = t.grad if t.grad is not None else torch.zeros_like(t)
        close(v.grad().numpy(), want.numpy())
    return y


# ---- construction ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i64", "bool"])
@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 4)])
def test_construction(ctx, dtype, shape):
    tags = tuple("abc"[:len(shape)])
    for t in (ctx.zeros(shape, tags, dtype), ctx.ones(shape, tags, dtype), ctx.full(shape, 7, tags, dtype),
              ctx.tensor(np.zeros(shape), tags, dtype), ctx.from_slice(tags, shape, [], dtype)):
        assert t.shape == shape and t.numel == 0 and t.dtype == dtype
        assert t.numpy().shape == shape and t.data_const().shape == shape
    if dtype in ("f32", "f16", "bf16"):
        v = ctx.variable(np.zeros(shape), tags, dtype)
        assert v.requires_grad and v.shape == shape


def test_negative_size_and_item_refused(ctx):
    with pytest.raises(fu.InvalidShape, match=r"full: .*>= 0"):
        ctx.zeros((2, -1), ("a", "b"))
    with pytest.raises(fu.InvalidShape, match="item"):
        ctx.zeros((0,), ("a",)).item()


# ---- elementwise -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,f,g", [
    ("add", lambda x, y: x.add(y), lambda x, y: x + y),
    ("sub", lambda x, y: x - y, lambda x, y: x - y),
    ("mul", lambda x, y: x * y, lambda x, y: x * y),
    ("div", lambda x, y: x / y, lambda x, y: x / y),
])
def test_binary_broadcast(ctx, name, f, g):
    """(0, 3) against (3,): the empty axis survives; the (3,) operand's gradient is zeros."""
    check(ctx, [(rand((0, 3)), ("a", "b")), (rand(3) + 2, ("b",))], f, g)
    check(ctx, [(rand((0, 3)), ("a", "b")), (rand((0, 3)), ("a", "b"))], f, g)


def test_size_one_broadcasts_to_zero(ctx):
    """A size-1 axis against a size-0 one gives size 0 (as torch), never 1."""
    check(ctx, [(rand((1, 3)), ("a", "b")), (rand(0), ("a",))],
          lambda x, y: x + y, lambda x, y: x + y[:, None])


@pytest.mark.parametrize("name,f,g", [
    ("relu", lambda x: x.relu(), torch.relu),
    ("gelu_erf", lambda x: x.unary("gelu_erf"), F.gelu),
    ("scale", lambda x: x.scale(2.0), lambda t: t * 2.0),
    ("add_scalar", lambda x: x.add_scalar(1.0), lambda t: t + 1.0),
    ("neg", lambda x: -x, lambda t: -t),
    ("clamp", lambda x: x.clamp(-1.0, 1.0), lambda t: t.clamp(-1.0, 1.0)),
])
def test_unary(ctx, name, f, g):
    check(ctx, [(rand((0, 3)), ("a", "b"))], f, g)


def test_where_masked_fill_cast(ctx):
    x = ctx.tensor(rand((0, 3)), ("a", "b"))
    assert x.where(x.compare("lt", 0.0), x).shape == (0, 3)
    assert x.masked_fill(x.compare("lt", 0.0), 1.0).shape == (0, 3)
    assert x.to("f16").dtype == "f16" and x.to("i64").shape == (0, 3)


# ---- reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,tag,dim", [((0, 3), "a", 0), ((0, 3), "b", 1), ((3, 0), "b", 1),
                                           ((2, 0, 4), "b", 1), ((2, 0, 4), "c", 2)])
def test_sum_mean(ctx, shape, tag, dim):
    """A sum of nothing is 0, a mean 0/0 = nan; over a non-empty axis the result is empty."""
    tags = ("a", "b", "c")[:len(shape)]
    check(ctx, [(rand(shape), tags)], lambda x: x.sum(tag), lambda t: t.sum(dim))
    check(ctx, [(rand(shape), tags)], lambda x: x.mean(tag), lambda t: t.mean(dim))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sum_all_mean_all_prod_variance(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.sum_all(), lambda t: t.sum())
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.mean_all(), lambda t: t.mean())
    x = ctx.tensor(rand((0, 3)), ("a", "b"))
    t = torch.tensor(x.numpy())
    close(x.prod("a").numpy(), t.prod(0).numpy())
    close(x.variance("a", ddof=1).numpy(), t.var(0, correction=1).numpy())
    close(x.variance("a", ddof=0).numpy(), t.var(0, correction=0).numpy())
    close(x.variance("b", ddof=1).numpy(), t.var(1, correction=1).numpy())
    i = ctx.zeros((0,), ("a",), "i64")
    assert i.sum_all().item() == 0 and i.sum_all().dtype == "i64"


def test_max_over_nonempty_axis_of_empty(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.max("b"), lambda t: t.amax(1))
    x = ctx.tensor(rand((0, 3)), ("a", "b"))
    assert x.argmax("b").shape == (0,) and x.min("b").shape == (0,)


@pytest.mark.parametrize("op", ["max", "min", "argmax"])
def test_extreme_over_empty_axis_refused(ctx, op):
    """torch refuses these ("Expected reduction dim to have non-zero size"): InvalidShape."""
    x = ctx.tensor(rand((0, 3)), ("a", "b"))
    with pytest.raises((IndexError, RuntimeError), match="non-zero size"):
        getattr(torch.tensor(x.numpy()), op)(0)
    with pytest.raises(fu.InvalidShape, match=rf"^{op}: expected a non-empty axis"):
        getattr(x, op)("a")


def test_max_of_flat_empty_refused(ctx):
    with pytest.raises(fu.InvalidShape, match="non-empty"):
        ctx.tensor(rand((0, 3)), ("a", "b")).reshape(("n",), (0,)).max("n")


# ---- softmax family ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,tag,dim", [((0, 3), "b", 1), ((0, 3), "a", 0), ((3, 0), "b", 1)])
def test_softmax_log_softmax(ctx, shape, tag, dim):
    check(ctx, [(rand(shape), ("a", "b"))], lambda x: x.softmax(tag), lambda t: F.softmax(t, dim))
    check(ctx, [(rand(shape), ("a", "b"))], lambda x: x.log_softmax(tag), lambda t: F.log_softmax(t, dim))


def test_logsumexp(ctx):
    """Over an empty axis: log 0 = -inf per row; over an empty batch: empty."""
    check(ctx, [(rand((2, 0)), ("a", "b"))], lambda x: x.logsumexp("b"), lambda t: t.logsumexp(1))
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.logsumexp("b"), lambda t: t.logsumexp(1))


# ---- selection and assembly --------------------------------------------------------------------

def test_concat_with_empty(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b")), (rand((2, 3)), ("a", "b"))],
          lambda x, y: fu.concat("a", x, y), lambda x, y: torch.cat([x, y], 0))
    check(ctx, [(rand((2, 0)), ("a", "b")), (rand((2, 0)), ("a", "b"))],
          lambda x, y: fu.concat("b", x, y), lambda x, y: torch.cat([x, y], 1))


def test_narrow_and_slice_empty(ctx):
    check(ctx, [(rand((4, 3)), ("a", "b"))], lambda x: x.narrow("a", 2, 0), lambda t: t.narrow(0, 2, 0))
    check(ctx, [(rand((4, 3)), ("a", "b"))], lambda x: x.slice(a=slice(3, 1)), lambda t: t[3:1])
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.narrow("a", 0, 0), lambda t: t.narrow(0, 0, 0))


@pytest.mark.parametrize("shape", [(5,), (5, 3)])
def test_gather_index_select_no_indices(ctx, shape):
    """No index: an empty result; the gradient to the table is zeros."""
    tags = ("v", "d")[:len(shape)]
    none = np.zeros(0, np.int64)
    ids = lambda: ctx.tensor(none, ("s",), "i64")
    check(ctx, [(rand(shape), tags)], lambda x: x.gather("v", ids(), "s"),
          lambda t: t.index_select(0, torch.tensor(none)))
    check(ctx, [(rand(shape), tags)], lambda x: x.index_select("v", ids(), "s"),
          lambda t: t.index_select(0, torch.tensor(none)))


def test_gather_from_empty_rows(ctx):
    """Gathering along a non-empty axis of a table with an empty other axis."""
    idx = np.array([1, 0, 1])
    check(ctx, [(rand((2, 0)), ("v", "d"))],
          lambda x: x.gather("v", ctx.tensor(idx, ("s",), "i64"), "s"),
          lambda t: t.index_select(0, torch.tensor(idx)))


def test_sort_top_k_empty_batch(ctx):
    x = ctx.tensor(rand((0, 3)), ("a", "b"))
    r = x.sort("b")
    assert r.values.shape == (0, 3) and r.indices.shape == (0, 3)
    assert x.top_k("b", 2, "k").values.shape == (0, 2)
    with pytest.raises(fu.IndexOutOfBounds, match="top_k"):
        ctx.tensor(rand((3, 0)), ("a", "b")).top_k("b", 1, "k")


def test_cumsum_empty(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.cumsum("a"), lambda t: t.cumsum(0))


# ---- dot / matmul ------------------------------------------------------------------------------

def test_dot_zero_free_axis(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b")), (rand((3, 4)), ("b", "c"))],
          lambda x, y: x.dot(y, "b"), lambda x, y: x @ y)
    check(ctx, [(rand((2, 3)), ("a", "b")), (rand((3, 0)), ("b", "c"))],
          lambda x, y: x.dot(y, "b"), lambda x, y: x @ y)


def test_dot_zero_contracting_axis_is_zeros(ctx):
    """K == 0: a sum of no products, zeros (in a recycled pool buffer too)."""
    junk = ctx.full((2, 4), 9.0, ("a", "c"))  # leaves non-zero bytes in the pool
    junk.release()
    y = check(ctx, [(rand((2, 0)), ("a", "k")), (rand((0, 4)), ("k", "c"))],
              lambda x, y: x.dot(y, "k"), lambda x, y: x @ y)
    assert np.all(y.numpy() == 0)
    check(ctx, [(rand((2, 0)), ("m", "k")), (rand((0, 4)), ("k", "n"))],
          lambda x, y: x.matmul(y, "plain", ("m", "n")), lambda x, y: x @ y)
    check(ctx, [(rand((3, 2, 0)), ("b", "m", "k")), (rand((3, 0, 4)), ("b", "k", "n"))],
          lambda x, y: x.dot(y, "k"), lambda x, y: x @ y)


def test_einsum_empty(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b")), (rand((3, 4)), ("b", "c"))],
          lambda x, y: x.einsum(y, ("a", "c")), lambda x, y: torch.einsum("ab,bc->ac", x, y))


# ---- shape ops and norms -----------------------------------------------------------------------

def test_reshape_split_permute(ctx):
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.reshape(("z", "y"), (3, 0)),
          lambda t: t.reshape(3, 0))
    check(ctx, [(rand((2, 0, 4)), ("a", "b", "c"))], lambda x: x.reshape(("z",), (0,)),
          lambda t: t.reshape(0))
    check(ctx, [(rand((0, 4)), ("a", "b"))], lambda x: x.split_axis("b", ("p", "q"), (2, 2)),
          lambda t: t.reshape(0, 2, 2))
    check(ctx, [(rand((0, 3)), ("a", "b"))], lambda x: x.permute(("b", "a")), lambda t: t.T)


def test_norms_on_empty_batch(ctx):
    check(ctx, [(rand((0, 3)), ("s", "d")), (rand(3), ("d",)), (rand(3), ("d",))],
          lambda x, w, b: x.layer_norm("d", 1e-5, weight=w, bias=b),
          lambda x, w, b: F.layer_norm(x, (3,), w, b, 1e-5))
    check(ctx, [(rand((0, 3)), ("s", "d")), (rand(3), ("d",))],
          lambda x, w: x.rms_norm_mul("d", w, 1e-6),
          lambda x, w: F.rms_norm(x, (3,), w, 1e-6))


# ---- no kernel for empty work ------------------------------------------------------------------

def test_no_launch_for_empty_work(ctx, monkeypatch):
    """Every launch goes through the runtime's launch(): none with work to do for empty work,
    forward or backward (the first calls build their plans, the second ones take the cached
    fast paths). A launch of zero chunks returns at once in the runtime (the context's bound
    launch passes it on rather than test for it in Python)."""
    x = ctx.variable(rand((0, 3)), ("a", "b"))
    b = ctx.tensor(rand(3), ("b",))
    w = ctx.tensor(rand((3, 4)), ("b", "c"))
    t = ctx.tensor(rand((4, 3)), ("a", "b"))
    none = ctx.tensor(np.zeros(0, np.int64), ("s",), "i64")
    launched = []
    monkeypatch.setattr(_rt, "launch", lambda *a: launched.append(a[1:4]) if a[2] else None)
    ctx.__dict__.pop("launch", None)   # a launch bound before the patch would bypass it
    for f in (lambda: x + b, lambda: x * x, lambda: x.relu(), lambda: x.sum("b"),
              lambda: x.softmax("b"), lambda: x.dot(w, "b"), lambda: x.log_softmax("b"),
              lambda: x.cumsum("a"), lambda: x.layer_norm("b", 1e-5), lambda: t.narrow("a", 1, 0),
              lambda: t.gather("a", none, "s"), lambda: x.reshape(("z",), (0,)),
              lambda: x.max("b"), lambda: x.to("f16")):
        for _ in range(2):
            y = f()
            if y.requires_grad:
                y.backward(grad=ctx.zeros(y.shape, y.tags))
    assert launched == []


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_optimizer_step_with_an_empty_parameter(ctx, name):
    """An empty parameter beside a real one: the step, the clip norm and the real parameter's
    update are torch's."""
    q0 = rand((2, 3))
    p, q = ctx.variable(rand((0, 3)), ("a", "b")), ctx.variable(q0, ("a", "b"))
    opt = getattr(fu.optim, name)(lr=0.1)
    opt.add_param(p)
    opt.add_param(q)
    (p.sum_all() + q.mul(q).sum_all()).backward()
    norm = opt.clip_grad_norm(1.0)
    opt.step()
    tp, tq = torch.zeros((0, 3), requires_grad=True), torch.tensor(q0, requires_grad=True)
    topt = getattr(torch.optim, name)([tp, tq], lr=0.1)
    (tp.sum() + (tq * tq).sum()).backward()
    tnorm = torch.nn.utils.clip_grad_norm_([tp, tq], 1.0)
    topt.step()
    np.testing.assert_allclose(float(norm), float(tnorm), rtol=1e-6)
    close(q.numpy(), tq.detach().numpy())
    assert p.shape == (0, 3) and p.grad().shape == (0, 3)
