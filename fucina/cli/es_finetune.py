"""Gradient-free fine-tuning of a GGUF model by evolution strategies (SPEC D-4), on one machine
or on Ray.

    fucina es-finetune [--model PATH.gguf | --tiny] [--data PATH.jsonl] [--shuffle]
        [--mode lora|full] [--reward rule|acc|nll] [--iterations N] [--population N]
        [--sigma F] [--alpha F] [--noise iid|correlated] [--antithetic] [--cache-streams]
        [--anchor-decay none|l1|l2] [--anchor-lambda F] [--norm z_score|centered_ranks|none]
        [--restore-mode regenerate|snapshot] [--batch N] [--max-new N] [--rank N]
        [--lora-alpha F] [--seq-max N] [--seed N] [--save DIR] [--load DIR] [--threads N]
        [--ray local|auto|ADDRESS] [--actors N]

What is trained (θ): `lora` (default) — LoRA adapters on q and v of every layer (rank 8, alpha
16, A and B both perturbed), the frozen model as the file stores it; `full` — every weight of
the model widened to f32 (the file must hold f32/f16/bf16 matrices: a quantized one raises
QuantizedWeightsUnsupported; transcode it first with `fucina export --dtype f16`).

An iteration: the loader's next `--batch` samples (the same for every member); every member n
of the population is written into a replica of θ (θ + σ·ε_n: `materialize_member`, θ itself is
never touched) and scored on the batch; then `update` moves θ along the reward-weighted noise
(z-score, centered ranks or raw rewards; antithetic pairs; anchored weight decay). Scoring on a
replica rather than perturb/score/restore in place keeps θ bit-exact whatever `--restore-mode`
says (regenerate's (x + t) − t is not), which is what lets `--ray` be byte-identical: with
`--ray`, `--actors` Ray actors each build the same model, θ and replica (fucina.dist.EsCluster)
and score the member tasks; the saved adapters.safetensors / model.safetensors are
byte-identical with and without `--ray`.

Rewards per sample (the batch reward is their mean): `rule` = unigram F1 of the greedy answer
(`--max-new` tokens at most, stopping at the template's end-of-turn marker or EOS) against the
gold answer + 0.1·format, format = 0.5·[the trimmed answer starts with "Ahoy!"] + 0.5·[ends
with "matey."]; `acc` = teacher-forced token accuracy over the supervised positions +
0.1·exp(−mean CE); `nll` = −mean CE (unbounded: pair it with centered ranks).

Checkpoints (SPEC T-28) at `--save` (default $SCRATCH/fucina-es, else the temp directory):
adapters.safetensors (lora; the same names finetune writes, so `fucina export --adapters` and
`fu.llm.load(adapters=…)` read it) or model.safetensors (full), then trainer_state.json with the
es_* fields, es_iteration, lora_rank/lora_alpha and the loader position. `--load DIR` resumes:
(seed, iteration) regenerate the population, so the run continues bit-exactly.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

import fucina as fu
from fucina import es
from fucina.io import ParamRegistry, load_trainer_state
from fucina.llm import (IGNORE_INDEX, ChatTemplate, EncodeOptions, Loader, LoaderState, SftText,
                        Template, Tokenizer, encode_pair, encode_prompt)
from fucina.llm.decoder import LINEARS, Model, Targets, Trainer, head_rows

from .finetune import PAIRS, exit_status, resolve_model

MODES = ("lora", "full")
REWARDS = ("rule", "acc", "nll")
FORMAT_WEIGHT = 0.1
WORD = re.compile(rb"[A-Za-z0-9]+")
MAX_WORD = 64


def default_save_dir() -> str:
    return os.path.join(os.environ.get("SCRATCH") or tempfile.gettempdir(), "fucina-es")


@dataclass
class Options:
    """Every flag of the command line (SPEC D-4 defaults)."""

    model: str | None = None
    tiny: bool = False
    data: str | None = None
    shuffle: bool = False
    data_seed: int | None = None
    mode: str = "lora"
    reward: str = "rule"
    iterations: int = 20
    population: int = 8
    sigma: float = 0.02
    alpha: float | None = None
    noise: str = "iid"
    antithetic: bool = False
    cache_streams: bool = False
    anchor_decay: str = "none"
    anchor_lambda: float = 0.0
    norm: str = "z_score"
    restore_mode: str = "regenerate"
    batch: int = 3
    max_new: int = 20
    rank: int = 8
    lora_alpha: float = 16.0
    seq_max: int = 256
    seed: int = 42
    save: str | None = None
    load: str | None = None
    threads: int | None = None
    format_prefix: str = "Ahoy!"
    format_suffix: str = "matey."
    ray: str | None = None
    actors: int = 2


# ---------------------------------------------------------------------------------------------
# rewards

def words(text: str) -> list:
    """Maximal ASCII-alphanumeric runs, lowercased, each cut at 64 bytes."""
    return [w.lower()[:MAX_WORD] for w in WORD.findall(text.encode("utf-8"))]


def unigram_f1(answer: str, gold: str) -> float:
    """2PR / (P + R) over the multiset overlap of words; 0 when either side or the overlap is
    empty."""
    a, g = words(answer), words(gold)
    if not a or not g:
        return 0.0
    left = {}
    for w in g:
        left[w] = left.get(w, 0) + 1
    overlap = 0
    for w in a:
        if left.get(w, 0):
            left[w] -= 1
            overlap += 1
    if overlap == 0:
        return 0.0
    p, r = overlap / len(a), overlap / len(g)
    return 2 * p * r / (p + r)


def format_score(answer: str, prefix: str, suffix: str) -> float:
    t = answer.strip(" \t\r\n")
    return 0.5 * t.startswith(prefix) + 0.5 * t.endswith(suffix)


def rule_reward(answer: str, gold: str, prefix: str, suffix: str) -> float:
    return unigram_f1(answer, gold) + FORMAT_WEIGHT * format_score(answer, prefix, suffix)


# ---------------------------------------------------------------------------------------------
# one process's share: model, θ, the replica members are scored on

class Task:
    """Everything that scores members, built identically by the driver and by every Ray actor:
    tokenizer, template, samples, θ registered in an es.Trainer (and a ParamRegistry with the
    same names: the checkpoint schema), and the replica θ + σ·ε_n is written into."""

    def __init__(self, path: str, opts: Options, threads: int | None):
        self.opts = opts
        self.ctx = ctx = fu.ExecContext(threads=threads)
        f = fu.gguf.read(path, ctx)
        self.tok = Tokenizer.from_gguf(f)
        # the file's format; a file without a template: its architecture's (gemma), else chatml
        self.template = ChatTemplate.from_gguf(f, self.tok).kind or Template.CHATML
        self.stop_ids = {i for i in (self.tok.token_to_id(self.template.stop_marker()),
                                     self.tok.eos_id) if i is not None}
        data = SftText.from_jsonl(opts.data) if opts.data else SftText.from_pairs(list(PAIRS))
        self.pairs = data.pairs
        enc = EncodeOptions(seq_max=opts.seq_max, ignore_index=IGNORE_INDEX)
        self.samples = [encode_pair(self.tok, self.template, p, enc) for p in self.pairs]
        self.prompts = [encode_prompt(self.tok, self.template, p.instruction, enc) for p in self.pairs]
        self.es = es.Trainer(sigma=opts.sigma, alpha=opts.alpha, population=opts.population,
                             antithetic=opts.antithetic, noise=opts.noise,
                             restore_mode=opts.restore_mode, cache_streams=opts.cache_streams,
                             anchor_decay=opts.anchor_decay, anchor_lambda=opts.anchor_lambda,
                             reward_norm=opts.norm, seed=opts.seed)
        self.registry = ParamRegistry()
        if opts.mode == "full":
            _check_dense(f, path)
            self.theta_model = Model.from_gguf(ctx, f, widen_frozen=True)
            self.model = Model.from_gguf(ctx, f, widen_frozen=True)       # the replica
            theta = _own_weights(self.theta_model)
            self.replica = [t for _, t in _own_weights(self.model)]
        else:
            self.model = Model.from_gguf(ctx, f)
            lora = fu.lora.LoraConfig(opts.rank, opts.lora_alpha)
            self.theta_trainer = Trainer(self.model, Targets(q=True, v=True), lora, opts.seed)
            self.lora = Trainer(self.model, Targets(q=True, v=True), lora, opts.seed)
            theta = [(n, t) for n, t in _adapter_tensors(self.theta_trainer)]
            self.replica = [t for _, t in _adapter_tensors(self.lora)]
        for name, t in theta:
            self.es.add_param(t, name)
            self.registry.add_param(name, t)
        if opts.anchor_decay != "none":
            self.es.capture_anchor()

    # ---- forward through the replica ----
    def logits(self, tokens, rows=None):
        """[seq, vocab] of the replica, or [len(rows), vocab] for the positions `rows` (caller
        holds the scope)."""
        if self.opts.mode == "full":
            return self.model.forward_logits(tokens, rows)
        return self.lora.forward_logits(tokens, None, rows)

    def greedy(self, prompt: list) -> str:
        """The replica's greedy answer: at most max_new tokens, stopping at end of turn / EOS."""
        seq, new = list(prompt), []
        for _ in range(self.opts.max_new):
            with fu.no_grad(), self.ctx.exec_scope():
                logits = self.logits(seq).narrow("seq", len(seq) - 1, 1)
                nxt = logits.argmax("vocab").item()
            if nxt in self.stop_ids:
                break
            new.append(nxt)
            seq.append(nxt)
        return self.tok.decode(new)

    def sample_reward(self, k: int) -> float:
        o = self.opts
        if o.reward == "rule":
            return rule_reward(self.greedy(self.prompts[k]), self.pairs[k].response,
                               o.format_prefix, o.format_suffix)
        s = self.samples[k]
        labels = np.asarray(s.labels, dtype=np.uint64)
        supervised = labels != np.uint64(IGNORE_INDEX)
        if not supervised.any():
            raise fu.NoSupervisedTokens(f"es-finetune: sample {k} supervises no token")
        # the head on the supervised positions only: the same bits (head_rows), less work
        rows = head_rows(~supervised)
        if rows is not None:
            labels, supervised = labels[rows], supervised[rows]
        with fu.no_grad(), self.ctx.exec_scope():
            logits = self.logits(s.inputs, rows)
            ce = logits.cross_entropy_ext("vocab", labels, ignore_index=IGNORE_INDEX).item()
            if o.reward == "nll":
                return -ce
            pred = logits.argmax("vocab").numpy().astype(np.uint64)
        accuracy = float((pred[supervised] == labels[supervised]).mean())
        return accuracy + FORMAT_WEIGHT * math.exp(-ce)

    def score(self, members, batch) -> list:
        """One reward per member: θ + σ·ε_n into the replica, then the mean over the batch."""
        out = []
        for n in members:
            self.es.materialize_member(n, self.replica)
            out.append(statistics.fmean(self.sample_reward(k) for k in batch))
        return out


