"""A tiny random decoder GGUF (Qwen3-shaped by default; llama, qwen2, gemma3 on request) with a
real byte-level BPE vocabulary, so the finetune demo (and its tests) run anywhere without downloading a model.

    path = build_tiny_model(tmp_dir / "tiny.gguf")                  # f32 weights
    path = build_tiny_model(tmp_dir / "tiny-q8.gguf", dtype="q8_0") # a quantized base

The vocabulary is trained here: GPT-2 byte-level BPE over a small English corpus (the pirate
pairs among it), pre-tokenized with the qwen2 pattern Qwen3 files name, then the merges in the
order they were learned; the Qwen3 special tokens (`<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` as CONTROL, `<think>`, `</think>` as USER_DEFINED) come last, and the file carries
a ChatML `tokenizer.chat_template`, so `fu.llm.Tokenizer.from_gguf` and `fu.llm.detect` treat
it exactly like a real Qwen3 file. Weights are drawn from the repo RNG (`fu.rng.normal_fill` at
`at(seed, k)`, tensor k in file order): the same seed gives a byte-identical file. Hidden, q,
kv and ffn sizes are multiples of 256, so every matrix is eligible for the 256-block K-quants
of the export loop.
"""
from __future__ import annotations

import collections
import os

import regex

import fucina as fu
from fucina.errors import InvalidArgument
from fucina.gguf import Metadata
from fucina.llm.tokenizer import CONTROL, NORMAL, PRE_TOKENIZERS, USER_DEFINED, byte_alphabet

