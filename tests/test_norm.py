"""Normalization (SPEC §3.10): layer_norm, rms_norm, rms_norm_mul, rms_norm_mul_add and
standardize_axis against torch (values and every gradient), finite differences, the
acceptances, bad input and bitwise thread invariance."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(5)
TAGS = ("b", "s", "d")
SHAPE = (2, 3, 37)


def rand(shape, s=1.0, mean=0.0):
    return (RNG.standard_normal(shape) * s + mean).astype(np.float32)


def run_both(ctx, arrays, tags, fu_fn, torch_fn, atol=1e-5, rtol=1e-5):
    """arrays: the operands (numpy); tags: theirs. Compares the value and the gradient of
    sum(y * w) with respect to every operand."""
    vs = [ctx.variable(a, t) for a, t in zip(arrays, tags)]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fu_fn(*vs)
    ty = torch_fn(*ts)
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=rtol, atol=atol)
    w = rand(y.shape)
    (y * ctx.tensor(w, y.tags)).sum_all().backward()
    (ty * torch.from_numpy(w)).sum().backward()
    for v, t in zip(vs, ts):
        np.testing.assert_allclose(v.grad().numpy(), t.grad.numpy(), rtol=rtol, atol=atol)
    return y


def moved(fn, axis):
    """A torch op over the last axis applied to `axis` instead."""
    return lambda t, *rest: fn(t.movedim(axis, -1), *rest).movedim(-1, axis)


# ---------------------------------------------------------------------------------------------
# acceptances (SPEC §3.10)

def test_acceptance(ctx):
    x = ctx.tensor([[1.0, 3.0]], ("r", "d"))
    assert x.layer_norm("d", 0.0).numpy().tolist() == [[-1.0, 1.0]]
    assert x.rms_norm("d", 0.0).numpy()[0, 1] == pytest.approx(3 / np.sqrt(5), rel=1e-6)
    s = ctx.tensor([1.0, 2.0, 3.0, 4.0], ("d",)).standardize_axis("d")
    assert s.numpy()[3] == pytest.approx(1.5 / np.sqrt(1.25), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# against torch

@pytest.mark.parametrize("axis", [2, 1])
def test_layer_norm_against_torch(ctx, axis):
    a = rand(SHAPE, 2.0, 1.0)
    tag, K = TAGS[axis], SHAPE[axis]
    run_both(ctx, [a], [TAGS], lambda x: x.layer_norm(tag, 1e-5),
             moved(lambda t: F.layer_norm(t, (K,), eps=1e-5), axis))
    w, b = rand(K), rand(K)
    run_both(ctx, [a, w, b], [TAGS, (tag,), (tag,)], lambda x, w, b: x.layer_norm(tag, 1e-5, weight=w, bias=b),
             moved(lambda t, w, b: F.layer_norm(t, (K,), w, b, 1e-5), axis))


@pytest.mark.parametrize("K", [1, 7, 16, 64, 100, 1000])
def test_row_lengths(ctx, K):
    a = rand((3, K), 3.0, 2.0)
    w, b = rand(K), rand(K)
    if K == 1:  # x - mean is exactly 0 here (torch leaves rounding noise in its weight gradient)
        assert (ctx.tensor(a, ("r", "d")).layer_norm("d", 1e-5).numpy() == 0).all()
    else:
        run_both(ctx, [a, w, b], [("r", "d"), ("d",), ("d",)],
                 lambda x, w, b: x.layer_norm("d", 1e-5, weight=w, bias=b),
                 lambda t, w, b: F.layer_norm(t, (K,), w, b, 1e-5))
    run_both(ctx, [a, w], [("r", "d"), ("d",)], lambda x, w: x.rms_norm("d", 1e-6, weight=w),
             lambda t, w: F.rms_norm(t, (K,), w, 1e-6))


@pytest.mark.parametrize("axis", [2, 0])
def test_rms_norm_family_against_torch(ctx, axis):
    a = rand(SHAPE, 2.0)
    tag, K = TAGS[axis], SHAPE[axis]
    rms = lambda t, w=None: F.rms_norm(t, (K,), w, 1e-6)
    run_both(ctx, [a], [TAGS], lambda x: x.rms_norm(tag, 1e-6), moved(rms, axis))
    w = rand(K)
    run_both(ctx, [a, w], [TAGS, (tag,)], lambda x, w: x.rms_norm(tag, 1e-6, weight=w), moved(rms, axis))
    run_both(ctx, [a, w], [TAGS, (tag,)], lambda x, w: x.rms_norm_mul(tag, w, 1e-6), moved(rms, axis))
    r = rand(SHAPE)
    run_both(ctx, [a, w, r], [TAGS, (tag,), TAGS], lambda x, w, r: x.rms_norm_mul_add(tag, w, r, 1e-6),
             lambda t, w, r: moved(rms, axis)(t, w) + r)


def test_rms_norm_mul_add_residual_in_another_axis_order(ctx):
    a = rand(SHAPE)
    w = rand(37)
    r = rand((37, 2, 3))  # tags (d, b, s)
    run_both(ctx, [a, w, r], [TAGS, ("d",), ("d", "b", "s")],
             lambda x, w, r: x.rms_norm_mul_add("d", w, r, 1e-6),
             lambda t, w, r: F.rms_norm(t, (37,), w, 1e-6) + r.permute(1, 2, 0))


@pytest.mark.parametrize("eps_mode", ["outside_sqrt", "inside_sqrt"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("accumulation", ["f32", "f64"])
def test_standardize_axis_against_torch(ctx, eps_mode, ddof, accumulation):
    a = rand(SHAPE, 3.0, 5.0)
    eps = 1e-3

    def ref(t):
        c = t - t.mean(-1, keepdim=True)
        if eps_mode == "outside_sqrt":
            return c / (t.std(-1, correction=ddof, keepdim=True) + eps)
        return c / torch.sqrt(t.var(-1, correction=ddof, keepdim=True) + eps)
    run_both(ctx, [a], [TAGS], lambda x: x.standardize_axis(
        "d", ddof=ddof, eps=eps, eps_mode=eps_mode, accumulation=accumulation), ref)


@pytest.mark.parametrize("valid_len", [0, 1, 20, 37])
def test_standardize_axis_valid_len(ctx, valid_len):
    a = rand(SHAPE, 2.0, 1.0)
    x = ctx.variable(a, TAGS)
    y = x.standardize_axis("d", ddof=1 if valid_len > 1 else 0, eps=1e-2, valid_len=valid_len)
    w = rand(SHAPE)
    (y * ctx.tensor(w, TAGS)).sum_all().backward()
    got, gx = y.numpy(), x.grad().numpy()
    assert (got[..., valid_len:] == 0).all() and (gx[..., valid_len:] == 0).all()
    if valid_len:
        t = torch.tensor(a[..., :valid_len], requires_grad=True)
        ref = (t - t.mean(-1, keepdim=True)) / (t.std(-1, correction=1 if valid_len > 1 else 0, keepdim=True) + 1e-2)
        (ref * torch.from_numpy(w[..., :valid_len])).sum().backward()
        np.testing.assert_allclose(got[..., :valid_len], ref.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gx[..., :valid_len], t.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_f64_accumulation_is_more_accurate(ctx):
    """A large offset: f64 row sums keep the mean and the variance exact enough."""
    a = (RNG.standard_normal((4, 4096)) + 3000.0).astype(np.float32)
    want = (a - a.astype(np.float64).mean(1, keepdims=True)) / a.astype(np.float64).std(1, keepdims=True)
    x = ctx.tensor(a, ("r", "d"))
    e32 = np.abs(x.standardize_axis("d").numpy() - want).max()
    e64 = np.abs(x.standardize_axis("d", accumulation="f64").numpy() - want).max()
    assert e64 <= 1e-6 and e32 > 1e-5, (e32, e64)


def test_standardize_constant_rows(ctx):
    """std = 0 with eps outside the sqrt: the value is 0 (0 / eps) and, as in torch, the std's
    derivative at 0 is taken as 0, so the gradient is finite."""
    a = np.array([[2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 5.0]], np.float32)
    run_both(ctx, [a], [("r", "d")], lambda x: x.standardize_axis("d", ddof=1, eps=1e-3),
             lambda t: (t - t.mean(-1, keepdim=True)) / (t.std(-1, keepdim=True) + 1e-3))


def test_rank_one_input(ctx):
    a = rand(9, 2.0, 1.0)
    w, b = rand(9), rand(9)
    run_both(ctx, [a, w, b], [("d",), ("d",), ("d",)], lambda x, w, b: x.layer_norm("d", 1e-5, weight=w, bias=b),
             lambda t, w, b: F.layer_norm(t, (9,), w, b, 1e-5))


def test_layer_norm_untagged_weight(ctx):
    """A rank-1 weight/bias with a tag other than the normalized one is accepted (length checked)."""
    a = rand((3, 8))
    w, b = rand(8), rand(8)
    y = ctx.tensor(a, ("r", "d")).layer_norm("d", 1e-5, weight=ctx.tensor(w, ("x",)), bias=ctx.tensor(b, ("x",)))
    want = F.layer_norm(torch.from_numpy(a), (8,), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_constant_weight_and_variable_weight_only(ctx):
    """needs_grad pruning: gradients only for the operands that require them."""
    a, w, b = rand((4, 8)), rand(8), rand(8)
    x = ctx.tensor(a, ("r", "d"))
    wv = ctx.variable(w, ("d",))
    y = x.layer_norm("d", 1e-5, weight=wv, bias=ctx.tensor(b, ("d",)))
    y.sum_all().backward()
    tw = torch.tensor(w, requires_grad=True)
    F.layer_norm(torch.from_numpy(a), (8,), tw, torch.from_numpy(b), 1e-5).sum().backward()
    np.testing.assert_allclose(wv.grad().numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# finite differences

def test_gradcheck_every_op(ctx1):
    a = rand((3, 5), 1.0, 0.5)
    w, b, r = rand(5), rand(5), rand((3, 5))
    cases = [
        (lambda x: x.layer_norm("d", 1e-5), []),
        (lambda x, w, b: x.layer_norm("d", 1e-5, weight=w, bias=b), [w, b]),
        (lambda x: x.layer_norm("r", 1e-5), []),
        (lambda x: x.rms_norm("d", 1e-6), []),
        (lambda x, w: x.rms_norm("d", 1e-6, weight=w), [w]),
        (lambda x, w: x.rms_norm_mul("d", w, 1e-6), [w]),
        (lambda x, w, r: x.rms_norm_mul_add("d", w, r, 1e-6), [w, r]),
        (lambda x: x.standardize_axis("d", ddof=1, eps=1e-2), []),
        (lambda x: x.standardize_axis("d", eps=1e-2, eps_mode="inside_sqrt", accumulation="f64"), []),
        (lambda x: x.standardize_axis("d", eps=1e-2, valid_len=3), []),
    ]
    wy = ctx1.tensor(rand((3, 5)), ("r", "d"))
    for fn, extra in cases:
        tags = [("r", "d")] + [("d",) if e.ndim == 1 else ("r", "d") for e in extra]
        vs = [ctx1.variable(v, t) for v, t in zip([a] + extra, tags)]
        res = fu.gradcheck(lambda *v, fn=fn: (fn(*v) * wy).sum_all(), vs)
        assert res.checked == sum(v.numel for v in vs)


# ---------------------------------------------------------------------------------------------
# determinism

def test_thread_invariance(ctx1, ctx2):
    """Rows spread over many work items (the weight/bias sums over many chunk partials):
    every value and gradient bitwise equal at 1 and 2 threads."""
    K = 700
    a, w, b, r, g = rand((300, K), 2.0, 1.0), rand(K), rand(K), rand((300, K)), rand((300, K))
    outs = []
    for c in (ctx1, ctx2):
        x, rv = c.variable(a, ("r", "d")), c.variable(r, ("r", "d"))
        wv, bv = c.variable(w, ("d",)), c.variable(b, ("d",))
        gt = c.tensor(g, ("r", "d"))
        res = []
        for fn, ps in ((lambda: x.layer_norm("d", 1e-5, weight=wv, bias=bv), (x, wv, bv)),
                       (lambda: x.rms_norm_mul_add("d", wv, rv, 1e-6), (x, wv, rv)),
                       (lambda: x.standardize_axis("d", ddof=1, eps=1e-3, accumulation="f64"), (x,)),
                       (lambda: x.layer_norm("r", 1e-5), (x,))):
            y = fn()
            y.backward(grad=gt)
            res.append(y.numpy())
            for p in ps:
                res.append(p.grad().numpy())
                p.zero_grad()
        outs.append(res)
    for u, v in zip(*outs):
        assert_bitwise(u, v)


# ---------------------------------------------------------------------------------------------
# bad input

def test_errors(ctx):
    x = ctx.tensor(np.zeros((2, 4), np.float32), ("r", "d"))
    w4, w3 = ctx.ones((4,), ("d",)), ctx.ones((3,), ("d",))
    with pytest.raises(TypeError):
        x.layer_norm("d", 1e-5, weight=w4)
    with pytest.raises(TypeError):
        x.layer_norm("d", 1e-5, bias=w4)
    with pytest.raises(fu.ShapeMismatch):
        x.layer_norm("d", 1e-5, weight=w3, bias=w3)
    with pytest.raises(fu.TagError):
        x.layer_norm("d", 1e-5, weight=ctx.ones((1, 4), ("a", "d")), bias=w4)
    with pytest.raises(fu.TagError):
        x.layer_norm("nope", 1e-5)
    with pytest.raises(fu.TagError):
        x.rms_norm_mul("d", ctx.ones((4,), ("e",)), 1e-6)
    with pytest.raises(fu.ShapeMismatch):
        x.rms_norm_mul("d", w3, 1e-6)
    with pytest.raises(fu.ShapeMismatch):
        x.rms_norm_mul_add("d", w4, ctx.zeros((2, 3), ("r", "d")), 1e-6)
    with pytest.raises(fu.TagError):
        x.rms_norm_mul_add("d", w4, ctx.zeros((2, 4), ("r", "e")), 1e-6)
    with pytest.raises(TypeError):
        x.rms_norm("d", 1e-6, scale=2.0)
    with pytest.raises(TypeError):
        x.standardize_axis("d", unbiased=True)
    with pytest.raises(ValueError):
        x.standardize_axis("d", eps_mode="around")
    with pytest.raises(ValueError):
        x.standardize_axis("d", accumulation="f16")
    with pytest.raises(fu.InvalidShape):
        x.standardize_axis("d", valid_len=5)
    with pytest.raises(fu.InvalidShape):
        x.standardize_axis("d", ddof=-1)
    with pytest.raises(fu.DTypeError):
        ctx.zeros((2, 4), ("r", "d"), dtype="f16").rms_norm("d", 1e-6)
    with pytest.raises(fu.ContextMismatch):
        with fu.ExecContext(threads=1) as other:
            x.rms_norm_mul("d", other.ones((4,), ("d",)), 1e-6)


def test_rms_norm_mul_rope_half_prepared(ctx):
    """QK-norm + RoPE: against torch's rms_norm then the HF rotate_half rotation, values and
    gradients for x and weight; positions may be negative; a RopeTheta is refused."""
    P, H, D = 6, 3, 16
    positions = [-2, 0, 1, 5, 9, 3]
    x = rand((P, H, D))
    w = rand((D,), 0.5, 1.0)
    table = ctx.prepare_rope_table(positions, D, 10000.0)

    def torch_fn(tx, tw):
        y = F.rms_norm(tx, (D,), tw, 1e-6)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        ang = torch.tensor(positions, dtype=torch.float32)[:, None] * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
        rot = torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1)
        return y * cos + rot * sin

    run_both(ctx, [x, w], [("seq", "head", "d"), ("d",)],
             lambda a, b: a.rms_norm_mul_rope_half_prepared("seq", "d", b, 1e-6, table),
             torch_fn, atol=2e-5, rtol=2e-5)
    with pytest.raises(TypeError, match="prepared RopeTable"):
        ctx.tensor(x, ("seq", "head", "d")).rms_norm_mul_rope_half_prepared(
            "seq", "d", ctx.tensor(w, ("d",)), 1e-6, fu.RopeTheta(positions, 10000.0))


@pytest.mark.parametrize("channel_first", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
def test_group_norm_against_torch(ctx, channel_first, affine):
    T, C, G = 13, 12, 3
    x = rand((T, C), 2.0, 0.5)
    w, b = rand((C,), 0.5, 1.0), rand((C,))
    arrays, tags = [x.T.copy() if channel_first else x], [("c", "t") if channel_first else ("t", "c")]
    if affine in ("weight", "both"):
        arrays.append(w), tags.append(("c",))
    if affine in ("bias", "both"):
        arrays.append(b), tags.append(("c",))

    def fu_fn(a, *ps):
        kw = {}
        if affine in ("weight", "both"):
            kw["weight"] = ps[0]
        if affine in ("bias", "both"):
            kw["bias"] = ps[-1]
        return a.group_norm("c", G, 1e-5, **kw)

    def torch_fn(a, *ps):
        tw = ps[0] if affine in ("weight", "both") else None
        tb = ps[-1] if affine in ("bias", "both") else None
        xc = a if channel_first else a.T          # [C, T]
        y = F.group_norm(xc[None], G, None, None, 1e-5)[0]
        if tw is not None:
            y = y * tw[:, None]
        if tb is not None:
            y = y + tb[:, None]
        return y if channel_first else y.T

    run_both(ctx, arrays, tags, fu_fn, torch_fn, atol=2e-5, rtol=2e-5)


def test_l2_normalize_and_snake(ctx):
    x = rand((5, 8))
    with ctx.exec_scope():
        run_both(ctx, [x], [("t", "c")], lambda a: a.l2_normalize("c", 1e-6),
                 lambda a: a * torch.rsqrt((a * a).sum(-1, keepdim=True) + 1e-6))
    alpha, inv_b = rand((8,), 0.3, 1.0), rand((8,), 0.2, 0.5)
    run_both(ctx, [x, alpha, inv_b], [("t", "c"), ("c",), ("c",)],
             lambda a, al, ib: a.snake("c", al, ib),
             lambda a, al, ib: a + ib * torch.sin(al * a) ** 2)
    v = ctx.variable(x, ("t", "c"))
    with pytest.raises(fu.ActiveExecScopeRequired, match="l2_normalize"):
        v.l2_normalize("c", 1e-6)
    with fu.no_grad():
        v.l2_normalize("c", 1e-6)


def test_group_norm_gradcheck_and_errors(ctx1):
    x = ctx1.variable(rand((6, 4), 1.0, 0.3), ("t", "c"))
    fu.gradcheck(lambda a: (a.group_norm("c", 2, 1e-5) * a).sum_all(), [x], eps=1e-2,
                 abs_tol=2e-3, rel_tol=2e-2)
    with pytest.raises(fu.InvalidShape, match="equal groups"):
        x.group_norm("c", 3, 1e-5)
    with pytest.raises(fu.InvalidShape, match="rank >= 2"):
        ctx1.tensor(rand((4,)), ("c",)).group_norm("c", 2, 1e-5)
    with pytest.raises(fu.TagError):
        x.group_norm("c", 2, 1e-5, weight=ctx1.tensor(rand((4,)), ("d",)))


# ---------------------------------------------------------------------------------------------
# group_norm: kernels that read [time, channel] in place (either axis contiguous)

def group_ref64(x, G, eps, w=None, b=None):
    """float64 reference on x [T, C]: per group of C/G consecutive channels, the mean and the
    biased variance over time × C/G, eps inside the sqrt, then · w + b."""
    T, C = x.shape
    xg = x.astype(np.float64).reshape(T, G, C // G)
    m = xg.mean(axis=(0, 2), keepdims=True)
    v = ((xg - m) ** 2).mean(axis=(0, 2), keepdims=True)
    y = ((xg - m) / np.sqrt(v + float(np.float32(eps)))).reshape(T, C)
    return y * (1.0 if w is None else w) + (0.0 if b is None else b)


def torch_group_norm(G, eps, channel_first):
    """F.group_norm on the channel-first [1, C, T] form of a [T, C] (or [C, T]) tensor."""
    def fn(a, w=None, b=None):
        xc = a if channel_first else a.T
        y = F.group_norm(xc[None], G, w, b, eps)[0]
        return y if channel_first else y.T
    return fn


# (T, C, G): groups of one channel; C not a multiple of the vector width (and below it); time 1;
# many time chunks (T = 20000 at C = 8: 5 chunks of 4096 rows); a group that is one element
GN_SHAPES = [(13, 12, 12), (9, 37, 1), (1, 8, 4), (1, 40, 5), (20000, 8, 2), (700, 100, 20),
             (3, 1, 1), (64, 48, 3)]


@pytest.mark.parametrize("T,C,G", GN_SHAPES)
@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_against_float64(ctx, T, C, G, channel_first):
    x = rand((T, C), 2.0, 0.5)
    w, b = rand(C, 0.5, 1.0), rand(C)
    a, tags = (x.T.copy(), ("c", "t")) if channel_first else (x, ("t", "c"))
    xt = ctx.tensor(a, tags)
    for kw, want in (({}, group_ref64(x, G, 1e-5)),
                     ({"weight": ctx.tensor(w, ("c",)), "bias": ctx.tensor(b, ("c",))},
                      group_ref64(x, G, 1e-5, w, b))):
        y = xt.group_norm("c", G, 1e-5, **kw).numpy()
        np.testing.assert_allclose(y.T if channel_first else y, want, rtol=2e-6, atol=2e-6)


def test_group_norm_large_offset_and_constant_groups(ctx):
    """f64 statistics: an offset of 3000 over a spread of 1 normalizes to float32 accuracy
    (a float32 mean alone would be off by ~1e-4); a constant group gives exactly the bias."""
    x = (RNG.standard_normal((5000, 6)) + 3000.0).astype(np.float32)
    x[:, 4:] = 7.25
    b = rand(6)
    y = ctx.tensor(x, ("t", "c")).group_norm("c", 3, 1e-5, bias=ctx.tensor(b, ("c",))).numpy()
    np.testing.assert_allclose(y[:, :4], group_ref64(x, 3, 1e-5, None, b)[:, :4], rtol=0, atol=2e-6)
    assert (y[:, 4:] == b[4:]).all()


@pytest.mark.parametrize("T,C,G", [(13, 12, 12), (9, 37, 1), (1, 40, 5), (700, 100, 20)])
@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_gradients_against_torch(ctx, T, C, G, channel_first):
    x = rand((T, C), 2.0, 0.5)
    w, b = rand(C, 0.5, 1.0), rand(C)
    a, tags = (x.T.copy(), ("c", "t")) if channel_first else (x, ("t", "c"))
    run_both(ctx, [a, w, b], [tags, ("c",), ("c",)],
             lambda v, wv, bv: v.group_norm("c", G, 1e-5, weight=wv, bias=bv),
             torch_group_norm(G, 1e-5, channel_first), atol=2e-5, rtol=2e-5)


def group_grads_ref64(x, g, G, eps, w):
    """float64 (dx, dw, db) of group_norm on x [T, C] for the upstream gradient g."""
    T, C = x.shape
    xg = x.astype(np.float64).reshape(T, G, C // G)
    m = xg.mean(axis=(0, 2), keepdims=True)
    inv = 1.0 / np.sqrt(((xg - m) ** 2).mean(axis=(0, 2), keepdims=True) + float(np.float32(eps)))
    xhat = (xg - m) * inv
    gw = (g.astype(np.float64) * w).reshape(T, G, C // G)
    dx = inv * (gw - gw.mean(axis=(0, 2), keepdims=True)
                - xhat * (gw * xhat).mean(axis=(0, 2), keepdims=True))
    return dx.reshape(T, C), (g * xhat.reshape(T, C)).sum(0), g.astype(np.float64).sum(0)


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_gradients_long_time_against_float64(ctx, channel_first):
    """20000 rows (5 time chunks): the weight and bias gradients sum 20000 terms; against a
    float64 reference (torch's float32 sums are ~10x further off here)."""
    T, C, G = 20000, 8, 2
    x, g, w, b = rand((T, C), 2.0, 0.5), rand((T, C)), rand(C, 0.5, 1.0), rand(C)
    tags = ("c", "t") if channel_first else ("t", "c")
    tr = (lambda a: a.T.copy()) if channel_first else (lambda a: a)
    xv, wv, bv = ctx.variable(tr(x), tags), ctx.variable(w, ("c",)), ctx.variable(b, ("c",))
    xv.group_norm("c", G, 1e-5, weight=wv, bias=bv).backward(grad=ctx.tensor(tr(g), tags))
    dx, dw, db = group_grads_ref64(x, g, G, 1e-5, w)
    np.testing.assert_allclose(tr(xv.grad().numpy()) if channel_first else xv.grad().numpy(), dx,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wv.grad().numpy(), dw, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(bv.grad().numpy(), db, rtol=1e-6, atol=1e-4)


def test_group_norm_strided_inputs(ctx):
    """A transposed view runs in place on its memory order, a narrowed view is copied first;
    values and gradients as torch's on the same data."""
    base = rand((24, 40), 1.5, 0.2)                        # memory [C, T] tagged (c, t)
    x = ctx.variable(base, ("c", "t"))
    y = x.permute(("t", "c")).group_norm("c", 6, 1e-5)
    t = torch.tensor(base, requires_grad=True)
    ty = F.group_norm(t[None], 6, None, None, 1e-5)[0].T
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=2e-5, atol=2e-5)
    g = rand((40, 24))
    y.backward(grad=ctx.tensor(g, ("t", "c")))
    ty.backward(torch.from_numpy(g))
    np.testing.assert_allclose(x.grad().numpy(), t.grad.numpy(), rtol=2e-5, atol=2e-5)
    wide = rand((30, 50), 1.0, 0.3)                        # [T, C]; channels 5..35 taken
    z = ctx.tensor(wide, ("t", "c")).narrow("c", 5, 30).group_norm("c", 10, 1e-5).numpy()
    np.testing.assert_allclose(z, group_ref64(wide[:, 5:35], 10, 1e-5), rtol=2e-6, atol=2e-6)


def test_group_norm_parameter_gradients_only(ctx):
    """needs_grad pruning: x constant, weight and bias variables (no dx pass)."""
    x, w, b, g = rand((300, 16), 1.0, 0.5), rand(16), rand(16), rand((300, 16))
    wv, bv = ctx.variable(w, ("c",)), ctx.variable(b, ("c",))
    ctx.tensor(x, ("t", "c")).group_norm("c", 4, 1e-5, weight=wv, bias=bv).backward(
        grad=ctx.tensor(g, ("t", "c")))
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    torch_group_norm(4, 1e-5, False)(torch.from_numpy(x), tw, tb).backward(torch.from_numpy(g))
    np.testing.assert_allclose(wv.grad().numpy(), tw.grad.numpy(), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(bv.grad().numpy(), tb.grad.numpy(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_gradcheck_affine(ctx1, channel_first):
    tags = ("c", "t") if channel_first else ("t", "c")
    x = ctx1.variable(rand((6, 5) if channel_first else (5, 6), 1.0, 0.3), tags)
    w, b = ctx1.variable(rand(6, 0.5, 1.0), ("c",)), ctx1.variable(rand(6), ("c",))
    wy = ctx1.tensor(rand(x.shape), tags)
    loss = lambda a, wv, bv: (a.group_norm("c", 3, 1e-5, weight=wv, bias=bv) * wy).sum_all()  # noqa: E731
    res = fu.gradcheck(loss, [x, w, b], eps=1e-2, abs_tol=2e-3, rel_tol=2e-2)
    assert res.checked == 30 + 6 + 6


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_thread_invariance(ctx1, ctx2, channel_first):
    """8192 rows of 24 channels: 7 time chunks, split over the team at 2 threads and run by the
    fused kernels at 1; every value and gradient bitwise equal."""
    T, C = 8192, 24
    x, w, b, g = rand((T, C), 2.0, 1.0), rand(C), rand(C), rand((T, C))
    tags = ("c", "t") if channel_first else ("t", "c")
    if channel_first:
        x, g = x.T.copy(), g.T.copy()
    outs = []
    for c in (ctx1, ctx2):
        xv, wv, bv = c.variable(x, tags), c.variable(w, ("c",)), c.variable(b, ("c",))
        y = xv.group_norm("c", 6, 1e-5, weight=wv, bias=bv)
        y.backward(grad=c.tensor(g, tags))
        wc = c.variable(w, ("c",))
        c.tensor(x, tags).group_norm("c", 6, 1e-5, weight=wc).backward(grad=c.tensor(g, tags))
        outs.append([y.numpy(), xv.grad().numpy(), wv.grad().numpy(), bv.grad().numpy(),
                     wc.grad().numpy()])
    for u, v in zip(*outs):
        assert_bitwise(u, v)


def test_group_norm_errors(ctx):
    x = ctx.tensor(rand((6, 4)), ("t", "c"))
    for groups in (0, -2, 2.0, True, "2"):
        with pytest.raises(fu.InvalidShape, match="groups"):
            x.group_norm("c", groups, 1e-5)
    with pytest.raises(fu.TagError):
        x.group_norm("d", 2, 1e-5)
    with pytest.raises(fu.ShapeMismatch, match="weight of length 4"):
        x.group_norm("c", 2, 1e-5, weight=ctx.tensor(rand(3), ("c",)))
    with pytest.raises(fu.TagError, match="bias"):
        x.group_norm("c", 2, 1e-5, bias=ctx.tensor(rand((1, 4)), ("a", "c")))
    with pytest.raises(fu.DTypeError, match="bias"):
        x.group_norm("c", 2, 1e-5, bias=ctx.zeros((4,), ("c",), dtype="f16"))
    with pytest.raises(fu.DTypeError):
        ctx.zeros((6, 4), ("t", "c"), dtype="bf16").group_norm("c", 2, 1e-5)
    with pytest.raises(TypeError):
        x.group_norm("c", 2, "1e-5")
    with pytest.raises(fu.ContextMismatch):
        with fu.ExecContext(threads=1) as other:
            x.group_norm("c", 2, 1e-5, weight=other.ones((4,), ("c",)))


# ---------------------------------------------------------------------------------------------
# group_norm over a batch: [*batch, time, channel] (or [*batch, channel, time]) in one set of
# launches, statistics per (item, group), weight and bias gradients summed over the items

def torch_batched_group_norm(G, eps, channel_first):
    """F.group_norm on [N, C, T] for x [*batch, T, C] (or [*batch, C, T])."""
    def fn(a, w=None, b=None):
        xc = a if channel_first else a.transpose(-1, -2)
        y = F.group_norm(xc.reshape(-1, *xc.shape[-2:]), G, w, b, eps).reshape(xc.shape)
        return y if channel_first else y.transpose(-1, -2)
    return fn


# (batch, T, C, G): one batch axis, two (a 2 x 3 grid of items), one item, a wide batch of
# single-row items, items of several time chunks (the long sums: against float64 below)
GN_BATCHED = [((3,), 13, 12, 3), ((2, 3), 9, 37, 1), ((1,), 40, 8, 4), ((6,), 1, 40, 5),
              ((3,), 600, 24, 6), ((2,), 700, 100, 20)]


@pytest.mark.parametrize("batch,T,C,G", GN_BATCHED)
@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_batched_against_torch(ctx, batch, T, C, G, channel_first):
    """Values and the gradients of x, weight and bias against torch's per-sample group norm."""
    x = rand((*batch, T, C), 2.0, 0.5)
    w, b = rand(C, 0.5, 1.0), rand(C)
    a = np.ascontiguousarray(np.swapaxes(x, -1, -2)) if channel_first else x
    btags = tuple(f"n{i}" for i in range(len(batch)))
    tags = btags + (("c", "t") if channel_first else ("t", "c"))
    run_both(ctx, [a, w, b], [tags, ("c",), ("c",)],
             lambda v, wv, bv: v.group_norm("c", G, 1e-5, weight=wv, bias=bv),
             torch_batched_group_norm(G, 1e-5, channel_first), atol=3e-5, rtol=3e-5)
    run_both(ctx, [a], [tags], lambda v: v.group_norm("c", G, 1e-5),
             torch_batched_group_norm(G, 1e-5, channel_first), atol=3e-5, rtol=3e-5)


def test_group_norm_batched_parameter_gradients_against_float64(ctx):
    """dw and db sum 4 items of 3000 rows: against float64 sums of the per-item references."""
    N, T, C, G = 4, 3000, 16, 4
    x, g, w, b = rand((N, T, C), 2.0, 0.5), rand((N, T, C)), rand(C, 0.5, 1.0), rand(C)
    xv, wv, bv = ctx.variable(x, ("n", "t", "c")), ctx.variable(w, ("c",)), ctx.variable(b, ("c",))
    xv.group_norm("c", G, 1e-5, weight=wv, bias=bv).backward(grad=ctx.tensor(g, ("n", "t", "c")))
    refs = [group_grads_ref64(x[i], g[i], G, 1e-5, w) for i in range(N)]
    for i in range(N):
        np.testing.assert_allclose(xv.grad().numpy()[i], refs[i][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wv.grad().numpy(), sum(r[1] for r in refs), rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(bv.grad().numpy(), sum(r[2] for r in refs), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_batched_gradcheck(ctx1, channel_first):
    tags = ("n", "c", "t") if channel_first else ("n", "t", "c")
    x = ctx1.variable(rand((2, 6, 4) if channel_first else (2, 4, 6), 1.0, 0.3), tags)
    w, b = ctx1.variable(rand(6, 0.5, 1.0), ("c",)), ctx1.variable(rand(6), ("c",))
    wy = ctx1.tensor(rand(x.shape), tags)
    loss = lambda a, wv, bv: (a.group_norm("c", 3, 1e-5, weight=wv, bias=bv) * wy).sum_all()  # noqa: E731
    res = fu.gradcheck(loss, [x, w, b], eps=1e-2, abs_tol=2e-3, rel_tol=2e-2)
    assert res.checked == 48 + 6 + 6


def _batched_run(c, x, g, w, b, tags, G):
    """(y, dx, dw, db) of one batched group_norm with weight and bias."""
    xv, wv, bv = c.variable(x, tags), c.variable(w, ("c",)), c.variable(b, ("c",))
    y = xv.group_norm("c", G, 1e-5, weight=wv, bias=bv)
    y.backward(grad=c.tensor(g, tags))
    return [y.numpy(), xv.grad().numpy(), wv.grad().numpy(), bv.grad().numpy()]


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_batched_thread_invariance(ctx1, ctx2, channel_first):
    """6 items of 2048 rows x 24 channels (2 time chunks each, 12 chunks split over the team
    at 2 threads, the fused kernels at 1): every value and gradient bitwise equal."""
    N, T, C = 6, 2048, 24
    x, g, w, b = rand((N, T, C), 2.0, 1.0), rand((N, T, C)), rand(C), rand(C)
    tags = ("n", "c", "t") if channel_first else ("n", "t", "c")
    if channel_first:
        x, g = np.ascontiguousarray(x.transpose(0, 2, 1)), np.ascontiguousarray(g.transpose(0, 2, 1))
    for u, v in zip(_batched_run(ctx1, x, g, w, b, tags, 6), _batched_run(ctx2, x, g, w, b, tags, 6)):
        assert_bitwise(u, v)


@pytest.mark.parametrize("channel_first", [False, True])
def test_group_norm_item_alone_equals_item_in_batch(ctx, channel_first):
    """An item's y and dx are bitwise those of the item alone (rank-2 and as a batch of one);
    a batch of one gives the rank-2 call's dw and db bitwise."""
    N, T, C, G = 5, 3000, 20, 5
    x, g, w, b = rand((N, T, C), 2.0, 1.0), rand((N, T, C)), rand(C), rand(C)
    tags = ("n", "c", "t") if channel_first else ("n", "t", "c")
    if channel_first:
        x, g = np.ascontiguousarray(x.transpose(0, 2, 1)), np.ascontiguousarray(g.transpose(0, 2, 1))
    y, dx, _, _ = _batched_run(ctx, x, g, w, b, tags, G)
    for i in (0, 3, N - 1):
        alone = _batched_run(ctx, x[i], g[i], w, b, tags[1:], G)
        one = _batched_run(ctx, x[i:i + 1], g[i:i + 1], w, b, tags, G)
        assert_bitwise(y[i], alone[0])
        assert_bitwise(dx[i], alone[1])
        for u, v in zip(one, alone):
            assert_bitwise(u[0] if u.ndim == 3 else u, v)


def test_group_norm_batched_strided_inputs(ctx):
    """A batch with its last two axes transposed runs in place on its memory order; permuted
    batch axes (and batch last in memory) are copied first; values and gradients as torch's."""
    base = rand((3, 24, 40), 1.5, 0.2)                     # memory [N, C, T] tagged (n, c, t)
    x = ctx.variable(base, ("n", "c", "t"))
    y = x.permute(("n", "t", "c")).group_norm("c", 6, 1e-5)
    t = torch.tensor(base, requires_grad=True)
    ty = F.group_norm(t, 6, None, None, 1e-5).transpose(1, 2)
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=2e-5, atol=2e-5)
    g = rand((3, 40, 24))
    y.backward(grad=ctx.tensor(g, ("n", "t", "c")))
    ty.backward(torch.from_numpy(g))
    np.testing.assert_allclose(x.grad().numpy(), t.grad.numpy(), rtol=2e-5, atol=2e-5)
    mem = rand((2, 3, 10, 8), 1.0, 0.4)                    # [a, b, T, C]; batch order (b, a)
    z = ctx.variable(mem, ("a", "b", "t", "c"))
    yz = z.permute(("b", "a", "t", "c")).group_norm("c", 4, 1e-5)
    tz = torch.tensor(mem, requires_grad=True)
    tyz = torch_batched_group_norm(4, 1e-5, False)(tz.permute(1, 0, 2, 3))
    np.testing.assert_allclose(yz.numpy(), tyz.detach().numpy(), rtol=2e-5, atol=2e-5)
    gz = rand((3, 2, 10, 8))
    yz.backward(grad=ctx.tensor(gz, ("b", "a", "t", "c")))
    tyz.backward(torch.from_numpy(gz))
    np.testing.assert_allclose(z.grad().numpy(), tz.grad.numpy(), rtol=2e-5, atol=2e-5)
    tail = rand((10, 8, 3), 1.0, 0.4)                      # memory [T, C, N]: batch innermost
    u = ctx.tensor(tail, ("t", "c", "n")).permute(("n", "t", "c")).group_norm("c", 2, 1e-5)
    want = torch_batched_group_norm(2, 1e-5, False)(torch.from_numpy(tail).permute(2, 0, 1))
    np.testing.assert_allclose(u.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(0, 7, 4), (3, 0, 4), (2, 0, 3, 4)])
def test_group_norm_empty_batch_or_time(ctx, shape, monkeypatch):
    """Empty work: an empty y, zero weight and bias gradients (filled), no group_norm kernel
    looked up or launched."""
    from fucina.exec import norm as exn

    def refuse(*fields):
        raise AssertionError(f"group_norm kernel {fields} for empty work")
    tags = tuple(f"n{i}" for i in range(len(shape) - 2)) + ("t", "c")
    xv, wv, bv = ctx.variable(np.zeros(shape, np.float32), tags), ctx.variable(rand(4), ("c",)), \
        ctx.variable(rand(4), ("c",))
    monkeypatch.setattr(exn, "_group_kernel", refuse)
    y = xv.group_norm("c", 2, 1e-5, weight=wv, bias=bv)
    y.backward(grad=ctx.zeros(shape, tags))
    assert y.shape == shape and xv.grad().shape == shape
    assert (wv.grad().numpy() == 0).all() and (bv.grad().numpy() == 0).all()


def test_group_norm_batched_errors(ctx):
    x = ctx.tensor(rand((2, 6, 4)), ("n", "t", "c"))
    with pytest.raises(fu.TagError, match=r"group_norm: .*channel tag 'c' among the last two"):
        ctx.tensor(rand((4, 2, 6)), ("c", "n", "t")).group_norm("c", 2, 1e-5)
    with pytest.raises(fu.InvalidShape, match="rank >= 2"):
        ctx.tensor(rand((4,)), ("c",)).group_norm("c", 2, 1e-5)
    with pytest.raises(fu.InvalidShape, match="4 channels do not split into 3"):
        x.group_norm("c", 3, 1e-5)
    with pytest.raises(fu.TagError, match=r"group_norm: expected weight tagged \('c',\)"):
        x.group_norm("c", 2, 1e-5, weight=ctx.tensor(rand((2, 4)), ("n", "c")))
    with pytest.raises(fu.TagError, match="bias"):
        x.group_norm("c", 2, 1e-5, bias=ctx.tensor(rand(2), ("n",)))
    with pytest.raises(fu.ShapeMismatch, match="weight of length 4"):
        x.group_norm("c", 2, 1e-5, weight=ctx.tensor(rand(2), ("c",)))
    with pytest.raises(fu.TagError):
        x.group_norm("m", 2, 1e-5)
    v = ctx.variable(rand((2, 6, 4)), ("n", "t", "c"))
    y = v.group_norm("c", 2, 1e-5)
    with pytest.raises(fu.FucinaError, match="backward"):
        y.backward(grad=ctx.tensor(rand((3, 6, 4)), ("n", "t", "c")))
    with pytest.raises(fu.FucinaError, match="backward"):
        y.backward(grad=ctx.tensor(rand((2, 6, 4)), ("m", "t", "c")))


# ---------------------------------------------------------------------------------------------
# l2_normalize: the rms_norm row kernel with the sum of squares undivided

def l2_ref(t, eps):
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("K", [1, 7, 16, 100, 1000])
def test_l2_normalize_against_torch(ctx, K):
    x = rand((5, K), 2.0, 0.3)
    with ctx.exec_scope():
        run_both(ctx, [x], [("r", "d")], lambda a: a.l2_normalize("d", 1e-6),
                 lambda t: l2_ref(t, 1e-6))
        a = rand(SHAPE)                                    # a middle axis: rows laid out first
        run_both(ctx, [a], [TAGS], lambda v: v.l2_normalize("s", 1e-3),
                 moved(lambda t: l2_ref(t, 1e-3), 1))


def test_l2_normalize_eps_on_the_squared_norm(ctx):
    """SPEC §7.1 item 7: x·rsqrt(Σx² + eps): [3, 4] -> [0.6, 0.8] at eps 0; a zero row stays 0
    with gradient g·rsqrt(eps); eps 1e-2 at [0.1, 0] gives 0.1/sqrt(0.02)."""
    y = ctx.tensor([[3.0, 4.0]], ("r", "d")).l2_normalize("d", 0.0).numpy()
    np.testing.assert_array_equal(y, np.float32([[0.6, 0.8]]))
    y = ctx.tensor([[0.1, 0.0]], ("r", "d")).l2_normalize("d", 1e-2).numpy()
    assert y[0, 0] == pytest.approx(0.1 / np.sqrt(0.02), rel=1e-6) and y[0, 1] == 0
    x = ctx.variable(np.zeros((1, 3), np.float32), ("r", "d"))
    with ctx.exec_scope():
        y = x.l2_normalize("d", 1e-4)
        y.backward(grad=ctx.tensor([[1.0, -2.0, 0.5]], ("r", "d")))
        assert not y.numpy().any()
        np.testing.assert_allclose(x.grad().numpy(), [[100.0, -200.0, 50.0]], rtol=1e-6)


def test_l2_normalize_gradcheck_and_threads(ctx1, ctx2):
    x = ctx1.variable(rand((3, 5), 1.0, 0.5), ("r", "d"))
    wy = ctx1.tensor(rand((3, 5)), ("r", "d"))
    with ctx1.exec_scope():
        fu.gradcheck(lambda a: (a.l2_normalize("d", 1e-3) * wy).sum_all(), [x])
    a, g = rand((300, 700), 2.0, 1.0), rand((300, 700))
    outs = []
    for c in (ctx1, ctx2):
        v = c.variable(a, ("r", "d"))
        with c.exec_scope():
            y = v.l2_normalize("d", 1e-6)
            y.backward(grad=c.tensor(g, ("r", "d")))
            outs.append((y.numpy(), v.grad().numpy()))
    for u, w in zip(*outs):
        assert_bitwise(u, w)
