"""Two interleaved spirals, a 2-64-64-2 tanh MLP, and bit-exact resume (SPEC D-1).

    python -m examples.spirals [--steps N] [--optimizer NAME[,NAME...]|all] [--threads N]
                               [--save DIR] [--load DIR] [--plot FILE.png] [--log-every N]

For every optimizer run (SGD nesterov, AdamW, Muon, Apollo, Apollo-Mini, and "groups": two
AdamW param groups in an OptimizerSet with a warmup-cosine schedule and global clipping):

1. train from init seed 42, one full-batch step per exec scope
   (forward → cross-entropy → backward → [clip] → step → zero_grad);
2. at the halfway step write a checkpoint directory (SPEC T-19): `model.safetensors`
   (ParamRegistry, names w1, b1, w2, b2, w3, b3), `optimizer.fucina` (the optimizer's frames),
   then `trainer_state.json` last; train to the end and save the final weights (model only);
3. build a FRESH model (init seed 7, fully overwritten) and optimizer, restore the checkpoint,
   train the second half and require bit-identical final parameters (else ResumeNotBitExact);
4. reload the final weights into a constant twin (frozen registry entries) and report its
   accuracy; `--plot` draws every run's decision boundary with the points (one panel per run,
   left to right in run order) as a PNG written by a small zlib-based writer (no plotting library).

Without --save the checkpoints go to a temporary directory. `--load DIR` skips the first half:
it resumes from the checkpoints a previous `--save DIR` run (same --steps) wrote, in this new
process, and compares the result bitwise with the final weights that run saved.

The default (`make demo`, ~10 s) is a short run: every optimizer but SGD, 1200 steps each
(checkpoint at 600); all of them reach 100 % training accuracy (AdamW by ~250 steps, Muon ~350,
Apollo ~400, groups ~450, Apollo-Mini ~1000). SGD (nesterov, lr 0.1) needs ~2100 steps on this
data (99 % at 2000), so it runs only when asked: the SPEC recipe is
`--optimizer all --steps 2000`.

Data and init come from the repo RNG (SPEC O-5), not the reference's Zig generator: the spiral
noise is `fu.rng.normal_fill(1234, noise, 0, 0.02)`, each weight `fu.rng.uniform_fill(at(seed, k),
w, -1/sqrt(fan_in), 1/sqrt(fan_in))` with k = 0, 1, 2 for w1, w2, w3 (as in D-2), biases zero.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

import fucina as fu
from fucina.cli.plot import png_bytes
from fucina.io import (MODEL_STATE_FILE, OPTIMIZER_STATE_FILE, TrainerState, begin_save,
                       load_trainer_state, save_trainer_state, step_dir, write_file_atomic)

N_PER_CLASS = 200
DATA_SEED = 1234
NOISE_STD = 0.02
INIT_SEED = 42
TWIN_SEED = 7  # the resumed model's own init, entirely overwritten by the checkpoint
HIDDEN = 64
SPEC_STEPS = 2000
DEFAULT_STEPS = 1200
DEFAULT_OPTIMIZERS = ("adamw", "muon", "apollo", "apollo_mini", "groups")
OPTIMIZERS = ("sgd", "adamw", "muon", "apollo", "apollo_mini", "groups")
WARMUP_FRACTION = 0.05  # groups: warmup_cosine_factor(step, total, 0.05·total, 0.05) — 100 of 2000
MIN_FACTOR = 0.05
CLIP = 1.0
FINAL_DIR = "final"


class ResumeNotBitExact(fu.FucinaError, AssertionError):
    """The resumed run's final parameters differ from the uninterrupted run's."""


# ---------------------------------------------------------------------------------------------
# data and model

def spiral_points(n_per_class: int = N_PER_CLASS) -> tuple[np.ndarray, np.ndarray]:
    """The noise-free points (float64, [2·n, 2]) and labels, interleaved: class 0 then class 1
    for each i, t = i/(n-1), θ = 3.5π·t, r = 0.15 + 0.85t. Class 0 is (r sin θ, r cos θ),
    class 1 its negation."""
    t = np.arange(n_per_class) / (n_per_class - 1)
    theta = 3.5 * math.pi * t
    r = 0.15 + 0.85 * t
    p = np.stack([r * np.sin(theta), r * np.cos(theta)], axis=1)
    points = np.empty((2 * n_per_class, 2))
    points[0::2], points[1::2] = p, -p
    return points, np.tile(np.array([0, 1], np.int64), n_per_class)


@dataclass
class Data:
    x: fu.Tensor         # [n, in] f32 constant
    labels: fu.Tensor    # [n] i64 constant
    x_np: np.ndarray
    labels_np: np.ndarray

    @classmethod
    def make(cls, ctx) -> "Data":
        points, labels = spiral_points()
        noise = ctx.zeros(points.shape, ("n", "in"))
        fu.rng.normal_fill(DATA_SEED, noise, 0.0, NOISE_STD)
        x = ctx.tensor(points.astype(np.float32), ("n", "in")) + noise
        return cls(x, ctx.tensor(labels, ("n",), dtype="i64"), x.numpy(), labels)


class Mlp:
    """2-64-64-2 tanh MLP. The attribute order is the registry's name order (w1, b1, ...); a
    trainable model holds variables, a constant twin plain tensors (frozen registry entries)."""

    def __init__(self, ctx, seed: int, trainable: bool = True):
        make = ctx.variable if trainable else ctx.tensor

        def weight(k, shape, tags):
            w = make(np.zeros(shape, np.float32), tags)
            bound = 1.0 / math.sqrt(shape[1])
            return fu.rng.uniform_fill(fu.rng.at(seed, k), w, -bound, bound)

        self.w1 = weight(0, (HIDDEN, 2), ("h1", "in"))
        self.b1 = make(np.zeros(HIDDEN, np.float32), ("h1",))
        self.w2 = weight(1, (HIDDEN, HIDDEN), ("h2", "h1"))
        self.b2 = make(np.zeros(HIDDEN, np.float32), ("h2",))
        self.w3 = weight(2, (2, HIDDEN), ("class", "h2"))
        self.b3 = make(np.zeros(2, np.float32), ("class",))

    def forward(self, x):
        h = (x.dot(self.w1, "in") + self.b1).tanh()
        h = (h.dot(self.w2, "h1") + self.b2).tanh()
        return h.dot(self.w3, "h2") + self.b3

    def registry(self) -> fu.io.ParamRegistry:
        reg = fu.io.ParamRegistry()
        reg.collect(self)
        return reg

    def arrays(self) -> dict:
        """name -> a float32 copy of each parameter."""
        return {name: getattr(self, name).numpy() for name in ("w1", "b1", "w2", "b2", "w3", "b3")}


def accuracy(logits, labels_np) -> float:
    """Fraction of rows whose argmax over "class" is the label (the i64 indices are copied
    out before the scope that owns them closes)."""
    return float(np.mean(logits.argmax("class").numpy() == labels_np))


# ---------------------------------------------------------------------------------------------
# optimizers

def _optim(name: str, module: str):
    """fu.optim.<name>, or from its module when the package does not export it (yet); None
    when it does not exist in this tree."""
    obj = getattr(fu.optim, name, None)
    if obj is None:
        try:
            obj = getattr(importlib.import_module(f"fucina.optim.{module}"), name)
        except (ImportError, AttributeError):
            return None
    return obj


@dataclass
class Trainer:
    """One run's optimizer (or OptimizerSet), its members (closed at the end), its schedule."""

    opt: object
    members: list
    schedule: object = None
    clip: float | None = None

    def close(self):
        for m in self.members:
            m.close()


