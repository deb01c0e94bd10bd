"""Selection and MoE benchmarks vs PyTorch (same process, interleaved medians).

    python -m benchmarks.bench_selection [--quick]

Targets (issue 6): top_k (k = 1, 8, 50) over [1, 151936] and [64, 151936] logits, argmax over
[64, 151936], sort of [256, 1024], and the routed expert FFN (d_model 1024, ffn 768, 8 of 64
experts, f32 weights, SwiGLU) for one token and for 16 tokens: each at least as fast as
PyTorch at 1 and 2 threads. PyTorch's MoE is the usual loop over experts: per selected expert
for one token, per routed expert with index_add_ for a batch. A [64, 151936] f32 row block is
39 MB and the 64 experts hold 604 MB, so both sides stream from memory there; the notes give
the rate (bytes of input or of routed expert weights per second).
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "selection"
VOCAB = 151936
D_MODEL, FFN, EXPERTS, TOP_K = 1024, 768, 64, 8

_weights: list = []


def _experts():
    """The MoE weights, made once per process (604 MB of f32)."""
    if not _weights:
        rng = np.random.default_rng(1)
        s = np.float32(0.03)
        _weights.extend([rng.standard_normal((EXPERTS, FFN, D_MODEL), dtype=np.float32) * s,
                         rng.standard_normal((EXPERTS, FFN, D_MODEL), dtype=np.float32) * s,
                         rng.standard_normal((EXPERTS, D_MODEL, FFN), dtype=np.float32) * s])
    return _weights


def _measure(out, threads, quick, what, fu_stmt, to_stmt, env, nbytes=None):
    stmts = {"fucina": fu_stmt}
    torch = c.torch()
    if torch is not None:
        stmts["torch"] = to_stmt
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                         repeats=5 if quick else 11, block_s=0.05 if quick else 0.15)
    note = ""
    if nbytes:
        note = f"Fucina {c.fmt_gbs(nbytes / t['fucina'].median)}" + (
            f", torch {c.fmt_gbs(nbytes / t['torch'].median)}" if "torch" in t else "")
    out.append(c.vs_torch(GROUP, what, threads, t["fucina"], t.get("torch"), load, note=note))


def _selection(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    rng = np.random.default_rng(0)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        env = {}
        for rows in (1, 64):
            a = rng.standard_normal((rows, VOCAB), dtype=np.float32) * 3
            env[f"x{rows}"] = ctx.tensor(a, ("r", "v"))
            if torch is not None:
                env[f"t{rows}"] = torch.from_numpy(a)
                for k in (1, 8, 50):
                    got = env[f"x{rows}"].top_k("v", k, "k")
                    tv, ti = env[f"t{rows}"].topk(k, dim=1)
                    if not (np.array_equal(got.values.numpy(), tv.numpy())
                            and np.array_equal(got.indices.numpy(), ti.numpy())):
                        raise AssertionError(f"top_k {k}: Fucina and PyTorch disagree")
        s = rng.standard_normal((256, 1024), dtype=np.float32)
        env["s"] = ctx.tensor(s, ("r", "c"))
        if torch is not None:
            env["ts"] = torch.from_numpy(s)
            if not np.array_equal(env["s"].sort("c").values.numpy(), env["ts"].sort(dim=1).values.numpy()):
                raise AssertionError("sort: Fucina and PyTorch disagree")
            if not np.array_equal(env["x64"].argmax("v").numpy(), env["t64"].argmax(dim=1).numpy()):
                raise AssertionError("argmax: Fucina and PyTorch disagree")
        for rows in (1, 64):
            for k in (1, 8, 50):
                _measure(out, threads, quick, f"top_k k={k} [{rows}, {VOCAB}]",
                         f'x{rows}.top_k("v", {k}, "k")', f"t{rows}.topk({k}, dim=1)", env,
                         nbytes=rows * VOCAB * 4)
        _measure(out, threads, quick, f"argmax [64, {VOCAB}]", 'x64.argmax("v")',
                 "t64.argmax(dim=1)", env, nbytes=64 * VOCAB * 4)
        _measure(out, threads, quick, "sort (ascending, values + indices) [256, 1024]",
                 's.sort("c")', "ts.sort(dim=1)", env)
        env.clear()
    finally:
        ctx.close()
    return out


def _moe(threads: int, quick: bool) -> list[dict]:
    import fucina as fu

    torch = c.torch()
    wg, wu, wd = _experts()
    rng = np.random.default_rng(2)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        G, U, D = (ctx.tensor(w, ("e", "o", "i")) for w in (wg, wu, wd))
        env = {"fu": fu, "G": G, "U": U, "D": D, "K": TOP_K, "FFN": FFN}
        if torch is not None:
            F = torch.nn.functional
            tg, tu, td = (torch.from_numpy(w) for w in (wg, wu, wd))

            def one(x, sel, w):
                y = torch.zeros_like(x)
                for e, we in zip(sel, w):
                    y += we * F.linear(F.silu(F.linear(x, tg[e])) * F.linear(x, tu[e]), td[e])
                return y

            def batch(x, sel, w):
                y = torch.zeros_like(x)
                for e in sel.unique().tolist():
                    tok, slot = (sel == e).nonzero(as_tuple=True)
                    xe = x[tok]
                    h = F.silu(F.linear(xe, tg[e])) * F.linear(xe, tu[e])
                    y.index_add_(0, tok, F.linear(h, td[e]) * w[tok, slot, None])
                return y

            env.update(one=one, batch=batch)
        for T in (1, 16):
            x = rng.standard_normal((T, D_MODEL), dtype=np.float32)
            logits = rng.standard_normal((T, EXPERTS), dtype=np.float32)
            sel, w = [0] * (T * TOP_K), [0.0] * (T * TOP_K)
            ctx.tensor(logits, ("t", "e")).router_top_k("e", TOP_K, sel, w)
            env.update(x=ctx.tensor(x, ("t", "d")), sel=sel, w=w)
            active = len(set(sel))
            nbytes = active * 3 * FFN * D_MODEL * 4
            if T == 1:
                fu_stmt = 'fu.moe_expert_ffn(x, G, U, D, sel, w, FFN, "swiglu")'
                to_stmt = "one(tx, sel, w)"
            else:
                fu_stmt = 'fu.moe_expert_ffn_batch(x, G, U, D, sel, w, K, FFN, "swiglu")'
                to_stmt = "batch(tx, tsel, tw)"
            if torch is not None:
                env.update(tx=torch.from_numpy(x), tsel=torch.tensor(sel).view(T, TOP_K),
                           tw=torch.tensor(w).view(T, TOP_K))
                got = eval(fu_stmt, env).numpy()
                want = eval(to_stmt, env).numpy()
                if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                    raise AssertionError(f"MoE {T} tokens: Fucina and PyTorch disagree")
            _measure(out, threads, quick,
                     f"MoE expert FFN f32, {T} token{'s' if T > 1 else ''}, {TOP_K} of {EXPERTS} experts "
                     f"(d {D_MODEL}, ffn {FFN}, swiglu; {active} experts routed)",
                     fu_stmt, to_stmt, env, nbytes=nbytes)
        env.clear()
        del G, U, D
    finally:
        ctx.close()
    return out


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "selection", _selection), (GROUP, "moe", _moe))


if __name__ == "__main__":
    c.main(rows)
