"""Elementwise benchmarks: eager overhead of tiny ops, bandwidth-bound ops at 64 MiB, bf16 casts.

    python -m benchmarks.bench_elementwise [--quick]

Targets (DESIGN.md §7): a tiny op costs no more than PyTorch's; add / scale at >= 16 MiB reach
>= 85 % of the measured memory bandwidth and are at least as fast as PyTorch (exp is held to the
same bar here: with vector exp it should be bandwidth-bound too); casts: at least PyTorch.

PyTorch's out-of-place ops allocate a fresh result each call; at 64 MiB glibc serves that with
mmap, so every call page-faults 64 MiB in (the faults/call column says how many). Fucina's pool
hands back a buffer that is already mapped. Both are what a user gets from `a + b`, so the
out-of-place rows compare them as is; the `out=` rows compare against PyTorch writing into a
preallocated tensor, which takes the allocation out of PyTorch's time.
"""
from __future__ import annotations

import numpy as np

from . import common as c
from .common import BIG_ELEMS

GROUP_TINY = "eager overhead"
GROUP_BW = "elementwise 64 MiB"
GROUP_CAST = "cast 16 Mi elements"


def _ctx(threads):
    import fucina as fu

    return fu.ExecContext(threads=threads)


# ---------------------------------------------------------------------------------------------
# tiny ops: per-op time

def _tiny(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    ctx = _ctx(threads)
    rows = []
    try:
        cases = [("a + b, 1 element f32", 1, "a + b", "ta + tb", False),
                 ("a + b, 1000 elements f32", 1000, "a + b", "ta + tb", False),
                 ("a + 1.0, 1 element f32", 1, "a + 1.0", "ta + 1.0", False),
                 ("a + b, 1 element f32, with autograd (both operands require grad)", 1,
                  "a + b", "ta + tb", True)]
        for what, n, fu_stmt, to_stmt, grad in cases:
            rng = np.random.default_rng(n)
            x, y = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
            make = ctx.variable if grad else ctx.tensor
            env = {"a": make(x, tags=("n",)), "b": make(y, tags=("n",))}
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                env.update(ta=torch.from_numpy(x.copy()).requires_grad_(grad),
                           tb=torch.from_numpy(y.copy()).requires_grad_(grad))
                stmts["torch"] = to_stmt
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=5 if quick else 15, block_s=0.01 if quick else 0.03)
            rows.append(c.vs_torch(GROUP_TINY, what, threads, t["fucina"], t.get("torch"), load,
                                   target="≤ PyTorch"))
    finally:
        ctx.close()
    return rows


# ---------------------------------------------------------------------------------------------
# bandwidth-bound ops at 64 MiB

BW_OPS = [
    # name, fucina stmt, torch out-of-place stmt, torch out= stmt, arrays read
    ("add", "a + b", "ta + tb", "torch.add(ta, tb, out=tc)", 2),
    ("scale (x * 2.0)", "a.scale(2.0)", "ta * 2.0", "torch.mul(ta, 2.0, out=tc)", 1),
    ("exp", "a.exp()", "torch.exp(ta)", "torch.exp(ta, out=tc)", 1),
]


def _bandwidth_ops(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    rng = np.random.default_rng(0)
    n = BIG_ELEMS
    x = rng.uniform(-4, 4, n).astype(np.float32)
    y = rng.uniform(-4, 4, n).astype(np.float32)
    ctx = _ctx(threads)
    env = {"a": ctx.tensor(x, tags=("n",)), "b": ctx.tensor(y, tags=("n",))}
    if torch is not None:
        env.update(torch=torch, ta=torch.from_numpy(x), tb=torch.from_numpy(y),
                   tc=torch.empty(n, dtype=torch.float32))
    rows = []
    try:
        for name, fu_stmt, to_stmt, out_stmt, reads in BW_OPS:
            rows += c.guarded(GROUP_BW, name, lambda: _one_bw(
                threads, quick, name, fu_stmt, to_stmt, out_stmt, reads, env))
    finally:
        env.clear()
        ctx.close()
    return rows


def _one_bw(threads, quick, name, fu_stmt, to_stmt, out_stmt, reads, env):
    torch = c.torch()
    nbytes = (reads + 1) * BIG_ELEMS * 4
    stmts = {"fucina": fu_stmt}
    if torch is not None:
        c.check_ends(eval(fu_stmt, env).numpy(), eval(to_stmt, env).numpy(), name)
        stmts.update(torch=to_stmt, torch_out=out_stmt)
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick, repeats=3 if quick else 9,
                         block_s=0.05 if quick else 0.15, before=lambda: c.sample_bandwidth(threads))
    with c.torch_threads(threads):
        faults = {k: c.faults_per_call(s, env) for k, s in stmts.items()}
    what = f"{name}, 16 Mi f32 ({(reads + 1) * 64} MiB moved)"
    if torch is None:
        return [c.bw_row(GROUP_BW, what, threads, t["fucina"], None, nbytes=nbytes,
                         bw_now=load.before, bw_target=True,
                         target="≥ 85 % BW", extra=f"faults/call {faults['fucina']:.0f}; {load}")]
    return [c.bw_row(GROUP_BW, f"{what} {label}", threads, t["fucina"], t[key].median,
                     nbytes=nbytes, bw_now=load.before, bw_target=True,
                     target="≥ 85 % BW and ≥ PyTorch",
                     extra=f"minor faults/call: Fucina {faults['fucina']:.0f}, "
                           f"torch {faults[key]:.0f}; {load}")
            for key, label in c.OUT_OF_PLACE_AND_OUT]


