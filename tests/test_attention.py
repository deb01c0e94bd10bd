"""grouped_attention (SPEC §3.12) against torch's scaled_dot_product_attention: values and the
q/k/v gradients for causal, windowed and bidirectional attention, GQA and arbitrary head maps,
f16 keys/values, an additive bias, lengths on both sides of the tiling thresholds (and with tiny
tiles, so every online-softmax path runs on small problems), finite differences, bitwise thread
invariance, the acceptance and bad input."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu
from conftest import assert_bitwise
from fucina.exec import attention as exa

RNG = np.random.default_rng(12)
QT, KT = ("seq", "head", "d"), ("seq", "kv_head", "d")


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def torch_attention(q, k, v, heads, scale, causal=True, window=0, bias=None):
    """SPEC's torch equivalent: SDPA after expanding the KV heads per query head; causal aligned
    to the end of the keys (an explicit mask, which also carries the window)."""
    S, H, D = q.shape
    T = k.shape[0]
    idx = torch.tensor(heads)
    qq, kk, vv = q.permute(1, 0, 2), k.permute(1, 0, 2)[idx], v.permute(1, 0, 2)[idx]
    mask = bias
    if causal:
        i = torch.arange(S)[:, None] + T - S
        j = torch.arange(T)[None, :]
        allowed = j <= i
        if window:
            allowed &= j > i - window
        mask = torch.where(allowed, 0.0, float("-inf"))
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    return out.permute(1, 0, 2).reshape(S, H * D)


def check(ctx, S, T, H, KVH, D, heads=None, causal=True, window=0, tol=2e-5):
    heads = heads or [h // (H // KVH) for h in range(H)]
    q, k, v, g = rand(S, H, D), rand(T, KVH, D), rand(T, KVH, D), rand(S, H * D)
    scale = 1.0 / np.sqrt(D)
    Q, K, V = ctx.variable(q, QT), ctx.variable(k, KT), ctx.variable(v, KT)
    y = Q.grouped_attention(K, V, heads, "hd", scale, mask="causal" if causal else "bidirectional",
                            window=window)
    assert y.tags == ("seq", "hd") and y.shape == (S, H * D)
    y.backward(grad=ctx.tensor(g, ("seq", "hd")))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ty = torch_attention(tq, tk, tv, heads, scale, causal, window)
    ty.backward(torch.from_numpy(g))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=tol, atol=tol)
    for mine, theirs in ((Q, tq), (K, tk), (V, tv)):
        np.testing.assert_allclose(mine.grad().numpy(), theirs.grad.numpy(), rtol=tol, atol=tol)
    return y.numpy(), Q.grad().numpy(), K.grad().numpy(), V.grad().numpy()


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles small enough that a short sequence spans many query and key blocks (the online
    softmax rescales, skipped tiles, partial blocks)."""
    monkeypatch.setattr(exa, "BQ", 8)
    monkeypatch.setattr(exa, "BK", 16)
    monkeypatch.setattr(exa, "FWD_BK", 16)


def test_acceptance(ctx):
    q = ctx.tensor([[[1.0, 0.0]]], QT)
    k = ctx.tensor([[[1.0, 1.0]]], KT)
    v = ctx.tensor([[[5.0, 7.0]]], KT)
    np.testing.assert_allclose(q.grouped_attention(k, v, [0], "o", 1.0).numpy(), [[5.0, 7.0]])


@pytest.mark.parametrize("S,T,H,KVH,D", [(1, 1, 1, 1, 4), (7, 7, 4, 2, 8), (37, 50, 4, 4, 16),
                                         (130, 130, 2, 1, 64)])
def test_causal_gqa(ctx, S, T, H, KVH, D):
    check(ctx, S, T, H, KVH, D)


@pytest.mark.parametrize("T", [exa.FWD_BK + 6, 4 * exa.FWD_BK + 3])
def test_both_sides_of_the_key_tile(ctx1, T):
    """Query and key tiles with partial last tiles: the online softmax over 2 and 5 key
    tiles (more in the backward's tiles, split in two parts)."""
    check(ctx1, 70, T, 2, 1, 32)
    check(ctx1, 70, T, 2, 2, 16, causal=False)


