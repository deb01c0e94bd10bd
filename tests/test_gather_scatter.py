"""Indexing, assembly and functional updates (SPEC §3.16): forward values bitwise against numpy
(every axis position, several dtypes, strided inputs), every backward rule against torch and
finite differences, serial-order accumulation of duplicates, the acceptances, bad input and
bitwise thread invariance of every kernel family."""
import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(16)
TAGS = ("a", "b", "c")
SHAPE = (3, 5, 7)


def rand(shape):
    return RNG.standard_normal(shape).astype(np.float32)


def grads_both(ctx, arrays, tags, fu_fn, torch_fn, *, scoped=False, exact=True):
    """Value of fu_fn(*variables) against torch_fn(*tensors) (bitwise when exact), then the
    gradients of sum(y * w) for every operand against torch autograd."""
    vs = [ctx.variable(a, t) for a, t in zip(arrays, tags)]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    scope = ctx.open_exec_scope() if scoped else None
    try:
        y = fu_fn(*vs)
        ty = torch_fn(*ts)
        if exact:
            assert_bitwise(y.numpy(), ty.detach().numpy())
        else:
            np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=1e-6)
        w = rand(y.shape)
        (y * ctx.tensor(w, y.tags)).sum_all().backward()
        (ty * torch.from_numpy(w)).sum().backward()
        for v, t in zip(vs, ts):
            np.testing.assert_allclose(v.grad().numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)
    finally:
        if scope is not None:
            ctx.close_exec_scope(scope)


def moved(t, axis):
    """numpy/torch helper: an op along `axis` written for axis 0."""
    return lambda f: f(t.movedim(axis, 0)).movedim(0, axis) if isinstance(t, torch.Tensor) else \
        np.moveaxis(f(np.moveaxis(t, axis, 0)), 0, axis)


# ---------------------------------------------------------------------------------------------
# acceptances (SPEC §3.15, §3.16)

def test_acceptance(ctx):
    x = ctx.tensor([10.0, 20.0, 30.0], ("i",))
    assert x.gather("i", [2, 0], "i").numpy().tolist() == [30, 10]
    assert x.flip("i").numpy().tolist() == [30, 20, 10]
    assert x.narrow("i", 1, 2).numpy().tolist() == [20, 30]
    m = ctx.tensor(np.arange(1, 13, dtype=np.float32).reshape(3, 4), ("row", "col"))
    assert m.select("row", -1).numpy().tolist() == [9, 10, 11, 12]
    assert m.slice(row=fu.SliceRange(1, None), col=fu.SliceRange(1, -1)).numpy().ravel().tolist() == [6, 7, 10, 11]
    got = m.index_select("row", ctx.tensor([2, 0], ("k",), "i64"), "row").numpy()
    assert got.tolist() == [[9, 10, 11, 12], [1, 2, 3, 4]]
    s = ctx.tensor([[30.0, 10.0, 20.0], [5.0, 15.0, 0.0]], ("row", "col"))
    order = ctx.tensor(np.argsort(s.numpy(), axis=1), ("row", "col"), "i64")
    assert s.take_along_axis("col", order).numpy().ravel().tolist() == [10, 20, 30, 0, 5, 15]


# ---------------------------------------------------------------------------------------------
# gathers: gather / index_select / take_along_axis

@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["f32", "i64", "bool", "f16", "bf16"])
def test_gather_rows_every_axis_and_dtype(ctx, axis, dtype):
    a = rand((6, 9, 40)) * 5
    x = ctx.tensor(a, ("a", "b", "c"), dtype)
    idx = RNG.integers(0, a.shape[axis], 23)
    tag = ("a", "b", "c")[axis]
    y = x.gather(tag, idx.tolist(), "k")
    assert y.tags == ("a", "b", "c")[:axis] + ("k",) + ("a", "b", "c")[axis + 1:]
    assert_bitwise(y.numpy(), np.take(x.numpy(), idx, axis=axis))
    assert_bitwise(x.index_select(tag, ctx.tensor(idx, ("j",), "i64"), tag).numpy(), np.take(x.numpy(), idx, axis=axis))


