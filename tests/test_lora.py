"""fu.lora (SPEC T-20): init against the RNG-10 transcription, delta/apply and their gradients
against a torch replica (x·Aᵀ·Bᵀ·scale; with dropout, the mask of test_rng's RNG-8 oracle),
fu.gradcheck, thread invariance, registration and state-dict names, merging, every error, and a
short AdamW run that fits a low-rank correction of a frozen layer."""
import io
import math

import numpy as np
import pytest
import safetensors.numpy
import torch

import fucina as fu
from conftest import assert_bitwise
from test_rng import keep_mask, uniform_oracle

L = fu.lora
f32 = np.float32
RNG = np.random.default_rng(20)


def randn(*shape, s=1.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


def make(ctx, in_dim=16, out_dim=12, rank=3, alpha=5.0, p=0.0, seed=42, fill_b=True, tags=("in", "out")):
    ad = L.Adapter(*tags).init(ctx, in_dim, out_dim, L.LoraConfig(rank, alpha, p), seed)
    if fill_b:   # B starts at zero; a trained-looking B makes every check meaningful
        fu.rng.uniform_fill(seed + 1, ad.b, -0.5, 0.5)
    return ad


def torch_delta(x, a, b, scale, mask=None, p=0.0):
    """The replica: (dropout(x) @ Aᵀ @ Bᵀ)·scale, dropout as our kept-mask times 1/(1-p) in f32."""
    xt = torch.tensor(x, requires_grad=True)
    at = torch.tensor(a, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    d = xt if mask is None else xt * torch.tensor(mask.astype(np.float32)) * float(f32(1) / (f32(1) - f32(p)))
    y = (d @ at.T) @ bt.T * scale
    return xt, at, bt, y


# ---------------------------------------------------------------------------------------------
# acceptance and init

def test_acceptance(ctx):
    """T-20: adapter(8→4, rank 2, alpha 4, seed 42): apply at init equals base bitwise; after
    filling B, merge_into then a plain dot matches apply to 1e-4."""
    ad = L.Adapter("in", "out").init(ctx, 8, 4, L.LoraConfig(rank=2, alpha=4.0), seed=42)
    x = ctx.tensor(randn(5, 8), ("seq", "in"))
    w = ctx.tensor(randn(4, 8), ("out", "in"))
    with fu.no_grad():
        base = x.dot(w, "in")
        assert_bitwise(ad.apply(x, base).numpy(), base.numpy())
        assert_bitwise(ad.delta(x).numpy(), np.zeros((5, 4), np.float32))
    fu.rng.uniform_fill(7, ad.b, -1.0, 1.0)
    with ctx.exec_scope():
        y = ad.apply(x, x.dot(w, "in")).numpy()
    ad.merge_into(w)
    merged = x.dot(w, "in").numpy()
    np.testing.assert_allclose(merged, y, rtol=0, atol=1e-4)
    assert np.abs(y - base.numpy()).max() > 0.1   # the adapter really changed the output


def test_init_matches_rng10(ctx):
    with ctx.exec_scope():   # A/B are caller-owned even when created inside a scope
        ad = L.Adapter("embed", "q").init(ctx, 300, 40, L.LoraConfig(rank=5, alpha=0.3, dropout_p=0.125), 777)
    bound = f32(math.sqrt(1.0 / 300))   # RNG-10: fan_in = in_dim
    want, _ = uniform_oracle(777, 5 * 300, -bound, bound)
    assert_bitwise(ad.a.numpy(), want.reshape(5, 300))
    assert_bitwise(ad.b.numpy(), np.zeros((40, 5), np.float32))
    assert ad.a.tags == (L.RANK_TAG, "embed") and ad.b.tags == ("q", "lora_r") and L.RANK_TAG == "lora_r"
    assert ad.a.requires_grad and ad.b.requires_grad
    assert not ad.a.scope_owned and not ad.b.scope_owned
    assert ad.scale == float(f32(0.3) / f32(5)) and ad.dropout_p == 0.125
    assert (ad.rank, ad.in_dim, ad.out_dim) == (5, 300, 40)
    again = L.Adapter("embed", "q").init(ctx, 300, 40, L.LoraConfig(5, 0.3), 777)
    assert_bitwise(again.a.numpy(), ad.a.numpy())   # same seed, same A
    other = ad.init(ctx, 300, 40, L.LoraConfig(5, 0.3), 778)   # a template makes any number
    assert other is not ad and not np.array_equal(other.a.numpy(), ad.a.numpy())
    assert "no weights" in repr(L.Adapter("a", "b")) and "scale=" in repr(ad)


def test_torch_kaiming_bound():
    """RNG-10 is torch's kaiming_uniform_(a=√5) bound: gain √(2/(1+5)), bound gain·√(3/fan_in)."""
    t = torch.empty(4, 300)
    torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    assert t.abs().max().item() <= float(f32(math.sqrt(1.0 / 300)))
    assert math.isclose(math.sqrt(2 / 6) * math.sqrt(3 / 300), math.sqrt(1 / 300))


# ---------------------------------------------------------------------------------------------
# forward and gradients

@pytest.mark.parametrize("x_tags,x_shape", [(("seq", "in"), (7, 16)), (("in", "seq"), (16, 7)),
                                            (("batch", "seq", "in"), (2, 3, 16))])
def test_delta_and_grads_vs_torch(ctx, x_tags, x_shape):
    ad = make(ctx)
    x_np = randn(*x_shape)
    x = ctx.variable(x_np, x_tags)
    with ctx.exec_scope():
        y = ad.delta(x)
        assert y.tags == tuple(t for t in x_tags if t != "in") + ("out",)
        g_np = randn(*y.shape)
        y.backward(grad=ctx.tensor(g_np, y.tags))
        y_np = y.numpy()
    x_rows = np.moveaxis(x_np, x_tags.index("in"), -1)   # torch's layout: features last
    xt, at, bt, yt = torch_delta(x_rows, ad.a.numpy(), ad.b.numpy(), ad.scale)
    yt.backward(torch.tensor(g_np))
    np.testing.assert_allclose(y_np, yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ad.a.grad().numpy(), at.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ad.b.grad().numpy(), bt.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad().numpy(), np.moveaxis(xt.grad.numpy(), -1, x_tags.index("in")),
                               rtol=1e-5, atol=1e-6)


def test_apply_with_dropout_vs_torch(ctx):
    ad = make(ctx, p=0.25)
    x_np, w_np = randn(9, 16), randn(12, 16)
    x, w = ctx.variable(x_np, ("seq", "in")), ctx.tensor(w_np, ("out", "in"))
    seed = 1234
    with ctx.exec_scope():
        y = ad.apply(x, x.dot(w, "in"), dropout_seed=seed)
        g_np = randn(*y.shape)
        y.backward(grad=ctx.tensor(g_np, y.tags))
        y_np = y.numpy()
    mask = keep_mask(seed, x_np.size, 0.25).reshape(x_np.shape)
    assert 0 < mask.sum() < mask.size
    xt, at, bt, dt = torch_delta(x_np, ad.a.numpy(), ad.b.numpy(), ad.scale, mask, 0.25)
    yt = xt @ torch.tensor(w_np).T + dt
    yt.backward(torch.tensor(g_np))
    np.testing.assert_allclose(y_np, yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, want in ((ad.a, at), (ad.b, bt), (x, xt)):
        np.testing.assert_allclose(got.grad().numpy(), want.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_apply_is_bitwise_base_add_delta(ctx, p):
    """apply runs base + scale·(x·Aᵀ·Bᵀ) in one pass (no scaled copy): the result and every
    gradient (x, A, B, a variable base) keep the bits of SPEC T-20's chain base.add(delta) —
    scale 5/3 is not a power of two, so a fused multiply-add would show."""
    ad = make(ctx, p=p)
    x_np, b_np, g_np = randn(9, 16), randn(9, 12), randn(9, 12)
    outs = []
    for fused in (True, False):
        x, base = ctx.variable(x_np, ("seq", "in")), ctx.variable(b_np, ("seq", "out"))
        with ctx.exec_scope():
            y = (ad.apply(x, base, dropout_seed=7) if fused else
                 base.add(ad.delta(x, dropout_seed=7)))
            y.backward(grad=ctx.tensor(g_np, y.tags))
            outs.append([y.numpy(), x.grad().numpy(), base.grad().numpy(),
                         ad.a.grad().numpy(), ad.b.grad().numpy()])
        ad.a.zero_grad()
        ad.b.zero_grad()
    for got, want in zip(*outs):
        assert_bitwise(got, want)
    y = b_np + (np.float32(ad.scale) * (x_np @ ad.a.numpy().T @ ad.b.numpy().T)).astype(f32)
    if p == 0.0:
        np.testing.assert_allclose(outs[0][0], y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_apply_reuse_base_writes_the_sum_over_base(ctx, p):
    """apply(reuse_base=True) adds the scaled product into base's own buffer as the GEMM stores
    it, and x's LoRA gradient into the one its frozen projection left (engine.Node.into): the
    result and every gradient keep the bits of the chain base.add(delta). A base something else
    views, or a variable, is left alone (the plain ops)."""
    ad = make(ctx, p=p)
    x_np, w_np, g_np = randn(9, 16), randn(12, 16), randn(9, 12)
    w = ctx.tensor(w_np, ("out", "in"))
    outs = []
    for mode in ("reuse", "viewed", "chain"):
        x = ctx.variable(x_np, ("seq", "in"))
        with ctx.exec_scope():
            base = x.dot(w, "in")
            before = base.numpy()
            if mode == "chain":
                y = base.add(ad.delta(x, dropout_seed=7))
            else:
                other = base.reshape(("n",), (9 * 12,)) if mode == "viewed" else None
                y = ad.apply(x, base, dropout_seed=7, reuse_base=True)
                assert (y._raw.buf is base._raw.buf) == (mode == "reuse")
                if other is not None:
                    assert_bitwise(other.numpy().reshape(9, 12), before)
            y.backward(grad=ctx.tensor(g_np, y.tags))
            outs.append([y.numpy(), x.grad().numpy(), ad.a.grad().numpy(),
                         ad.b.grad().numpy()])
        ad.a.zero_grad()
        ad.b.zero_grad()
    for got in outs[:2]:
        for g, want in zip(got, outs[2]):
            assert_bitwise(g, want)
    bv = ctx.variable(randn(9, 12), ("seq", "out"))
    x = ctx.variable(x_np, ("seq", "in"))
    with ctx.exec_scope():
        before = bv.numpy()
        y = ad.apply(x, bv, dropout_seed=7, reuse_base=True)
        assert y._raw.buf is not bv._raw.buf
        assert_bitwise(bv.numpy(), before)


def _project_is_the_chain(ctx, ad, w, x_np, g_np, compute="f32", other=True):
    """project (one lora_linear node) against the dot (dot_bf16 with compute="bf16") then
    apply(reuse_base=True), on h = x/2 (with `other`, h has a second consumer, so its
    gradient has two parts): the output and the gradients of x, A and B, bitwise."""
    outs = []
    for fused in (True, False):
        x = ctx.variable(x_np, ("seq", "in"))
        with ctx.exec_scope():
            h = x.scale(0.5)
            if fused:
                y = ad.project(h, w, compute=compute)
            else:
                base = h.dot_bf16(w, "in") if compute == "bf16" else h.dot(w, "in")
                y = ad.apply(h, base, reuse_base=True)
            assert (y._node.name == "lora_linear") == fused
            loss = (y * ctx.tensor(g_np, y.tags)).sum_all()
            if other:
                loss = loss.add((h * ctx.tensor(x_np, h.tags)).sum_all())
            loss.backward()
            outs.append([y.numpy(), x.grad().numpy(), ad.a.grad().numpy(),
                         ad.b.grad().numpy()])
        ad.a.zero_grad()
        ad.b.zero_grad()
    for got, want in zip(*outs):
        assert_bitwise(got, want)


@pytest.mark.parametrize("M,K,N", [(200, 600, 500), (300, 600, 500), (9, 16, 12)],
                         ids=["direct-b", "packed", "rowvec"])
def test_project_is_the_dot_then_apply_bitwise(M, K, N):
    """project(x, w) adds the rank product in the projection's own GEMM and dxa·A in the tile
    stores of dx = g·w (one lora_linear node): its output and the gradients of x (on top of
    another consumer's), A and B keep the bits of x.dot(w) then apply(reuse_base=True), at 1
    and 2 threads, on tile-kernel shapes and on a small one (the pass after the GEMM). With
    dropout, an f16 weight, a weight that trains or x's in tag not last it is those two ops."""
    x_np, w_np, g_np = randn(M, K), randn(N, K, s=0.05), randn(M, N)
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            ad = make(ctx, in_dim=K, out_dim=N, rank=8, alpha=16.0)
            _project_is_the_chain(ctx, ad, ctx.tensor(w_np, ("out", "in")), x_np, g_np)
    with fu.ExecContext(threads=1) as ctx:
        ad = make(ctx, in_dim=16, out_dim=12, rank=3, p=0.25)
        x = ctx.variable(randn(9, 16), ("seq", "in"))
        cases = [(ctx.tensor(randn(12, 16), ("out", "in")), 7),                     # dropout
                 (ctx.tensor(randn(12, 16), ("out", "in"), dtype="f16"), None),      # f16 w
                 (ctx.variable(randn(12, 16), ("out", "in")), None),                 # trains
                 (ctx.tensor(randn(16, 12), ("in", "out")), None)]                   # [in, out]
        for w, seed in cases:
            with ctx.exec_scope():
                y = ad.project(x, w, dropout_seed=seed)
                assert y._node.name != "lora_linear"
                want = ad.apply(x, x.dot(w, "in"), dropout_seed=seed)
                assert_bitwise(y.numpy(), want.numpy())
        xt = ctx.variable(randn(16, 9), ("in", "seq"))
        with ctx.exec_scope():
            y = ad.project(xt, cases[0][0])
            assert y._node.name != "lora_linear" and y.tags == ("seq", "out")
        with fu.no_grad():
            with pytest.raises(TypeError, match="project"):
                ad.project(x, randn(12, 16))
            with pytest.raises(fu.TagError, match="project"):
                ad.project(x, ctx.tensor(randn(12, 16), ("out", "feat")))
            with pytest.raises(fu.ShapeMismatch, match="project"):
                ad.project(x, ctx.tensor(randn(11, 16), ("out", "in")))


@pytest.mark.parametrize("M,K,N", [(200, 600, 500), (50, 1536, 576), (30, 40, 2400),
                                   (30, 2400, 40), (9, 16, 12)])
@pytest.mark.parametrize("other", [True, False], ids=["two-consumers", "one"])
def test_project_bf16_is_the_dot_bf16_then_apply_bitwise(M, K, N, other):
    """compute="bf16": project(x, w) is x.dot_bf16(w) + delta(x) with the rank product in the
    bf16 GEMM's tile stores, forward and dx (exec.matmul_bf16's rank_add and accumulate):
    its output and the gradients of x (alone, or on top of another consumer's), A and B keep
    the bits of x.dot_bf16(w) then apply(reuse_base=True), at 1 and 2 threads, a bf16 and an
    f32 w, for one KC block, several and a k in slices (forward or dx)."""
    x_np, w_np, g_np = randn(M, K), randn(N, K, s=0.05), randn(M, N)
    for th, wdt in ((1, "bf16"), (2, "bf16"), (2, "f32")):
        with fu.ExecContext(threads=th) as ctx:
            ad = make(ctx, in_dim=K, out_dim=N, rank=8, alpha=16.0)
            w = ctx.tensor(w_np, ("out", "in"), dtype=wdt)
            _project_is_the_chain(ctx, ad, w, x_np, g_np, "bf16", other)
    with fu.ExecContext(threads=1) as ctx:
        ad = make(ctx, in_dim=16, out_dim=12, rank=3, p=0.25)
        x = ctx.variable(randn(9, 16), ("seq", "in"))
        w = ctx.tensor(randn(12, 16), ("out", "in"), dtype="bf16")
        with ctx.exec_scope():
            y = ad.project(x, w, dropout_seed=7, compute="bf16")           # dropout: two ops
            assert y._node.name != "lora_linear"
            want = ad.apply(x, x.dot_bf16(w, "in"), dropout_seed=7)
            assert_bitwise(y.numpy(), want.numpy())
        with fu.no_grad(), pytest.raises(fu.InvalidArgument, match="expected compute 'f32' or "
                                                                   "'bf16', got 'f16'"):
            ad.project(x, w, compute="f16")


def test_dropout_seed_modes(ctx):
    ad = make(ctx, p=0.5)
    plain = make(ctx, p=0.0)   # the same seed: the same A and B
    x = ctx.tensor(randn(6, 16), ("seq", "in"))
    with fu.no_grad():
        eval_ = ad.delta(x).numpy()                      # None = eval: no dropout at all
        assert_bitwise(eval_, plain.delta(x).numpy())
        assert_bitwise(eval_, plain.delta(x, dropout_seed=5).numpy())   # p = 0: the seed is unused
        t1, t2 = ad.delta(x, dropout_seed=5).numpy(), ad.delta(x, dropout_seed=5).numpy()
        assert_bitwise(t1, t2)                           # the mask is a function of the seed
        assert not np.array_equal(t1, ad.delta(x, dropout_seed=6).numpy())
        assert not np.array_equal(t1, eval_)
        # exactly the op chain dropout -> dot(A) -> dot(B) -> scale
        chain = x.dropout(0.5, 5).dot(ad.a, "in").dot(ad.b, "lora_r").scale(ad.scale).numpy()
        assert_bitwise(t1, chain)


def test_mixed_precision_frozen_base(ctx):
    """T-24: a frozen f16 weight's dot gives the f32 base; gradients reach A and B only."""
    ad = make(ctx)
    x_np, w_np = randn(5, 16), randn(12, 16).astype(np.float16)
    x, w16 = ctx.tensor(x_np, ("seq", "in")), ctx.tensor(w_np, ("out", "in"), dtype="f16")
    with ctx.exec_scope():
        y = ad.apply(x, x.dot(w16, "in"))
        y.sum_all().backward()
        y_np = y.numpy()
    xt, at, bt, dt = torch_delta(x_np, ad.a.numpy(), ad.b.numpy(), ad.scale)
    yt = xt @ torch.tensor(w_np.astype(np.float32)).T + dt
    yt.sum().backward()
    np.testing.assert_allclose(y_np, yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ad.a.grad().numpy(), at.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ad.b.grad().numpy(), bt.grad.numpy(), rtol=1e-5, atol=1e-5)
    assert w16.grad() is None


def test_gradient_at_init(ctx):
    """B == 0 at init: dL/dA is exactly zero while dL/dB is not."""
    ad = make(ctx, fill_b=False)
    x = ctx.tensor(randn(4, 16), ("seq", "in"))
    with ctx.exec_scope():
        ad.delta(x).sum_all().backward()
    assert not ad.a.grad().numpy().any() and ad.b.grad().numpy().any()


def test_gradcheck(ctx):
    ad = make(ctx, in_dim=6, out_dim=5, rank=2, alpha=3.0, p=0.3)
    x = ctx.variable(randn(4, 6), ("seq", "in"))
    w = ctx.tensor(randn(5, 6), ("out", "in"))
    target = ctx.tensor(randn(4, 5), ("seq", "out"))
    res = fu.gradcheck(lambda x, a, b: ad.apply(x, x.dot(w, "in"), dropout_seed=11).mse_loss(target),
                       [x, ad.a, ad.b], eps=1e-3, abs_tol=1e-3, rel_tol=1e-2)
    assert res.checked == x.numel + ad.a.numel + ad.b.numel


def test_thread_invariance(ctx1, ctx2):
    x_np, w_np, g_np = randn(70, 96), randn(80, 96), randn(70, 80)
    outs = []
    for c in (ctx1, ctx2):
        ad = make(c, in_dim=96, out_dim=80, rank=8, alpha=16.0, p=0.1, seed=3)
        x, w = c.variable(x_np, ("seq", "in")), c.tensor(w_np, ("out", "in"))
        with c.exec_scope():
            y = ad.apply(x, x.dot(w, "in"), dropout_seed=9)
            y.backward(grad=c.tensor(g_np, ("seq", "out")))
            y_np = y.numpy()
        ad.merge_into(w)
        outs.append((y_np, ad.a.grad().numpy(), ad.b.grad().numpy(), x.grad().numpy(), w.numpy(),
                     ad.merge_f16(c.tensor(w_np.astype(np.float16), ("out", "in"), "f16")).numpy()))
    for one, two in zip(*outs):
        assert_bitwise(one, two)


# ---------------------------------------------------------------------------------------------
# registration and state dicts

def test_register_params(ctx):
    ad = make(ctx)
    opt = fu.optim.AdamW(lr=1e-3)
    ad.register_params(opt, "layers.3.q")
    assert [s.name for s in opt.slots] == ["layers.3.q.lora_a", "layers.3.q.lora_b"]
    assert opt.slots[0].raw is ad.a._raw and opt.slots[1].raw is ad.b._raw
    with pytest.raises(fu.DuplicateParam):
        ad.register_params(opt, "again")
    tr = fu.es.Trainer(sigma=0.01, population=4, seed=1)   # anything with add_param(t, name=)
    ad.register_params(tr, "layers.0.v")
    assert tr.names() == ["layers.0.v.lora_a", "layers.0.v.lora_b"]


def test_named_tensors_round_trip(ctx):
    ad = make(ctx, seed=5)
    f = io.BytesIO()
    fu.io.save_state_dict(f, ad.named_tensors("layers.1.down") + make(ctx, seed=6).named_tensors("layers.2.up"))
    got = safetensors.numpy.load(f.getvalue())
    assert sorted(got) == ["layers.1.down.lora_a", "layers.1.down.lora_b", "layers.2.up.lora_a",
                           "layers.2.up.lora_b"]
    assert_bitwise(got["layers.1.down.lora_a"], ad.a.numpy())
    assert_bitwise(got["layers.1.down.lora_b"], ad.b.numpy())
    fresh = make(ctx, seed=99)
    assert not np.array_equal(fresh.a.numpy(), ad.a.numpy())
    f.seek(0)
    fu.io.load_state_dict(f, fresh.named_tensors_mut("layers.1.down"), strict=False)
    assert_bitwise(fresh.a.numpy(), ad.a.numpy())
    assert_bitwise(fresh.b.numpy(), ad.b.numpy())
    assert [e.name for e in fresh.named_tensors_mut("p")] == ["p.lora_a", "p.lora_b"]


# ---------------------------------------------------------------------------------------------
# merging

def test_merge_into_op_order(ctx):
    """w_i += scale·d_i with d = B·A from the GEMM: bitwise the f32 numpy of that formula."""
    ad = make(ctx, in_dim=40, out_dim=24, rank=6, alpha=5.0)
    w_np = randn(24, 40)
    w = ctx.tensor(w_np, ("out", "in"))
    with fu.no_grad():
        d = ad.b.matmul(ad.a, "plain", ("out", "in")).numpy()
    ad.merge_into(w)
    assert_bitwise(w.numpy(), w_np + f32(ad.scale) * d)
    want = w_np.astype(np.float64) + ad.scale * (ad.b.numpy().astype(np.float64) @ ad.a.numpy())
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-6, atol=1e-6)


def test_merge_f16_returns_new(ctx):
    ad = make(ctx, in_dim=40, out_dim=24, rank=6, alpha=5.0)
    w_np = randn(24, 40).astype(np.float16)
    w16 = ctx.tensor(w_np, ("out", "in"), dtype="f16")
    merged = ad.merge_f16(w16)
    assert merged is not w16 and merged.dtype == "f16" and merged.tags == ("out", "in")
    assert not merged.requires_grad
    assert_bitwise(w16.numpy(), w_np)   # the input is untouched
    want = (w_np.astype(np.float64) + ad.scale * (ad.b.numpy().astype(np.float64) @ ad.a.numpy()))
    got = merged.numpy().astype(np.float64)
    assert (np.abs(got - want) <= np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)).all()
    with ctx.exec_scope():   # inside a scope the result is still caller-owned
        inner = ad.merge_f16(w16)
    assert_bitwise(inner.numpy(), merged.numpy())
    x = ctx.tensor(randn(3, 40), ("seq", "in"))
    with fu.no_grad():
        np.testing.assert_allclose(x.dot(merged, "in").numpy(), ad.apply(x, x.dot(w16, "in")).numpy(),
                                   rtol=0, atol=0.05)


# ---------------------------------------------------------------------------------------------
# errors

def test_tag_errors():
    for tags in (("a", "a"), ("lora_r", "b"), ("a", "lora_r"), ("", "b"), (3, "b")):
        with pytest.raises(fu.TagError):
            L.Adapter(*tags)


def test_init_errors(ctx):
    t = L.Adapter("in", "out")
    for rank in (0, 5, -1):
        with pytest.raises(fu.InvalidRank, match="rank"):
            t.init(ctx, 8, 4, L.LoraConfig(rank, 1.0), 1)
    t.init(ctx, 8, 4, L.LoraConfig(4, 1.0), 1)   # rank == min(in, out) is fine
    for p in (-0.1, 1.0, 1.5, float("nan"), 0.99999999):   # f32(0.99999999) == 1
        with pytest.raises(fu.InvalidDropout):
            t.init(ctx, 8, 4, L.LoraConfig(2, 1.0, p), 1)
    with pytest.raises(TypeError):
        t.init(ctx, 8, 4, (2, 1.0), 1)
    with pytest.raises(TypeError):
        t.init(ctx, 8, 4, L.LoraConfig(2.0, 1.0), 1)
    with pytest.raises(TypeError):
        t.init(ctx, 8, 4, L.LoraConfig(2, "1"), 1)
    with pytest.raises(TypeError):
        t.init(ctx, 8, 4, L.LoraConfig(2, 1.0), 1.5)


def test_forward_errors(ctx):
    ad = make(ctx)
    x = ctx.tensor(randn(3, 16), ("seq", "in"))
    base = ctx.tensor(randn(3, 12), ("seq", "out"))
    bad = [(fu.DTypeError, ctx.tensor(randn(3, 16), ("seq", "in"), dtype="f16")),
           (fu.TagError, ctx.tensor(randn(3, 16), ("seq", "feat"))),
           (fu.TagError, ctx.tensor(randn(3, 16, 2), ("seq", "in", "out"))),
           (fu.TagError, ctx.tensor(randn(3, 16), ("lora_r", "in"))),
           (fu.ShapeMismatch, ctx.tensor(randn(3, 15), ("seq", "in")))]
    with fu.no_grad():
        for err, xx in bad:
            with pytest.raises(err, match="lora.Adapter.delta"):
                ad.delta(xx)
            with pytest.raises(err):
                ad.apply(xx, base)
        with pytest.raises(fu.DTypeError, match="base"):
            ad.apply(x, ctx.tensor(randn(3, 12), ("seq", "out"), dtype="bf16"))
        with pytest.raises(fu.TagError, match="base"):
            ad.apply(x, ctx.tensor(randn(12, 3), ("out", "seq")))
        with pytest.raises(fu.ShapeMismatch, match="base"):
            ad.apply(x, ctx.tensor(randn(3, 11), ("seq", "out")))
        with pytest.raises(TypeError):
            ad.delta(randn(3, 16))
        with fu.ExecContext(threads=1) as other:
            with pytest.raises(fu.ContextMismatch):
                ad.delta(other.tensor(randn(3, 16), ("seq", "in")))
            with pytest.raises(fu.ContextMismatch):
                ad.apply(x, other.tensor(randn(3, 12), ("seq", "out")))
    # SPEC §3.0 composite contract: under gradients a scope is required
    with pytest.raises(fu.ActiveExecScopeRequired, match="delta"):
        ad.delta(x)
    with pytest.raises(fu.ActiveExecScopeRequired, match="apply"):
        ad.apply(x, base)
    with fu.no_grad():
        ad.apply(x, base)   # no-grad use works unscoped


def test_merge_errors(ctx, tmp_path):
    ad = make(ctx, in_dim=32, out_dim=8, rank=2)
    w = ctx.tensor(randn(8, 32), ("out", "in"))
    with pytest.raises(fu.TagError):
        ad.merge_into(ctx.tensor(randn(32, 8), ("in", "out")))
    with pytest.raises(fu.ShapeMismatch):
        ad.merge_into(ctx.tensor(randn(8, 31), ("out", "in")))
    with pytest.raises(fu.MutableDataRequiresNoGrad, match="variable"):
        ad.merge_into(ctx.variable(randn(8, 32), ("out", "in")))
    with pytest.raises(fu.DTypeError, match="merge_f16"):
        ad.merge_into(w.to("f16"))
    with pytest.raises(fu.DTypeError, match="merge_into"):
        ad.merge_f16(w)
    with pytest.raises(fu.DTypeError):
        ad.merge_f16(w.to("bf16"))
    for m in (ad.merge_into, ad.merge_f16):
        with pytest.raises(TypeError, match="quantized"):   # DTypeError is a TypeError
            m(w.to("q8_0"))
    with pytest.raises(fu.ShapeMismatch):
        ad.merge_f16(ctx.tensor(randn(7, 32), ("out", "in"), dtype="f16"))
    path = tmp_path / "w.gguf"   # a memory-mapped GGUF weight is read-only: never written
    fu.gguf.write(path, {"w": w}, {})
    f = fu.gguf.read(path, ctx)
    ro = f.tensors["w"]   # tagged ("ne1", "ne0"): [out, in]
    with pytest.raises(fu.ReadOnlyStorage, match="read-only"):
        make(ctx, in_dim=32, out_dim=8, rank=2, tags=("ne0", "ne1")).merge_into(ro)
    assert_bitwise(ro.numpy(), w.numpy())
    del ro, f
    dead = make(ctx)
    dead.release()
    for call in (lambda a: a.delta(w), lambda a: a.merge_into(w), lambda a: a.named_tensors("p"),
                 lambda a: a.register_params(fu.optim.SGD(lr=0.1), "p")):
        for a in (dead, L.Adapter("in", "out")):
            with pytest.raises(fu.UseAfterRelease):
                call(a)


# ---------------------------------------------------------------------------------------------
# training end to end

def test_training_fits_a_low_rank_correction():
    """A frozen random layer plus an adapter trained by AdamW on y = x·(W + ΔW)ᵀ with ΔW rank 2:
    the loss falls below 10 % of its start in 50 steps (and merging keeps the trained outputs)."""
    with fu.ExecContext(threads=2) as ctx:
        rng = np.random.default_rng(5)
        w_np = (rng.standard_normal((24, 32)) / math.sqrt(32)).astype(np.float32)
        dw = (rng.standard_normal((24, 2)) @ rng.standard_normal((2, 32)) / math.sqrt(32)).astype(np.float32)
        x_np = rng.standard_normal((128, 32)).astype(np.float32)
        x, w = ctx.tensor(x_np, ("batch", "in")), ctx.tensor(w_np, ("out", "in"))
        y = ctx.tensor(x_np @ (w_np + dw).T, ("batch", "out"))
        ad = L.Adapter("in", "out").init(ctx, 32, 24, L.LoraConfig(rank=4, alpha=8.0), seed=1)
        opt = fu.optim.AdamW(lr=0.05, weight_decay=0.0)
        ad.register_params(opt, "layer")
        losses = []
        for step in range(50):
            with ctx.exec_scope():
                loss = ad.apply(x, x.dot(w, "in")).mse_loss(y)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert losses[-1] < 0.1 * losses[0], losses
        with fu.no_grad():
            trained = ad.apply(x, x.dot(w, "in")).numpy()
        ad.merge_into(w)
        np.testing.assert_allclose(x.dot(w, "in").numpy(), trained, rtol=0, atol=1e-4)
