"""Selection (SPEC §3.15): argmax, top_k, sort, argsort and router_top_k against numpy / torch
and a literal Python transcription of the SPEC rules (NaN, -inf and ties), on the row walker
(selected axis last) and the column walker (any other axis), both top-k algorithms (insertion
up to INSERT_MAX slots, the radix sort beyond); the value gradients against torch and finite
differences; ownership under exec scopes; bad input; bitwise thread invariance."""
import math

import numpy as np
import pytest
import torch

import fucina as fu
from fucina.exec.selection import INSERT_MAX

RNG = np.random.default_rng(11)
NAN, INF = float("nan"), float("inf")


def rand(shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def distinct(shape, scale=0.01):
    """Distinct values (no ties, so torch's tie order never matters), in random order."""
    n = int(np.prod(shape))
    return ((RNG.permutation(n) - n / 2) * scale).astype(np.float32).reshape(shape)


def tags_of(n):
    return tuple("abcdefgh"[:n])


# ---------------------------------------------------------------------------------------------
# literal references of the SPEC rules (per 1-D row, Python floats)

def ref_argmax(row):
    best_i, best = None, -INF
    for i, v in enumerate(row):
        if v > best:
            best, best_i = v, i
        elif best_i is None and v == best:  # a row whose max is -inf: its first -inf
            best_i = i
    return 0 if best_i is None else best_i


def ref_top_k(row, k):
    vals, idx = [-INF] * k, [0] * k
    for i, v in enumerate(row):
        if not v > vals[-1]:
            continue
        s = k - 1
        while s > 0 and vals[s - 1] < v:
            vals[s], idx[s] = vals[s - 1], idx[s - 1]
            s -= 1
        vals[s], idx[s] = v, i
    return vals, idx


def along(a, axis, fn):
    """Apply fn(row) -> tuple of 1-D results along `axis` of a; stack them back in place."""
    moved = np.moveaxis(a, axis, -1)
    outs = [fn(list(map(float, r))) for r in moved.reshape(-1, moved.shape[-1])]
    res = []
    for j in range(len(outs[0])):
        arr = np.array([o[j] for o in outs]).reshape(moved.shape[:-1] + (-1,))
        res.append(np.moveaxis(arr, -1, axis))
    return res


def tie_heavy(shape):
    """Small integers (many ties) with NaN and -inf sprinkled in."""
    a = RNG.integers(-3, 4, size=shape).astype(np.float32)
    a[RNG.random(shape) < 0.1] = NAN
    a[RNG.random(shape) < 0.1] = -INF
    return a


# ---------------------------------------------------------------------------------------------
# acceptance (SPEC §3.15)

def test_acceptance(ctx):
    logits = ctx.tensor([[1.0, 3.0, 2.0, 0.0]], ("row", "expert"))
    best = logits.argmax("expert")
    assert best.dtype == "i64" and best.tags == ("row",) and best.numpy().tolist() == [1]
    top = logits.top_k("expert", 2, "k")
    assert top.values.numpy().tolist() == [[3.0, 2.0]] and top.indices.numpy().tolist() == [[1, 2]]
    assert top.values.tags == ("row", "k") and top.indices.dtype == "i64"
    selected, weights = [0, 0], [0.0, 0.0]
    logits.router_top_k("expert", 2, selected, weights)
    assert selected[0] == 1 and weights[0] == pytest.approx(0.7310586, abs=1e-6)
    x = ctx.tensor([[30.0, 10.0, 20.0], [5.0, 15.0, 0.0]], ("row", "col"))
    order = x.argsort("col", False)
    assert order.dtype == "i64"
    # take_along_axis with the i64 order sorts each row (the gather family's op, applied in numpy)
    assert np.take_along_axis(x.numpy(), order.numpy(), 1).reshape(-1).tolist() == [10, 20, 30, 0, 5, 15]


# ---------------------------------------------------------------------------------------------
# argmax

@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1), (2, 17), (4, 64), (3, 65), (2, 1000), (5, 3, 33)])
def test_argmax_every_axis(ctx, shape):
    a = rand(shape)
    x = ctx.tensor(a, tags_of(len(shape)))
    for ax, tag in enumerate(x.tags):
        got = x.argmax(tag)
        assert got.tags == tuple(t for t in x.tags if t != tag)
        np.testing.assert_array_equal(got.numpy(), np.argmax(a, axis=ax))