@pytest.mark.parametrize("B", [1, 3, 16, 17, 100])
def test_gather_row_lengths_and_strided_sources(ctx, B):
    a = rand((30, B))
    idx = RNG.integers(0, 30, 50)
    x = ctx.tensor(a, ("v", "d"))
    assert_bitwise(x.gather("v", idx, "s").numpy(), a[idx])
    xt = ctx.tensor(np.ascontiguousarray(a.T), ("d", "v")).permute(("v", "d"))  # column-major source
    assert_bitwise(xt.gather("v", idx, "s").numpy(), a[idx])
    assert_bitwise(xt.gather("d", [B - 1, 0], "e").numpy(), a[:, [B - 1, 0]])
    part = ctx.tensor(rand((30, B + 5)), ("v", "d")).narrow("d", 2, B)  # rows with a gap
    assert_bitwise(part.gather("v", idx, "s").numpy(), part.numpy()[idx])
    many = RNG.integers(0, B, 9000)  # more positions than one work item holds
    assert_bitwise(x.gather("d", many, "e").numpy(), a[:, many])
    want = np.zeros((30, B), np.float32)
    upd = rand((30, 9000))
    for j, i in enumerate(many):
        want[:, i] += upd[:, j]
    assert_bitwise(ctx.zeros((30, B), ("v", "d")).index_add("d", many, ctx.tensor(upd, ("v", "d"))).numpy(), want)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_take_along_axis(ctx, axis):
    a = rand(SHAPE)
    shape = list(SHAPE)
    shape[axis] = 11
    idx = RNG.integers(0, SHAPE[axis], shape)
    x = ctx.tensor(a, TAGS)
    got = x.take_along_axis(TAGS[axis], ctx.tensor(idx, TAGS, "i64"))
    assert_bitwise(got.numpy(), np.take_along_axis(a, idx, axis))
    # indices given in another axis order are aligned by tag; i64 data gathers too
    perm = (2, 0, 1)
    it = ctx.tensor(np.transpose(idx, perm), tuple(TAGS[p] for p in perm), "i64")
    assert_bitwise(x.take_along_axis(TAGS[axis], it).numpy(), np.take_along_axis(a, idx, axis))
    ai = (a * 100).astype(np.int64)
    got = ctx.tensor(ai, TAGS, "i64").take_along_axis(TAGS[axis], it)
    assert_bitwise(got.numpy(), np.take_along_axis(ai, idx, axis))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_gather_backward(ctx, axis):
    idx = RNG.integers(0, SHAPE[axis], 9)
    it = torch.from_numpy(idx)
    grads_both(ctx, [rand(SHAPE)], [TAGS], lambda x: x.gather(TAGS[axis], idx.tolist(), "k"),
               lambda t: t.index_select(axis, it), exact=True)
    tidx = ctx.tensor(idx, ("k",), "i64")
    grads_both(ctx, [rand(SHAPE)], [TAGS], lambda x: x.index_select(TAGS[axis], tidx, TAGS[axis]),
               lambda t: t.index_select(axis, it))
    shape = list(SHAPE)
    shape[axis] = 6
    full = RNG.integers(0, SHAPE[axis], shape)
    grads_both(ctx, [rand(SHAPE)], [TAGS], lambda x: x.take_along_axis(TAGS[axis], ctx.tensor(full, TAGS, "i64")),
               lambda t: torch.gather(t, axis, torch.from_numpy(full)))


def test_gather_gradcheck(ctx):
    x = ctx.variable(rand((4, 5)), ("r", "c"))
    w = ctx.tensor(rand((6, 5)), ("k", "c"))
    assert fu.gradcheck(lambda v: (v.gather("r", [3, 0, 3, 1, 3, 2], "k") * w).sum_all(), [x]).checked == 20
    full = ctx.tensor(RNG.integers(0, 5, (4, 8)), ("r", "c"), "i64")
    w2 = ctx.tensor(rand((4, 8)), ("r", "c"))
    assert fu.gradcheck(lambda v: (v.take_along_axis("c", full) * w2).sum_all(), [x]).checked == 20
    # gradients that arrive as strided views (a permute after the gather)
    wt = ctx.tensor(rand((5, 6)), ("c", "k"))
    assert fu.gradcheck(lambda v: (v.gather("r", [3, 0, 3, 1, 3, 2], "k").permute(("c", "k")).tanh() * wt)
                        .sum_all(), [x]).checked == 20
    assert fu.gradcheck(lambda v: (v.take_along_axis("c", full).permute(("c", "r")).sin()).sum_all(), [x]).checked == 20
    ids = ctx.tensor([4, 4, 0], ("k",), "i64")
    assert fu.gradcheck(lambda v: (v.index_select("c", ids, "k") * v.index_select("c", ids, "k")).sum_all(),
                        [x]).checked == 20


def test_duplicates_accumulate_in_index_order(ctx):
    """The gather backward equals a serial loop, bitwise (values chosen to make order matter)."""
    V, D, J = 7, 37, 400
    idx = RNG.integers(0, V, J)
    g = (RNG.standard_normal((J, D)) * 10.0 ** RNG.integers(-4, 5, (J, 1))).astype(np.float32)
    x = ctx.variable(np.zeros((V, D), np.float32), ("v", "d"))
    x.gather("v", idx, "s").backward(grad=ctx.tensor(g, ("s", "d")))
    want = np.zeros((V, D), np.float32)
    for j in range(J):
        want[idx[j]] += g[j]
    assert_bitwise(x.grad().numpy(), want)
    # per element (take_along_axis backward, axis 0 and the last axis)
    full = RNG.integers(0, V, (J, D))
    x = ctx.variable(np.zeros((V, D), np.float32), ("v", "d"))
    gt = ctx.tensor(g, ("v", "d"))
    x2 = ctx.variable(np.zeros((D, V), np.float32), ("d", "v"))
    x.take_along_axis("v", ctx.tensor(full, ("v", "d"), "i64")).backward(grad=gt)
    x2.take_along_axis("v", ctx.tensor(full.T, ("d", "v"), "i64")).backward(grad=ctx.tensor(g.T, ("d", "v")))
    want = np.zeros((V, D), np.float32)
    for j in range(J):
        want[full[j], np.arange(D)] += g[j]
    assert_bitwise(x.grad().numpy(), want)
    assert_bitwise(x2.grad().numpy(), want.T)


# ---------------------------------------------------------------------------------------------
# views: narrow / select / slice

def test_views_alias_the_source(ctx):
    x = ctx.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), ("r", "c"))
    n, s, sl = x.narrow("c", 1, 2), x.select("r", 1), x.slice(r=fu.SliceRange(0, 2))
    x.data()[1, 2] = 100.0
    assert n.numpy()[1, 1] == 100.0 and s.numpy()[2] == 100.0 and sl.numpy()[1, 2] == 100.0
    stepped = x.slice(c=fu.SliceRange(0, None, 2))  # step > 1: a copy
    x.data()[0, 0] = -1.0
    assert stepped.numpy()[0, 0] == 0.0


