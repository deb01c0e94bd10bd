"""The qwen2 and gemma3 architectures of fu.llm.decoder (issue 17 items 1, 2, 4): tiny random
models written by our GGUF writer (fucina/cli/tiny_model.py) load in transformers (gguf_file=)
with logits equal to ours; loss and LoRA gradients of all seven targets against an independent
float64 torch replica (q/k/v biases; gemma3's embedding scale, post-norms, tanh-GeGLU, sliding
window, two RoPE bases, attention scale and logit soft-cap); KV-cache greedy generation equal
to a full recompute and to transformers; the finetune, export, chat and es-finetune commands
on both; and, when the real files are present ($FUCINA_MODELS_DIR, default build/models),
greedy 24 tokens equal to transformers' and ten finetune steps with the loss falling."""
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import real_models
import torch

import fucina as fu
from conftest import assert_bitwise
from fucina.cli import es_finetune as ef
from fucina.cli import finetune as ft
from fucina.cli import info
from fucina.cli.tiny_model import build_tiny_model
from fucina.llm import IGNORE_INDEX
from fucina.llm.decoder import TARGETS, Config, Model, Ropes, Trainer
from fucina.llm.generation import LM, Decoder, KVCache

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
GEMMA = dict(arch="gemma3", layers=7, hidden=256, heads=2, kv_heads=1, head_dim=256, ffn=256,
             sliding_window=5)
MODELS = {"qwen2": dict(arch="qwen2"), "qwen2-tied": dict(arch="qwen2", tied=True),
          "gemma3": GEMMA, "gemma3-softcap": dict(GEMMA, final_softcap=3.0),
          "gemma3-wide": dict(GEMMA, sliding_window=1024)}
NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
         "up": "ffn_up", "down": "ffn_down"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("archs")
    return {name: build_tiny_model(d / f"{name}.gguf", seed=11, **kw) for name, kw in MODELS.items()}


def ids(n, seed=0, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def hf_model(path):
    d, name = os.path.split(str(path))
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                             dtype=torch.float32)


def our_logits(path, tokens, threads=1):
    ctx = fu.ExecContext(threads=threads)
    m = Model.from_gguf(ctx, path)
    with ctx.exec_scope():
        return m.forward_logits(tokens).numpy()


def rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


# ---------------------------------------------------------------------------------------------
# config

def test_configs_read_the_architecture_traits(tiny, ctx1):
    assert fu.llm.qwen3 is fu.llm.decoder          # the package's earlier name still works
    q = Config.from_gguf(fu.gguf.read(tiny["qwen2"], ctx1))
    assert (q.qkv_bias, q.qk_norm, q.rope_mode, q.activation, q.post_norms) == (
        True, False, "half", "swiglu", False)
    assert not any(q.is_sliding(l) for l in range(q.num_layers)) and not q.two_ropes
    g = Config.from_gguf(fu.gguf.read(tiny["gemma3"], ctx1))
    assert (g.qk_norm, g.rope_mode, g.activation, g.post_norms, g.qkv_bias) == (
        True, "half", "geglu", True, False)
    assert g.embed_scale == 16.0 and g.sliding_window == 5 and g.two_ropes
    assert [g.is_sliding(l) for l in range(7)] == [True] * 5 + [False, True]
    assert (g.rope_theta, g.rope_theta_local) == (1e6, 1e4)
    assert g.attn_scale == 1 / 16 and g.final_softcap == 0
    assert Config.from_gguf(fu.gguf.read(tiny["gemma3-softcap"], ctx1)).final_softcap == 3.0
    d = info.describe(tiny["gemma3"])
    assert d["sliding"] == {"window": 5, "layers": 6, "rope_theta": 1e4}
    assert "sliding       window 5 in 6 of 7 layers, their RoPE base 10000" in info.render(d)
    assert "sliding" not in info.describe(tiny["qwen2"])
    # the 27B rule: query_pre_attn_scalar = hidden / heads
    meta = dict(fu.gguf.read(tiny["gemma3"], ctx1).metadata)
    meta["gemma3.block_count"] = 62
    assert Config.from_gguf(meta, vocab_size=512).attn_scale == np.float32(1 / math.sqrt(128))
    del meta["gemma3.attention.sliding_window"]
    with pytest.raises(fu.UnsupportedModel, match="gemma3.attention.sliding_window"):
        Config.from_gguf(meta, vocab_size=512)


