"""A small GPT written with fucina ops: the model of benchmarks/bench_gpt.py (issue 18) and of
the nanochat example.

    cfg = GptConfig()                                   # 6 layers, d 512, 8 heads x 64, ...
    weights = init_weights(cfg, seed=0)                 # name -> float32 numpy array
    model = Gpt(ctx, cfg, weights)                      # leaves that require grad
    with ctx.exec_scope():
        loss = model.loss(tokens, targets)              # mean next-token cross-entropy
        loss.backward()

One block: h = x + Wo·attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)); x' = h + Wd·(Wu·n(h) ·
silu(Wg·n(h))), n = RMSNorm without weight (eps 1e-5), RoPE on half-split pairs (θ 1e4), causal
attention over 8 heads of 64. Then n(x), an untied head, and the cross-entropy fused with the
head's projection (`linear_cross_entropy`: no [seq, vocab] logits buffer in the graph). Weights
are initialised in numpy (normal, std 0.02; output projections scaled by 1/sqrt(2·layers)) so a
twin in another framework can start from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class GptConfig:
    layers: int = 6
    d: int = 512
    heads: int = 8
    head_dim: int = 64
    ffn: int = 1536
    vocab: int = 16384
    seq: int = 1024
    eps: float = 1e-5
    theta: float = 1e4

    @property
    def attn(self) -> int:
        return self.heads * self.head_dim


def shapes(cfg: GptConfig) -> dict:
    """name -> (shape, tags) of every weight; a matrix is tagged (out, in)."""
    out = {"wte": ((cfg.vocab, cfg.d), ("vocab", "embed")),
           "head": ((cfg.vocab, cfg.d), ("vocab", "embed"))}
    io = {"wq": ("q", "embed"), "wk": ("k", "embed"), "wv": ("v", "embed"),
          "wo": ("embed", "attn"), "w_gate": ("ffn", "embed"), "w_up": ("ffn", "embed"),
          "w_down": ("embed", "ffn")}
    size = {"q": cfg.attn, "k": cfg.attn, "v": cfg.attn, "attn": cfg.attn, "embed": cfg.d,
            "ffn": cfg.ffn}
    for l in range(cfg.layers):
        for m in MATRICES:
            o, i = io[m]
            out[f"layers.{l}.{m}"] = ((size[o], size[i]), (o, i))
    return out


def init_weights(cfg: GptConfig, seed: int = 0) -> dict:
    """name -> float32 array: normal(0, 0.02), residual outputs (wo, w_down) / sqrt(2·layers)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in shapes(cfg).items():
        std = 0.02 / np.sqrt(2 * cfg.layers) if name.endswith(("wo", "w_down")) else 0.02
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    return out