@pytest.mark.parametrize("rg", [(1, None, 1), (-3, None, 1), (0, -1, 2), (None, 100, 3), (-100, 4, 1), (2, 3, 5)])
def test_slice_matches_numpy(ctx, rg):
    a = rand((6, 7))
    x = ctx.tensor(a, ("r", "c"))
    s = slice(*rg)
    assert_bitwise(x.slice(c=fu.SliceRange(*rg)).numpy(), a[:, s])
    assert_bitwise(x.slice(r=s).numpy(), a[s])
    with ctx.exec_scope():
        assert_bitwise(x.slice(r=fu.SliceRange(*rg), c=fu.SliceRange(*rg)).numpy(), a[s, s])


def test_view_backwards(ctx):
    a = rand(SHAPE)
    grads_both(ctx, [a], [TAGS], lambda x: x.narrow("b", 1, 3), lambda t: t.narrow(1, 1, 3))
    grads_both(ctx, [a], [TAGS], lambda x: x.select("c", -2), lambda t: t.select(2, -2), scoped=True)
    grads_both(ctx, [a], [TAGS], lambda x: x.slice(b=fu.SliceRange(1, None, 2)), lambda t: t[:, 1::2])
    grads_both(ctx, [a], [TAGS], lambda x: x.slice(a=fu.SliceRange(-2), c=fu.SliceRange(1, 6, 3)),
               lambda t: t[-2:, :, 1:6:3], scoped=True)
    x = ctx.variable(a, TAGS)
    assert fu.gradcheck(lambda v: (v.narrow("c", 2, 4).select("a", 1).slice(b=fu.SliceRange(0, None, 2))
                                   * v.select("b", 0).sum_all()).sum_all(), [x]).checked == a.size


# ---------------------------------------------------------------------------------------------
# assembly: pad / concat / stack / unbind / flip / roll / repeat

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_assembly_forward(ctx, axis):
    a, b = rand(SHAPE), rand(SHAPE)
    tag = TAGS[axis]
    x, y = ctx.tensor(a, TAGS), ctx.tensor(b, TAGS)
    widths = [(0, 0)] * 3
    widths[axis] = (2, 3)
    assert_bitwise(x.pad(tag, 2, 3, 1.5).numpy(), np.pad(a, widths, constant_values=np.float32(1.5)))
    z = ctx.tensor(np.concatenate([b, b], axis), TAGS)
    assert_bitwise(fu.concat(tag, x, y, z).numpy(), np.concatenate([a, b, b, b], axis))
    assert_bitwise(x.concat(tag, [y]).numpy(), np.concatenate([a, b], axis))
    yp = ctx.tensor(np.transpose(b, (2, 1, 0)), TAGS[::-1])  # other axis order: aligned by tag
    assert_bitwise(x.concat(tag, yp).numpy(), np.concatenate([a, b], axis))
    assert_bitwise(fu.stack("s", axis, x, y, yp).numpy(), np.stack([a, b, b], axis))
    assert fu.stack("s", axis, x, y).tags == TAGS[:axis] + ("s",) + TAGS[axis:]
    assert_bitwise(x.flip(tag).numpy(), np.flip(a, axis))
    for shift in (0, 1, -2, 13):
        assert_bitwise(x.roll(tag, shift).numpy(), np.roll(a, shift, axis))
    assert_bitwise(x.repeat_axis(tag, 3).numpy(), np.concatenate([a] * 3, axis))
    parts = x.unbind_into(tag, [])
    assert len(parts) == SHAPE[axis]
    for k, p in enumerate(parts):
        assert_bitwise(p.numpy(), np.take(a, k, axis))


def test_assembly_on_other_dtypes_and_strides(ctx):
    a = RNG.integers(-9, 9, (4, 6))
    x = ctx.tensor(a, ("r", "c"), "i64")
    assert_bitwise(x.pad("c", 1, 2, 7).numpy(), np.pad(a, [(0, 0), (1, 2)], constant_values=7))
    m = ctx.tensor(a > 0, ("r", "c"), "bool")
    assert_bitwise(m.pad("r", 1, 0, True).numpy(), np.pad(a > 0, [(1, 0), (0, 0)], constant_values=True))
    h = ctx.tensor(a, ("r", "c"), "bf16")
    assert_bitwise(fu.concat("r", h, h).flip("c").numpy(), np.flip(np.concatenate([a, a]), 1).astype(np.float32))
    t = ctx.tensor(rand((6, 4)), ("c", "r")).permute(("r", "c"))  # strided source
    assert_bitwise(t.flip("c").roll("r", 1).numpy(), np.roll(np.flip(t.numpy(), 1), 1, 0))


def test_assembly_backwards(ctx):
    a, b = rand(SHAPE), rand((3, 2, 7))
    grads_both(ctx, [a], [TAGS], lambda x: x.pad("b", 1, 2, 9.0),
               lambda t: torch.nn.functional.pad(t, (0, 0, 1, 2), value=9.0))
    grads_both(ctx, [a, b], [TAGS, TAGS], lambda x, y: fu.concat("b", x, y, x), lambda t, u: torch.cat([t, u, t], 1))
    grads_both(ctx, [a, a.transpose(2, 0, 1).copy()], [TAGS, ("c", "a", "b")],
               lambda x, y: x.stack("s", 3, y), lambda t, u: torch.stack([t, u.permute(1, 2, 0)], 3), scoped=True)
    grads_both(ctx, [a], [TAGS], lambda x: x.flip("a"), lambda t: t.flip(0))
    grads_both(ctx, [a], [TAGS], lambda x: x.roll("c", 3), lambda t: t.roll(3, 2))
    grads_both(ctx, [a], [TAGS], lambda x: x.repeat_axis("b", 3), lambda t: t.repeat(1, 3, 1), exact=True)
    x, y = ctx.variable(a, TAGS), ctx.variable(b, TAGS)
    assert fu.gradcheck(lambda u, v: (fu.concat("b", u.flip("c"), v).roll("b", 2).pad("a", 1, 1)
                                      * fu.stack("s", 0, u, u).repeat_axis("s", 2).sum_all()).sum_all(),
                        [x, y]).checked == a.size + b.size


