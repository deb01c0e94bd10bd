"""Evolution strategies (SPEC T-25, T-26, T-28): gradient-free training by seeded noise.

    tr = fu.es.Trainer(sigma=0.1, alpha=0.1, population=128, antithetic=True, seed=42)
    for name, t in model_params: tr.add_param(t, name)
    stats = tr.step(evaluator)            # evaluator.eval(member) -> reward, in place
    # or member-parallel on replicas:
    tr.evaluate_members(evaluator, rewards, workers=4)   # evaluator.eval_member(worker, member)
    stats = tr.update(rewards)

The update is θ += (α/N)·Σ_n C_n·ε_n — no 1/σ (folded into α), no optimizer state. C_n are
the shaped rewards (z-score, centered ranks or raw), ε_n member n's noise. Noise is never
stored: member n's noise at iteration i is a pure function of (config.seed, i, n) — the
checkpoint contract of SPEC T-25 — so perturb, restore and update each regenerate it inside
their generated kernels (fucina.codegen.es), bitwise identical for any thread count.

Seeds. member_seed(n) = at(seed ^ SEED_DOMAIN, iteration·population + n); under antithetic
sampling members 2k and 2k+1 share member 2k's draw with opposite signs, and the update folds
each pair to one stream with coefficient C_2k − C_2k+1. Slot k's stream is at(member_seed ^
NOISE_DOMAIN, k) ("iid") or the member seed itself ("correlated": same-length slots get the same
noise, the reference library's reseeding artifact, kept). Element j of a stream is RNG-7
gaussian_fill_at_fast(stream, j).

In place or on replicas. `perturb(n)` / `restore(n)` move the shared parameters to member n
and back (one member at a time: MemberActive / MemberNotActive guard it); restore either
regenerates and subtracts (exact up to (x + t) − t rounding) or copies a per-iteration snapshot
back (bitwise). `materialize_member(n, replicas)` writes θ + σ·ε_n into caller-owned replica
tensors without touching θ (`materialize_members` fills a stack of replicas, one launch per
slot) — the member-parallel path: each worker owns its replicas and its own ExecContext,
`evaluate_members` hands members out from a shared counter, and only the scalar rewards cross
threads. The shared θ changes only in `update`.

Distributed evaluation (design; a later issue builds it on Ray or Dask). Everything a remote
worker needs to score member n is the triple (seed, iteration, member) — `member_task(n)`
returns it as a small picklable MemberTask — and everything it sends back is one float.
Each remote worker runs a full replica Trainer over its own copy of θ (same config, same
registration order, built from the same initial checkpoint):

    driver:  tasks = [tr.member_task(n) for n in range(N)]
             rewards = gather(remote.score.submit(task) for task in tasks)   # floats only
             broadcast(rewards); tr.update(rewards)
    worker:  score(task):  replica_tr.materialize_task(task, replica); return reward(replica)
             on broadcast: replica_tr.update(rewards)                        # same bits as the driver

The update is a deterministic function of (θ, seed, iteration, rewards) whose kernels give the
same bits for any thread count, chunking and vector width (per-element f32 ops in a fixed order,
never contracted to FMA), so every worker's θ stays bitwise equal to the driver's without ever
shipping θ or noise; `materialize_task` refuses a task of another seed or
iteration (a worker that missed an update). A restarted worker reloads the latest checkpoint
(T-28: θ + (seed, iteration)) and continues. evaluate_members' contract — workers pull member
indices (or blocks of consecutive members, scored by one batched forward: a list of tasks on
the wire), the first error stops the fan-out, rewards land by member index — is the one the
distributed engine keeps, with futures in place of threads.

Anchored weight decay (T-26): after each update, θ is pulled toward θ₀ (`capture_anchor`,
taken once after registration and BEFORE a checkpoint load): l2 θ₀ + (1 − αλ)(θ − θ₀), l1 the
soft threshold of θ − θ₀ by αλ. It runs fused in the update kernel.

Checkpoints (T-28): `save_checkpoint(dir, registry)` writes model.safetensors (or
adapters.safetensors) and trainer_state.json with the es_* fields; `load_checkpoint` takes
seed, population, noise scheme, antithetic, σ, α and the AWD settings from the checkpoint,
validates them, restores the iteration and loads the parameters: (seed, iteration) regenerate
the population from there on.

Rewards are float32 (as the reference's); they must be finite — a NaN poisons the z-score of
the whole iteration (score failed rollouts 0.0 in the evaluator).

Ternary genomes (T-27): `add_ternary_param` registers a TQ2_0 tensor trained in place by trit
flips and the EGGROLL vote-and-threshold update on the same shaped rewards — see
fucina.es_ternary, whose TernaryMethods are part of this Trainer. perturb/restore/update and
the checkpoints cover both kinds of slot; NoParams means neither kind is registered.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .ag.tensor import Tensor
from .errors import (AnchorMissing, CheckpointConfigMismatch, DTypeError, DuplicateParam,
                     IndexOutOfBounds, InvalidArgumentType, InvalidConfig, InvalidTrainerState,
                     MemberActive, MemberNotActive, NoParams, NonContiguousParam,
                     ReplicaShapeMismatch, RewardCountMismatch, UnsupportedDType)
from .es_ternary import TRITS_DOMAIN, TernaryMethods
from .exec import es as xes
from .exec import rng as xrng
from .exec.raw import RawTensor
from .io.checkpoint import (ADAPTERS_STATE_FILE, MODEL_STATE_FILE, TrainerState, begin_save,
                            load_trainer_state, save_trainer_state, write_file_atomic)
from .rng import GAMMA, at

__all__ = ["EsConfig", "EsStats", "MemberTask", "Trainer", "SEED_DOMAIN", "NOISE_DOMAIN",
           "TRITS_DOMAIN", "PARAM_DTYPES", "MAX_WORKERS"]

SEED_DOMAIN = 0x65735F7365656473   # "es_seeds"
NOISE_DOMAIN = 0x65735F6E6F697365  # "es_noise"
PARAM_DTYPES = ("f32", "f16", "bf16")
MAX_WORKERS = 64
MASK64 = (1 << 64) - 1

NOISE_SCHEMES = ("iid", "correlated")
RESTORE_MODES = ("regenerate", "snapshot")
ANCHOR_DECAYS = ("none", "l1", "l2")
REWARD_NORMS = ("z_score", "centered_ranks", "none")
_NOISE_CODE = {"iid": 0, "correlated": 1}          # trainer_state.json es_noise
_DECAY_CODE = {"none": 0, "l1": 1, "l2": 2}         # trainer_state.json es_anchor_decay


def _f32(x) -> np.float32:
    return np.float32(x)


# ---------------------------------------------------------------------------------------------
# configuration

@dataclass(frozen=True)
class EsConfig:
    """SPEC T-25's knobs. Floats are the reference's f32 values (rounded to float32 on use)."""

    sigma: float = 0.001
    alpha: float | None = None          # None: sigma / 2
    population: int = 30
    antithetic: bool = False
    noise: str = "iid"                  # iid | correlated
    restore_mode: str = "regenerate"    # regenerate | snapshot
    cache_streams: bool = False
    anchor_decay: str = "none"          # none | l1 | l2
    anchor_lambda: float = 0.0
    reward_norm: str = "z_score"        # z_score | centered_ranks | none
    ternary_flip_rate: float = 0.001
    ternary_update_fraction: float = 0.005
    ternary_update_decay: float = 0.0
    seed: int = 42

    def alpha_value(self) -> float:
        """alpha, or sigma / 2, in float32."""
        return float(_f32(self.alpha) if self.alpha is not None else _f32(self.sigma) / _f32(2))


def _real(cfg, name: str) -> np.float32:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidConfig(f"es.Trainer: {name}: expected a real number, got {v!r}")
    with np.errstate(over="ignore"):
        return _f32(v)


def _choice(cfg, name: str, options) -> None:
    v = getattr(cfg, name)
    if v not in options:
        raise InvalidConfig(f"es.Trainer: {name}: expected one of {options}, got {v!r}")


def _flag(cfg, name: str) -> None:
    if not isinstance(getattr(cfg, name), bool):
        raise InvalidConfig(f"es.Trainer: {name}: expected a bool, got {getattr(cfg, name)!r}")


def validate_config(cfg: EsConfig) -> EsConfig:
    """SPEC T-25's checks (InvalidConfig), on the float32 values the trainer uses."""
    if not isinstance(cfg, EsConfig):
        raise InvalidArgumentType(f"es.Trainer: expected an EsConfig, got {type(cfg).__name__}")
    sigma = _real(cfg, "sigma")
    if not (np.isfinite(sigma) and sigma > 0):
        raise InvalidConfig(f"es.Trainer: sigma: expected a finite float32 > 0, got {cfg.sigma!r}")
    if cfg.alpha is not None:
        alpha = _real(cfg, "alpha")
        if not (np.isfinite(alpha) and alpha > 0):
            raise InvalidConfig(f"es.Trainer: alpha: expected None or a finite float32 > 0, got "
                                f"{cfg.alpha!r}")
    p = cfg.population
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 2:
        raise InvalidConfig(f"es.Trainer: population: expected an int >= 2, got {p!r}")
    for name in ("antithetic", "cache_streams"):
        _flag(cfg, name)
    if cfg.antithetic and p % 2:
        raise InvalidConfig(f"es.Trainer: population: antithetic sampling pairs members, expected "
                            f"an even population, got {p}")
    _choice(cfg, "noise", NOISE_SCHEMES)
    _choice(cfg, "restore_mode", RESTORE_MODES)
    _choice(cfg, "anchor_decay", ANCHOR_DECAYS)
    _choice(cfg, "reward_norm", REWARD_NORMS)
    for name in ("ternary_flip_rate", "ternary_update_fraction"):
        v = _real(cfg, name)
        if not (v > 0 and v <= 1):
            raise InvalidConfig(f"es.Trainer: {name}: expected 0 < value <= 1, got {getattr(cfg, name)!r}")
    v = _real(cfg, "ternary_update_decay")
    if not (np.isfinite(v) and v >= 0):
        raise InvalidConfig(f"es.Trainer: ternary_update_decay: expected a finite value >= 0, got "
                            f"{cfg.ternary_update_decay!r}")
    lam = _real(cfg, "anchor_lambda")
    if cfg.anchor_decay != "none":
        if not (np.isfinite(lam) and lam > 0):
            raise InvalidConfig(f"es.Trainer: anchor_lambda: anchor_decay={cfg.anchor_decay!r} "
                                f"expects a finite lambda > 0, got {cfg.anchor_lambda!r}")
        step = _f32(cfg.alpha_value()) * lam
        if cfg.anchor_decay == "l2" and not step < 1:
            raise InvalidConfig(f"es.Trainer: anchor_lambda: l2 expects alpha·lambda < 1, got "
                                f"{cfg.alpha_value()!r}·{cfg.anchor_lambda!r} = {float(step)!r}")
    s = cfg.seed
    if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= MASK64:
        raise InvalidConfig(f"es.Trainer: seed: expected an int in [0, 2^64), got {s!r}")
    return cfg


