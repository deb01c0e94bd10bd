"""Contractions at the Tensor level (SPEC A-4…A-9): acceptances, einsum against numpy for
every role, gradients against torch and finite differences, and bad input."""

import weakref

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(7)


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_acceptances(ctx):
    a = ctx.from_slice(("b", "m", "k"), (2, 1, 2), [1, 2, 5, 6])
    b = ctx.from_slice(("b", "k", "n"), (2, 2, 1), [3, 4, 7, 8])
    r = a.dot(b, "k")
    assert r.tags == ("b", "m", "n") and r.numpy().ravel().tolist() == [11, 83]
    q = ctx.from_slice(("g", "i", "d"), (2, 1, 2), [1, 2, 3, 4])
    k = ctx.from_slice(("j", "d"), (2, 2), [1, 0, 0, 1])
    assert q.einsum(k, ("g", "i", "j")).numpy().ravel().tolist() == [1, 2, 3, 4]
    s = ctx.from_slice(("s", "k"), (2, 2), [1, 2, 3, 4]).einsum(ctx.from_slice(("k", "n"), (2, 2), [5, 6, 7, 8]), ("n",))
    assert s.numpy().tolist() == [62, 72]
    x = ctx.from_slice(("s", "i"), (1, 2), [1, 1])
    A = ctx.from_slice(("r", "i"), (1, 2), [2, 3])
    B = ctx.from_slice(("o", "r"), (2, 1), [1, -1])
    assert fu.einsum_many(("s", "o"), x, A, B).numpy().ravel().tolist() == [5, -5]
    x = ctx.from_slice(("m", "k"), (1, 2), [1, 2])
    w = ctx.from_slice(("n", "k"), (2, 2), [3, 4, 5, 6])
    assert x.matmul(w, "trans_b", ("m", "n")).numpy().ravel().tolist() == [11, 17]
    res = ctx.tensor([[1, 1], [2, 2]], ("r", "c"))
    out = res.add_dot(ctx.tensor([[1, 2], [3, 4]], ("r", "k")), ctx.tensor([[5, 6], [7, 8]], ("k", "c")), "k")
    assert out.numpy().ravel().tolist() == [20, 23, 45, 52]
    v = ctx.tensor([1.0, 2.0], ("k",))
    assert v.dot(v, "k").tags == () and v.dot(v, "k").item() == 5.0


SIZES = {"b": 3, "i": 5, "j": 4, "k": 6, "p": 2, "q": 3}


@pytest.mark.parametrize("xt,yt,out", [
    (("i", "k"), ("k", "j"), ("i", "j")),
    (("i", "k"), ("k", "j"), ("j", "i")),
    (("k", "i"), ("j", "k"), ("i", "j")),
    (("b", "i", "k"), ("b", "k", "j"), ("b", "i", "j")),
    (("i", "b", "k"), ("k", "j", "b"), ("j", "b", "i")),
    (("i", "k", "p"), ("k", "j"), ("i", "j")),          # x-private dropped: summed first
    (("i", "k"), ("q", "k", "j"), ("j",)),
    (("i",), ("j",), ("i", "j")),                       # outer product
    (("b", "i", "k", "p"), ("p", "b", "k", "j"), ("b", "j", "i")),  # two contraction axes
])
def test_einsum_roles_against_numpy(ctx, xt, yt, out):
    xa, ya = rnd(*[SIZES[t] for t in xt]), rnd(*[SIZES[t] for t in yt])
    got = ctx.tensor(xa, xt).einsum(ctx.tensor(ya, yt), out)
    want = np.einsum(f"{''.join(xt)},{''.join(yt)}->{''.join(out)}", xa.astype(np.float64), ya.astype(np.float64))
    assert got.tags == out
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5 * 36, rtol=0)


@pytest.mark.parametrize("xt,yt,out", [
    (("b", "i", "k"), ("b", "k", "j"), ("b", "i", "j")),
    (("i", "k", "p"), ("k", "j"), ("j", "i")),
    (("k", "i"), ("j", "k", "q"), ("i", "j")),
])
def test_einsum_gradients_against_torch_and_fd(ctx, xt, yt, out):
    xa, ya = rnd(*[SIZES[t] for t in xt]), rnd(*[SIZES[t] for t in yt])
    wa = rnd(*[SIZES[t] for t in out])
    x, y = ctx.variable(xa, xt), ctx.variable(ya, yt)
    w = ctx.tensor(wa, out)
    (x.einsum(y, out) * w).sum_all().backward()
    tx, ty = torch.tensor(xa, requires_grad=True), torch.tensor(ya, requires_grad=True)
    spec = f"{''.join(xt)},{''.join(yt)}->{''.join(out)}"
    (torch.einsum(spec, tx, ty) * torch.from_numpy(wa)).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y.grad().numpy(), ty.grad.numpy(), rtol=1e-4, atol=1e-5)
    x.zero_grad()
    y.zero_grad()
    r = fu.gradcheck(lambda p, q: (p.einsum(q, out) * w).sum_all(), [x, y], abs_tol=2e-3)
    assert r.checked == xa.size + ya.size