class Gpt:
    """The model over fucina variables (`params`: name -> Tensor, registration order).
    matrix_dtype "bf16" holds the block matrices as bf16 leaves (the optimizer keeps f32
    masters; the GEMMs widen them in registers); embedding and head stay f32."""

    def __init__(self, ctx, cfg: GptConfig, weights: dict, matrix_dtype: str = "f32"):
        self.ctx, self.cfg = ctx, cfg
        self.params = {name: ctx.variable(weights[name], tags=tags,
                                          dtype=matrix_dtype if name.startswith("layers.") else "f32")
                       for name, (_, tags) in shapes(cfg).items()}
        self.table = ctx.prepare_rope_table(range(cfg.seq), cfg.head_dim, cfg.theta)
        self._tables = {cfg.seq: self.table}
        self.heads = tuple(range(cfg.heads))
        self.scale = float(np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim)))

    def _w(self, l: int, m: str):
        return self.params[f"layers.{l}.{m}"]

    def rope_table(self, n: int):
        """The RoPE table of positions 0 .. n - 1 (built once per length)."""
        if n not in self._tables:
            self._tables[n] = self.ctx.prepare_rope_table(range(n), self.cfg.head_dim,
                                                          self.cfg.theta)
        return self._tables[n]

    def block(self, l: int, x):
        """x [seq, embed] (or [batch, seq, embed]) -> the same shape."""
        c = self.cfg
        table = self.rope_table(x.shape[x.tags.index("seq")])
        n = x.rms_norm("embed", c.eps)
        q = n.dot(self._w(l, "wq"), "embed").split_axis("q", ("head", "d"), (c.heads, c.head_dim))
        k = n.dot(self._w(l, "wk"), "embed").split_axis("k", ("kv_head", "d"),
                                                         (c.heads, c.head_dim))
        v = n.dot(self._w(l, "wv"), "embed").split_axis("v", ("kv_head", "d"),
                                                         (c.heads, c.head_dim))
        q = q.rope("seq", "d", table, "half")
        k = k.rope("seq", "d", table, "half")
        attn = q.grouped_attention(k, v, self.heads, "attn", self.scale)
        h = x + attn.dot(self._w(l, "wo"), "attn")
        n2 = h.rms_norm("embed", c.eps)
        gate = n2.dot(self._w(l, "w_gate"), "embed")
        up = n2.dot(self._w(l, "w_up"), "embed")
        return h + up.swiglu(gate).dot(self._w(l, "w_down"), "ffn")

    def hidden(self, tokens):
        """The final normed hidden states [seq, embed] of `tokens` (len <= cfg.seq), or
        [batch, seq, embed] of a [batch, seq] array of them."""
        tokens = np.asarray(tokens)
        x = self.params["wte"].gather("vocab", tokens.reshape(-1), "seq")
        if tokens.ndim == 2:
            x = x.reshape(("batch", "seq", "embed"), tokens.shape + (self.cfg.d,))
        for l in range(self.cfg.layers):
            x = self.block(l, x)
        return x.rms_norm("embed", self.cfg.eps)

    def loss(self, tokens, targets):
        """Mean cross-entropy of next-token prediction (targets: one id per position, shaped
        as tokens)."""
        return self.hidden(tokens).linear_cross_entropy(self.params["head"], targets)

    def last_logits(self, tokens):
        """Logits [1, vocab] of the position after `tokens` (no graph needed: call under
        fu.no_grad())."""
        h = self.hidden(tokens)
        return h.narrow("seq", h.shape[0] - 1, 1).dot(self.params["head"], "embed")


def torch_twin(torch, cfg: GptConfig, weights: dict, table_cos, table_sin, lr: float = 3e-4):
    """The same model in PyTorch (for parity tests and benchmarks; `torch` is passed in, the
    library never imports it): (weights as leaves, loss(tokens, targets), fused AdamW). RoPE
    uses this model's own cos/sin tables, so both sides rotate by the same numbers."""
    F = torch.nn.functional
    W = {k: torch.from_numpy(v.copy()).requires_grad_() for k, v in weights.items()}
    cos = torch.from_numpy(table_cos)[:, None, :]
    sin = torch.from_numpy(table_sin)[:, None, :]
    half = cfg.head_dim // 2
    scale = float(np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim)))

    def rope(x):                       # x [..., seq, heads, hd], pairs (i, i + hd/2)
        a, b = x[..., :half], x[..., half:]
        S = x.shape[-3]
        c, s = cos[:S], sin[:S]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    def loss(tokens, targets):         # [seq] or [batch, seq]
        lead = tuple(tokens.shape)
        x = W["wte"][tokens]
        for l in range(cfg.layers):
            p = f"layers.{l}."
            n = F.rms_norm(x, (cfg.d,), eps=cfg.eps)
            q = rope((n @ W[p + "wq"].T).view(*lead, cfg.heads, cfg.head_dim))
            k = rope((n @ W[p + "wk"].T).view(*lead, cfg.heads, cfg.head_dim))
            v = (n @ W[p + "wv"].T).view(*lead, cfg.heads, cfg.head_dim)
            a = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2),
                                               v.transpose(-3, -2), is_causal=True, scale=scale)
            h = x + a.transpose(-3, -2).reshape(*lead, cfg.attn) @ W[p + "wo"].T
            n2 = F.rms_norm(h, (cfg.d,), eps=cfg.eps)
            x = h + (F.silu(n2 @ W[p + "w_gate"].T) * (n2 @ W[p + "w_up"].T)) @ W[p + "w_down"].T
        n = F.rms_norm(x, (cfg.d,), eps=cfg.eps)
        return F.cross_entropy((n @ W["head"].T).reshape(-1, cfg.vocab), targets.reshape(-1))

    opt = torch.optim.AdamW(list(W.values()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=True)
    return W, loss, opt
