"""Ternary-native ES (SPEC T-27): TQ2_0 genomes trained in place by sparse trit flips and the
EGGROLL vote-and-threshold update. The methods here are part of `fucina.es.Trainer`.

    tr = fu.es.Trainer(sigma=0.1, population=32, antithetic=True, ternary_flip_rate=0.002,
                       ternary_update_fraction=0.002)
    w = ctx.tensor(init, ("out", "in")).to("tq2_0")     # a genome: codes 0/1/2 = weights -d/0/+d
    tr.add_ternary_param(w, "w")                        # borrowed: w IS the training state
    stats = tr.step(evaluator)                          # perturb / eval / restore, then update

A genome of `len` logical elements is a run of TQ2_0 blocks: 256 two-bit codes and a f16 scale
d each (SPEC R-9, crumb layout in T-27). Only the codes train; d never changes. Float slots
(`add_param`) and ternary slots coexist in one trainer and share its reward pipeline, and the
float slots are bitwise unaffected by adding ternary ones (separate seed domain, separate
stream numbering).

Noise. Member n of iteration i flips F = max(1, round(flip_rate·len)) elements of every
genome: ternary member seed at(seed ^ TRITS_DOMAIN, i·population + n) (n's even twin under
antithetic sampling), slot k's stream at(member_seed ^ TRITS_DOMAIN, k), flip j: element
at(stream, 2j) % len moved one bin by +1 (at(stream, 2j + 1) odd) or −1, negated for the
antithetic odd member; moves clamp at the rails (code 0 down or 2 up stays). perturb records
each flip's old code, and restore replays that log in reverse: bitwise, collisions included.

Update (EGGROLL). With the trainer's shaped, antithetically folded coefficients C_s (SPEC T-25),
every stream's flips are regenerated unmirrored and vote[index] += f32(C_s·delta) in
stream-then-flip order (clamped no-op flips still vote). The nonzero votes are ranked by
(|vote| desc, index asc) and the top K = min(#votes, max(1, round(len·eff))) move one bin toward
sign(vote), eff = update_fraction / (1 + update_decay·iteration) (f64). All buffers are
allocated and the flips generated before the first parameter byte changes (mutate-last).

Kernels (fucina.codegen.es_ternary): the flip lists are a parallel map over flips; applying
flips, the undo replay and the vote-and-threshold update are order-dependent and run as one
chunk each, touching O(flips) elements rather than the genome. Every result is the same for any
thread count.

Replicas: `materialize_ternary_member(n, dst)` copies each genome into a caller-owned TQ2_0
tensor and applies member n's flips there (θ untouched), the twin of materialize_member for
member-parallel evaluation; `materialize_ternary_members` fills stacks of replicas.

Checkpoints (T-28): `save_checkpoint` adds `ternary.gguf` (each genome's blocks, byte for byte,
under its name — or `ternary.k` — as GGUF tq2_0 tensors) next to model.safetensors, and
trainer_state.json carries the es_ternary_* knobs; `load_checkpoint` checks the file strictly
(names, shapes, dtype, codes) before anything changes, then copies the blocks, scales included.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .ag.tensor import Tensor
from .errors import (CheckpointDtypeMismatch, CheckpointDuplicateName, CheckpointMissingEntry,
                     CheckpointShapeMismatch, CheckpointUnknownName, DTypeError, DuplicateParam,
                     IndexOutOfBounds, InvalidArgumentType, InvalidConfig, ReplicaShapeMismatch)
from .exec import es as xes
from .exec import es_ternary as xt
from .gguf import read as gguf_read
from .gguf import write as gguf_write
from .rng import at

__all__ = ["TRITS_DOMAIN", "TERNARY_DTYPE", "TERNARY_FILE", "TernaryMethods", "flip_count",
           "update_count", "round_half_away"]

TRITS_DOMAIN = 0x65735F7472697473  # "es_trits"
TERNARY_DTYPE = "tq2_0"
TERNARY_FILE = "ternary.gguf"
BLOCK = 256
MASK64 = (1 << 64) - 1
_SIGNS = np.array([1.0, -1.0], np.float32)     # a flip stream's coefficient: +1, or −1 mirrored
_SIGN_ADDR = int(_SIGNS.ctypes.data)


def round_half_away(x: float) -> int:
    """Round a finite x >= 0 to the nearest integer, halves away from zero (the reference's
    @round; Python's round() would send halves to even)."""
    f = math.floor(x)
    return int(f) + (1 if x - f >= 0.5 else 0)


def flip_count(flip_rate: float, length: int) -> int:
    """Flips per member on a genome of `length` elements: max(1, round(f64(rate)·len)), with
    the rate's float32 value."""
    return max(1, round_half_away(float(np.float32(flip_rate)) * length))


def update_count(fraction: float, decay: float, iteration: int, length: int) -> int:
    """The update's move cap max(1, round(len·eff)), eff = f64(fraction) / (1 + f64(decay)·i)."""
    eff = float(np.float32(fraction)) / (1.0 + float(np.float32(decay)) * float(iteration))
    return max(1, round_half_away(eff * length))


class _TernarySlot:
    """One registered genome: the caller's tensor (borrowed, kept alive), its storage, name and
    length, and the active member's flip list and undo log (sized to the flip count)."""

    __slots__ = ("tensor", "raw", "name", "length", "idx", "val", "undo", "applied")

    def __init__(self, tensor, raw, name, length):
        self.tensor, self.raw, self.name, self.length = tensor, raw, name, length
        self.idx = self.val = self.undo = None
        self.applied = 0

    def live(self, op: str):
        self.raw.ctx.check_open(op)
        return self.raw

    def flip_buffers(self, count: int):
        """(idx, val, undo) of at least `count` flips, reallocated when the count grew."""
        if self.idx is None or self.idx.numel < count:
            ctx = self.raw.ctx
            self.idx, self.val = ctx.empty((count,), "i64"), ctx.empty((count,), "f32")
            self.undo = ctx.empty((count,), "bool")
        return self.idx, self.val, self.undo


def _genome(t, where: str, what: str):
    """The TQ2_0 storage of tensor t, or the error saying what was expected."""
    if not isinstance(t, Tensor):
        raise InvalidArgumentType(f"{where}: {what}: expected a fucina Tensor, got "
                                  f"{type(t).__name__}")
    raw = t._live(where)
    if raw.dtype != TERNARY_DTYPE:
        raise DTypeError(f"{where}: {what}: expected a {TERNARY_DTYPE} tensor (a ternary genome, "
                         f"e.g. t.to('tq2_0')), got {raw.dtype}")
    return raw


class TernaryMethods:
    """The ternary half of es.Trainer (the trainer owns config, iteration, active_member and
    the list `_tslots`)."""

    __slots__ = ()

    # ---- registration ----
    def add_ternary_param(self, t, name: str | None = None, length: int | None = None) -> None:
        """Register a TQ2_0 tensor as a ternary genome, trained in place (borrowed). `length`,
        when given, is checked against the tensor (SPEC T-27's (blocks, length) form): a
        positive multiple of 256 covering exactly its blocks. InvalidConfig (length, a code 3
        anywhere, read-only storage such as a GGUF mapping), DTypeError, MemberActive,
        DuplicateParam (the same storage twice)."""
        where = "es.Trainer.add_ternary_param"
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentType(f"{where}: expected a str name, got {type(name).__name__}")
        what = f"genome {name or getattr(t, 'tags', '')!r}"
        raw = _genome(t, where, what)
        self._guard_idle(where)
        n = raw.numel
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, int) or length <= 0 \
                    or length % BLOCK:
                raise InvalidConfig(f"{where}: {what}: length: expected a positive multiple of "
                                    f"{BLOCK}, got {length!r}")
            if length != n:
                raise InvalidConfig(f"{where}: {what}: length {length} needs {length // BLOCK} "
                                    f"blocks, the tensor holds {n // BLOCK}")
        if raw.buf.readonly:
            raise InvalidConfig(f"{where}: {what}: expected writable storage (a genome trains in "
                                f"place), got a read-only buffer; copy it first (e.g. "
                                f"t.to('f32').to('tq2_0') or a fresh tensor)")
        if any(s.raw.addr == raw.addr for s in self._tslots):
            raise DuplicateParam(f"{where}: {what} shares its storage with a registered genome; "
                                 f"expected each storage once")
        bad = xt.invalid_element(raw.ctx, raw)
        if bad is not None:
            raise InvalidConfig(f"{where}: {what}: element {bad} holds crumb code 3; expected "
                                f"ternary codes 0, 1, 2")
        self._tslots.append(_TernarySlot(t, raw, name, n))

    def add_ternary_param_named(self, t, name: str, length: int | None = None) -> None:
        self.add_ternary_param(t, name, length)

    def ternary_param_count(self) -> int:
        return len(self._tslots)

    def ternary_names(self) -> list:
        return [s.name for s in self._tslots]

    # ---- seeds and counts (checkpoint contract) ----
    def ternary_member_seed(self, member: int) -> int:
        """at(seed ^ TRITS_DOMAIN, iteration·population + member) at the current iteration."""
        cfg = self.config
        return at(cfg.seed ^ TRITS_DOMAIN, (self.iteration * cfg.population + member) & MASK64)

    @staticmethod
    def ternary_slot_stream_seed(member_seed: int, k: int) -> int:
        """Ternary slot k's flip stream (always per slot: `noise` governs float slots only)."""
        return at(member_seed ^ TRITS_DOMAIN, k)

    def ternary_flip_count(self, length: int) -> int:
        return flip_count(self.config.ternary_flip_rate, length)

    def ternary_update_count(self, length: int) -> int:
        """The move cap of the next update on a genome of `length` elements."""
        cfg = self.config
        return update_count(cfg.ternary_update_fraction, cfg.ternary_update_decay,
                            self.iteration, length)

    def _flips_of(self, ctx, length: int, k: int, member: int, idx, val, count: int) -> None:
        """Member `member`'s flips of slot k (mirrored for the antithetic odd member) into
        idx / val (val = the ±1 deltas)."""
        cfg = self.config
        mirror = int(cfg.antithetic and member & 1)
        base = (self.iteration * cfg.population + self._noise_member(member)) & MASK64
        xt.flips(ctx, _SIGN_ADDR + 4 * mirror, idx, val, 1, count, length,
                 cfg.seed ^ TRITS_DOMAIN, base, 1, TRITS_DOMAIN, k)

    # ---- in place ----
    def _stage_perturb(self, member: int) -> list:
        """Every genome's flips for member, generated into its flip buffers; nothing moved."""
        where = "es.Trainer.perturb"
        raws = [s.live(where) for s in self._tslots]
        staged = []
        for k, (s, raw) in enumerate(zip(self._tslots, raws)):
            count = self.ternary_flip_count(s.length)
            idx, val, undo = s.flip_buffers(count)
            self._flips_of(raw.ctx, s.length, k, member, idx, val, count)
            staged.append((s, raw, count))
        return staged

    @staticmethod
    def _perturb_ternary(staged) -> None:
        """Apply the staged flips in order, recording each element's old code."""
        for s, raw, count in staged:
            xt.apply(raw.ctx, "perturb", raw.addr, s.idx, s.val, s.undo, count)
            s.applied = count

    def _restore_ternary(self) -> None:
        """Replay every undo log in reverse (bitwise)."""
        raws = [s.live("es.Trainer.restore") for s in self._tslots]
        for s, raw in zip(self._tslots, raws):
            xt.apply(raw.ctx, "restore", raw.addr, s.idx, None, s.undo, s.applied)
            s.applied = 0

    # ---- replicas ----
    def materialize_ternary_member(self, member: int, dst) -> None:
        """dst[k] = genome k with member's flips applied, the genomes untouched: dst holds one
        caller-owned TQ2_0 tensor per genome (registration order, same shape; typically in a
        worker's own ExecContext, whose team runs the kernels). MemberActive,
        ReplicaShapeMismatch, DTypeError."""
        self._materialize_ternary([member], dst, "es.Trainer.materialize_ternary_member")

    def materialize_ternary_members(self, members, dst) -> None:
        """materialize_ternary_member for several members: dst[k] holds len(members) replicas
        of genome k back to back (e.g. a tq2_0 tensor [member, ...]), replica g receiving
        member members[g]. Same errors."""
        self._materialize_ternary(members, dst, "es.Trainer.materialize_ternary_members")

    def _materialize_ternary(self, members, dst, where: str) -> None:
        members = [self._check_member(m, where) for m in members]
        if not members:
            raise IndexOutOfBounds(f"{where}: expected at least one member, got none")
        self._guard_idle(where)
        dsts = list(dst)
        if len(dsts) != len(self._tslots):
            raise ReplicaShapeMismatch(f"{where}: expected {len(self._tslots)} replica tensors "
                                       f"(one per genome), got {len(dsts)}")
        G = len(members)
        pairs = []
        for k, (s, d) in enumerate(zip(self._tslots, dsts)):
            src = s.live(where)
            what = f"replica {k} (genome {s.name or k})"
            raw = _genome(d, where, what)
            if raw.lay.nbytes != G * src.lay.nbytes:
                raise ReplicaShapeMismatch(f"{where}: {what}: expected {G * src.lay.nbytes} bytes "
                                           f"({G} x {src.numel} {TERNARY_DTYPE}), got "
                                           f"{raw.lay.nbytes}")
            pairs.append((src, raw))
        for k, (src, raw) in enumerate(pairs):
            ctx, nbytes = raw.ctx, src.lay.nbytes
            count = self.ternary_flip_count(src.numel)
            idx, val = ctx.empty((count,), "i64"), ctx.empty((count,), "f32")
            for g, member in enumerate(members):
                out = raw.addr + g * nbytes
                xt.copy(ctx, src.addr, out, nbytes)
                self._flips_of(ctx, src.numel, k, member, idx, val, count)
                xt.apply(ctx, "flip", out, idx, val, None, count)

    # ---- the update ----
    def _stage_ternary(self, coeffs: np.ndarray) -> list:
        """Everything the ternary update needs, allocated, and every stream's flips generated
        (unmirrored, val = C_s·delta): no genome changes yet."""
        cfg = self.config
        staged = []
        S = len(coeffs)
        base = (self.iteration * cfg.population) & MASK64
        for k, s in enumerate(self._tslots):
            raw = s.live("es.Trainer.update")
            ctx = raw.ctx
            count = self.ternary_flip_count(s.length)
            n = S * count
            cbuf = ctx.from_numpy(coeffs, (S,), "f32", "es.Trainer.update")
            idx, val = ctx.empty((n,), "i64"), ctx.empty((n,), "f32")
            xt.flips(ctx, cbuf.addr, idx, val, S, count, s.length, cfg.seed ^ TRITS_DOMAIN, base,
                     2 if cfg.antithetic else 1, TRITS_DOMAIN, k)
            staged.append((raw, idx, val, n, self.ternary_update_count(s.length),
                           xt.vote_scratch(ctx, n)))
        return staged

    def _apply_ternary(self, staged) -> None:
        """The vote-and-threshold moves of every genome; `last_ternary_update` records
        (nonzero votes, moves applied) per genome."""
        self.last_ternary_update = [
            xt.vote(raw.ctx, raw.addr, idx, val, n, kcap, raw.numel, scratch)
            for raw, idx, val, n, kcap, scratch in staged]

    # ---- checkpoints (T-28) ----
    def _ternary_file_names(self, where: str) -> list:
        """The genomes' names in ternary.gguf (slot name, else "ternary.k"); unique."""
        names = [f"ternary.{k}" if s.name is None else s.name for k, s in enumerate(self._tslots)]
        seen = set()
        for name in names:
            if name in seen:
                raise CheckpointDuplicateName(f"{where}: two genomes are named "
                                              f"{name!r}; expected unique genome names")
            seen.add(name)
        return names

    def _save_ternary(self, directory) -> None:
        """ternary.gguf with every genome (replaced atomically, flushed to disk); without
        genomes, a stale file from an earlier save is removed."""
        path = os.path.join(os.fspath(directory), TERNARY_FILE)
        if not self._tslots:
            if os.path.exists(path):
                os.unlink(path)
            return
        where = "es.Trainer.save_checkpoint"
        names = self._ternary_file_names(where)
        for s in self._tslots:
            s.live(where)
        gguf_write(path, {name: s.tensor for name, s in zip(names, self._tslots)},
                   {"general.architecture": "fucina.es.ternary"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_ternary(self, directory, where: str) -> list:
        """[(genome storage, checkpoint storage)] from ternary.gguf, checked strictly against
        the registered genomes; nothing is copied yet."""
        path = os.path.join(os.fspath(directory), TERNARY_FILE)
        if not os.path.exists(path):
            if self._tslots:
                raise CheckpointMissingEntry(f"{where}: {path!r} is missing; expected the "
                                             f"{len(self._tslots)} ternary genome(s) of this "
                                             f"trainer")
            return []
        if not self._tslots:
            raise CheckpointUnknownName(f"{where}: {path!r} holds ternary genomes; expected none "
                                        f"(register them with add_ternary_param before loading)")
        f = gguf_read(path, self._tslots[0].live(where).ctx)
        names = self._ternary_file_names(where)
        unknown = sorted(set(f.tensors) - set(names))
        if unknown:
            raise CheckpointUnknownName(f"{where}: {TERNARY_FILE}: unexpected genome(s) {unknown}; "
                                        f"expected {names}")
        pairs = []
        for name, s in zip(names, self._tslots):
            if name not in f.tensors:
                raise CheckpointMissingEntry(f"{where}: {TERNARY_FILE}: genome {name!r} is missing")
            t = f.tensors[name]
            dtype = getattr(t, "dtype", getattr(t, "type_name", None))
            if dtype != TERNARY_DTYPE:
                raise CheckpointDtypeMismatch(f"{where}: {TERNARY_FILE}: genome {name!r}: expected "
                                              f"{TERNARY_DTYPE}, got {dtype}")
            raw, dst = t._live(where), s.live(where)
            if raw.shape != dst.shape:
                raise CheckpointShapeMismatch(f"{where}: {TERNARY_FILE}: genome {name!r}: expected "
                                              f"shape {dst.shape}, got {raw.shape}")
            bad = xt.invalid_element(raw.ctx, raw)
            if bad is not None:
                raise InvalidConfig(f"{where}: {TERNARY_FILE}: genome {name!r}: element {bad} "
                                    f"holds crumb code 3; expected ternary codes 0, 1, 2")
            pairs.append((dst, raw))
        return pairs

    @staticmethod
    def _commit_ternary(pairs) -> None:
        for dst, src in pairs:
            xes.copy_bytes(dst.ctx, src, dst)
