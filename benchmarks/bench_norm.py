"""Normalization benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_norm [--quick]

Target (DESIGN.md §7): layer_norm (with weight and bias) and rms_norm (with weight), forward +
backward at [1024, 1024], at least as fast as PyTorch at 1 and 2 threads. A step is what a
training loop does: gradients cleared (set to None on both sides), forward, backward with a given
upstream gradient, gradients for x, weight (and bias). PyTorch's rms_norm backward is composed of
several ops on CPU; its layer_norm is one fused kernel each way. Forward-only rows are for
information.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "normalization"
SHAPE = (1024, 1024)


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    R, D = SHAPE
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(SHAPE) * 2 + 0.5).astype(np.float32)
    w, bvec = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        x, wv, bv = ctx.variable(a, ("r", "d")), ctx.variable(w, ("d",)), ctx.variable(bvec, ("d",))
        env = {"x": x, "w": wv, "b": bv, "g": ctx.tensor(g, ("r", "d")),
               "xc": ctx.tensor(a, ("r", "d")), "wc": ctx.tensor(w, ("d",)), "bc": ctx.tensor(bvec, ("d",))}
        cases = [
            ("layer_norm (weight + bias), forward + backward",
             'x.zero_grad(); w.zero_grad(); b.zero_grad(); x.layer_norm("d", 1e-5, weight=w, bias=b).backward(grad=g)',
             "tx.grad = tw.grad = tb.grad = None; F.layer_norm(tx, (D,), tw, tb, 1e-5).backward(tg)", True),
            ("rms_norm (weight), forward + backward",
             'x.zero_grad(); w.zero_grad(); x.rms_norm("d", 1e-6, weight=w).backward(grad=g)',
             "tx.grad = tw.grad = None; F.rms_norm(tx, (D,), tw, 1e-6).backward(tg)", True),
            ("layer_norm (weight + bias), forward only (no grad)",
             'xc.layer_norm("d", 1e-5, weight=wc, bias=bc)',
             "F.layer_norm(cx, (D,), cw, cb, 1e-5)", False),
            ("rms_norm (weight), forward only (no grad)",
             'xc.rms_norm("d", 1e-6, weight=wc)', "F.rms_norm(cx, (D,), cw, 1e-6)", False),
        ]
        if torch is not None:
            F = torch.nn.functional
            env.update(torch=torch, F=F, D=D, tg=torch.from_numpy(g),
                       tx=torch.tensor(a, requires_grad=True), tw=torch.tensor(w, requires_grad=True),
                       tb=torch.tensor(bvec, requires_grad=True), cx=torch.from_numpy(a),
                       cw=torch.from_numpy(w), cb=torch.from_numpy(bvec))
            y = x.layer_norm("d", 1e-5, weight=wv, bias=bv)
            want = F.layer_norm(env["cx"], (D,), env["cw"], env["cb"], 1e-5).numpy()
            if not np.allclose(y.numpy(), want, rtol=1e-4, atol=1e-4):
                raise AssertionError("layer_norm: Fucina and PyTorch disagree")
            y = x.rms_norm("d", 1e-6, weight=wv)
            if not np.allclose(y.numpy(), F.rms_norm(env["cx"], (D,), env["cw"], 1e-6).numpy(),
                               rtol=1e-4, atol=1e-4):
                raise AssertionError("rms_norm: Fucina and PyTorch disagree")
            del y
        for what, fu_stmt, to_stmt, target in cases:
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                stmts["torch"] = to_stmt
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=5 if quick else 15, block_s=0.03 if quick else 0.1)
            to_s = t["torch"].median if "torch" in t else None
            met = None if (to_s is None or not target) else t["fucina"].median <= to_s
            r = c.row(GROUP, f"{what} [{R}, {D}]", threads, t["fucina"].median, to_s,
                      target="≥ PyTorch" if target else "", met=met,
                      note=f"block spread (IQR/2) ±{t['fucina'].spread * 50:.0f} %"
                           + (f" / ±{t['torch'].spread * 50:.0f} %" if to_s else "") + f"; {load}")
            r["parity"] = met is False and to_s / t["fucina"].median >= c.PARITY
            out.append(r)
        env.clear()
        del x, wv, bv
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    out = []
    for k in c.thread_counts():
        out += c.guarded(GROUP, "norms", lambda: _one(k, quick))
    return out


if __name__ == "__main__":
    c.main(rows)
