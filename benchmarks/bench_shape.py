"""Shape benchmarks: copies of non-contiguous tensors vs PyTorch (same process, interleaved
medians).

    python -m benchmarks.bench_shape [--quick]

Reshape of a non-contiguous view. A reshape of a view whose elements are not in row-major order
copies them (SPEC: "a view of a contiguous tensor, else a copy"), and so does torch.reshape when
the strides do not allow a view, so these rows time strided copies of 4 MiB at LLM shapes (seq
1024, 16 heads of 64):
* merge_axes of the attention output: [head, seq, d] permuted to [seq, head, d], heads merged
  into one axis of 1024 (PyTorch: .permute(1, 0, 2).reshape(1024, 1024));
* reshape of q [seq, head, d] permuted to [head, seq, d] into [head·seq, d] (heads flattened
  into the rows of a batched product; PyTorch: .permute(1, 0, 2).reshape(16384, 64));
* reshape of a transposed [1024, 1024] matrix to one flat axis (an element-wise transpose;
  PyTorch: .t().reshape(-1)).
For information, one row where PyTorch needs no copy: splitting the feature axis of a
transposed [seq, f] into [seq, head, d] is a strided view in PyTorch, a copy in Fucina (its
reshape views only contiguous tensors).

Transposed operands. contiguous() of a transposed or permuted view, a cast of one, and an add
with one transposed operand: the element-wise kernels walk register tiles there (codegen/
elementwise.py). PyTorch: .t().contiguous(), .permute(...).contiguous(), torch.add(a, b.t(),
out=); for the cast the faster of a preallocated bf16 .copy_(x.t()) and .t().contiguous().to()
(torch's own .t().to(bfloat16) keeps the transposed strides, so it transposes nothing).

Target (DESIGN.md §7, the "≥ PyTorch" of bandwidth-bound ops; 4-12 MiB fit in a server L3, so
no share of the memory bandwidth is claimed): at least as fast as PyTorch at 1 and 2 threads.
The note gives bytes read + written per second.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "shape (non-contiguous → copy)"
S, H, D = 1024, 16, 64


def _to_numpy(t):
    """A result as float32/int numpy (Fucina tensor or PyTorch tensor; 16-bit floats widened)."""
    torch = c.torch()
    if torch is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.float().numpy()
    return t.numpy()


def _time(threads, quick, env, cases) -> list[dict]:
    """cases: (what, Fucina statement, {PyTorch formulation: statement}, expected result,
    bytes read + written, held to the target?). Both sides are checked before timing."""
    torch = c.torch()
    out = []
    for what, fu_stmt, to_stmts, want, moved, target in cases:
        if not np.array_equal(_to_numpy(eval(fu_stmt, env)), want):
            raise AssertionError(f"{what}: wrong result")
        stmts = {"fucina": fu_stmt}
        if torch is not None:
            for name, stmt in to_stmts.items():
                if not np.array_equal(_to_numpy(eval(stmt, env)), want):
                    raise AssertionError(f"{what}: PyTorch's result ({name}) differs")
                stmts[f"torch {name}"] = stmt
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=5 if quick else 15, block_s=0.03 if quick else 0.1)
        best, which = c.fastest_torch(t)
        rate = f"Fucina {c.fmt_gbs(moved / t['fucina'].median)}" + (
            f", torch {c.fmt_gbs(moved / best.median)}" if target and best is not None else "")
        note = f"{rate} (read + written)" + (f"; {which}" if len(to_stmts) > 1 else "")
        out.append(c.vs_torch(GROUP, what, threads, t["fucina"], best, load,
                              target="≥ PyTorch" if target else "", note=note))
    return out


def _reshapes(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)
    heads = rng.standard_normal((H, S, D)).astype(np.float32)   # attention output, head-major
    q = rng.standard_normal((S, H, D)).astype(np.float32)       # q projection, seq-major
    fm = rng.standard_normal((H * D, S)).astype(np.float32)     # feature-major [f 1024, seq 1024]
    ctx = fu.ExecContext(threads=threads)
    try:
        env = {"o": ctx.tensor(heads, ("head", "seq", "d")).permute(("seq", "head", "d")),
               "q": ctx.tensor(q, ("seq", "head", "d")).permute(("head", "seq", "d")),
               "m": ctx.tensor(fm, ("f", "seq")).permute(("seq", "f")), "S": S, "H": H, "D": D}
        if torch is not None:
            env.update(to=torch.from_numpy(heads).permute(1, 0, 2),
                       tq=torch.from_numpy(q).permute(1, 0, 2), tm=torch.from_numpy(fm).t())
        nb = 2 * heads.nbytes
        cases = [
            (f"merge_axes (head, d) → hd of [seq {S}, head {H}, d {D}], a permuted view of "
             f"[head, seq, d] (attention output's head merge)", 'o.merge_axes(("head", "d"), "hd")',
             {"": "to.reshape(S, H * D)"}, heads.transpose(1, 0, 2).reshape(S, H * D), nb, True),
            (f"reshape [head {H}, seq {S}, d {D}] → [head·seq, d], a permuted view of [seq, head, d]",
             'q.reshape(("hs", "d"), (H * S, D))', {"": "tq.reshape(H * S, D)"},
             q.transpose(1, 0, 2).reshape(H * S, D), nb, True),
            (f"reshape [seq {S}, f {H * D}] → [seq·f], a transposed view of [f, seq]",
             'm.reshape(("n",), (S * H * D,))', {"": "tm.reshape(-1)"}, fm.T.reshape(-1), nb, True),
            (f"reshape [seq {S}, f {H * D}] → [seq, head {H}, d {D}], a transposed view of [f, seq] "
             f"(PyTorch: a view, no copy; Fucina: a copy)", 'm.reshape(("seq", "head", "d"), (S, H, D))',
             {"": "tm.reshape(S, H, D)"}, fm.T.reshape(S, H, D), nb, False),
        ]
        out = _time(threads, quick, env, cases)
        env.clear()
    finally:
        ctx.close()
    return out


def _transposes(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(1)
    sq = rng.standard_normal((1024, 1024)).astype(np.float32)
    sq2 = rng.standard_normal((1024, 1024)).astype(np.float32)
    tall = rng.standard_normal((4096, 512)).astype(np.float32)
    qkv = {d: rng.standard_normal((S, H, d)).astype(np.float32) for d in (64, 128)}
    ctx = fu.ExecContext(threads=threads)
    try:
        env = {"xt": ctx.tensor(sq, ("j", "i")).permute(("i", "j")),
               "xt16": ctx.tensor(sq, ("j", "i"), dtype="bf16").permute(("i", "j")),
               "tt": ctx.tensor(tall, ("j", "i")).permute(("i", "j")),
               "a": ctx.tensor(sq2, ("i", "j")), "b": ctx.tensor(sq, ("j", "i")),
               "k64": ctx.tensor(qkv[64], ("seq", "head", "d")).permute(("head", "d", "seq")),
               "q128": ctx.tensor(qkv[128], ("seq", "head", "d")).permute(("head", "seq", "d"))}
        if torch is not None:
            env.update(T=torch, tx=torch.from_numpy(sq), tx16=torch.from_numpy(sq).bfloat16(),
                       ttall=torch.from_numpy(tall), ta=torch.from_numpy(sq2),
                       tk=torch.from_numpy(qkv[64]), tq=torch.from_numpy(qkv[128]),
                       o32=torch.empty(1024, 1024), o16=torch.empty(1024, 1024, dtype=torch.bfloat16))
        bf16 = ctx.tensor(sq, ("j", "i"), dtype="bf16").numpy().T   # sq rounded to bf16, transposed
        mib = sq.nbytes
        cases = [
            ("contiguous() of a transposed [1024, 1024] f32", "xt.contiguous()",
             {"": "tx.t().contiguous()"}, sq.T, 2 * mib, True),
            ("contiguous() of a transposed [4096, 512] f32 (→ [512, 4096])", "tt.contiguous()",
             {"": "ttall.t().contiguous()"}, tall.T, 2 * tall.nbytes, True),
            ("contiguous() of a transposed [1024, 1024] bf16", "xt16.contiguous()",
             {"": "tx16.t().contiguous()"}, bf16, mib, True),
            ("to('bf16') of a transposed [1024, 1024] f32 (a cast into row-major order)", 'xt.to("bf16")',
             {"copy_": "o16.copy_(tx.t())", "contiguous().to": "tx.t().contiguous().to(T.bfloat16)"},
             ctx.tensor(sq.T.copy(), ("i", "j")).to("bf16").numpy(), mib + mib // 2, True),
            ("a + b with b transposed, [1024, 1024] f32 (torch.add(a, b.t(), out=))", "a + b",
             {"out=": "T.add(ta, tx.t(), out=o32)", "": "ta + tx.t()"}, sq2 + sq.T, 3 * mib, True),
            (f"contiguous() of [seq {S}, head {H}, d 64] permuted to [head, d, seq] (K transposed "
             f"per head)", "k64.contiguous()", {"": "tk.permute(1, 2, 0).contiguous()"},
             qkv[64].transpose(1, 2, 0), 2 * qkv[64].nbytes, True),
            (f"contiguous() of [seq {S}, head {H}, d 128] permuted to [head, seq, d] (rows of d, no "
             f"transpose)", "q128.contiguous()", {"": "tq.permute(1, 0, 2).contiguous()"},
             qkv[128].transpose(1, 0, 2), 2 * qkv[128].nbytes, True),
        ]
        out = _time(threads, quick, env, cases)
        env.clear()
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "reshape / merge_axes", _reshapes),
                               (GROUP, "transpose / permute / cast / add", _transposes))


if __name__ == "__main__":
    c.main(rows)