@pytest.mark.parametrize("axis", [0, 1])
def test_argmax_nan_inf_and_ties(ctx, axis):
    rows = [[NAN, 3.0, NAN, 3.0, 1.0],   # NaN never wins; first of the tie
            [NAN, NAN, NAN, NAN, NAN],   # all NaN -> 0
            [-INF, -INF, -INF, -INF, -INF],
            [NAN, -INF, NAN, -INF, NAN],  # max -inf -> its first -inf index
            [1.0, INF, 2.0, INF, NAN],
            [-0.0, 0.0, -1.0, 0.0, -0.0]]
    a = np.array(rows, np.float32)
    a = a if axis == 1 else np.ascontiguousarray(a.T)
    x = ctx.tensor(a, ("p", "q"))
    want = [1, 0, 0, 1, 1, 0]
    assert x.argmax(("p", "q")[axis]).numpy().tolist() == want
    assert [ref_argmax(list(r)) for r in rows] == want


def test_argmax_tie_heavy_matches_reference(ctx):
    a = tie_heavy((6, 300, 21))
    x = ctx.tensor(a, ("a", "n", "b"))
    for ax, tag in enumerate(x.tags):
        want, = along(a, ax, lambda r: (ref_argmax(r),))
        np.testing.assert_array_equal(x.argmax(tag).numpy(), np.squeeze(want, axis=ax))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_argmax_16bit(ctx, dtype):
    a = rand((5, 300))
    x = ctx.tensor(a, ("r", "c"), dtype=dtype)
    wide = x.numpy()  # the stored 16-bit values, widened
    np.testing.assert_array_equal(x.argmax("c").numpy(), [ref_argmax(list(map(float, r))) for r in wide])
    np.testing.assert_array_equal(x.argmax("r").numpy(), [ref_argmax(list(map(float, r))) for r in wide.T])


# ---------------------------------------------------------------------------------------------
# top_k

@pytest.mark.parametrize("shape", [(9,), (3, 70), (2, 1000), (4, 5, 66), (2, 150, 3)])
def test_top_k_against_torch(ctx, shape):
    a = distinct(shape)
    x = ctx.tensor(a, tags_of(len(shape)))
    for ax, tag in enumerate(x.tags):
        n = shape[ax]
        for k in sorted({1, 2, min(8, n), min(INSERT_MAX, n), min(INSERT_MAX + 1, n), n}):
            top = x.top_k(tag, k, "k")
            tv, ti = torch.from_numpy(a).topk(k, dim=ax)
            np.testing.assert_array_equal(top.values.numpy(), tv.numpy())
            np.testing.assert_array_equal(top.indices.numpy(), ti.numpy())
            assert top.values.tags == x.tags[:ax] + ("k",) + x.tags[ax + 1:]


@pytest.mark.parametrize("k", [1, 3, 10, INSERT_MAX, INSERT_MAX + 1, 90, 120])
def test_top_k_ties_nan_inf_match_reference(ctx, k):
    a = tie_heavy((5, 120, 3))
    x = ctx.tensor(a, ("a", "n", "b"))
    for ax, tag in ((1, "n"), (0, "a")):
        kk = min(k, a.shape[ax])
        top = x.top_k(tag, kk, "k")
        vals, idx = along(a, ax, lambda r: ref_top_k(r, kk))
        np.testing.assert_array_equal(top.values.numpy(), vals.astype(np.float32))
        np.testing.assert_array_equal(top.indices.numpy(), idx)
    last = np.ascontiguousarray(np.moveaxis(a, 1, 2))  # selected axis last: the row walker
    top = ctx.tensor(last, ("a", "b", "n")).top_k("n", k, "k")
    vals, idx = along(last, 2, lambda r: ref_top_k(r, k))
    np.testing.assert_array_equal(top.values.numpy(), vals.astype(np.float32))
    np.testing.assert_array_equal(top.indices.numpy(), idx)