class EsStats(NamedTuple):
    """Reward statistics of one update, before shaping (f64 mean/std with ddof 0; f32 extrema)."""

    mean_reward: float
    std_reward: float
    min_reward: float
    max_reward: float


@dataclass(frozen=True)
class MemberTask:
    """What a remote worker needs to materialize one member (see the module docstring)."""

    seed: int
    iteration: int
    member: int


# ---------------------------------------------------------------------------------------------
# host-side seed and coefficient math (scalars; the element work runs in the kernels)

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def at_many(seed, index) -> np.ndarray:
    """RNG-2 `at` vectorised: uint64 array at(seed[i], index[i]) (either may be a scalar)."""
    with np.errstate(over="ignore"):
        i = np.asarray(index, dtype=np.uint64)
        z = np.asarray(seed, dtype=np.uint64) + (i + np.uint64(1)) * np.uint64(GAMMA)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def reward_stats(r32: np.ndarray) -> EsStats:
    """Sequential f64 sums, ddof 0, in member order."""
    vals = [float(v) for v in r32]
    mean = 0.0
    for v in vals:
        mean += v
    mean /= len(vals)
    var = 0.0
    for v in vals:
        d = v - mean
        var += d * d
    var /= len(vals)
    return EsStats(mean, math.sqrt(var), float(min(r32)), float(max(r32)))


