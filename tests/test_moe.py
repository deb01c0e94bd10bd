"""The routed MoE expert FFN (SPEC §3.17): moe_expert_ffn / moe_expert_ffn_batch against a torch
loop over experts (float64), for f32 and f16 expert stacks and every gated activation; the two
stack geometries; one token equals the batch row bitwise; router_top_k feeding it; bad input;
bitwise thread invariance."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fucina as fu

RNG = np.random.default_rng(17)
ACTS = ["glu", "swiglu", "geglu", "situ", "swiglu_clamp10"]


def rand(shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def torch_act(act, up, g):
    if act == "glu":
        return up * torch.sigmoid(g)
    if act == "swiglu":
        return up * F.silu(g)
    if act == "geglu":
        return up * F.gelu(g, approximate="tanh")
    if act == "situ":
        return 25 * torch.tanh(up * 0.04) * (4 * torch.tanh(g * 0.25) * torch.sigmoid(g))
    return up.clamp(-10, 10) * F.silu(g.clamp(max=10))


def torch_moe(x, wg, wu, wd, selected, weights, top_k, act):
    """The loop over experts, in float64: y_t = sum_s w · down_e(act(gate_e x_t, up_e x_t))."""
    x = torch.from_numpy(x).double()
    wg, wu, wd = (torch.from_numpy(w.astype(np.float64)) for w in (wg, wu, wd))
    sel = torch.tensor(selected).view(-1, top_k)
    w = torch.tensor(np.asarray(weights, np.float64)).view(-1, top_k)
    y = torch.zeros_like(x)
    for e in sel.unique().tolist():
        tok, slot = (sel == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = torch_act(act, xe @ wu[e].T, xe @ wg[e].T)
        y.index_add_(0, tok, (h @ wd[e].T) * w[tok, slot, None])
    return y.numpy()


def experts(E, Fd, H, dtype="f32", scale=0.2):
    ws = [rand((E, Fd, H), scale), rand((E, Fd, H), scale), rand((E, H, Fd), scale)]
    if dtype == "f16":
        ws = [w.astype(np.float16).astype(np.float32) for w in ws]  # what the f16 stack holds
    return ws


def stacks(ctx, ws, dtype="f32"):
    return [ctx.tensor(w, ("e", "o", "i"), dtype=dtype) for w in ws]


def close(got, want, k):
    """SPEC §0.5 contraction tolerance: |Δ| <= 1e-5 · k (k the longest contraction)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * k)


# ---------------------------------------------------------------------------------------------
# against torch

@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("act", ACTS)
def test_batch_against_torch(ctx, dtype, act):
    E, Fd, H, T, K = 6, 40, 37, 9, 3
    ws = experts(E, Fd, H, dtype)
    x = rand((T, H))
    selected = RNG.integers(0, E, T * K).tolist()
    weights = rand(T * K).tolist()
    y = fu.moe_expert_ffn_batch(ctx.tensor(x, ("t", "d")), *stacks(ctx, ws, dtype), selected,
                                weights, K, Fd, act)
    assert y.tags == ("t", "d") and y.dtype == "f32" and not y.requires_grad
    close(y.numpy(), torch_moe(x, *ws, selected, weights, K, act), max(H, Fd))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_single_token_against_torch(ctx, dtype):
    E, Fd, H, K = 8, 48, 64, 3
    ws = experts(E, Fd, H, dtype)
    x = rand((1, H))
    selected, weights = [5, 0, 5], [0.5, 0.25, -1.5]  # an expert may appear twice
    y = fu.moe_expert_ffn(ctx.tensor(x, ("t", "d")), *stacks(ctx, ws, dtype), selected, weights,
                          Fd, "swiglu")
    assert y.shape == (1, H)
    close(y.numpy(), torch_moe(x, *ws, selected, weights, K, "swiglu"), max(H, Fd))
    y1 = fu.moe_expert_ffn(ctx.tensor(x[0], ("d",)), *stacks(ctx, ws, dtype), selected, weights,
                           Fd, "swiglu")
    assert y1.tags == ("d",) and y1.numpy().tobytes() == y.numpy()[0].tobytes()