def test_top_k_unfilled_slots(ctx):
    x = ctx.tensor([NAN, -INF, 1.0, NAN, 1.0], ("n",))
    for k in (3, 5):
        top = x.top_k("n", k, "n")  # out_tag may equal tag
        assert top.values.tags == ("n",)
        assert top.values.numpy().tolist() == [1.0, 1.0] + [-INF] * (k - 2)
        assert top.indices.numpy().tolist() == [2, 4] + [0] * (k - 2)


def test_top_k_both_algorithms_agree(ctx):
    """k = INSERT_MAX (insertion) and INSERT_MAX + 1 (radix): same slots on a shared prefix."""
    a = tie_heavy((4, 500))
    x = ctx.tensor(a, ("r", "c"))
    small, big = x.top_k("c", INSERT_MAX, "k"), x.top_k("c", INSERT_MAX + 1, "k")
    np.testing.assert_array_equal(small.values.numpy(), big.values.numpy()[:, :INSERT_MAX])
    np.testing.assert_array_equal(small.indices.numpy(), big.indices.numpy()[:, :INSERT_MAX])


def test_top_k_long_rows_and_sorted_input(ctx):
    a = distinct((3, 151936))
    a[1] = np.sort(a[1])          # ascending: every element is admitted
    a[2] = np.sort(a[2])[::-1]    # descending: only the first k are
    x = ctx.tensor(a, ("r", "v"))
    for k in (1, 8, 50, 200):
        top = x.top_k("v", k, "k")
        tv, ti = torch.from_numpy(a).topk(k, dim=1)
        np.testing.assert_array_equal(top.values.numpy(), tv.numpy())
        np.testing.assert_array_equal(top.indices.numpy(), ti.numpy())


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_top_k_16bit_values_keep_dtype(ctx, dtype):
    a = rand((3, 100))
    x = ctx.tensor(a, ("r", "c"), dtype=dtype)
    top = x.top_k("c", 5, "k")
    assert top.values.dtype == dtype and top.indices.dtype == "i64"
    wide = x.numpy()
    vals, idx = along(wide, 1, lambda r: ref_top_k(r, 5))
    np.testing.assert_array_equal(top.values.numpy(), vals.astype(np.float32))
    np.testing.assert_array_equal(top.indices.numpy(), idx)


# ---------------------------------------------------------------------------------------------
# sort / argsort

def check_sorted(a, values, indices, axis, descending):
    """values are a[indices] along axis, ordered, NaN last; indices a permutation."""
    np.testing.assert_array_equal(np.sort(indices, axis=axis),
                                  np.broadcast_to(np.expand_dims(np.arange(a.shape[axis]),
                                                                 tuple(i for i in range(a.ndim) if i != axis)), a.shape))
    np.testing.assert_array_equal(values, np.take_along_axis(a, indices, axis))
    key = np.where(np.isnan(a), np.inf, -a if descending else a)
    by_value = np.argsort(key, axis=axis, kind="stable")
    nan_last = np.argsort(np.isnan(np.take_along_axis(a, by_value, axis)), axis=axis, kind="stable")
    want = np.take_along_axis(a, np.take_along_axis(by_value, nan_last, axis), axis)
    np.testing.assert_array_equal(values, want)  # NaN compares equal in assert_array_equal


