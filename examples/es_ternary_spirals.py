"""es-ternary-spirals (SPEC T-27's acceptance demo): the two-spirals MLP whose hidden weights are
a TQ2_0 ternary genome, trained by ternary-native ES only — no gradients, no float updates.

The network is D-2's task with a ternary middle layer:

    x [2] -> tanh(w1·x + b1) [256] -> tanh(w2·h1) [16] -> w3·h2 -> logits [2]

w2 [16, 256] is the genome: 4096 weights, each (code − 1)·d with a 2-bit code in {0, 1, 2} and
one f16 scale d per 256-weight block (ggml's tq2_0). Only its codes train. The first layer
(random tanh features of the plane, from the repo RNG) and the readout (each class sums eight
of the sixteen hidden units with a fixed gain) stay as initialised. Each iteration scores the
population of flipped genomes — `materialize_ternary_members` writes every member's genome
into one stacked tq2_0 replica, a single batched forward scores them all by −(mean
cross-entropy) — and `update` moves the top-voted trits one bin (EGGROLL vote-and-threshold).

    python -m examples.es_ternary_spirals          # the CI run: 1000 iterations, target 0.95
    python -m examples.es_ternary_spirals --iterations N --population N --flip-rate F
        --update-fraction F --update-decay F --seed N --target F --threads N --log-every N
        --save DIR --load DIR

The default run takes about 1.5 s; on seeds 1, 2, 3, 7, 11, 42 and 2024 it ends at 0.979 to
1.000 training accuracy (0.90 is passed by iteration 300). The run fails (exit status 1,
TernaryTrainingFailed) unless the final accuracy reaches --target.
--save writes an ES checkpoint (model.safetensors with the fixed layers, ternary.gguf with the
genome, trainer_state.json); --load resumes one bit-exactly.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import fucina as fu
from fucina import es
from fucina.io import ParamRegistry

from .es_spirals import make_spirals  # SPEC D-2's data: 97 points per class, noise from --seed

H1, H2 = 256, 16            # the genome is w2 [H2, H1]: whole tq2_0 blocks along h1
FEATURE_GAIN = 6.0          # w1 ~ U(±6): sharp random half-planes ...
FEATURE_SHIFT = 3.0         # ... b1 ~ U(±3), so they cut the spiral arms everywhere
GENOME_INIT = 0.2           # w2 ~ U(±0.2) quantized: d ≈ 0.2, about half the codes nonzero
READOUT_GAIN = 0.5          # logit c = ±0.5·(Σ of units 0..7 − Σ of units 8..15)
NAMES = ("w1", "b1", "w3")  # the fixed layers, saved in model.safetensors
DEFAULTS = dict(iterations=1000, population=32, flip_rate=0.001, update_fraction=0.002,
                update_decay=0.0, target=0.95)


class TernaryTrainingFailed(fu.EsError):
    """The ternary-ES-trained network missed its accuracy target."""


class Model:
    """The network above: fixed float layers, the tq2_0 genome w2, and the data."""

    def __init__(self, ctx, xs, labels, seed: int):
        self.ctx, self.labels_np = ctx, labels
        self.w1 = self._uniform(fu.rng.at(seed, 0), (H1, 2), ("h1", "in"), FEATURE_GAIN)
        self.b1 = self._uniform(fu.rng.at(seed, 1), (H1,), ("h1",), FEATURE_SHIFT)
        self.w2 = self._uniform(fu.rng.at(seed, 2), (H2, H1), ("h2", "h1"), GENOME_INIT).to("tq2_0")
        readout = np.full((2, H2), READOUT_GAIN, np.float32)
        readout[0, H2 // 2:] = readout[1, :H2 // 2] = -READOUT_GAIN
        self.w3 = ctx.tensor(readout, ("class", "h2"))
        self.x = ctx.tensor(xs, ("batch", "in"))
        self.labels = ctx.tensor(labels, ("batch",), "i64")
        self.features = self.stack = self.stack_labels = None

    def _uniform(self, seed, shape, tags, bound):
        return fu.rng.uniform_fill(seed, self.ctx.zeros(shape, tags), -bound, bound)

    def registry(self) -> ParamRegistry:
        reg = ParamRegistry()
        for name in NAMES:
            reg.add_param(name, getattr(self, name))
        return reg

    def refresh_features(self) -> None:
        """h1 = tanh(w1·x + b1): fixed, computed once (and again after a checkpoint load)."""
        self.features = (self.x.dot(self.w1, "in") + self.b1).tanh()

    def _logits(self, w2):
        return self.features.dot(w2.to("f32"), "h1").tanh().dot(self.w3, "h2")

    def score(self):
        """(accuracy, mean cross-entropy) of the current genome."""
        with self.ctx.exec_scope():
            z = self._logits(self.w2)
            ce = z.cross_entropy("class", self.labels).item()
            acc = float((z.argmax("class").numpy() == self.labels_np).mean())
        return acc, ce

    def rewards(self, trainer) -> np.ndarray:
        """−(mean cross-entropy) of every member: all genomes in one stacked replica, scored by
        one batched forward."""
        P = trainer.config.population
        if self.stack is None or self.stack.shape[0] != P:
            self.stack = self.ctx.zeros((P, H2, H1), ("member", "h2", "h1")).to("tq2_0")
            # member m's labels at (batch, m): cross_entropy reads the labels in the row-major
            # order of the logits' other axes, here (batch, member)
            self.stack_labels = self.ctx.tensor(np.repeat(self.labels_np[:, None], P, 1),
                                                ("batch", "member"), "i64")
        trainer.materialize_ternary_members(range(P), [self.stack])
        with self.ctx.exec_scope():
            logits = self._logits(self.stack)
            ce = logits.cross_entropy("class", self.stack_labels, reduction="none")
            return -ce.mean("batch").numpy()


def run(iterations=DEFAULTS["iterations"], population=DEFAULTS["population"],
        flip_rate=DEFAULTS["flip_rate"], update_fraction=DEFAULTS["update_fraction"],
        update_decay=DEFAULTS["update_decay"], seed=42, target=DEFAULTS["target"], threads=None,
        log_every=100, save=None, load=None, log=print) -> dict:
    """Train; returns {accuracy, ce, iterations, seconds, genome (its block bytes)}.
    TernaryTrainingFailed when the final accuracy is below target."""
    xs, labels = make_spirals(seed)
    ctx = fu.ExecContext(threads=threads)
    try:
        trainer = es.Trainer(sigma=0.1, population=population, antithetic=population % 2 == 0,
                             ternary_flip_rate=flip_rate, ternary_update_fraction=update_fraction,
                             ternary_update_decay=update_decay, seed=seed)
        model = Model(ctx, xs, labels, seed)
        trainer.add_ternary_param(model.w2, "w2")
        registry = model.registry()
        if load is not None:  # the checkpoint's layers, seed, population and ternary knobs win
            trainer.load_checkpoint(load, registry)
            log(f"resumed {load} at iteration {trainer.iteration}")
        cfg = trainer.config
        model.refresh_features()
        n = model.w2.numel
        log(f"es-ternary-spirals: genome w2 {model.w2.shape} tq2_0 ({n} trits, {n // 256} blocks), "
            f"population {cfg.population}{' (antithetic)' if cfg.antithetic else ''}, "
            f"{trainer.ternary_flip_count(n)} flips per member, up to "
            f"{trainer.ternary_update_count(n)} moves per update")
        acc, ce = model.score()
        log(f"before: accuracy {acc:.3f} (chance 0.500)  ce {ce:.4f}")
        start = last = trainer.iteration
        t0 = tlast = time.perf_counter()
        for it in range(start + 1, start + iterations + 1):
            trainer.update(model.rewards(trainer))
            if log_every and it % log_every == 0:
                now = time.perf_counter()
                acc, ce = model.score()
                votes, moves = trainer.last_ternary_update[0]
                log(f"iter {it:>6}  accuracy {acc:.3f}  ce {ce:.4f}  votes {votes:>4}  moves "
                    f"{moves:>3}  {(it - last) / (now - tlast):.0f} it/s")
                last, tlast = it, now
        elapsed = time.perf_counter() - t0
        acc, ce = model.score()
        per_iter = 1e3 * elapsed / max(iterations, 1)
        log(f"after {iterations} iterations ({elapsed:.1f} s, {per_iter:.2f} ms/iter): accuracy "
            f"{acc:.3f}  ce {ce:.4f}")
        if save is not None:
            trainer.save_checkpoint(save, registry)
            log(f"saved {save} (iteration {trainer.iteration})")
        genome = model.w2.data_const().copy()
        trainer.close()
        del model, registry
        if acc < target:
            raise TernaryTrainingFailed(f"es-ternary-spirals: accuracy {acc:.3f} below target "
                                        f"{target:.3f}")
        log(f"PASS: ternary-ES training reached {100 * acc:.1f}% (target {100 * target:.1f}%)")
        return {"accuracy": acc, "ce": ce, "iterations": iterations, "seconds": elapsed,
                "genome": genome}
    finally:
        ctx.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.es_ternary_spirals",
                                description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=DEFAULTS["iterations"])
    p.add_argument("--population", type=int, default=DEFAULTS["population"])
    p.add_argument("--flip-rate", type=float, default=DEFAULTS["flip_rate"])
    p.add_argument("--update-fraction", type=float, default=DEFAULTS["update_fraction"])
    p.add_argument("--update-decay", type=float, default=DEFAULTS["update_decay"])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--target", type=float, default=DEFAULTS["target"])
    p.add_argument("--threads", type=int)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save")
    p.add_argument("--load")
    a = p.parse_args(argv)
    if a.iterations < 0 or a.population < 2 or (a.threads is not None and a.threads < 1):
        p.error("--iterations must be >= 0, --population >= 2 and --threads >= 1")
    try:
        run(a.iterations, a.population, a.flip_rate, a.update_fraction, a.update_decay, a.seed,
            a.target, a.threads, a.log_every, a.save, a.load, log=lambda s: print(s, flush=True))
    except TernaryTrainingFailed as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
