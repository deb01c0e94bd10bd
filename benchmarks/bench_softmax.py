"""Softmax-family benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_softmax [--quick]

Target (DESIGN.md §7): softmax forward at [1024, 151936] (a Qwen vocabulary row per position)
at least as fast as PyTorch, at 1 and 2 threads. PyTorch's out-of-place softmax allocates a fresh
622 MB result per call (mmap + page faults, which is what `F.softmax(x, -1)` costs a user); the
`out=` row takes that allocation out of PyTorch's time. Fucina's result comes from its pool.
The other rows (log_softmax, logsumexp, backward, attention-shaped softmax with scale + mask +
causal) are for information, each against the PyTorch spelling of the same computation.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "softmax family"
VOCAB = (1024, 151936)
ATTN = (16, 512, 512)  # heads, queries, keys


def _check(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    for sl in (slice(0, 2), slice(-2, None)):
        if not np.allclose(got[sl], want[sl], rtol=1e-5, atol=1e-6, equal_nan=True):
            raise AssertionError(f"{what}: Fucina and PyTorch disagree")


def _measure(threads, quick, stmts, env):
    return c.measured(stmts, env=env, threads=threads, quick=quick, repeats=3 if quick else 7,
                      block_s=0.05 if quick else 0.3)


def _vocab(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    shape = VOCAB if not quick else (256, VOCAB[1])
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 3
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        env = {"x": ctx.tensor(data, ("pos", "vocab"))}
        what = f"softmax forward [{shape[0]}, {shape[1]}]"
        stmts = {"fucina": 'x.softmax("vocab")'}
        if torch is not None:
            env.update(torch=torch, tx=torch.from_numpy(data), to=torch.empty(shape))
            _check(eval(stmts["fucina"], env).numpy(), torch.softmax(env["tx"], -1).numpy(), what)
            stmts.update(torch="torch.softmax(tx, -1)", torch_out="torch.softmax(tx, -1, out=to)")
        t, load = _measure(threads, quick, stmts, env)
        rate = f"{shape[0] * shape[1] * 8 / t['fucina'].median / 1e9:.1f} GB/s read + write"
        for key, label in c.OUT_OF_PLACE_AND_OUT:
            out.append(c.vs_torch(GROUP, f"{what} {label}", threads, t["fucina"], t.get(key), load,
                                  note=rate))
            if torch is None:
                break
        # log_softmax and logsumexp at the same shape (information)
        stmts = {"fucina": 'x.log_softmax("vocab")'}
        if torch is not None:
            stmts.update(torch="torch.log_softmax(tx, -1, out=to)")
        t, load = _measure(threads, quick, stmts, env)
        out.append(c.vs_torch(GROUP, f"log_softmax forward [{shape[0]}, {shape[1]}] vs torch out=",
                              threads, t["fucina"], t.get("torch"), load, target=""))
        stmts = {"fucina": 'x.logsumexp("vocab")'}
        if torch is not None:
            stmts.update(torch="torch.logsumexp(tx, -1)")
        t, load = _measure(threads, quick, stmts, env)
        out.append(c.vs_torch(GROUP, f"logsumexp [{shape[0]}, {shape[1]}]", threads, t["fucina"],
                              t.get("torch"), load, target=""))
        env.clear()
    finally:
        ctx.close()
    return out


def _attention(threads: int, quick: bool) -> list[dict]:
    """Attention scores: softmax(s * scale + mask) over keys with a causal mask, fwd and fwd+bwd."""
    import fucina as fu

    torch = c.torch()
    H, Q, K = ATTN
    rng = np.random.default_rng(1)
    data = rng.standard_normal(ATTN).astype(np.float32)
    bias = rng.standard_normal((Q, K)).astype(np.float32)
    causal = np.where(np.arange(K)[None, :] <= np.arange(Q)[:, None], 0.0, -np.inf).astype(np.float32)
    g = rng.standard_normal(ATTN).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        x = ctx.variable(data, ("h", "q", "k"))
        env = {"x": x, "m": ctx.tensor(bias, ("q", "k")), "g": ctx.tensor(g, ("h", "q", "k")),
               "C": {"query_tag": "q"}}
        fwd = 'x.softmax("k", scale=0.125, mask=m, causal=C)'
        both = f'x.zero_grad(); {fwd}.backward(grad=g)'
        stmts = {"fucina": fwd}
        stmts_b = {"fucina": both}
        if torch is not None:
            tx = torch.tensor(data, requires_grad=True)
            env.update(torch=torch, F=torch.nn.functional, tx=tx, tm=torch.from_numpy(bias + causal),
                       tg=torch.from_numpy(g))
            with torch.no_grad():
                _check(eval(fwd, env).numpy(), torch.softmax(tx * 0.125 + env["tm"], -1).numpy(),
                       "attention softmax")
            stmts["torch"] = "F.softmax(tx * 0.125 + tm, -1)"
            stmts_b["torch"] = "tx.grad = None; F.softmax(tx * 0.125 + tm, -1).backward(tg)"
        for label, st in (("forward", stmts), ("forward + backward", stmts_b)):
            t, load = _measure(threads, quick, st, env)
            out.append(c.vs_torch(GROUP, f"attention softmax [{H}, {Q}, {K}] scale + [q, k] mask + "
                                         f"causal, {label} (torch: x*s + mask with -inf causal entries)",
                                  threads, t["fucina"], t.get("torch"), load, target=""))
        env.clear()
        del x
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "softmax [1024, 151936]", _vocab),
                               (GROUP, "attention softmax", _attention))


if __name__ == "__main__":
    c.main(rows)
