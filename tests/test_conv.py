"""Convolution, pooling and vision ops (SPEC §3.13): the acceptance lines, every stride /
padding / dilation / groups combination against torch (values and every gradient), the
float32 formulas bitwise against numpy where SPEC asks for it, finite differences, the
Winograd-prepared route, thread invariance and bad input.

Tolerances: dense convs are contractions of k = taps * in-channels products (one FMA chain per
output), compared with torch at |d| <= 2e-6 * k + 1e-5 * |want| (well inside SPEC §0.5's
1e-5 * k); weight gradients sum k = output pixels products the same way. The Winograd route
matches conv2d within 2e-5 * k * max|x| * max|w| (its transforms reassociate the sum).
Depthwise convs, pools, unfold / fold, upsampling, prelu and channel_affine are bitwise equal
to the float32 formula computed in numpy in the stated order.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise

RNG = np.random.default_rng(11)


def rand(shape, s=1.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


def close_k(got, want, k, rel=1e-5):
    """|got - want| <= 2e-6 * k + rel * |want| elementwise (a contraction of length k)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.abs(got - want) - rel * np.abs(want)
    assert err.max(initial=0.0) <= 2e-6 * k, f"max excess error {err.max():.3g} > {2e-6 * k:.3g} (k={k})"


def run_both(ctx, arrays, tags, fu_fn, torch_fn, k_value, k_grads):
    """Value and the gradient of sum(y * w) w.r.t. every operand, fucina vs torch; k_grads: the
    contraction length of each operand's gradient."""
    vs = [ctx.variable(a, t) for a, t in zip(arrays, tags)]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fu_fn(*vs)
    ty = torch_fn(*ts)
    close_k(y.numpy(), ty.detach().numpy(), k_value)
    w = rand(y.shape)
    (y * ctx.tensor(w, y.tags)).sum_all().backward()
    (ty * torch.from_numpy(w)).sum().backward()
    for v, t, k in zip(vs, ts, k_grads):
        close_k(v.grad().numpy(), t.grad.numpy(), k)
    return y


# torch in Fucina's layouts: 1-D [time, channel], 2-D [H, W, C], weights as SPEC stores them

def t_conv1d(x, w, stride=1, padding=0, dilation=1, groups=1):
    return F.conv1d(x.T[None], w.permute(2, 1, 0), None, stride, padding, dilation, groups)[0].T


def t_conv2d(x, w, b=None, stride=1, padding=0, groups=1):
    return F.conv2d(x.permute(2, 0, 1)[None], w.permute(0, 3, 1, 2), b, stride, padding,
                    1, groups)[0].permute(1, 2, 0)


def t_map(fn, x, *a, **kw):
    return fn(x.permute(2, 0, 1)[None], *a, **kw)[0].permute(1, 2, 0)


# ---------------------------------------------------------------------------------------------
# acceptance (SPEC §3.13)

def test_acceptance(ctx):
    x = ctx.tensor([[1.0], [2.0], [3.0]], ("time", "in"))
    w = ctx.tensor([[[1.0]], [[1.0]]], ("tap", "in", "out"))
    assert x.conv1d("time", "in", "tap", "out", w).numpy().ravel().tolist() == [3.0, 5.0]
    img = ctx.tensor(np.array([1, 2, 3, 4], np.float32).reshape(2, 2, 1), ("h", "w", "c"))
    k = ctx.tensor(np.full((1, 1, 1, 1), 2.0, np.float32), ("o", "kh", "kw", "i"))
    y = img.conv2d(k, None, 1, 0, 1, ("h", "w", "o"))
    assert y.tags == ("h", "w", "o") and y.numpy().ravel().tolist() == [2.0, 4.0, 6.0, 8.0]
    assert img.max_pool2d(2, 2, 0).numpy().ravel().tolist() == [4.0]
    z = ctx.tensor(rand((4, 6, 3)), ("h", "w", "c"))
    back = z.unfold(2, 2, 0, ("patch", "elem")).fold((4, 6), 2, 2, 0, ("h", "w", "c"))
    assert_bitwise(back.numpy(), z.numpy())


# ---------------------------------------------------------------------------------------------
# 1-D family against torch

