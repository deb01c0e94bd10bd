"""LoRA adapters (SPEC T-20): a trainable low-rank update beside a frozen linear weight.

    QAdapter = fu.lora.Adapter("embed", "q")             # tags: in -> out (the Zig type)
    ad = QAdapter.init(ctx, 1024, 2048, fu.lora.LoraConfig(rank=8, alpha=16), seed=7)
    with ctx.exec_scope():
        y = ad.apply(x, x.dot(w_q, "embed"), dropout_seed=step_seed)   # base + delta
        ...backward...
    ad.register_params(opt, "layers.0.q")                 # "layers.0.q.lora_a" / ".lora_b"
    ad.merge_into(w_f32)                                  # w += (alpha/r)·B·A, in place

delta(x) = scale·(dropout(x)·Aᵀ)·Bᵀ, scale = f32(alpha)/f32(rank), with A: [rank, in] tagged
("lora_r", in_tag), kaiming-uniform from the seed (RNG-10, row-major, fan_in = in), and
B: [out, rank] tagged (out_tag, "lora_r"), zeros — so the initial delta is exactly zero. The op
chain is dropout → dot(A, in_tag) → dot(B, "lora_r") → scale, always that order (the grads of
a checkpoint's resume depend on it; dropout with p = 0 is the identity and is skipped); apply
runs the scale and the add as one pass over the output (ag.elementwise.add_scaled), or, with
reuse_base, inside the product's GEMM straight into base's buffer (ag.matmul.
add_scaled_dot_into) — the same two roundings and gradients either way. project(x, w) goes
one step further for a frozen f32 w: the rank product is added in the tile stores of x·w's own
GEMM, and dxa·A in those of dx = g·w (ag.matmul.lora_linear; again the same bits). A and B are
caller-owned variables, never scope-adopted; everything else is a plain op, so the backward
rules are those of dropout, dot and scale.

Lifetime: delta/apply are composite ops; a result that will be backward()'d needs an open exec
scope (SPEC §3.0: ActiveExecScopeRequired otherwise). A and B are variables, so under grad mode
that is every call: evaluate under `fu.no_grad()` or a scope.

Merging: merge_into adds scale·(B·A) to an f32 constant weight [out_tag, in_tag] in place (one
matmul, then w_i += scale·d_i); merge_f16 widens an f16 weight, merges, and returns a NEW f16
tensor. Quantized weights are not mergeable: dequantize (w.to("f32")), merge, re-encode.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .ag.checks import require_scope, same_ctx
from .ag.elementwise import add_scaled
from .ag.engine import Leaf, no_grad, sole_view
from .ag.matmul import add_scaled_dot_into, lora_linear
from .ag.tensor import Tensor
from .errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidDropout, InvalidRank,
                     MutableDataRequiresNoGrad, ReadOnlyStorage, ShapeMismatch, TagError,
                     UseAfterRelease)
from .exec.quant import BLOCKS
from .io.state_dict import NamedTensor, NamedTensorMut
from .rng import kaiming_uniform_fill

__all__ = ["RANK_TAG", "LoraConfig", "Adapter"]

RANK_TAG = "lora_r"   # the reserved rank axis every adapter contracts over
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the delta is scaled by alpha / r, so alpha transfers across ranks) and the
    inverted-dropout probability applied to x inside delta when a dropout seed is given."""

    rank: int
    alpha: float
    dropout_p: float = 0.0