def test_unbind_into_caller_owned(ctx):
    a = rand((3, 4))
    x = ctx.variable(a, ("r", "c"))
    out = [None] * 3
    with ctx.exec_scope():
        x.unbind_into("r", out)
        assert not any(t.scope_owned for t in out)
        (out[0] * 2.0 + out[2]).sum_all().backward()
    want = np.zeros_like(a)
    want[0], want[2] = 2.0, 1.0
    assert_bitwise(x.grad().numpy(), want)
    with pytest.raises(fu.ShapeMismatch):
        x.unbind_into("r", [None])

    def loss(v):
        parts = v.unbind_into("c", [])
        return (parts[0] * parts[3] + parts[1].exp()).sum_all()
    assert fu.gradcheck(loss, [x]).checked == 12


def test_assembly_plans_follow_layouts(ctx):
    """concat/stack plans are memoised per operand tags and layouts: calls that differ only in
    strides, dtype, axis order, piece count or gradient need still get their own results."""
    a, b, w = rand((4, 6)), rand((4, 6)), rand((4, 9))
    x, y = ctx.tensor(a, ("r", "c")), ctx.tensor(b, ("r", "c"))
    variants = [
        (y, b),  # contiguous
        (ctx.tensor(b.T.copy(), ("c", "r")).permute(("r", "c")), b),  # transposed strides
        (ctx.tensor(w, ("r", "c")).narrow("c", 2, 6), w[:, 2:8]),  # rows at stride 9
        (ctx.tensor(b.T.copy(), ("c", "r")), b),  # other axis order, aligned by tag
    ]
    for _ in range(2):  # the second round runs on memoised plans
        for axis, tag in enumerate(("r", "c")):
            for v, want in variants:
                assert_bitwise(fu.concat(tag, x, v).numpy(), np.concatenate([a, want], axis))
                vx = fu.concat(tag, v, x)  # the first operand's axis order
                assert_bitwise(vx.permute(("r", "c")).numpy(), np.concatenate([want, a], axis))
                assert_bitwise(fu.stack("s", axis, x, v).numpy(), np.stack([a, want], axis))
        h = ctx.tensor(b, ("r", "c"), "f16")  # same shape and tags, another dtype
        assert_bitwise(fu.concat("r", h, h).numpy(), np.concatenate([b, b]).astype(np.float16))
    many = [rand((3, 5)) for _ in range(9)]  # more pieces than fit in the argument block
    ts = [ctx.tensor(m, ("r", "c")) for m in many]
    for k in (2, 6, 7, 9):
        for axis, tag in enumerate(("r", "c")):
            assert_bitwise(fu.concat(tag, *ts[:k]).numpy(), np.concatenate(many[:k], axis))
    long = [rand((3, 4099)) for _ in range(9)]  # rows longer than a work item, table in a buffer
    assert_bitwise(fu.concat("c", *[ctx.tensor(m, ("r", "c")) for m in long]).numpy(), np.concatenate(long, 1))
    # the same layouts with gradients: the memoised plan still records the node
    grads_both(ctx, [a, b.T.copy()], [("r", "c"), ("c", "r")], lambda u, v: fu.concat("c", u, v, u),
               lambda t, s: torch.cat([t, s.T, t], 1))
    grads_both(ctx, [a, b.T.copy()], [("r", "c"), ("c", "r")], lambda u, v: fu.stack("s", 1, u, v),
               lambda t, s: torch.stack([t, s.T], 1), scoped=True)


def _message(fn, cls):
    with pytest.raises(cls) as e:
        fn()
    return str(e.value)


