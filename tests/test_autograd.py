"""Autograd: SPEC §3.19–§3.20 acceptances, every backward rule against finite differences
(gradcheck) and against torch autograd, ownership and scopes (R-5, R-6)."""
import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(0)


def pos(*shape):
    return (RNG.random(shape) + 0.5).astype(np.float32)


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# ---- SPEC acceptances ----

def test_shared_branch_accumulates_before_propagating(ctx):
    x = ctx.variable([3.0, 5.0], ("n",))
    (x * x + x.scale(4.0)).sum_all().backward()
    assert x.grad().numpy().tolist() == [10.0, 14.0]


def test_leaf_grads_accumulate_across_backward(ctx):
    w = ctx.variable([1.0, 2.0], ("n",))
    w.scale(3).sum_all().backward()
    w.scale(3).sum_all().backward()
    assert w.grad().numpy().tolist() == [6.0, 6.0]
    w.zero_grad()
    assert w.grad() is None


def test_broadcast_gradient_is_sum_reduced(ctx):
    x = ctx.variable([[1, 2], [3, 4]], ("row", "col"))
    b = ctx.variable([10, 20], ("col",))
    y = x + b
    assert y.numpy().ravel().tolist() == [11, 22, 13, 24]
    y.sum_all().backward()
    assert b.grad().numpy().tolist() == [2, 2] and b.grad().tags == ("col",)
    assert x.grad().numpy().tolist() == [[1, 1], [1, 1]]


