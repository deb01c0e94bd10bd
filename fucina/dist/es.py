"""Evolution-strategies members on Ray actors, byte-identical to the single-process run.

Each actor holds a replica: an `es.Trainer` with its own copy of θ, registered exactly as on
the driver, and a `score(members)` that rewards members through `materialize_members` on the
actor's own replica tensors (θ is only read). The driver sends member tasks — (seed, iteration,
first member, last member): nothing else — and gets one float per member back. After the
driver's `update`, the rewards are broadcast and every actor applies the same update to its θ.
The update's kernels give the same bits on every machine and thread count (fucina.es), so θ
stays bitwise equal everywhere without ever shipping θ or noise.

    def build_replica():                       # runs inside each actor (and must be picklable)
        ctx = fu.ExecContext(threads=1)
        model = make_model(ctx)                 # the driver's construction
        tr = fu.es.Trainer(sigma=..., population=..., seed=...)
        reg = register(model, tr)               # same order, same names as on the driver
        return fu.dist.Replica(tr, reg, score=lambda members: [...])

    cluster = fu.dist.EsCluster(build_replica, trainer, registry, actors=2, ray="local")
    for it in range(iterations):
        rewards = cluster.evaluate(trainer)
        trainer.update(rewards)
        cluster.update(trainer, rewards)
    cluster.verify(trainer); cluster.close()

Faults. At start, and whenever an actor has to be brought back, the driver's θ travels once as
a checkpoint (T-28's files, through Ray's object store) followed by the rewards of every update
since: the actor loads the checkpoint and replays those updates, which lands it on the driver's
θ bit for bit. Actors restart by themselves (Ray `max_restarts`); a member task of an actor that
died is sent to another, and the restarted actor is restored before it gets work again.
ReplicaOutOfSync says an actor's iteration or seed is not the driver's (it is then restored);
WorkersLost that no actor is left.
"""
from __future__ import annotations

import collections
import hashlib
import io as _io
import numbers
import os
import tempfile
import time
from dataclasses import dataclass

from .. import es as _es
from ..errors import (InvalidArgumentType, InvalidConfig, ReplicaOutOfSync, RewardCountMismatch,
                      WorkersLost)
from .ray import Actors

__all__ = ["EsCluster", "Replica", "RESNAPSHOT_AFTER"]

RESNAPSHOT_AFTER = 256   # updates replayed on a restore before the driver refreshes its snapshot
RESTORE_TRIES = 6     # restore attempts, 0.2 s apart and doubling


@dataclass
class Replica:
    """What the replica builder returns inside an actor: the trainer holding this actor's θ,
    the ParamRegistry naming θ (the checkpoint schema; `adapters` = the LoRA file name), and
    score(members: range[, payload]) -> one float reward per member (payload: what the driver
    passed to EsCluster.evaluate, when it passed one)."""

    trainer: object
    registry: object
    score: object
    adapters: bool = False


