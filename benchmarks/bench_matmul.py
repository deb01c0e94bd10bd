"""GEMM benchmarks: f32 matrix products at transformer shapes, 1 and 2 threads, vs torch.mm;
and the bf16 compute's products (gemm_bf16) vs torch.mm in bf16.

    python -m benchmarks.bench_matmul [--quick]

Target (DESIGN.md §7): at least 90 % of PyTorch's speed (MKL/oneDNN behind torch.mm) on every
row, i.e. torch/fucina >= 0.90. Both sides write into a preallocated output (`gemm(ctx, a, b,
out)` vs `torch.mm(ta, tb, out=tc)`), so the rows time the products, not the allocation of a
fresh result. Fucina's figure includes packing both operands (its scratch comes from the pool).
GFLOP/s = 2·M·K·N / median time. (M, K, N): a is [M, K], b is [K, N]; "b = Wᵀ" means b is the
transposed view of a contiguous [N, K] weight (the nn.Linear layout), read without a copy.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "matmul f32"

# (M, K, N, b transposed?, required row?)
CASES = [
    (256, 1024, 1024, False, True),
    (1024, 1024, 1024, False, True),
    (2048, 1024, 1024, False, True),
    (1024, 3072, 1024, False, True),
    (256, 1024, 8, False, True),
    (1024, 1024, 1024, True, False),
    (1, 1024, 1024, False, False),
    (1, 1024, 1024, True, False),
    (64, 64, 64, False, False),
    (1, 1, 1, False, False),
]
QUICK = {(256, 1024, 1024, False), (1024, 1024, 1024, False), (256, 1024, 8, False),
         (1, 1024, 1024, True), (1, 1, 1, False)}


def _what(M, K, N, tb):
    return f"({M}, {K}, {N})" + (", b = Wᵀ" if tb else "")


def _one(threads: int, quick: bool, M, K, N, tb) -> list[dict]:
    import fucina as fu
    from fucina.exec.matmul import gemm, path_of

    torch = c.torch()
    rng = np.random.default_rng(M + K + N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        a = ctx.from_numpy(A)
        b = ctx.from_numpy(np.ascontiguousarray(B.T)).permute((1, 0)) if tb else ctx.from_numpy(B)
        out = ctx.empty((M, N))
        env = {"gemm": gemm, "ctx": ctx, "a": a, "b": b, "out": out}
        stmts = {"fucina": "gemm(ctx, a, b, out)"}
        gemm(ctx, a, b, out)
        got = out.to_numpy()
        want = A.astype(np.float64) @ B.astype(np.float64)
        if np.abs(got - want).max() > 1e-5 * K * np.abs(A).max() * np.abs(B).max():
            raise AssertionError(f"{_what(M, K, N, tb)}: wrong result")
        if torch is not None:
            tbm = torch.from_numpy(np.ascontiguousarray(B.T)).t() if tb else torch.from_numpy(B)
            env.update(torch=torch, ta=torch.from_numpy(A), tb=tbm, tc=torch.empty(M, N))
            stmts["torch"] = "torch.mm(ta, tb, out=tc)"
        small = M * N * K < 1 << 20
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else (15 if small else 9),
                             block_s=0.05 if quick else (0.03 if small else 0.15))
        path = path_of(a, b)
        env.clear()
        del a, b, out
    finally:
        ctx.close()
    flops = 2.0 * M * K * N
    note = f"Fucina {flops / t['fucina'].median / 1e9:.1f} GFLOP/s"
    if "torch" in t:
        note += f", torch {flops / t['torch'].median / 1e9:.1f} GFLOP/s"
    r = c.vs_torch(GROUP, _what(M, K, N, tb), threads, t["fucina"], t.get("torch"), load,
                   target="≥ 90 % of PyTorch", at_least=0.90, note=f"{note}; path {path}")
    r["gflops"] = flops / t["fucina"].median / 1e9
    return [r]


GROUP_BF16 = "matmul bf16"
# the bf16 compute's products (LoRA step, SmolLM2 shapes, seq 256): (M, K, N, b = Wᵀ of a bf16
# weight [N, K]?); without: b is a bf16 [K, N] (the weight of a dx product)
BF16_CASES = [(256, 576, 1536, True), (256, 1536, 576, False), (256, 576, 49152, True),
              (256, 49152, 576, False), (1024, 1024, 1024, True)]
BF16_QUICK = {(256, 576, 1536, True), (256, 1536, 576, False)}


def _one_bf16(threads: int, quick: bool, M, K, N, tb) -> list[dict]:
    """gemm_bf16 (f32 a rounded to bf16 as it is packed, bf16 b, f32 out) against torch.mm of
    the same operands in bf16 (a converted in the timed statement too; oneDNN's AMX or
    AVX-512 BF16 kernels where the CPU has them, a bf16 result)."""
    import fucina as fu
    from fucina.exec.matmul_bf16 import gemm_bf16, host_engine

    torch = c.torch()
    rng = np.random.default_rng(M + K + N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    W = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        a = ctx.from_numpy(A)
        w = ctx.from_numpy(W, dtype="bf16")
        b = w.permute((1, 0)) if tb else w
        out = ctx.empty((M, N))
        env = {"gemm_bf16": gemm_bf16, "ctx": ctx, "a": a, "b": b, "out": out}
        stmts = {"fucina": "gemm_bf16(ctx, a, b, out=out)"}
        gemm_bf16(ctx, a, b, out=out)
        got = out.to_numpy()
        wb = w.to_numpy().astype(np.float64)
        want = A.astype(np.float64) @ (wb.T if tb else wb)
        if np.abs(got - want).max() > 2.0 ** -7 * K * np.abs(A).max() * np.abs(W).max():
            raise AssertionError(f"bf16 {_what(M, K, N, tb)}: wrong result")
        if torch is not None:
            tw = torch.from_numpy(W).to(torch.bfloat16)
            env.update(torch=torch, ta=torch.from_numpy(A), tb=tw.t() if tb else tw,
                       tc=torch.empty(M, N, dtype=torch.bfloat16))
            stmts["torch"] = "torch.mm(ta.to(torch.bfloat16), tb, out=tc)"
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 9, block_s=0.05 if quick else 0.15)
        env.clear()
        del a, b, w, out
    finally:
        ctx.close()
    flops = 2.0 * M * K * N
    note = f"Fucina {flops / t['fucina'].median / 1e9:.1f} GFLOP/s on {host_engine()[0]}"
    if "torch" in t:
        note += f", torch {flops / t['torch'].median / 1e9:.1f} GFLOP/s (bf16 result)"
    r = c.vs_torch(GROUP_BF16, _what(M, K, N, tb), threads, t["fucina"], t.get("torch"), load,
                   target="≥ 90 % of PyTorch", at_least=0.90, note=note)
    r["gflops"] = flops / t["fucina"].median / 1e9
    return [r]


def rows(quick: bool = False) -> list[dict]:
    shapes = [case[:4] for case in CASES if not quick or case[:4] in QUICK]
    bf16 = [s for s in BF16_CASES if not quick or s in BF16_QUICK]
    return c.each_thread_count(
        quick, *((GROUP, _what(*s), lambda k, q, s=s: _one(k, q, *s)) for s in shapes),
        *((GROUP_BF16, _what(*s), lambda k, q, s=s: _one_bf16(k, q, *s)) for s in bf16))


if __name__ == "__main__":
    c.main(rows)