@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("padding", [0, 1, 3])
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv1d_against_torch(ctx1, stride, padding, dilation, groups):
    T, Cin, Cout, K = 17, 8, 12, 3
    run_both(ctx1, [rand((T, Cin)), rand((K, Cin // groups, Cout))], [("t", "i"), ("k", "i", "o")],
             lambda x, w: x.conv1d("t", "i", "k", "o", w, stride, padding, dilation, groups),
             lambda x, w: t_conv1d(x, w, stride, padding, dilation, groups),
             K * Cin // groups, [K * Cout // groups, T])


def test_conv1d_depthwise_groups_is_bitwise_formula(ctx):
    """groups == channels (one tap weight per channel): the separately rounded float32 sum."""
    T, C, K = 21, 19, 3
    x, w = rand((T, C)), rand((K, 1, C))
    y = ctx.tensor(x, ("t", "c")).conv1d("t", "c", "k", "o", ctx.tensor(w, ("k", "c", "o")),
                                         1, 1, 2, C)
    xp = np.concatenate([np.zeros((1, C), np.float32), x, np.zeros((1, C), np.float32)])
    want = np.zeros((T - 2, C), np.float32)
    for k in range(K):
        want = want + xp[2 * k: 2 * k + T - 2] * w[k, 0]
    assert_bitwise(y.numpy(), want)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dilation", [1, 2, 3])
def test_causal_conv1d_against_torch(ctx1, dilation, with_state):
    T, Cin, Cout, K = 11, 5, 7, 3
    hist = dilation * (K - 1)
    st = rand((hist, Cin)) if with_state else None
    pre = torch.from_numpy(st) if with_state else torch.zeros(hist, Cin)
    run_both(ctx1, [rand((T, Cin)), rand((K, Cin, Cout))], [("t", "i"), ("k", "i", "o")],
             lambda x, w: x.causal_conv1d("t", "i", "k", "o", w, dilation, state=st),
             lambda x, w: t_conv1d(torch.cat([pre, x]), w, dilation=dilation),
             K * Cin, [K * Cout, T + hist])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_causal_conv1d_against_torch(ctx1, groups):
    T, Cin, Cout, K, d = 10, 8, 12, 4, 2
    hist = d * (K - 1)
    st = rand((hist, Cin))
    run_both(ctx1, [rand((T, Cin)), rand((K, Cin // groups, Cout))], [("t", "i"), ("k", "ig", "o")],
             lambda x, w: x.grouped_causal_conv1d("t", "i", "k", "ig", "o", w, d, groups, state=st),
             lambda x, w: t_conv1d(torch.cat([torch.from_numpy(st), x]), w, dilation=d, groups=groups),
             K * Cin // groups, [K * Cout // groups, T + hist])


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_depthwise_conv1d(ctx, dilation, with_state):
    T, C, K = 13, 37, 4
    hist = dilation * (K - 1)
    x, w = rand((T, C)), rand((C, K))
    st = rand((hist, C)) if with_state else None
    full = np.concatenate([st if with_state else np.zeros((hist, C), np.float32), x])
    want = np.zeros((T, C), np.float32)
    for k in range(K):   # y[t] = sum_k x[t - d(K-1-k)] w[:, k], taps in order, float32
        want = want + full[k * dilation: k * dilation + T] * w[:, k]
    xc, wc = ctx.tensor(x, ("t", "c")), ctx.tensor(w, ("c", "k"))
    assert_bitwise(xc.causal_depthwise_conv1d("t", "c", "k", wc, dilation, state=st).numpy(), want)
    y = run_both(ctx, [x, w], [("t", "c"), ("c", "k")],
                 lambda x, w: x.causal_depthwise_conv1d("t", "c", "k", w, dilation, state=st),
                 lambda x, w: F.conv1d(torch.cat([torch.from_numpy(full[:hist]), x]).T[None],
                                       w[:, None, :], dilation=dilation, groups=C)[0].T,
                 K, [K, T + hist])
    assert y.tags == ("t", "c")


def test_streaming_state_continues_a_sequence(ctx):
    """Running a long signal in two chunks, the second with the first's last rows as state,
    gives the one-shot result (dense and depthwise)."""
    T, C, K, d = 24, 6, 3, 2
    hist = d * (K - 1)
    x, w, k = rand((T, C)), rand((K, C, 5)), rand((C, K))
    xt = ctx.tensor(x, ("t", "c"))
    wt, kt = ctx.tensor(w, ("k", "c", "o")), ctx.tensor(k, ("c", "k"))
    whole = xt.causal_conv1d("t", "c", "k", "o", wt, d).numpy()
    dwhole = xt.causal_depthwise_conv1d("t", "c", "k", kt, d).numpy()
    a, b = ctx.tensor(x[:10], ("t", "c")), ctx.tensor(x[10:], ("t", "c"))
    st = ctx.tensor(x[10 - hist:10], ("r", "c"))
    two = np.concatenate([a.causal_conv1d("t", "c", "k", "o", wt, d).numpy(),
                          b.causal_conv1d("t", "c", "k", "o", wt, d, state=st).numpy()])
    close_k(two, whole, K * C)
    dtwo = np.concatenate([a.causal_depthwise_conv1d("t", "c", "k", kt, d).numpy(),
                           b.causal_depthwise_conv1d("t", "c", "k", kt, d, state=st).numpy()])
    assert_bitwise(dtwo, dwhole)


def test_no_gradient_flows_into_state(ctx):
    x = ctx.variable(rand((5, 3)), ("t", "c"))
    w = ctx.variable(rand((3, 3, 2)), ("k", "c", "o"))
    k = ctx.variable(rand((3, 3)), ("c", "k"))
    st = ctx.variable(rand((2, 3)), ("r", "c"))
    y = x.causal_conv1d("t", "c", "k", "o", w, 1, state=st).sum_all()
    y = y + x.causal_depthwise_conv1d("t", "c", "k", k, 1, state=st).sum_all()
    y.backward()
    assert st.grad() is None
    assert x.grad() is not None and w.grad() is not None and k.grad() is not None


@pytest.mark.parametrize("stride,padding,output_pad", [(1, 0, 0), (2, 1, 0), (3, 2, 0), (2, 0, 1),
                                                       (3, 0, 2)])
def test_conv_transpose1d_against_torch(ctx1, stride, padding, output_pad):
    T, IC, OC, K = 9, 6, 5, 4

    def t_fn(x, w2, b):
        wt = w2.reshape(OC, K, IC).permute(2, 0, 1)             # torch [in, out, taps]
        return F.conv_transpose1d(x.T[None], wt, b, stride, padding, output_pad)[0].T

    run_both(ctx1, [rand((T, IC)), rand((K * OC, IC)), rand(OC)], [("t", "i"), ("ko", "i"), ("o",)],
             lambda x, w2, b: x.conv_transpose1d("t", "i", "ko", "o", w2, b, OC, K, stride,
                                                 padding, output_pad),
             t_fn, K * IC, [K * OC, T, (T - 1) * stride + K])


def test_conv_transpose1d_output_pad_rows_are_bias_only(ctx):
    """SPEC 7.1 item 10: with padding > 0 the output_pad trailing rows hold the bias alone (torch
    fills them with kernel taps); the rows before them are torch's."""
    T, IC, OC, K, s, p, op = 6, 3, 4, 3, 2, 1, 1
    x, w2, b = rand((T, IC)), rand((K * OC, IC)), rand(OC)
    y = ctx.tensor(x, ("t", "i")).conv_transpose1d("t", "i", "ko", "o", ctx.tensor(w2, ("ko", "i")),
                                                   ctx.tensor(b, ("o",)), OC, K, s, p, op).numpy()
    wt = torch.from_numpy(w2).reshape(OC, K, IC).permute(2, 0, 1)
    ref = F.conv_transpose1d(torch.from_numpy(x).T[None], wt, torch.from_numpy(b), s, p, 0)[0].T.numpy()
    assert y.shape == (ref.shape[0] + op, OC)
    close_k(y[:-op], ref, K * IC)
    assert_bitwise(y[-op:], np.tile(b, (op, 1)))


# ---------------------------------------------------------------------------------------------
# 2-D family against torch

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("padding", [0, 1, (2, 1)])
@pytest.mark.parametrize("stride", [1, 2, (1, 3)])
def test_conv2d_against_torch(ctx1, stride, padding, groups, bias):
    H, W, Cin, Cout, kh, kw = 9, 10, 6, 8, 3, 2
    arrays = [rand((H, W, Cin)), rand((Cout, kh, kw, Cin // groups))] + ([rand(Cout)] if bias else [])
    tags = [("h", "w", "c"), ("o", "kh", "kw", "i")] + ([("o",)] if bias else [])
    P = len(range(0, H + 2 * (padding if isinstance(padding, int) else padding[0]) - kh + 1,
                  stride if isinstance(stride, int) else stride[0]))
    run_both(ctx1, arrays, tags,
             lambda x, w, *b: x.conv2d(w, b[0] if b else None, stride, padding, groups),
             lambda x, w, *b: t_conv2d(x, w, b[0] if b else None, stride, padding, groups),
             kh * kw * Cin // groups, [kh * kw * Cout // groups, H * W, H * W][:len(arrays)])
    assert P > 0


@pytest.mark.parametrize("shape", [(8, 8, 16, 16, 3), (7, 9, 5, 5, 5), (12, 12, 64, 64, 3)])
def test_conv2d_depthwise(ctx1, shape):
    """groups == channels takes the depthwise kernel: bitwise the float32 formula, gradients
    as torch's."""
    H, W, C, Cout, k = shape
    x, w, b = rand((H, W, C)), rand((Cout, k, k, 1)), rand(Cout)
    y = ctx1.tensor(x, ("h", "w", "c")).conv2d(ctx1.tensor(w, ("o", "a", "b", "i")), None, 1, k // 2, C)
    xp = np.pad(x, ((k // 2, k // 2), (k // 2, k // 2), (0, 0)))
    want = np.zeros((H, W, C), np.float32)
    for ky in range(k):
        for kx in range(k):
            want = want + xp[ky:ky + H, kx:kx + W] * w[:, ky, kx, 0]
    assert_bitwise(y.numpy(), want)
    run_both(ctx1, [x, w, b], [("h", "w", "c"), ("o", "a", "b", "i"), ("o",)],
             lambda x, w, b: x.conv2d(w, b, 2, k // 2, C),
             lambda x, w, b: t_conv2d(x, w, b, 2, k // 2, C), k * k, [k * k, H * W, H * W])


@pytest.mark.parametrize("shape", [((91, 91, 4), (8, 3, 3, 4)), ((9000, 6), (3, 6, 10))])
def test_weight_gradient_over_pixel_blocks(ctx, shape):
    """More output pixels than one weight-gradient block (8192): the blocks' partial sums are
    folded in order; the boundary falls inside a row (2-D) and inside the signal (1-D)."""
    xs, ws = shape
    if len(xs) == 3:
        fu_fn, t_fn, tags = (lambda x, w: x.conv2d(w, None, 1, 1), lambda x, w: t_conv2d(x, w, None, 1, 1),
                             [("h", "w", "c"), ("o", "a", "b", "i")])
        k_x, k_w = 9 * ws[0], xs[0] * xs[1]
    else:
        fu_fn, t_fn, tags = (lambda x, w: x.conv1d("t", "i", "k", "o", w, 1, 1),
                             lambda x, w: t_conv1d(x, w, 1, 1), [("t", "i"), ("k", "i", "o")])
        k_x, k_w = 3 * ws[2], xs[0]
    run_both(ctx, [rand(xs), rand(ws)], tags, fu_fn, t_fn, 9 * xs[-1], [k_x, k_w])


def test_weight_gradient_blocks_split_the_pixels(ctx1):
    """Each block's partial sums its own row-major pixel range (here 9009 pixels: 2 blocks
    of 4505, the boundary inside row 49 of 91)."""
    from fucina.exec import conv as exc

    H, W, C, O = 99, 91, 3, 5
    x, gy = rand((H + 2, W + 2, C)), rand((H, W, O))     # x: an already padded source
    geo = exc.Geo(H, W, C, O, 3, 3, pt=1, pb=1, pl=1, pr=1)
    part = exc.wgrad_partials(ctx1, ctx1.from_numpy(x), ctx1.from_numpy(gy), geo).to_numpy()
    assert part.shape == (2, 9, C, O)
    cols = np.stack([x[ky:ky + H, kx:kx + W] for ky in range(3) for kx in range(3)], 2)
    cols = cols.reshape(H * W, 9, C).astype(np.float64)
    g2 = gy.reshape(H * W, O).astype(np.float64)
    for blk, (p0, p1) in enumerate([(0, 4505), (4505, 9009)]):
        want = np.einsum("ptc,po->tco", cols[p0:p1], g2[p0:p1])
        close_k(part[blk], want, p1 - p0)


def test_conv2d_wide_and_1x1(ctx1):
    """Many output channels (several column blocks) and a 1x1 kernel."""
    run_both(ctx1, [rand((6, 7, 20)), rand((70, 1, 1, 20)), rand(70)],
             [("h", "w", "c"), ("o", "a", "b", "i"), ("o",)],
             lambda x, w, b: x.conv2d(w, b), lambda x, w, b: t_conv2d(x, w, b), 20, [70, 42, 42])
    run_both(ctx1, [rand((5, 5, 3)), rand((33, 3, 3, 3))], [("h", "w", "c"), ("o", "a", "b", "i")],
             lambda x, w: x.conv2d(w, None, 1, 1), lambda x, w: t_conv2d(x, w, None, 1, 1),
             27, [297, 25])


@pytest.mark.parametrize("padding", [1, 0, (2, 1), 3])   # 3: the input gradient crops
def test_conv2d_winograd_route_against_torch(ctx1, padding):
    """3x3, stride 1, one group, >= 16 channels each side, >= 256 output pixels: the forward and
    the input gradient are Winograd F(2, 3) (any padding, odd sizes: partial tiles)."""
    from fucina.exec import conv as exc

    H, W, Cin, Cout = 18, 20, 16, 20
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    assert exc.wino_pays(exc.Geo(H, W, Cin, Cout, 3, 3, pt=ph, pb=ph, pl=pw, pr=pw))
    run_both(ctx1, [rand((H, W, Cin)), rand((Cout, 3, 3, Cin)), rand(Cout)],
             [("h", "w", "c"), ("o", "a", "b", "i"), ("o",)],
             lambda x, w, b: x.conv2d(w, b, 1, padding), lambda x, w, b: t_conv2d(x, w, b, 1, padding),
             9 * Cin, [9 * Cout, H * W, H * W])


# routes: direct, Winograd, depthwise
@pytest.mark.parametrize("cin,cout,groups", [(4, 6, 1), (16, 16, 1), (6, 6, 6)])
def test_conv2d_relu(ctx, cin, cout, groups):
    x, w, b = rand((16, 17, cin)), rand((cout, 3, 3, cin // groups)), rand(cout)
    xt, wt, bt = ctx.tensor(x, ("h", "w", "c")), ctx.tensor(w, ("o", "a", "b", "i")), ctx.tensor(b, ("o",))
    fused = xt.conv2d_relu(wt, bt, 1, 1, groups)
    assert_bitwise(fused.numpy(), xt.conv2d(wt, bt, 1, 1, groups).relu().numpy())
    assert fused.numpy().min() == 0.0
    y = run_both(ctx, [x, w, b], [("h", "w", "c"), ("o", "a", "b", "i"), ("o",)],
                 lambda x, w, b: x.conv2d_relu(w, b, 1, 1, groups),
                 lambda x, w, b: torch.relu(t_conv2d(x, w, b, 1, 1, groups)), 9 * cin // groups,
                 [9 * cout // groups, 272, 272])
    assert_bitwise(y.numpy(), fused.numpy())  # the same values under gradients


# ---------------------------------------------------------------------------------------------
# pools and upsampling

def np_pool(x, k, s, p, op):
    """The float32 formula: taps in (ky, kx) order; max keeps the first maximum unless a NaN
    comes (the last NaN wins); avg divides the valid taps' sum by their count."""
    H, W, C = x.shape
    OH, OW = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    out = np.empty((OH, OW, C), np.float32)
    for oy in range(OH):
        for ox in range(OW):
            acc = np.full(C, -np.inf if op == "max" else 0.0, np.float32)
            n = 0
            for ky in range(k):
                for kx in range(k):
                    iy, ix = oy * s + ky - p, ox * s + kx - p
                    if 0 <= iy < H and 0 <= ix < W:
                        v = x[iy, ix]
                        n += 1
                        acc = np.where((v > acc) | np.isnan(v), v, acc) if op == "max" else acc + v
            out[oy, ox] = acc / np.float32(n) if op == "avg" else acc
    return out


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0), (3, 3, 0)])
@pytest.mark.parametrize("op", ["max", "avg"])
def test_pools(ctx, op, k, s, p):
    x = rand((9, 11, 21))
    fu_fn = (lambda t: t.max_pool2d(k, s, p)) if op == "max" else (lambda t: t.avg_pool2d(k, s, p))
    assert_bitwise(fu_fn(ctx.tensor(x, ("h", "w", "c"))).numpy(), np_pool(x, k, s, p, op))
    t_fn = ((lambda t: t_map(F.max_pool2d, t, k, s, p)) if op == "max" else
            (lambda t: t_map(F.avg_pool2d, t, k, s, p, count_include_pad=False)))
    run_both(ctx, [x], [("h", "w", "c")], fu_fn, t_fn, 1, [1])


def test_pool_rectangular_and_defaults(ctx):
    x = rand((10, 9, 3))
    xt = ctx.tensor(x, ("h", "w", "c"))
    want = t_map(F.max_pool2d, torch.from_numpy(x), (3, 2), (2, 1), (1, 0)).numpy()
    assert_bitwise(xt.max_pool2d((3, 2), (2, 1), (1, 0)).numpy(), want)
    assert_bitwise(xt.avg_pool2d(2).numpy(), t_map(F.avg_pool2d, torch.from_numpy(x), 2).numpy())


def test_max_pool_ties_and_nan(ctx):
    """Gradient to the first maximum of a window; a NaN in a window makes its output NaN."""
    x = np.zeros((2, 2, 1), np.float32)
    v = ctx.variable(x, ("h", "w", "c"))
    v.max_pool2d(2).sum_all().backward()
    assert v.grad().numpy().ravel().tolist() == [1.0, 0.0, 0.0, 0.0]
    y = np.array([1, np.nan, 3, 2], np.float32).reshape(2, 2, 1)
    assert np.isnan(ctx.tensor(y, ("h", "w", "c")).max_pool2d(2).item())


def test_avg_pool_counts_valid_taps_only(ctx):
    """SPEC 7.1 item 10: a corner window with padding averages its valid taps only."""
    x = np.ones((3, 3, 1), np.float32)
    y = ctx.tensor(x, ("h", "w", "c")).avg_pool2d(3, 1, 1).numpy()
    assert (y == 1.0).all()  # count_include_pad=True would give 4/9 in a corner


def test_upsample2x_nearest(ctx):
    x = rand((5, 3, 7))
    y = run_both(ctx, [x], [("h", "w", "c")], lambda t: t.upsample2x_nearest(),
                 lambda t: t_map(F.interpolate, t, scale_factor=2, mode="nearest"), 1, [4])
    assert_bitwise(y.numpy(), x.repeat(2, 0).repeat(2, 1))
    v = ctx.variable(x, ("h", "w", "c"))
    g = rand((10, 6, 7))
    v.upsample2x_nearest().backward(ctx.tensor(g, ("h", "w", "c")))
    want = ((g[0::2, 0::2] + g[0::2, 1::2]) + g[1::2, 0::2]) + g[1::2, 1::2]   # the sum-pool's order
    assert_bitwise(v.grad().numpy(), want)


# ---------------------------------------------------------------------------------------------
# unfold / fold

def np_unfold(x, kh, kw, sh, sw, ph, pw):
    H, W, C = x.shape
    OH, OW = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    xp = np.pad(x, ((ph, ph), (pw, pw), (0, 0)))
    col = np.empty((OH * OW, kh * kw * C), np.float32)
    for oy in range(OH):
        for ox in range(OW):
            col[oy * OW + ox] = xp[oy * sh:oy * sh + kh, ox * sw:ox * sw + kw].reshape(-1)
    return col


def np_fold(col, H, W, kh, kw, sh, sw, ph, pw):
    C = col.shape[1] // (kh * kw)
    OH, OW = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    out = np.zeros((H + 2 * ph + sh * 0, W + 2 * pw, C), np.float32)
    cols = col.reshape(OH, OW, kh, kw, C)
    for ky in range(kh):        # taps in (ky, kx) order, each adding every window's element
        for kx in range(kw):
            out[ky:ky + sh * (OH - 1) + 1:sh, kx:kx + sw * (OW - 1) + 1:sw] += cols[:, :, ky, kx]
    return out[ph:ph + H, pw:pw + W]


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 1, 1), ((3, 2), (2, 1), (1, 0)),
                                                   (2, 3, 1)])
def test_unfold_fold(ctx, kernel, stride, padding):
    (kh, kw), (sh, sw), (ph, pw) = [(v, v) if isinstance(v, int) else v for v in (kernel, stride, padding)]
    H, W, C = 7, 8, 5
    x = rand((H, W, C))
    col = ctx.tensor(x, ("h", "w", "c")).unfold(kernel, stride, padding, ("p", "e"))
    assert col.tags == ("p", "e")
    assert_bitwise(col.numpy(), np_unfold(x, kh, kw, sh, sw, ph, pw))
    c = rand(col.shape)
    back = ctx.tensor(c, ("p", "e")).fold((H, W), kernel, stride, padding, ("h", "w", "c"))
    assert_bitwise(back.numpy(), np_fold(c, H, W, kh, kw, sh, sw, ph, pw))

    def t_unfold(t):
        L = col.shape[0]
        return F.unfold(t.permute(2, 0, 1)[None], kernel, 1, padding, stride)[0].reshape(
            C, kh * kw, L).permute(2, 1, 0).reshape(L, -1)

    def t_fold(t):
        L = t.shape[0]
        tc = t.reshape(L, kh * kw, C).permute(2, 1, 0).reshape(C * kh * kw, L)
        return F.fold(tc[None], (H, W), kernel, 1, padding, stride)[0].permute(1, 2, 0)

    run_both(ctx, [x], [("h", "w", "c")], lambda t: t.unfold(kernel, stride, padding, ("p", "e")),
             t_unfold, 1, [kh * kw])
    run_both(ctx, [c], [("p", "e")], lambda t: t.fold((H, W), kernel, stride, padding, ("h", "w", "c")),
             t_fold, kh * kw, [1])


def test_fold_is_the_adjoint_of_unfold(ctx):
    """<unfold(x), c> == <x, fold(c)> (overlapping windows and padding)."""
    x, H, W = rand((6, 7, 3)), 6, 7
    col = ctx.tensor(x, ("h", "w", "c")).unfold(3, 2, 1, ("p", "e")).numpy()
    c = rand(col.shape)
    back = ctx.tensor(c, ("p", "e")).fold((H, W), 3, 2, 1, ("h", "w", "c")).numpy()
    assert np.isclose(float((col.astype(np.float64) * c).sum()), float((x.astype(np.float64) * back).sum()),
                      rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# prelu, channel_affine

@pytest.mark.parametrize("shape", [(37,), (5, 19), (3, 4, 70)])
def test_prelu(ctx, shape):
    x, a = rand(shape), rand(shape[-1:])
    x.ravel()[:3] = [0.0, -0.0, np.nan]
    tags = ("a", "b", "c")[-len(shape):]
    y = ctx.tensor(x, tags).prelu(ctx.tensor(a, tags[-1:]))
    assert_bitwise(y.numpy(), np.where(x > 0, x, a * x))
    x = rand(shape)
    run_both(ctx, [x, a], [tags, tags[-1:]], lambda x, a: x.prelu(a),
             lambda x, a: torch.where(x > 0, x, a * x), 1, [1, int(np.prod(shape[:-1]))])


@pytest.mark.parametrize("shape", [(37,), (3, 4, 70)])
def test_channel_affine(ctx, shape):
    x, s, b = rand(shape), rand(shape[-1:]), rand(shape[-1:])
    tags = ("a", "b", "c")[-len(shape):]
    y = ctx.tensor(x, tags).channel_affine(ctx.tensor(s, tags[-1:]), ctx.tensor(b, tags[-1:]))
    assert_bitwise(y.numpy(), x * s + b)
    n = int(np.prod(shape[:-1]))
    run_both(ctx, [x, s, b], [tags, tags[-1:], tags[-1:]], lambda x, s, b: x.channel_affine(s, b),
             lambda x, s, b: x * s + b, 1, [1, n, n])


def test_operands_may_be_views(ctx):
    """Offset views (narrow) and strided views (permute) give the results of their copies."""
    def both(fn, *arrays_tags):
        views, copies = [], []
        for a, tags, how in arrays_tags:
            big = ctx.tensor(a, tags)
            if how == "narrow":          # rows 1..n-1 of the first axis: contiguous, offset 1 row
                views.append(big.narrow(tags[0], 1, a.shape[0] - 1))
                copies.append(ctx.tensor(a[1:], tags))
            elif how == "permute":       # stored transposed, viewed back
                t = ctx.tensor(np.ascontiguousarray(np.swapaxes(a, 0, 1)), (tags[1], tags[0]) + tags[2:])
                views.append(t.permute(tags))
                copies.append(big)
            else:
                views.append(big)
                copies.append(big)
        assert_bitwise(fn(*views).numpy(), fn(*copies).numpy())

    both(lambda x, w: x.conv1d("t", "i", "k", "o", w, 1, 1),
         (rand((9, 4)), ("t", "i"), "narrow"), (rand((4, 4, 6)), ("k", "i", "o"), "narrow"))
    both(lambda x, w: x.conv1d("t", "c", "k", "o", w, 1, 1, 1, 5),
         (rand((9, 5)), ("t", "c"), "permute"), (rand((4, 1, 5)), ("k", "c", "o"), "narrow"))
    both(lambda x, k: x.causal_depthwise_conv1d("t", "c", "k", k, 2),
         (rand((9, 5)), ("t", "c"), "narrow"), (rand((6, 3)), ("c", "k"), "narrow"))
    both(lambda x, w: x.conv_transpose1d("t", "i", "ko", "o", w, None, 3, 1, 2),
         (rand((6, 4)), ("t", "i"), ""), (rand((4, 4)), ("ko", "i"), "narrow"))
    both(lambda x, w: x.conv2d(w, None, 1, 1),
         (rand((6, 7, 8)), ("h", "w", "c"), "permute"), (rand((9, 3, 3, 8)), ("o", "a", "b", "i"), "narrow"))
    both(lambda x, w: x.conv2d(w, None, 2, 1, 5),
         (rand((6, 7, 5)), ("h", "w", "c"), "narrow"), (rand((6, 3, 3, 1)), ("o", "a", "b", "i"), "narrow"))
    both(lambda x: x.max_pool2d(2), (rand((7, 6, 3)), ("h", "w", "c"), "permute"))
    both(lambda x: x.unfold(2, 1, 0, ("p", "e")), (rand((5, 6, 3)), ("h", "w", "c"), "narrow"))
    both(lambda x, a: x.prelu(a), (rand((5, 4)), ("r", "c"), "permute"), (rand(5), ("c",), "narrow"))


# ---------------------------------------------------------------------------------------------
# finite differences for every differentiable operand

def test_gradcheck_every_op(ctx1):
    c = ctx1
    v = c.variable
    checks = [
        (lambda x, w: x.conv1d("t", "i", "k", "o", w, 2, 1, 2, 2),
         [v(rand((9, 4)), ("t", "i")), v(rand((2, 2, 6)), ("k", "i", "o"))]),
        (lambda x, w: x.causal_conv1d("t", "i", "k", "o", w, 2, state=np.ones((2, 3), np.float32)),
         [v(rand((6, 3)), ("t", "i")), v(rand((2, 3, 4)), ("k", "i", "o"))]),
        (lambda x, w: x.grouped_causal_conv1d("t", "i", "k", "ig", "o", w, 1, 2),
         [v(rand((6, 4)), ("t", "i")), v(rand((3, 2, 4)), ("k", "ig", "o"))]),
        (lambda x, w: x.causal_depthwise_conv1d("t", "c", "k", w, 2, state=np.ones((2, 3), np.float32)),
         [v(rand((7, 3)), ("t", "c")), v(rand((3, 2)), ("c", "k"))]),
        (lambda x, w, b: x.conv_transpose1d("t", "i", "ko", "o", w, b, 3, 2, 2, 1, 1),
         [v(rand((5, 2)), ("t", "i")), v(rand((6, 2)), ("ko", "i")), v(rand(3), ("o",))]),
        (lambda x, w, b: x.conv2d(w, b, (2, 1), 1, 2),
         [v(rand((5, 4, 4)), ("h", "w", "c")), v(rand((4, 3, 2, 2)), ("o", "a", "b", "i")),
          v(rand(4), ("o",))]),
        (lambda x, w: x.conv2d(w, None, 1, 1, 3),
         [v(rand((4, 5, 3)), ("h", "w", "c")), v(rand((3, 3, 3, 1)), ("o", "a", "b", "i"))]),
        (lambda x, w, b: x.conv2d_relu(w, b, 1, 1),
         [v(rand((4, 4, 2)), ("h", "w", "c")), v(rand((3, 3, 3, 2)), ("o", "a", "b", "i")),
          v(rand(3) + 2, ("o",))]),
        (lambda x: x.max_pool2d(3, 2, 1), [v(rand((6, 5, 2)), ("h", "w", "c"))]),
        (lambda x: x.avg_pool2d(3, 2, 1), [v(rand((6, 5, 2)), ("h", "w", "c"))]),
        (lambda x: x.upsample2x_nearest(), [v(rand((3, 2, 2)), ("h", "w", "c"))]),
        (lambda x: x.unfold(3, 2, 1, ("p", "e")), [v(rand((5, 4, 2)), ("h", "w", "c"))]),
        (lambda x: x.fold((5, 4), 3, 2, 1, ("h", "w", "c")), [v(rand((6, 18)), ("p", "e"))]),
        (lambda x, a: x.prelu(a), [v(rand((4, 3)) + 0.1, ("r", "c")), v(rand(3), ("c",))]),
        (lambda x, s, b: x.channel_affine(s, b),
         [v(rand((4, 3)), ("r", "c")), v(rand(3), ("c",)), v(rand(3), ("c",))]),
    ]
    for fn, vs in checks:
        with c.exec_scope():
            y0 = fn(*vs)
            shape, tags = y0.shape, y0.tags
        w = c.tensor(rand(shape), tags)
        res = fu.gradcheck(lambda *a, fn=fn, w=w: (fn(*a) * w).sum_all(), vs, eps=1e-2,
                           abs_tol=3e-3, rel_tol=2e-2)
        assert res.checked == sum(t.numel for t in vs)


# ---------------------------------------------------------------------------------------------
# the Winograd-prepared route

@pytest.mark.parametrize("HW,pad", [((16, 13), 1), ((9, 20), 0), ((5, 6), 1), ((3, 3), 1)])
def test_conv2d_prepared_matches_conv2d(ctx, HW, pad):
    H, W = HW
    Cin, Cout = 8, 12
    x, w, b = rand((H, W, Cin)), rand((Cout, 3, 3, Cin)), rand(Cout)
    xt, wt, bt = ctx.tensor(x, ("h", "w", "c")), ctx.tensor(w, ("o", "a", "b", "i")), ctx.tensor(b, ("o",))
    prep = wt.prepare_conv2d_weights()
    assert isinstance(prep, fu.PreparedConv2dWeights) and not prep.empty
    direct = xt.conv2d(wt, bt, 1, pad).numpy()
    got = xt.conv2d_prepared(wt, prep, bt, 1, pad)
    assert got.tags == ("h", "w", "o")
    k = 9 * Cin
    scale = np.abs(x).max() * np.abs(w).max()
    assert np.abs(got.numpy() - direct).max() <= 2e-5 * k * scale
    want = t_conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), 1, pad)
    close_k(direct, want.numpy(), k)
    relu = xt.conv2d_prepared_relu(wt, prep, bt, 1, pad).numpy()
    assert_bitwise(relu, np.where(got.numpy() > 0, got.numpy(), np.float32(0)))


def test_conv2d_prepared_other_routes_are_conv2d(ctx):
    """Shapes Winograd does not cover (stride 2, groups, 5x5) take the direct route."""
    x = ctx.tensor(rand((9, 9, 4)), ("h", "w", "c"))
    w3 = ctx.tensor(rand((4, 3, 3, 4)), ("o", "a", "b", "i"))
    p3 = w3.prepare_conv2d_weights()
    for args in [(None, 2, 1), (None, (1, 2), 2)]:
        assert_bitwise(x.conv2d_prepared(w3, p3, *args).numpy(), x.conv2d(w3, *args).numpy())
    w3g = ctx.tensor(rand((4, 3, 3, 2)), ("o", "a", "b", "i"))
    p3g = w3g.prepare_conv2d_weights()
    assert_bitwise(x.conv2d_prepared(w3g, p3g, None, 1, 1, 2).numpy(), x.conv2d(w3g, None, 1, 1, 2).numpy())
    w5 = ctx.tensor(rand((4, 5, 5, 2)), ("o", "a", "b", "i"))
    p5 = w5.prepare_conv2d_weights()
    assert p5.empty
    assert_bitwise(x.conv2d_prepared(w5, p5, None, 1, 2, 2).numpy(), x.conv2d(w5, None, 1, 2, 2).numpy())


def test_conv2d_prepared_refuses_gradients(ctx):
    x = ctx.variable(rand((6, 6, 4)), ("h", "w", "c"))
    w = ctx.variable(rand((4, 3, 3, 4)), ("o", "a", "b", "i"))
    with pytest.raises(fu.GradientPreparedConv2dUnsupported):
        w.prepare_conv2d_weights()
    with fu.no_grad():
        prep = w.prepare_conv2d_weights()
        y = x.conv2d_prepared(w, prep, None, 1, 1)   # inference on variables is fine
    assert not y.requires_grad
    with pytest.raises(fu.GradientPreparedConv2dUnsupported):
        x.conv2d_prepared(w, prep, None, 1, 1)
    other = ctx.tensor(rand((5, 3, 3, 4)), ("o", "a", "b", "i"))
    with pytest.raises(fu.ShapeMismatch):
        x.detach().conv2d_prepared(other, prep, None, 1, 1)
    with pytest.raises(TypeError):
        x.detach().conv2d_prepared(w.detach(), "planes", None, 1, 1)


# ---------------------------------------------------------------------------------------------
# bitwise thread invariance (sizes that split into many chunks and use the team)

def _every_op(c):
    """Values and gradients of one call of every op family, as numpy arrays."""
    r = np.random.default_rng(3)

    def var(shape, tags):
        return c.variable((r.standard_normal(shape)).astype(np.float32), tags)

    out = []
    cases = [
        (lambda x, w: x.conv2d(w, None, 1, 1), [var((32, 32, 32), ("h", "w", "c")),
                                                var((32, 3, 3, 32), ("o", "a", "b", "i"))]),
        (lambda x, w, b: x.conv2d(w, b, 2, 1, 4), [var((20, 20, 16), ("h", "w", "c")),
                                                   var((24, 3, 3, 4), ("o", "a", "b", "i")),
                                                   var((24,), ("o",))]),
        (lambda x, w: x.conv2d(w, None, 1, 1, 64), [var((24, 24, 64), ("h", "w", "c")),
                                                    var((64, 3, 3, 1), ("o", "a", "b", "i"))]),
        (lambda x, w: x.conv1d("t", "i", "k", "o", w, 1, 1), [var((9000, 24), ("t", "i")),
                                                             var((3, 24, 40), ("k", "i", "o"))]),
        (lambda x, w: x.causal_depthwise_conv1d("t", "c", "k", w, 2),
         [var((10000, 64), ("t", "c")), var((64, 4), ("c", "k"))]),
        (lambda x, w, b: x.conv_transpose1d("t", "i", "ko", "o", w, b, 16, 4, 2, 1),
         [var((1024, 32), ("t", "i")), var((64, 32), ("ko", "i")), var((16,), ("o",))]),
        (lambda x: x.max_pool2d(3, 2, 1), [var((64, 64, 32), ("h", "w", "c"))]),
        (lambda x: x.avg_pool2d(2), [var((64, 64, 32), ("h", "w", "c"))]),
        (lambda x: x.upsample2x_nearest(), [var((48, 48, 16), ("h", "w", "c"))]),
        (lambda x: x.unfold(3, 1, 1, ("p", "e")), [var((40, 40, 16), ("h", "w", "c"))]),
        (lambda x: x.fold((34, 34), 3, 1, 0, ("h", "w", "c")), [var((1024, 144), ("p", "e"))]),
        (lambda x, a: x.prelu(a), [var((4096, 64), ("r", "c")), var((64,), ("c",))]),
        (lambda x, s, b: x.channel_affine(s, b), [var((4096, 64), ("r", "c")), var((64,), ("c",)),
                                                  var((64,), ("c",))]),
    ]
    for fn, vs in cases:
        y = fn(*vs)
        g = c.tensor(r.standard_normal(y.shape).astype(np.float32), y.tags)
        y.backward(g)
        out.append([y.numpy()] + [v.grad().numpy() for v in vs])
    x = c.tensor(r.standard_normal((40, 40, 32)).astype(np.float32), ("h", "w", "c"))
    w = c.tensor(r.standard_normal((32, 3, 3, 32)).astype(np.float32), ("o", "a", "b", "i"))
    p = w.prepare_conv2d_weights()
    small = c.tensor(x.numpy()[:5, :5], ("h", "w", "c"))      # F(2, 3) there, F(4, 3) above
    out.append([x.conv2d_prepared(w, p, None, 1, 1).numpy(), small.conv2d_prepared(w, p, None, 1, 1).numpy()])
    return out


def test_thread_invariance(ctx1, ctx2):
    for a, b in zip(_every_op(ctx1), _every_op(ctx2)):
        for u, v in zip(a, b):
            assert_bitwise(u, v)


# ---------------------------------------------------------------------------------------------
# bad input

def test_errors_1d(ctx):
    x = ctx.tensor(rand((8, 4)), ("t", "i"))
    w = ctx.tensor(rand((3, 4, 6)), ("k", "i", "o"))
    with pytest.raises(fu.TagError, match="storage order"):
        ctx.tensor(rand((4, 8)), ("i", "t")).conv1d("t", "i", "k", "o", w)
    with pytest.raises(fu.TagError):
        x.conv1d("t", "i", "k", "o", ctx.tensor(rand((3, 6, 4)), ("k", "o", "i")))
    with pytest.raises(fu.ShapeMismatch, match="groups"):
        x.conv1d("t", "i", "k", "o", ctx.tensor(rand((3, 2, 6)), ("k", "i", "o")), groups=3)
    with pytest.raises(fu.ShapeMismatch, match="in channels / groups"):
        x.conv1d("t", "i", "k", "o", w, groups=2)
    with pytest.raises(fu.ShapeMismatch, match="larger than the padded input"):
        x.conv1d("t", "i", "k", "o", w, dilation=4)
    with pytest.raises(fu.InvalidShape, match="stride"):
        x.conv1d("t", "i", "k", "o", w, stride=0)
    with pytest.raises(fu.InvalidDataLength, match="state"):
        x.causal_conv1d("t", "i", "k", "o", w, 1, state=np.zeros(5, np.float32))
    with pytest.raises(fu.DTypeError):
        ctx.tensor(rand((8, 4)), ("t", "i"), dtype="f16").conv1d("t", "i", "k", "o", w)
    with pytest.raises(fu.ShapeMismatch, match="kernel axis"):
        x.causal_depthwise_conv1d("t", "i", "k", ctx.tensor(rand((3, 2)), ("i", "k")))
    with pytest.raises(fu.TagError):
        x.causal_depthwise_conv1d("t", "i", "k", ctx.tensor(rand((2, 4)), ("k", "i")))
    with pytest.raises(fu.ShapeMismatch, match="weight2"):
        x.conv_transpose1d("t", "i", "ko", "o", ctx.tensor(rand((10, 4)), ("ko", "i")), None, 3, 3)
    with pytest.raises(fu.TagError, match="bias"):
        x.conv_transpose1d("t", "i", "ko", "o", ctx.tensor(rand((9, 4)), ("ko", "i")),
                           ctx.tensor(rand(3), ("z",)), 3, 3)
    with pytest.raises(TypeError):
        x.conv1d("t", "i", "k", "o", w, strides=2)
    with fu.ExecContext(threads=1) as other:
        with pytest.raises(fu.ContextMismatch):
            x.conv1d("t", "i", "k", "o", other.tensor(rand((3, 4, 6)), ("k", "i", "o")))


def test_errors_2d(ctx):
    x = ctx.tensor(rand((6, 6, 4)), ("h", "w", "c"))
    w = ctx.tensor(rand((8, 3, 3, 4)), ("o", "a", "b", "i"))
    with pytest.raises(fu.TagError, match="rank-3"):
        ctx.tensor(rand((6, 4)), ("h", "c")).conv2d(w)
    with pytest.raises(fu.ShapeMismatch, match="groups"):
        x.conv2d(w, groups=3)
    with pytest.raises(fu.ShapeMismatch, match="Cin/groups"):
        x.conv2d(w, groups=2)
    with pytest.raises(fu.ShapeMismatch, match="larger than the padded input"):
        x.conv2d(ctx.tensor(rand((8, 7, 7, 4)), ("o", "a", "b", "i")))
    with pytest.raises(fu.ShapeMismatch, match="bias"):
        x.conv2d(w, ctx.tensor(rand(7), ("o",)))
    with pytest.raises(fu.InvalidShape, match="padding"):
        x.conv2d(w, padding=-1)
    with pytest.raises(TypeError, match="pair"):
        x.conv2d(w, stride=(1, 2, 3))
    with pytest.raises(fu.TagError):
        x.conv2d(w, out_tags=("h", "h", "o"))
    with pytest.raises(fu.InvalidShape, match="padding < kernel"):
        x.max_pool2d(2, 2, 2)
    with pytest.raises(fu.ShapeMismatch, match="larger than the padded input"):
        x.avg_pool2d(7)
    with pytest.raises(fu.ShapeMismatch, match="patch rows"):
        ctx.tensor(rand((8, 16)), ("p", "e")).fold((6, 6), 2, 2, 0, ("h", "w", "c"))
    with pytest.raises(fu.TagError):
        x.unfold(2, 2, 0, ("p",))
    with pytest.raises(fu.TagError, match="alpha"):
        x.prelu(ctx.tensor(rand(4), ("h",)))
    with pytest.raises(fu.ShapeMismatch, match="alpha"):
        x.prelu(ctx.tensor(rand(5), ("c",)))
    with pytest.raises(fu.TagError, match="shift"):
        x.channel_affine(ctx.tensor(rand(4), ("c",)), ctx.tensor(rand(4), ("w",)))