def test_partial_key_tile_never_reads_stale_memory(ctx1, monkeypatch):
    """The kernels load whole vectors of a partial last key tile, columns past the keys
    included, whose scores no result may read. Every buffer handed out here starts as NaN:
    a score of such a column used anywhere (a NaN times p = 0 is NaN) shows in the output
    or a gradient."""
    real = type(ctx1).empty

    def poisoned(self, shape, dtype="f32"):
        t = real(self, shape, dtype)
        if dtype == "f32":
            np.frombuffer(t.buf, np.float32)[:] = np.nan
        return t

    monkeypatch.setattr(type(ctx1), "empty", poisoned)
    check(ctx1, 70, exa.BK + 6, 2, 1, 32)
    check(ctx1, 70, exa.FWD_BK + 6, 2, 2, 16, causal=False)


def test_tiled_paths(ctx, tiny_tiles):
    check(ctx, 37, 53, 4, 2, 8)
    check(ctx, 37, 53, 4, 2, 8, causal=False)
    check(ctx, 37, 53, 2, 1, 8, window=5)
    check(ctx, 20, 20, 2, 2, 8, window=1)


def test_window(ctx):
    check(ctx, 40, 64, 4, 2, 16, window=9)
    check(ctx, 40, 64, 4, 2, 16, window=1000)


def test_bidirectional(ctx):
    check(ctx, 33, 21, 4, 1, 16, causal=False)   # more queries than keys is fine here


def test_arbitrary_head_map(ctx):
    check(ctx, 12, 15, 4, 2, 8, heads=[1, 0, 1, 0])
    check(ctx, 12, 15, 3, 3, 8, heads=[2, 2, 0])    # KV head 1 unused: its grads are zero


def test_f16_kv_gradient_to_q_only(ctx):
    S, T, H, KVH, D = 20, 24, 4, 2, 16
    q, k, v, g = rand(S, H, D), rand(T, KVH, D), rand(T, KVH, D), rand(S, H * D)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    Q = ctx.variable(q, QT)
    K, V = ctx.tensor(k16, KT, dtype="f16"), ctx.tensor(v16, KT, dtype="f16")
    heads = [h // 2 for h in range(H)]
    y = Q.grouped_attention(K, V, heads, "hd", 0.25)
    y.backward(grad=ctx.tensor(g, ("seq", "hd")))
    tq = torch.tensor(q, requires_grad=True)
    ty = torch_attention(tq, torch.from_numpy(k16.astype(np.float32)),
                         torch.from_numpy(v16.astype(np.float32)), heads, 0.25)
    ty.backward(torch.from_numpy(g))
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(Q.grad().numpy(), tq.grad.numpy(), rtol=2e-5, atol=2e-5)
    Kv = ctx.variable(k16, KT, dtype="f16")
    with pytest.raises(fu.UnsupportedGradient, match="q only"):
        Q.grouped_attention(Kv, V, heads, "hd", 0.25)


def test_bias_is_inference_only(ctx):
    S, T, H, D = 9, 13, 2, 8
    q, k, v, bias = rand(S, H, D), rand(T, H, D), rand(T, H, D), rand(S, T)
    Q, K, V = ctx.tensor(q, QT), ctx.tensor(k, KT), ctx.tensor(v, KT)
    B = ctx.tensor(bias, ("q", "k"))
    y = Q.grouped_attention(K, V, [0, 1], "hd", 0.3, mask="bidirectional", bias=B)
    want = torch_attention(*(torch.from_numpy(a) for a in (q, k, v)), [0, 1], 0.3, causal=False,
                           bias=torch.from_numpy(bias))
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)
    with pytest.raises(fu.UnsupportedGradient, match="inference-only"):
        ctx.variable(q, QT).grouped_attention(K, V, [0, 1], "hd", 0.3, mask="bidirectional", bias=B)
    with fu.no_grad():
        ctx.variable(q, QT).grouped_attention(K, V, [0, 1], "hd", 0.3, mask="bidirectional", bias=B)
    with pytest.raises(fu.InvalidShape, match="bidirectional"):
        Q.grouped_attention(K, V, [0, 1], "hd", 0.3, bias=B)


def test_gradcheck(ctx1):
    S, T, H, KVH, D = 5, 6, 2, 1, 4
    q, k, v = (ctx1.variable(rand(*s).astype(np.float64).astype(np.float32), t)
               for s, t in (((S, H, D), QT), ((T, KVH, D), KT), ((T, KVH, D), KT)))
    w = ctx1.tensor(rand(S, H * D), ("seq", "hd"))
    with ctx1.exec_scope():
        fu.gradcheck(lambda a, b, c: (a.grouped_attention(b, c, [0, 0], "hd", 0.7, window=3) * w).sum_all(),
                     [q, k, v], eps=1e-2, abs_tol=2e-3, rel_tol=2e-2)


