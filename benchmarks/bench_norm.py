"""Normalization benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_norm [--quick]

Target (DESIGN.md §7, "layer/rms norm ≥ PyTorch"): at least as fast as PyTorch at 1 and 2
threads. A step is what a training loop does: gradients cleared (set to None on both sides),
forward, backward with a given upstream gradient, gradients for every operand that has one.

* layer_norm (with weight and bias) and rms_norm (with weight) at [1024, 1024], forward +
  backward; forward-only rows for information. PyTorch's rms_norm backward is composed of
  several ops on CPU; its layer_norm is one fused kernel each way.
* group_norm (32 groups, weight + bias) on a conv batch N 8, C 64, H = W 32: Fucina is one
  batched call on [8 batch, 1024 time (H·W), 64 channel] (channels contiguous); PyTorch is one
  F.group_norm on [8, 64, 32, 32], NCHW or channels_last (the faster is reported).
* l2_normalize over the last axis of [1024, 1024] (eps added to the squared norm, composed; its
  step runs in an exec scope): PyTorch the same formula, or F.normalize (the faster).
* snake x + inv_b[c]·sin(alpha[c]·x)² on [1024 time, 1024 channels], gradients for x, alpha and
  inv_b: PyTorch the same formula.
* rms_norm_mul_rope_half_prepared, the Qwen3 QK-norm + RoPE on q [1024 seq, 16 heads, 64]:
  PyTorch F.rms_norm then the half rotation with precomputed cos/sin.
The new ops are held to the target forward-only too.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "normalization"
SHAPE = (1024, 1024)
GN = (8, 64, 32, 32, 32)   # N, C, H, W, groups
QK = (1024, 16, 64)        # seq, heads, head dim


def _time(threads, quick, env, cases) -> list[dict]:
    """cases: (what, Fucina statement, PyTorch statement or {formulation: statement}, target?)."""
    out = []
    for what, fu_stmt, to_stmts, target in cases:
        stmts = {"fucina": fu_stmt}
        if c.torch() is not None:
            variants = to_stmts if isinstance(to_stmts, dict) else {"": to_stmts}
            stmts.update({f"torch {k}": v for k, v in variants.items()})
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=5 if quick else 15, block_s=0.03 if quick else 0.1)
        best, note = c.fastest_torch(t)
        out.append(c.vs_torch(GROUP, what, threads, t["fucina"], best, load,
                              target="≥ PyTorch" if target else "",
                              note=note if isinstance(to_stmts, dict) else ""))
    return out


def _agree(what, got, want, tol=1e-4):
    if not np.allclose(got, want, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: Fucina and PyTorch disagree")


def _layer_rms(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    R, D = SHAPE
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(SHAPE) * 2 + 0.5).astype(np.float32)
    w, bvec = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        x, wv, bv = ctx.variable(a, ("r", "d")), ctx.variable(w, ("d",)), ctx.variable(bvec, ("d",))
        env = {"x": x, "w": wv, "b": bv, "g": ctx.tensor(g, ("r", "d")),
               "xc": ctx.tensor(a, ("r", "d")), "wc": ctx.tensor(w, ("d",)), "bc": ctx.tensor(bvec, ("d",))}
        cases = [
            (f"layer_norm (weight + bias), forward + backward [{R}, {D}]",
             'x.zero_grad(); w.zero_grad(); b.zero_grad(); x.layer_norm("d", 1e-5, weight=w, bias=b).backward(grad=g)',
             "tx.grad = tw.grad = tb.grad = None; F.layer_norm(tx, (D,), tw, tb, 1e-5).backward(tg)", True),
            (f"rms_norm (weight), forward + backward [{R}, {D}]",
             'x.zero_grad(); w.zero_grad(); x.rms_norm("d", 1e-6, weight=w).backward(grad=g)',
             "tx.grad = tw.grad = None; F.rms_norm(tx, (D,), tw, 1e-6).backward(tg)", True),
            (f"layer_norm (weight + bias), forward only (no grad) [{R}, {D}]",
             'xc.layer_norm("d", 1e-5, weight=wc, bias=bc)',
             "F.layer_norm(cx, (D,), cw, cb, 1e-5)", False),
            (f"rms_norm (weight), forward only (no grad) [{R}, {D}]",
             'xc.rms_norm("d", 1e-6, weight=wc)', "F.rms_norm(cx, (D,), cw, 1e-6)", False),
        ]
        if torch is not None:
            F = torch.nn.functional
            env.update(torch=torch, F=F, D=D, tg=torch.from_numpy(g),
                       tx=torch.tensor(a, requires_grad=True), tw=torch.tensor(w, requires_grad=True),
                       tb=torch.tensor(bvec, requires_grad=True), cx=torch.from_numpy(a),
                       cw=torch.from_numpy(w), cb=torch.from_numpy(bvec))
            _agree("layer_norm", x.layer_norm("d", 1e-5, weight=wv, bias=bv).numpy(),
                   F.layer_norm(env["cx"], (D,), env["cw"], env["cb"], 1e-5).numpy())
            _agree("rms_norm", x.rms_norm("d", 1e-6, weight=wv).numpy(),
                   F.rms_norm(env["cx"], (D,), env["cw"], 1e-6).numpy())
        out = _time(threads, quick, env, cases)
        env.clear()
        del x, wv, bv
    finally:
        ctx.close()
    return out


def _group_norm(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    N, C, H, W, G = GN
    T, eps = H * W, 1e-5
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((N, C, H, W)) * 2 + 0.5).astype(np.float32)
    g = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w, bvec = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)

    xs = np.ascontiguousarray(a.reshape(N, C, T).transpose(0, 2, 1))   # [N, T, C]
    gs = np.ascontiguousarray(g.reshape(N, C, T).transpose(0, 2, 1))
    tags = ("n", "t", "c")
    ctx = fu.ExecContext(threads=threads)
    try:
        x, xc, gt = ctx.variable(xs, tags), ctx.tensor(xs, tags), ctx.tensor(gs, tags)
        wv, bv = ctx.variable(w, ("c",)), ctx.variable(bvec, ("c",))
        wc, bc = ctx.tensor(w, ("c",)), ctx.tensor(bvec, ("c",))

        def forward():
            return xc.group_norm("c", G, eps, weight=wc, bias=bc)

        def step():
            x.zero_grad()
            wv.zero_grad()
            bv.zero_grad()
            x.group_norm("c", G, eps, weight=wv, bias=bv).backward(grad=gt)

        env = {"forward": forward, "step": step}
        shape = f"[{N} batch, {T} time ({H}×{W}), {C} channels] (one call), {G} groups"
        cases = [
            (f"group_norm (weight + bias), forward + backward, {shape}", "step()",
             {"NCHW": "vx.grad = vw.grad = vb.grad = None; F.group_norm(vx, G, vw, vb, eps).backward(tg)",
              "channels_last": "ux.grad = vw.grad = vb.grad = None; "
                               "F.group_norm(ux, G, vw, vb, eps).backward(ug)"}, True),
            (f"group_norm (weight + bias), forward only (no grad), {shape}", "forward()",
             {"NCHW": "F.group_norm(tx, G, tw, tb, eps)",
              "channels_last": "F.group_norm(cx, G, tw, tb, eps)"}, True),
        ]
        if torch is not None:
            F = torch.nn.functional
            cl = torch.channels_last
            tx, tg = torch.from_numpy(a), torch.from_numpy(g)
            env.update(F=F, G=G, eps=eps, tx=tx, cx=tx.clone(memory_format=cl),
                       tw=torch.from_numpy(w), tb=torch.from_numpy(bvec), tg=tg,
                       ug=tg.clone(memory_format=cl), vx=tx.clone().requires_grad_(),
                       ux=tx.clone(memory_format=cl).requires_grad_(),
                       vw=torch.tensor(w, requires_grad=True), vb=torch.tensor(bvec, requires_grad=True))
            want = F.group_norm(tx, G, env["tw"], env["tb"], eps).numpy().reshape(N, C, T)
            _agree("group_norm", forward().numpy(), want.transpose(0, 2, 1))
        out = _time(threads, quick, env, cases)
        env.clear()
    finally:
        ctx.close()
    return out


def _l2_snake(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    R, D = SHAPE
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(SHAPE) * 2 + 0.5).astype(np.float32)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    alpha = rng.uniform(0.5, 2.0, D).astype(np.float32)
    inv_b = (1.0 / (alpha + 1e-9)).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        x, al, ib = ctx.variable(a, ("t", "c")), ctx.variable(alpha, ("c",)), ctx.variable(inv_b, ("c",))
        gt = ctx.tensor(g, ("t", "c"))

        def l2_step():
            x.zero_grad()
            with ctx.exec_scope():
                x.l2_normalize("c", 1e-6).backward(grad=gt)

        env = {"x": x, "al": al, "ib": ib, "g": gt, "l2_step": l2_step, "xc": ctx.tensor(a, ("t", "c")),
               "alc": ctx.tensor(alpha, ("c",)), "ibc": ctx.tensor(inv_b, ("c",))}
        l2 = "{0} * torch.rsqrt({0}.square().sum(-1, keepdim=True) + 1e-6)"
        snake = "{0} + {2} * torch.sin({1} * {0}).pow(2)"
        cases = [
            (f"l2_normalize over the last axis, forward + backward [{R}, {D}]", "l2_step()",
             {"same formula": f"vx.grad = None; ({l2.format('vx')}).backward(tg)",
              "F.normalize": "vx.grad = None; F.normalize(vx, dim=-1).backward(tg)"}, True),
            (f"l2_normalize over the last axis, forward only (no grad) [{R}, {D}]",
             'xc.l2_normalize("c", 1e-6)',
             {"same formula": l2.format("tx"), "F.normalize": "F.normalize(tx, dim=-1)"}, True),
            (f"snake (alpha, inv_b per channel), forward + backward [{R} time, {D} channels]",
             'x.zero_grad(); al.zero_grad(); ib.zero_grad(); x.snake("c", al, ib).backward(grad=g)',
             f"vx.grad = va.grad = vib.grad = None; ({snake.format('vx', 'va', 'vib')}).backward(tg)",
             True),
            (f"snake (alpha, inv_b per channel), forward only (no grad) [{R} time, {D} channels]",
             'xc.snake("c", alc, ibc)', snake.format("tx", "ta", "tib"), True),
        ]
        if torch is not None:
            env.update(torch=torch, F=torch.nn.functional, tx=torch.from_numpy(a),
                       ta=torch.from_numpy(alpha), tib=torch.from_numpy(inv_b),
                       tg=torch.from_numpy(g), vx=torch.tensor(a, requires_grad=True),
                       va=torch.tensor(alpha, requires_grad=True),
                       vib=torch.tensor(inv_b, requires_grad=True))
            _agree("l2_normalize", env["xc"].l2_normalize("c", 1e-6).numpy(),
                   eval(l2.format("tx"), env).numpy())
            _agree("snake", env["xc"].snake("c", env["alc"], env["ibc"]).numpy(),
                   eval(snake.format("tx", "ta", "tib"), env).numpy())
        out = _time(threads, quick, env, cases)
        env.clear()
    finally:
        ctx.close()
    return out


def _qk_norm_rope(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    S, H, D = QK
    theta, eps = 1e6, 1e-6
    rng = np.random.default_rng(3)
    q = rng.standard_normal(QK).astype(np.float32)
    g = rng.standard_normal(QK).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    try:
        qv, wv = ctx.variable(q, ("s", "h", "d")), ctx.variable(w, ("d",))
        env = {"q": qv, "w": wv, "g": ctx.tensor(g, ("s", "h", "d")), "qc": ctx.tensor(q, ("s", "h", "d")),
               "wc": ctx.tensor(w, ("d",)), "table": ctx.prepare_rope_table(list(range(S)), D, theta)}
        fused = 'rms_norm_mul_rope_half_prepared("s", "d", {}, 1e-6, table)'
        shape = f"q [{S} seq, {H} heads, {D}], θ {theta:,.0f}"
        cases = [
            (f"rms_norm_mul_rope_half_prepared (QK-norm + RoPE), forward + backward, {shape}",
             f"q.zero_grad(); w.zero_grad(); q.{fused.format('w')}.backward(grad=g)",
             "vq.grad = vw.grad = None; rope(F.rms_norm(vq, (D,), vw, eps)).backward(tg)", True),
            (f"rms_norm_mul_rope_half_prepared (QK-norm + RoPE), forward only (no grad), {shape}",
             f"qc.{fused.format('wc')}", "rope(F.rms_norm(tq, (D,), tw, eps))", True),
        ]
        if torch is not None:
            F = torch.nn.functional
            # the table as SPEC §3.11 makes it: angle = f32(p) / powf(theta, 2i / D) in f32
            pw = torch.tensor(theta, dtype=torch.float32) ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
            ang = (torch.arange(S, dtype=torch.float32)[:, None] / pw).double()
            cos = torch.cat([ang.cos()] * 2, -1)[:, None, :].float().contiguous()
            sin = torch.cat([ang.sin()] * 2, -1)[:, None, :].float().contiguous()

            def rope(t):
                return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin

            env.update(F=F, D=D, eps=eps, rope=rope, tq=torch.from_numpy(q), tw=torch.from_numpy(w),
                       tg=torch.from_numpy(g), vq=torch.tensor(q, requires_grad=True),
                       vw=torch.tensor(w, requires_grad=True))
            _agree("rms_norm_mul_rope_half_prepared", eval(f"qc.{fused.format('wc')}", env).numpy(),
                   rope(F.rms_norm(env["tq"], (D,), env["tw"], eps)).numpy())
        out = _time(threads, quick, env, cases)
        env.clear()
        del qv, wv
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "layer_norm / rms_norm", _layer_rms),
                               (GROUP, "group_norm", _group_norm),
                               (GROUP, "l2_normalize / snake", _l2_snake),
                               (GROUP, "rms_norm_mul_rope_half_prepared", _qk_norm_rope))


if __name__ == "__main__":
    c.main(rows)
