"""Muon benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_muon [--quick]

Target: newton_schulz5 (5 steps, f32) on 3072×1024 (tall: iterated on its transpose) and
1024×1024 at least as fast as PyTorch running the same iteration in f32 — written the fastest
way torch offers (torch.optim.Muon's form: A = X·Xᵀ, B = addmm(A, A, A, beta=b, alpha=c),
X = addmm(X, B, X, beta=a); torch's own Muon runs it in bf16, so it is not used as is).
For information: one Muon step (f32 momentum, Nesterov, NS, apply) over the seven matrices of a
Qwen3-0.6B block (q 2048×1024, k and v 1024×1024, o 1024×2048, gate and up 3072×1024,
down 1024×3072) against the same step in torch (lerp momentum, the f32 iteration above,
param.mul_ + add_).
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "muon"
NS_SHAPES = [(3072, 1024), (1024, 1024)]
BLOCK = {"q": (2048, 1024), "k": (1024, 1024), "v": (1024, 1024), "o": (1024, 2048),
         "gate": (3072, 1024), "up": (3072, 1024), "down": (1024, 3072)}
A, B, C = 3.4445, -4.7750, 2.0315


def torch_ns(torch, G, steps: int = 5):
    """Keller Jordan's iteration in f32 with torch's fused addmm forms."""
    tall = G.size(0) > G.size(1)
    X = G.T if tall else G
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        gram = X @ X.T
        upd = torch.addmm(gram, gram, gram, beta=B, alpha=C)
        X = torch.addmm(X, upd, X, beta=A)
    return X.T if tall else X


def torch_muon_step(torch, params, bufs, lr=0.02, momentum=0.95, wd=0.01):
    for p, m in zip(params, bufs):
        g = p.grad
        m.lerp_(g, 1 - momentum)
        u = g.lerp(m, momentum)
        o = torch_ns(torch, u)
        rows, cols = p.shape
        p.mul_(1 - lr * wd)
        p.add_(o, alpha=-lr * max(1.0, rows / cols) ** 0.5)


def _ns(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina.optim.muon import newton_schulz5

    torch = c.torch()
    out = []
    ctx = fu.ExecContext(threads=threads)
    try:
        for shape in NS_SHAPES:
            g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            env = {"ns": newton_schulz5, "x": ctx.tensor(g, ("r", "c"))}
            stmts = {"fucina": "ns(x, 5)"}
            if torch is not None:
                env.update(tns=torch_ns, torch=torch, tx=torch.from_numpy(g))
                want = torch_ns(torch, env["tx"]).numpy()
                got = newton_schulz5(env["x"], 5).numpy()
                if not np.allclose(got, want, atol=1e-4):
                    raise AssertionError("newton_schulz5: Fucina and PyTorch disagree")
                stmts["torch"] = "tns(torch, tx)"
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=3 if quick else 7, block_s=0.3 if quick else 1.0)
            out.append(c.vs_torch(GROUP, f"newton_schulz5, 5 steps, f32 [{shape[0]}, {shape[1]}]",
                                  threads, t["fucina"], t.get("torch"), load))
            env.clear()
    finally:
        ctx.close()
    return out


def _step(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina.optim.muon import Muon

    torch = c.torch()
    rng = np.random.default_rng(1)
    vals = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in BLOCK.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in BLOCK.items()}
    ctx = fu.ExecContext(threads=threads)
    try:
        opt = Muon(lr=0.02, momentum=0.95, weight_decay=0.01)
        ws = {k: ctx.variable(v, ("o", "i")) for k, v in vals.items()}
        for k, w in ws.items():
            opt.add_param(w, k)
            w.backward(grad=ctx.tensor(grads[k], ("o", "i")))
        env = {"opt": opt}
        stmts = {"fucina": "opt.step()"}
        if torch is not None:
            tp = [torch.tensor(vals[k]) for k in BLOCK]
            for p, k in zip(tp, BLOCK):
                p.grad = torch.from_numpy(grads[k])
            env.update(step=torch_muon_step, torch=torch, tp=tp,
                       tb=[torch.zeros_like(p) for p in tp])
            stmts["torch"] = "step(torch, tp, tb)"
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 5, block_s=1.0 if quick else 3.0)
        r = c.vs_torch(GROUP, "Muon step, one Qwen3-0.6B block (7 matrices, 15.7 M params)",
                       threads, t["fucina"], t.get("torch"), load, target="")
        env.clear()
        del opt, ws
        return [r]
    finally:
        ctx.close()


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "newton_schulz5", _ns), (GROUP, "Muon step", _step))


if __name__ == "__main__":
    c.main(rows)