def _register(opt, model):
    """SPEC D-1 registration order: w1, w2, w3 (a fallback param for Muon/Apollo: the head is
    never orthogonalised or low-rank projected), b1, b2, b3 — named, so frames match by name."""
    opt.add_param(model.w1, "w1")
    opt.add_param(model.w2, "w2")
    opt.add_fallback_param(model.w3, "w3")
    for name in ("b1", "b2", "b3"):
        opt.add_param(getattr(model, name), name)


def _single(factory):
    def build(model):
        opt = factory()
        _register(opt, model)
        return Trainer(opt, [opt])
    return build


def _groups(model):
    """Weights with decay, biases without, one global clip and one schedule over both."""
    decay = fu.optim.AdamW(lr=0.02, weight_decay=0.01)
    no_decay = fu.optim.AdamW(lr=0.02, weight_decay=0.0)
    for name in ("w1", "w2", "w3"):
        decay.add_param(getattr(model, name), name)
    for name in ("b1", "b2", "b3"):
        no_decay.add_param(getattr(model, name), name)
    sched = fu.optim.LrSchedule()
    sched.attach(decay.config)
    sched.attach(no_decay.config)
    return Trainer(fu.optim.OptimizerSet([decay, no_decay]), [decay, no_decay], sched, CLIP)


