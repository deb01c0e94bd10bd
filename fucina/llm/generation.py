"""Serving a model: a KV cache, prefill and one-token decode steps, stop handling and streamed
text (issue 15).

    lm = fu.llm.load("model.gguf", ctx)                 # model + tokenizer + chat template
    out = lm.generate("The capital of France is", max_new=16)
    out.ids, out.text, out.finish_reason, out.decode_tokens_per_s
    reply = lm.chat([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1)
    for piece in lm.stream([{"role": "user", "content": "Hi"}]): print(piece, end="")

The cache holds, per layer, the rotated keys and the values of every position so far
([ctx_len, kv_head, d], preallocated; f32, or f16 with `kv_dtype="f16"`). The prompt runs as
one forward (prefill) whose keys and values are written into the cache; every later step
feeds the one new token, writes its key and value row in place and attends over the filled
prefix — earlier positions are never recomputed. The weights are used as the file stores them
(a quantized matrix is read in place by `dot`, never widened per token). A decode step is ~500
small launches: after a few eager steps the LM records one and replays it from C at each
position (Decoder, fucina/exec/plan.py); the LM keeps its cache and that plan between replies.

Text comes out in pieces as tokens are decoded: bytes of a multi-byte character split across
tokens are held until the character is whole, and text that could still become a stop string
is held until that is decided; a stop string ends the reply and is not part of it. Generation
also stops at the end-of-turn marker of the template (chat) and at EOS (token ids), at
`max_new` new tokens, and when the context length is full (finish reason "length").

`adapters=DIR` (a finetune save directory: adapters.safetensors + trainer_state.json, or a
PEFT adapter directory: fu.llm.peft) applies LoRA adapters on the fly — each adapted projection adds (x·Aᵀ)·Bᵀ·alpha/rank to the frozen
one's output, nothing is merged; alpha comes from the directory (trainer_state.json's
lora_alpha, or adapter_config.json) unless given.
"""
from __future__ import annotations

import codecs
import numbers
import os
import time
from dataclasses import dataclass

import numpy as np

from .. import gguf
from ..ag.engine import no_grad
from ..ag.tensor import Tensor
from ..errors import (AdaptersMismatch, ContextOverflow, FucinaError, InvalidArgument,
                      InvalidArgumentType, InvalidSequenceLength)
from ..exec import elementwise as ew
from ..exec import plan
from ..lora import LoraConfig
from .decoder.model import Model, check_tokens
from .decoder.train import Trainer, _Lora
from .sampling import Settings, pick
from .template import ChatTemplate
from .tokenizer import Tokenizer

__all__ = ["load", "LM", "KVCache", "Decoder", "Generation"]

KV_DTYPES = ("f32", "f16")
MATVECS = ("exact", "q8")
CACHE_STEP = 256   # the KV cache an LM keeps grows in steps of this many positions


class KVCache:
    """Per-layer keys and values of the positions seen so far, preallocated for `length`
    positions. `pos` is the number filled; `__call__` is Model.layer's `kv` hook."""

    def __init__(self, model: Model, length: int, dtype: str = "f32"):
        c = model.config
        if dtype not in KV_DTYPES:
            raise InvalidArgumentType(f"KVCache: expected kv dtype in {KV_DTYPES}, got {dtype!r}")
        self.length, self.dtype, self.pos = int(length), dtype, 0
        shape = (self.length, c.kv_heads, c.head_dim)
        tags = ("seq", "kv_head", "d")
        self.k = [model.ctx.zeros(shape, tags=tags, dtype=dtype) for _ in range(c.num_layers)]
        self.v = [model.ctx.zeros(shape, tags=tags, dtype=dtype) for _ in range(c.num_layers)]
        self._n = 0
        # one RoPE table for every position the cache can hold; steps take views of its rows
        self.table = model.build_rope_table(0, self.length)

    def __call__(self, l: int, k: Tensor, v: Tensor):
        n = k.shape[0]
        end = self.pos + n
        for cache, new in ((self.k[l], k), (self.v[l], v)):
            dst = cache._raw.narrow(0, self.pos, n)
            ew.run(dst.ctx, "copy", self.dtype, dst.shape, (new._raw,), out=dst)
        self._n = n
        return self.k[l].narrow("seq", 0, end), self.v[l].narrow("seq", 0, end)

    def advance(self) -> None:
        """After a forward through every layer: the new positions are filled."""
        self.pos += self._n
        self._n = 0


@dataclass
class Generation:
    """One reply: the new token ids (stop tokens and stop strings excluded), their text, why
    it ended ("stop", "length" or "max_new"), and the timing of prefill and decode."""

    ids: list
    text: str
    finish_reason: str
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0