def test_memoised_plans_keep_the_errors(ctx):
    """A bad call that shares its key with a memoised plan (released, closed, foreign or
    non-tensor operands; a bool axis_index; bad indices) raises what a first call raises."""
    from fucina.ag import gather_scatter as ags

    x, y = ctx.tensor(rand((4, 5)), ("r", "c")), ctx.tensor(rand((4, 5)), ("r", "c"))
    idx = ctx.tensor([4, 0, 2], ("k",), "i64")
    other = fu.ExecContext(threads=1)
    closed = fu.ExecContext(threads=1)
    try:
        foreign = other.tensor(rand((4, 5)), ("r", "c"))
        gone = ctx.tensor(rand((4, 5)), ("r", "c"))
        gone.release()
        cx = closed.tensor(rand((4, 5)), ("r", "c"))
        fu.concat("c", cx, cx)
        closed.close()
        cases = [
            (lambda: fu.concat("c", x, foreign), fu.ContextMismatch, "different ExecContexts"),
            (lambda: fu.concat("c", x, gone), fu.UseAfterRelease, "was released"),
            (lambda: fu.concat("c", gone, x), fu.UseAfterRelease, "was released"),
            (lambda: fu.concat("c", cx, cx), fu.ContextClosed, "was closed"),
            (lambda: fu.concat("c", x, y.numpy()), TypeError, "expected Tensor operands"),
            (lambda: fu.concat("z", x, y), fu.TagError, "z"),
            (lambda: fu.concat(["c"], x, y), fu.TagError, "is not an axis"),  # unhashable tags
            (lambda: fu.stack(["s"], 1, x, y), fu.TagError, "strings"),
            (lambda: x.index_select(["c"], idx, "c"), fu.TagError, "is not an axis"),
            (lambda: fu.stack("s", True, x, y), TypeError, "integer axis_index"),
            (lambda: fu.stack("s", 1, x, gone), fu.UseAfterRelease, "was released"),
            (lambda: x.index_select("c", other.tensor([1], ("k",), "i64"), "c"), fu.ContextMismatch,
             "different ExecContexts"),
            (lambda: x.index_select("c", ctx.tensor([1.0], ("k",)), "c"), fu.DTypeError, "expected i64"),
            (lambda: x.index_select("c", ctx.tensor([[1]], ("k", "l"), "i64"), "c"), fu.InvalidShape, "rank-1"),
            (lambda: x.index_select("c", [1, 2], "c"), TypeError, "i64 Tensor of indices"),
            (lambda: gone.index_select("c", idx, "c"), fu.UseAfterRelease, "was released"),
            (lambda: x.index_select("c", ctx.tensor([1, 5], ("k",), "i64"), "c"), fu.IndexOutOfBounds,
             "index 5 at position 1 is out of range for axis 'c' of size 5"),
            (lambda: x.index_select("r", idx, "r"), fu.IndexOutOfBounds, "index 4 at position 0"),
        ]
        ags._assemblies.clear()
        ags._gather_tags.clear()
        first = [_message(fn, cls) for fn, cls, _ in cases]  # nothing memoised yet
        fu.concat("c", x, y)  # memoise the plans these keys hit
        fu.stack("s", 1, x, y)
        x.index_select("c", idx.narrow("k", 1, 2), "c")
        for (fn, cls, text), msg in zip(cases, first):
            assert text in msg
            assert _message(fn, cls) == msg
        v = ctx.variable(rand((4, 5)), ("r", "c"))
        with pytest.raises(fu.ActiveExecScopeRequired):
            fu.stack("s", 1, v, v)
        with ctx.exec_scope():
            fu.stack("s", 1, v, v)
        with pytest.raises(fu.ActiveExecScopeRequired):  # memoised, still scoped under gradients
            fu.stack("s", 1, v, v)
    finally:
        other.close()
        closed.close()


def test_column_gathers_follow_layouts(ctx):
    """index_select plans are memoised per layouts: strided, permuted and other-dtype sources
    of one shape each get their own values."""
    a = rand((6, 10))
    cols = RNG.integers(0, 8, 5)
    i = ctx.tensor(cols, ("k",), "i64")
    sources = [(ctx.tensor(a[:, :8].copy(), ("r", "c")), a[:, :8]),
               (ctx.tensor(a, ("r", "c")).narrow("c", 2, 8), a[:, 2:]),
               (ctx.tensor(a[:, :8].T.copy(), ("c", "r")).permute(("r", "c")), a[:, :8]),
               (ctx.tensor(a[:, :8], ("r", "c"), "bf16"), ctx.tensor(a[:, :8], ("r", "c"), "bf16").numpy())]
    for _ in range(2):
        for x, want in sources:
            assert_bitwise(x.index_select("c", i, "c").numpy(), want[:, cols])
            assert_bitwise(x.index_select("c", ctx.tensor(cols[::-1].copy(), ("k",), "i64"), "k").numpy(),
                           want[:, cols[::-1]])
            assert_bitwise(x.index_select("r", i.narrow("k", 0, 3) if cols[:3].max() < 6 else
                                          ctx.tensor([5, 0, 3], ("k",), "i64"), "r").numpy(),
                           want[cols[:3] if cols[:3].max() < 6 else [5, 0, 3]])


# ---------------------------------------------------------------------------------------------
# functional updates

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_updates_forward(ctx, axis):
    a = rand(SHAPE)
    tag = TAGS[axis]
    x = ctx.tensor(a, TAGS)
    n = SHAPE[axis]
    upd_shape = list(SHAPE)
    upd_shape[axis] = 2
    u = rand(upd_shape)
    want = a.copy()
    np.moveaxis(want, axis, 0)[1:3] = np.moveaxis(u, axis, 0)
    assert_bitwise(x.set_slice(tag, 1, ctx.tensor(u, TAGS)).numpy(), want)
    want = a.copy()
    np.moveaxis(want, axis, 0)[n - 2:] = 0
    assert_bitwise(x.zero_slice(tag, n - 2, 2).numpy(), want)
    rows = [n - 1, 0, n - 1]  # duplicates: the later row stays (SPEC O-11)
    upd_shape[axis] = 3
    u3 = rand(upd_shape)
    want = a.copy()
    for j, r in enumerate(rows):
        np.moveaxis(want, axis, 0)[r] = np.moveaxis(u3, axis, 0)[j]
    assert_bitwise(x.set_rows(tag, rows, ctx.tensor(u3, TAGS)).numpy(), want)
    want = a.copy()
    np.moveaxis(want, axis, 0)[[0, n - 1]] = 0
    assert_bitwise(x.zero_rows(tag, rows).numpy(), want)
    want = a.copy()
    for j, r in enumerate(rows):
        np.moveaxis(want, axis, 0)[r] += np.moveaxis(u3, axis, 0)[j]
    assert_bitwise(x.index_add(tag, rows, ctx.tensor(u3, TAGS)).numpy(), want)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_scatter_forward_serial_order(ctx, axis):
    a = rand(SHAPE)
    shape = list(SHAPE)
    shape[axis] = 9
    src = (rand(shape) * 10.0 ** RNG.integers(-3, 4, shape)).astype(np.float32)
    idx = RNG.integers(0, SHAPE[axis], shape)
    x = ctx.tensor(a, TAGS)
    it, st = ctx.tensor(idx, TAGS, "i64"), ctx.tensor(src, TAGS)
    add, put = a.copy(), a.copy()
    for pos in np.ndindex(*shape):  # row-major: the serial order of SPEC §3.16
        dst = list(pos)
        dst[axis] = idx[pos]
        add[tuple(dst)] += src[pos]
        put[tuple(dst)] = src[pos]
    assert_bitwise(x.scatter_add(TAGS[axis], it, st).numpy(), add)
    assert_bitwise(x.scatter(TAGS[axis], it, st).numpy(), put)  # last write wins (SPEC §7.1 item 2)
    tw = torch.from_numpy(a.copy()).scatter_add(axis, torch.from_numpy(idx), torch.from_numpy(src))
    np.testing.assert_allclose(add, tw.numpy(), rtol=1e-5, atol=1e-5)


