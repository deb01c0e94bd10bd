"""Losses and RoPE against PyTorch: cross-entropy forward + backward at LLM vocabulary size
(issue 5 target: >= 2x torch), mse at 16 Mi elements, RoPE (half mode) forward."""
from __future__ import annotations

import numpy as np

from . import common as C

import fucina as fu


def _ce(rows, threads, quick):
    t = C.torch()
    K = 151936
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((rows, K)).astype(np.float32)
    labels = rng.integers(0, K, rows)
    ctx = fu.ExecContext(threads=threads)
    x = ctx.variable(x_np, ("r", "c"))

    def fu_step():
        with ctx.exec_scope():
            x.cross_entropy("c", labels).backward()
        x.zero_grad()

    stmts = {"fu": fu_step}
    if t is not None:
        tx = t.tensor(x_np, requires_grad=True)
        tl = t.from_numpy(labels)

        def t_step():
            t.nn.functional.cross_entropy(tx, tl).backward()
            tx.grad = None

        stmts["t"] = t_step
    tm, load = C.measured(stmts, env={}, threads=threads, quick=quick, repeats=3 if quick else 7,
                          block_s=0.2 if quick else 0.5)
    bw = C.bandwidth(threads)
    floor = rows * K * 4 * 3 / bw  # forward reads x twice, backward reads x and writes dx: >= 3 passes
    ctx.close()
    return [C.vs_torch("cross-entropy", f"fwd + bwd [{rows}, {K}], mean", threads, tm["fu"],
                       tm.get("t"), load, target="≥ 2× PyTorch", at_least=2.0,
                       note=f"memory-traffic floor ≈ {floor * 1e3:.1f} ms at {bw / 1e9:.0f} GB/s "
                            f"(3 passes over the logits)")]


def _mse_rope(threads, quick):
    t = C.torch()
    rng = np.random.default_rng(1)
    n = C.BIG_ELEMS
    a_np, b_np = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    S, H, D = 2048, 32, 128
    q_np = rng.standard_normal((S, H, D)).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    a, b = ctx.tensor(a_np, ("n",)), ctx.tensor(b_np, ("n",))
    q = ctx.tensor(q_np, ("s", "h", "d"))
    table = ctx.prepare_rope_table(list(range(S)), D, 10000.0)
    env = {"a": a, "b": b, "q": q, "table": table}
    stmts = {"fu_mse": "a.mse_loss(b)", "fu_rope": "q.rope('s', 'd', table, 'half')"}
    if t is not None:
        inv = 1.0 / (10000.0 ** (t.arange(0, D, 2, dtype=t.float32) / D))
        ang = t.outer(t.arange(S, dtype=t.float32), inv)
        cos, sin = t.cat([ang.cos()] * 2, -1)[:, None, :], t.cat([ang.sin()] * 2, -1)[:, None, :]
        tq = t.from_numpy(q_np)

        def t_rope():
            x1, x2 = tq[..., : D // 2], tq[..., D // 2:]
            return tq * cos + t.cat([-x2, x1], -1) * sin

        env.update(ta=t.from_numpy(a_np), tb=t.from_numpy(b_np), t_rope=t_rope, F=t.nn.functional)
        stmts.update(t_mse="F.mse_loss(ta, tb)", t_rope="t_rope()")
    tm, load = C.measured(stmts, env=env, threads=threads, quick=quick, repeats=5 if quick else 9,
                          block_s=0.1 if quick else 0.3)
    rows = [C.vs_torch(group, what, threads, tm[f"fu_{key}"], tm.get(f"t_{key}"), load)
            for key, group, what in (("mse", "losses", f"mse_loss, {n} f32, mean"),
                                     ("rope", "rope", f"rope half, [{S}, {H}, {D}], prepared table"))]
    del a, b, q, table, env
    ctx.close()
    return rows


def rows(quick: bool = False) -> list[dict]:
    return C.each_thread_count(
        quick, *(("cross-entropy", f"[{r}, 151936]", lambda k, q, r=r: _ce(r, k, q)) for r in (256, 1024)),
        ("losses", "mse / rope", _mse_rope))


if __name__ == "__main__":
    C.main(rows)
