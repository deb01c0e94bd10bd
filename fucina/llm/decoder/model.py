"""The decoder over frozen GGUF weights (qwen3, llama, qwen2, gemma3): the forward of SPEC T-21
steps 1-3, op for op, with the architecture's traits read from its Config.

    f = fu.gguf.read(path, ctx)
    model = Model.from_gguf(ctx, f)
    with ctx.exec_scope():
        logits = model.forward_logits(tokens)          # [seq, vocab], tags ("seq", "vocab")

Weights stay as the file stores them (f32, f16, bf16 or block-quantized, memory-mapped, never
copied): every linear is a frozen right operand of `dot` (SPEC A-8), so gradients reach the
activations only. Matrices are retagged [out, in] with the axis names below; 1-D norm weights
are widened to f32 when stored narrower (they are small). `output.weight` absent means the
output projection is tied to token_embd. `widen_frozen=True` instead decodes every matrix to an
f32 copy once (more memory, plain f32 GEMMs forward and backward) and drops the file's pages of
it from the resident set: the finetune demo's default.
`compute="bf16"` holds every matrix as bf16 (half the memory of f32; quantized and f16 ones are
decoded, f32 ones rounded to nearest even; the file's pages of a converted matrix are dropped
too) and runs every projection and the head through Tensor.dot_bf16: the activation (and,
backward, its gradient) rounded to bf16, f32 sums through the CPU's AMX tiles or its bf16 dot
instruction.
Everything else — norms, RoPE, attention, softmax, the loss, any adapter — stays f32.

One layer (`layer`), with `adapt(name, input, base)` the hook a LoRA trainer uses to add its
deltas to the frozen projections (None = the plain model; the layer never reads a base after
handing it to the hook, which may write its result over it; a hook with `project(name, input,
w, compute)` computes an unbiased projection (in f32, or in bf16 for compute="bf16") and its
delta itself, in one GEMM):
    attn_in = x.rms_norm_mul("embed", attn_norm, eps)
    q, k, v = attn_in · Wq/Wk/Wv (a fused attn_qkv weight is split after its one dot)
    q_rope = q3.rms_norm_mul_rope_half_prepared("seq", "d", q_norm, eps, table)   (same for k)
    attn = q_rope.grouped_attention(k_rope, v3, kv_head_for_head, "attn", 1/sqrt(f32(head_dim)))
    h = x + attn · Wo;  ffn_in = h.rms_norm_mul("embed", ffn_norm, eps)
    x' = h + (up.swiglu(gate)) · Wdown      (up·silu(gate))
llama-arch files run the same layer without the QK-norm and with interleaved RoPE pairs; qwen2
adds its q/k/v biases to the projections (before a LoRA delta is added); gemma3 scales the
embedding rows by sqrt(hidden), normalizes the attention and FFN outputs again before adding
them (post_attention_norm, post_ffw_norm), gates with GeGLU (up·gelu_tanh(gate)), attends over a
window of keys in its sliding layers, rotates sliding and global layers with their own RoPE
bases (`rope_table` then returns a Ropes pair) and soft-caps the logits when the file says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ... import gguf
from ...ag.rope import RopeTable
from ...ag.engine import needs_graph
from ...ag.tensor import Tensor
from ...errors import (IndexOutOfBounds, InvalidArgument, InvalidArgumentType,
                       InvalidSequenceLength, ShapeMismatch)
from ...exec.quant import BLOCKS
from .config import Config, UnsupportedModel

__all__ = ["Model", "Layer", "LINEARS", "Ropes"]

# projection -> (GGUF tensor, input tag, output tag); a weight is tagged (output, input)
LINEARS = {"q": ("attn_q", "embed", "q"), "k": ("attn_k", "embed", "k"),
           "v": ("attn_v", "embed", "v"), "o": ("attn_output", "attn", "embed"),
           "gate": ("ffn_gate", "embed", "ffn"), "up": ("ffn_up", "embed", "ffn"),
           "down": ("ffn_down", "ffn", "embed")}
MATRIX_DTYPES = ("f32", "f16", "bf16", *BLOCKS)
COMPUTE = ("f32", "bf16")   # Model.from_gguf(compute=...): the frozen projections' arithmetic


@dataclass
class Layer:
    """One block's frozen weights: `linear[name]` for q, k, v, o, gate, up, down (q/k/v None
    when the file fuses them into `qkv`, tagged ("qkv", "embed")), the f32 norm weights, and
    `bias[name]` for q, k, v (f32, tagged by the projection's output) when the arch has them."""

    linear: dict
    qkv: Tensor | None
    attn_norm: Tensor
    ffn_norm: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    bias: dict | None = None
    post_attn_norm: Tensor | None = None
    post_ffn_norm: Tensor | None = None


@dataclass(frozen=True)
class Ropes:
    """The RoPE tables of one span of positions when sliding and global layers rotate with
    different bases (gemma3): `glob` with rope_theta, `local` with rope_theta_local."""

    glob: RopeTable
    local: RopeTable


def _retag(t: Tensor, tags: tuple) -> Tensor:
    """A caller-owned constant sharing t's storage under new tags (never scope-adopted)."""
    return Tensor(t._live("decoder.Model"), tags)


class Model:
    """A loaded model: `config`, `token_embd`, `output_norm`, `output`, `layers`, and the RoPE
    tables it has built, cached per (offset, length) for its lifetime (checkpoint nodes and
    recorded graphs hold them)."""

    def __init__(self, ctx, config: Config, token_embd, output_norm, output, layers, source=None,
                 compute: str = "f32"):
        self.ctx, self.config = ctx, config
        self.compute = compute        # "bf16": projections through dot_bf16 (see from_gguf)
        self.token_embd, self.output_norm, self.output = token_embd, output_norm, output
        self.layers = layers
        self.source = source          # the GGUFFile whose mapping backs the weights
        self._tables = {}
        self.q8_matvec = False        # see dot

    def __repr__(self):
        c = self.config
        return (f"decoder.Model({c.arch}, {c.num_layers} layers, hidden {c.hidden}, heads "
                f"{c.heads}/{c.kv_heads}x{c.head_dim}, ffn {c.ffn}, vocab {c.vocab})")

    # ---- loading ----
    @classmethod
    def from_gguf(cls, ctx, gguf_file, *, widen_frozen: bool = False,
                  compute: str = "f32") -> "Model":
        """The model of a GGUF file (a `fu.gguf.read(path, ctx)` result or a path). Missing or
        unusable tensors raise UnsupportedModel, wrong sizes ShapeMismatch (naming the tensor).
        compute: "f32" (the default) or "bf16" (matrices held as bf16, projections in bf16;
        excludes widen_frozen)."""
        if isinstance(gguf_file, (str, bytes, os.PathLike)):
            gguf_file = gguf.read(gguf_file, ctx)
        if not isinstance(gguf_file, gguf.GGUFFile):
            raise InvalidArgumentType("decoder.Model.from_gguf: expected a GGUF file "
                                      "(fu.gguf.read) or a path, "
                                      f"got {type(gguf_file).__name__}")
        if not isinstance(widen_frozen, bool):
            raise InvalidArgumentType("decoder.Model.from_gguf: expected widen_frozen as a bool, "
                                      f"got {widen_frozen!r}")
        if compute not in COMPUTE:
            raise InvalidArgument(f"decoder.Model.from_gguf: compute: expected one of "
                                  f"{', '.join(COMPUTE)}, got {compute!r}")
        if compute == "bf16" and widen_frozen:
            raise InvalidArgument("decoder.Model.from_gguf: compute='bf16' holds the frozen "
                                  "matrices as bf16; expected widen_frozen=False with it")
        cfg = Config.from_gguf(gguf_file)
        load = _Loader(ctx, gguf_file, cfg, widen_frozen, compute)
        embd = load.matrix("token_embd.weight", ("vocab", "embed"), (cfg.vocab, cfg.hidden))
        if "output.weight" in gguf_file.tensors:
            out = load.matrix("output.weight", ("vocab", "embed"), (cfg.vocab, cfg.hidden))
        else:
            out = embd   # tied
        layers = [load.layer(i) for i in range(cfg.num_layers)]
        return cls(ctx, cfg, embd, load.vector("output_norm.weight", cfg.hidden), out, layers,
                   gguf_file, compute)

    def for_matvec(self) -> None:
        """Give every projection and the head a copy laid out for one-row products
        (Tensor.for_matvec): serving's exact decode steps, same bits, ~20 % faster."""
        for w in self.layers:
            w.linear = {n: t if t is None else t.for_matvec() for n, t in w.linear.items()}
            if w.qkv is not None:
                w.qkv = w.qkv.for_matvec()
        self.output = self.output.for_matvec()

    # ---- forward ----
    def rope_table(self, offset: int, length: int):
        """The RoPE table of positions offset .. offset + length - 1 (feature_dim = the rotary
        span, head_dim unless the file says otherwise; theta = rope_theta), built once per
        (offset, length); a Ropes pair when sliding layers have their own base."""
        key = (int(offset), int(length))
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self.build_rope_table(*key)
        return table

    def build_rope_table(self, offset: int, length: int):
        """rope_table's table, built anew (the caller keeps it: a KV cache's whole context)."""
        c = self.config
        positions = range(offset, offset + length)
        glob = self.ctx.prepare_rope_table(positions, c.rope_dim, c.rope_theta)
        if not c.two_ropes:
            return glob
        return Ropes(glob, self.ctx.prepare_rope_table(positions, c.rope_dim, c.rope_theta_local))

    def rope_rows(self, table, start: int, length: int):
        """Positions start .. start + length - 1 of a table built once for a whole context
        (a view of its rows, no new table: each row depends on its position only, so the rows
        equal a table built for those positions bit for bit)."""
        if isinstance(table, Ropes):
            return Ropes(self.rope_rows(table.glob, start, length),
                         self.rope_rows(table.local, start, length))
        return RopeTable(table.ctx, table.positions[start:start + length], table.feature_dim,
                         table.theta_base, table.inverse, table._cos.narrow(0, start, length),
                         table._sin.narrow(0, start, length))

    def embed(self, tokens) -> Tensor:
        """Step 1: the token rows of the (frozen) embedding, f32 [seq, embed]."""
        e = self.token_embd
        if e.dtype in BLOCKS:
            x = e.get_rows("vocab", tokens, "seq")
        else:
            x = e.gather("vocab", tokens, "seq")
            x = x if x.dtype == "f32" else x.to("f32")
        s = self.config.embed_scale
        return x if s == 1.0 else x.scale(s)

    def dot(self, x: Tensor, w: Tensor, tag: str) -> Tensor:
        """x · w for a projection: in bf16 (Tensor.dot_bf16) when the model computes in bf16;
        with `q8_matvec` set, a single row without a graph takes the 8-bit-activation integer
        dot (Tensor.dot_q8; serving's decode steps), else the exact dot."""
        if self.compute == "bf16":
            return x.dot_bf16(w, tag)
        if self.q8_matvec and x.shape[0] == 1 and not needs_graph(x):
            return x.dot_q8(w, tag)
        return x.dot(w, tag)

    def linear(self, layer: int, name: str, x: Tensor, adapt=None) -> Tensor:
        """x · W_name of one layer (contracting the weight's input tag), then adapt(name, x,
        base) when given. (q, k, v go through `attention_inputs`, which knows fused weights.)"""
        return self._project(name, x, self.layers[layer].linear[name], adapt)

    def _project(self, name: str, x: Tensor, w: Tensor, adapt, bias=None) -> Tensor:
        """x · w (+ bias), then adapt(name, x, base); in one GEMM when the hook has
        project(name, x, w, compute) and takes it (no bias: Adapter.project)."""
        if adapt is not None and bias is None and not self.q8_matvec and \
                hasattr(adapt, "project"):
            y = adapt.project(name, x, w, self.compute)
            if y is not None:
                return y
        base = self.dot(x, w, LINEARS[name][1])
        if bias is not None:
            base = base.add(bias)
        return base if adapt is None else adapt(name, x, base)

    def attention_inputs(self, layer: int, attn_in: Tensor, adapt=None) -> tuple:
        """q [seq, q], k [seq, k], v [seq, v] (step 2b-c)."""
        w = self.layers[layer]
        c = self.config
        if w.qkv is None:
            bias = w.bias or {}
            return tuple(self._project(n, attn_in, w.linear[n], adapt, bias.get(n))
                         for n in ("q", "k", "v"))
        fused = self.dot(attn_in, w.qkv, "embed")
        bases, start = [], 0
        for name, n in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim)):
            bases.append(fused.narrow("qkv", start, n).reshape(("seq", name),
                                                               (fused.shape[0], n)))
            start += n
        out = []
        for name, base in zip(("q", "k", "v"), bases):
            if w.bias is not None:
                base = base.add(w.bias[name])
            out.append(base if adapt is None else adapt(name, attn_in, base))
        return tuple(out)

    def layer(self, l: int, x: Tensor, table, adapt=None, kv=None) -> Tensor:
        """Step 2: one decoder block, x [seq, embed] -> [seq, embed]. `kv(l, k, v)`, when given,
        receives this block's rotated keys and values of the new positions and returns the keys
        and values to attend over (a KV cache: the earlier positions followed by these)."""
        c, w = self.config, self.layers[l]
        eps = c.rms_eps
        attn_in = x.rms_norm_mul("embed", w.attn_norm, eps)
        q, k, v = self.attention_inputs(l, attn_in, adapt)
        q3 = q.split_axis("q", ("head", "d"), (c.heads, c.head_dim))
        k3 = k.split_axis("k", ("kv_head", "d"), (c.kv_heads, c.head_dim))
        v3 = v.split_axis("v", ("kv_head", "d"), (c.kv_heads, c.head_dim))
        sliding = c.is_sliding(l)
        if isinstance(table, Ropes):
            table = table.local if sliding else table.glob
        if c.qk_norm:
            q_rope = q3.rms_norm_mul_rope_half_prepared("seq", "d", w.q_norm, eps, table)
            k_rope = k3.rms_norm_mul_rope_half_prepared("seq", "d", w.k_norm, eps, table)
        else:
            q_rope = q3.rope("seq", "d", table, c.rope_mode)
            k_rope = k3.rope("seq", "d", table, c.rope_mode)
        if kv is not None:
            k_rope, v3 = kv(l, k_rope, v3)
        attn = q_rope.grouped_attention(k_rope, v3, c.kv_head_for_head, "attn", c.attn_scale,
                                        window=c.sliding_window if sliding else 0)
        out = self.linear(l, "o", attn, adapt)
        if w.post_attn_norm is not None:
            out = out.rms_norm_mul("embed", w.post_attn_norm, eps)
        h = x.add(out)
        ffn_in = h.rms_norm_mul("embed", w.ffn_norm, eps)
        gate = self.linear(l, "gate", ffn_in, adapt)
        up = self.linear(l, "up", ffn_in, adapt)
        out = self.linear(l, "down", up.gated(gate, c.activation), adapt)
        if w.post_ffn_norm is not None:
            out = out.rms_norm_mul("embed", w.post_ffn_norm, eps)
        return h.add(out)

    def head(self, x: Tensor) -> Tensor:
        """Step 3: logits [seq, vocab] = rms_norm_mul(x, output_norm) · W_outputᵀ, then
        cap·tanh(logits/cap) when the config soft-caps them."""
        c = self.config
        logits = self.dot(x.rms_norm_mul("embed", self.output_norm, c.rms_eps), self.output,
                          "embed")
        if c.final_softcap > 0:
            logits = logits.scale(1.0 / c.final_softcap).tanh().scale(c.final_softcap)
        return logits

    def forward_logits(self, tokens, rows=None) -> Tensor:
        """The plain model (no adapters): logits [seq, vocab] for positions 0 .. len - 1, or
        for the positions `rows` only (increasing, e.g. decoder.train.head_rows')."""
        tokens = check_tokens("decoder.Model.forward_logits", tokens, self.config.vocab)
        table = self.rope_table(0, len(tokens))
        x = self.embed(tokens)
        for l in range(self.config.num_layers):
            x = self.layer(l, x, table)
        return self.head(x if rows is None else x.gather("seq", rows, "seq"))