def test_one_backward_per_graph(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    loss = (x * x).sum_all()
    with pytest.raises(fu.MissingOutputGradient):
        (x * x).backward()
    loss.backward()
    with pytest.raises(fu.BackwardAlreadyRun):
        loss.backward()
    x.zero_grad()
    with pytest.raises(fu.BackwardAlreadyRun):  # zero_grad does not reset a consumed graph
        loss.backward()


def test_backward_with_seed_and_errors(ctx):
    x = ctx.variable([1.0, 2.0, 3.0], ("n",))
    y = x * x
    y.backward(grad=ctx.tensor([1.0, 0.5, 0.0], ("n",)))
    assert x.grad().numpy().tolist() == [2.0, 2.0, 0.0]
    z = x * 2.0
    with pytest.raises(fu.ShapeMismatch):
        z.backward(grad=ctx.tensor([1.0, 2.0], ("n",)))
    z.backward(grad=ctx.ones((3,), ("n",)))  # a failed seeding leaves the graph runnable
    with pytest.raises(fu.NoGradientGraph):
        ctx.tensor([1.0], ("n",)).sum_all().backward()


def test_no_grad_and_detach_and_pruning(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    c = ctx.tensor([5.0, 6.0], ("n",))
    with fu.no_grad():
        assert not fu.is_grad_enabled()
        with fu.no_grad():
            assert not (x * c).requires_grad
        assert not fu.is_grad_enabled()
    assert fu.is_grad_enabled()
    assert not x.detach().requires_grad and (x * c).requires_grad and not (c * c).requires_grad
    (x.detach() * x).sum_all().backward()
    assert x.grad().numpy().tolist() == [1.0, 2.0]


def test_accumulation_reuses_an_unshared_accumulator(ctx):
    """A second backward adds into the leaf's own buffer when nothing else sees it; a
    grad_view taken in between keeps its snapshot (the sum then goes to a new buffer)."""
    w = ctx.variable([1.0, 2.0], ("n",))
    leaf = w._leaf("test")
    w.scale(3).sum_all().backward()
    addr = leaf.grad.addr
    w.scale(3).sum_all().backward()
    assert leaf.grad.addr == addr and w.grad().numpy().tolist() == [6.0, 6.0]
    view = w.grad_view()
    w.scale(3).sum_all().backward()
    assert leaf.grad.addr != addr and view.numpy().tolist() == [6.0, 6.0]
    assert w.grad().numpy().tolist() == [9.0, 9.0]


def test_dot_gradient_adds_into_the_accumulated_one(ctx, monkeypatch):
    """A dot's VJP adds its dx into the gradient already gathered for x when only the engine
    holds that buffer (the GEMM adds as it stores: the bits of the separate add); a gradient
    that add's VJP handed to two operands is never written over. Checked against the engine
    with in-place accumulation off, and against torch."""
    from fucina.ag import engine
    rng = np.random.default_rng(3)
    xs, w1, w2, w3 = (rng.standard_normal(s).astype(np.float32)
                      for s in ((7, 5), (6, 5), (5, 5), (4, 5)))

    def grads():
        x = ctx.variable(xs, ("s", "i"))
        with ctx.exec_scope():
            a = x.dot(ctx.tensor(w1, ("o", "i")), "i")                    # dx, fresh
            b = x.dot(ctx.tensor(w3, ("p", "i")), "i")                    # into a's dx
            c = x.add(x.dot(ctx.tensor(w2, ("j", "i")), "i").reshape(("s", "i"), (7, 5)))
            loss = a.mul(a).sum_all().add(b.sum_all()).add(c.mul(c).sum_all())
            loss.backward()
            return x.grad().numpy()

    calls = []
    real = engine._reusable
    monkeypatch.setattr(engine, "_reusable",
                        lambda g, p: calls.append(real(g, p)) or calls[-1])
    fused = grads()
    assert any(c is not None for c in calls)
    monkeypatch.setattr(engine, "_reusable", lambda g, p: None)
    assert_bitwise(fused, grads())
    t = torch.tensor(xs, requires_grad=True)
    loss = ((t @ torch.tensor(w1).T) ** 2).sum() + (t @ torch.tensor(w3).T).sum() \
        + ((t + t @ torch.tensor(w2).T) ** 2).sum()
    loss.backward()
    np.testing.assert_allclose(fused, t.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_every_later_dot_adds_into_the_gradient(ctx, monkeypatch):
    """x feeding four dots (q, k, v and a LoRA side in a decoder) gets one gradient buffer:
    the first VJP's fresh one, the other three adding into it in place — the engine keeps no
    reference to it between VJPs that would make it look shared. No separate add runs, and
    the bits are those of the separate adds."""
    from fucina.ag import engine
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((6, 5)).astype(np.float32)
    ws = [rng.standard_normal((n, 5)).astype(np.float32) for n in (4, 3, 3, 2)]

    def grads():
        x = ctx.variable(xs, ("s", "i"))
        with ctx.exec_scope():
            outs = [x.dot(ctx.tensor(w, (f"o{j}", "i")), "i") for j, w in enumerate(ws)]
            loss = outs[0].mul(outs[0]).sum_all()
            for o in outs[1:]:
                loss = loss.add(o.mul(o).sum_all())
            loss.backward()
            return x.grad().numpy()

    adds = []
    real = engine.add_into
    monkeypatch.setattr(engine, "add_into",
                        lambda c, acc, g: adds.append(acc.shape) or real(c, acc, g))
    fused = grads()
    assert (6, 5) not in adds
    monkeypatch.setattr(engine, "_reusable", lambda g, p: None)
    assert_bitwise(fused, grads())
    assert adds.count((6, 5)) == 3


def test_each_leaf_owns_its_gradient(ctx):
    """add hands both operands one buffer and backward(grad=G) starts from the caller's G: every
    leaf still gets its own accumulator, so scaling one gradient touches nothing else."""
    a, b = ctx.variable([1.0, 2.0], ("n",)), ctx.variable([3.0, 4.0], ("n",))
    seed = ctx.tensor([1.0, 2.0], ("n",))
    (a + b).backward(grad=seed)
    c = ctx.variable([5.0, 6.0], ("n",))
    c.backward(grad=seed)  # the root is the leaf itself: its gradient is the seed's values
    ga, gb, gc = a.grad_view(), b.grad_view(), c.grad_view()
    addrs = {t._raw.addr for t in (ga, gb, gc, seed)}
    assert len(addrs) == 4
    opt = fu.optim.SGD(lr=1.0)
    for name, w in (("a", a), ("b", b), ("c", c)):
        opt.add_param(w, name=name)
    opt.scale_gradients(0.5)
    for w in (a, b, c):
        assert w.grad().numpy().tolist() == [0.5, 1.0]
    assert seed.numpy().tolist() == [1.0, 2.0]


def test_grad_view_is_a_snapshot_and_grad_a_copy(ctx):
    w = ctx.variable([1.0], ("n",))
    w.scale(2.0).sum_all().backward()
    view, copy = w.grad_view(), w.grad()
    w.scale(2.0).sum_all().backward()
    assert view.numpy().tolist() == [2.0] and copy.numpy().tolist() == [2.0]
    assert w.grad().numpy().tolist() == [4.0]


def test_variable_rules(ctx):
    w = ctx.variable([1.0, 2.0], ("n",))
    with pytest.raises(fu.MutableDataRequiresNoGrad):
        w.data()
    assert w.data_const().tolist() == [1.0, 2.0]
    with pytest.raises(fu.DTypeError):
        ctx.variable([1, 2], ("n",), dtype="i64")
    h = ctx.variable([1.0, 2.0], ("n",), dtype="bf16")
    with pytest.raises(fu.UnsupportedGradient):
        h * h
    (h.to("f32") * 3.0).sum_all().backward()
    g = h.grad()
    assert g.dtype == "f32" and g.numpy().tolist() == [3.0, 3.0]
    with pytest.raises(fu.GradientCastUnsupported):
        w.to("i64")


# ---- every rule: finite differences (gradcheck) and torch ----

BINARY_OPS = ["add", "sub", "mul", "div", "maximum", "minimum", "pow"]


def torch_binary(op, a, b):
    return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
            "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow}[op](a, b)


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_rules_against_torch_and_fd(ctx, op):
    a_np, b_np = pos(3, 4), pos(4)
    w_np = rnd(3, 4)
    a, b = ctx.variable(a_np, ("i", "j")), ctx.variable(b_np, ("j",))
    w = ctx.tensor(w_np, ("i", "j"))
    (getattr(a, op)(b) * w).sum_all().backward()
    ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    (torch_binary(op, ta, tb) * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.grad().numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-5)
    a.zero_grad()
    b.zero_grad()
    r = fu.gradcheck(lambda x, y: (getattr(x, op)(y) * w).sum_all(), [a, b])
    assert r.checked == 16


def test_maximum_tie_splits_gradient(ctx):
    a, b = ctx.variable([1.0, 2.0, 3.0], ("n",)), ctx.variable([1.0, 5.0, 0.0], ("n",))
    a.maximum(b).sum_all().backward()
    assert a.grad().numpy().tolist() == [0.5, 0.0, 1.0] and b.grad().numpy().tolist() == [0.5, 1.0, 0.0]


@pytest.mark.parametrize("op,s,reflected", [
    ("add", 1.5, False), ("sub", 1.5, True), ("mul", -2.0, False), ("div", 3.0, False),
    ("div", 3.0, True), ("pow", 2.5, False), ("pow", 1.7, True)])
def test_scalar_rules(ctx, op, s, reflected):
    a_np = pos(5)
    a = ctx.variable(a_np, ("n",))
    f = {"add": lambda x: x + s, "sub": (lambda x: s - x) if reflected else (lambda x: x - s),
         "mul": lambda x: x * s, "div": (lambda x: s / x) if reflected else (lambda x: x / s),
         "pow": (lambda x: s ** x) if reflected else (lambda x: x ** s)}[op]
    f(a).sum_all().backward()
    ta = torch.tensor(a_np, requires_grad=True)
    f(ta).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    a.zero_grad()
    assert fu.gradcheck(lambda x: f(x).sum_all(), [a]).checked == 5


@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt"])
def test_unary_rules(ctx, op):
    a_np = pos(6) if op in ("log", "sqrt") else rnd(6)
    w_np = rnd(6)
    a = ctx.variable(a_np, ("n",))
    (getattr(a, op)() * ctx.tensor(w_np, ("n",))).sum_all().backward()
    ta = torch.tensor(a_np, requires_grad=True)
    (getattr(torch, op)(ta) * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    a.zero_grad()
    w = ctx.tensor(w_np, ("n",))
    assert fu.gradcheck(lambda x: (getattr(x, op)() * w).sum_all(), [a]).checked == 6


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
def test_reduction_rules(ctx, op, axis):
    a_np, w_np = rnd(4, 5), rnd(*([5] if axis == 0 else [4]))
    a = ctx.variable(a_np, ("i", "j"))
    tag = ("i", "j")[axis]
    w = ctx.tensor(w_np, ("j",) if axis == 0 else ("i",))
    (getattr(a, op)(tag) * w).sum_all().backward()
    ta = torch.tensor(a_np, requires_grad=True)
    red = {"sum": lambda t: t.sum(axis), "mean": lambda t: t.mean(axis),
           "max": lambda t: t.max(axis).values, "min": lambda t: t.min(axis).values}[op]
    (red(ta) * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    a.zero_grad()
    assert fu.gradcheck(lambda x: (getattr(x, op)(tag) * w).sum_all(), [a]).checked == 20


def test_max_gradient_goes_to_first_occurrence(ctx):
    a = ctx.variable([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], ("r", "c"))
    a.max("c").sum_all().backward()
    assert a.grad().numpy().tolist() == [[0, 1, 0], [1, 0, 0]]


def test_sum_all_mean_all_views_and_casts(ctx):
    a_np = rnd(3, 4)
    a = ctx.variable(a_np, ("i", "j"))
    y = a.narrow("j", 1, 2).permute(("j", "i")).contiguous().to("bf16").to("f32")
    (y.mean_all() + a.sum_all()).backward()
    want = np.ones((3, 4), np.float32)
    want[:, 1:3] += np.float32(1 / 6)
    np.testing.assert_allclose(a.grad().numpy(), want, rtol=1e-6)
    a.zero_grad()
    assert fu.gradcheck(lambda x: x.narrow("j", 1, 2).permute(("j", "i")).tanh().sum_all(), [a]).checked == 12


def test_mlp_against_torch(ctx):
    """Two layers through elementwise ops and reductions (dot arrives with the GEMM)."""
    x_np, w1_np, w2_np = rnd(8, 5), rnd(5, 7) * 0.5, rnd(7) * 0.5
    x = ctx.tensor(x_np, ("b", "i"))
    w1, w2 = ctx.variable(w1_np, ("i", "h")), ctx.variable(w2_np, ("h",))
    xb = x.permute(("i", "b"))
    hidden = (xb * w1).sum("i").tanh()  # (i, b) * (i, h) -> (i, b, h) -> sum over i -> (b, h)
    loss = (hidden * w2).sum("h").mean("b")
    loss.backward()
    tx = torch.from_numpy(x_np)
    tw1, tw2 = torch.tensor(w1_np, requires_grad=True), torch.tensor(w2_np, requires_grad=True)
    tl = (torch.tanh(tx @ tw1) @ tw2).mean()
    tl.backward()
    assert abs(loss.item() - tl.item()) <= 1e-5
    np.testing.assert_allclose(w1.grad().numpy(), tw1.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(w2.grad().numpy(), tw2.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_gradients_bitwise_at_one_and_two_threads(ctx1, ctx2):
    a_np, b_np = rnd(300, 257), rnd(257)
    grads = []
    for c in (ctx1, ctx2):
        a, b = c.variable(a_np, ("i", "j")), c.variable(b_np, ("j",))
        ((a * b).tanh().max("j").sum_all() + (a - b).sum("i").mean_all()).backward()
        grads.append((a.grad().numpy(), b.grad().numpy()))
    assert_bitwise(grads[0][0], grads[1][0])
    assert_bitwise(grads[0][1], grads[1][1])


def test_gradcheck_options_and_errors(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))
    with pytest.raises(fu.InvalidGradcheckOptions):
        fu.gradcheck(lambda v: v.sum_all(), [x], eps=0.0)
    with pytest.raises(fu.InvalidGradcheckOptions):
        fu.gradcheck(lambda v: v.sum_all(), [x], abs_tol=float("nan"))
    with pytest.raises(fu.NoVariableInputs):
        fu.gradcheck(lambda v: v.sum_all(), [ctx.tensor([1.0], ("n",))])
    with pytest.raises(TypeError, match="scalar"):
        fu.gradcheck(lambda v: v * 2.0, [x])
    y = ctx.variable([1.0], ("n",))
    with pytest.raises(fu.MissingAnalyticalGradient):
        fu.gradcheck(lambda v, u: v.sum_all(), [x, y])
    with pytest.raises(fu.GradientMismatch):
        fu.gradcheck(lambda v: v.detach().sum_all() + v.sum_all() * 0.0 + (v * v).detach().sum_all(), [x])


# ---- ownership and scopes (R-5, R-6) ----

def test_replace_acceptance(ctx):
    x = ctx.tensor([1.0, 2.0], ("n",))
    for _ in range(3):
        x = ctx.replace(x, lambda: x.scale(2.0))
    assert x.numpy().tolist() == [8.0, 16.0]
    old = x
    with pytest.raises(fu.TagError):
        ctx.replace(x, lambda: x.sum("nope"))
    assert old.numpy().tolist() == [8.0, 16.0]  # on error the old value stays


def test_scope_borrows_are_released_at_close(ctx):
    w = ctx.variable([1.0, 2.0], ("n",))
    with ctx.exec_scope():
        y = w * 3.0
        z = ctx.zeros((2,), ("n",))             # constructors stay caller-owned
        h = ctx.tensor([1.0, 2.0], ("n",), dtype="f16") * 2.0   # typed constants too
        assert y.scope_owned and not z.scope_owned and not h.scope_owned
        y.release()                               # a no-op on a borrow
        loss = y.sum_all()
        loss.backward()
    with pytest.raises(fu.UseAfterRelease, match="exec scope closed"):
        y.numpy()
    assert z.numpy().tolist() == [0, 0] and h.numpy().tolist() == [2.0, 4.0]
    assert w.grad().numpy().tolist() == [3.0, 3.0] and not w.grad().scope_owned


def test_scopes_nest_and_close_innermost_first(ctx):
    outer = ctx.open_exec_scope()
    a = ctx.tensor([1.0], ("n",)) * 2.0
    inner = ctx.open_exec_scope()
    b = a * 2.0
    with pytest.raises(AssertionError):
        ctx.close_exec_scope(outer)
    ctx.close_exec_scope(inner)
    assert a.numpy().tolist() == [2.0]
    with pytest.raises(fu.UseAfterRelease):
        b.numpy()
    ctx.close_exec_scope(outer)
    with pytest.raises(fu.UseAfterRelease):
        a.numpy()


def test_pool_acceptance_under_a_scope_touches_32_buffers(ctx):
    n = (1 << 20) // 4
    x = ctx.tensor(np.zeros(n, np.float32), ("n",))
    seen = set()
    with ctx.exec_scope():
        y = x
        for _ in range(32):
            y = y.add_scalar(1.0)
            seen.add(y.data_const().__array_interface__["data"][0])
        assert y.numpy()[0] == 32.0
    assert len(seen) == 32


def test_graph_scope_frees_what_backward_does_not_read(ctx):
    """Inside a graph scope a chain of 32 same-shaped ops under gradients touches 2 buffers (an
    add saves nothing: each link dies once the next is made, as without a scope), composed ops
    still find a scope open, and the result handed to the enclosing scope is its borrow."""
    n = (1 << 20) // 4
    w = ctx.variable(np.ones(n, np.float32), ("n",))
    x = ctx.tensor(np.zeros(n, np.float32), ("n",))
    seen = set()
    with ctx.exec_scope():
        with ctx.graph_scope():
            y = x + w
            for _ in range(32):
                y = y.add_scalar(1.0)
                seen.add(y.data_const().__array_interface__["data"][0])
            assert not y.scope_owned
            s = fu.einsum_many((), y, ctx.tensor(np.ones(n, np.float32), ("n",)))  # composed
        assert not s.scope_owned
        assert s._to_scope() is s and s.scope_owned
        s.backward()
        assert s.numpy() == 33.0 * n
    assert len(seen) == 2
    with pytest.raises(fu.UseAfterRelease, match="exec scope closed"):
        s.numpy()
    assert w.grad().numpy()[:3].tolist() == [1.0, 1.0, 1.0]


def test_graph_scope_nests_with_exec_scopes(ctx):
    """An exec scope inside a graph scope adopts and releases as always; scopes still close
    innermost first; with no exec scope around, _to_scope leaves the result caller-owned."""
    outer = ctx.open_graph_scope()
    a = ctx.tensor([1.0], ("n",)) * 2.0
    inner = ctx.open_exec_scope()
    b = a * 2.0
    assert b.scope_owned and not a.scope_owned
    with pytest.raises(AssertionError):
        ctx.close_exec_scope(outer)
    ctx.close_exec_scope(inner)
    with pytest.raises(fu.UseAfterRelease):
        b.numpy()
    c = a * 3.0
    ctx.close_exec_scope(outer)
    assert a.numpy().tolist() == [2.0] and not c._to_scope().scope_owned
    assert not ctx.scopes and not ctx.adopting


def test_scope_close_frees_the_graph_behind_a_kept_result(ctx):
    """Releasing a result drops its node's links to the parents: the saved buffers of a graph
    made in a graph scope go back to the pool when the enclosing scope closes, even while the
    caller still holds the (released) result and never ran backward."""
    w = ctx.variable(np.ones(4096, np.float32), ("n",))
    base = ctx.pool.outstanding_buffers()
    with ctx.exec_scope():
        with ctx.graph_scope():
            y = w
            for _ in range(8):
                y = y * w          # each mul saves its operands
            loss = y.sum_all()
            del y
        loss._to_scope()
        assert ctx.pool.outstanding_buffers() == base + 8   # y1 .. y7 saved, and the loss
    assert ctx.pool.outstanding_buffers() == base
    with pytest.raises(fu.UseAfterRelease):
        loss.backward()


def test_released_node_before_backward_is_an_error(ctx):
    w = ctx.variable([1.0, 2.0], ("n",))
    h = w * 2.0
    loss = h.sum_all()
    h.release()
    with pytest.raises(fu.GraphNodeReleased, match="released before backward"):
        loss.backward()
    with ctx.exec_scope():
        h2 = w * 2.0
    with pytest.raises(fu.UseAfterRelease):
        h2.sum_all()


# ---- custom_vjp (SPEC §3.21) ----

class ScaledSquare:
    Output = ("n",)

    @staticmethod
    def forward(ctx, extra, inputs):
        (x,) = inputs
        return (x * x).scale(extra)

    @staticmethod
    def backward(ctx, extra, inputs, output, gy, needs_grad, out):
        (x,) = inputs
        out[0] = (gy * x).scale(2.0 * extra)


def test_custom_vjp_acceptance(ctx):
    x = ctx.variable([1.0, -2.0, 3.0], ("n",))
    y = fu.custom_vjp(ScaledSquare, 0.5, [x])
    assert y.numpy().tolist() == [0.5, 2.0, 4.5] and y.requires_grad
    r = fu.gradcheck(lambda v: fu.custom_vjp(ScaledSquare, 0.5, [v]).sum_all(), [x])
    assert r.checked == 3
    c = fu.custom_vjp(ScaledSquare, 0.5, [ctx.tensor([1.0], ("n",))])
    assert not c.requires_grad
    with fu.no_grad():
        assert not fu.custom_vjp(ScaledSquare, 0.5, [x]).requires_grad


def test_custom_vjp_errors(ctx):
    x = ctx.variable([1.0, 2.0], ("n",))

    class NoBackward:
        Output = ("n",)

        @staticmethod
        def forward(ctx, extra, inputs):
            return inputs[0] * 1.0

    with pytest.raises(TypeError, match="backward"):
        fu.custom_vjp(NoBackward, None, [x])

    class Forgetful(ScaledSquare):
        @staticmethod
        def backward(ctx, extra, inputs, output, gy, needs_grad, out):
            pass

    with pytest.raises(fu.MissingBackwardGradient):
        fu.custom_vjp(Forgetful, 1.0, [x]).sum_all().backward()

    class WrongShape(ScaledSquare):
        @staticmethod
        def backward(ctx, extra, inputs, output, gy, needs_grad, out):
            out[0] = ctx.tensor([1.0, 2.0, 3.0], ("n",))

    with pytest.raises(fu.ShapeMismatch):
        fu.custom_vjp(WrongShape, 1.0, [x]).sum_all().backward()
    with pytest.raises(fu.DTypeError):
        fu.custom_vjp(ScaledSquare, 1.0, [ctx.tensor([1, 2], ("n",), dtype="i64")])
