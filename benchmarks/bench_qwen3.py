"""One LoRA training step of a small Qwen3-shaped model (SPEC T-21) vs a PyTorch eager replica.

    python -m benchmarks.bench_qwen3 [--quick]

The model: 4 layers, hidden 512, 8 query / 4 KV heads of 64, ffn 1536, vocab 8192, f32 weights
(written to a temporary GGUF file and memory-mapped back); one sequence of 256 tokens, LoRA
rank 8 / alpha 16 on q and v (the finetune defaults), AdamW (lr 1e-3, wd 0) on the adapters.
A step is forward + mean cross-entropy + backward + AdamW step + zero_grad: Fucina's trainer
under an exec scope, PyTorch's replica with frozen weight tensors, the LoRA delta as two extra
matmuls, F.rms_norm, F.scaled_dot_product_attention (causal, GQA), F.silu, F.cross_entropy and
torch.optim.AdamW on the adapter parameters. Both sides are first checked to agree on the loss
over 5 steps. Target: ≥ PyTorch (time per step; the note gives tokens/s).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from . import common as c

GROUP = "qwen3 LoRA training step (SPEC T-21)"
SHAPE = dict(layers=4, hidden=512, heads=8, kv=4, hd=64, ffn=1536, vocab=8192)
SEQ, RANK, ALPHA, EPS, THETA = 256, 8, 16.0, 1e-6, 1e6


def write_model(path, seed=0):
    """A random Qwen3-shaped GGUF (f32); returns the weights as numpy arrays by GGUF name."""
    import gguf

    s = SHAPE
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(s["layers"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["hd"])
    w.add_value_length(s["hd"])
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_context_length(4096)
    vals = {}

    def add(name, shape, scale, base=0.0):
        a = (base + rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, a)
        vals[name] = a

    h, q, kv, f = s["hidden"], s["heads"] * s["hd"], s["kv"] * s["hd"], s["ffn"]
    add("token_embd.weight", (s["vocab"], h), 1.0)
    add("output.weight", (s["vocab"], h), h ** -0.5)
    add("output_norm.weight", (h,), 0.1, 1.0)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", s["hd"]),
                        ("attn_k_norm", s["hd"])):
            add(p + name + ".weight", (n,), 0.1, 1.0)
        for name, shape in (("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
                            ("attn_output", (h, q)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)),
                            ("ffn_down", (h, f))):
            add(p + name + ".weight", shape, shape[1] ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vals


class TorchReplica:
    """The same step in PyTorch eager (f32): frozen weights, LoRA A/B parameters on q and v."""

    def __init__(self, torch, vals, adapters):
        self.t, self.F = torch, torch.nn.functional
        self.w = {k: torch.from_numpy(v.copy()) for k, v in vals.items()}
        self.lora = {k: (torch.nn.Parameter(torch.from_numpy(a.copy())),
                         torch.nn.Parameter(torch.from_numpy(b.copy())))
                     for k, (a, b) in adapters.items()}
        params = [p for ab in self.lora.values() for p in ab]
        self.opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        s = SHAPE
        hd = s["hd"]
        inv = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(SEQ, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(self, x):
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return self.t.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], -1)

    def loss(self, tokens, labels):
        t, F, W, s = self.t, self.F, self.w, SHAPE
        scale = ALPHA / RANK

        def lin(l, name, x):
            y = F.linear(x, W[f"blk.{l}.{name}.weight"])
            if (l, name) in self.lora:
                a, b = self.lora[(l, name)]
                y = y + F.linear(F.linear(x, a), b) * scale
            return y

        x = F.embedding(tokens, W["token_embd.weight"])
        H, KV, hd = s["heads"], s["kv"], s["hd"]
        for l in range(s["layers"]):
            p = f"blk.{l}."
            hin = F.rms_norm(x, (s["hidden"],), W[p + "attn_norm.weight"], EPS)
            q = lin(l, "attn_q", hin).view(SEQ, H, hd)
            k = lin(l, "attn_k", hin).view(SEQ, KV, hd)
            v = lin(l, "attn_v", hin).view(SEQ, KV, hd)
            q = self.rope(F.rms_norm(q, (hd,), W[p + "attn_q_norm.weight"], EPS)).transpose(0, 1)
            k = self.rope(F.rms_norm(k, (hd,), W[p + "attn_k_norm.weight"], EPS)).transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True,
                                               enable_gqa=True)
            x = x + lin(l, "attn_output", o.transpose(0, 1).reshape(SEQ, H * hd))
            fin = F.rms_norm(x, (s["hidden"],), W[p + "ffn_norm.weight"], EPS)
            x = x + lin(l, "ffn_down", lin(l, "ffn_up", fin) * F.silu(lin(l, "ffn_gate", fin)))
        logits = F.linear(F.rms_norm(x, (s["hidden"],), W["output_norm.weight"], EPS),
                          W["output.weight"])
        return F.cross_entropy(logits, labels, ignore_index=-100)

    def step(self, tokens, labels, value=False):
        loss = self.loss(tokens, labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item() if value else None


def _step_rows(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    ctx = fu.ExecContext(threads=threads)
    try:
        with tempfile.TemporaryDirectory() as d:
            return [_step_row(ctx, os.path.join(d, "model.gguf"), threads, quick)]
    finally:
        ctx.close()


def _step_row(ctx, path, threads: int, quick: bool) -> dict:
    import fucina as fu
    from fucina.llm import decoder

    torch = c.torch()
    vals = write_model(path)
    model = decoder.Model.from_gguf(ctx, fu.gguf.read(path, ctx))
    trainer = decoder.Trainer(model, decoder.Targets(), fu.lora.LoraConfig(RANK, ALPHA), 42)
    opt = fu.optim.AdamW(lr=1e-3, weight_decay=0.0)
    trainer.register_all_params(opt)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, SHAPE["vocab"], SEQ + 1)
    tokens, labels = seq[:-1], seq[1:].astype(np.uint64)
    labels[:32] = decoder.IGNORE_INDEX   # a masked prompt, as in SFT

    def fu_step(value=False):
        with ctx.exec_scope():
            loss = trainer.loss(tokens, labels)
            loss.backward()
            out = loss.item() if value else None
        opt.step()
        opt.zero_grad()
        return out

    env = {"fu_step": fu_step}
    stmts = {"fucina": "fu_step()"}
    if torch is not None:
        names = {"q": "attn_q", "v": "attn_v"}
        adapters = {(l, names[n]): (ad.a.numpy(), ad.b.numpy())
                    for l, layer in enumerate(trainer.adapters) for n, ad in layer.items()}
        rep = TorchReplica(torch, vals, adapters)
        t_tokens = torch.from_numpy(tokens.astype(np.int64))
        t_labels = torch.from_numpy(np.where(labels == decoder.IGNORE_INDEX, -100,
                                             labels.astype(np.int64)))
        with c.torch_threads(threads):  # same trajectory: a check, and both sides warmed
            for i in range(5):
                a, b = fu_step(True), rep.step(t_tokens, t_labels, True)
                if not np.isclose(a, b, rtol=1e-4):
                    raise AssertionError(f"qwen3 step {i}: Fucina loss {a} vs PyTorch {b}")
        env["to_step"] = lambda: rep.step(t_tokens, t_labels)
        stmts["torch"] = "to_step()"
    else:
        fu_step()
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                         repeats=3 if quick else 9, block_s=0.3 if quick else 1.0)
    note = f"{SEQ / t['fucina'].median:,.0f} tokens/s Fucina"
    if "torch" in t:
        note += f", {SEQ / t['torch'].median:,.0f} tokens/s PyTorch"
    return c.vs_torch(GROUP, "forward + CE + backward + AdamW step, 4 layers, hidden 512, 8/4 "
                             "heads x 64, ffn 1536, vocab 8192, seq 256, f32 weights, LoRA r8 on "
                             "q, v", threads, t["fucina"], t.get("torch"), load, note=note)


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "training step", _step_rows))


if __name__ == "__main__":
    c.main(rows)