def test_gradcheck_batch_axes(ctx1):
    """The batched path's gradients against finite differences (two items, GQA)."""
    B, S, T, H, KVH, D = 2, 3, 4, 2, 1, 4
    q, k, v = (ctx1.variable(rand(*s), ("b",) + t)
               for s, t in (((B, S, H, D), QT), ((B, T, KVH, D), KT), ((B, T, KVH, D), KT)))
    w = ctx1.tensor(rand(B, S, H * D), ("b", "seq", "hd"))
    with ctx1.exec_scope():
        fu.gradcheck(lambda a, b, c: (a.grouped_attention(b, c, [0, 0], "hd", 0.7) * w).sum_all(),
                     [q, k, v], eps=1e-2, abs_tol=2e-3, rel_tol=2e-2)


def test_thread_invariance(ctx1, ctx2, tiny_tiles):
    results = []
    for ctx in (ctx1, ctx2):
        global RNG
        RNG = np.random.default_rng(99)
        results.append(check(ctx, 45, 60, 4, 2, 16))
    for a, b in zip(*results):
        assert_bitwise(a, b)
    results = []
    for ctx in (ctx1, ctx2):
        RNG = np.random.default_rng(7)
        results.append(check(ctx, 300, 700, 4, 2, 32))   # default tiles, online and multi-block
    for a, b in zip(*results):
        assert_bitwise(a, b)


@pytest.mark.parametrize("D", [40, 72, 128])
def test_head_sizes_at_default_tiles(ctx1, ctx2, D):
    """Head sizes with a masked last vector (40, 72) and with several column blocks of the
    micro-tiles (128), causal with a window and bidirectional, at the default tiles: torch's
    values and the same bits at 1 and 2 threads."""
    global RNG
    for kw in ({"window": 37}, {"causal": False}):
        results = []
        for ctx in (ctx1, ctx2):
            RNG = np.random.default_rng(D)
            results.append(check(ctx, 150, 170, 4, 2, D, **kw))
        for a, b in zip(*results):
            assert_bitwise(a, b)


@pytest.mark.parametrize("S,T,H,KVH,D,kw", [(50, 50, 16, 4, 64, {}), (150, 300, 8, 8, 128, {}),
                                            (130, 130, 4, 1, 256, {"window": 45}),
                                            (90, 90, 32, 16, 32, {"causal": False}),
                                            (70, 200, 8, 2, 64, {})])
def test_rows_2k_apart_read_head_major(ctx1, ctx2, monkeypatch, S, T, H, KVH, D, kw):
    """Operands whose rows lie a multiple of 2 KiB apart (16 heads of 64, 8 of 64 or 128,
    Gemma-3's 4 of 256) are read from head-major copies (exa._rows; dq's parts then come
    head-major, one part at T <= 64, two beyond): torch's values, and bitwise the results of
    reading them in place, at 1 and 2 threads."""
    global RNG
    results = []
    for ctx in (ctx1, ctx2):
        RNG = np.random.default_rng(S + H)
        results.append(check(ctx, S, T, H, KVH, D, **kw))
    monkeypatch.setattr(exa, "_rows", lambda ctx, x, heads, D: (x, heads * D, D))
    RNG = np.random.default_rng(S + H)
    results.append(check(ctx1, S, T, H, KVH, D, **kw))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert_bitwise(a, b)


@pytest.mark.parametrize("S,T,causal,window", [(1024, 1024, True, 0), (300, 1000, True, 0),
                                               (500, 500, False, 0), (256, 256, True, 40)])