class _Text:
    """Incremental detokenizer: whole UTF-8 characters only, and nothing that may still turn
    into one of the stop strings."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple):
        self.tok, self.stops = tokenizer, tuple(s for s in stops if s)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held, self.emitted, self.stopped = "", [], False

    def feed(self, token: int) -> str:
        """The text that is now certain (possibly empty); sets `stopped` at a stop string."""
        self.held += self.utf8.decode(self.tok.decode_bytes([token]))
        for s in self.stops:
            at = self.held.find(s)
            if at >= 0:
                self.held, self.stopped = self.held[:at], True
                return self._emit(len(self.held))
        keep = 0     # the longest tail of `held` that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:n]):
                    keep = n
                    break
        return self._emit(len(self.held) - keep)

    def finish(self) -> str:
        """Everything held (the reply ended without a stop string completing)."""
        if not self.stopped:
            self.held += self.utf8.decode(b"", final=True)
        return self._emit(len(self.held))

    def _emit(self, n: int) -> str:
        out, self.held = self.held[:n], self.held[n:]
        if self.stopped:
            self.held = ""
        if out:
            self.emitted.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self.emitted)


class LM:
    """A model file ready to serve: `model`, `tokenizer`, `template`, and optional LoRA
    adapters applied on the fly (`trainer`: their holder). See the module docstring."""

    def __init__(self, ctx, model: Model, tokenizer: Tokenizer, template: ChatTemplate,
                 trainer: Trainer | None = None, kv_dtype: str = "f32", matvec: str = "exact"):
        self.ctx, self.model, self.tokenizer, self.template = ctx, model, tokenizer, template
        self.trainer, self.kv_dtype, self.matvec = trainer, kv_dtype, matvec
        self.context_length = model.config.context_length
        self._decode = None
        self._stop_ids = frozenset(i for i in (tokenizer.eos_id,
                                               *(tokenizer.token_to_id(s)
                                                 for s in template.stop_strings()))
                                   if i is not None)

    def __repr__(self):
        return (f"LM({self.model!r}, template={self.template!r}"
                f"{', adapters' if self.trainer is not None else ''})")

    # ---- the forward ----
    def forward(self, tokens, cache: KVCache) -> Tensor:
        """Logits [1, vocab] of the last of `tokens`, which follow the cache's positions; the
        cache takes their keys and values. Call under no_grad and an exec scope."""
        return self.through(self.model.embed(tokens), cache)

    def through(self, x: Tensor, cache: KVCache) -> Tensor:
        """forward from the embedded rows x [n, embed] on: every layer, then the head."""
        m = self.model
        n = x.shape[0]
        table = m.rope_rows(cache.table, cache.pos, n)
        ad = self.trainer.adapters if self.trainer is not None else None
        for l in range(m.config.num_layers):
            x = m.layer(l, x, table, None if ad is None else _Lora(ad[l], {}), kv=cache)
        cache.advance()
        if n > 1:
            x = x.narrow("seq", n - 1, 1)
        return m.head(x)

    # ---- prompts ----
    def encode(self, prompt) -> list:
        """A str is tokenized as is (no template), with BOS first when the file's
        add_bos_token asks for it (Gemma: without BOS it scores and continues text badly);
        a list of ints is taken as ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(i) for i in check_tokens("LM.generate", prompt, self.model.config.vocab)]
        else:
            raise InvalidArgumentType("LM.generate: expected the prompt as a str or a list of "
                                      f"token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidSequenceLength("LM.generate: expected a non-empty prompt, got none")
        return ids

    def render(self, messages) -> str:
        """The chat's text as the model file's template writes it, ending with the opener of
        the assistant's reply."""
        return self.template.render(messages, add_generation_prompt=True)

    # ---- generation ----
    def stream(self, prompt=None, *, messages=None, max_new: int = 64, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               repetition_penalty: float = 1.0, seed: int = 0, stop=None, result=None):
        """Yield the reply's text in pieces (see the module docstring). Give a `prompt` (str or
        ids, used as is) or `messages` (rendered with the template; its end-of-turn marker then
        stops the reply too). `result`, a list, receives the finished Generation."""
        if (prompt is None) == (messages is None):
            raise InvalidArgumentType("LM.stream: expected exactly one of prompt= or messages=")
        settings = Settings(temperature, top_k, top_p, min_p, repetition_penalty)
        if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral) or max_new < 0:
            raise InvalidArgument(f"LM.generate: max_new: expected an int >= 0, got {max_new!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise InvalidArgumentType(f"LM.generate: seed: expected an int, got {seed!r}")
        stops = _stop_strings(stop)
        if messages is not None:
            ids = self.encode(self.render(messages))
            stops = stops + tuple(s for s in self.template.stop_strings() if s not in stops)
        else:
            ids = self.encode(prompt)
        if len(ids) > self.context_length:
            raise ContextOverflow(f"LM.generate: the prompt has {len(ids)} tokens; the model's "
                                  f"context length is {self.context_length}")
        length = min(self.context_length, len(ids) + max_new)
        text = _Text(self.tokenizer, stops)
        out = Generation([], "", "max_new", len(ids))
        history = list(ids)
        ctx = self.ctx
        with no_grad():
            decode = self._decoder(length)
            cache = decode.cache
            t0 = time.perf_counter()
            token = None
            for step in range(max_new):
                with ctx.exec_scope():
                    logits = self.forward(ids, cache) if step == 0 else decode(token)
                    token = pick(logits, settings, seed, step, history)
                t1 = time.perf_counter()
                if step == 0:
                    out.prefill_s = t1 - t0
                else:
                    out.decode_s += t1 - t0
                    out.decode_steps += 1
                t0 = t1
                if token in self._stop_ids:
                    out.finish_reason = "stop"
                    break
                out.ids.append(token)
                history.append(token)
                piece = text.feed(token)
                if piece:
                    yield piece
                if text.stopped:
                    out.finish_reason = "stop"
                    break
                if cache.pos >= length and len(out.ids) < max_new:
                    out.finish_reason = "length"      # the context is full
                    break
                t0 = time.perf_counter()
        tail = text.finish()
        if tail:
            yield tail
        out.text = text.text
        if result is not None:
            result.append(out)

    def _decoder(self, length: int) -> "Decoder":
        """The LM's decoder with a cache of at least `length` positions, emptied. It is kept
        between replies (its recorded plan with it), and replaced by a larger one (rounded up
        to CACHE_STEP positions, at most the context length) when a reply needs more."""
        dec = self._decode
        if dec is None or dec.cache.length < length:
            size = min(self.context_length, -(-length // CACHE_STEP) * CACHE_STEP)
            self._decode = dec = None      # the old cache's memory goes first
            dec = self._decode = Decoder(self, KVCache(self.model, size, self.kv_dtype))
        dec.begin()
        return dec

    def generate(self, prompt, **settings) -> Generation:
        """The whole reply to `prompt` (str as is, or ids) as a Generation (see stream)."""
        box = []
        for _ in self.stream(prompt, result=box, **settings):
            pass
        return box[0]

    def chat(self, messages, **settings) -> Generation:
        """The assistant's reply to `messages` ([{"role", "content"}, ...]), rendered with the
        model file's chat template."""
        box = []
        for _ in self.stream(messages=messages, result=box, **settings):
            pass
        return box[0]


class Decoder:
    """One-token decode steps over a KVCache. A step is ~500 small launches, so after `WARM`
    eager steps three are recorded (fucina/exec/plan.py), and once their plan replays the
    third step's logits bit for bit, every later step is that plan run from C at the cache's
    position: the embedded token is copied into a fixed input row, the plan writes the cache
    row and the logits (the same buffer every step: read them before the next step). A region
    that cannot be fitted stays eager (`replaying` False)."""

    WARM = 1

    def __init__(self, lm: LM, cache: KVCache):
        self.lm, self.cache = lm, cache
        self.x = lm.ctx.zeros((1, lm.model.config.hidden), tags=("seq", "embed"))
        self.steps, self.recordings = 0, []
        self.plan, self.logits, self.eager = None, None, False

    @property
    def replaying(self) -> bool:
        return self.plan is not None

    def begin(self) -> None:
        """A new reply: the cache empties; a plan stays valid (its values are functions of the
        position), recordings of an unfinished fit are dropped."""
        self.cache.pos = 0
        self.recordings = []

    def __call__(self, token: int) -> Tensor:
        """The logits [1, vocab] after `token` (call under no_grad and an exec scope)."""
        lm, cache, x = self.lm, self.cache, self.x._raw
        e = lm.model.embed([token])._raw
        ew.run(x.ctx, "copy", "f32", x.shape, (e,), out=x)
        if self.plan is not None:
            self.plan.run(lm.ctx, cache.pos)
            cache.pos += 1
            return self.logits
        self.steps += 1
        model = lm.model
        model.q8_matvec = lm.matvec == "q8"      # decode steps only; the prompt stays exact
        try:
            if self.eager or self.steps <= self.WARM:
                return lm.through(self.x, cache)
            at = cache.pos
            with plan.record(lm.ctx) as rec:
                logits = lm.through(self.x, cache)
        finally:
            model.q8_matvec = False
        self.recordings.append((rec, logits._raw, at))
        if len(self.recordings) == 3:
            self._fit(logits)
        return logits

    def _fit(self, last: Tensor) -> None:
        (r1, out1, x1), (r2, _, _), (r3, _, x3) = self.recordings
        self.recordings = []
        fitted = plan.Plan.fit([r1, r2, r3], x1)
        if fitted is not None:
            # replay the third step (it rewrites the same cache row) and compare the bits
            fitted.run(self.lm.ctx, x3)
            logits = Tensor(out1, last.tags)
            if np.array_equal(logits.numpy().view(np.uint32), last.numpy().view(np.uint32)):
                self.plan, self.logits = fitted, logits
                return
        self.eager = True


def _stop_strings(stop) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    items = tuple(stop)
    for s in items:
        if not isinstance(s, str):
            raise InvalidArgumentType("LM.generate: stop: expected a str or a list of str, got "
                                      f"{s!r}")
    return tuple(s for s in items if s)


# ---------------------------------------------------------------------------------------------
# loading

def attach_adapters(model: Model, path, alpha=None) -> Trainer:
    """A Trainer over `model` holding the adapters of `path` (a finetune save directory or a
    PEFT adapter directory, fu.llm.peft.read), checked strictly against the model: every name,
    shape and dtype (AdaptersMismatch otherwise)."""
    import io as _io

    from safetensors.numpy import save as st_save
    from . import peft
    ad = peft.read(path, model.config, alpha)
    try:
        trainer = Trainer(model, ad.targets, LoraConfig(ad.rank, ad.alpha), 0)
        trainer.load_adapters(_io.BytesIO(st_save(ad.tensors)))
    except FucinaError as e:
        raise AdaptersMismatch(f"fu.llm.load: adapters {os.fspath(path)!r} do not fit the model "
                               f"({model.config.arch}, {model.config.num_layers} layers, hidden "
                               f"{model.config.hidden}): {type(e).__name__}: {e}") from None
    return trainer


def load(path, ctx, adapters=None, alpha=None, *, kv_dtype: str = "f32",
         think_off: bool = True, matvec: str = "exact") -> LM:
    """Model, tokenizer and chat template of one GGUF file (weights in place), with LoRA
    adapters from a finetune save directory applied on the fly when `adapters` is given.
    matvec="exact" (default): every product uses the stored weight exactly, in f32 (greedy
    ids equal transformers'); q4_0 / q4_1 / q5_0 / q5_1 matrices are also held in the
    decode gemv's interleaved layout (Model.for_matvec: their bytes twice, faster decode at
    one thread, the same bits); "q8": decode steps multiply q4_0/q4_1/q5_0/q5_1/q8_0 and
    q2_k..q6_k weights by the activation row rounded to 8 bits per group of 4 values with integer
    dots (Tensor.dot_q8), logits within ~0.5 % of the exact ones, so a greedy reply can part from
    the exact one after a near tie. On Zen 5 the exact path is now the faster one too
    (SmolLM2 Q4_1: q8 ~10 % slower at one thread, ~6 % at two); on Zen 3 (AVX2) q8 decodes
    SmolLM2 Q4_1 ~1.1x, Qwen2.5-Coder-0.5B Q4_K_M (q5_0 layers) ~1.3x and Gemma-3-270M
    Q4_K_M ~1.05x faster at one thread; measure on your CPU before choosing q8. Its bits are
    the same on AVX2 and AVX-512 hosts; a host without AVX2 runs "q8" as the exact
    product."""
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgumentType(f"fu.llm.load: kv_dtype: expected one of {KV_DTYPES}, got "
                                  f"{kv_dtype!r}")
    if matvec not in MATVECS:
        raise InvalidArgumentType(f"fu.llm.load: matvec: expected one of {MATVECS}, got "
                                  f"{matvec!r}")
    if adapters is not None and not isinstance(adapters, (str, bytes, os.PathLike)):
        raise InvalidArgumentType(f"fu.llm.load: adapters: expected a directory path (a finetune "
                                  f"save or PEFT adapter directory) or None, got "
                                  f"{type(adapters).__name__} {adapters!r}")
    if alpha is not None and adapters is None:
        raise InvalidArgumentType("fu.llm.load: alpha= is the adapters' scale; expected "
                                  "adapters= with it")
    f = gguf.read(path, ctx) if not isinstance(path, gguf.GGUFFile) else path
    tok = Tokenizer.from_gguf(f)
    template = ChatTemplate.from_gguf(f, tok, think_off=think_off)
    model = Model.from_gguf(ctx, f)
    if matvec == "exact":
        model.for_matvec()
    trainer = None if adapters is None else attach_adapters(model, adapters, alpha)
    return LM(ctx, model, tok, template, trainer, kv_dtype, matvec)
