"""The hyperparameters of one decoder-family model, read from GGUF metadata (SPEC T-21).

    cfg = Config.from_gguf(fu.gguf.read(path, ctx))     # or the metadata mapping + vocab_size=

Keys are llama.cpp's `<arch>.*` names. A missing head_dim (`attention.key_length`) defaults to
embedding_length / head_count, a missing head_count_kv to head_count, a missing rotary span
(`rope.dimension_count`) to head_dim, as llama.cpp does; RoPE scaling (YaRN...) is refused. The
vocabulary size is the row count of `token_embd.weight` (the metadata rarely states it).
Mixture-of-experts files (arch `qwen3moe`, or any `<arch>.expert_count`) raise MoeUnsupported.

What differs between the architectures is data (ARCHITECTURES), not code:
  qwen3   QK-norm, half ("neox") RoPE pairs.
  llama   no QK-norm, interleaved RoPE pairs (llama.cpp's converter permutes Q/K rows for it).
  qwen2   no QK-norm, half RoPE, biases on the q, k and v projections.
  gemma3  QK-norm, half RoPE, embeddings times f32(sqrt(hidden)), norms before and after both
          attention and FFN, GeGLU (tanh GELU), sliding-window layers (window
          `attention.sliding_window`) interleaved with global ones: layer l is global when
          (l + 1) % 6 == 0 (llama.cpp's and transformers' rule); sliding layers rotate with base
          `rope.freq_base_swa` (10000 when absent), global ones with `rope.freq_base`; attention
          scale 1/sqrt(query_pre_attn_scalar), which llama.cpp takes as head_dim except for the
          62-layer 27B (hidden / heads); logits soft-capped by `final_logit_softcapping` when set.
          Gemma's RMSNorm multiplies by (1 + w): llama.cpp's converter already stores 1 + w in the
          file (transformers' GGUF loader subtracts the 1 again), so the stored weight is used as
          every other architecture uses its norm weight.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgumentType, MoeUnsupported, UnsupportedModel

__all__ = ["Config", "UnsupportedModel", "ARCHITECTURES"]

# architecture -> the traits the file does not state (Config fields of the same names)
ARCHITECTURES = {
    "qwen3": dict(qk_norm=True, rope_mode="half"),
    "llama": dict(qk_norm=False, rope_mode="interleaved"),
    "qwen2": dict(qk_norm=False, rope_mode="half", qkv_bias=True),
    "gemma3": dict(qk_norm=True, rope_mode="half", post_norms=True, activation="geglu",
                   swa_pattern=6),
}
_MOE = ("qwen3moe", "qwen2moe", "qwen3vlmoe", "mixtral", "deepseek2", "llama4")
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


@dataclass(frozen=True)
class Config:
    """One dense decoder: sizes, norm eps, RoPE bases and the architecture's traits."""

    arch: str
    num_layers: int
    hidden: int           # embedding_length
    ffn: int              # feed_forward_length
    heads: int
    kv_heads: int
    head_dim: int         # key_length == value_length
    vocab: int
    rope_theta: float
    rms_eps: float
    context_length: int
    qk_norm: bool = True
    rope_mode: str = "half"
    rope_dim: int = 0     # rotary span (rope.dimension_count); 0 = head_dim
    qkv_bias: bool = False        # q, k, v projections add a bias (qwen2)
    post_norms: bool = False      # RMSNorm after attention and after the FFN too (gemma3)
    activation: str = "swiglu"    # the FFN gate: "swiglu" (up·silu(gate)) or "geglu" (tanh GELU)
    embed_scale: float = 1.0      # the embedding rows are multiplied by this (gemma3: sqrt(hidden))
    sliding_window: int = 0       # keys a sliding layer sees (0: every layer is global)
    swa_pattern: int = 0          # layer l is global when (l + 1) % swa_pattern == 0
    rope_theta_local: float = 0.0  # RoPE base of sliding layers (0: rope_theta)
    attn_scale: float = 0.0       # softmax scale (0: 1/sqrt(f32 head_dim))
    final_softcap: float = 0.0    # logits -> cap·tanh(logits/cap) when > 0

    def __post_init__(self):
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        if self.rope_theta_local == 0:
            object.__setattr__(self, "rope_theta_local", self.rope_theta)
        if self.attn_scale == 0:
            object.__setattr__(self, "attn_scale",
                               float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim))))

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window (with the local RoPE base)."""
        return (self.sliding_window > 0 and self.swa_pattern > 0
                and (layer + 1) % self.swa_pattern != 0)

    @property
    def two_ropes(self) -> bool:
        """Sliding and global layers rotate with different bases (two RoPE tables)."""
        return (self.rope_theta_local != self.rope_theta
                and any(self.is_sliding(l) for l in range(self.num_layers)))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dims(self) -> dict:
        """Axis tag -> size, for the tags the weights and adapters use."""
        return {"embed": self.hidden, "q": self.q_dim, "k": self.kv_dim, "v": self.kv_dim,
                "attn": self.q_dim, "ffn": self.ffn, "vocab": self.vocab, "d": self.head_dim}

    @property
    def kv_head_for_head(self) -> tuple:
        """GQA: query head h reads KV head h // (heads / kv_heads)."""
        group = self.heads // self.kv_heads
        return tuple(h // group for h in range(self.heads))

    @classmethod
    def from_gguf(cls, gguf_file, vocab_size: int | None = None) -> "Config":
        """From a `fu.gguf.read(...)` result (vocab = rows of token_embd.weight) or from its
        metadata mapping (vocab = vocab_size, else `<arch>.vocab_size`, else the token list)."""
        where = "decoder.Config.from_gguf"
        meta = gguf_file if isinstance(gguf_file, Mapping) else getattr(gguf_file, "metadata", None)
        if not isinstance(meta, Mapping):
            raise InvalidArgumentType(f"{where}: expected a GGUF file (fu.gguf.read) or its "
                                      f"metadata mapping, got {type(gguf_file).__name__}")
        arch = meta.get("general.architecture")
        if arch in _MOE or (isinstance(arch, str) and f"{arch}.expert_count" in meta):
            raise MoeUnsupported(f"{where}: architecture {arch!r} is a mixture-of-experts model; "
                                 f"expected a dense {' or '.join(map(repr, ARCHITECTURES))} model")
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(f"{where}: general.architecture {arch!r} is not supported; "
                                   f"expected one of {sorted(ARCHITECTURES)}")

        def get(key, kind, default=None):
            full = f"{arch}.{key}"
            v = meta.get(full, default)
            if v is None:
                raise UnsupportedModel(f"{where}: missing metadata key {full!r}")
            ok = (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0
                  if kind is int else isinstance(v, numbers.Real) and not isinstance(v, bool)
                  and v > 0)
            if not ok:
                raise UnsupportedModel(f"{where}: {full}: expected a positive "
                                       f"{'integer' if kind is int else 'number'}, got {v!r}")
            return kind(v)

        hidden, heads = get("embedding_length", int), get("attention.head_count", int)
        kv_heads = get("attention.head_count_kv", int, heads)
        head_dim = get("attention.key_length", int, hidden // heads)
        value_dim = get("attention.value_length", int, head_dim)
        if value_dim != head_dim:
            raise UnsupportedModel(f"{where}: {arch}.attention.value_length {value_dim} != "
                                   f"key_length {head_dim}; expected one head_dim")
        if heads % kv_heads:
            raise UnsupportedModel(f"{where}: {heads} query heads do not group evenly over "
                                   f"{kv_heads} KV heads")
        rope_dim = get("rope.dimension_count", int, head_dim)
        if rope_dim % 2 or rope_dim > head_dim:
            raise UnsupportedModel(f"{where}: {arch}.rope.dimension_count {rope_dim}: expected an "
                                   f"even rotary span <= head_dim {head_dim}")
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise UnsupportedModel(f"{where}: {arch}.rope.scaling.type {scaling!r} is not "
                                   f"supported; expected none (plain RoPE)")
        vocab = _vocab(where, gguf_file, meta, arch, vocab_size)
        traits = dict(ARCHITECTURES[arch])
        num_layers = get("block_count", int)
        if arch == "gemma3":
            traits.update(
                embed_scale=float(np.sqrt(np.float32(hidden), dtype=np.float32)),
                sliding_window=get("attention.sliding_window", int),
                rope_theta_local=get("rope.freq_base_swa", float, GEMMA3_LOCAL_ROPE_BASE),
                attn_scale=float(np.float32(1.0) / np.sqrt(np.float32(
                    hidden // heads if num_layers == GEMMA3_27B_LAYERS else head_dim))))
            if f"{arch}.final_logit_softcapping" in meta:
                traits["final_softcap"] = get("final_logit_softcapping", float)
        return cls(arch=arch, num_layers=num_layers, hidden=hidden,
                   ffn=get("feed_forward_length", int), heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, vocab=vocab, rope_theta=get("rope.freq_base", float, 10000.0),
                   rms_eps=get("attention.layer_norm_rms_epsilon", float),
                   context_length=get("context_length", int), rope_dim=rope_dim, **traits)


def _vocab(where, gguf_file, meta, arch, vocab_size) -> int:
    if vocab_size is None:
        info = getattr(gguf_file, "infos", {}).get("token_embd.weight")
        if info is not None:
            vocab_size = info.shape[0]
        elif f"{arch}.vocab_size" in meta:
            vocab_size = meta[f"{arch}.vocab_size"]
        elif isinstance(meta.get("tokenizer.ggml.tokens"), list):
            vocab_size = len(meta["tokenizer.ggml.tokens"])
        else:
            raise UnsupportedModel(f"{where}: cannot tell the vocabulary size: no token_embd.weight, "
                                   f"{arch}.vocab_size or tokenizer.ggml.tokens; pass vocab_size=")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
        raise UnsupportedModel(f"{where}: expected a positive vocabulary size, got {vocab_size!r}")
    return int(vocab_size)