def shaped_rewards(r32: np.ndarray, stats: EsStats, norm: str) -> np.ndarray:
    """The f32 coefficients C_n of SPEC T-25 step 2."""
    n = len(r32)
    if norm == "z_score":
        den = stats.std_reward + 1e-8
        return np.array([(float(v) - stats.mean_reward) / den for v in r32], dtype=np.float32)
    if norm == "centered_ranks":
        order = sorted(range(n), key=lambda m: (float(r32[m]), m))
        c = np.empty(n, dtype=np.float32)
        denom = _f32(n - 1)
        for rank, m in enumerate(order):
            c[m] = _f32(rank) / denom - _f32(0.5)
        return c
    return r32.copy()


# ---------------------------------------------------------------------------------------------
# the trainer

class _Slot:
    """One registered float parameter: its storage (kept alive here), its name, and the
    trainer-owned buffers of the same dtype (snapshot, anchor)."""

    __slots__ = ("raw", "name", "snapshot", "anchor")

    def __init__(self, raw: RawTensor, name):
        self.raw, self.name = raw, name
        self.snapshot = None
        self.anchor = None

    def live(self, op: str) -> RawTensor:
        self.raw.ctx.check_open(op)
        return self.raw


def _raw_of(t, where: str, what: str) -> RawTensor:
    if isinstance(t, Tensor):
        return t._live(where)
    if isinstance(t, RawTensor):
        t.ctx.check_open(where)
        return t
    raise InvalidArgumentType(f"{where}: {what}: expected a fucina Tensor, got {type(t).__name__}")


def _check_float(raw: RawTensor, where: str, what: str, err=DTypeError) -> None:
    if raw.dtype not in PARAM_DTYPES:
        raise err(f"{where}: {what}: expected an f32/f16/bf16 tensor, got {raw.dtype}")
    if not raw.is_contiguous():
        raise NonContiguousParam(f"{where}: {what}: expected a contiguous tensor, got shape "
                                 f"{raw.shape} with strides {raw.strides}")
    if raw.buf.readonly:  # perturb and update write θ in place: a read-only mapping would fault
        raise InvalidConfig(f"{where}: {what}: expected writable storage (ES updates parameters "
                            f"in place), got a read-only buffer such as a GGUF mapping; copy it "
                            f"first")