def test_missing_bias_or_post_norm_is_named(tiny, tmp_path, ctx1):
    for name, drop in (("qwen2", "blk.1.attn_k.bias"), ("gemma3", "blk.0.post_ffw_norm.weight")):
        f = fu.gguf.read(tiny[name], ctx1)
        tensors = {k: v for k, v in f.tensors.items() if k != drop}
        out = tmp_path / f"{name}.gguf"
        fu.gguf.write(str(out), tensors, f.metadata)
        with pytest.raises(fu.UnsupportedModel, match=f"missing tensor '{drop}'"):
            Model.from_gguf(ctx1, str(out))


# ---------------------------------------------------------------------------------------------
# transformers reads our files and computes our logits

@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "gemma3", "gemma3-wide"])
def test_logits_equal_transformers(tiny, name):
    tokens = ids(21, seed=1)
    ours = our_logits(tiny[name], tokens)
    with torch.no_grad():
        ref = hf_model(tiny[name])(torch.tensor([tokens])).logits[0].numpy()
    assert rel(ours, ref) < 1e-5, rel(ours, ref)


def test_the_sliding_window_changes_the_logits(tiny):
    """The window-5 and window-1024 models share every weight: the first five positions agree,
    later ones differ (in both implementations), so the comparison above covers the window."""
    tokens = ids(21, seed=1)
    a, b = our_logits(tiny["gemma3"], tokens), our_logits(tiny["gemma3-wide"], tokens)
    np.testing.assert_allclose(a[:5], b[:5], rtol=0, atol=1e-5 * np.abs(b).max())
    assert rel(a[5:], b[5:]) > 1e-2


# ---------------------------------------------------------------------------------------------
# the independent float64 replica

def weights(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        out[t.name] = torch.tensor(np.asarray(t.data, np.float64).reshape(shape))
    return out


def rope_cos_sin(S, D, theta):
    i = np.arange(D // 2)
    pw = np.power(np.float32(theta), (2 * i).astype(np.float32) / np.float32(D)).astype(np.float32)
    ang = (np.arange(S, dtype=np.float32)[:, None] / pw[None, :]).astype(np.float32)
    return torch.tensor(np.cos(ang.astype(np.float64))), torch.tensor(np.sin(ang.astype(np.float64)))


def rope_half(x, cos, sin):
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def replica_loss(c: Config, W, tokens, labels, adapters, scale):
    """Cross-entropy (mean over supervised positions) of the decoder written out from the
    papers' descriptions: LoRA adds scale·(x·Aᵀ)·Bᵀ to a projection's output (bias included)."""
    eps = float(np.float32(c.rms_eps))
    S = len(tokens)
    tables = {th: rope_cos_sin(S, c.head_dim, th) for th in {c.rope_theta, c.rope_theta_local}}
    x = W["token_embd.weight"][torch.tensor(tokens)] * float(c.embed_scale)
    pos = torch.arange(S)
    for l in range(c.num_layers):
        p = f"blk.{l}."

        def lin(name, inp):
            y = inp @ W[p + NAMES[name] + ".weight"].T
            if p + NAMES[name] + ".bias" in W:
                y = y + W[p + NAMES[name] + ".bias"]
            if (l, name) in adapters:
                a, b = adapters[(l, name)]
                y = y + scale * ((inp @ a.T) @ b.T)
            return y

        sliding = c.sliding_window > 0 and (l + 1) % 6 != 0 if c.arch == "gemma3" else False
        cos, sin = tables[c.rope_theta_local if sliding else c.rope_theta]
        h = rms(x, W[p + "attn_norm.weight"], eps)
        q = lin("q", h).view(S, c.heads, c.head_dim)
        k = lin("k", h).view(S, c.kv_heads, c.head_dim)
        v = lin("v", h).view(S, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms(q, W[p + "attn_q_norm.weight"], eps), rms(k, W[p + "attn_k_norm.weight"], eps)
        q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
        g = c.heads // c.kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(c.head_dim)   # = sqrt(qpas) here
        keep = pos[None, :] <= pos[:, None]
        if sliding:
            keep &= pos[:, None] - pos[None, :] < c.sliding_window
        att = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
        o = lin("o", torch.einsum("hst,thd->shd", att, v).reshape(S, -1))
        if c.post_norms:
            o = rms(o, W[p + "post_attention_norm.weight"], eps)
        x = x + o
        f = rms(x, W[p + "ffn_norm.weight"], eps)
        gate, up = lin("gate", f), lin("up", f)
        act = gelu_tanh(gate) if c.activation == "geglu" else torch.nn.functional.silu(gate)
        d = lin("down", up * act)
        if c.post_norms:
            d = rms(d, W[p + "post_ffw_norm.weight"], eps)
        x = x + d
    out = W.get("output.weight", W["token_embd.weight"])
    logits = rms(x, W["output_norm.weight"], eps) @ out.T
    if c.final_softcap:
        logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
    lab = torch.tensor([-100 if y == IGNORE_INDEX else y for y in labels])
    return torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100)


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "gemma3", "gemma3-softcap"])
def test_loss_and_lora_gradients_match_the_replica(tiny, ctx1, name):
    model = Model.from_gguf(ctx1, tiny[name])
    tr = Trainer(model, TARGETS, fu.lora.LoraConfig(4, 8.0), seed=3)
    rng = np.random.default_rng(4)
    for _, ad in tr.named_adapters():
        ad.b._raw.storage_view()[:] = (rng.standard_normal(ad.b.shape) * 0.05).astype(np.float32)
    tokens = ids(14, seed=2)
    labels = tokens[1:] + [7]
    labels[:3] = [IGNORE_INDEX] * 3
    with ctx1.exec_scope():
        loss = tr.loss(tokens, labels)
        value = float(loss.numpy())
        loss.backward()
    adapters = {(l, n): tuple(torch.tensor(t.numpy().astype(np.float64), requires_grad=True)
                              for t in (ad.a, ad.b))
                for l, layer in enumerate(tr.adapters) for n, ad in layer.items()}
    ref = replica_loss(model.config, weights(tiny[name]), tokens, labels, adapters, 2.0)
    ref.backward()
    assert abs(value - ref.item()) <= 2e-6 * abs(ref.item()), (value, ref.item())
    for (l, n), (a, b) in adapters.items():
        ad = tr.adapters[l][n]
        for got, want in ((ad.a.grad().numpy(), a.grad.numpy()), (ad.b.grad().numpy(), b.grad.numpy())):
            assert rel(got, want) < 2e-5, ((l, n), rel(got, want))