def test_many_tokens_per_expert(ctx):
    """Few experts, many tokens: expert groups of 4 tokens at a time plus a remainder."""
    E, Fd, H, T, K = 3, 33, 50, 23, 2
    ws = experts(E, Fd, H)
    x = rand((T, H))
    selected = RNG.integers(0, E, T * K).tolist()
    weights = rand(T * K).tolist()
    y = fu.moe_expert_ffn_batch(ctx.tensor(x, ("t", "d")), *stacks(ctx, ws), selected, weights,
                                K, Fd, "geglu")
    close(y.numpy(), torch_moe(x, *ws, selected, weights, K, "geglu"), max(H, Fd))


def test_router_feeds_moe(ctx):
    E, Fd, H, T, K = 16, 32, 48, 6, 4
    ws = experts(E, Fd, H)
    x = rand((T, H))
    logits = ((RNG.permutation(T * E) - T * E / 2) * 0.05).astype(np.float32).reshape(T, E)  # no ties
    selected, weights = [0] * (T * K), [0.0] * (T * K)
    ctx.tensor(logits, ("t", "e")).router_top_k("e", K, selected, weights)
    y = fu.moe_expert_ffn_batch(ctx.tensor(x, ("t", "d")), *stacks(ctx, ws), selected, weights,
                                K, Fd, "swiglu")
    p = torch.softmax(torch.from_numpy(logits).double(), 1)
    tw, ti = p.topk(K, dim=1)
    tw = tw / tw.sum(1, keepdim=True)
    want = torch_moe(x, *ws, ti.reshape(-1).tolist(), tw.reshape(-1).numpy(), K, "swiglu")
    close(y.numpy(), want, max(H, Fd))


# ---------------------------------------------------------------------------------------------
# geometry and consistency

def test_stacked_rank2_geometry_is_the_same(ctx):
    E, Fd, H, T, K = 5, 24, 40, 4, 2
    ws = experts(E, Fd, H)
    x = ctx.tensor(rand((T, H)), ("t", "d"))
    selected = RNG.integers(0, E, T * K).tolist()
    weights = rand(T * K).tolist()
    y3 = fu.moe_expert_ffn_batch(x, *stacks(ctx, ws), selected, weights, K, Fd, "swiglu")
    g2 = ctx.tensor(ws[0].reshape(E * Fd, H), ("r", "i"))
    u2 = ctx.tensor(ws[1].reshape(E * Fd, H), ("r", "i"))
    d2 = ctx.tensor(ws[2].reshape(E * H, Fd), ("r", "i"))
    y2 = fu.moe_expert_ffn_batch(x, g2, u2, d2, selected, weights, K, Fd, "swiglu")
    assert y2.numpy().tobytes() == y3.numpy().tobytes()


def test_one_token_equals_its_batch_row(ctx):
    E, Fd, H, T, K = 7, 40, 36, 10, 3
    ws = stacks(ctx, experts(E, Fd, H))
    x = rand((T, H))
    selected = RNG.integers(0, E, T * K).tolist()
    weights = rand(T * K).tolist()
    y = fu.moe_expert_ffn_batch(ctx.tensor(x, ("t", "d")), *ws, selected, weights, K, Fd, "situ").numpy()
    for t in range(T):
        yt = fu.moe_expert_ffn(ctx.tensor(x[t:t + 1], ("t", "d")), *ws, selected[t * K:(t + 1) * K],
                               weights[t * K:(t + 1) * K], Fd, "situ")
        assert yt.numpy().tobytes() == y[t:t + 1].tobytes()


def test_mixed_dtypes_and_numpy_routes(ctx):
    """f16 gate/up with an f32 down; routes as numpy arrays."""
    E, Fd, H, T, K = 4, 20, 30, 3, 2
    g, u, d = experts(E, Fd, H, "f16")
    d = rand((E, H, Fd), 0.2)
    x = rand((T, H))
    selected = RNG.integers(0, E, T * K)
    weights = rand(T * K)
    y = fu.moe_expert_ffn_batch(ctx.tensor(x, ("t", "d")), ctx.tensor(g, ("e", "o", "i"), dtype="f16"),
                                ctx.tensor(u, ("e", "o", "i"), dtype="f16"), ctx.tensor(d, ("e", "o", "i")),
                                selected, weights, K, Fd, "glu")
    close(y.numpy(), torch_moe(x, g, u, d, selected.tolist(), weights, K, "glu"), max(H, Fd))