@pytest.mark.parametrize("kind,sa,sb", [
    ("plain", (4, 5), (5, 3)), ("trans_b", (4, 5), (3, 5)), ("plain", (2, 4, 5), (5, 3)),
    ("trans_a", (2, 5, 4), (2, 5, 3)), ("trans_b", (1, 4, 5), (3, 3, 5)), ("plain", (3, 1, 4, 5), (2, 5, 3))])
def test_matmul_kinds_and_batch_broadcast(ctx, kind, sa, sb):
    a_np, b_np = rnd(*sa), rnd(*sb)
    tags_a = tuple(f"a{i}" for i in range(len(sa)))
    tags_b = tuple(f"b{i}" for i in range(len(sb)))
    a, b = ctx.variable(a_np, tags_a), ctx.variable(b_np, tags_b)
    ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    tr = torch.matmul(ta.transpose(-1, -2) if kind == "trans_a" else ta,
                      tb.transpose(-1, -2) if kind == "trans_b" else tb)
    out_tags = tuple(f"o{i}" for i in range(tr.dim()))
    r = a.matmul(b, kind, out_tags)
    assert r.shape == tuple(tr.shape)
    np.testing.assert_allclose(r.numpy(), tr.detach().numpy(), rtol=1e-5, atol=1e-5)
    w = rnd(*tr.shape)
    (r * ctx.tensor(w, out_tags)).sum_all().backward()
    (tr * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(a.grad().numpy(), ta.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.grad().numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_add_dot_gradients(ctx):
    r_np, a_np, b_np = rnd(4, 3), rnd(4, 5), rnd(5, 3)
    r, a, b = ctx.variable(r_np, ("r", "c")), ctx.variable(a_np, ("r", "k")), ctx.variable(b_np, ("k", "c"))
    (r.add_dot(a, b, "k") * r).sum_all().backward()
    tr, ta, tb = (torch.tensor(v, requires_grad=True) for v in (r_np, a_np, b_np))
    (torch.addmm(tr, ta, tb) * tr).sum().backward()
    for mine, theirs in ((r, tr), (a, ta), (b, tb)):
        np.testing.assert_allclose(mine.grad().numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["dot", "matmul", "add_dot"])
def test_a_contraction_keeps_only_the_operand_its_gradient_reads(ctx, form):
    """dX reads Y and dY reads X: a product whose left operand alone needs a gradient (x · W
    with W frozen, LoRA's base projection) keeps W, not x, so x's buffer goes back to the pool
    with its last handle while the graph lives on; and the other way round. Gradients as torch."""
    x_np, w_np, r_np = rnd(6, 5), rnd(5, 4), rnd(6, 4)
    for left_grad in (True, False):
        h = ctx.variable(x_np, ("s", "k")) if left_grad else ctx.tensor(x_np, ("s", "k"))
        w = ctx.tensor(w_np, ("k", "o")) if left_grad else ctx.variable(w_np, ("k", "o"))
        x = h * 1.0                             # an intermediate only the product could keep
        w2 = w * 1.0
        if form == "dot":
            y = x.dot(w2, "k")
        elif form == "matmul":
            y = x.matmul(w2, "plain", ("s", "o"))
        else:
            y = ctx.tensor(r_np, ("s", "o")).add_dot(x, w2, "k")
        gone = weakref.ref((x if left_grad else w2)._raw.buf)
        del x, w2
        assert gone() is None, form
        y.sum_all().backward()
        th, tw = (torch.tensor(v, requires_grad=True) for v in (x_np, w_np))
        (th @ tw).sum().backward()
        leaf, want = (h, th) if left_grad else (w, tw)
        np.testing.assert_allclose(leaf.grad().numpy(), want.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_rhs(ctx, dtype):
    x_np, w_np = rnd(3, 8), rnd(8, 4)
    x = ctx.variable(x_np, ("s", "i"))
    w_const = ctx.tensor(w_np, ("i", "o"), dtype=dtype)
    y = x.dot(w_const, "i")
    wide = w_const.to("f32").numpy()
    np.testing.assert_allclose(y.numpy(), x_np.astype(np.float64) @ wide, atol=1e-5 * 8)
    y.sum_all().backward()
    np.testing.assert_allclose(x.grad().numpy(), np.ones((3, 4)) @ wide.T, rtol=1e-5)
    w_var = ctx.variable(w_np, ("i", "o"), dtype=dtype)
    x.dot(w_var, "i").sum_all().backward()
    g = w_var.grad()
    assert g.dtype == "f32"
    np.testing.assert_allclose(g.numpy(), x_np.T @ np.ones((3, 4)), rtol=1e-5)


def test_mlp_against_torch(ctx):
    """Two layers, tanh, through dot; loss and every gradient against torch."""
    x_np, w1_np, b1_np, w2_np = rnd(16, 12), rnd(12, 32) * 0.3, rnd(32) * 0.1, rnd(32, 10) * 0.3
    x = ctx.tensor(x_np, ("b", "i"))
    w1, b1, w2 = ctx.variable(w1_np, ("i", "h")), ctx.variable(b1_np, ("h",)), ctx.variable(w2_np, ("h", "o"))
    out = (x.dot(w1, "i") + b1).tanh().dot(w2, "h")
    loss = (out * out).mean_all()
    loss.backward()
    tw1, tb1, tw2 = (torch.tensor(v, requires_grad=True) for v in (w1_np, b1_np, w2_np))
    tout = torch.tanh(torch.from_numpy(x_np) @ tw1 + tb1) @ tw2
    tl = (tout * tout).mean()
    tl.backward()
    assert abs(loss.item() - tl.item()) <= 1e-5 * abs(tl.item()) + 1e-6
    for mine, theirs in ((w1, tw1), (b1, tb1), (w2, tw2)):
        np.testing.assert_allclose(mine.grad().numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_contractions_bitwise_for_any_thread_count(ctx1, ctx2):
    xa, ya = rnd(3, 37, 129), rnd(3, 129, 65)
    res = []
    for c in (ctx1, ctx2):
        x, y = c.variable(xa, ("b", "m", "k")), c.variable(ya, ("b", "k", "n"))
        z = x.dot(y, "k")
        z.sum_all().backward()
        res.append((z.numpy(), x.grad().numpy(), y.grad().numpy()))
    for p, q in zip(*res):
        assert_bitwise(p, q)


def test_bad_input(ctx):
    x, y = ctx.tensor(rnd(2, 3), ("m", "k")), ctx.tensor(rnd(4, 5), ("k", "n"))
    with pytest.raises(fu.TagError, match="'q'"):
        x.dot(y, "q")
    with pytest.raises(fu.ShapeMismatch, match="'k' has size 3 .* 4"):
        x.dot(y, "k")
    with pytest.raises(fu.TagError, match="neither"):
        x.einsum(ctx.tensor(rnd(3, 5), ("k", "n")), ("m", "z"))
    with pytest.raises(fu.TagError, match="unique"):
        x.einsum(ctx.tensor(rnd(3, 5), ("k", "n")), ("m", "m"))
    with pytest.raises(fu.TagError, match="use dot"):
        x.matmul(ctx.tensor(rnd(2, 4), ("m", "n")), "trans_a", ("k", "n"))
    with pytest.raises(fu.TagError):
        ctx.tensor(rnd(2, 2), ("r", "c")).add_dot(x, y, "k")
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1, 2], ("k",), dtype="i64").dot(ctx.tensor([1, 2], ("k",)), "k")
    w = ctx.variable(rnd(3, 5), ("k", "n"))
    with pytest.raises(fu.ActiveExecScopeRequired):
        fu.einsum_many(("m", "n"), x, w, ctx.tensor(rnd(5, 5), ("n", "o")))
    with ctx.exec_scope():
        r = fu.einsum_many(("m", "o"), x, w, ctx.tensor(rnd(5, 5), ("n", "o")))
        assert r.tags == ("m", "o") and r.scope_owned


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_rhs_when_the_output_wants_the_transpose(ctx, dtype):
    x_np, w_np = rnd(3, 8), rnd(8, 4)
    w = ctx.tensor(w_np, ("i", "o"), dtype=dtype)
    y = ctx.tensor(x_np, ("s", "i")).einsum(w, ("o", "s"))
    np.testing.assert_allclose(y.numpy(), (x_np.astype(np.float64) @ w.to("f32").numpy()).T, atol=1e-5 * 8)


def test_skinny_transposed_output_keeps_the_wide_product(ctx, monkeypatch):
    """A LoRA weight's gradient [out, r] = gᵀ·u: einsum runs the wide product uᵀ·g (r rows
    against `out` columns) and copies its small result into out order, instead of a GEMM with
    r columns — the same bits (one FMA chain per element either way), checked against the
    swapped plan and numpy; rows of C up to RV_ROWS take rowvec whatever b's size, with the
    packed path's bits."""
    from fucina.exec import einsum as es
    from fucina.exec import matmul as mm
    rng = np.random.default_rng(5)
    u, g = rng.standard_normal((1024, 8), np.float32), rng.standard_normal((1024, 600), np.float32)
    ut, gt = ctx.tensor(u, ("seq", "r")), ctx.tensor(g, ("seq", "out"))
    outs = []
    for skinny, rows in ((0, 0), (es.SKINNY, mm.RV_ROWS)):
        monkeypatch.setattr(es, "SKINNY", skinny)
        monkeypatch.setattr(mm, "RV_ROWS", rows)
        es._plan.cache_clear()
        mm._plans.clear()
        outs.append(ut._einsum(gt, ("out", "r")).numpy())
        a, b = ctx.from_numpy(u.T.copy()), ctx.from_numpy(g)
        assert mm.path_of(a, b) == ("rowvec" if rows else "packed direct-b")
        outs.append(mm.gemm(ctx, a, b).to_numpy())
    es._plan.cache_clear()
    mm._plans.clear()
    assert_bitwise(outs[0], outs[2])
    assert_bitwise(outs[1], outs[3])
    np.testing.assert_allclose(outs[2], g.T.astype(np.float64) @ u, rtol=1e-5, atol=1e-3)