def test_checkpointed_layers_are_bitwise_on_gemma3(tiny, ctx1):
    """The two-table RoPE pair rides through checkpoint_with_context like one table."""
    grads = []
    for ckpt in (False, True):
        tr = Trainer(Model.from_gguf(ctx1, tiny["gemma3"]), ("q", "v", "down"),
                     fu.lora.LoraConfig(4, 8.0), seed=5, checkpoint_layers=ckpt)
        for _, ad in tr.named_adapters():
            fu.rng.normal_fill(9, ad.b, 0.0, 0.05)
        tokens = ids(12, seed=6)
        with ctx1.exec_scope():
            loss = tr.loss(tokens, tokens[1:] + [0])
            loss.backward()
        grads.append([t.grad().numpy() for _, ad in tr.named_adapters() for t in (ad.a, ad.b)])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)



@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "gemma3"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("compute", ["f32", "bf16"])
def test_projections_with_the_delta_fused_keep_the_bits(tmp_path, ctx1, arch, ckpt, compute):
    """The trainer's hook projects through Adapter.project (the rank product in the frozen
    projection's GEMM, f32 or bf16 compute; qwen2's biased q, k, v the plain way): three AdamW
    steps give the losses and adapter gradients, bit for bit, of the hook without it (dot or
    dot_bf16, then apply)."""
    from fucina.llm.decoder import train
    kw = GEMMA if arch == "gemma3" else {"arch": arch}
    path = build_tiny_model(tmp_path / f"{arch}.gguf", seed=13, **kw)
    model = Model.from_gguf(ctx1, path, compute=compute)
    runs = []
    for fused in (True, False):
        tr = Trainer(model, TARGETS, fu.lora.LoraConfig(4, 8.0), seed=7, checkpoint_layers=ckpt)
        opt = fu.optim.AdamW(lr=1e-2)
        tr.register_all_params(opt)
        tokens = ids(13, seed=8)
        hook, took = train._Lora.project, []

        def counted(self, name, x, w, compute):
            y = hook(self, name, x, w, compute)
            took.append(y._node is None or y._node.name == "lora_linear")   # None: no grad
            return y
        if fused:
            train._Lora.project = counted
        else:
            del train._Lora.project
        try:
            run = []
            for _ in range(3):
                with ctx1.exec_scope():
                    loss = tr.loss(tokens, tokens[1:] + [1])
                    loss.backward()
                    run.append(loss.numpy())
                run += [t.grad().numpy() for _, ad in tr.named_adapters() for t in (ad.a, ad.b)]
                opt.step()
                opt.zero_grad()
        finally:
            train._Lora.project = hook
        assert fused == (len(took) >= 3 * 4 * len(tr.adapters) and all(took))
        runs.append(run)
    for got, want in zip(*runs):
        assert_bitwise(got, want)

# ---------------------------------------------------------------------------------------------
# generation with the KV cache

