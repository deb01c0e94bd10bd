"""LoRA fine-tuning of a frozen decoder model (SPEC T-21): adapters on chosen projections of every
layer, the training forward and its loss.

    trainer = Trainer(model, Targets(q=True, v=True), fu.lora.LoraConfig(8, 16), seed=42)
    opt = fu.optim.AdamW(lr=1e-3, weight_decay=0.0)
    trainer.register_all_params(opt)
    with ctx.exec_scope():
        loss = trainer.loss(sample.inputs, sample.labels)   # step = step_counter, then += 1
        loss.backward()
    opt.step(); opt.zero_grad()

Targets in their fixed order (t = the index in TARGETS): q, k, v (embed -> q/k/v), o (attn ->
embed), gate, up (embed -> ffn), down (ffn -> embed). The adapter of layer l, target t is
initialised from seed at(seed, l·7 + t) and named "layers.<l>.<target>.lora_a/_b" (registered
and saved layer-major, in target order, A then B). Training step s draws its LoRA dropout seeds
as at(seed ^ 0x64726F7064726F70, (s·num_layers + l)·7 + t); evaluation passes none.
checkpoint_layers=True runs each layer as one checkpoint_with_context node (the frozen model,
RoPE table and seeds as `extra`, x and the layer's A/B as inputs): bitwise the same gradients,
activations of one layer at a time.

Memory: the forward runs in a graph scope (ExecContext.open_graph_scope) inside the caller's
exec scope, so of its intermediates only those a backward rule reads stay alive until
backward (the base projections, the LoRA deltas before their sums and the residual sums go
back to the pool as the forward goes); the loss or logits it returns is the caller's scope
borrow, and the caller's scope closing releases the graph behind it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import numpy as np

from ... import io
from ...ag.checkpoint import checkpoint_with_context
from ...ag.engine import is_grad_enabled, no_grad
from ...ag.loss import check_loss_scale, host_labels
from ...ag.tensor import Tensor
from ...errors import ExecScopeRequired, InvalidArgument, InvalidArgumentType, LabelLengthMismatch
from ...exec.matmul import SMALL_M
from ...exec.quant import GEMV_MAX_ROWS
from ...lora import Adapter, LoraConfig
from ...rng import MASK64, at
from ..data import IGNORE_INDEX
from .model import LINEARS, Model, check_tokens
from .replay import Replays

__all__ = ["Trainer", "Targets", "TARGETS", "IGNORE_INDEX", "DROPOUT_SALT"]

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DROPOUT_SALT = 0x64726F7064726F70   # "drop" "drop": keeps dropout streams apart from init streams


# the head's product keeps its bits on fewer rows only above the row counts where x·Wᵀ takes
# another kernel (f32: the dot path up to SMALL_M rows; quantized: the gemv up to GEMV_MAX_ROWS)
HEAD_MIN_ROWS = max(SMALL_M, GEMV_MAX_ROWS) + 1


def head_rows(ignored: np.ndarray):
    """The positions whose logits the loss needs (ascending), or None for all of them.

    An unsupervised position (label IGNORE_INDEX: a prompt token under mask_prompt, padding)
    adds nothing to the loss and gets a zero gradient, so its head product, norm and softmax
    need not run: chat SFT supervises a fraction of its tokens, and the head ([seq, embed] x
    [embed, vocab], forward and backward) is a quarter to over half of a LoRA step's matrix
    work. Kept at HEAD_MIN_ROWS rows or more (the first unsupervised ones fill up), so every
    kept row's logits take the kernel the whole sequence would: the loss and every gradient are
    bitwise those of the full head."""
    R = len(ignored)
    if R <= HEAD_MIN_ROWS or not ignored.any():
        return None
    keep = ~ignored
    short = HEAD_MIN_ROWS - int(keep.sum())
    if short > 0:
        keep[np.flatnonzero(ignored)[:short]] = True
    return np.flatnonzero(keep)


@dataclass(frozen=True)
class Sample:
    """One sample as the loss reads it (Trainer._sample): the eager loss and a replayed step
    (decoder/replay.py, which keys and feeds on it) prepare it once, the same way."""
    ids: np.ndarray            # the token ids, checked against the vocabulary
    labels: np.ndarray         # the labels of the head's rows (of every position when rows is None)
    ignored: np.ndarray        # which of those labels are IGNORE_INDEX
    mask: bytes                # which positions of the whole sample are ignored
    rows: np.ndarray | None    # head_rows: the positions the head runs on, None for all


@dataclass(frozen=True)
class Targets:
    """Which projections of every layer get an adapter (the defaults: q and v)."""

    q: bool = True
    k: bool = False
    v: bool = True
    o: bool = False
    gate: bool = False
    up: bool = False
    down: bool = False

    @classmethod
    def of(cls, value) -> "Targets":
        """A Targets as is, or one from target names, e.g. ("q", "k", "v", "o")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) or not hasattr(value, "__iter__"):
            raise InvalidArgumentType("decoder.Targets: expected a Targets or target names, got "
                                      f"{value!r}")
        names = list(value)
        for n in names:
            if n not in TARGETS:
                raise InvalidArgument(f"decoder.Targets: unknown target {n!r}; expected names from "
                                      f"{TARGETS}")
        return cls(**{n: n in names for n in TARGETS})

    def names(self) -> tuple:
        """The enabled targets in their fixed order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


class _Lora:
    """The adapt(name, x, base) hook of Model.layer for one layer: base + delta of the adapter
    bound to `name` (with that target's dropout seed), base alone for targets without one.
    Model never reads a base after handing it over, so the sum may reuse its buffer."""

    __slots__ = ("adapters", "seeds")

    def __init__(self, adapters: dict, seeds: dict):
        self.adapters, self.seeds = adapters, seeds

    def __call__(self, name, x, base):
        ad = self.adapters.get(name)
        return base if ad is None else ad.apply(x, base, self.seeds.get(name), reuse_base=True)

    def project(self, name, x, w, compute="f32"):
        """x · w plus the delta in one GEMM (Adapter.project); None without an adapter."""
        ad = self.adapters.get(name)
        return None if ad is None else ad.project(x, w, self.seeds.get(name), compute)


def _bound(ad: Adapter, a: Tensor, b: Tensor) -> Adapter:
    """ad's configuration over the given A/B tensors (a checkpoint recompute's fresh leaves)."""
    c = Adapter(ad.in_tag, ad.out_tag)
    c.a, c.b, c.scale, c.dropout_p = a, b, ad.scale, ad.dropout_p
    return c


@dataclass(frozen=True)
class _LayerExtra:
    """What a checkpointed layer needs besides its trainable inputs (kept by reference)."""

    model: Model
    layer: int
    table: object
    adapters: dict      # target -> the trainer's Adapter (configuration only)
    seeds: dict         # target -> dropout seed or None


def _layer_block(extra: _LayerExtra, x, *ab):
    names = tuple(extra.adapters)
    bound = {n: _bound(extra.adapters[n], ab[2 * i], ab[2 * i + 1]) for i, n in enumerate(names)}
    return extra.model.layer(extra.layer, x, extra.table, _Lora(bound, extra.seeds))


def _u64(op: str, what: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an int {what}, got {type(v).__name__} {v!r}")
    return int(v) & MASK64


class Trainer:
    """LoRA adapters over a frozen Model, with the training forward and loss of SPEC T-21.

    `adapters[l][target]` is the lora.Adapter of layer l (enabled targets only); `step_counter`
    counts loss calls (the dropout step); `checkpoint_layers` may be flipped between steps."""

    def __init__(self, model: Model, targets, lora_config: LoraConfig, seed: int,
                 checkpoint_layers: bool = False):
        op = "decoder.Trainer"
        if not isinstance(model, Model):
            raise InvalidArgumentType(f"{op}: expected a decoder.Model, got {type(model).__name__}")
        if not isinstance(lora_config, LoraConfig):
            raise InvalidArgumentType(f"{op}: expected a lora.LoraConfig, got "
                                      f"{type(lora_config).__name__}")
        if not isinstance(checkpoint_layers, bool):
            raise InvalidArgumentType(f"{op}: expected checkpoint_layers as a bool, got "
                                      f"{checkpoint_layers!r}")
        self.targets = Targets.of(targets)
        if not self.targets.names():
            raise InvalidArgument(f"{op}: expected at least one target, got none of {TARGETS}")
        self.model, self.lora_config = model, lora_config
        self.seed = _u64(op, "seed", seed)
        self.checkpoint_layers = checkpoint_layers
        self.step_counter = 0
        c = model.config
        dims = c.dims
        self.adapters = []
        for l in range(c.num_layers):
            layer = {}
            for t, name in enumerate(TARGETS):
                if getattr(self.targets, name):
                    _, tin, tout = LINEARS[name]
                    layer[name] = Adapter(tin, tout).init(model.ctx, dims[tin], dims[tout],
                                                          lora_config, at(self.seed, l * 7 + t))
            self.adapters.append(layer)
        self._replays = Replays(self)

    @property
    def replay(self) -> bool:
        """loss_backward replays steps of a repeating shape (decoder/replay.py); on by default."""
        return self._replays.enabled

    @replay.setter
    def replay(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise InvalidArgumentType(f"decoder.Trainer.replay: expected a bool, got {on!r}")
        self._replays.enabled = on
        if not on:
            self._replays.drop()

    def __repr__(self):
        return (f"decoder.Trainer({self.model!r}, targets={self.targets.names()}, "
                f"rank={self.lora_config.rank}, alpha={self.lora_config.alpha}, "
                f"step_counter={self.step_counter})")

    # ---- the forward ----
    def dropout_seeds(self, step: int | None, layer: int) -> dict:
        """target -> the LoRA dropout seed of (step, layer); all None when step is None."""
        if step is None:
            return {n: None for n in self.adapters[layer]}
        salt = (self.seed ^ DROPOUT_SALT) & MASK64
        L = self.model.config.num_layers
        return {n: at(salt, (step * L + layer) * 7 + TARGETS.index(n)) for n in self.adapters[layer]}

    def forward_logits(self, tokens, step: int | None, rows=None) -> Tensor:
        """Logits [seq, vocab] ("seq", "vocab") with every adapter applied; step None = eval (no
        dropout); only the positions `rows` (increasing, e.g. head_rows') when given. Under
        gradients it needs an open exec scope (ExecScopeRequired)."""
        op = "decoder.Trainer.forward_logits"
        self._need_scope(op)
        tokens = check_tokens(op, tokens, self.model.config.vocab)
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                                 or step < 0):
            raise InvalidArgumentType(f"{op}: expected step as an int >= 0 or None (eval), got "
                                      f"{step!r}")
        with self.model.ctx.graph_scope():
            logits = self._logits(tokens, step, rows=rows)
        return logits._to_scope()

    def _need_scope(self, op: str) -> None:
        if is_grad_enabled() and not self.model.ctx.scopes:
            raise ExecScopeRequired(f"{op}: the trainer's forward records a graph over the "
                                    f"adapters; expected `with ctx.exec_scope():` around it")

    def _logits(self, tokens: np.ndarray, step, last_only: bool = False, rows=None) -> Tensor:
        """The logits of every position, of the last (last_only), or of the positions `rows`
        (ascending indices; head_rows)."""
        m = self.model
        table = m.rope_table(0, len(tokens))
        x = m.embed(tokens)
        # a checkpoint node is keyed on the adapters requiring grad, not on grad mode: skip it
        # when nothing is recorded
        ckpt = self.checkpoint_layers and is_grad_enabled()
        for l, layer in enumerate(self.adapters):
            seeds = self.dropout_seeds(step, l)
            if ckpt:
                ab = [t for ad in layer.values() for t in (ad.a, ad.b)]
                x = checkpoint_with_context(_layer_block, _LayerExtra(m, l, table, layer, seeds),
                                            x, *ab)
            else:
                x = m.layer(l, x, table, _Lora(layer, seeds))
        if last_only:
            x = x.narrow("seq", len(tokens) - 1, 1)
        elif rows is not None:
            x = x.gather("seq", rows, "seq")
        return m.head(x)

    # ---- losses ----
    def loss(self, tokens, labels) -> Tensor:
        """loss_ext(tokens, labels, reduction="mean", loss_scale=1)."""
        return self.loss_ext(tokens, labels)

    def loss_ext(self, tokens, labels, reduction: str = "mean", loss_scale: float = 1.0) -> Tensor:
        """Cross-entropy of forward_logits(tokens, step_counter) against labels (one per token;
        IGNORE_INDEX = not supervised) with `reduction` ("mean" over supervised positions: 0
        when there are none), times loss_scale when it is not 1. Needs an open exec scope
        (ExecScopeRequired); the result is a scope borrow. step_counter advances by one.
        The head runs on the supervised positions only (head_rows; every position with
        reduction="none"): the same bits as the logits of all of them."""
        op = "decoder.Trainer.loss_ext"
        if not self.model.ctx.scopes:
            raise ExecScopeRequired(f"{op}: expected an open exec scope (`with ctx.exec_scope():`); "
                                    f"the loss and its graph are scope borrows")
        check_loss_scale(op, loss_scale)
        return self._sample_loss(self._sample(op, tokens, labels, reduction), reduction,
                                 loss_scale)

    def _sample(self, op: str, tokens, labels, reduction: str) -> Sample:
        """tokens and labels checked (one label per token, ids and labels inside the
        vocabulary), with the head's rows for `reduction` ("none": every position)."""
        n_tokens = len(tokens)
        n_labels = labels.numel if isinstance(labels, Tensor) else len(labels)
        if n_labels != n_tokens:
            raise LabelLengthMismatch(f"{op}: expected one label per token ({n_tokens}), got "
                                      f"{n_labels} labels")
        vocab = self.model.config.vocab
        ids = check_tokens(op, tokens, vocab)
        arr, ignored = host_labels("cross_entropy", labels, n_tokens, vocab, IGNORE_INDEX, ("seq",))
        rows = None if reduction == "none" else head_rows(ignored)
        mask = ignored.tobytes()
        if rows is not None:
            arr, ignored = arr[rows], ignored[rows]
        return Sample(ids, arr, ignored, mask, rows)

    def _sample_loss(self, s: Sample, reduction: str, loss_scale: float) -> Tensor:
        """loss_ext of a prepared sample and a checked loss_scale (in an open exec scope)."""
        step = self.step_counter
        # a graph scope: what backward does not read (base projections, LoRA deltas before
        # their sums, residual sums) goes back to the pool as the forward goes, instead of
        # living in the caller's scope until it closes; the loss alone is the caller's borrow
        with self.model.ctx.graph_scope():
            logits = self._logits(s.ids, step, rows=s.rows)
            ce = logits.cross_entropy_ext("vocab", s.labels, ignore_index=IGNORE_INDEX,
                                          reduction=reduction)
            del logits
            if loss_scale != 1:
                ce = ce.scale(loss_scale)
        self.step_counter = step + 1   # counted once the call succeeded
        return ce._to_scope()

    def loss_backward(self, tokens, labels, reduction: str = "mean",
                      loss_scale: float = 1.0) -> float:
        """loss_ext(tokens, labels, reduction, loss_scale), then its backward, in one call:
        the loss value; the adapters' gradients accumulate as backward's do. No scope needed.
        Steps of a shape that repeats run as a replay of a captured one (decoder/replay.py:
        the Python of the graph and the dispatch skipped), bitwise the eager step's loss and
        gradients; `replay = False` keeps every step eager."""
        return self._replays.loss_backward(tokens, labels, reduction, loss_scale)

    def eval_last_logits(self, tokens) -> Tensor:
        """The logits of the last position, [1, vocab] ("seq", "vocab"), caller-owned: no
        dropout, no graph, step_counter unchanged (for greedy generation)."""
        op = "decoder.Trainer.eval_last_logits"
        tokens = check_tokens(op, tokens, self.model.config.vocab)
        ctx = self.model.ctx
        with no_grad(), ctx.graph_scope():   # each intermediate freed once the next is made
            logits = self._logits(tokens, None, last_only=True)
            return Tensor(logits._live(op), logits.tags)   # caller-owned

    # ---- parameters and files ----
    def named_adapters(self):
        """(prefix, adapter) layer-major in target order: ("layers.0.q", ...), ..."""
        return [(f"layers.{l}.{n}", ad) for l, layer in enumerate(self.adapters)
                for n, ad in layer.items()]

    def register_all_params(self, opt) -> None:
        """Every A then B into `opt` (any optimizer, OptimizerSet group or ES trainer) under
        its registry name."""
        for prefix, ad in self.named_adapters():
            ad.register_params(opt, prefix)

    def named_tensors(self) -> list:
        """[NamedTensor] of every A/B in registry order, for fu.io.save_state_dict."""
        return [e for prefix, ad in self.named_adapters() for e in ad.named_tensors(prefix)]

    def save_adapters(self, writer) -> None:
        """Every A/B as one safetensors state dict (a binary file object, or a path written
        atomically)."""
        io.save_state_dict(writer, self.named_tensors())

    def load_adapters(self, reader) -> None:
        """Strict load of save_adapters' file: every name present, nothing extra, same shapes."""
        self.load_adapters_with_options(reader)

    def load_adapters_with_options(self, reader, *, strict: bool = True, aliases=()) -> None:
        """fu.io.load_state_dict into the adapters with its strict/aliases options."""
        entries = [e for prefix, ad in self.named_adapters() for e in ad.named_tensors_mut(prefix)]
        io.load_state_dict(reader, entries, strict=strict, aliases=aliases)