def check_tokens(op: str, tokens, vocab: int) -> np.ndarray:
    """Token ids as an int64 array: a non-empty flat sequence of integers in [0, vocab)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidSequenceLength(f"{op}: expected a flat sequence of token ids, got shape "
                                    f"{arr.shape}")
    if arr.size == 0:
        raise InvalidSequenceLength(f"{op}: expected at least one token, got none")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{op}: expected integer token ids, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise IndexOutOfBounds(f"{op}: token id {bad} is out of range; expected ids in "
                               f"[0, {vocab})")
    return arr.astype(np.int64)


class _Loader:
    """Fetches and checks the named tensors of one file."""

    def __init__(self, ctx, f, cfg: Config, widen: bool, compute: str):
        self.ctx, self.f, self.cfg, self.widen, self.compute = ctx, f, cfg, widen, compute

    def get(self, name: str):
        t = self.f.tensors.get(name)
        if t is None:
            raise UnsupportedModel(f"decoder.Model.from_gguf: {self.f.path}: missing tensor {name!r}")
        if not isinstance(t, Tensor):
            raise UnsupportedModel(f"decoder.Model.from_gguf: tensor {name!r} has ggml type "
                                   f"{t.type_name}, which fucina cannot compute with")
        return t

    def matrix(self, name: str, tags: tuple, shape: tuple) -> Tensor:
        t = self.get(name)
        if t.shape != shape:
            raise ShapeMismatch(f"decoder.Model.from_gguf: tensor {name!r}: expected shape "
                                f"{list(shape)} {tags}, got {list(t.shape)}")
        if t.dtype not in MATRIX_DTYPES:
            raise UnsupportedModel(f"decoder.Model.from_gguf: tensor {name!r}: expected one of "
                                   f"{MATRIX_DTYPES}, got {t.dtype}")
        if self.widen and t.dtype != "f32":
            t = t.to("f32")
            self.f.release_pages([name])   # decoded once: the f32 copy is what we read now
        if self.compute == "bf16" and t.dtype != "bf16":
            t = (t if t.dtype in ("f32", "f16") else t.to("f32")).to("bf16")
            self.f.release_pages([name])   # the bf16 copy is what we read now
        return _retag(t, tags)

    def vector(self, name: str, n: int, tag: str = "embed") -> Tensor:
        t = self.get(name)
        if t.shape != (n,):
            raise ShapeMismatch(f"decoder.Model.from_gguf: tensor {name!r}: expected shape [{n}], "
                                f"got {list(t.shape)}")
        if t.dtype != "f32":
            if t.dtype not in ("f16", "bf16"):
                raise UnsupportedModel(f"decoder.Model.from_gguf: tensor {name!r}: expected an "
                                       f"f32/f16/bf16 norm weight, got {t.dtype}")
            t = t.to("f32")
        return _retag(t, (tag,))

    def layer(self, i: int) -> Layer:
        c, p = self.cfg, f"blk.{i}."
        dims = c.dims
        linear, qkv = {}, None
        fused = p + "attn_qkv.weight" in self.f.tensors
        for name, (stem, tin, tout) in LINEARS.items():
            if fused and name in ("q", "k", "v"):
                linear[name] = None
                continue
            linear[name] = self.matrix(p + stem + ".weight", (tout, tin), (dims[tout], dims[tin]))
        if fused:
            qkv = self.matrix(p + "attn_qkv.weight", ("qkv", "embed"),
                              (c.q_dim + 2 * c.kv_dim, c.hidden))
        qn = self.vector(p + "attn_q_norm.weight", c.head_dim, "d") if c.qk_norm else None
        kn = self.vector(p + "attn_k_norm.weight", c.head_dim, "d") if c.qk_norm else None
        bias = None
        if c.qkv_bias:
            if fused:
                raise UnsupportedModel(f"decoder.Model.from_gguf: {p}attn_qkv.weight: a fused "
                                       f"q/k/v weight with biases is not supported; expected "
                                       f"separate attn_q/attn_k/attn_v")
            bias = {n: self.vector(p + LINEARS[n][0] + ".bias", dims[n], n)
                    for n in ("q", "k", "v")}
        post_attn = post_ffn = None
        if c.post_norms:
            post_attn = self.vector(p + "post_attention_norm.weight", c.hidden)
            post_ffn = self.vector(p + "post_ffw_norm.weight", c.hidden)
        return Layer(linear, qkv, self.vector(p + "attn_norm.weight", c.hidden),
                     self.vector(p + "ffn_norm.weight", c.hidden), qn, kn, bias, post_attn,
                     post_ffn)
