"""Convolution and pooling benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_conv [--quick]

Targets (the conv issue): at 1 and 2 threads, at least as fast as PyTorch on
  - conv2d 3x3, stride 1, pad 1, [64, 64, 64] channel-last -> 64 channels: forward (no grad)
    and forward + backward (gradients for the input and the weight);
  - conv1d at audio shapes: [16000 time, 80 in] -> 256 out, 3 taps, pad 1 (forward);
  - a causal depthwise conv1d of [4096, 1024] with 4 taps (forward);
  - max_pool2d 2x2 on [64, 64, 64] (forward).
PyTorch gets its fastest formulation for the same data: every row times a few equivalent
PyTorch statements interleaved with Fucina's and reports the fastest one's median (the note
names it). 2-D rows: NCHW and channels_last (freshly allocated: a view of a numpy array carries
a batch stride that sends max_pool2d down a slow path). 1-D rows: F.conv1d on [1, C, T] and
F.conv2d on [1, C, 1, T] (PyTorch's depthwise conv1d is several times slower than the same op
as a conv2d); the causal depthwise conv pads 3 on both sides and drops the last 3 outputs (a
view). The Winograd-prepared conv2d row (inference-only, no target) is for information.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "convolution"


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    x2, w2, g2 = arr(64, 64, 64), arr(64, 3, 3, 64) * 0.05, arr(64, 64, 64)
    xa, wa = arr(16000, 80), arr(3, 80, 256) * 0.1
    xd, kd = arr(4096, 1024), arr(1024, 4)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        env = {
            "x": ctx.variable(x2, ("h", "w", "c")), "w": ctx.variable(w2, ("o", "kh", "kw", "i")),
            "g": ctx.tensor(g2, ("h", "w", "o")),
            "xc": ctx.tensor(x2, ("h", "w", "c")), "wc": ctx.tensor(w2, ("o", "kh", "kw", "i")),
            "xa": ctx.tensor(xa, ("t", "i")), "wa": ctx.tensor(wa, ("k", "i", "o")),
            "xd": ctx.tensor(xd, ("t", "c")), "kd": ctx.tensor(kd, ("c", "k")),
        }
        env["prep"] = env["wc"].prepare_conv2d_weights()
        conv2d = {"channels_last": "F.conv2d(tx, tw, None, 1, 1)",
                  "NCHW": "F.conv2d(nx, nw, None, 1, 1)"}
        cases = [
            ("conv2d 3x3 s1 p1, [64, 64, 64] -> 64, forward (no grad)",
             "xc.conv2d(wc, None, 1, 1)", conv2d, True),
            ("conv2d 3x3 s1 p1, [64, 64, 64] -> 64, forward + backward (input and weight)",
             "x.zero_grad(); w.zero_grad(); x.conv2d(w, None, 1, 1).backward(grad=g)",
             {"channels_last": "vx.grad = vw.grad = None; F.conv2d(vx, vw, None, 1, 1).backward(tg)",
              "NCHW": "ux.grad = uw.grad = None; F.conv2d(ux, uw, None, 1, 1).backward(ng)"}, True),
            ("conv1d [16000, 80] -> 256, 3 taps, pad 1, forward",
             'xa.conv1d("t", "i", "k", "o", wa, 1, 1)',
             {"conv1d": "F.conv1d(ta, twa, None, 1, 1)",
              "conv2d": "F.conv2d(ta4, twa4, None, 1, (0, 1))"}, True),
            ("causal depthwise conv1d [4096, 1024], 4 taps, forward",
             'xd.causal_depthwise_conv1d("t", "c", "k", kd)',
             {"conv1d": "F.conv1d(td, tkd, None, 1, 3, 1, 1024)[..., :4096]",
              "conv2d": "F.conv2d(td4, tkd4, None, 1, (0, 3), 1, 1024)[..., :4096]"}, True),
            ("max_pool2d 2x2 on [64, 64, 64], forward", "xc.max_pool2d(2)",
             {"channels_last": "F.max_pool2d(tx, 2)", "NCHW": "F.max_pool2d(nx, 2)"}, True),
            ("conv2d_prepared (Winograd) 3x3 s1 p1, [64, 64, 64] -> 64, inference",
             "xc.conv2d_prepared(wc, prep, None, 1, 1)", conv2d, False),
        ]
        if torch is not None:
            F = torch.nn.functional
            cl = torch.channels_last

            def nchw(a, perm):
                return torch.from_numpy(np.ascontiguousarray(a.transpose(perm)))

            nx, nw, ng = nchw(x2, (2, 0, 1))[None], nchw(w2, (0, 3, 1, 2)), nchw(g2, (2, 0, 1))[None]
            tx, tw, tg = (t.clone(memory_format=cl) for t in (nx, nw, ng))
            ta, twa = nchw(xa, (1, 0))[None], nchw(wa, (2, 1, 0))
            td, tkd = nchw(xd, (1, 0))[None], torch.from_numpy(kd)[:, None, :].contiguous()
            env.update(torch=torch, F=F, tx=tx, tw=tw, tg=tg, nx=nx, nw=nw, ng=ng,
                       vx=tx.clone(memory_format=cl).requires_grad_(),
                       vw=tw.clone(memory_format=cl).requires_grad_(),
                       ux=nx.clone().requires_grad_(), uw=nw.clone().requires_grad_(),
                       ta=ta, twa=twa, ta4=ta[:, :, None], twa4=twa[:, :, None],
                       td=td, tkd=tkd, td4=td[:, :, None], tkd4=tkd[:, :, None])
            _agree(env, torch)
        for what, fu_stmt, to_stmts, target in cases:
            stmts = {"fucina": fu_stmt}
            if torch is not None:
                stmts.update({f"torch {k}": v for k, v in to_stmts.items()})
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=5 if quick else 15, block_s=0.05 if quick else 0.15)
            best, note = c.fastest_torch(t)
            out.append(c.vs_torch(GROUP, what, threads, t["fucina"], best, load,
                                  target="≥ PyTorch" if target else "", note=note))
        env.clear()
    finally:
        ctx.close()
    return out


def _agree(env, torch) -> None:
    """Fucina and PyTorch compute the same thing on the benchmark data."""
    F = torch.nn.functional
    checks = [
        (env["xc"].conv2d(env["wc"], None, 1, 1).numpy(),
         F.conv2d(env["tx"], env["tw"], None, 1, 1)[0].permute(1, 2, 0).numpy()),
        (env["xa"].conv1d("t", "i", "k", "o", env["wa"], 1, 1).numpy(),
         F.conv1d(env["ta"], env["twa"], None, 1, 1)[0].T.numpy()),
        (env["xd"].causal_depthwise_conv1d("t", "c", "k", env["kd"]).numpy(),
         F.conv1d(env["td"], env["tkd"], None, 1, 3, 1, 1024)[0, :, :4096].T.numpy()),
        (env["xc"].max_pool2d(2).numpy(), F.max_pool2d(env["tx"], 2)[0].permute(1, 2, 0).numpy()),
        (env["xc"].conv2d_prepared(env["wc"], env["prep"], None, 1, 1).numpy(),
         F.conv2d(env["tx"], env["tw"], None, 1, 1)[0].permute(1, 2, 0).numpy()),
    ]
    for got, want in checks:
        if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
            raise AssertionError("conv benchmark: Fucina and PyTorch disagree")


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "conv", _one))


if __name__ == "__main__":
    c.main(rows)
