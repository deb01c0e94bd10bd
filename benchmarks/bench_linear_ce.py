"""linear_cross_entropy vs PyTorch's composed F.cross_entropy(x @ w.T, y): time and peak memory.

    python -m benchmarks.bench_linear_ce [--quick]

Target (issue 5): 1024 rows × 1024 features → 151936 classes, forward + backward (gradients to x
and w), at least as fast as torch composed, and less peak memory. The work is three GEMMs of
1024·1024·151936 multiply-adds each (~0.95 TFLOP per step), so a step takes seconds: each side
runs a few single steps, interleaved. Peak memory is measured the same way for both, in a fresh
subprocess each: the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs
just before the step) minus the resident set just before it. Quick mode uses 256 × 1024 → 32768.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from . import common as c

GROUP = "linear cross-entropy"

_PEAK = r"""
import json, sys, numpy as np
R, D, K, which, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rng = np.random.default_rng(0)
x = rng.standard_normal((R, D)).astype(np.float32)
w = (rng.standard_normal((K, D)) * 0.02).astype(np.float32)
y = rng.integers(0, K, R)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

if which == "fucina":
    import fucina as fu
    ctx = fu.ExecContext(threads=threads)
    X, W = ctx.variable(x, ("row", "d")), ctx.variable(w, ("class", "d"))
    small = ctx.variable(x[:4], ("row", "d"))          # load the kernels first
    small.linear_cross_entropy(ctx.variable(w[:300], ("class", "d")), y[:4] % 300).backward()
    step = lambda: X.linear_cross_entropy(W, y).backward()
else:
    import torch
    torch.set_num_threads(threads)
    X, W, Y = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True), torch.from_numpy(y)
    torch.nn.functional.cross_entropy(X[:4] @ W[:300].T, Y[:4] % 300).backward()
    X.grad = W.grad = None
    step = lambda: torch.nn.functional.cross_entropy(X @ W.T, Y).backward()
base = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
step()
print(json.dumps({"peak": rss("VmHWM") - base}))
"""


def _peak(which: str, R, D, K, threads: int) -> float | None:
    try:
        out = subprocess.run([sys.executable, "-c", _PEAK, str(R), str(D), str(K), which,
                              str(threads)], capture_output=True, text=True, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return None


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    R, D, K = (256, 1024, 32768) if quick else (1024, 1024, 151936)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R, D)).astype(np.float32)
    w = (rng.standard_normal((K, D)) * 0.02).astype(np.float32)
    y = rng.integers(0, K, R)
    ctx = fu.ExecContext(threads=threads)
    try:
        X, W = ctx.variable(x, ("row", "d")), ctx.variable(w, ("class", "d"))
        env = {"X": X, "W": W, "y": y}
        stmts = {"fucina": "X.zero_grad(); W.zero_grad(); X.linear_cross_entropy(W, y).backward()"}
        if torch is not None:
            env.update(F=torch.nn.functional, tx=torch.tensor(x, requires_grad=True),
                       tw=torch.tensor(w, requires_grad=True), ty=torch.from_numpy(y))
            stmts["torch"] = "tx.grad = tw.grad = None; F.cross_entropy(tx @ tw.T, ty).backward()"
            got = X.linear_cross_entropy(W, y).item()
            want = env["F"].cross_entropy(env["tx"] @ env["tw"].T, env["ty"]).item()
            if abs(got - want) > 1e-4 * max(1.0, abs(want)):
                raise AssertionError(f"linear_cross_entropy: Fucina {got} vs PyTorch {want}")
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick, repeats=3,
                             block_s=0.01)
        env.clear()
        del X, W
    finally:
        ctx.close()
    peaks = {k: _peak(k, R, D, K, threads) for k in stmts}
    mib = lambda b: "?" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
    return [c.vs_torch(GROUP, f"fwd + bwd {R}×{D} → {K} (mean), vs composed x @ w.T + CE", threads,
                       t["fucina"], t.get("torch"), load,
                       note=f"peak memory of one step: Fucina {mib(peaks.get('fucina'))}, PyTorch "
                            f"{mib(peaks.get('torch'))} (logits alone {R * K * 4 / 2**20:.0f} MiB)")]


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "linear_cross_entropy", _one))


if __name__ == "__main__":
    c.main(rows)