def recompute_greedy(path, prompt, n):
    ctx = fu.ExecContext(threads=1)
    m = Model.from_gguf(ctx, path)
    seq = list(prompt)
    for _ in range(n):
        with ctx.exec_scope():
            seq.append(int(m.forward_logits(seq).numpy()[-1].argmax()))
    return seq[len(prompt):]


def hf_greedy(path, prompt, n, model=None):
    m = model or hf_model(path)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_cached_greedy_equals_recompute_and_transformers(tiny, name):
    prompt = ids(9, seed=8)       # longer than gemma3's window of 5
    lm = fu.llm.load(tiny[name], fu.ExecContext(threads=2))
    if name == "gemma3":
        assert isinstance(KVCache(lm.model, 4).table, Ropes)
    ours = lm.generate(prompt, max_new=12).ids
    assert len(ours) == 12 or lm.tokenizer.eos_id not in ours
    assert ours == recompute_greedy(tiny[name], prompt, len(ours))
    assert ours == hf_greedy(tiny[name], prompt, len(ours))


# ---------------------------------------------------------------------------------------------
# the commands

@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_finetune_export_and_chat(tiny, tmp_path, name):
    out = tmp_path / "tuned.gguf"
    r = ft.run(ft.Options(model=tiny[name], lr=1e-2, sample=False, threads=1, steps=12,
                          save=str(tmp_path / "ck"), export=str(out), export_dtype="q8_0"),
               out=lambda line="": None)
    losses = [st.loss for st in r.steps]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert r.export.top1["merged"] == r.export.top1["exported"] == r.export.top1["trainer"]
    ctx = fu.ExecContext(threads=1)
    exported = fu.gguf.read(str(out), ctx)
    base = fu.gguf.read(tiny[name], ctx)
    assert set(exported.tensors) == set(base.tensors)        # biases and post-norms kept
    assert Model.from_gguf(ctx, str(out)).config == Model.from_gguf(ctx, tiny[name]).config
    tokens = ids(11, seed=3)
    with torch.no_grad():          # transformers reads the merged file as we do
        ref = hf_model(r.export.merged)(torch.tensor([tokens])).logits[0].numpy()
    assert rel(our_logits(r.export.merged, tokens), ref) < 1e-5
    p = subprocess.run([sys.executable, "-m", "fucina.cli.chat", str(tiny[name]), "--adapters",
                        str(tmp_path / "ck"), "--prompt", "What is two plus two?",
                        "--max-new", "6", "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    lm = fu.llm.load(tiny[name], ctx, adapters=str(tmp_path / "ck"))
    want = lm.chat([{"role": "user", "content": "What is two plus two?"}], max_new=6)
    assert want.text and want.text in p.stdout and f"{len(want.ids)} new at" in p.stderr


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_es_finetune_both_modes(tiny, tmp_path, name):
    for mode in ("lora", "full"):
        r = ef.run(ef.Options(model=tiny[name], save=str(tmp_path / mode), iterations=2,
                              population=4, batch=2, max_new=4, reward="acc", threads=1,
                              mode=mode), out=lambda *_: None)
        assert r.iterations == 2


def test_es_full_mode_perturbs_the_biases(tiny, ctx1):
    m = Model.from_gguf(ctx1, tiny["qwen2"], widen_frozen=True)
    names = [n for n, _ in ef._own_weights(m)]
    assert "blk.0.attn_q.bias" in names and "blk.1.attn_v.bias" in names
    g = Model.from_gguf(ctx1, tiny["gemma3"], widen_frozen=True)
    names = [n for n, _ in ef._own_weights(g)]
    assert "blk.3.post_attention_norm.weight" in names and "blk.6.post_ffw_norm.weight" in names


# ---------------------------------------------------------------------------------------------
# the real files

PROMPT = "The Eiffel Tower is located in the city of"


def real(name):
    """The real file of `name` (tests/real_models.py), or skip naming `make models`."""
    return str(real_models.require(name))


@pytest.fixture(scope="module")
def hf_real():
    """arch -> transformers' model of the real file, loaded once for this module's tests
    (45 s for the qwen2 file here, most of it transformers reading the GGUF) and dropped
    after them."""
    models = {}

    def get(arch):
        if arch not in models:
            models[arch] = hf_model(real(arch))
        return models[arch]
    yield get
    models.clear()


def hf_prompt(arch):
    tok = real_models.hf_tokenizer(arch)
    ids_ = tok(PROMPT, add_special_tokens=False)["input_ids"]
    return ([tok.bos_token_id] if arch == "gemma3" else []) + ids_, tok


def cached_greedy(model, prompt, n):
    """Greedy ids through the serving path without a tokenizer: the prompt through LM.forward
    into a KVCache, then the Decoder's one-token steps (recorded and replayed after a few)."""
    holder = types.SimpleNamespace(model=model, trainer=None, ctx=model.ctx, matvec="exact")
    holder.through = lambda x, cache: LM.through(holder, x, cache)
    cache = KVCache(model, len(prompt) + n)
    decode = Decoder(holder, cache)
    out = []
    with fu.no_grad():
        for i in range(n):
            with model.ctx.exec_scope():
                logits = LM.forward(holder, prompt, cache) if i == 0 else decode(out[-1])
                out.append(int(logits.numpy()[0].argmax()))
    assert decode.replaying
    return out


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_real_file_greedy_equals_transformers(arch, hf_real):
    path = real(arch)
    prompt, tok = hf_prompt(arch)
    model = Model.from_gguf(fu.ExecContext(threads=2), path)
    assert model.config.arch == arch
    ours = cached_greedy(model, prompt, 24)
    assert ours == hf_greedy(path, prompt, 24, hf_real(arch)), (tok.decode(ours),)
    if arch == "gemma3":
        assert tok.decode(ours).startswith(" Paris")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_real_file_ten_finetune_steps_lower_the_loss(arch):
    path = real(arch)
    prompt, tok = hf_prompt(arch)
    answer = tok(" Paris, the capital of France.", add_special_tokens=False)["input_ids"]
    tokens = prompt + answer
    labels = [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX]
    ctx = fu.ExecContext(threads=2)
    tr = Trainer(Model.from_gguf(ctx, path), TARGETS, fu.lora.LoraConfig(8, 16.0), seed=1)
    opt = fu.optim.AdamW(lr=3e-4, weight_decay=0.0)
    tr.register_all_params(opt)
    losses = []
    for _ in range(10):
        with ctx.exec_scope():
            loss = tr.loss(tokens, labels)
            losses.append(float(loss.numpy()))
            loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(math.isfinite(v) for v in losses)
    # measured: qwen2 1.147 -> 0.475 -> 0.101 -> ... -> 0.000, gemma3 0.806 -> 0.376 -> 0.08 -> ...
    assert losses[-1] < 0.1 * losses[0] and max(losses[3:]) < 0.5 * losses[0], losses


@pytest.mark.slow
def test_real_qwen2_serves_through_fu_llm_load():
    """The serving path end to end (its byte-level BPE tokenizer and ChatML template)."""
    path = real("qwen2")
    prompt, _ = hf_prompt("qwen2")
    lm = fu.llm.load(path, fu.ExecContext(threads=2))
    assert lm.encode(PROMPT) == prompt
    assert lm.generate(PROMPT, max_new=24).ids == cached_greedy(lm.model, prompt, 24)
    reply = lm.chat([{"role": "user", "content": "Write a Python function that returns the "
                                                 "square of x."}], max_new=40)
    assert "def square(x):" in reply.text, reply.text


PASSAGE = ("The river flows through the old town and past the market square. In the evening, "
           "people gather on the bridge to watch the boats return to the harbour.")


def nll(logits, ids):
    """Mean next-token negative log-likelihood (float64) of ids under logits [len, vocab]."""
    z = logits.astype(np.float64)[:-1]
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_real_file_nll_equals_transformers(arch, hf_real):
    """A two-sentence passage, tokenized by our tokenizer with the file's BOS policy (the ids
    equal transformers'): our NLL equals transformers' on the same file, near the issue's
    oracle's range (1.9 on its passage; here 3.13 for the coder model, 2.57 for Gemma); Gemma
    scored without its BOS is far worse (5.45 here, the issue's 6.1), so the policy matters."""
    path = real(arch)
    ctx = fu.ExecContext(threads=2)
    lm = fu.llm.load(path, ctx)
    ids = lm.encode(PASSAGE)
    assert ids == real_models.hf_tokenizer(arch)(PASSAGE)["input_ids"]
    m = hf_real(arch)
    with fu.no_grad(), ctx.exec_scope():
        ours = nll(lm.model.forward_logits(ids).numpy(), ids)
        bare = nll(lm.model.forward_logits(ids[1:]).numpy(), ids[1:]) if arch == "gemma3" else None
    with torch.no_grad():
        theirs = nll(m(torch.tensor([ids])).logits[0].numpy(), ids)
    assert abs(ours - theirs) < 2e-4 * max(1.0, theirs), (ours, theirs)
    assert ours < 4.0
    if bare is not None:
        assert ids[0] == lm.tokenizer.bos_id and bare > ours + 2.0, (bare, ours)
