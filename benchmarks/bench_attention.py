"""grouped_attention benchmarks vs PyTorch's scaled_dot_product_attention (same process,
interleaved medians).

    python -m benchmarks.bench_attention [--quick]

Target (issue 5): forward + backward at seq 256, 16 heads, head dim 64, causal, at least as fast
as torch SDPA (its CPU flash kernel) at 1 and 2 threads. A step clears the gradients, runs the
forward and the backward with a given upstream gradient (q, k, v gradients). The GQA row maps 16
query heads to 4 KV heads (torch: repeat_interleave of k and v, as SPEC §3.12 prescribes);
the long row (seq 2048) runs the tiled online-softmax forward. Forward-only rows are for
information.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "attention"


def _case(threads, quick, S, H, KVH, D, backward):
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((S, H, D)).astype(np.float32)
    k = rng.standard_normal((S, KVH, D)).astype(np.float32)
    v = rng.standard_normal((S, KVH, D)).astype(np.float32)
    g = rng.standard_normal((S, H * D)).astype(np.float32)
    G = H // KVH
    scale = 1.0 / np.sqrt(D)
    ctx = fu.ExecContext(threads=threads)
    try:
        make = ctx.variable if backward else ctx.tensor
        Q = make(q, ("seq", "head", "d"))
        K, V = make(k, ("seq", "kv_head", "d")), make(v, ("seq", "kv_head", "d"))
        env = {"Q": Q, "K": K, "V": V, "heads": [h // G for h in range(H)], "s": scale,
               "g": ctx.tensor(g, ("seq", "hd"))}
        att = 'Q.grouped_attention(K, V, heads, "hd", s)'
        fu_stmt = (f"Q.zero_grad(); K.zero_grad(); V.zero_grad(); {att}.backward(grad=g)"
                   if backward else att)
        stmts = {"fucina": fu_stmt}
        if torch is not None:
            F = torch.nn.functional
            tq = torch.tensor(q.transpose(1, 0, 2), requires_grad=backward)
            tk = torch.tensor(k.transpose(1, 0, 2), requires_grad=backward)
            tv = torch.tensor(v.transpose(1, 0, 2), requires_grad=backward)
            env.update(torch=torch, F=F, tq=tq, tk=tk, tv=tv, G=G, s=scale,
                       tg=torch.from_numpy(g.reshape(S, H, D).transpose(1, 0, 2).copy()))
            tatt = ("F.scaled_dot_product_attention(tq, tk.repeat_interleave(G, 0) if G > 1 else tk, "
                    "tv.repeat_interleave(G, 0) if G > 1 else tv, is_causal=True, scale=s)")
            stmts["torch"] = (f"tq.grad = tk.grad = tv.grad = None; {tatt}.backward(tg)"
                              if backward else f"with torch.no_grad(): {tatt}")
            with torch.no_grad():
                want = eval(tatt, env).permute(1, 0, 2).reshape(S, H * D).numpy()
            with fu.no_grad():
                got = eval(att, env).numpy()
            if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                raise AssertionError("grouped_attention: Fucina and PyTorch disagree")
        t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                             repeats=3 if quick else 9, block_s=0.05 if quick else 0.2)
        env.clear()
    finally:
        ctx.close()
    return t, load


def _one(threads: int, quick: bool) -> list[dict]:
    out = []
    cases = [("causal, forward + backward", 256, 16, 16, 64, True, True),
             ("causal GQA 16→4 heads, forward + backward", 256, 16, 4, 64, True, True),
             ("causal, forward only (no grad)", 256, 16, 16, 64, False, False),
             ("causal, forward + backward", 2048, 16, 16, 64, True, False)]
    for what, S, H, KVH, D, backward, target in cases:
        if quick and S > 256:
            continue
        t, load = _case(threads, quick, S, H, KVH, D, backward)
        out.append(c.vs_torch(GROUP, f"{what} seq {S}, {H} heads, d {D}", threads, t["fucina"],
                              t.get("torch"), load, target="≥ PyTorch" if target else ""))
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "attention", _one))


if __name__ == "__main__":
    c.main(rows)
