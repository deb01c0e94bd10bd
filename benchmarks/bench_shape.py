"""Shape benchmarks: reshape and merge_axes of a non-contiguous tensor vs PyTorch (same process,
interleaved medians).

    python -m benchmarks.bench_shape [--quick]

A reshape of a view whose elements are not in row-major order copies them (SPEC: "a view of a
contiguous tensor, else a copy"), and so does torch.reshape when the strides do not allow a view,
so these rows time strided copies of 4 MiB at LLM shapes (seq 1024, 16 heads of 64):
* merge_axes of the attention output: [head, seq, d] permuted to [seq, head, d], heads merged
  into one axis of 1024 (PyTorch: .permute(1, 0, 2).reshape(1024, 1024));
* reshape of q [seq, head, d] permuted to [head, seq, d] into [head·seq, d] (heads flattened
  into the rows of a batched product; PyTorch: .permute(1, 0, 2).reshape(16384, 64));
* reshape of a transposed [1024, 1024] matrix to one flat axis (an element-wise transpose;
  PyTorch: .t().reshape(-1)).
Target (DESIGN.md §7, the "≥ PyTorch" of bandwidth-bound ops; 4 MiB fits in a server L3, so
no share of the memory bandwidth is claimed): at least as fast as PyTorch at 1 and 2 threads.
The note gives bytes read + written per second. For information, one row where PyTorch needs no copy:
splitting the feature axis of a transposed [seq, f] into [seq, head, d] is a strided view in
PyTorch, a copy in Fucina (its reshape views only contiguous tensors).
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "shape (non-contiguous → copy)"
S, H, D = 1024, 16, 64


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)
    heads = rng.standard_normal((H, S, D)).astype(np.float32)   # attention output, head-major
    q = rng.standard_normal((S, H, D)).astype(np.float32)       # q projection, seq-major
    fm = rng.standard_normal((H * D, S)).astype(np.float32)     # feature-major [f 1024, seq 1024]
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        env = {"o": ctx.tensor(heads, ("head", "seq", "d")).permute(("seq", "head", "d")),
               "q": ctx.tensor(q, ("seq", "head", "d")).permute(("head", "seq", "d")),
               "m": ctx.tensor(fm, ("f", "seq")).permute(("seq", "f"))}
        cases = [
            (f"merge_axes (head, d) → hd of [seq {S}, head {H}, d {D}], a permuted view of "
             f"[head, seq, d] (attention output's head merge)", 'o.merge_axes(("head", "d"), "hd")',
             "to.reshape(S, H * D)", heads.transpose(1, 0, 2).reshape(S, H * D), True),
            (f"reshape [head {H}, seq {S}, d {D}] → [head·seq, d], a permuted view of [seq, head, d]",
             'q.reshape(("hs", "d"), (H * S, D))', "tq.reshape(H * S, D)",
             q.transpose(1, 0, 2).reshape(H * S, D), True),
            (f"reshape [seq {S}, f {H * D}] → [seq·f], a transposed view of [f, seq]",
             'm.reshape(("n",), (S * H * D,))', "tm.reshape(-1)", fm.T.reshape(-1), True),
            (f"reshape [seq {S}, f {H * D}] → [seq, head {H}, d {D}], a transposed view of [f, seq] "
             f"(PyTorch: a view, no copy; Fucina: a copy)", 'm.reshape(("seq", "head", "d"), (S, H, D))',
             "tm.reshape(S, H, D)", fm.T.reshape(S, H, D), False),
        ]
        if torch is not None:
            env.update(S=S, H=H, D=D, to=torch.from_numpy(heads).permute(1, 0, 2),
                       tq=torch.from_numpy(q).permute(1, 0, 2), tm=torch.from_numpy(fm).t())
        for what, fu_stmt, to_stmt, want, target in cases:
            if not np.array_equal(eval(fu_stmt, env).numpy(), want):
                raise AssertionError(f"{what}: wrong result")
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                if not np.array_equal(eval(to_stmt, env).numpy(), want):
                    raise AssertionError(f"{what}: PyTorch's result differs")
                stmts["torch"] = to_stmt
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=5 if quick else 15, block_s=0.03 if quick else 0.1)
            moved = 2 * want.nbytes
            rate = f"Fucina {c.fmt_gbs(moved / t['fucina'].median)}" + (
                f", torch {c.fmt_gbs(moved / t['torch'].median)}" if target and "torch" in t else "")
            out.append(c.vs_torch(GROUP, what, threads, t["fucina"], t.get("torch"), load,
                                  target="≥ PyTorch" if target else "", note=f"{rate} (read + written)"))
        env.clear()
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "reshape / merge_axes", _one))


if __name__ == "__main__":
    c.main(rows)
