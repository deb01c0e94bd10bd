"""A full GPT train step against a PyTorch twin (issue 18).

    python -m benchmarks.bench_gpt [--quick]

The model of examples/gpt.py: 6 layers, d 512, 8 heads x 64, SwiGLU 1536, vocab 16384, seq 1024,
RMSNorm (eps 1e-5, no weight), half-split RoPE (θ 1e4), causal attention, an untied head with
the cross-entropy fused into its projection (Fucina: `linear_cross_entropy`; PyTorch: linear +
cross_entropy, the usual eager form), AdamW (lr 3e-4, β 0.9/0.95, no decay; PyTorch
`fused=True`). Both start from the same float32 weights and see the same tokens at every step;
a step is forward + backward + optimizer step + zero_grad. Both sides' losses are compared step
by step (first step: same weights, so equal to f32 rounding), and the step time is interleaved
(Fucina step, PyTorch step, ...), medians. Issue 18's second target: the GEMMs inside the
step (6·N·tokens FLOPs of the matrix products outside attention, over the time of their pack
and tile launches, timed launch by launch in one extra step) at ≥ 90 % of our own f32 GEMM
rate measured in the same process (1024³ `matmul`, the proxy for the core's peak); the note
also gives the whole step's rate (attention's causal FLOPs included). A second row per thread
count trains on batches of 4 sequences
([batch, seq] tokens through the batch axes of attention and of the fused linear + CE).
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import row

GROUP = "gpt train step"


def _flops(cfg, batch: int = 1) -> tuple[float, float]:
    """(the step's FLOPs, those of its matrix products outside attention)."""
    per_layer = 4 * cfg.d * cfg.attn + 3 * cfg.d * cfg.ffn
    dense = 6 * (cfg.layers * per_layer + cfg.vocab * cfg.d) * cfg.seq
    attn = cfg.layers * 3 * 2 * cfg.seq * cfg.seq * cfg.attn     # causal: half of 2 GEMMs, x3
    return float(dense + attn) * batch, float(dense) * batch


def _one(threads: int, quick: bool, batch: int = 1) -> list[dict]:
    import fucina as fu
    from examples.gpt import Gpt, GptConfig, init_weights, torch_twin
    torch = c.torch()
    cfg = GptConfig()
    steps = 3 if quick or batch > 1 else 7
    weights = init_weights(cfg, seed=0)
    rng = np.random.default_rng(1)
    shape = (cfg.seq + 1,) if batch == 1 else (batch, cfg.seq + 1)
    batches = [rng.integers(0, cfg.vocab, shape) for _ in range(steps + 1)]
    ctx = fu.ExecContext(threads=threads)
    model = Gpt(ctx, cfg, weights)
    opt = fu.optim.AdamW(lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.0)
    for name, t in model.params.items():
        opt.add_param(t, name=name)

    def fu_step(tokens):
        with ctx.exec_scope():
            loss = model.loss(tokens[..., :-1], tokens[..., 1:])
            loss.backward()
            value = loss.item()
        opt.step()
        opt.zero_grad()
        return value

    tw = None
    if torch is not None:
        with c.torch_threads(threads):
            W, tloss, topt = torch_twin(torch, cfg, weights, model.table.cos(),
                                       model.table.sin())

        def to_step(tokens):
            t = torch.from_numpy(tokens)
            loss = tloss(t[..., :-1], t[..., 1:])
            loss.backward()
            topt.step()
            topt.zero_grad(set_to_none=True)
            return loss.item()
        tw = to_step
    fu_losses, to_losses, fu_s, to_s = c.alternating_steps(batches, fu_step, tw, threads)
    gemm_s = c.gemm_seconds(ctx, lambda: fu_step(batches[-1]))   # one more step, its GEMMs timed
    ctx.close()
    total, dense = _flops(cfg, batch)
    rate, gemm_rate = total / fu_s, dense / gemm_s
    peak, core = c.gemm_rate(threads), c.core_peak(threads)
    share = gemm_rate / core
    dev = max(abs(a - b) / abs(b) for a, b in zip(fu_losses, to_losses)) if to_losses else None
    note = (f"{steps} timed steps after one warm-up, medians; the GEMMs inside a step (packs and "
            f"tiles, timed launch by launch in one more step) {gemm_rate / 1e9:.0f} GFLOP/s = "
            f"**{share:.0%}** of the cores' f32 FMA peak ({core / 1e9:.0f} GFLOP/s) and "
            f"{gemm_rate / peak:.0%} of our 1024³ f32 GEMM rate ({peak / 1e9:.0f} GFLOP/s), same "
            f"process, {gemm_s * 1e3:.0f} ms of the step; {rate / 1e9:.0f} GFLOP/s for the "
            f"whole step; losses {fu_losses[0]:.6f} → {fu_losses[-1]:.6f}"
            + (f", max relative deviation from torch over the steps {dev:.1e}" if dev is not None
               else "")
            + (f"; {c.bound_note(to_s, total, peak, 'torch', core)}" if to_s else ""))
    shape = f"seq {cfg.seq}" if batch == 1 else f"batch {batch} x seq {cfg.seq}"
    r = row(GROUP, f"GPT 6 x d512, {shape}, vocab {cfg.vocab}: forward + backward + AdamW "
            f"(torch: eager + fused AdamW)", threads, fu_s, to_s,
            target="≥ 1.5× PyTorch, GEMMs inside the step ≥ 90 % of the core's f32 peak"
            if to_s else "", met=(to_s / fu_s >= 1.5 and share >= 0.9) if to_s else None,
            note=note)
    return [c.above_bound(r, to_s, total, core, 1.5) if to_s else r]


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "gpt step", _one),
                               (GROUP, "gpt step, batch 4", lambda k, q: _one(k, q, 4)))


if __name__ == "__main__":
    import sys
    for r in rows("--quick" in sys.argv):
        print(r)