def _check_dense(f, path: str) -> None:
    bad = sorted({t.dtype for name, t in f.tensors.items()
                  if name.endswith(".weight") and getattr(t, "dtype", None) not in
                  ("f32", "f16", "bf16")})
    if bad:
        raise fu.QuantizedWeightsUnsupported(
            f"es-finetune --mode full: {path} stores weights as {', '.join(map(str, bad))}; "
            f"expected f32/f16/bf16 (full mode perturbs every weight). Hint: `fucina export "
            f"--from-gguf {path} --dtype f16 --out F16.gguf` first, or use --mode lora")


NORMS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "q_norm": "attn_q_norm",
         "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
         "post_ffn_norm": "post_ffw_norm"}


def _own_weights(model: Model) -> list:
    """(GGUF name, tensor) of every distinct weight of a widened model, in a fixed order, each
    writable and owned here: widened matrices are copies already; an f32 tensor still backed by
    the file's read-only mapping (a norm vector, an f32 matrix) is copied once."""
    out, seen = [], {}

    def own(name, t):
        key = id(t._raw.buf)
        if key in seen:                    # tied: the output projection is the embedding
            return seen[key]
        if t._raw.buf.readonly:
            t = model.ctx.tensor(t.numpy(), tags=t.tags)
        seen[key] = t
        out.append((name, t))
        return t

    model.token_embd = own("token_embd.weight", model.token_embd)
    model.output = own("output.weight", model.output)
    model.output_norm = own("output_norm.weight", model.output_norm)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        for name, (stem, _, _) in LINEARS.items():
            if layer.linear[name] is not None:
                layer.linear[name] = own(f"{p}{stem}.weight", layer.linear[name])
        if layer.qkv is not None:
            layer.qkv = own(f"{p}attn_qkv.weight", layer.qkv)
        for attr, stem in NORMS.items():
            if getattr(layer, attr) is not None:
                setattr(layer, attr, own(f"{p}{stem}.weight", getattr(layer, attr)))
        if layer.bias is not None:         # qwen2's q/k/v biases are weights too
            for name, t in layer.bias.items():
                layer.bias[name] = own(f"{p}{LINEARS[name][0]}.bias", t)
    return out