def _digest(registry) -> str:
    """sha256 of θ as its safetensors state dict (the bytes a checkpoint would hold)."""
    buf = _io.BytesIO()
    registry.save_state_dict(buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _snapshot(trainer, registry, adapters: bool) -> dict:
    """The driver's checkpoint (T-28) as {file name: bytes}."""
    with tempfile.TemporaryDirectory(prefix="fucina-es-snapshot-") as d:
        trainer.save_checkpoint(d, registry, adapters=adapters)
        out = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out


class _EsActor:
    """The actor body (wrapped by ray.remote at run time: Ray is an optional import)."""

    def __init__(self, build):
        self.replica = build()
        if not isinstance(self.replica, Replica):
            raise InvalidArgumentType(f"fucina.dist.EsCluster: the replica builder must return a "
                                      f"fucina.dist.Replica, got {type(self.replica).__name__}")

    def _in_sync(self, seed: int, iteration: int, where: str) -> None:
        tr = self.replica.trainer
        if (tr.config.seed, tr.iteration) != (seed, iteration):
            raise ReplicaOutOfSync(f"{where}: this actor is at seed {tr.config.seed} iteration "
                                   f"{tr.iteration}; expected seed {seed} iteration {iteration}")

    def score(self, seed: int, iteration: int, start: int, stop: int, payload=None) -> list:
        self._in_sync(seed, iteration, "fucina.dist.EsCluster.score")
        members = range(start, stop)
        got = self.replica.score(members) if payload is None else self.replica.score(members,
                                                                                   payload)
        got = [float(r) for r in got]
        if len(got) != stop - start:
            raise RewardCountMismatch(f"fucina.dist.EsCluster.score: members {start}..{stop - 1}: "
                                      f"expected {stop - start} rewards, got {len(got)}")
        return got

    def update(self, seed: int, iteration: int, rewards) -> int:
        self._in_sync(seed, iteration, "fucina.dist.EsCluster.update")
        self.replica.trainer.update(rewards)
        return self.replica.trainer.iteration

    def restore(self, snapshot: dict, history: list) -> int:
        """Load the driver's checkpoint, then replay the updates made since it."""
        r = self.replica
        with tempfile.TemporaryDirectory(prefix="fucina-es-restore-") as d:
            for name, data in snapshot.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            r.trainer.load_checkpoint(d, r.registry, adapters=r.adapters)
        for iteration, rewards in history:
            if iteration == r.trainer.iteration:
                r.trainer.update(rewards)
        return r.trainer.iteration

    def digest(self) -> str:
        return _digest(self.replica.registry)

    def pid(self) -> int:
        return os.getpid()


class EsCluster(Actors):
    """ES member evaluation on `actors` Ray actors (one CPU each unless `cpus_per_actor`), in
    step with the driver's `trainer` (θ registered in `registry`; `adapters` as in
    es.Trainer.save_checkpoint). ray: "local" (a private cluster on this machine), "auto" (the
    cluster this machine joined) or an address. `block`: members per task (default: the
    population spread over twice the actors, so a slow actor does not hold the others)."""

    def __init__(self, build_replica, trainer, registry, *, actors: int = 2, ray: str = "local",
                 adapters: bool = False, cpus_per_actor: float = 1, block: int | None = None):
        where = "fucina.dist.EsCluster"
        for name, v in (("actors", actors), ("block", 1 if block is None else block)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise InvalidConfig(f"{where}: {name}: expected an int >= 1, got {v!r}")
        if not isinstance(trainer, _es.Trainer):
            raise InvalidArgumentType(f"{where}: expected an es.Trainer, got "
                                      f"{type(trainer).__name__}")
        super().__init__(_EsActor, (build_replica,), actors, ray, cpus_per_actor)
        self.trainer, self.registry, self.adapters = trainer, registry, adapters
        self.block = block
        self.restored = 0            # how many times an actor was brought back (for reports)
        self._snap_ref, self._history = None, []
        self._resnapshot()
        for i in range(len(self.actors)):
            self._restore(i)

    # ---- keeping actors on the driver's θ ----
    def _resnapshot(self) -> None:
        snap = _snapshot(self.trainer, self.registry, self.adapters)
        self._snap_ref, self._history = self._ray.put(snap), []

    def _restore(self, i: int) -> None:
        """Bring actor i to the driver's θ (it may be restarting: the call waits for it)."""
        ray = self._ray
        err = None
        for attempt in range(RESTORE_TRIES):
            try:
                it = ray.get(self.actors[i].restore.remote(self._snap_ref, list(self._history)))
            except ray.exceptions.RayActorError as e:   # still restarting: wait, then again
                err = e
                time.sleep(0.2 * 2 ** attempt)
                continue
            if it != self.trainer.iteration:
                raise ReplicaOutOfSync(f"fucina.dist.EsCluster: actor {i} restored to iteration "
                                       f"{it}; expected the driver's {self.trainer.iteration}")
            return
        raise WorkersLost(f"fucina.dist.EsCluster: actor {i} could not be restored after "
                          f"{RESTORE_TRIES} tries: {err}")

    def _cause(self, e):
        """The library error inside a RayTaskError, or None."""
        cause = getattr(e, "cause", None)
        return cause if isinstance(cause, Exception) else None

    # ---- evaluation ----
    def evaluate(self, trainer=None, rewards=None, payload=None) -> list:
        """One reward per member of the trainer's current iteration, scored on the actors;
        written into `rewards` (a list of population floats) when given, and returned.
        `payload` (picklable, e.g. the iteration's batch) is passed on to every score call:
        score(members, payload)."""
        tr = self.trainer if trainer is None else trainer
        if tr is not self.trainer:
            raise InvalidConfig("fucina.dist.EsCluster.evaluate: expected the trainer the cluster "
                                "was built for")
        ray = self._ray
        N = tr.config.population
        if rewards is None:
            rewards = [0.0] * N
        elif len(rewards) != N:
            raise RewardCountMismatch(f"fucina.dist.EsCluster.evaluate: expected a rewards buffer "
                                      f"of {N} entries, got {len(rewards)}")
        block = self.block or max(1, -(-N // (2 * len(self.actors))))
        queue = collections.deque(range(m, min(m + block, N)) for m in range(0, N, block))
        idle = collections.deque(range(len(self.actors)))
        pending, error = {}, None
        seed, iteration = tr.config.seed, tr.iteration
        while pending or (queue and error is None):
            while queue and idle and error is None:
                i, unit = idle.popleft(), queue.popleft()
                ref = self.actors[i].score.remote(seed, iteration, unit.start, unit.stop, payload)
                pending[ref] = (i, unit)
            if not pending:
                break
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, unit = pending.pop(ref)
            try:
                rewards[unit.start:unit.stop] = ray.get(ref)
            except ray.exceptions.RayActorError:          # the actor died: its task goes on
                queue.appendleft(unit)
                self.restored += 1
                self._restore(i)
            except ray.exceptions.RayTaskError as e:
                cause = self._cause(e)
                if isinstance(cause, ReplicaOutOfSync):    # restarted between calls
                    queue.appendleft(unit)
                    self.restored += 1
                    self._restore(i)
                elif error is None:
                    error = cause or e                     # stop handing out work; drain
            idle.append(i)
        if error is not None:
            raise error
        return rewards

    def update(self, trainer, rewards) -> None:
        """After the driver's trainer.update(rewards): every actor applies the same update."""
        if trainer is not self.trainer:
            raise InvalidConfig("fucina.dist.EsCluster.update: expected the trainer the cluster "
                                "was built for")
        ray = self._ray
        iteration = trainer.iteration - 1          # the update the driver just made
        rewards = [float(r) for r in rewards]
        self._history.append((iteration, rewards))
        seed = trainer.config.seed
        refs = [a.update.remote(seed, iteration, rewards) for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                self.restored += 1
                self._restore(i)          # snapshot + history (this update included)
        if len(self._history) >= RESNAPSHOT_AFTER:
            self._resnapshot()

    def verify(self, trainer=None) -> str:
        """Every actor's θ is the driver's, byte for byte (ReplicaOutOfSync otherwise); returns
        the sha256 of θ's state dict."""
        want = _digest(self.registry)
        got = self._ray.get([a.digest.remote() for a in self.actors])
        bad = [i for i, g in enumerate(got) if g != want]
        if bad:
            raise ReplicaOutOfSync(f"fucina.dist.EsCluster.verify: actors {bad} hold a θ that differs "
                                   f"from the driver's (sha256 {want[:12]}…)")
        return want
