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
from .common import BIG_ELEMS, MiB, row

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
        cases = [("a + b, 1 element f32", 1, "a + b", "ta + tb"),
                 ("a + b, 1000 elements f32", 1000, "a + b", "ta + tb"),
                 ("a + 1.0, 1 element f32", 1, "a + 1.0", "ta + 1.0")]
        for what, n, fu_stmt, to_stmt in cases:
            rng = np.random.default_rng(n)
            x, y = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
            env = {"a": ctx.tensor(x, tags=("n",)), "b": ctx.tensor(y, tags=("n",))}
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                env.update(ta=torch.from_numpy(x.copy()), tb=torch.from_numpy(y.copy()))
                stmts["torch"] = to_stmt
            with c.torch_threads(threads):
                t = c.interleaved(stmts, env=env, repeats=5 if quick else 15,
                                  block_s=0.01 if quick else 0.03)
            fu_s = t["fucina"].median
            to_s = t["torch"].median if "torch" in t else None
            met = None if to_s is None else fu_s <= to_s
            rows.append(row(GROUP_TINY, what, threads, fu_s, to_s, target="≤ PyTorch", met=met,
                            note=f"spread ±{t['fucina'].spread * 50:.0f} % / "
                                 f"±{t['torch'].spread * 50:.0f} %" if to_s else ""))
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


def _check(fu_val, to_val, what):
    """Cheap sanity check that we time a correct kernel (first/last 4096 elements)."""
    f, t = np.asarray(fu_val), np.asarray(to_val, dtype=np.float32)
    for sl in (slice(0, 4096), slice(-4096, None)):
        if not np.allclose(f.reshape(-1)[sl], t.reshape(-1)[sl], rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{what}: Fucina and PyTorch disagree")


def _bandwidth_ops(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    bw = c.bandwidth(threads)
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
                threads, quick, name, fu_stmt, to_stmt, out_stmt, reads, env, bw))
    finally:
        env.clear()
        ctx.close()
    return rows


def _one_bw(threads, quick, name, fu_stmt, to_stmt, out_stmt, reads, env, bw):
    torch = c.torch()
    nbytes = (reads + 1) * BIG_ELEMS * 4
    stmts = {"fucina": fu_stmt}
    if torch is not None:
        _check(eval(fu_stmt, env).numpy(), eval(to_stmt, env).numpy(), name)
        stmts.update(torch=to_stmt, torch_out=out_stmt)
    with c.torch_threads(threads):
        t = c.interleaved(stmts, env=env, repeats=3 if quick else 9, block_s=0.05 if quick else 0.15)
        faults = {k: c.faults_per_call(s, env) for k, s in stmts.items()}
    fu_s = t["fucina"].median
    pct = nbytes / fu_s / bw
    what = f"{name}, 16 Mi f32 ({(reads + 1) * 64} MiB moved)"
    bw_note = (f"Fucina {c.fmt_gbs(nbytes / fu_s)} = {pct:.0%} of {c.fmt_gbs(bw)} measured "
               f"({threads} thr); faults/call {faults['fucina']:.0f}")
    if torch is None:
        return [row(GROUP_BW, what, threads, fu_s, target="≥ 85 % BW", met=pct >= 0.85,
                    note=bw_note)]
    out = []
    for key, label in (("torch", "vs torch out-of-place"), ("torch_out", "vs torch out= (prealloc.)")):
        to_s = t[key].median
        met = pct >= 0.85 and fu_s <= to_s
        out.append(row(GROUP_BW, f"{what} {label}", threads, fu_s, to_s,
                       target="≥ 85 % BW and ≥ PyTorch", met=met,
                       note=f"{bw_note}; torch {c.fmt_gbs(nbytes / to_s)}, "
                            f"faults/call {faults[key]:.0f}"))
    return out


# ---------------------------------------------------------------------------------------------
# casts

def _casts(threads: int, quick: bool) -> list[dict]:
    torch = c.torch()
    bw = c.bandwidth(threads)
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
                threads, quick, what, fu_stmt, to_stmt, out_stmt, env, bw))
    finally:
        env.clear()
        del a
        ctx.close()
    return rows


def _one_cast(threads, quick, what, fu_stmt, to_stmt, out_stmt, env, bw):
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
    with c.torch_threads(threads):
        t = c.interleaved(stmts, env=env, repeats=3 if quick else 9, block_s=0.05 if quick else 0.15)
    fu_s = t["fucina"].median
    label = f"{what}, 16 Mi elements (64 MiB f32 + 32 MiB bf16)"
    note = f"Fucina {c.fmt_gbs(nbytes / fu_s)} = {nbytes / fu_s / bw:.0%} of measured BW"
    if torch is None:
        return [row(GROUP_CAST, label, threads, fu_s, note=note)]
    return [row(GROUP_CAST, f"{label} vs torch .to()", threads, fu_s, t["torch"].median,
                target="≥ PyTorch", met=fu_s <= t["torch"].median, note=note),
            row(GROUP_CAST, f"{label} vs torch copy_ into prealloc.", threads, fu_s,
                t["torch_out"].median, target="≥ PyTorch", met=fu_s <= t["torch_out"].median,
                note=note)]


# ---------------------------------------------------------------------------------------------

def bandwidth_rows() -> list[dict]:
    """The measured bandwidth itself, one row per thread count (reference for the % columns)."""
    return [row("memory bandwidth", "STREAM-style scale_f32 (C kernel, runtime launch), 64 MiB → 64 MiB",
                k, round(c.bandwidth(k) / 1e9, 1), unit="GB/s", target="reference",
                note="best of 15; bytes read + bytes written")
            for k in c.thread_counts()]


def rows(quick: bool = False) -> list[dict]:
    out = []
    for k in c.thread_counts():
        out += c.guarded(GROUP_TINY, "tiny ops", lambda: _tiny(k, quick))
    out += bandwidth_rows()
    for k in c.thread_counts():
        out += c.guarded(GROUP_BW, "bandwidth ops", lambda: _bandwidth_ops(k, quick))
    for k in c.thread_counts():
        out += c.guarded(GROUP_CAST, "casts", lambda: _casts(k, quick))
    return out


if __name__ == "__main__":
    c.main(rows)