def test_profile_and_no_grad_variables(ctx):
    E, Fd, H, T, K = 4, 16, 16, 5, 2
    ws = experts(E, Fd, H)
    vs = [ctx.variable(w, ("e", "o", "i")) for w in ws]
    x = ctx.tensor(rand((T, H)), ("t", "d"))
    selected = [0, 1, 1, 2, 0, 0, 3, 1, 2, 2]
    prof = {}
    with fu.no_grad():
        y = fu.moe_expert_ffn_batch(x, *vs, selected, [1.0] * 10, K, Fd, "swiglu", profile=prof)
    assert prof["pairs"] == 10 and prof["active_experts"] == 4 and prof["max_expert_m"] == 3
    assert prof["tokens"] == 5 and prof["total_ns"] >= prof["gate_up_ns"] + prof["down_ns"] > 0
    close(y.numpy(), torch_moe(x.numpy(), *ws, selected, [1.0] * 10, K, "swiglu"), 16)


def test_scope_borrow(ctx):
    ws = stacks(ctx, experts(2, 8, 8))
    x = ctx.tensor(rand((1, 8)), ("t", "d"))
    with ctx.exec_scope():
        y = fu.moe_expert_ffn(x, *ws, [1], [1.0], 8, "swiglu")
        assert y.scope_owned
    with pytest.raises(fu.UseAfterRelease):
        y.numpy()


# ---------------------------------------------------------------------------------------------
# bad input

def test_errors(ctx):
    E, Fd, H = 3, 8, 6
    g, u, d = stacks(ctx, experts(E, Fd, H))
    x = ctx.tensor(rand((2, H)), ("t", "d"))
    ok = dict(selected=[0, 1, 2, 0], weights=[1.0] * 4)

    def batch(x=x, g=g, u=u, d=d, selected=ok["selected"], weights=ok["weights"], top_k=2, out_pe=Fd,
              act="swiglu", **kw):
        return fu.moe_expert_ffn_batch(x, g, u, d, selected, weights, top_k, out_pe, act, **kw)

    batch()
    with pytest.raises(fu.UnsupportedGradient, match="moe_expert_ffn_batch: inference-only"):
        batch(x=ctx.variable(rand((2, H)), ("t", "d")))
    with pytest.raises(fu.UnsupportedGradient):
        batch(g=ctx.variable(rand((E, Fd, H)), ("e", "o", "i")))
    with pytest.raises(fu.InvalidDataLength, match="expected 4 selected experts and 4 weights"):
        batch(selected=[0, 1, 2])
    with pytest.raises(fu.InvalidDataLength):
        batch(weights=[1.0] * 5)
    with pytest.raises(fu.IndexOutOfBounds, match=r"\[0, 3\), got 3"):
        batch(selected=[0, 1, 3, 0])
    with pytest.raises(fu.IndexOutOfBounds):
        batch(selected=[0, -1, 2, 0])
    with pytest.raises(TypeError, match="selected"):
        batch(selected=[0.0, 1.0, 2.0, 0.0])
    with pytest.raises(fu.InvalidShape, match="out_pe >= 1"):
        batch(out_pe=0)
    with pytest.raises(fu.InvalidShape, match="top_k >= 1"):
        batch(top_k=0)
    with pytest.raises(fu.ShapeMismatch, match=r"gate: expected \[experts, 4, 6\]"):
        batch(out_pe=4)
    with pytest.raises(fu.ShapeMismatch, match="gate"):
        batch(x=ctx.tensor(rand((2, H + 1)), ("t", "d")))
    with pytest.raises(fu.ShapeMismatch, match="up"):
        batch(u=ctx.tensor(rand((E + 1, Fd, H)), ("e", "o", "i")))
    with pytest.raises(fu.ShapeMismatch, match="down"):
        batch(d=ctx.tensor(rand((E, H, Fd + 1)), ("e", "o", "i")))
    with pytest.raises(fu.ShapeMismatch, match="down: expected 3 experts"):
        batch(d=ctx.tensor(rand((E + 1, H, Fd)), ("e", "o", "i")))
    with pytest.raises(fu.ShapeMismatch, match="rank-2 or rank-3"):
        batch(g=ctx.tensor(rand((E * Fd * H,)), ("r",)))
    with pytest.raises(fu.ShapeMismatch, match=r"expected \[tokens, hidden\]"):
        batch(x=ctx.tensor(rand((H,)), ("d",)))
    with pytest.raises(fu.DTypeError, match="f32 or f16 expert weights, got bf16"):
        batch(g=ctx.tensor(rand((E, Fd, H)), ("e", "o", "i"), dtype="bf16"))
    with pytest.raises(fu.ShapeMismatch, match="up: expected gate's shape"):
        batch(u=ctx.tensor(rand((E, Fd, H)), ("e", "o", "i"), dtype="f16"))
    with pytest.raises(fu.DTypeError, match="x: expected f32"):
        batch(x=ctx.tensor(rand((2, H)), ("t", "d"), dtype="f16"))
    with pytest.raises(fu.InvalidShape, match="contiguous expert stack"):
        batch(d=ctx.tensor(rand((E, Fd, H)), ("e", "i", "o")).permute(("e", "o", "i")))
    with pytest.raises(ValueError, match="act"):
        batch(act="relu")
    with pytest.raises(TypeError, match="profile"):
        batch(profile=[])
    with pytest.raises(TypeError):
        batch(bogus=1)
    with pytest.raises(fu.ShapeMismatch, match="one token"):
        fu.moe_expert_ffn(x, g, u, d, [0, 1], [1.0, 1.0], Fd, "swiglu")
    with pytest.raises(fu.InvalidDataLength):
        fu.moe_expert_ffn(ctx.tensor(rand((1, H)), ("t", "d")), g, u, d, [], [], Fd, "swiglu")
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(fu.ContextMismatch):
            batch(g=other.tensor(rand((E, Fd, H)), ("e", "o", "i")))
    finally:
        other.close()