def _adapter_tensors(trainer: Trainer) -> list:
    return [(prefix + suffix, t) for prefix, ad in trainer.named_adapters()
            for suffix, t in ((".lora_a", ad.a), (".lora_b", ad.b))]


class RayTask:
    """Builds one Ray actor's replica (fucina.dist.Replica) of the run."""

    def __init__(self, path: str, opts: Options):
        self.path, self.opts = path, opts

    def __call__(self):
        from fucina import dist
        task = Task(self.path, self.opts, threads=1)
        replica = dist.Replica(task.es, task.registry, task.score, adapters=self.opts.mode == "lora")
        replica.task = task
        return replica


# ---------------------------------------------------------------------------------------------
# the run

@dataclass
class Result:
    iterations: int
    rewards: list       # mean reward per iteration
    seconds: float
    save_dir: str


def run(opts: Options, out=print) -> Result:
    _validate(opts)
    with tempfile.TemporaryDirectory(prefix="fucina-es-finetune-") as tmp:
        path = resolve_model(opts, tmp)
        task = Task(path, opts, opts.threads)
        loader = Loader(len(task.samples), "shuffled" if opts.shuffle else "sequential",
                        opts.seed if opts.data_seed is None else opts.data_seed)
        tr, lora = task.es, opts.mode == "lora"
        if opts.load is not None:
            state = tr.load_checkpoint(opts.load, task.registry, adapters=lora)
            if None not in (state.data_seed, state.data_epoch, state.data_index):
                loader.restore(LoaderState(state.data_seed, state.data_epoch, state.data_index))
            out(f"resumed {opts.load} at iteration {tr.iteration}")
        cfg = tr.config
        out(f"es-finetune: {os.path.basename(path)}, mode {opts.mode} ({tr.element_count():,} "
            f"parameters), reward {opts.reward}, population {cfg.population}"
            f"{' (antithetic)' if cfg.antithetic else ''}, sigma {float(np.float32(cfg.sigma)):.4g}, "
            f"alpha {tr.alpha_value():.4g}, {cfg.reward_norm}, batch {opts.batch}"
            + (f", Ray {opts.ray} x {opts.actors} actors" if opts.ray else ""))
        cluster = None
        if opts.ray is not None:
            from fucina import dist
            cluster = dist.EsCluster(RayTask(path, opts), tr, task.registry, actors=opts.actors,
                                     ray=opts.ray, adapters=lora, block=1)
        means, t0 = [], time.perf_counter()
        try:
            start = tr.iteration
            for it in range(start, opts.iterations):
                batch = [loader.next() for _ in range(opts.batch)]
                t1 = time.perf_counter()
                if cluster is None:
                    rewards = task.score(range(cfg.population), batch)
                else:
                    rewards = cluster.evaluate(tr, payload=batch)
                stats = tr.update(rewards)
                if cluster is not None:
                    cluster.update(tr, rewards)
                means.append(stats.mean_reward)
                out(f"iter {it + 1:>4}/{opts.iterations}  reward mean {stats.mean_reward:.4f}  "
                    f"std {stats.std_reward:.4f}  min {stats.min_reward:.4f}  max "
                    f"{stats.max_reward:.4f}  {(time.perf_counter() - t1) * 1e3:.0f} ms")
            if cluster is not None:
                cluster.verify(tr)
        finally:
            if cluster is not None:
                cluster.close()
        elapsed = time.perf_counter() - t0
        save = opts.save or default_save_dir()
        ls = loader.state()
        extra = dict(lora_rank=opts.rank, lora_alpha=float(opts.lora_alpha)) if lora else {}
        tr.save_checkpoint(save, task.registry, adapters=lora, data_seed=ls.seed,
                           data_epoch=ls.epoch, data_index=ls.index, **extra)
        out(f"saved {save} (iteration {tr.iteration}, {elapsed:.1f} s)")
        return Result(tr.iteration, means, elapsed, save)