SPECIAL = (("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
           ("<think>", USER_DEFINED), ("</think>", USER_DEFINED))
VOCAB = 512
ARCHS = ("qwen3", "llama", "qwen2", "gemma3")
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = """\
system user assistant
What is the capital of France? Ahoy! The capital of France be Paris, matey.
Name a primary color. Ahoy! Red be a fine primary color, matey.
What is two plus two? Ahoy! Two plus two makes four, matey.
What language is spoken in Italy? Ahoy! In Italy they be speakin' Italian, matey.
How many days are in a week? Ahoy! A week holds seven days, matey.
The quick brown fox jumps over the lazy dog, and the dog does not mind at all.
A ship sails the sea; the captain reads the map while the crew sings of home.
There are seven days in a week, twelve months in a year and four seasons.
Rome is the capital of Italy, Berlin of Germany, Madrid of Spain and Paris of France.
Red, blue and yellow are primary colors; green, orange and purple are not.
One plus one makes two, two plus two makes four, and three times three is nine.
People in Italy speak Italian, people in France speak French, in Spain Spanish.
"""


def train_bpe(text: str, vocab_size: int = VOCAB, pre: str = "qwen2") -> tuple[list, list]:
    """(tokens, merges): the 256 byte symbols in byte order, then one token per merge, learned
    greedily (most frequent adjacent pair over the pre-tokens, ties to the smallest pair), until
    the vocabulary plus the special tokens reaches `vocab_size` or every pre-token is one token."""
    alphabet = byte_alphabet()
    words = collections.Counter(
        tuple(alphabet[b] for b in piece.encode("utf-8"))
        for piece in regex.findall(PRE_TOKENIZERS[pre], text))
    tokens, merges = list(alphabet), []
    while len(tokens) + len(SPECIAL) < vocab_size:
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        tokens.append(merged)
        words = collections.Counter({_merge(w, best, merged): n for w, n in words.items()})
    return tokens, merges


def _merge(word: tuple, pair: tuple, merged: str) -> tuple:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_tiny_model(path, *, seed: int = 0, dtype: str = "f32", layers: int = 2,
                     hidden: int = 256, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                     ffn: int = 512, vocab_size: int = VOCAB, arch: str = "qwen3",
                     tied: bool = False, sliding_window: int = 4,
                     final_softcap: float = 0.0) -> str:
    """Write the model to `path` (matrices stored as `dtype`: f32, f16, bf16 or a block type
    such as q8_0; norm weights and biases f32) and return the path. arch "qwen3" (QK-norm, half
    RoPE), "llama" (no QK-norm, interleaved RoPE pairs), "qwen2" (q/k/v biases) or "gemma3"
    (post-norms, QK-norm, sliding window `sliding_window` on layers l with (l + 1) % 6 != 0,
    `final_logit_softcapping` written when final_softcap > 0), with the metadata keys llama.cpp
    writes for each. tied=True leaves out output.weight (the head reads token_embd)."""
    if arch not in ARCHS:
        raise InvalidArgument(f"build_tiny_model: expected arch in {ARCHS}, got {arch!r}")
    path = os.fspath(path)
    tokens, merges = train_bpe(CORPUS, vocab_size)
    n_plain = len(tokens)
    tokens += [t for t, _ in SPECIAL]
    types = [NORMAL] * n_plain + [ty for _, ty in SPECIAL]
    tid = {t: i for i, t in enumerate(tokens)}
    meta = Metadata(types={})

    def put(key, value, vtype):
        meta[key], meta.types[key] = value, vtype

    put("general.architecture", arch, "str")
    put("general.name", f"fucina tiny {arch} (random weights)", "str")
    for key, value in (("block_count", layers), ("context_length", 1024),
                       ("embedding_length", hidden), ("feed_forward_length", ffn),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim)):
        put(f"{arch}.{key}", value, "u32")
    put(f"{arch}.rope.freq_base", 1e6, "f32")
    if arch == "gemma3":
        put(f"{arch}.attention.sliding_window", sliding_window, "u32")
        if final_softcap > 0:
            put(f"{arch}.final_logit_softcapping", final_softcap, "f32")
    put(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, "f32")
    put("tokenizer.ggml.model", "gpt2", "str")
    put("tokenizer.ggml.pre", "qwen2", "str")
    put("tokenizer.ggml.tokens", tokens, "[str]")
    put("tokenizer.ggml.token_type", types, "[i32]")
    put("tokenizer.ggml.merges", [f"{a} {b}" for a, b in merges], "[str]")
    put("tokenizer.ggml.eos_token_id", tid["<|im_end|>"], "u32")
    put("tokenizer.ggml.padding_token_id", tid["<|endoftext|>"], "u32")
    put("tokenizer.ggml.bos_token_id", tid["<|endoftext|>"], "u32")
    put("tokenizer.ggml.add_bos_token", False, "bool")
    put("tokenizer.chat_template", CHAT_TEMPLATE, "str")

    ctx = fu.ExecContext(threads=1)
    try:
        tensors = {}

        def add(name, shape, std, mean=0.0, matrix=True):
            t = ctx.zeros(shape, fu.gguf.tags_for(len(shape)))
            fu.rng.normal_fill(fu.rng.at(seed, len(tensors)), t, mean, std)
            tensors[name] = t.to(dtype) if matrix and dtype != "f32" else t

        def norm(name, n):
            add(name, (n,), 0.1, mean=1.0, matrix=False)

        q, kv = heads * head_dim, kv_heads * head_dim
        add("token_embd.weight", (len(tokens), hidden), 1.0)
        if not tied:
            add("output.weight", (len(tokens), hidden), 0.3 * hidden ** -0.5 * 4)
        norm("output_norm.weight", hidden)
        for i in range(layers):
            p = f"blk.{i}."
            norm(p + "attn_norm.weight", hidden)
            norm(p + "ffn_norm.weight", hidden)
            if arch in ("qwen3", "gemma3"):
                norm(p + "attn_q_norm.weight", head_dim)
                norm(p + "attn_k_norm.weight", head_dim)
            if arch == "gemma3":
                norm(p + "post_attention_norm.weight", hidden)
                norm(p + "post_ffw_norm.weight", hidden)
            add(p + "attn_q.weight", (q, hidden), hidden ** -0.5)
            add(p + "attn_k.weight", (kv, hidden), hidden ** -0.5)
            add(p + "attn_v.weight", (kv, hidden), hidden ** -0.5)
            if arch == "qwen2":
                for stem, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                    add(p + stem + ".bias", (n,), 0.5, matrix=False)
            add(p + "attn_output.weight", (hidden, q), q ** -0.5)
            add(p + "ffn_gate.weight", (ffn, hidden), hidden ** -0.5)
            add(p + "ffn_up.weight", (ffn, hidden), hidden ** -0.5)
            add(p + "ffn_down.weight", (hidden, ffn), ffn ** -0.5)
        fu.gguf.write(path, tensors, meta)
    finally:
        ctx.close()
    return path