# ---------------------------------------------------------------------------------------------
# determinism

def test_bitwise_thread_invariance(ctx1, ctx2):
    E, Fd, H, T, K = 8, 96, 64, 16, 4
    ws = experts(E, Fd, H)
    x = rand((T, H))
    selected = RNG.integers(0, E, T * K).tolist()
    weights = rand(T * K).tolist()
    out = []
    for c in (ctx1, ctx2):
        xs = c.tensor(x, ("t", "d"))
        out.append([fu.moe_expert_ffn_batch(xs, *stacks(c, ws), selected, weights, K, Fd, "swiglu").numpy(),
                    fu.moe_expert_ffn(c.tensor(x[:1], ("t", "d")), *stacks(c, ws, "f16"), selected[:K],
                                      weights[:K], Fd, "geglu").numpy()])
    for p, q in zip(*out):
        assert p.tobytes() == q.tobytes()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "tq2_0"])
@pytest.mark.parametrize("rank2", [False, True])
def test_quantized_stacks_are_the_dequantized_f32_path(ctx, fmt, rank2):
    """SPEC §3.17's quantized arms (dense-dequantized reference semantics): bitwise the f32
    path on the decoded weights; only routed experts are decoded."""
    E, Fd, H, T, K = 5, 256, 256, 3, 2
    ws = [rand((E, Fd, H), 0.05), rand((E, Fd, H), 0.05), rand((E, H, Fd), 0.05)]
    q = [ctx.tensor(w, ("e", "o", "i")).to(fmt) for w in ws]
    deq = [t.to("f32") for t in q]
    if rank2:
        q = [ctx.tensor(w.reshape(-1, w.shape[-1]), ("eo", "i")).to(fmt) for w in ws]
    x = ctx.tensor(rand((T, H)), ("t", "h"))
    sel, wts = [4, 1, 1, 2, 4, 4], [0.7, 0.3, 0.5, 0.5, 0.9, 0.1]
    got = fu.moe_expert_ffn_batch(x, *q, sel, wts, K, Fd, "swiglu").numpy()
    want = fu.moe_expert_ffn_batch(x, *deq, sel, wts, K, Fd, "swiglu").numpy()
    np.testing.assert_array_equal(got, want)
    one = fu.moe_expert_ffn(ctx.tensor(rand((1, H)), ("t", "h")), *q, [3], [1.0], Fd, "glu")
    assert one.shape == (1, H)
    with pytest.raises(fu.IndexOutOfBounds):
        fu.moe_expert_ffn_batch(x, *q, [5, 1, 1, 2, 4, 4], wts, K, Fd, "swiglu")
    with pytest.raises(fu.DTypeError, match="block-quantized"):
        fu.moe_expert_ffn_batch(x, q[0], deq[1], q[2], sel, wts, K, Fd, "swiglu")
