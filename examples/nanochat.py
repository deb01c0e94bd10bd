"""nanochat: the GPT of examples/gpt.py trained from scratch on text every machine has — the
Python standard library's own source files, as bytes (../shared/seeds/TRAINING.txt's worked
example; issue 18 item 7).

    python -m examples.nanochat                    # the real run: 6 x d512, seq 1024, 2000 steps
    python -m examples.nanochat --tiny             # the CI run: 2 x d128, seq 128, 60 steps
        [--steps N] [--data-mb F] [--lr F] [--seed N] [--threads N] [--eval-every N]
        [--save DIR] [--save-every N] [--load DIR] [--plot PNG] [--sample N]

Data: every `*.py` under `sysconfig.get_paths()["stdlib"]` (sorted paths, files joined by a
newline), the first `--data-mb` MiB; tokens are bytes (vocab 256); the last 5 % is held out.
Step s trains on one window of seq + 1 bytes starting at at(seed, s) mod (train length − seq − 1)
(fu.rng's counter-based draw: a resumed run sees the same windows).

Model and optimizer: the block matrices are bf16 leaves with f32 masters, updated by Muon
(lr 0.02, momentum 0.95, Nesterov, spectral scale; Newton–Schulz through the bf16 GEMM,
ns_dtype="bf16"); the embedding and the untied head are f32
and go to Muon's embedded AdamW (lr 3e-3, β 0.9/0.95). The loss is the head's projection fused
with the cross-entropy. A line per `--log-every` steps (loss, ms/step, tokens/s), the held-out
loss every `--eval-every` steps, the loss curves as a PNG (`--plot`, default build/nanochat.png),
a checkpoint directory (model.safetensors, optimizer.fucina, trainer_state.json last) at `--save`
(and every `--save-every` steps); `--load DIR` resumes bit-exactly. At the end, `--sample` bytes
are generated from a prompt with temperature 0.8 and top-k 40 through fu.llm's sampler.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import time

import numpy as np

import fucina as fu
from fucina.io import (MODEL_STATE_FILE, OPTIMIZER_STATE_FILE, ParamRegistry, TrainerState,
                       begin_save, load_trainer_state, save_trainer_state, step_dir,
                       write_file_atomic)

from .gpt import Gpt, GptConfig, init_weights

REAL = dict(cfg=GptConfig(vocab=256), steps=2000, data_mb=8.0)
TINY = dict(cfg=GptConfig(layers=2, d=128, heads=4, head_dim=32, ffn=384, vocab=256, seq=128),
            steps=60, data_mb=0.5)
HELD_OUT = 0.05
EVAL_WINDOWS = 8
PROMPT = "def "


def stdlib_bytes(limit_mb: float) -> np.ndarray:
    """The first limit_mb MiB of the standard library's .py files (sorted, newline-joined)."""
    root = sysconfig.get_paths()["stdlib"]
    limit = int(limit_mb * (1 << 20))
    out, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        out.append(data + b"\n")
        size += len(data) + 1
        if size >= limit:
            break
    text = b"".join(out)[:limit]
    if len(text) < 4096:
        raise fu.DatasetTooSmall(f"nanochat: found only {len(text)} bytes of Python source under "
                                 f"{root}; expected at least 4096")
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


class Run:
    """Model, optimizer, data and the step counter of one training run."""

    def __init__(self, ctx, cfg: GptConfig, data: np.ndarray, lr: float, seed: int):
        self.ctx, self.cfg, self.seed = ctx, cfg, seed
        split = int(len(data) * (1 - HELD_OUT))
        self.train, self.held_out = data[:split], data[split:]
        if min(len(self.train), len(self.held_out)) <= cfg.seq + 1:
            raise fu.DatasetTooSmall(f"nanochat: {len(data)} bytes do not make train and held-out "
                                     f"windows of {cfg.seq + 1}; raise --data-mb")
        self.model = Gpt(ctx, cfg, init_weights(cfg, seed), matrix_dtype="bf16")
        # the bf16 matrices orthogonalise through the bf16 GEMM, as torch.optim.Muon does
        self.opt = fu.optim.Muon(lr=lr, ns_dtype="bf16", fallback=fu.optim.AdamWConfig(
            lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0))
        self.registry = ParamRegistry()
        for name, t in self.model.params.items():
            if name.startswith("layers."):
                self.opt.add_param(t, name=name)
            else:
                self.opt.add_fallback_param(t, name=name)
            self.registry.add_param(name, t)
        self.step = 0

    def window(self, source: np.ndarray, index: int) -> np.ndarray:
        start = fu.rng.at(self.seed, index) % (len(source) - self.cfg.seq - 1)
        return source[start:start + self.cfg.seq + 1]

    def train_step(self) -> float:
        w = self.window(self.train, self.step)
        with self.ctx.exec_scope():
            loss = self.model.loss(w[:-1], w[1:])
            loss.backward()
            value = loss.item()
        self.opt.step()
        self.opt.zero_grad()
        self.step += 1
        return value

    def eval_loss(self) -> float:
        """Mean loss over EVAL_WINDOWS fixed held-out windows."""
        total = 0.0
        with fu.no_grad():
            for k in range(EVAL_WINDOWS):
                w = self.window(self.held_out, (1 << 40) + k)
                with self.ctx.exec_scope():
                    total += self.model.loss(w[:-1], w[1:]).item()
        return total / EVAL_WINDOWS

    def save(self, path: str) -> None:
        begin_save(path)
        write_file_atomic(os.path.join(path, MODEL_STATE_FILE), self.registry.save_state_dict)
        write_file_atomic(os.path.join(path, OPTIMIZER_STATE_FILE), self.opt.save_state)
        save_trainer_state(path, TrainerState(step=self.step, seed=self.seed))

    def load(self, path: str) -> None:
        state = load_trainer_state(path)
        if state is None:
            raise fu.InvalidTrainerState(f"nanochat --load {path}: expected a checkpoint "
                                         f"directory with a trainer_state.json, found none")
        if state.seed != self.seed:
            raise fu.CheckpointConfigMismatch(f"nanochat --load {path}: seed {state.seed}; "
                                              f"expected --seed {self.seed}")
        self.registry.load_state_dict(os.path.join(path, MODEL_STATE_FILE))
        with open(os.path.join(path, OPTIMIZER_STATE_FILE), "rb") as f:
            self.opt.load_state(f)
        self.step = state.step

    def sample(self, n: int, prompt: str = PROMPT, seed: int = 0) -> str:
        """n bytes after `prompt`: temperature 0.8, top-k 40 (fu.llm.sample), the last seq bytes
        as context."""
        from fucina.llm import sampling
        ids = list(prompt.encode("utf-8"))
        settings = sampling.Settings(temperature=0.8, top_k=40)
        for i in range(n):
            with fu.no_grad(), self.ctx.exec_scope():
                logits = self.model.last_logits(ids[-self.cfg.seq:])
                ids.append(sampling.pick(logits, settings, seed, i, ids))
        return bytes(ids).decode("utf-8", errors="replace")


