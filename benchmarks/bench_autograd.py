"""Autograd overhead and a training step against PyTorch (issue: Named-axis Tensor and
autograd): a tiny op that records a node, the backward of a 1-element sum, and one MLP
forward + backward (256x512 -> 1024 -> 10, tanh, cross-entropy)."""
from __future__ import annotations

import numpy as np

from . import common as C

import fucina as fu


def _tiny(threads, quick):
    t = C.torch()
    ctx = fu.ExecContext(threads=threads)
    env = {"a": ctx.variable([1.0], ("n",)), "b": ctx.tensor([2.0], ("n",)),
           "s": ctx.variable([1.0], ("n",))}
    stmts = {"fu_mul": "a * b", "fu_bwd": "s.sum_all().backward()"}
    if t is not None:
        env.update(ta=t.tensor([1.0], requires_grad=True), tb=t.tensor([2.0]),
                   ts=t.tensor([1.0], requires_grad=True))
        stmts.update(t_mul="ta * tb", t_bwd="ts.sum().backward()")
    tm, load = C.measured(stmts, env=env, threads=threads, quick=quick, repeats=5 if quick else 11,
                          block_s=0.03 if quick else 0.1)
    ctx.close()
    return [C.vs_torch("autograd overhead", what, threads, tm[f"fu_{key}"], tm.get(f"t_{key}"), load,
                       target="≤ PyTorch")
            for key, what in (("mul", "a * b, 1 element, a a variable (records a node)"),
                              ("bwd", "s.sum_all().backward(), 1 element"))]


def _mlp(threads, quick):
    t = C.torch()
    rng = np.random.default_rng(0)
    B, D, H, K = 256, 512, 1024, 10
    x_np = rng.standard_normal((B, D)).astype(np.float32)
    w1_np = (rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32)
    b1_np = np.zeros(H, np.float32)
    w2_np = (rng.standard_normal((H, K)) / np.sqrt(H)).astype(np.float32)
    labels = rng.integers(0, K, B)
    ctx = fu.ExecContext(threads=threads)
    x = ctx.tensor(x_np, ("b", "i"))
    w1, b1, w2 = ctx.variable(w1_np, ("i", "h")), ctx.variable(b1_np, ("h",)), ctx.variable(w2_np, ("h", "k"))

    def fu_step():
        with ctx.exec_scope():
            loss = (x.dot(w1, "i") + b1).tanh().dot(w2, "h").cross_entropy("k", labels)
            loss.backward()
        for p in (w1, b1, w2):
            p.zero_grad()

    stmts = {"fu": fu_step}
    if t is not None:
        tx = t.from_numpy(x_np)
        tw1, tb1, tw2 = (t.tensor(v, requires_grad=True) for v in (w1_np, b1_np, w2_np))
        tl = t.from_numpy(labels)

        def t_step():
            loss = t.nn.functional.cross_entropy(t.tanh(tx @ tw1 + tb1) @ tw2, tl)
            loss.backward()
            for p in (tw1, tb1, tw2):
                p.grad = None

        stmts["t"] = t_step
    tm, load = C.measured(stmts, env={}, threads=threads, quick=quick, repeats=3 if quick else 9,
                          block_s=0.1 if quick else 0.3)
    ctx.close()
    return [C.vs_torch("training step", f"MLP {B}x{D} -> {H} -> {K}, tanh, CE: forward + backward",
                       threads, tm["fu"], tm.get("t"), load)]


def rows(quick: bool = False) -> list[dict]:
    return C.each_thread_count(quick, ("autograd overhead", "tiny ops", _tiny),
                               ("training step", "MLP", _mlp))


if __name__ == "__main__":
    C.main(rows)