@pytest.mark.parametrize("shape", [(1,), (2,), (5, 31), (3, 32), (3, 33), (4, 300), (2, 5000), (3, 40, 5)])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_every_axis(ctx, shape, descending):
    a = rand(shape)
    a.reshape(-1)[::7] = NAN
    a.reshape(-1)[3::11] = -INF
    a.reshape(-1)[5::13] = INF
    x = ctx.tensor(a, tags_of(len(shape)))
    for ax, tag in enumerate(x.tags):
        res = x.sort(tag, descending)
        assert res.values.tags == x.tags and res.indices.dtype == "i64"
        check_sorted(a, res.values.numpy(), res.indices.numpy(), ax, descending)
        np.testing.assert_array_equal(x.argsort(tag, descending).numpy(), res.indices.numpy())


@pytest.mark.parametrize("n", [20, 3000])
def test_sort_distinct_matches_torch(ctx, n):
    a = distinct((6, n))
    x = ctx.tensor(a, ("r", "c"))
    for descending in (False, True):
        res = x.sort("c", descending)
        tv, ti = torch.from_numpy(a).sort(dim=1, descending=descending)
        np.testing.assert_array_equal(res.values.numpy(), tv.numpy())
        np.testing.assert_array_equal(res.indices.numpy(), ti.numpy())


def test_sort_ties_and_signed_zeros(ctx):
    a = tie_heavy((4, 1000))
    a[0, ::3] = -0.0
    a[0, 1::3] = 0.0
    x = ctx.tensor(a, ("r", "c"))
    for descending in (False, True):
        res = x.sort("c", descending)
        check_sorted(a, res.values.numpy(), res.indices.numpy(), 1, descending)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sort_16bit(ctx, dtype):
    x = ctx.tensor(rand((3, 200)), ("r", "c"), dtype=dtype)
    res = x.sort("c", True)
    assert res.values.dtype == dtype
    check_sorted(x.numpy(), res.values.numpy(), res.indices.numpy(), 1, True)


def test_non_contiguous_input(ctx):
    a = rand((40, 30))
    view = ctx.tensor(a, ("r", "c")).permute(("c", "r"))  # a strided view of the same storage
    assert not view._raw.is_contiguous()
    np.testing.assert_array_equal(view.argmax("r").numpy(), a.argmax(0))
    top = view.top_k("r", 4, "k")
    tv, ti = torch.from_numpy(a.T.copy()).topk(4, dim=1)
    np.testing.assert_array_equal(top.values.numpy(), tv.numpy())
    np.testing.assert_array_equal(top.indices.numpy(), ti.numpy())
    check_sorted(a.T.copy(), *(t.numpy() for t in view.sort("r")), 1, False)


# ---------------------------------------------------------------------------------------------
# gradients

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_top_k_and_sort_gradients_against_torch(ctx, axis):
    a = distinct((3, 70, 4))
    tags = ("a", "b", "c")
    tag = tags[axis]
    for k in (1, 3, min(INSERT_MAX + 1, a.shape[axis])):
        x = ctx.variable(a, tags)
        tx = torch.tensor(a, requires_grad=True)
        top = x.top_k(tag, k, "k")
        w = rand(top.values.shape)
        (top.values * ctx.tensor(w, top.values.tags)).sum_all().backward()
        (tx.topk(k, dim=axis).values * torch.from_numpy(w)).sum().backward()
        np.testing.assert_array_equal(x.grad().numpy(), tx.grad.numpy())
    x = ctx.variable(a, tags)
    tx = torch.tensor(a, requires_grad=True)
    res = x.sort(tag, True)
    w = rand(a.shape)
    (res.values * ctx.tensor(w, tags)).sum_all().backward()
    (tx.sort(dim=axis, descending=True).values * torch.from_numpy(w)).sum().backward()
    np.testing.assert_array_equal(x.grad().numpy(), tx.grad.numpy())


