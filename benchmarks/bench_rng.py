"""RNG benchmarks (SPEC §4): dropout at 16 Mi f32 against PyTorch, and the seeded Gaussian fills.

    python -m benchmarks.bench_rng [--quick]

* dropout(p=0.1) forward, 16 Mi f32 → a new 16 Mi f32 tensor (64 MiB read + 64 MiB written),
  against `torch.nn.functional.dropout(x, 0.1, training=True)`. PyTorch uses a different RNG
  (Bernoulli mask from its own generator), so only time is compared; target: ≤ PyTorch.
* gaussian_fill_at_fast (RNG-7, the ES noise contract) into a preallocated 16 Mi f32 tensor:
  no PyTorch equivalent (torch.normal_ is another mapping), so the row reports the write rate
  in GB/s (64 MiB written per call) and its share of the measured memory bandwidth.
* gaussian_fill_at (RNG-6, f64 Box–Muller with musl-exact ln/sin/cos), same shape, for reference.
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import BIG_ELEMS, row

GROUP = "rng 16 Mi f32"
MiB = 1 << 20


def _dropout(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    data = np.random.default_rng(5).standard_normal(BIG_ELEMS).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        env = {"x": ctx.tensor(data, ("n",))}
        stmts = {"fucina": "x.dropout(0.1, 7)"}
        if torch is not None:
            import torch.nn.functional as F

            env.update(tx=torch.from_numpy(data), F=F)
            stmts["torch"] = "F.dropout(tx, 0.1, True)"
            kept = (eval(stmts["fucina"], env).numpy() != 0).mean()
            if abs(kept - 0.9) > 1e-3:
                raise AssertionError(f"dropout kept {kept:.4f} of the elements, expected 0.9")
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 9, block_s=0.05 if quick else 0.15,
                             before=lambda: c.sample_bandwidth(threads))
        env.clear()
    finally:
        ctx.close()
    to_s = t["torch"].median if "torch" in t else None
    return [c.bw_row(GROUP, "dropout p=0.1 forward, 16 Mi f32 (new tensor)", threads, t["fucina"], to_s,
                     nbytes=2 * data.nbytes, bw_now=load.before, bw_target=False,
                     target="≤ PyTorch" if to_s else "",
                     extra=f"PyTorch draws its mask with another RNG: time only; {load}")]


def _fills(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    import fucina.rng as R

    ctx = fu.ExecContext(threads=threads)
    rows = []
    try:
        env = {"R": R, "out": ctx.zeros((BIG_ELEMS,), ("n",))}
        stmts = {"fast": "R.gaussian_fill_at_fast(42, 0, out, 1.0)",
                 "f64": "R.gaussian_fill_at(42, 0, out, 1.0)"}
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 7, block_s=0.05 if quick else 0.15,
                             before=lambda: c.sample_bandwidth(threads))
        env.clear()
    finally:
        ctx.close()
    nbytes = BIG_ELEMS * 4
    for key, what in (("fast", "gaussian_fill_at_fast (RNG-7, f32 Cephes), 16 Mi f32 into a given tensor"),
                      ("f64", "gaussian_fill_at (RNG-6, f64 musl ln/sin/cos), 16 Mi f32 into a given tensor")):
        med, best = t[key].median, t[key].best
        r = row(GROUP, what, threads, round(nbytes / med / 1e9, 2), unit="GB/s",
                note=f"median {c.fmt_time(med)} per call = {c.fmt_gbs(nbytes / med)} written "
                     f"(best {c.fmt_gbs(nbytes / best)}), {nbytes / med / load.before:.0%} of the "
                     f"{c.fmt_gbs(load.before)} read+write bandwidth measured just before; "
                     f"compute-bound (no PyTorch equivalent); {load}")
        rows.append(r)
    return rows


def rows(quick: bool = False) -> list[dict]:
    return c.finalize(c.each_thread_count(quick, (GROUP, "dropout", _dropout),
                                          (GROUP, "gaussian fills", _fills)))


if __name__ == "__main__":
    c.main(lambda quick: rows(quick) + c.bandwidth_rows())
