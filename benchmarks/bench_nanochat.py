"""The nanochat train step against PyTorch (issue 18 item 7).

    python -m benchmarks.bench_nanochat [--quick]

examples/nanochat's real model (the GPT of examples/gpt.py: 6 x d512, 8 heads x 64, SwiGLU 1536,
seq 1024, byte vocabulary 256) on windows of the Python standard library's bytes. Fucina: the
block matrices are bf16 leaves with f32 masters (the GEMMs widen them in registers), Muon for
them (Newton–Schulz through the bf16 GEMM, as torch's Muon runs it in bf16), its embedded AdamW for the embedding and the head, the loss fused with the head
(examples/nanochat.Run.train_step). PyTorch: the same weights and windows in the usual CPU mixed
precision — f32 parameters, the forward under `torch.autocast("cpu", torch.bfloat16)` —
`torch.optim.Muon` (lr 0.02, momentum 0.95, Nesterov; its default lr adjustment is the same
spectral sqrt(max(1, rows/cols))) for the matrices and fused AdamW (lr 3e-3, β 0.9/0.95, eps
1e-10) for the rest. A step is forward + backward + both optimizers + zero_grad; steps
alternate (Fucina, PyTorch, ...), medians after one warm-up. The two sides round differently
(bf16 weights vs bf16 matmul inputs), so their losses are reported, not compared bitwise.
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import row

GROUP = "nanochat step"


def _torch_step(torch, cfg, weights, cos, sin, lr: float):
    """The PyTorch side: (step(window) -> loss)."""
    from examples.gpt import torch_twin
    W, loss_fn, _ = torch_twin(torch, cfg, weights, cos, sin)
    mats = [t for n, t in W.items() if n.startswith("layers.")]
    rest = [t for n, t in W.items() if not n.startswith("layers.")]
    muon = torch.optim.Muon(mats, lr=lr, weight_decay=0.0, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0,
                              fused=True)

    def step(window):
        t = torch.from_numpy(window.astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(t[:-1], t[1:])
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from examples.gpt import init_weights
    from examples.nanochat import REAL, Run, stdlib_bytes
    torch = c.torch()
    cfg = REAL["cfg"]
    steps = 3 if quick else 6
    ctx = fu.ExecContext(threads=threads)
    run = Run(ctx, cfg, stdlib_bytes(REAL["data_mb"]), lr=0.02, seed=0)
    windows = [run.window(run.train, s) for s in range(steps + 1)]

    def ours(window):
        assert np.array_equal(window, run.window(run.train, run.step))
        return run.train_step()

    theirs = None
    if torch is not None:
        with c.torch_threads(threads):
            theirs = _torch_step(torch, cfg, init_weights(cfg, 0), run.model.table.cos(),
                                 run.model.table.sin(), 0.02)
    fu_losses, to_losses, fu_s, to_s = c.alternating_steps(windows, ours, theirs, threads)
    ctx.close()
    tokens = cfg.seq
    note = (f"{steps} timed steps after one warm-up, medians; {tokens / fu_s:,.0f} tokens/s"
            + (f" vs {tokens / to_s:,.0f}" if to_s else "")
            + f"; losses {fu_losses[0]:.4f} → {fu_losses[-1]:.4f}"
            + (f" (PyTorch {to_losses[0]:.4f} → {to_losses[-1]:.4f})" if to_losses else ""))
    return [row(GROUP, f"nanochat 6 x d512, seq {cfg.seq}, bytes: bf16 matrices + Muon, "
                f"AdamW embedding/head (torch: autocast bf16, Muon + fused AdamW)", threads,
                fu_s, to_s, note=note)]


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "nanochat step", _one))


if __name__ == "__main__":
    import sys
    for r in rows("--quick" in sys.argv):
        print(r)