def recipes() -> dict:
    """name -> build(model) -> Trainer, for the optimizers this tree has (SPEC D-1 configs)."""
    out = {"sgd": _single(lambda: fu.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)),
           "adamw": _single(lambda: fu.optim.AdamW(lr=0.02, weight_decay=1e-4))}
    muon, adamw_config = _optim("Muon", "muon"), fu.optim.AdamWConfig
    if muon is not None:
        out["muon"] = _single(lambda: muon(
            lr=0.02, weight_decay=0.01,
            fallback=adamw_config(lr=0.02, beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0)))
    apollo, apollo_config = _optim("Apollo", "apollo"), _optim("ApolloConfig", "apollo")
    if apollo is not None and apollo_config is not None:
        out["apollo"] = _single(lambda: apollo(lr=0.05, rank=8, update_proj_gap=100))
        out["apollo_mini"] = _single(
            lambda: apollo(apollo_config.mini(lr=0.005, update_proj_gap=100)))
    out["groups"] = _groups
    return out


# ---------------------------------------------------------------------------------------------
# training

def train(ctx, model, data, trainer, start: int, stop: int, total: int, log_every: int = 0,
          label: str = "", out=print) -> list:
    """Steps start .. stop-1 of a `total`-step run; a line (loss, accuracy, ms/step) every
    `log_every` steps. Returns [(step, loss, accuracy)] of the logged steps (loss and accuracy
    of the parameters the step started from)."""
    opt, sched = trainer.opt, trainer.schedule
    warmup = round(WARMUP_FRACTION * total)
    logged, t0, last = [], time.perf_counter(), start
    for step in range(start, stop):
        if sched is not None:  # a pure function of the step: a resumed run re-applies it
            sched.apply(fu.optim.warmup_cosine_factor(step, total, warmup, MIN_FACTOR))
        log = log_every and ((step + 1) % log_every == 0 or step + 1 == stop)
        with ctx.exec_scope():
            logits = model.forward(data.x)
            loss = logits.cross_entropy("class", data.labels)
            loss.backward()
            if trainer.clip is not None:
                opt.clip_grad_norm(trainer.clip)
            opt.step()
            opt.zero_grad()
            if log:
                row = (step + 1, loss.item(), accuracy(logits, data.labels_np))
        if log:
            now = time.perf_counter()
            logged.append(row)
            out(f"  {label:<12} step {row[0]:>5}/{total}  loss {row[1]:.4e}  acc {row[2]:7.2%}  "
                f"{(now - t0) / (step + 1 - last) * 1e3:6.3f} ms/step")
            t0, last = now, step + 1
    return logged


def save_checkpoint(path, model, step: int, opt=None) -> None:
    """A T-19 directory: payloads atomically, trainer_state.json last (the commit sentinel)."""
    begin_save(path)
    write_file_atomic(os.path.join(path, MODEL_STATE_FILE), model.registry().save_state_dict)
    if opt is not None:
        write_file_atomic(os.path.join(path, OPTIMIZER_STATE_FILE), opt.save_state)
    save_trainer_state(path, TrainerState(step=step, seed=INIT_SEED))


def load_model(path, model) -> TrainerState:
    """Fill `model` from a checkpoint directory (strict: every name, shape and dtype)."""
    state = load_trainer_state(path)
    if state is None:
        raise fu.CheckpointError(f"spirals: {path}: expected a complete checkpoint directory "
                                 f"(a parseable {fu.io.TRAINER_STATE_FILE}), found none")
    with open(os.path.join(path, MODEL_STATE_FILE), "rb") as f:
        model.registry().load_state_dict(f)
    return state