def test_update_backwards(ctx):
    a = rand(SHAPE)
    u2 = rand((3, 2, 7))
    rows = [4, 1, 3]
    u3 = rand((3, 3, 7))
    it = torch.tensor(rows)
    grads_both(ctx, [a, u2], [TAGS, TAGS], lambda x, u: x.set_slice("b", 2, u),
               lambda t, u: torch.cat([t[:, :2], u, t[:, 4:]], 1))
    grads_both(ctx, [a], [TAGS], lambda x: x.zero_slice("c", 1, 3),
               lambda t: torch.cat([t[..., :1], torch.zeros(3, 5, 3), t[..., 4:]], 2))
    grads_both(ctx, [a, u3], [TAGS, TAGS], lambda x, u: x.set_rows("b", rows, u),
               lambda t, u: t.index_copy(1, it, u))
    grads_both(ctx, [a], [TAGS], lambda x: x.zero_rows("b", rows),
               lambda t: t.index_fill(1, it, 0.0))
    grads_both(ctx, [a, u3], [TAGS, TAGS], lambda x, u: x.index_add("b", rows + [], u),
               lambda t, u: t.index_add(1, it, u))
    idx = np.stack([RNG.permutation(5)[:4] for _ in range(21)]).reshape(3, 7, 4).transpose(0, 2, 1)  # unique per column
    ti = torch.from_numpy(np.ascontiguousarray(idx))
    fi = ctx.tensor(idx, TAGS, "i64")
    src = rand((3, 4, 7))
    grads_both(ctx, [a, src], [TAGS, TAGS], lambda x, s: x.scatter_add("b", fi, s),
               lambda t, s: t.scatter_add(1, ti, s), exact=False)
    grads_both(ctx, [a, src], [TAGS, TAGS], lambda x, s: x.scatter("b", fi, s), lambda t, s: t.scatter(1, ti, s))
    x, u, s = ctx.variable(a, TAGS), ctx.variable(u3, TAGS), ctx.variable(src, TAGS)
    w = ctx.tensor(rand(SHAPE), TAGS)
    up = ctx.variable(u2, TAGS)
    assert fu.gradcheck(lambda x, u: (x.set_slice("b", 3, u).zero_slice("c", 2, 4) * w).sum_all(),
                        [x, up]).checked == a.size + u2.size
    assert fu.gradcheck(lambda x, u, s: (x.index_add("b", rows, u).set_rows("b", [0], u.narrow("b", 0, 1))
                                         .scatter("b", fi, s).scatter_add("b", fi, s).zero_rows("c", [2])
                                         * w).sum_all(),
                        [x, u, s]).checked == a.size + u3.size + src.size


def test_scatter_writer_gradients(ctx):
    """SPEC §3.16: self gets 0 at every written slot; every writer of a slot receives its g."""
    x = ctx.variable([1.0, 2.0, 3.0], ("i",))
    s = ctx.variable([10.0, 20.0, 30.0], ("i",))
    y = x.scatter("i", ctx.tensor([2, 0, 2], ("i",), "i64"), s)
    assert y.numpy().tolist() == [20.0, 2.0, 30.0]
    y.backward(grad=ctx.tensor([1.0, 2.0, 3.0], ("i",)))
    assert x.grad().numpy().tolist() == [0.0, 2.0, 0.0]
    assert s.grad().numpy().tolist() == [3.0, 1.0, 3.0]


# ---------------------------------------------------------------------------------------------
# masked_select / nonzero

@pytest.mark.parametrize("dtype", ["f32", "i64", "bool", "bf16"])
def test_masked_select_and_nonzero(ctx, dtype):
    a = rand((37, 1001))
    keep = RNG.random((37, 1001)) < 0.3
    x = ctx.tensor(a * 10, ("r", "c"), dtype)
    m = ctx.tensor(keep, ("r", "c"), "bool")
    assert_bitwise(x.masked_select(m, "k").numpy(), x.numpy()[keep])
    mt = ctx.tensor(keep.T.astype(np.float32), ("c", "r"))  # float mask in another axis order
    assert_bitwise(x.masked_select(mt, "k").numpy(), x.numpy()[keep])
    assert m.nonzero() == np.flatnonzero(keep).tolist()
    assert x.nonzero() == np.flatnonzero(x.numpy()).tolist()


def test_masked_select_backward_and_nan(ctx):
    a = rand((5, 6))
    keep = RNG.random((5, 6)) < 0.5
    m = ctx.tensor(keep, ("r", "c"), "bool")
    grads_both(ctx, [a], [("r", "c")], lambda x: x.masked_select(m, "k"),
               lambda t: t.masked_select(torch.from_numpy(keep)), scoped=True)
    x = ctx.variable(a, ("r", "c"))
    assert fu.gradcheck(lambda v: (v.masked_select(m, "k") * v.masked_select(m, "k")).sum_all(), [x]).checked == 30
    n = ctx.tensor([0.0, np.nan, -0.0, 2.0, 0.0], ("i",))
    assert n.nonzero() == [1, 3]
    assert ctx.zeros((4,), ("i",)).nonzero() == []