def test_gradcheck(ctx1):
    a = distinct((3, 6), 0.1)  # gaps of 0.1 >> the finite-difference step: no order flips
    w = ctx1.tensor(rand((3, 3)), ("r", "k"))
    ws = ctx1.tensor(rand((3, 6)), ("r", "c"))
    wr = ctx1.tensor(rand((2, 6)), ("k", "c"))
    x = ctx1.variable(a, ("r", "c"))
    res = fu.gradcheck(lambda v: (v.top_k("c", 3, "k").values * w).sum_all(), [x])
    assert res.checked == 18
    res = fu.gradcheck(lambda v: (v.sort("c", False).values * ws).sum_all(), [x])
    assert res.checked == 18
    res = fu.gradcheck(lambda v: (v.top_k("r", 2, "k").values * wr).sum_all(), [x])
    assert res.checked == 18


def test_unfilled_slot_gradient_goes_to_index_0(ctx):
    x = ctx.variable([NAN, 1.0, 2.0], ("n",))
    top = x.top_k("n", 3, "k")
    assert top.indices.numpy().tolist() == [2, 1, 0] and top.values.numpy()[2] == -INF
    (top.values * ctx.tensor([2.0, 3.0, 5.0], ("k",))).sum_all().backward()
    assert x.grad().numpy().tolist() == [5.0, 3.0, 2.0]  # the reference's scatter, slot order


def test_argmax_argsort_router_have_no_gradient(ctx):
    x = ctx.variable(rand((2, 5)), ("r", "e"))
    assert not x.argmax("e").requires_grad and not x.argsort("e").requires_grad
    top = x.top_k("e", 2, "k")
    assert top.values.requires_grad and not top.indices.requires_grad
    with pytest.raises(fu.UnsupportedGradient, match="router_top_k"):
        x.router_top_k("e", 2, [0] * 4, [0.0] * 4)
    x.detach().router_top_k("e", 2, [0] * 4, [0.0] * 4)


def test_f16_variable_values_have_no_gradient_path(ctx):
    x = ctx.variable(rand((2, 5)), ("r", "e"), dtype="f16")
    with pytest.raises(fu.UnsupportedGradient, match="top_k"):
        x.top_k("e", 2, "k")
    with fu.no_grad():
        assert x.top_k("e", 2, "k").values.dtype == "f16"


# ---------------------------------------------------------------------------------------------
# ownership

def test_scope_ownership(ctx):
    x = ctx.variable(rand((3, 10)), ("r", "c"))
    with ctx.exec_scope():
        top = x.top_k("c", 2, "k")
        srt = x.sort("c")
        best, order = x.argmax("c"), x.argsort("c")
        assert top.values.scope_owned and srt.values.scope_owned
        assert not top.indices.scope_owned and not srt.indices.scope_owned
        assert not best.scope_owned and not order.scope_owned
        const = ctx.tensor(rand((3, 10)), ("r", "c")).top_k("c", 2, "k")
        assert const.values.scope_owned and not const.indices.scope_owned  # f32 no-grad: a borrow
    with pytest.raises(fu.UseAfterRelease):
        top.values.numpy()
    assert top.indices.numpy().shape == (3, 2) and best.numpy().shape == (3,)
    order.release()
    top.indices.release()


def test_result_release_frees_both(ctx):
    top = ctx.tensor(rand((2, 9)), ("r", "c")).top_k("c", 3, "k")
    assert isinstance(top, fu.TopKResult)
    values, indices = top  # a named tuple
    top.release()
    for t in (values, indices):
        with pytest.raises(fu.UseAfterRelease):
            t.numpy()
    with ctx.tensor(rand((2, 9)), ("r", "c")).sort("c") as res:
        assert res.values.shape == (2, 9)
    with pytest.raises(fu.UseAfterRelease):
        res.indices.numpy()


# ---------------------------------------------------------------------------------------------
# router_top_k

def torch_router(logits, k, normalize):
    p = torch.softmax(torch.from_numpy(logits), dim=1)
    w, i = p.topk(k, dim=1)
    if normalize:
        w = w / w.sum(dim=1, keepdim=True)
    return i.numpy(), w.numpy()