def _int(v, op: str, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an int {what}, got {type(v).__name__} {v!r}")
    return int(v)


def _f32(v, op: str, what: str) -> np.float32:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidArgumentType(f"{op}: expected a real {what}, got {type(v).__name__} {v!r}")
    with np.errstate(over="ignore"):
        return np.float32(v)


class Adapter:
    """`Adapter(in_tag, out_tag)` names the adapted linear's axes (the reference's generic
    type); `.init(ctx, in_dim, out_dim, config, seed)` returns an adapter holding its own A, B.
    One tag pair serves any number of adapters (one per layer)."""

    __slots__ = ("in_tag", "out_tag", "a", "b", "scale", "dropout_p")

    def __init__(self, in_tag: str, out_tag: str):
        for what, tag in (("in_tag", in_tag), ("out_tag", out_tag)):
            if not isinstance(tag, str) or not tag:
                raise TagError(f"lora.Adapter: expected {what} to be a non-empty str, got {tag!r}")
            if tag == RANK_TAG:
                raise TagError(f"lora.Adapter: {what} {tag!r} is reserved for the LoRA rank axis; "
                               f"expected another tag")
        if in_tag == out_tag:
            raise TagError(f"lora.Adapter: expected distinct in/out tags, got {in_tag!r} twice")
        self.in_tag, self.out_tag = in_tag, out_tag
        self.a = self.b = None
        self.scale = self.dropout_p = None

    def __repr__(self):
        if self.a is None:
            return f"lora.Adapter({self.in_tag!r} -> {self.out_tag!r}, no weights)"
        return (f"lora.Adapter({self.in_tag!r} -> {self.out_tag!r}, A {self.a.shape}, "
                f"B {self.b.shape}, scale={self.scale}, dropout_p={self.dropout_p})")

    # ---- creation / lifetime ----
    def init(self, ctx, in_dim: int, out_dim: int, config: LoraConfig, seed: int) -> "Adapter":
        """A new adapter for a frozen [out_dim, in_dim] weight: A kaiming-uniform from `seed`
        (same seed, bitwise-identical A), B zeros. InvalidRank unless 1 <= rank <=
        min(in_dim, out_dim); InvalidDropout unless 0 <= dropout_p < 1."""
        op = "lora.Adapter.init"
        if not isinstance(config, LoraConfig):
            raise InvalidArgumentType(f"{op}: expected a lora.LoraConfig, got "
                                      f"{type(config).__name__}")
        in_dim, out_dim = _int(in_dim, op, "in_dim"), _int(out_dim, op, "out_dim")
        rank = _int(config.rank, op, "rank")
        if not 1 <= rank <= min(in_dim, out_dim):
            raise InvalidRank(f"{op}: expected 1 <= rank <= min(in_dim, out_dim) = "
                              f"{min(in_dim, out_dim)}, got rank {rank}")
        p = _f32(config.dropout_p, op, "dropout_p")
        if not 0 <= p < 1:   # NaN fails too
            raise InvalidDropout(f"{op}: expected 0 <= dropout_p < 1, got {config.dropout_p!r}")
        alpha = _f32(config.alpha, op, "alpha")
        seed = _int(seed, op, "seed") & MASK64
        new = Adapter(self.in_tag, self.out_tag)
        new.a = ctx.variable(np.zeros((rank, in_dim), np.float32), (RANK_TAG, self.in_tag))
        kaiming_uniform_fill(seed, new.a, in_dim)
        new.b = ctx.variable(np.zeros((out_dim, rank), np.float32), (self.out_tag, RANK_TAG))
        new.scale = float(alpha / np.float32(rank))
        new.dropout_p = float(p)
        return new

    def release(self) -> None:
        """Return A and B to the pool now (the reference's deinit); the adapter is then unusable."""
        for t in (self.a, self.b):
            if t is not None:
                t.release()
        self.a = self.b = None

    def _weights(self, op: str) -> tuple[Tensor, Tensor]:
        if self.a is None:
            raise UseAfterRelease(f"{op}: the adapter holds no A/B; expected one returned by "
                                  f"Adapter(...).init(ctx, ...) and not released")
        return self.a, self.b

    # ---- forward ----
    @property
    def in_dim(self) -> int:
        return self._weights("lora.Adapter.in_dim")[0].shape[1]

    @property
    def out_dim(self) -> int:
        return self._weights("lora.Adapter.out_dim")[1].shape[0]

    @property
    def rank(self) -> int:
        return self._weights("lora.Adapter.rank")[0].shape[0]

    def delta_tags(self, x_tags: tuple) -> tuple:
        """The tags of delta(x): x's with in_tag removed and out_tag appended."""
        return tuple(t for t in x_tags if t != self.in_tag) + (self.out_tag,)

    def _check_input(self, op: str, x) -> tuple:
        a, _ = self._weights(op)
        if not isinstance(x, Tensor):
            raise InvalidArgumentType(f"{op}: expected x to be a fucina Tensor, got "
                                      f"{type(x).__name__}")
        same_ctx(op, a, x)
        r = x._live(op)
        if r.dtype != "f32":
            raise DTypeError(f"{op}: expected x of dtype f32, got {r.dtype}")
        if self.in_tag not in x.tags:
            raise TagError(f"{op}: expected x to carry the adapter's in tag {self.in_tag!r}, "
                           f"got tags {x.tags}")
        for tag in (self.out_tag, RANK_TAG):
            if tag in x.tags:
                raise TagError(f"{op}: expected x without the tag {tag!r} (the adapter's "
                               f"{'out' if tag == self.out_tag else 'reserved rank'} tag), got "
                               f"tags {x.tags}")
        n = r.shape[x.tags.index(self.in_tag)]
        if n != a.shape[1]:
            raise ShapeMismatch(f"{op}: expected x's {self.in_tag!r} axis of size {a.shape[1]} "
                                f"(the adapter's in_dim), got {n}")
        return self.delta_tags(x.tags)

    def _rank_side(self, x, dropout_seed):
        """dropout(x)·Aᵀ, the rank-r side of the product. Without dropout x itself (dropout(x,
        0) is an identity): then the dot's VJP can add its dx straight into the gradient the
        frozen projection left for x (engine.Node.into)."""
        p = self.dropout_p if dropout_seed is not None else 0.0
        d = x if p == 0.0 else x.dropout(p, dropout_seed)
        return d.dot(self.a, self.in_tag)

    def _delta(self, x, dropout_seed):
        return self._rank_side(x, dropout_seed).dot(self.b, RANK_TAG).scale(self.scale)

    def delta(self, x, dropout_seed: int | None = None):
        """scale·dropout(x)·Aᵀ·Bᵀ. dropout_seed None = eval (no dropout); a fresh per-step seed
        trains with dropout_p (only consumed when dropout_p > 0)."""
        op = "lora.Adapter.delta"
        self._check_input(op, x)
        require_scope(op, x, self.a, self.b)
        return self._delta(x, dropout_seed)

    def apply(self, x, base, dropout_seed: int | None = None, *, reuse_base: bool = False):
        """base + delta(x); base is f32 with exactly delta's tags (e.g. x.dot(w, in_tag)).
        reuse_base=True: the caller never reads base again, so the result may be written over
        its buffer, the product's sums added in as they are stored — the same bits without a
        [.., out] buffer for the product or a pass over it (a contiguous base that no other
        tensor views and that is not a variable; otherwise the plain ops)."""
        op = "lora.Adapter.apply"
        tags = self._check_input(op, x)
        if not isinstance(base, Tensor):
            raise InvalidArgumentType(f"{op}: expected base to be a fucina Tensor, got "
                                      f"{type(base).__name__}")
        same_ctx(op, x, base)
        rb = base._live(op)
        if rb.dtype != "f32":
            raise DTypeError(f"{op}: expected base of dtype f32 (frozen-weight dots produce f32), "
                             f"got {rb.dtype}")
        if base.tags != tags:
            raise TagError(f"{op}: expected base tagged {tags} (x with {self.in_tag!r} replaced "
                           f"by {self.out_tag!r}), got {base.tags}")
        sizes = dict(zip(x.tags, x._raw.shape))
        sizes[self.out_tag] = self.b.shape[0]
        want = tuple(sizes[t] for t in tags)
        if rb.shape != want:
            raise ShapeMismatch(f"{op}: expected base of shape {want}, got {rb.shape}")
        require_scope(op, x, base, self.a, self.b)
        xa = self._rank_side(x, dropout_seed)
        if reuse_base and not isinstance(base._node, Leaf) and rb.is_contiguous() \
                and sole_view(rb):
            return Tensor._result(*add_scaled_dot_into(base, xa, self.b, RANK_TAG, self.scale))
        return Tensor._result(*add_scaled(base, xa.dot(self.b, RANK_TAG), self.scale))

    def project(self, x, w, dropout_seed: int | None = None, compute: str = "f32"):
        """x.dot(w, in_tag) + delta(x) (compute="bf16": x.dot_bf16(w, in_tag) + delta(x)):
        apply() over the frozen projection w [out, in], with the rank product added in the
        projection's own GEMM (ag.matmul.lora_linear) when w is a frozen f32 weight (or bf16
        with compute="bf16"), x's in tag is its last axis and no dropout runs — the same
        bits as the dot and apply(reuse_base=True), without their pass over [.., out]
        forward or over [.., in] backward; otherwise exactly those two."""
        op = "lora.Adapter.project"
        self._check_input(op, x)
        if not isinstance(w, Tensor):
            raise InvalidArgumentType(f"{op}: expected w to be a fucina Tensor, got "
                                      f"{type(w).__name__}")
        if compute not in ("f32", "bf16"):
            raise InvalidArgument(f"{op}: expected compute 'f32' or 'bf16', got {compute!r}")
        same_ctx(op, x, w)
        rw = w._live(op)
        want = (self.b.shape[0], self.a.shape[1])
        if sorted(w.tags) != sorted((self.out_tag, self.in_tag)):
            raise TagError(f"{op}: expected w tagged ({self.out_tag!r}, {self.in_tag!r}), got "
                           f"{w.tags}")
        bf16 = compute == "bf16"
        p = self.dropout_p if dropout_seed is not None else 0.0
        if (p != 0.0 or rw.dtype not in (("f32", "bf16") if bf16 else ("f32",))
                or w.requires_grad or x._raw.rank != 2
                or x.tags[-1] != self.in_tag or w.tags != (self.out_tag, self.in_tag)):
            base = x.dot_bf16(w, self.in_tag) if bf16 else x.dot(w, self.in_tag)
            return self.apply(x, base, dropout_seed, reuse_base=True)
        if rw.shape != want:
            raise ShapeMismatch(f"{op}: expected w of shape {want}, got {rw.shape}")
        require_scope(op, x, self.a, self.b)
        return Tensor._result(*lora_linear(x, w, self.a, self.b, self.scale, bf16))

    # ---- training / state dicts ----
    def register_params(self, opt, prefix: str) -> None:
        """opt.add_param(A, name=prefix + ".lora_a") then B as prefix + ".lora_b" (any optimizer
        or fu.es.Trainer). The adapter must outlive the optimizer."""
        a, b = self._weights("lora.Adapter.register_params")
        opt.add_param(a, name=prefix + ".lora_a")
        opt.add_param(b, name=prefix + ".lora_b")

    def named_tensors(self, prefix: str) -> list:
        """[NamedTensor prefix.lora_a, prefix.lora_b] for fu.io.save_state_dict (borrowed)."""
        a, b = self._weights("lora.Adapter.named_tensors")
        return [NamedTensor.of(prefix + ".lora_a", a), NamedTensor.of(prefix + ".lora_b", b)]

    def named_tensors_mut(self, prefix: str) -> list:
        """The load-side twin of named_tensors, for fu.io.load_state_dict."""
        a, b = self._weights("lora.Adapter.named_tensors_mut")
        return [NamedTensorMut.of(prefix + ".lora_a", a), NamedTensorMut.of(prefix + ".lora_b", b)]

    # ---- merging ----
    def _check_base(self, op: str, w, dtype: str, other: str) -> None:
        a, b = self._weights(op)
        if not isinstance(w, Tensor):
            raise InvalidArgumentType(f"{op}: expected a fucina Tensor weight, got "
                                      f"{type(w).__name__}")
        same_ctx(op, a, w)
        r = w._live(op)
        if r.dtype in BLOCKS:
            raise DTypeError(f"{op}: a quantized ({r.dtype}) weight is not mergeable; expected "
                             f"{dtype} (dequantize with w.to('f32'), merge, then re-encode)")
        if r.dtype != dtype:
            raise DTypeError(f"{op}: expected a {dtype} weight, got {r.dtype}"
                             + (f" (use {other})" if other else ""))
        if w.tags != (self.out_tag, self.in_tag):
            raise TagError(f"{op}: expected a weight tagged {(self.out_tag, self.in_tag)}, got "
                           f"{w.tags}")
        want = (b.shape[0], a.shape[1])
        if r.shape != want:
            raise ShapeMismatch(f"{op}: expected a weight of shape {list(want)} [out, in], got "
                                f"{list(r.shape)}")

    def _add_delta(self, w) -> None:
        """w += scale·(B·A): one matmul, then the elementwise w_i + scale·d_i (no FMA)."""
        with no_grad():
            d = self.b.matmul(self.a, "plain", (self.out_tag, self.in_tag))
            w.add_scaled_in_place(d, self.scale)
        d.release()

    def merge_into(self, w) -> None:
        """w += scale·(B·A) in place; w an f32 constant tagged (out_tag, in_tag). A variable
        (it may sit in a recorded graph) raises MutableDataRequiresNoGrad, a read-only mapping
        ReadOnlyStorage."""
        op = "lora.Adapter.merge_into"
        self._check_base(op, w, "f32", "merge_f16 for f16 weights")
        if w.requires_grad:
            raise MutableDataRequiresNoGrad(f"{op}: expected a constant weight, got a variable "
                                            f"(merging would invalidate recorded forwards)")
        if w._raw.buf.readonly:
            raise ReadOnlyStorage(f"{op}: expected writable storage, got a read-only "
                                            f"buffer (a GGUF mapping?); merge into a copy")
        self._add_delta(w)

    def merge_f16(self, w) -> Tensor:
        """A NEW f16 tensor: f16(f32(w) + scale·(B·A)); w (f16, (out_tag, in_tag)) is untouched."""
        op = "lora.Adapter.merge_f16"
        self._check_base(op, w, "f16", "merge_into for f32 weights")
        with no_grad():
            wide = w.to("f32")
            self._add_delta(wide)
            out = wide.to("f16")
        wide.release()
        return out