def _validate(o: Options) -> None:
    if o.mode not in MODES or o.reward not in REWARDS:
        raise fu.InvalidConfig(f"es-finetune: expected --mode in {MODES} and --reward in "
                               f"{REWARDS}, got {o.mode!r} / {o.reward!r}")
    for name in ("iterations", "batch", "rank", "seq_max", "actors"):
        if getattr(o, name) < 1:
            raise fu.InvalidConfig(f"es-finetune: --{name.replace('_', '-')}: expected >= 1, got "
                                   f"{getattr(o, name)}")
    if o.max_new < 1:
        raise fu.InvalidConfig(f"es-finetune: --max-new: expected >= 1, got {o.max_new}")
    if o.load is not None and load_trainer_state(o.load) is None:
        raise fu.InvalidTrainerState(f"es-finetune --load {o.load}: expected a checkpoint "
                                     f"directory with a trainer_state.json, found none")


def parse_args(argv=None) -> Options:
    d = Options()
    ap = argparse.ArgumentParser(prog="fucina es-finetune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF to fine-tune (default: as `fucina finetune`)")
    ap.add_argument("--tiny", action="store_true", help="a small random model (the pipeline, anywhere)")
    ap.add_argument("--data", metavar="PATH.jsonl", help="instruction/response JSONL (default: "
                    "the five built-in pirate pairs)")
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--data-seed", type=int)
    ap.add_argument("--mode", choices=MODES, default=d.mode)
    ap.add_argument("--reward", choices=REWARDS, default=d.reward)
    ap.add_argument("--iterations", type=int, default=d.iterations)
    ap.add_argument("--population", type=int, default=d.population)
    ap.add_argument("--sigma", type=float, default=d.sigma)
    ap.add_argument("--alpha", type=float, help="ES step (default sigma / 2)")
    ap.add_argument("--noise", choices=("iid", "correlated"), default=d.noise)
    ap.add_argument("--antithetic", action="store_true")
    ap.add_argument("--cache-streams", action="store_true")
    ap.add_argument("--anchor-decay", choices=("none", "l1", "l2"), default=d.anchor_decay)
    ap.add_argument("--anchor-lambda", type=float, default=d.anchor_lambda)
    ap.add_argument("--norm", choices=("z_score", "centered_ranks", "none"), default=d.norm)
    ap.add_argument("--restore-mode", choices=("regenerate", "snapshot"), default=d.restore_mode)
    ap.add_argument("--batch", type=int, default=d.batch, help="samples scored per iteration")
    ap.add_argument("--max-new", type=int, default=d.max_new, help="rule reward: answer length")
    ap.add_argument("--rank", type=int, default=d.rank)
    ap.add_argument("--lora-alpha", type=float, default=d.lora_alpha)
    ap.add_argument("--seq-max", type=int, default=d.seq_max)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--save", metavar="DIR")
    ap.add_argument("--load", metavar="DIR")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--ray", metavar="local|auto|ADDRESS",
                    help="score members on Ray actors (byte-identical result)")
    ap.add_argument("--actors", type=int, default=d.actors)
    a = ap.parse_args(argv)
    return Options(**{k: v for k, v in vars(a).items()})


def main(argv=None) -> int:
    opts = parse_args(argv)
    return exit_status("es-finetune", lambda: run(opts, out=lambda s: print(s, flush=True)))


if __name__ == "__main__":
    sys.exit(main())