@pytest.mark.parametrize("experts,k", [(4, 2), (8, 8), (64, 8), (160, 6), (300, 70)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_against_torch(ctx, experts, k, normalize):
    logits = distinct((7, experts), 8.0 / (7 * experts))  # no ties: torch's tie order is its own
    selected, weights = [0] * (7 * k), [0.0] * (7 * k)
    ctx.tensor(logits, ("row", "expert")).router_top_k("expert", k, selected, weights,
                                                      normalize_selected=normalize)
    ti, tw = torch_router(logits, k, normalize)
    assert selected == ti.reshape(-1).tolist()
    np.testing.assert_allclose(weights, tw.reshape(-1), rtol=1e-5, atol=1e-6)
    if normalize:
        np.testing.assert_allclose(np.array(weights).reshape(7, k).sum(1), 1.0, rtol=1e-5)


def test_router_ties_numpy_outputs_and_unfilled(ctx):
    logits = np.array([[1.0, 2.0, 2.0, 0.5], [-INF, 3.0, -INF, -INF]], np.float32)
    sel = np.zeros(6, np.int64)
    w = np.zeros(6, np.float32)
    ctx.tensor(logits, ("row", "expert")).router_top_k("expert", 3, sel, w)
    assert sel.tolist() == [1, 2, 0, 1, 0, 0]  # ties: lower index first; unfilled slots index 0
    e = np.exp(np.array([2.0, 2.0, 1.0]) - 2.0)
    np.testing.assert_allclose(w[:3], e / e.sum(), rtol=1e-6)
    assert w[3:].tolist() == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# bad input

def test_errors(ctx):
    x = ctx.tensor(rand((2, 5)), ("r", "c"))
    with pytest.raises(fu.InvalidShape, match="top_k.*k >= 1"):
        x.top_k("c", 0, "k")
    with pytest.raises(fu.IndexOutOfBounds, match=r"top_k: expected k <= 5.*got k=6"):
        x.top_k("c", 6, "k")
    with pytest.raises(fu.TagError, match="top_k.*'z'"):
        x.top_k("z", 1, "k")
    with pytest.raises(fu.TagError, match="out_tag 'r'"):
        x.top_k("c", 1, "r")
    with pytest.raises(TypeError, match="integer k"):
        x.top_k("c", 1.0, "k")
    with pytest.raises(fu.TagError, match="argmax.*'z'"):
        x.argmax("z")
    with pytest.raises(fu.TagError, match="sort"):
        x.sort("z")
    with pytest.raises(TypeError, match="descending"):
        x.sort("c", 1)
    with pytest.raises(TypeError, match="descending"):
        x.argsort("c", "yes")
    ints = ctx.tensor([[1, 2]], ("r", "c"), dtype="i64")
    for fn in (lambda: ints.argmax("c"), lambda: ints.top_k("c", 1, "k"), lambda: ints.sort("c"),
               lambda: ints.argsort("c")):
        with pytest.raises(fu.DTypeError, match="expected a float tensor"):
            fn()
    with pytest.raises(TypeError):
        x.sort("c", descending=False, stable=True)


def test_router_errors(ctx):
    x = ctx.tensor(rand((2, 4)), ("row", "expert"))
    with pytest.raises(fu.TagError, match="router_top_k"):
        ctx.tensor(rand((2, 2, 4)), ("a", "row", "expert")).router_top_k("expert", 1, [0] * 4, [0.0] * 4)
    with pytest.raises(fu.TagError, match="'row' last"):
        x.router_top_k("row", 1, [0] * 4, [0.0] * 4)
    with pytest.raises(fu.InvalidShape, match="k >= 1"):
        x.router_top_k("expert", 0, [], [])
    with pytest.raises(fu.IndexOutOfBounds, match="k <= 4"):
        x.router_top_k("expert", 5, [0] * 10, [0.0] * 10)
    with pytest.raises(fu.InvalidDataLength, match="selected of length rows \\* k = 4, got 3"):
        x.router_top_k("expert", 2, [0] * 3, [0.0] * 4)
    with pytest.raises(fu.InvalidDataLength, match="weights"):
        x.router_top_k("expert", 2, [0] * 4, [0.0] * 5)
    with pytest.raises(TypeError, match="mutable sequence"):
        x.router_top_k("expert", 2, (0,) * 4, [0.0] * 4)
    with pytest.raises(fu.DTypeError, match="f32 logits"):
        ctx.tensor(rand((2, 4)), ("row", "expert"), dtype="f16").router_top_k("expert", 1, [0] * 2, [0.0] * 2)
    with pytest.raises(TypeError, match="normalize_selected"):
        x.router_top_k("expert", 1, [0] * 2, [0.0] * 2, normalize_selected=1)


def test_closed_context_and_mismatch():
    c = fu.ExecContext(threads=1)
    x = c.tensor(rand((2, 4)), ("r", "c"))
    c.close()
    with pytest.raises(fu.ContextClosed):
        x.top_k("c", 1, "k")
    with pytest.raises(fu.ContextClosed):
        x.argmax("c")


# ---------------------------------------------------------------------------------------------
# determinism

def test_bitwise_thread_invariance(ctx1, ctx2):
    """Shapes that split into several chunks (and pass the inline threshold): the row and
    column walkers, both top-k algorithms, sort (long rows: the bounded-scratch grid), the
    gradient scatter and the router give the same bits at 1 and 2 threads."""
    a = tie_heavy((64, 3000))
    b = rand((300, 600))
    d = distinct((64, 3000))
    long = distinct((20, 151936))
    gw = rand((64, 8))
    logits = rand((256, 160))
    out = []
    for c in (ctx1, ctx2):
        x, y = c.tensor(a, ("r", "c")), c.tensor(b, ("r", "c"))
        res = [x.argmax("c"), y.argmax("r")]
        res += list(x.top_k("c", 8, "k")) + list(y.top_k("r", 8, "k")) + list(x.top_k("c", 100, "k"))
        res += list(x.sort("c", True)) + list(y.sort("r"))
        srt = c.tensor(long, ("r", "v")).sort("v")
        np.testing.assert_array_equal(srt.values.numpy(), np.sort(long, axis=1))
        res += list(srt)
        v = c.variable(d, ("r", "c"))
        (v.top_k("c", 8, "k").values * c.tensor(gw, ("r", "k"))).sum_all().backward()
        res.append(v.grad())
        sel, w = [0] * (256 * 8), [0.0] * (256 * 8)
        c.tensor(logits, ("row", "e")).router_top_k("e", 8, sel, w)
        out.append([t.numpy() for t in res] + [np.array(sel), np.array(w, np.float32)])
    for p, q in zip(*out):
        assert p.dtype == q.dtype
        assert p.tobytes() == q.tobytes()


# ---------------------------------------------------------------------------------------------
# documented divergences from torch (SPEC §7.1 item 3 and 4)

def test_divergences_from_torch(ctx):
    a = np.array([[1.0, NAN, 3.0, 2.0]], np.float32)
    x, t = ctx.tensor(a, ("r", "c")), torch.from_numpy(a)
    assert t.argmax(1).item() == 1 and x.argmax("c").numpy().tolist() == [2]
    assert torch.isnan(t.topk(1, dim=1).values).all()
    assert x.top_k("c", 1, "k").values.numpy().tolist() == [[3.0]]
    assert math.isnan(t.sort(dim=1, descending=True).values[0, 0])
    assert np.isnan(x.sort("c", True).values.numpy()[0, -1])
    assert x.sort("c", True).values.numpy()[0, :3].tolist() == [3.0, 2.0, 1.0]
