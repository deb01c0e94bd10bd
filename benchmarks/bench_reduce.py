"""Reduction and scan benchmarks at 64 MiB (16 Mi f32), vs PyTorch.

    python -m benchmarks.bench_reduce [--quick]

Sums read 64 MiB and write almost nothing, so they are bandwidth-bound; the target used
here is "at least as fast as PyTorch" (DESIGN.md §7 lists no separate reduction target), and the
note gives the read rate against the measured (read + write) scale bandwidth for reference.
Fucina's reductions are deterministic (the order is fixed by the size, not the thread count);
PyTorch's are not required to be.

Scans (cumsum) read 64 MiB and write 64 MiB. Fucina's cumsum is a serial float32 chain per
lane (bitwise deterministic, SPEC §3.8); PyTorch's CPU cumsum is serial per lane too but
accumulates in float64. A 1-D input is a single chain: no thread count can split it without
changing the result, so its 2-thread row runs on one core on both sides. PyTorch's
out-of-place cumsum allocates (and page-faults in) a fresh 64 MiB result every call, so the
scan rows are also measured against `torch.cumsum(..., out=)` into a preallocated tensor.

Variance is two passes in a fixed order in Fucina (mean, then Σ(x − μ)²/(n − ddof)); PyTorch
uses Welford (per-lane reductions) or a two-pass float64 reduction (whole-tensor).
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import BIG_ELEMS

GROUPS = {"sum": "reduce 64 MiB", "scan": "scan 64 MiB", "var": "variance 64 MiB"}

SQ = (4096, 4096)
CASES = [
    # kind, what, shape, fucina stmt, torch stmt, bytes moved (x data size)
    ("sum", "sum_all, 16 Mi f32", (BIG_ELEMS,), "x.sum_all()", "tx.sum()", 1),
    ("sum", "sum over last axis, [4096, 4096] → [4096]", SQ, 'x.sum("j")', "tx.sum(dim=1)", 1),
    ("sum", "sum over first axis, [4096, 4096] → [4096]", SQ, 'x.sum("i")', "tx.sum(dim=0)", 1),
    ("scan", "cumsum, 16 Mi f32 (one serial chain) vs torch out-of-place", (BIG_ELEMS,),
     'x.cumsum("n")', "tx.cumsum(0)", 2),
    ("scan", "cumsum, 16 Mi f32 (one serial chain) vs torch out= (prealloc.)", (BIG_ELEMS,),
     'x.cumsum("n")', "torch.cumsum(tx, 0, out=to)", 2),
    ("scan", "cumsum over last axis, [4096, 4096] vs torch out-of-place", SQ,
     'x.cumsum("j")', "tx.cumsum(1)", 2),
    ("scan", "cumsum over last axis, [4096, 4096] vs torch out= (prealloc.)", SQ,
     'x.cumsum("j")', "torch.cumsum(tx, 1, out=to)", 2),
    ("scan", "cumsum over first axis, [4096, 4096] vs torch out= (prealloc.)", SQ,
     'x.cumsum("i")', "torch.cumsum(tx, 0, out=to)", 2),
    ("var", "variance (ddof=1), 16 Mi f32 → scalar", (BIG_ELEMS,), 'x.variance("n", 1)',
     "tx.var(0)", 1),
    ("var", "variance (ddof=1) over last axis, [4096, 4096] → [4096]", SQ, 'x.variance("j", 1)',
     "tx.var(1)", 1),
    ("var", "variance (ddof=1) over first axis, [4096, 4096] → [4096]", SQ, 'x.variance("i", 1)',
     "tx.var(0)", 1),
]

NOTES = {
    "sum": "read-only, % is of the read + write scale bandwidth",
    "scan": "64 MiB read + 64 MiB written; % is of the scale bandwidth",
    "var": "two passes in Fucina (the second re-reads x: % counts one read of x)",
}


def _agree(kind, got, want) -> bool:
    if kind == "scan":  # a serial float32 chain vs PyTorch's float64 accumulation
        return np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
    return np.allclose(got, want, rtol=1e-4, atol=1e-2)


def _one(threads: int, quick: bool, kind, what, shape, fu_stmt, to_stmt, moved) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    data = np.random.default_rng(2).uniform(-1, 1, shape).astype(np.float32)
    tags = ("i", "j")[:len(shape)] if len(shape) == 2 else ("n",)
    ctx = fu.ExecContext(threads=threads)
    try:
        env = {"x": ctx.tensor(data, tags=tags)}
        stmts = {"fucina": fu_stmt}
        if torch is not None:
            env.update(torch=torch, tx=torch.from_numpy(data), to=torch.empty(shape))
            with c.torch_threads(threads):
                got = eval(fu_stmt, env).numpy()
                want = eval(to_stmt, env).numpy()
            if not _agree(kind, got, want):
                raise AssertionError(f"{what}: Fucina and PyTorch disagree")
            stmts["torch"] = to_stmt
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 9, block_s=0.05 if quick else 0.15,
                             before=lambda: c.sample_bandwidth(threads))
        env.clear()
    finally:
        ctx.close()
    to_s = t["torch"].median if "torch" in t else None
    return [c.bw_row(GROUPS[kind], what, threads, t["fucina"], to_s, nbytes=data.nbytes * moved,
                     bw_now=load.before, bw_target=False,
                     target="≥ PyTorch" if to_s else "",
                     extra=f"{NOTES[kind]}; {load}")]


def rows(quick: bool = False) -> list[dict]:
    return c.finalize(c.each_thread_count(
        quick, *((GROUPS[case[0]], case[1], lambda k, q, case=case: _one(k, q, *case)) for case in CASES)))


if __name__ == "__main__":
    c.main(lambda quick: rows(quick) + c.bandwidth_rows())
