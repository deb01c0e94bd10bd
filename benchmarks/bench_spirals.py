"""The spirals demo (SPEC D-1) vs PyTorch eager.

    python -m benchmarks.bench_spirals [--quick]

Rows:
* one full-batch AdamW training step of the 400-point 2-64-64-2 tanh MLP — forward, mean
  cross-entropy, backward, AdamW(lr 0.02, wd 1e-4) step, zero_grad; Fucina's step under an exec
  scope, PyTorch's with `F.linear` + `torch.tanh` + `F.cross_entropy` and `torch.optim.AdamW` as a
  user gets it (default implementation on CPU tensors, gradients set to None), same data and
  init. Target (DESIGN.md §7, spirals training ≤ PyTorch eager): Fucina ≤ PyTorch at 1 thread;
  2 threads reported too. Both sides are first checked to agree on the loss over 20 steps.
* the whole default demo (`python -m examples.spirals`, its default optimizers and steps,
  training + checkpoint + resume + twin) as a fresh process: wall time with interpreter start,
  import and warm kernel cache. For information (no PyTorch counterpart).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from . import common as c

GROUP = "spirals (SPEC D-1)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_model(torch, arrays):
    names = ("w1", "b1", "w2", "b2", "w3", "b3")
    params = {n: torch.nn.Parameter(torch.from_numpy(arrays[n].copy())) for n in names}
    opt = torch.optim.AdamW([params[n] for n in ("w1", "w2", "w3", "b1", "b2", "b3")],
                            lr=0.02, weight_decay=1e-4)
    return params, opt


def _step_rows(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    ctx = fu.ExecContext(threads=threads)
    try:
        return [_step_row(ctx, threads, quick)]  # its tensors are gone before the pool closes
    finally:
        ctx.close()


def _step_row(ctx, threads: int, quick: bool) -> dict:
    from examples import spirals as sp

    torch = c.torch()
    data = sp.Data.make(ctx)
    model = sp.Mlp(ctx, sp.INIT_SEED)
    trainer = sp.recipes()["adamw"](model)
    opt = trainer.opt

    def fu_step(value=False):
        with ctx.exec_scope():
            loss = model.forward(data.x).cross_entropy("class", data.labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item() if value else None

    env = {"fu_step": fu_step}
    stmts = {"fucina": "fu_step()"}
    if torch is not None:
        F = torch.nn.functional
        p, topt = _torch_model(torch, model.arrays())
        x = torch.from_numpy(data.x_np.copy())
        y = torch.from_numpy(data.labels_np.copy())

        def to_step(value=False):
            h = torch.tanh(F.linear(x, p["w1"], p["b1"]))
            h = torch.tanh(F.linear(h, p["w2"], p["b2"]))
            loss = F.cross_entropy(F.linear(h, p["w3"], p["b3"]), y)
            loss.backward()
            topt.step()
            topt.zero_grad()
            return loss.item() if value else None

        with c.torch_threads(threads):  # same trajectory: a check, and both sides warmed
            for i in range(20):
                a, b = fu_step(True), to_step(True)
                if not np.isclose(a, b, rtol=1e-3, atol=1e-5):
                    raise AssertionError(f"spirals step {i}: Fucina loss {a} vs PyTorch {b}")
        env["to_step"] = to_step
        stmts["torch"] = "to_step()"
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                         repeats=5 if quick else 15, block_s=0.05 if quick else 0.15)
    trainer.close()
    return c.vs_torch(GROUP, "AdamW full-batch step, 400 points, MLP 2-64-64-2 tanh (fwd + CE + bwd "
                             "+ step + zero_grad)", threads, t["fucina"], t.get("torch"), load,
                      target="≤ PyTorch" if threads == 1 else "")


def _demo_rows(quick: bool) -> list[dict]:
    """Wall time of the default demo in a fresh process (best of 1 or 3)."""
    from examples import spirals as sp

    runs = 1 if quick else 3
    best = float("inf")
    with c.ForeignLoad() as load:
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "examples.spirals"], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            best = min(best, time.perf_counter() - t0)
    what = (f"default demo (`python -m examples.spirals`: {', '.join(sp.DEFAULT_OPTIMIZERS)}; "
            f"{sp.DEFAULT_STEPS} steps + resume of the second half each), fresh process")
    return [c.row(GROUP, what, "all", best, note=f"best of {runs}; interpreter start, import, "
                                                 f"warm kernel cache included; {load}")]


def rows(quick: bool = False) -> list[dict]:
    return (c.each_thread_count(quick, (GROUP, "AdamW step", _step_rows))
            + c.guarded(GROUP, "default demo", lambda: _demo_rows(quick)))


if __name__ == "__main__":
    c.main(rows)