def test_block_copies_and_fills(ctx):
    """The block kernel: row spans split across work items, strided rows, every dtype, and the
    streamed (non-temporal) fill of a buffer past STREAM_BYTES, on recycled dirty memory."""
    from fucina.exec import gather_scatter as gs

    n = (gs.STREAM_BYTES >> 2) + 12345
    dirty = ctx.full_raw((n,), 7.0)
    del dirty  # back to the pool: the next allocation of this size reuses it
    z = gs.zeros(ctx, (n,))
    assert not z.to_numpy().any()
    a = rand((3, 5 * gs.BLOCK_BYTES // 4 + 3))  # rows longer than one work item
    x = ctx.tensor(a, ("r", "c"))
    assert_bitwise(x.pad("c", 1, 2, -3.0).numpy(), np.pad(a, [(0, 0), (1, 2)], constant_values=np.float32(-3.0)))
    assert_bitwise(fu.concat("r", x, x).numpy(), np.concatenate([a, a]))
    for dtype in ("f16", "bf16", "i64", "bool"):
        h = ctx.tensor(a[:, :100] * 4, ("r", "c"), dtype)
        assert_bitwise(h.pad("r", 2, 1, 1).numpy(), np.pad(h.numpy(), [(2, 1), (0, 0)], constant_values=1))
        # one-element columns (rows of one element at a stride) and a column copy
        assert_bitwise(h.pad("c", 1, 1, 0).numpy(), np.pad(h.numpy(), [(0, 0), (1, 1)], constant_values=0))
        col = ctx.tensor(a[:, :1] * 2, ("r", "c"), dtype)
        assert_bitwise(h.set_slice("c", 7, col).numpy(),
                       np.concatenate([h.numpy()[:, :7], col.numpy(), h.numpy()[:, 8:]], 1))
    for fill in (0.0, -0.0, 0.0, -0.0, np.float32(-0.0), float("nan")):  # fill bits memoised exactly
        got = x.narrow("c", 0, 6).pad("c", 1, 0, fill).numpy()[:, 0]
        assert_bitwise(got, np.full(3, fill, np.float32))
        assert (np.signbit(got) == np.signbit(np.float32(fill))).all()
        t = ctx.zeros((4, 6, 5), ("a", "b", "c"), dtype)._raw
        view = t.permute([2, 0, 1]).narrow(2, 1, 3)  # no fold to rows: the elementwise path
        gs.fill(ctx, view, 1)
        want = np.zeros((4, 6, 5), t.to_numpy().dtype)
        want[:, 1:4, :] = 1
        assert_bitwise(t.to_numpy(), want)


# ---------------------------------------------------------------------------------------------
# bad input

def test_index_errors(ctx):
    x = ctx.tensor(rand((4, 5)), ("r", "c"))
    with pytest.raises(fu.IndexOutOfBounds, match="gather: index 4 at position 1"):
        x.gather("r", [0, 4], "k")
    with pytest.raises(fu.IndexOutOfBounds, match="index -1"):
        x.index_select("c", ctx.tensor([1, -1], ("k",), "i64"), "c")
    with pytest.raises(fu.DTypeError, match="index_select: expected i64"):
        x.index_select("c", ctx.tensor([1.0], ("k",)), "c")
    with pytest.raises(fu.InvalidShape):
        x.index_select("c", ctx.tensor([[1]], ("k", "l"), "i64"), "c")
    with pytest.raises(fu.InvalidShape, match="at least one index"):
        x.gather("r", [], "k")
    with pytest.raises(TypeError):
        x.gather("r", [0.5], "k")
    with pytest.raises(fu.TagError):
        x.gather("z", [0], "k")
    with pytest.raises(fu.TagError):
        x.gather("r", [0], "c")  # out_tag collides with another axis
    bad = ctx.tensor(RNG.integers(0, 5, (4, 5)) + np.eye(4, 5, dtype=np.int64) * 9, ("r", "c"), "i64")
    with pytest.raises(fu.IndexOutOfBounds, match=r"position \(0, 0\)"):
        x.take_along_axis("c", bad)
    with pytest.raises(fu.ShapeMismatch):
        x.take_along_axis("c", ctx.tensor(np.zeros((3, 5), np.int64), ("r", "c"), "i64"))
    with pytest.raises(fu.TagError):
        x.take_along_axis("c", ctx.tensor(np.zeros((4, 5), np.int64), ("r", "d"), "i64"))
    with pytest.raises(fu.IndexOutOfBounds):
        x.scatter_add("c", bad, x)
    with pytest.raises(fu.IndexOutOfBounds):
        x.zero_rows("r", [4])
    with pytest.raises(fu.IndexOutOfBounds):
        x.index_add("c", [5], ctx.tensor(rand((4, 1)), ("r", "c")))
    ids = RNG.integers(0, 300, 3000)
    ids[-1] = 300  # the last of many indices, in a put split into row bands
    with pytest.raises(fu.IndexOutOfBounds, match="index 300 at position 2999"):
        ctx.zeros((300, 257), ("v", "d")).index_add("v", ids, ctx.tensor(rand((3000, 257)), ("v", "d")))


def test_shape_and_argument_errors(ctx):
    x = ctx.tensor(rand((4, 5)), ("r", "c"))
    with pytest.raises(fu.InvalidShape, match="does not fit"):
        x.narrow("c", 3, 3)
    with pytest.raises(fu.InvalidShape):
        x.zero_slice("c", -1, 2)
    with pytest.raises(fu.InvalidShape, match="length >= 0"):
        x.narrow("c", 0, -1)
    with pytest.raises(fu.IndexOutOfBounds):
        x.select("r", 4)
    with pytest.raises(fu.IndexOutOfBounds):
        x.select("r", -5)
    with pytest.raises(fu.InvalidShape, match="positive step"):
        x.slice(c=fu.SliceRange(0, None, 0))
    with pytest.raises(fu.InvalidShape, match="positive step"):
        x.slice(c=fu.SliceRange(None, None, -1))
    assert x.slice(c=fu.SliceRange(4, 2)).shape == (4, 0)  # numpy's empty range
    with pytest.raises(fu.TagError):
        x.slice(z=fu.SliceRange(0, 1))
    with pytest.raises(fu.InvalidShape):
        x.repeat_axis("r", 0)
    with pytest.raises(fu.InvalidShape):
        x.pad("r", -1, 0)
    with pytest.raises(fu.ShapeMismatch, match="along 'r'"):
        fu.concat("c", x, ctx.tensor(rand((3, 5)), ("r", "c")))
    with pytest.raises(fu.TagError):
        fu.concat("c", x, ctx.tensor(rand((4, 5)), ("r", "d")))
    with pytest.raises(fu.DTypeError):
        fu.concat("c", x, ctx.tensor(np.zeros((4, 5)), ("r", "c"), "i64"))
    with pytest.raises(fu.TagError):
        fu.stack("r", 0, x, x)
    with pytest.raises(fu.IndexOutOfBounds):
        fu.stack("s", 3, x, x)
    with pytest.raises(fu.ShapeMismatch):
        fu.stack("s", 0, x, ctx.tensor(rand((5, 4)), ("r", "c")))
    with pytest.raises(fu.InvalidShape, match="3 positions"):
        x.set_rows("r", [0, 1, 2], ctx.tensor(rand((2, 5)), ("r", "c")))
    with pytest.raises(fu.InvalidShape, match="does not fit"):
        x.set_slice("c", 4, ctx.tensor(rand((4, 2)), ("r", "c")))
    with pytest.raises(fu.ShapeMismatch):
        x.scatter("c", ctx.tensor(np.zeros((4, 2), np.int64), ("r", "c"), "i64"), ctx.tensor(rand((4, 3)), ("r", "c")))
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1.0], ("i",), "bf16").index_add("i", [0], ctx.tensor([1.0], ("i",), "bf16"))
    with pytest.raises(fu.EmptySelection):
        x.masked_select(ctx.zeros((4, 5), ("r", "c"), "bool"), "k")
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(fu.ContextMismatch):
            fu.concat("c", x, other.tensor(rand((4, 5)), ("r", "c")))
    finally:
        other.close()