def test_backward_splits_the_key_tiles_by_work(S, T, causal, window):
    """The backward's two parts of the key tiles carry about equal work (the queries that may
    attend each tile): within one tile's work of half the total."""
    geo = exa.Geometry(S, 4, 64, T, 2, causal, window)
    parts, split = exa._split(geo)
    nkt = -(-T // exa.BK)
    work = [np.subtract(*geo.queries(t * exa.BK, min(exa.BK, T - t * exa.BK))[::-1])
            for t in range(nkt)]
    assert parts == 2 and 0 < split < nkt
    assert abs(sum(work[:split]) - sum(work) / 2) <= max(work)
    assert exa._split(exa.Geometry(8, 4, 64, exa.BK, 2, True, 0)) == (1, 1)


def test_bad_input(ctx):
    q = ctx.tensor(rand(4, 2, 8), QT)
    k = ctx.tensor(rand(6, 1, 8), KT)
    v = ctx.tensor(rand(6, 1, 8), KT)
    with pytest.raises(fu.TagError, match="expected q tagged"):
        ctx.tensor(rand(4, 2, 8), ("s", "head", "d")).grouped_attention(k, v, [0, 0], "o", 1.0)
    with pytest.raises(fu.TagError, match="expected k tagged"):
        q.grouped_attention(ctx.tensor(rand(6, 1, 8), ("seq", "kvh", "d")), v, [0, 0], "o", 1.0)
    with pytest.raises(fu.ShapeMismatch, match="head dim 8"):
        q.grouped_attention(ctx.tensor(rand(6, 1, 4), KT), v, [0, 0], "o", 1.0)
    with pytest.raises(fu.ShapeMismatch, match="v of k's shape"):
        q.grouped_attention(k, ctx.tensor(rand(5, 1, 8), KT), [0, 0], "o", 1.0)
    with pytest.raises(fu.InvalidDataLength, match="expected 2 entries"):
        q.grouped_attention(k, v, [0], "o", 1.0)
    with pytest.raises(fu.IndexOutOfBounds, match=r"kv_head_for_head\[1\]"):
        q.grouped_attention(k, v, [0, 1], "o", 1.0)
    with pytest.raises(fu.ShapeMismatch, match="kv seq >= q seq"):
        q.grouped_attention(ctx.tensor(rand(3, 1, 8), KT), ctx.tensor(rand(3, 1, 8), KT), [0, 0], "o", 1.0)
    with pytest.raises(fu.InvalidShape, match="window"):
        q.grouped_attention(k, v, [0, 0], "o", 1.0, mask="bidirectional", window=2)
    with pytest.raises(ValueError, match="mask"):
        q.grouped_attention(k, v, [0, 0], "o", 1.0, mask="full")
    with pytest.raises(TypeError):
        q.grouped_attention(k, v, [0, 0], "o", 1.0, lens=[4])
    with pytest.raises(fu.DTypeError, match="q of dtype f32"):
        ctx.tensor(rand(4, 2, 8), QT, dtype="f16").grouped_attention(k, v, [0, 0], "o", 1.0)
    with pytest.raises(fu.ShapeMismatch, match="bias of shape"):
        q.grouped_attention(k, v, [0, 0], "o", 1.0, mask="bidirectional",
                            bias=ctx.tensor(rand(4, 5), ("a", "b")))


@pytest.mark.parametrize("T,H,KVH,D,window,kv", [(1, 2, 1, 8, 0, "f32"), (57, 9, 3, 64, 0, "f32"),
                                                 (700, 4, 1, 256, 512, "f32"),
                                                 (33, 6, 2, 48, 0, "f16"), (40, 4, 4, 17, 7, "f16")])
def test_one_query_decode_kernel(ctx1, ctx2, T, H, KVH, D, window, kv):
    """A single query without gradients (a decode step) runs the one-launch decode kernel:
    torch's values, the same bits at 1 and 2 threads."""
    heads = [h // (H // KVH) for h in range(H)]
    q, k, v = rand(1, H, D), rand(T, KVH, D), rand(T, KVH, D)
    if kv == "f16":
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    outs = []
    for c in (ctx1, ctx2):
        with fu.no_grad():
            y = c.tensor(q, QT).grouped_attention(c.tensor(k, KT, dtype=kv), c.tensor(v, KT, dtype=kv),
                                                  heads, "hd", scale, window=window)
        outs.append(y.numpy())
    want = torch_attention(*(torch.tensor(a) for a in (q, k, v)), heads, scale, True, window)
    np.testing.assert_allclose(outs[0], want.numpy(), rtol=2e-5, atol=2e-5)
    assert_bitwise(outs[0], outs[1])


@pytest.mark.parametrize("T,window,kv", [(57, 0, "f32"), (64, 0, "f16"), (700, 512, "f32"),
                                         (5, 0, "f32")])
def test_decode_kernel_fixed_shape_gives_the_generic_bits(ctx1, T, window, kv):
    """The decode kernel built for the model's head size and cache row (constant offsets,
    unrolled d) and the one that takes them as arguments give the same bits."""
    from fucina.codegen import kernels
    from fucina.codegen.attention import AttentionKey
    H, KVH, D = 9, 3, 64
    q = ctx1.tensor(rand(1, H, D), QT)._raw
    k, v = (ctx1.tensor(rand(T, KVH, D), KT, dtype=kv)._raw for _ in range(2))
    outs = []
    for d, row in ((0, 0), (D, KVH * D)):
        out = ctx1.tensor(np.zeros((1, H * D), np.float32), ("s", "hd"))._raw
        lse = ctx1.tensor(np.zeros((H, 1), np.float32), ("h", "s"))._raw
        ctx1.launch(kernels.get(AttentionKey("decode", kv=kv, d=d, row=row)), H, 0, q.addr,
                    k.addr, v.addr, out.addr, lse.addr, T, window, H // KVH, D,
                    int(np.float32(0.125).view(np.uint32)), KVH * D)
        outs.append((fu.Tensor(out, ("s", "hd")).numpy(), fu.Tensor(lse, ("h", "s")).numpy()))
    assert_bitwise(outs[0][0], outs[1][0])
    assert_bitwise(outs[0][1], outs[1][1])


@pytest.mark.parametrize("lead,heads,window,kv", [((3,), None, 0, "f32"), ((2, 2), None, 3, "f32"),
                                                  ((2,), [1, 0, 1, 0], 0, "f32"),
                                                  ((2,), None, 0, "f16")])
def test_batch_axes(ctx, lead, heads, window, kv):
    """Leading batch axes: each item is attended on its own (torch on every item, gradients
    included), and the result is bitwise the item run alone."""
    S, T, H, KVH, D = 6, 9, 4, 2, 8
    heads = heads or [h // (H // KVH) for h in range(H)]
    names = tuple(f"b{i}" for i in range(len(lead)))
    q, k, v = rand(*lead, S, H, D), rand(*lead, T, KVH, D), rand(*lead, T, KVH, D)
    if kv == "f16":
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    g = rand(*lead, S, H * D)
    scale = 0.3
    Q = ctx.variable(q, names + QT)
    K = (ctx.variable(k, names + KT) if kv == "f32" else ctx.tensor(k, names + KT, dtype=kv))
    V = (ctx.variable(v, names + KT) if kv == "f32" else ctx.tensor(v, names + KT, dtype=kv))
    y = Q.grouped_attention(K, V, heads, "hd", scale, window=window)
    assert y.tags == names + ("seq", "hd") and y.shape == (*lead, S, H * D)
    y.backward(grad=ctx.tensor(g, names + ("seq", "hd")))
    flat = int(np.prod(lead))
    for i in range(flat):
        at = np.unravel_index(i, lead)
        tq, tk, tv = (torch.tensor(a[at], requires_grad=True) for a in (q, k, v))
        ty = torch_attention(tq, tk, tv, heads, scale, True, window)
        ty.backward(torch.from_numpy(g[at]))
        np.testing.assert_allclose(y.numpy()[at], ty.detach().numpy(), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(Q.grad().numpy()[at], tq.grad.numpy(), rtol=2e-5, atol=2e-5)
        if kv == "f32":
            for mine, theirs in ((K, tk), (V, tv)):
                np.testing.assert_allclose(mine.grad().numpy()[at], theirs.grad.numpy(),
                                           rtol=2e-5, atol=2e-5)
        with fu.no_grad():
            alone = ctx.tensor(q[at], QT).grouped_attention(
                ctx.tensor(k[at], KT, dtype=kv), ctx.tensor(v[at], KT, dtype=kv), heads, "hd",
                scale, window=window)
        assert_bitwise(y.numpy()[at], alone.numpy())


def test_batch_axes_bad_input(ctx):
    q = ctx.tensor(rand(2, 3, 4, 8), ("b",) + QT)
    k = ctx.tensor(rand(2, 5, 2, 8), ("b",) + KT)
    with pytest.raises(fu.TagError, match="q's leading axes"):
        q.grouped_attention(ctx.tensor(rand(5, 2, 8), KT), k, [0, 0, 1, 1], "o", 0.1)
    with pytest.raises(fu.ShapeMismatch, match="leading axes"):
        q.grouped_attention(ctx.tensor(rand(3, 5, 2, 8), ("b",) + KT), k, [0, 0, 1, 1], "o", 0.1)
    with pytest.raises(fu.InvalidShape, match="bias takes no batch axes"):
        q.grouped_attention(k, k, [0, 0, 1, 1], "o", 0.1, mask="bidirectional",
                            bias=ctx.tensor(rand(3, 5), ("seq", "kv")))
