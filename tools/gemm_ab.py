"""The LoRA step before and after the GEMM changes of issue 18, interleaved in one process.

    PYTHONPATH=. python -m tools.gemm_ab [--threads 1 2] [--steps 5] [--quick] [--no-hf]

"before" replays the previous GEMM planning in this very process: a 14-row micro-tile and b
always packed first (fucina.codegen.gemm.mr patched to 14, fucina.exec.matmul.DIRECT_B off);
"after" is the code as it stands (8-row micro-tile, b read in place by gemm_tile_direct where
it applies). Both are bench_finetune's step (benchmarks/bench_finetune.py: loss, backward,
clip 1.0, AdamW; LoRA rank 8, alpha 16) on one trainer, timed step by step in turn (before,
after, transformers + peft when installed), medians after a warm-up round; the GEMM plans are
dropped at every switch. A "(fastest step)" line gives the minima (a busy machine's
disturbances only ever add time). At 1 thread a second line gives the caller's CPU clock (on a
shared machine other processes' time slices are then left out). GFLOP/s counts bench_finetune's matrix work; "% of peak" divides it
by our 1024³ f32 GEMM rate measured in the same process at the same thread count.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _set(mode: str, orig_mr):
    from fucina.codegen import gemm as g
    from fucina.exec import matmul as mm
    g.mr = (lambda: 14) if mode == "before" else orig_mr
    mm.DIRECT_B = mode != "before"
    mm._plans.clear()


def _peak(threads: int) -> float:
    """Our 1024³ f32 GEMM rate (best of a few blocks), FLOP/s."""
    import fucina as fu
    from fucina.exec.matmul import gemm
    ctx = fu.ExecContext(threads=threads)
    rng = np.random.default_rng(0)
    a = ctx.from_numpy(rng.standard_normal((1024, 1024)).astype(np.float32))
    b = ctx.from_numpy(rng.standard_normal((1024, 1024)).astype(np.float32))
    out = gemm(ctx, a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            gemm(ctx, a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / 10)
    ctx.close()
    return 2 * 1024 ** 3 / best


def run_case(path, label, targets, seq, threads, steps, hf: bool) -> dict:
    from benchmarks import bench_finetune as bf
    from benchmarks import common as c
    from fucina.codegen import gemm as g

    orig_mr = g.mr
    cfg, fstep = bf._fucina(path, targets, threads)
    hstep = None
    if hf and c.torch() is not None:
        try:
            with c.torch_threads(threads):
                hstep = bf._hf(path, targets)
        except ImportError:
            hstep = None
    rng = np.random.default_rng(seq)
    times = {k: [] for k in ("before", "after", "hf", "before cpu", "after cpu", "hf cpu")}

    def timed(name, fn):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        if i:
            times[name].append(time.perf_counter() - t0)
            times[name + " cpu"].append(time.thread_time() - c0)

    for i in range(steps + 1):
        tokens = rng.integers(0, cfg.vocab, seq + 1)
        for mode in ("before", "after"):
            _set(mode, orig_mr)
            timed(mode, lambda: fstep(tokens))
        _set("after", orig_mr)
        if hstep is not None:
            with c.torch_threads(threads):
                timed("hf", lambda: hstep(tokens))
    flop = bf._flops(cfg, targets, seq)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    fastest = {k + " min": min(v) for k, v in times.items() if v}
    return {"label": label, "targets": ",".join(targets), "seq": seq, "threads": threads,
            "flop": flop, **med, **fastest}


def main(argv=None):
    from benchmarks import bench_finetune as bf
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="SmolLM2 q,v seq 256 only")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-real", action="store_true", help="skip the qwen2 / gemma3 files")
    ns = p.parse_args(argv)
    path, label = bf.model_file()
    cases = [(path, label, t, s) for s in ((256,) if ns.quick else ns.seqs)
             for t in (("q", "v"),) + (() if ns.quick else (bf.TARGETS["all seven"],))]
    if not ns.quick and not ns.no_real:
        cases += [(p_, l_, ("q", "v"), 256) for p_, l_ in bf.real_files()[:1]]
    print("| model | targets | seq | threads | before | after | after/before | transformers + peft "
          "| hf/before | hf/after | GFLOP/s before → after | % of our 1024³ GEMM (before → after) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads in ns.threads:
        peak = _peak(threads)
        for path_, label_, targets, seq in cases:
            r = run_case(path_, label_, targets, seq, threads, ns.steps, not ns.no_hf)
            _row(f"{label_.split(' (')[0]} | {r['targets']} | {seq}", threads, r, "",
                 f" of {peak / 1e9:.0f}", peak)
            _row(" (fastest step) | |", threads, r, " min", "", peak)
            if threads == 1:    # the caller's CPU clock: other processes' time slices left out
                _row(" (CPU clock) | |", 1, r, " cpu", "", None)

def _row(label, threads, r, kind, peak_note, peak):
    """One table row of run_case's result `r` for the timing `kind` ("" median, " min",
    " cpu"): before, after, transformers + peft when measured, GFLOP/s and % of `peak`."""
    b, a, hf = r["before" + kind], r["after" + kind], r.get("hf" + kind)
    gb, ga = r["flop"] / b / 1e9, r["flop"] / a / 1e9
    pct = (f"{100 * gb * 1e9 / peak:.0f} % → {100 * ga * 1e9 / peak:.0f} %{peak_note}"
           if peak else "")
    print(f"| {label} | {threads} | {b:.3f} s | {a:.3f} s | {a / b:.3f} | "
          + (f"{hf:.3f} s | {hf / b:.2f}× | {hf / a:.2f}× | " if hf else "— | — | — | ")
          + f"{gb:.0f} → {ga:.0f} | {pct} |", flush=True)


if __name__ == "__main__":
    main()
