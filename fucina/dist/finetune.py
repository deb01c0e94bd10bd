"""Data-parallel LoRA fine-tuning on Ray actors, byte-identical to single-process accumulation.

An accumulation window (SPEC T-13) is a list of micro-batches. Each actor holds the same frozen
model and a LoRA trainer (built by the caller's `build()`, e.g. from the same GGUF path); before
a window every actor loads the driver's adapters, then computes the gradients of the
micro-batches it is handed — with the trainer's step counter set to the one that micro-batch
has in the single-process run, so dropout streams agree. Only gradients and loss values come
back. The driver adds them into its own adapters' accumulators in window order — the very
additions the single-process run makes, one backward after the other — and then clips and steps
exactly as it would alone. Kernels give the same bits at any thread count, so the adapters after
every step are byte-identical with and without Ray.

    cluster = fu.dist.GradCluster(build_trainer, trainer, actors=2, ray="local")
    losses = cluster.accumulate([(inputs, labels, 1 / total_valid), ...])   # reduction "sum"
    opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()

A window of one micro-batch with loss_scale None is the plain mean-CE step (`trainer.loss`).
An actor lost in the middle of a window is replaced by Ray (max_restarts) and its micro-batches
are computed again elsewhere: gradients are a pure function of (adapters, micro-batch, step).
"""
from __future__ import annotations

import collections
import io as _io
import numbers
import time

import numpy as np

from ..errors import InvalidConfig, WorkersLost
from .ray import Actors

__all__ = ["GradCluster"]

RETRIES = 6          # reload attempts, 0.2 s apart and doubling (Ray restarts a lost actor)


class _GradActor:
    """The actor body (wrapped by ray.remote at run time)."""

    def __init__(self, build):
        self.trainer = build()
        self.leaves = [t for _, ad in self.trainer.named_adapters() for t in (ad.a, ad.b)]
        self.version = -1

    def load(self, version: int, blob: bytes) -> int:
        if version != self.version:
            self.trainer.load_adapters(_io.BytesIO(blob))
            self.version = version
        return self.version

    def grads(self, version: int, step: int, inputs, labels, loss_scale):
        """(loss, [gradient of every A and B in registry order]) of one micro-batch."""
        if version != self.version:
            return None            # restarted since the broadcast: the driver reloads us
        tr = self.trainer
        tr.step_counter = step
        for t in self.leaves:
            t.zero_grad()
        if loss_scale is None:
            value = tr.loss_backward(inputs, labels)
        else:
            value = tr.loss_backward(inputs, labels, reduction="sum", loss_scale=loss_scale)
        out = [t.grad_view().numpy() for t in self.leaves]
        for t in self.leaves:
            t.zero_grad()
        return value, out


class GradCluster(Actors):
    """Micro-batch gradients of `trainer`'s adapters on `actors` Ray actors (see the module
    docstring); `build()` must construct, inside an actor, a trainer of the same model, targets,
    rank, alpha, dropout and seed."""

    def __init__(self, build, trainer, *, actors: int = 2, ray: str = "local",
                 cpus_per_actor: float = 1):
        if isinstance(actors, bool) or not isinstance(actors, numbers.Integral) or actors < 1:
            raise InvalidConfig(f"fucina.dist.GradCluster: actors: expected an int >= 1, got "
                                f"{actors!r}")
        super().__init__(_GradActor, (build,), actors, ray, cpus_per_actor)
        self.trainer = trainer
        self.leaves = [t for _, ad in trainer.named_adapters() for t in (ad.a, ad.b)]
        self.version, self._blob_ref = -1, None
        self.restarts = 0

    def _broadcast(self) -> None:
        """Ship the driver's adapters (as save_adapters writes them) to every actor."""
        buf = _io.BytesIO()
        self.trainer.save_adapters(buf)
        self.version += 1
        self._blob_ref = self._ray.put(buf.getvalue())
        refs = [a.load.remote(self.version, self._blob_ref) for a in self.actors]
        for i, ref in enumerate(refs):
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayActorError:   # lost or restarting: load it again
                self.restarts += 1
                self._reload(i)

    def _reload(self, i: int) -> None:
        ray = self._ray
        err = None
        for attempt in range(RETRIES):
            try:
                ray.get(self.actors[i].load.remote(self.version, self._blob_ref))
                return
            except ray.exceptions.RayActorError as e:    # still restarting: wait, then again
                err = e
                time.sleep(0.2 * 2 ** attempt)
        raise WorkersLost(f"fucina.dist.GradCluster: actor {i} could not be reloaded after "
                          f"{RETRIES} tries: {err}")

    def accumulate(self, window) -> list:
        """Gradients of every micro-batch (inputs, labels, loss_scale) of the window added into
        the trainer's adapters in window order; returns the micro-batch losses in that order.
        The trainer's step counter advances by len(window), as the single-process loop's does."""
        ray = self._ray
        window = list(window)
        if not window:
            raise InvalidConfig("fucina.dist.GradCluster.accumulate: expected at least one "
                                "micro-batch, got none")
        self._broadcast()
        step0 = self.trainer.step_counter
        results = [None] * len(window)
        queue = collections.deque(range(len(window)))
        idle = collections.deque(range(len(self.actors)))
        pending = {}
        while queue or pending:
            while queue and idle:
                i, j = idle.popleft(), queue.popleft()
                inputs, labels, scale = window[j]
                ref = self.actors[i].grads.remote(self.version, step0 + j, list(inputs),
                                                  list(labels), scale)
                pending[ref] = (i, j)
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, j = pending.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayActorError:
                got = None
            if got is None:                  # died, or restarted with stale adapters
                self.restarts += 1
                queue.appendleft(j)
                self._reload(i)
            else:
                results[j] = got
            idle.append(i)
        ctx = self.trainer.model.ctx
        for _, grads in results:             # window order: the single-process additions
            for leaf, g in zip(self.leaves, grads):
                leaf.backward(grad=ctx.tensor(np.asarray(g, dtype=np.float32), leaf.tags))
        self.trainer.step_counter = step0 + len(window)
        return [loss for loss, _ in results]