class Trainer(TernaryMethods):
    """The ES trainer of SPEC T-25 (see the module docstring), with the ternary genomes of
    T-27 (fucina.es_ternary).

    `Trainer(EsConfig(...))` or `Trainer(sigma=..., population=..., ...)`; InvalidConfig on a
    bad setting. Slot k = the k-th registered float parameter (the noise-stream index);
    ternary slots are numbered apart (their own flip streams)."""

    def __init__(self, config: EsConfig | None = None, **options):
        if config is None:
            config = EsConfig(**options)  # an unknown keyword is a TypeError
        elif options:
            raise InvalidArgumentType(f"es.Trainer: pass an EsConfig or keyword options, not both "
                                      f"(got {sorted(options)})")
        self.config = validate_config(config)
        self.iteration = 0
        self.active_member: int | None = None
        self._slots: list[_Slot] = []
        self._snapshot_valid = False
        self._cache: list | None = None      # [stream][slot] f32 RawTensor (cache_streams)
        self._filled: list[bool] = []
        self._has_anchor = False
        self._tslots: list = []              # ternary genomes (fucina.es_ternary)
        self.last_ternary_update: list = []  # (nonzero votes, moves) per genome, last update

    # ---- lifetime ----
    def close(self) -> None:
        """Drop every slot and trainer-owned buffer (they go back to their pools)."""
        self._drop_buffers()
        self._slots = []
        self._tslots = []
        self.active_member = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _drop_buffers(self) -> None:
        for s in self._slots:
            s.snapshot = s.anchor = None
        self._snapshot_valid = False
        self._cache, self._filled = None, []
        self._has_anchor = False

    # ---- configuration views ----
    def alpha_value(self) -> float:
        """The effective learning rate: alpha, defaulting to sigma / 2 (float32)."""
        return self.config.alpha_value()

    def param_count(self) -> int:
        """Registered slots, float and ternary."""
        return len(self._slots) + len(self._tslots)

    def element_count(self) -> int:
        """Elements of every slot, genome elements included."""
        return sum(s.raw.numel for s in self._slots) + sum(s.length for s in self._tslots)

    def names(self) -> list:
        return [s.name for s in self._slots]

    # ---- registration ----
    def add_param(self, t, name: str | None = None) -> None:
        """Register an f32/f16/bf16 tensor (variable, constant or typed): DTypeError,
        NonContiguousParam, InvalidConfig (read-only storage), MemberActive, DuplicateParam
        (same storage twice)."""
        where = "es.Trainer.add_param"
        if not isinstance(t, Tensor):
            raise InvalidArgumentType(f"{where}: expected a fucina Tensor, got {type(t).__name__}")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentType(f"{where}: expected a str name, got {type(name).__name__}")
        raw = t._live(where)
        _check_float(raw, where, f"param {name or t.tags!r}")
        self._guard_idle(where)
        if any(s.raw.addr == raw.addr for s in self._slots):
            raise DuplicateParam(f"{where}: param {name or t.tags!r} shares its storage with a "
                                 f"registered slot; expected each storage once")
        self._add_slot(_Slot(raw, name))

    def add_param_named(self, t, name: str) -> None:
        self.add_param(t, name)

    def add_registry(self, registry) -> int:
        """Register every entry of a ParamRegistry, trainable and frozen, in its order; entries
        whose storage is already registered are skipped (tied weights perturb once). All or
        nothing: UnsupportedDType (an entry not f32/f16/bf16), NonContiguousParam,
        InvalidConfig (read-only storage), MemberActive. Returns the number of slots added."""
        where = "es.Trainer.add_registry"
        self._guard_idle(where)
        found, seen = [], {s.raw.addr for s in self._slots}
        for i in range(registry.parameter_count()):
            view = registry.view(i)
            raw = _raw_of(registry.tensor(i), where, f"entry {view.name!r}")
            _check_float(raw, where, f"entry {view.name!r}", UnsupportedDType)
            if raw.addr in seen:
                continue
            seen.add(raw.addr)
            found.append(_Slot(raw, view.name))
        for slot in found:
            self._add_slot(slot)
        return len(found)

    def _add_slot(self, slot: _Slot) -> None:
        """A new slot invalidates what was sized for the old set: the snapshot, the stream
        cache and the anchor (a fresh capture_anchor is needed)."""
        self._drop_buffers()
        self._slots.append(slot)

    def _guard_idle(self, where: str) -> None:
        if self.active_member is not None:
            raise MemberActive(f"{where}: member {self.active_member} is applied in place; "
                               f"expected no active member (restore it first)")

    def capture_anchor(self) -> None:
        """Snapshot the current parameters as the AWD anchor θ₀ (never serialized). Call after
        registration and BEFORE loading a checkpoint on resume. MemberActive, NoParams."""
        where = "es.Trainer.capture_anchor"
        self._guard_idle(where)
        self._need_slots(where)
        for s in self._slots:
            raw = s.live(where)
            if s.anchor is None:
                s.anchor = raw.ctx.empty(raw.shape, raw.dtype)
            xes.copy_bytes(raw.ctx, raw, s.anchor)
        self._has_anchor = True

    def _need_slots(self, where: str) -> None:
        if not self._slots and not self._tslots:
            raise NoParams(f"{where}: expected at least one registered param, got none")

    # ---- seeds (checkpoint contract) ----
    def member_seed(self, member: int) -> int:
        """at(seed ^ SEED_DOMAIN, iteration·population + member) at the current iteration."""
        cfg = self.config
        return at(cfg.seed ^ SEED_DOMAIN, (self.iteration * cfg.population + member) & MASK64)

    def _noise_member(self, member: int) -> int:
        return member & ~1 if self.config.antithetic else member

    def _noise_sign(self, member: int) -> float:
        return -1.0 if self.config.antithetic and member & 1 else 1.0

    def _stream_index(self, member: int) -> int:
        return member >> 1 if self.config.antithetic else member

    def stream_count(self) -> int:
        return self.config.population // 2 if self.config.antithetic else self.config.population

    def slot_stream_seed(self, member_seed: int, k: int) -> int:
        """Slot k's noise stream for a member seed (iid: per slot; correlated: shared)."""
        return at(member_seed ^ NOISE_DOMAIN, k) if self.config.noise == "iid" else member_seed

    def _stream_table(self, member_seeds: np.ndarray) -> np.ndarray:
        """[slot, member] slot_stream_seed of every slot for a uint64 array of member seeds,
        as the int64 bit patterns the kernels read."""
        K = len(self._slots)
        if self.config.noise == "iid":
            table = at_many(member_seeds[None, :] ^ np.uint64(NOISE_DOMAIN),
                            np.arange(K, dtype=np.uint64)[:, None])
        else:
            table = np.broadcast_to(member_seeds, (K, len(member_seeds)))
        return table.view(np.int64)

    def _check_member(self, member, where: str) -> int:
        p = self.config.population
        if isinstance(member, bool) or not isinstance(member, numbers.Integral) or not 0 <= member < p:
            raise IndexOutOfBounds(f"{where}: expected a member index in [0, {p}), got {member!r}")
        return int(member)

    # ---- in place: perturb / restore ----
    def perturb(self, member: int) -> None:
        """θ += σ·ε_member in place over every float slot, and member's flips on every genome
        (T-27). MemberActive, NoParams."""
        where = "es.Trainer.perturb"
        member = self._check_member(member, where)
        self._guard_idle(where)
        self._need_slots(where)
        raws = [s.live(where) for s in self._slots]
        staged = self._stage_perturb(member)  # the genomes' flips, generated, nothing moved
        if self.config.restore_mode == "snapshot" and not self._snapshot_valid:
            for s, raw in zip(self._slots, raws):
                if s.snapshot is None:
                    s.snapshot = raw.ctx.empty(raw.shape, raw.dtype)
                xes.copy_bytes(raw.ctx, raw, s.snapshot)
            self._snapshot_valid = True
        self._apply(member, 1.0, raws)
        self._perturb_ternary(staged)
        self.active_member = member

    def restore(self, member: int) -> None:
        """Undo perturb(member): regenerate and subtract, or copy the snapshot back (bitwise);
        genomes replay their undo logs (bitwise). MemberNotActive when no member, or another
        one, is active."""
        where = "es.Trainer.restore"
        if self.active_member is None or self.active_member != member:
            active = "no member is active" if self.active_member is None else \
                f"the active member is {self.active_member}"
            raise MemberNotActive(f"{where}: expected the active member, got {member!r} ({active})")
        raws = [s.live(where) for s in self._slots]
        self._restore_ternary()  # the undo logs replayed (every genome checked live first)
        if self.config.restore_mode == "snapshot":
            for s, raw in zip(self._slots, raws):
                xes.copy_bytes(raw.ctx, s.snapshot, raw)
        else:
            self._apply(member, -1.0, raws)
        self.active_member = None

    def _apply(self, member: int, sign: float, raws) -> None:
        cfg = self.config
        ms = self.member_seed(self._noise_member(member))
        scaled = float(_f32(sign * self._noise_sign(member)) * _f32(cfg.sigma))
        stream = self._stream_index(member)
        cache = self._cache_row(stream) if cfg.cache_streams else None
        fill = cache is not None and not self._filled[stream]
        for k, raw in enumerate(raws):
            xes.perturb(raw.ctx, raw, raw, self.slot_stream_seed(ms, k), scaled,
                        None if cache is None else cache[k], fill)
        if fill:
            self._filled[stream] = True

    def _cache_row(self, stream: int) -> list:
        """Stream `stream`'s per-slot f32 noise buffers (allocated on first use)."""
        if self._cache is None:
            n = self.stream_count()
            self._cache, self._filled = [None] * n, [False] * n
        row = self._cache[stream]
        if row is None:
            row = self._cache[stream] = [s.raw.ctx.empty((s.raw.numel,), "f32") for s in self._slots]
        return row

    # ---- replicas ----
    def materialize_member(self, member: int, dst) -> None:
        """dst[k] = θ_k + σ·ε_member,k for every slot, θ untouched: dst is a sequence of
        tensors (one per slot, registration order, same dtype and byte length; caller-owned
        replicas, typically in a worker's own ExecContext, whose team runs the kernels).
        MemberActive, ReplicaShapeMismatch, DTypeError, NonContiguousParam."""
        where = "es.Trainer.materialize_member"
        member = self._check_member(member, where)
        self._guard_idle(where)
        pairs = self._replicas(dst, 1, where)
        ms = self.member_seed(self._noise_member(member))
        scaled = float(_f32(self._noise_sign(member)) * _f32(self.config.sigma))
        for k, (src, raw) in enumerate(pairs):
            xes.perturb(raw.ctx, src, raw, self.slot_stream_seed(ms, k), scaled)

    def materialize_members(self, members, dst) -> None:
        """materialize_member for several members at once, one kernel launch per slot: dst[k]
        holds len(members) replicas of slot k back to back (e.g. a tensor [member, ...] of
        stacked replicas), replica g receiving member members[g]. Same errors."""
        where = "es.Trainer.materialize_members"
        members = [self._check_member(m, where) for m in members]
        if not members:
            raise IndexOutOfBounds(f"{where}: expected at least one member, got none")
        self._guard_idle(where)
        G = len(members)
        pairs = self._replicas(dst, G, where)
        cfg = self.config
        noise_members = np.array([self._noise_member(m) for m in members], dtype=np.uint64)
        with np.errstate(over="ignore"):
            index = np.uint64(self.iteration * cfg.population & MASK64) + noise_members
        member_seeds = at_many(np.uint64(cfg.seed ^ SEED_DOMAIN), index)
        ctx = pairs[0][1].ctx
        seeds = ctx.from_numpy(self._stream_table(member_seeds), (len(pairs), G), "i64", where)
        signs = np.array([self._noise_sign(m) for m in members], dtype=np.float32)
        scaled = ctx.from_numpy(signs * _f32(cfg.sigma), (G,), "f32", where)
        for k, (src, raw) in enumerate(pairs):
            xes.perturb_members(raw.ctx, src, raw, seeds.addr + 8 * G * k, scaled.addr, G)

    def _replicas(self, dst, count: int, where: str) -> list:
        """[(slot storage, replica storage)] checked: one replica tensor per slot holding
        `count` copies of the slot's bytes, same dtype, contiguous."""
        dsts = list(dst)
        if len(dsts) != len(self._slots):
            raise ReplicaShapeMismatch(f"{where}: expected {len(self._slots)} replica tensors "
                                       f"(one per slot), got {len(dsts)}")
        pairs = []
        for k, (s, d) in enumerate(zip(self._slots, dsts)):
            src = s.live(where)
            raw = d._live(where) if isinstance(d, Tensor) else _raw_of(d, where, f"replica {k}")
            if raw.lay.nbytes != count * src.lay.nbytes or raw.dtype != src.dtype \
                    or not raw.lay.contiguous:
                self._bad_replica(raw, src, count, k, where)
            pairs.append((src, raw))
        return pairs

    def _bad_replica(self, raw, src, count: int, k: int, where: str):
        what = f"replica {k} (slot {self._slots[k].name or k})"
        if raw.lay.nbytes != count * src.lay.nbytes:
            raise ReplicaShapeMismatch(f"{where}: {what}: expected {count * src.lay.nbytes} bytes "
                                       f"({count} x {src.numel} {src.dtype}), got {raw.lay.nbytes}")
        if raw.dtype != src.dtype:
            raise DTypeError(f"{where}: {what}: expected dtype {src.dtype}, got {raw.dtype}")
        raise NonContiguousParam(f"{where}: {what}: expected a contiguous tensor, got shape "
                                 f"{raw.shape} with strides {raw.strides}")

    def member_task(self, member: int) -> MemberTask:
        """(seed, iteration, member): all a remote worker needs to materialize `member`."""
        member = self._check_member(member, "es.Trainer.member_task")
        return MemberTask(self.config.seed, self.iteration, member)

    def materialize_task(self, task: MemberTask, dst) -> None:
        """materialize_member for a task made by a trainer in the same state; InvalidConfig when
        the task's seed or iteration differs from this trainer's (an out-of-sync replica)."""
        if not isinstance(task, MemberTask):
            raise InvalidArgumentType(f"es.Trainer.materialize_task: expected a MemberTask, got "
                                      f"{type(task).__name__}")
        if (task.seed, task.iteration) != (self.config.seed, self.iteration):
            raise InvalidConfig(f"es.Trainer.materialize_task: expected a task of seed "
                                f"{self.config.seed} iteration {self.iteration}, got seed "
                                f"{task.seed} iteration {task.iteration}")
        self.materialize_member(task.member, dst)

    # ---- the update ----
    def update(self, rewards) -> EsStats:
        """θ += (α/N)·Σ_n C_n·ε_n (then AWD) and the ternary votes (T-27), iteration += 1;
        returns the reward stats. Mutate-last: MemberActive, NoParams, RewardCountMismatch and
        AnchorMissing are raised before any parameter changes."""
        where = "es.Trainer.update"
        cfg = self.config
        self._guard_idle(where)
        self._need_slots(where)
        r32 = np.asarray(rewards, dtype=np.float32).reshape(-1)
        if r32.size != cfg.population:
            raise RewardCountMismatch(f"{where}: expected {cfg.population} rewards (one per "
                                      f"member), got {r32.size}")
        if cfg.anchor_decay != "none" and not self._has_anchor:
            raise AnchorMissing(f"{where}: anchor_decay={cfg.anchor_decay!r} needs an anchor; "
                                f"expected capture_anchor() after registration")
        raws = [s.live(where) for s in self._slots]
        stats = reward_stats(r32)
        coeffs = shaped_rewards(r32, stats, cfg.reward_norm)
        if cfg.antithetic:
            coeffs = coeffs[0::2] - coeffs[1::2]
            members = np.arange(0, cfg.population, 2, dtype=np.uint64)
        else:
            members = np.arange(cfg.population, dtype=np.uint64)
        staged = self._stage_ternary(coeffs)  # ternary flips generated, nothing moved yet
        if raws:
            self._update_floats(raws, coeffs, members)
        self._apply_ternary(staged)
        self.iteration += 1
        self._snapshot_valid = False
        self._filled = [False] * len(self._filled)
        return stats

    def _update_floats(self, raws, coeffs, members) -> None:
        """update's float half: every slot element gets (α/N)·Σ_s C_s·ε_s, then AWD."""
        cfg = self.config
        S = len(coeffs)
        with np.errstate(over="ignore"):
            index = np.uint64(self.iteration * cfg.population & MASK64) + members
        member_seeds = at_many(np.uint64(cfg.seed ^ SEED_DOMAIN), index)
        scale = float(_f32(cfg.alpha_value()) / _f32(cfg.population))
        decay, knob = cfg.anchor_decay, 0.0
        if decay != "none":
            step = _f32(cfg.alpha_value()) * _f32(cfg.anchor_lambda)
            knob = float(_f32(1) - step if decay == "l2" else step)
        cached = cfg.cache_streams
        if cached:
            self._fill_all_streams(member_seeds, raws)
            entries = np.array([[self._cache[s][k].addr for s in range(S)]
                                for k in range(len(raws))], dtype=np.int64)
        else:
            entries = self._stream_table(member_seeds)
        ctx0 = raws[0].ctx
        where = "es.Trainer.update"
        table = ctx0.from_numpy(entries, (len(raws), S), "i64", where)
        cbuf = ctx0.from_numpy(coeffs, (S,), "f32", where)
        for k, (s, raw) in enumerate(zip(self._slots, raws)):
            xes.update(raw.ctx, raw, table.addr + 8 * S * k, cbuf.addr, S, scale, cached, decay,
                       s.anchor, knob)

    def _fill_all_streams(self, member_seeds, raws) -> None:
        """cache_streams: regenerate every stream not yet used this iteration into its cache."""
        for stream in range(self.stream_count()):
            row = self._cache_row(stream)
            if self._filled[stream]:
                continue
            ms = int(member_seeds[stream])
            for k, raw in enumerate(raws):
                xrng.gaussian_fill_at_fast(raw.ctx, row[k], self.slot_stream_seed(ms, k), 0, 1.0)
            self._filled[stream] = True

    # ---- drivers ----
    def step(self, evaluator) -> EsStats:
        """For each member: perturb, evaluator.eval(member) (or evaluator(member)), restore
        (also when eval raises, then re-raise); then update."""
        fn = getattr(evaluator, "eval", None) or evaluator
        rewards = []
        for member in range(self.config.population):
            self.perturb(member)
            try:
                value = fn(member)
            except BaseException:
                self.restore(member)
                raise
            self.restore(member)
            rewards.append(value)
        return self.update(rewards)

    def evaluate_members(self, evaluator, rewards, workers: int, block: int = 1):
        """rewards[m] = evaluator.eval_member(worker, m) (or evaluator(worker, m)) for every
        member, on min(workers, population, 64) threads (worker 0 is the caller) pulling members
        from a shared counter. Each worker must own its replica and ExecContext; θ is only read.
        The first error stops the fan-out and is raised after every worker joined.

        block > 1: workers pull runs of `block` consecutive members (the last may be shorter)
        and call evaluator.eval_members(worker, members) -> one reward per member — for
        evaluators that score a stack of replicas in one batched forward.

        InvalidConfig (workers or block < 1), MemberActive, RewardCountMismatch (rewards of the
        wrong length, or a block answered with the wrong number of rewards). Returns rewards."""
        where = "es.Trainer.evaluate_members"
        for name, v in (("workers", workers), ("block", block)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise InvalidConfig(f"{where}: {name}: expected an int >= 1, got {v!r}")
        self._guard_idle(where)
        N = self.config.population
        if len(rewards) != N:
            raise RewardCountMismatch(f"{where}: expected a rewards buffer of {N} entries, got "
                                      f"{len(rewards)}")
        if block == 1:
            one = getattr(evaluator, "eval_member", None) or evaluator

            def score(worker, members):
                return [one(worker, members.start)]
        else:
            many = getattr(evaluator, "eval_members", None) or evaluator

            def score(worker, members):
                got = list(many(worker, members))
                if len(got) != len(members):
                    raise RewardCountMismatch(f"{where}: eval_members(worker {worker}, {members}) "
                                              f"expected {len(members)} rewards, got {len(got)}")
                return got
        units = [range(m, min(m + block, N)) for m in range(0, N, block)]
        count = min(int(workers), len(units), MAX_WORKERS)
        if count == 1:
            for members in units:
                rewards[members.start:members.stop] = score(0, members)
            return rewards
        lock = threading.Lock()
        state = {"next": 0, "error": None}

        def run(worker: int) -> None:
            while True:
                with lock:
                    u = state["next"]
                    if state["error"] is not None or u >= len(units):
                        return
                    state["next"] = u + 1
                members = units[u]
                try:
                    values = score(worker, members)
                except BaseException as e:  # the first error wins; the others stop pulling
                    with lock:
                        if state["error"] is None:
                            state["error"] = e
                    return
                rewards[members.start:members.stop] = values

        threads = [threading.Thread(target=run, args=(w,), name=f"es-worker-{w}", daemon=True)
                   for w in range(1, count)]
        for t in threads:
            t.start()
        try:
            run(0)
        finally:
            for t in threads:
                t.join()
        if state["error"] is not None:
            raise state["error"]
        return rewards

    # ---- checkpoints (T-28) ----
    def trainer_state(self, step: int | None = None, **fields) -> TrainerState:
        """The trainer_state.json fields of this run: seed, es_* (σ, α as float32 values),
        es_iteration; step defaults to the iteration; `fields` adds others (data_seed, ...)."""
        cfg = self.config
        return TrainerState(
            step=self.iteration if step is None else step, seed=cfg.seed,
            es_sigma=float(_f32(cfg.sigma)), es_alpha=self.alpha_value(),
            es_population=cfg.population, es_noise=_NOISE_CODE[cfg.noise],
            es_antithetic=int(cfg.antithetic), es_anchor_decay=_DECAY_CODE[cfg.anchor_decay],
            es_anchor_lambda=float(_f32(cfg.anchor_lambda)),
            es_ternary_flip_rate=float(_f32(cfg.ternary_flip_rate)),
            es_ternary_update_fraction=float(_f32(cfg.ternary_update_fraction)),
            es_ternary_update_decay=float(_f32(cfg.ternary_update_decay)),
            es_iteration=self.iteration, **fields)

    def save_checkpoint(self, directory, registry, adapters: bool = False, step: int | None = None,
                        **fields) -> None:
        """A checkpoint directory (SPEC T-19/T-28): model.safetensors (adapters.safetensors
        when `adapters`) from the registry, ternary.gguf with the ternary genomes (if any),
        then trainer_state.json last. No optimizer file: ES has no optimizer state; (seed,
        es_iteration) regenerate the population."""
        where = "es.Trainer.save_checkpoint"
        self._guard_idle(where)
        state = self.trainer_state(step, **fields)
        self._ternary_file_names(where)  # unique genome names, checked before anything is written
        begin_save(directory)
        name = ADAPTERS_STATE_FILE if adapters else MODEL_STATE_FILE
        write_file_atomic(os.path.join(os.fspath(directory), name), registry.save_state_dict)
        self._save_ternary(directory)
        save_trainer_state(directory, state)

    def load_checkpoint(self, directory, registry, adapters: bool = False) -> TrainerState:
        """Resume: the checkpoint's seed, population, noise scheme, antithetic flag, σ, α and AWD
        settings replace this trainer's (validated: InvalidConfig), its iteration is restored
        and the registry's tensors and the ternary genomes are loaded (strict: the genomes
        must match ternary.gguf by name, shape and dtype). CheckpointConfigMismatch when an es_*
        field is missing or out of range; InvalidTrainerState when the directory holds no
        complete checkpoint. Transactional: on any error the trainer and the tensors are
        unchanged. Capture the AWD anchor BEFORE calling this."""
        where = "es.Trainer.load_checkpoint"
        self._guard_idle(where)
        state = load_trainer_state(directory)
        if state is None:
            raise InvalidTrainerState(f"{where}: {os.fspath(directory)!r} holds no complete "
                                      f"checkpoint (no trainer_state.json)")
        cfg = validate_config(config_from_state(state, self.config, where))
        name = ADAPTERS_STATE_FILE if adapters else MODEL_STATE_FILE
        genomes = self._read_ternary(directory, where)
        registry.load_state_dict(os.path.join(os.fspath(directory), name), strict=True)
        self._commit_ternary(genomes)
        self.config = cfg
        self.iteration = state.es_iteration
        self._snapshot_valid = False           # θ changed; the stream count may have too
        self._cache, self._filled = None, []
        return state


def config_from_state(state: TrainerState, base: EsConfig, where: str = "es") -> EsConfig:
    """`base` with the checkpoint's contract fields: seed, σ, α, population, noise, antithetic,
    AWD and ternary knobs. CheckpointConfigMismatch on a missing or out-of-range field."""
    def need(name):
        v = getattr(state, name)
        if v is None:
            raise CheckpointConfigMismatch(f"{where}: trainer_state.json lacks {name!r}; expected "
                                           f"an ES checkpoint")
        return v

    def code(name, value, table):
        names = {c: k for k, c in table.items()}
        if value not in names:
            raise CheckpointConfigMismatch(f"{where}: {name}: expected one of {sorted(names)}, "
                                           f"got {value}")
        return names[value]

    need("es_iteration")
    antithetic = 0 if state.es_antithetic is None else state.es_antithetic  # absent: pre-antithetic
    if antithetic not in (0, 1):
        raise CheckpointConfigMismatch(f"{where}: es_antithetic: expected 0 or 1, got {antithetic}")
    decay = 0 if state.es_anchor_decay is None else state.es_anchor_decay
    ternary = {name: getattr(state, "es_" + name) for name in
               ("ternary_flip_rate", "ternary_update_fraction", "ternary_update_decay")}
    return dataclasses.replace(
        base, seed=state.seed, sigma=need("es_sigma"), alpha=need("es_alpha"),
        population=need("es_population"), noise=code("es_noise", need("es_noise"), _NOISE_CODE),
        antithetic=bool(antithetic), anchor_decay=code("es_anchor_decay", decay, _DECAY_CODE),
        anchor_lambda=state.es_anchor_lambda if state.es_anchor_lambda is not None else 0.0,
        **{k: v for k, v in ternary.items() if v is not None})