def run(cfg: GptConfig, steps: int, data_mb: float, lr: float = 0.02, seed: int = 0,
        threads=None, log_every: int = 10, eval_every: int = 100, save: str | None = None,
        save_every: int = 0, load: str | None = None, plot: str | None = None,
        sample: int = 200, out=print) -> dict:
    data = stdlib_bytes(data_mb)
    with fu.ExecContext(threads=threads) as ctx:
        r = Run(ctx, cfg, data, lr, seed)
        if load is not None:
            r.load(load)
            out(f"resumed {load} at step {r.step}")
        n = sum(int(np.prod(t.shape)) for t in r.model.params.values())
        out(f"nanochat: {cfg.layers} x d{cfg.d}, {n / 1e6:.1f} M params (matrices bf16 + f32 "
            f"masters, Muon; embedding/head f32, AdamW), seq {cfg.seq}, {len(r.train):,} train "
            f"bytes of Python source")
        train, held = [], []
        t_last, s_last = time.perf_counter(), r.step
        while r.step < steps:
            loss = r.train_step()
            train.append((r.step, loss))
            if r.step % log_every == 0 or r.step == steps:
                now = time.perf_counter()
                ms = (now - t_last) * 1e3 / max(r.step - s_last, 1)
                out(f"step {r.step:>5}/{steps}  loss {loss:.4f}  {ms:.0f} ms/step  "
                    f"{cfg.seq * 1e3 / ms:.0f} tok/s")
                t_last, s_last = now, r.step
            if eval_every and (r.step % eval_every == 0 or r.step == steps):
                held.append((r.step, r.eval_loss()))
                out(f"step {r.step:>5}  held-out loss {held[-1][1]:.4f}")
            if save and save_every and r.step % save_every == 0:
                r.save(step_dir(save, r.step))
        if save:
            r.save(save)
            out(f"saved {save} (step {r.step})")
        if plot:
            from fucina.cli.plot import loss_curves_png
            png = loss_curves_png([("train", train, (31, 119, 180)),
                                   ("eval", held, (255, 127, 14))], title="loss")
            os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
            write_file_atomic(plot, lambda f: f.write(png))
            out(f"wrote {plot}")
        text = r.sample(sample) if sample else ""
        if text:
            out("sample:\n" + text)
        weights = {name: t.numpy() for name, t in r.model.params.items()}
        return {"train": train, "held_out": held, "sample": text, "weights": weights,
                "step": r.step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.nanochat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the short CI run")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--data-mb", type=float)
    ap.add_argument("--lr", type=float, default=0.02, help="Muon lr (default 0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--load")
    ap.add_argument("--plot", default=os.path.join("build", "nanochat.png"))
    ap.add_argument("--sample", type=int, default=200, help="bytes to generate at the end")
    a = ap.parse_args(argv)
    preset = TINY if a.tiny else REAL
    steps = a.steps if a.steps is not None else preset["steps"]
    data_mb = a.data_mb if a.data_mb is not None else preset["data_mb"]
    if steps < 1 or data_mb <= 0 or a.log_every < 1 or a.eval_every < 0:
        ap.error("--steps and --log-every must be >= 1, --data-mb > 0, --eval-every >= 0")
    try:
        run(preset["cfg"], steps, data_mb, a.lr, a.seed, a.threads, a.log_every, a.eval_every,
            a.save, a.save_every, a.load, a.plot, a.sample, out=lambda s: print(s, flush=True))
    except fu.FucinaError as e:
        print(f"nanochat: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