def test_composed_ops_need_a_scope(ctx):
    x = ctx.variable(rand((3, 4)), ("r", "c"))
    m = ctx.tensor(np.ones((3, 4), bool), ("r", "c"), "bool")
    for fn in (lambda: x.select("r", 0), lambda: fu.stack("s", 0, x, x), lambda: x.unbind_into("r", []),
               lambda: x.masked_select(m, "k"), lambda: x.slice(r=fu.SliceRange(1), c=fu.SliceRange(1))):
        with pytest.raises(fu.ActiveExecScopeRequired):
            fn()
        with fu.no_grad():
            fn()  # no-grad use works unscoped
    x.slice(r=fu.SliceRange(1))  # one sliced axis is a plain view op
    with pytest.raises(fu.UnsupportedGradient):
        with ctx.exec_scope():
            x.masked_select(ctx.variable(np.ones((3, 4), np.float32), ("r", "c")), "k")


# ---------------------------------------------------------------------------------------------
# thread invariance (every kernel family, big enough to split across the team)

def test_bitwise_thread_invariance(ctx1, ctx2):
    V, D, J = 300, 257, 3000
    table = rand((V, D))
    ids = RNG.integers(0, V, J)
    ids[::7] = 5  # a hot row
    g = (rand((J, D)) * 10.0 ** RNG.integers(-4, 5, (J, 1))).astype(np.float32)
    full = RNG.integers(0, V, (J, D))
    keep = RNG.random((V, D)) < 0.5

    def run(ctx):
        out = []
        x = ctx.variable(table, ("v", "d"))
        y = x.gather("v", ids, "s")
        y.backward(grad=ctx.tensor(g, ("s", "d")))
        out += [y.numpy(), x.grad().numpy()]
        x.zero_grad()
        it = ctx.tensor(full, ("v", "d"), "i64")
        y = x.take_along_axis("v", it)
        y.backward(grad=ctx.tensor(g, ("v", "d")))
        out += [y.numpy(), x.grad().numpy()]
        xc = ctx.tensor(table, ("v", "d"))
        out.append(xc.index_add("v", ids, ctx.tensor(g, ("v", "d"))).numpy())
        out.append(xc.scatter_add("v", it, ctx.tensor(g, ("v", "d"))).numpy())
        out.append(xc.scatter("v", it, ctx.tensor(g, ("v", "d"))).numpy())
        ti = ctx.tensor(full.T.copy(), ("d", "v"), "i64")  # an i64 gather along the last axis
        out.append(ti.take_along_axis("v", ctx.tensor(full.T % V, ("d", "v"), "i64")).numpy())
        out.append(xc.masked_select(ctx.tensor(keep, ("v", "d"), "bool"), "k").numpy())
        out.append(np.array(xc.nonzero()))
        out.append(fu.concat("d", xc, xc.flip("v")).roll("v", 17).repeat_axis("d", 2).numpy())
        out.append(fu.concat("v", *[xc] * 9).numpy())  # the piece table in a buffer
        return out

    for p, q in zip(run(ctx1), run(ctx2)):
        assert_bitwise(p, q)
