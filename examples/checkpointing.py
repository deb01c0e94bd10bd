"""Activation checkpointing, shown on a 16-block residual MLP trained a few SGD steps twice:
plain, then with every block under `fu.checkpoint`. The losses agree to the last bit; the
checkpointed run keeps one activation per block instead of four, so its peak pool bytes drop.

    python -m examples.checkpointing [--steps N] [--blocks N] [--batch N] [--width N]
"""
from __future__ import annotations

import argparse
import weakref

import numpy as np

import fucina as fu


class PoolMeter:
    """Live and peak bytes of the pool buffers handed out since install (a buffer counts until
    the last view of it dies, i.e. until it goes back to the pool)."""

    def __init__(self, ctx):
        self._pool = ctx.pool
        ctx.pool = self  # every allocation in the library goes through ctx.pool.alloc
        self.live = self.peak = 0

    def alloc(self, nbytes, *args, **kw):
        buf = self._pool.alloc(nbytes, *args, **kw)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(buf, self._freed, nbytes)
        return buf

    def _freed(self, nbytes):
        self.live -= nbytes

    def reset_peak(self):
        self.peak = self.live

    def __getattr__(self, name):  # counters, close(): the real pool's
        return getattr(self._pool, name)


def block(h, w, b):
    """One residual layer: h + tanh(h·w + b) — four activations when recorded plainly."""
    return h + (h.matmul(w, "plain", ("n", "d")) + b).tanh()


def train(ctx, params, x, target, steps, checkpointed, lr=0.05):
    """SGD on mse(MLP(x), target); returns the losses. Each step's graph lives in an exec scope."""
    meter = ctx.pool
    losses = []
    for _ in range(steps):
        with ctx.exec_scope():
            h = x
            for w, b in params:
                h = fu.checkpoint(block, h, w, b) if checkpointed else block(h, w, b)
            loss = h.mse_loss(target)
            loss.backward()
            losses.append(loss.item())
        for w, b in params:  # in place through a grad-free view of each parameter's storage
            for p in (w, b):
                p.detach().add_scaled_in_place(p.grad_view(), -lr)
                p.zero_grad()
    return losses, meter.peak


def run(steps=4, blocks=16, batch=512, width=128, threads=None, seed=0):
    """Both runs from the same initial parameters; returns {checkpointed: (losses, peak bytes)}."""
    rng = np.random.default_rng(seed)
    x_np = rng.standard_normal((batch, width)).astype(np.float32)
    t_np = np.tanh(x_np @ rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width))
    w_np = [(rng.standard_normal((width, width)) * 0.5 / np.sqrt(width)).astype(np.float32)
            for _ in range(blocks)]
    b_np = [(rng.standard_normal(width) * 0.1).astype(np.float32) for _ in range(blocks)]
    out = {}
    for checkpointed in (False, True):
        with fu.ExecContext(threads=threads) as ctx:
            meter = PoolMeter(ctx)
            x = ctx.tensor(x_np, ("n", "d"))
            target = ctx.tensor(t_np, ("n", "d"))
            params = [(ctx.variable(w, ("k", "d")), ctx.variable(b, ("d",))) for w, b in zip(w_np, b_np)]
            meter.reset_peak()
            out[checkpointed] = train(ctx, params, x, target, steps, checkpointed)
            del x, target, params
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=128)
    a = ap.parse_args(argv)
    res = run(a.steps, a.blocks, a.batch, a.width)
    act = a.batch * a.width * 4
    print(f"{a.blocks} residual blocks, batch {a.batch}, width {a.width} "
          f"(one activation = {act / 2**20:.2f} MiB)\n")
    print(f"{'step':>4}  {'loss (plain)':>14}  {'loss (checkpointed)':>20}")
    for i, (p, c) in enumerate(zip(res[False][0], res[True][0])):
        print(f"{i:>4}  {p:>14.9f}  {c:>20.9f}  {'identical' if p == c else 'DIFFERENT'}")
    for ck, label in ((False, "plain"), (True, "checkpointed")):
        peak = res[ck][1]
        print(f"peak pool bytes, {label:<12}: {peak / 2**20:8.2f} MiB ({peak / act:5.1f} activations)")
    same = res[False][0] == res[True][0]
    print("\nlosses identical bit for bit" if same else "\nlosses differ")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