def find_checkpoint(root: str, name: str) -> str:
    """`root` itself when it is a checkpoint directory, else the complete
    `root/<name>/checkpoint-step-N` with the highest N."""
    if load_trainer_state(root) is not None:
        return root
    base, best = os.path.join(root, name), None
    if os.path.isdir(base):
        for entry in os.listdir(base):
            if entry.startswith("checkpoint-step-") and entry[16:].isdigit():
                d = os.path.join(base, entry)
                if load_trainer_state(d) is not None and (best is None or int(entry[16:]) > best[0]):
                    best = (int(entry[16:]), d)
    if best is None:
        raise fu.CheckpointError(f"spirals --load: expected a checkpoint for {name!r} under "
                                 f"{root} (a checkpoint-step-N directory with trainer_state.json), "
                                 f"found none")
    return best[1]


def max_abs_delta(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
               for k in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return all(a[k].tobytes() == b[k].tobytes() for k in a)


@dataclass
class Result:
    name: str
    steps: int
    resumed_from: int
    final_loss: float | None
    accuracy: float            # the constant twin's, on the training set
    max_delta: float | None    # resumed vs uninterrupted; None when there was no reference
    ms_per_step: float
    first_full: int | None     # first logged step at 100 % (None: never at a logged step)
    checkpoint: str
    final: str
    boundary: np.ndarray | None = field(default=None, repr=False)


def run_one(ctx, data, name: str, build, steps: int, save_root: str, load_root: str | None,
            log_every: int, out=print, grid: np.ndarray | None = None) -> Result:
    """One optimizer: [uninterrupted run + halfway checkpoint], resumed run, bitwise check,
    constant twin. With load_root the uninterrupted half comes from an earlier process."""
    half = steps // 2
    run_dir = os.path.join(save_root, name)
    final_dir = os.path.join(run_dir, FINAL_DIR)
    logged, reference, elapsed, done = [], None, 0.0, 0
    if load_root is None:
        ckpt = step_dir(run_dir, half)
        model = Mlp(ctx, INIT_SEED)
        trainer = build(model)
        t0 = time.perf_counter()
        logged += train(ctx, model, data, trainer, 0, half, steps, log_every, name, out)
        t1 = time.perf_counter()
        save_checkpoint(ckpt, model, half, trainer.opt)
        t2 = time.perf_counter()
        logged += train(ctx, model, data, trainer, half, steps, steps, log_every, name, out)
        elapsed, done = (t1 - t0) + (time.perf_counter() - t2), steps
        reference = model.arrays()
        trainer.close()
        del model, trainer
    else:
        ckpt = find_checkpoint(load_root, name)
        ref_dir = os.path.join(os.path.dirname(ckpt), FINAL_DIR)
        if load_trainer_state(ref_dir) is not None:
            ref = Mlp(ctx, TWIN_SEED, trainable=False)
            if load_model(ref_dir, ref).step == steps:
                reference = ref.arrays()
            del ref
        if reference is None:
            out(f"  {name:<12} no final weights of a {steps}-step run in {ref_dir}: the resumed "
                f"run is not compared")

    # the resume: fresh model (its own init, overwritten) and fresh optimizer, then the state
    model = Mlp(ctx, TWIN_SEED)
    state = load_model(ckpt, model)
    if state.seed != INIT_SEED or not 0 < state.step < steps:
        raise fu.CheckpointError(f"spirals: {ckpt}: expected seed {INIT_SEED} and a step in "
                                 f"(0, {steps}), got seed {state.seed} step {state.step}")
    trainer = build(model)  # load weights BEFORE registering (16-bit masters would be stale)
    with open(os.path.join(ckpt, OPTIMIZER_STATE_FILE), "rb") as f:
        trainer.opt.load_state(f)
    out(f"  {name:<12} resumed from {ckpt} (step {state.step}) into a fresh model and optimizer")
    t0 = time.perf_counter()
    resumed = train(ctx, model, data, trainer, state.step, steps, steps, log_every,
                    name + "*", out)
    elapsed += time.perf_counter() - t0
    done += steps - state.step
    if load_root is not None:
        logged = resumed
    final = model.arrays()
    trainer.close()
    delta = None
    if reference is not None:
        delta = max_abs_delta(final, reference)
        if delta != 0.0 or not bitwise_equal(final, reference):
            raise ResumeNotBitExact(
                f"spirals[{name}]: resumed from step {state.step}, the final parameters differ "
                f"from the uninterrupted run: max|Δ| = {delta:.3e}; expected 0 (bit-exact)")
    save_checkpoint(final_dir, model, steps)  # model only: no optimizer file
    del model, trainer

    twin = Mlp(ctx, TWIN_SEED, trainable=False)
    load_model(final_dir, twin)
    with ctx.exec_scope():
        acc = accuracy(twin.forward(data.x), data.labels_np)
    boundary = None if grid is None else class1_probability(ctx, twin, grid)
    del twin
    full = [s for s, _, a in logged if a == 1.0]
    return Result(name, steps, state.step, logged[-1][1] if logged else None, acc, delta,
                  elapsed / max(done, 1) * 1e3, full[0] if full else None, ckpt, final_dir,
                  boundary)


# ---------------------------------------------------------------------------------------------
# the picture: decision boundary + points, written as PNG with zlib

PLOT_SIZE = 320
PLOT_EXTENT = 1.25  # the square [-1.25, 1.25]² holds every point (radius <= 1 plus noise)


def plot_grid(size: int = PLOT_SIZE) -> np.ndarray:
    """Pixel centres as [size·size, 2] float32 points, row-major from the top-left corner."""
    c = ((np.arange(size) + 0.5) / size * 2.0 - 1.0) * PLOT_EXTENT
    gx, gy = np.meshgrid(c, -c)
    return np.stack([gx.ravel(), gy.ravel()], axis=1).astype(np.float32)


def class1_probability(ctx, model, grid: np.ndarray) -> np.ndarray:
    """softmax(model(grid))[:, 1] as a [size, size] image."""
    size = int(round(math.sqrt(grid.shape[0])))
    with ctx.exec_scope():
        probs = model.forward(ctx.tensor(grid, ("n", "in"))).softmax("class").numpy()
    return probs[:, 1].reshape(size, size)


COLORS = (np.array([59, 117, 175]), np.array([239, 134, 54]))  # class 0 blue, class 1 orange


def render_panel(prob: np.ndarray, x_np: np.ndarray, labels_np: np.ndarray) -> np.ndarray:
    """uint8 RGB: pale class colours by probability, a dark decision boundary (p = 0.5), and
    the points as dots with a white rim."""
    size = prob.shape[0]
    p = prob[..., None]
    img = (1 - p) * COLORS[0] + p * COLORS[1]
    img = 0.35 * img + 0.65 * 255.0  # pale background
    side = prob > 0.5
    edge = np.zeros_like(side)
    edge[:, 1:] |= side[:, 1:] != side[:, :-1]
    edge[1:, :] |= side[1:, :] != side[:-1, :]
    img[edge] = (40, 40, 40)
    px = (x_np[:, 0] / PLOT_EXTENT + 1.0) / 2.0 * size
    py = (1.0 - x_np[:, 1] / PLOT_EXTENT) / 2.0 * size
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    for cx, cy, k in zip(px, py, labels_np):
        lo_y, hi_y = max(int(cy) - 4, 0), min(int(cy) + 5, size)
        lo_x, hi_x = max(int(cx) - 4, 0), min(int(cx) + 5, size)
        d2 = (yy[lo_y:hi_y, lo_x:hi_x] - cy) ** 2 + (xx[lo_y:hi_y, lo_x:hi_x] - cx) ** 2
        patch = img[lo_y:hi_y, lo_x:hi_x]
        patch[d2 <= 3.2 ** 2] = 255
        patch[d2 <= 2.2 ** 2] = COLORS[k] * 0.8
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_plot(path: str, panels: list, data: Data) -> None:
    """Panels side by side, separated by a white gutter."""
    gutter = np.full((PLOT_SIZE, 8, 3), 255, np.uint8)
    parts = []
    for prob in panels:
        parts += [render_panel(prob, data.x_np, data.labels_np), gutter]
    image = np.concatenate(parts[:-1], axis=1)
    write_file_atomic(path, lambda f: f.write(png_bytes(image)))


# ---------------------------------------------------------------------------------------------
# driver

def select(spec: str, available: dict) -> tuple[list, list]:
    """(names to run, names asked for but missing in this tree) for "all" or "a,b,c"."""
    names = list(OPTIMIZERS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        raise SystemExit(f"spirals: --optimizer: expected 'all' or names from {OPTIMIZERS}, "
                         f"got {spec!r}")
    return [n for n in names if n in available], [n for n in names if n not in available]


def _run_all(ctx, names, available, steps, save, load, plot, log_every, out, results) -> None:
    data = Data.make(ctx)
    grid = plot_grid() if plot else None
    out(f"spirals: {data.x.shape[0]} points, MLP 2-{HIDDEN}-{HIDDEN}-2 tanh, {steps} full-batch "
        f"steps, checkpoint at {steps // 2}, {ctx.threads} thread(s)")
    for name in names:
        results.append(run_one(ctx, data, name, available[name], steps, save, load, log_every,
                               out, grid))
    if plot:
        write_plot(plot, [r.boundary for r in results], data)


def run(steps: int = DEFAULT_STEPS, optimizers=",".join(DEFAULT_OPTIMIZERS), save=None,
        load=None, plot=None, threads=None, log_every=None, out=print) -> list[Result]:
    """The whole demo; returns one Result per optimizer run (raises ResumeNotBitExact)."""
    if steps < 2:
        raise SystemExit(f"spirals: --steps: expected at least 2, got {steps}")
    available = recipes()
    names, missing = select(optimizers, available)
    for n in missing:
        out(f"NOTE: optimizer {n!r} is skipped: fucina.optim has no "
            f"{'Muon' if n == 'muon' else 'Apollo'} in this tree")
    if load is not None and load_trainer_state(load) is not None and len(names) != 1:
        raise SystemExit(f"spirals: --load {load} is one checkpoint directory; expected a single "
                         f"--optimizer (the one that wrote it), got {names}")
    if log_every is None:
        log_every = max(1, steps // 12)
    tmp = None
    if save is None:
        tmp = tempfile.TemporaryDirectory(prefix="fucina-spirals-")
        save = tmp.name
    results = []
    t_all = time.perf_counter()
    ctx = fu.ExecContext(threads=threads)
    try:
        _run_all(ctx, names, available, steps, save, load, plot, log_every, out, results)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # drop the runs' tensors before the pool closes
        raise
    finally:
        ctx.close()
        leaked = ctx.pool.outstanding_buffers()
        if tmp is not None:
            tmp.cleanup()
    wall = time.perf_counter() - t_all
    out("")
    out(f"{'optimizer':<12} {'accuracy':>9} {'100% at':>8} {'last loss':>10} {'resume':>20} "
        f"{'ms/step':>8}")
    for r in results:
        resume = ("bit-exact" if r.max_delta == 0.0 else "no reference") + f" @{r.resumed_from}"
        full = "-" if r.first_full is None else str(r.first_full)
        loss = "-" if r.final_loss is None else f"{r.final_loss:.3e}"
        out(f"{r.name:<12} {r.accuracy:>9.2%} {full:>8} {loss:>10} {resume:>20} "
            f"{r.ms_per_step:>8.3f}")
    out(f"(100% at: the first progress line at 100 % accuracy, one every {log_every} steps; "
        f"resume @N: resumed from the step-N checkpoint)")
    if plot:
        out(f"decision boundaries -> {plot} (panels left to right: {', '.join(names)})")
    if tmp is None:
        out(f"checkpoints under {save}")
    out(f"pool: {leaked} buffers outstanding after close; total {wall:.1f} s")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.spirals", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                    help=f"steps per run (default {DEFAULT_STEPS}; the SPEC recipe: {SPEC_STEPS})")
    ap.add_argument("--optimizer", default=",".join(DEFAULT_OPTIMIZERS),
                    help=f"'all' or a comma list of {', '.join(OPTIMIZERS)} "
                         f"(default {','.join(DEFAULT_OPTIMIZERS)})")
    ap.add_argument("--save", metavar="DIR", help="keep the checkpoints here (<DIR>/<optimizer>/...)")
    ap.add_argument("--load", metavar="DIR",
                    help="resume from a previous --save DIR run instead of training the first half")
    ap.add_argument("--plot", metavar="PNG", help="write the decision boundaries as a PNG")
    ap.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
    ap.add_argument("--log-every", type=int, default=None, help="progress line every N steps")
    args = ap.parse_args(argv)
    results = run(args.steps, args.optimizer, args.save, args.load, args.plot, args.threads,
                  args.log_every)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
