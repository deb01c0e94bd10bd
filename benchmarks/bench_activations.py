"""Activation benchmarks: transcendental activations at 16 Mi f32 and a fused SwiGLU, vs PyTorch.

    python -m benchmarks.bench_activations [--quick]

Target (the activation family's brief): gelu, gelu_erf, silu, tanh, exp and sigmoid on 16 Mi
elements at least as fast as PyTorch at 1 and 2 threads; swiglu (up · silu(gate)) on
[256, 3072] at least as fast as PyTorch.

Each op is compared with PyTorch twice: out-of-place, what `F.gelu(x)` costs a user (at 64 MiB
glibc serves the result with mmap, so torch faults its pages in on every call; Fucina's pool
hands back a mapped buffer), and writing into a preallocated tensor (`out=`), which isolates
the kernels. Fucina's kernels are within 2 ulp of float64 (silu, gelu, sigmoid ~1.7 ulp with a
compensated division); PyTorch's vectorized erf is an Abramowitz-Stegun fit with ~1e-7
absolute error, which is cheaper. The note gives each row's rate against the measured memory
bandwidth (a kernel at the bandwidth line is memory-bound; below it, compute-bound).
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import BIG_ELEMS

GROUP = "activations 16 Mi f32"
GROUP_GATED = "gated activations"

# op, Fucina statement, torch out-of-place, torch out=
UNARY_CASES = [
    ("gelu (tanh)", "a.gelu()", 'F.gelu(ta, approximate="tanh")',
     'torch._C._nn.gelu(ta, approximate="tanh", out=tc)'),
    ("gelu_erf", "a.gelu_erf()", "F.gelu(ta)", "torch._C._nn.gelu(ta, out=tc)"),
    ("silu", "a.silu()", "F.silu(ta)", "torch._C._nn.silu(ta, out=tc)"),
    ("tanh", "a.tanh()", "torch.tanh(ta)", "torch.tanh(ta, out=tc)"),
    ("exp", "a.exp()", "torch.exp(ta)", "torch.exp(ta, out=tc)"),
    ("sigmoid", "a.sigmoid()", "torch.sigmoid(ta)", "torch.sigmoid(ta, out=tc)"),
]


def _ctx(threads):
    import fucina as fu

    return fu.ExecContext(threads=threads)


def _unary(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    n = BIG_ELEMS
    x = np.random.default_rng(0).uniform(-6, 6, n).astype(np.float32)
    ctx = _ctx(threads)
    env = {"a": ctx.tensor(x, tags=("n",))}
    if torch is not None:
        import torch.nn.functional as F

        env.update(torch=torch, F=F, ta=torch.from_numpy(x), tc=torch.empty(n, dtype=torch.float32))
    rows = []
    try:
        for what, fu_stmt, to_stmt, out_stmt in UNARY_CASES:
            rows += c.guarded(GROUP, what, lambda: _one(threads, quick, what, fu_stmt, to_stmt,
                                                        out_stmt, env))
    finally:
        env.clear()
        ctx.close()
    return rows


def _one(threads, quick, what, fu_stmt, to_stmt, out_stmt, env):
    torch = c.torch()
    nbytes = 2 * BIG_ELEMS * 4
    stmts = {"fucina": fu_stmt}
    if torch is not None:
        with c.torch_threads(threads):
            c.check_ends(eval(fu_stmt, env).numpy(), eval(to_stmt, env).numpy(), what, atol=2e-6)
        stmts.update(torch=to_stmt, torch_out=out_stmt)
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick, repeats=3 if quick else 9,
                         block_s=0.05 if quick else 0.15, before=lambda: c.sample_bandwidth(threads))
    label = f"{what}, 16 Mi f32 (128 MiB moved)"
    if torch is None:
        return [c.bw_row(GROUP, label, threads, t["fucina"], None, nbytes=nbytes,
                         bw_now=load.before, bw_target=False, extra=str(load))]
    return [c.bw_row(GROUP, f"{label} {k}", threads, t["fucina"], t[key].median,
                     nbytes=nbytes, bw_now=load.before, bw_target=False, target="≥ PyTorch",
                     extra=str(load))
            for key, k in c.OUT_OF_PLACE_AND_OUT]


def _gated(threads: int, quick: bool) -> list[dict]:
    """up · silu(gate) on [256, 3072] (an FFN's SwiGLU at 256 tokens), and split_gated on the
    concatenated [256, 6144] projection; torch needs two kernels (silu, mul)."""
    torch = c.torch()
    rng = np.random.default_rng(1)
    up = rng.standard_normal((256, 3072)).astype(np.float32)
    gate = rng.standard_normal((256, 3072)).astype(np.float32)
    both = np.concatenate([gate, up], axis=1)
    ctx = _ctx(threads)
    env = {"u": ctx.tensor(up, tags=("t", "f")), "g": ctx.tensor(gate, tags=("t", "f")),
           "x": ctx.tensor(both, tags=("t", "f"))}
    cases = [("swiglu up·silu(gate), [256, 3072]", "u.swiglu(g)", "tu * F.silu(tg)",
              "torch.mul(tu, torch._C._nn.silu(tg, out=ts), out=tc)"),
             ("split_gated swiglu, [256, 6144] → [256, 3072]", 'x.split_gated("swiglu", "f", "f")',
              "(lambda a, b: F.silu(a) * b)(*tx.chunk(2, dim=1))",
              "torch.mul(torch._C._nn.silu(tx[:, :3072], out=ts), tx[:, 3072:], out=tc)")]
    if torch is not None:
        import torch.nn.functional as F

        env.update(torch=torch, F=F, tu=torch.from_numpy(up), tg=torch.from_numpy(gate),
                   tx=torch.from_numpy(both), ts=torch.empty(256, 3072), tc=torch.empty(256, 3072))
    rows = []
    try:
        for what, fu_stmt, to_stmt, out_stmt in cases:
            rows += c.guarded(GROUP_GATED, what, lambda: _one_gated(
                threads, quick, what, fu_stmt, to_stmt, out_stmt, env))
    finally:
        env.clear()
        ctx.close()
    return rows


def _one_gated(threads, quick, what, fu_stmt, to_stmt, out_stmt, env):
    torch = c.torch()
    stmts = {"fucina": fu_stmt}
    if torch is not None:
        with c.torch_threads(threads):
            c.check_ends(eval(fu_stmt, env).numpy(), eval(to_stmt, env).numpy(), what, atol=2e-6)
        stmts.update(torch=to_stmt, torch_out=out_stmt)
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick, repeats=5 if quick else 15,
                         block_s=0.02 if quick else 0.05)
    if torch is None:
        return [c.vs_torch(GROUP_GATED, what, threads, t["fucina"], None, load)]
    return [c.vs_torch(GROUP_GATED, f"{what} {label}", threads, t["fucina"], t[key], load)
            for key, label in c.OUT_OF_PLACE_AND_OUT]


def rows(quick: bool = False) -> list[dict]:
    return c.finalize(c.each_thread_count(quick, (GROUP, "unary activations", _unary))
                      + c.each_thread_count(quick, (GROUP_GATED, "gated activations", _gated)))


if __name__ == "__main__":
    c.main(lambda quick: rows(quick) + c.bandwidth_rows())