# ---------------------------------------------------------------------------------------------
# casts

def _casts(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    n = BIG_ELEMS
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    ctx = _ctx(threads)
    a = ctx.tensor(x, tags=("n",))
    env = {"a": a, "h": a.to("bf16")}
    if torch is not None:
        ta = torch.from_numpy(x)
        env.update(torch=torch, ta=ta, th=ta.to(torch.bfloat16),
                   tc16=torch.empty(n, dtype=torch.bfloat16), tc32=torch.empty(n, dtype=torch.float32))
    rows = []
    cases = [("f32 → bf16", 'a.to("bf16")', "ta.to(torch.bfloat16)", "tc16.copy_(ta)"),
             ("bf16 → f32", 'h.to("f32")', "th.to(torch.float32)", "tc32.copy_(th)")]
    try:
        for what, fu_stmt, to_stmt, out_stmt in cases:
            rows += c.guarded(GROUP_CAST, what, lambda: _one_cast(
                threads, quick, what, fu_stmt, to_stmt, out_stmt, env))
    finally:
        env.clear()
        del a
        ctx.close()
    return rows


def _one_cast(threads, quick, what, fu_stmt, to_stmt, out_stmt, env):
    torch = c.torch()
    nbytes = BIG_ELEMS * 6
    stmts = {"fucina": fu_stmt}
    if torch is not None:
        fu_bits = eval(fu_stmt, env).data_const()
        to_val = eval(to_stmt, env)
        to_bits = (to_val.view(torch.int16).numpy().view(np.uint16) if to_val.dtype == torch.bfloat16
                   else to_val.numpy())
        if not np.array_equal(fu_bits[:4096], to_bits[:4096]):
            raise AssertionError(f"{what}: Fucina and PyTorch disagree")
        stmts.update(torch=to_stmt, torch_out=out_stmt)
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick, repeats=3 if quick else 9,
                         block_s=0.05 if quick else 0.15, before=lambda: c.sample_bandwidth(threads))
    fu = t["fucina"]
    label = f"{what}, 16 Mi elements (96 MiB moved)"
    if torch is None:
        return [c.bw_row(GROUP_CAST, label, threads, fu, None, nbytes=nbytes,
                         bw_now=load.before, bw_target=False,
                         extra=str(load))]
    return [c.bw_row(GROUP_CAST, f"{label} vs torch .to()", threads, fu, t["torch"].median,
                     nbytes=nbytes, bw_now=load.before, bw_target=False, target="≥ PyTorch",
                     extra=str(load)),
            c.bw_row(GROUP_CAST, f"{label} vs torch copy_ into prealloc.", threads, fu,
                     t["torch_out"].median, nbytes=nbytes, bw_now=load.before, bw_target=False,
                     target="≥ PyTorch",
                     extra=str(load))]


def rows(quick: bool = False) -> list[dict]:
    return c.finalize(c.each_thread_count(quick, (GROUP_TINY, "tiny ops", _tiny))
                      + c.each_thread_count(quick, (GROUP_BW, "bandwidth ops", _bandwidth_ops))
                      + c.each_thread_count(quick, (GROUP_CAST, "casts", _casts)))


if __name__ == "__main__":
    c.main(lambda quick: rows(quick) + c.bandwidth_rows())
