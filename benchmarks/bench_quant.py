"""Block-quantized formats: dequantization throughput vs PyTorch (same process, interleaved).

    python -m benchmarks.bench_quant [--quick]

The matrix is a Qwen3-0.6B MLP weight, [3072, 1024]. Fucina's `q.to("f32")` runs the generated
decoder; PyTorch has no ggml block formats, so its competitor is the same dequantization written
as PyTorch tensor ops on the raw block bytes (the way a torch user dequantizes a GGUF weight).
Each row reports GB/s of (block bytes read + f32 bytes written). Target: at least as fast as
the PyTorch composition. The encoders (ggml's reference quantizers) are shown for information.

Quantized matmul rows (SPEC A-8): `x.dot(w_q, "in")` at Qwen3-0.6B MLP shapes, one token
(1 x 1024 -> 3072, the gemv kernel) and a 256-token prefill (256 x 1024 -> 3072, w decoded into
the f32 GEMM's packed panels), for q4_k and q8_0. The PyTorch competitor is what a torch user
with a GGUF weight runs: dequantize (the torch-ops decode above) then `x @ w.T`; the notes add
PyTorch's matmul alone on a weight dequantized beforehand and Fucina's own f32 GEMM on the
dequantized weight (`x.dot(w_f32)`). Target: at least as fast as dequantize-then-matmul.

Quantized matvec rows: one token against SmolLM2 / Qwen2.5-0.5B-sized matrices of every GGUF
format, against torch F.linear on the dequantized f32 weight; each format once more through
`Tensor.dot_q8` (8-bit activation rows, integer dots: `fu.llm.load(matvec="q8")`'s decode
path), with our exact matvec timed in the same blocks — opt-in and not the exact product, so
no target.
"""
from __future__ import annotations

import numpy as np

from . import common as c

GROUP = "quantization"
SHAPE = (3072, 1024)
MATMUL_ROWS = (1, 256)
MATMUL_FORMATS = ("q4_k", "q8_0")


def torch_dequant(torch, fmt: str):
    """ggml's dequantize_row_* for one format as PyTorch ops on a uint8 [blocks, bytes] tensor."""
    def half(raw, a):
        return raw[:, a:a + 2].contiguous().view(torch.float16).float()

    def q8_0(raw):
        return half(raw, 0) * raw[:, 2:].contiguous().view(torch.int8).float()

    def q4_0(raw):
        qs = raw[:, 2:].int()
        return half(raw, 0) * (torch.cat([qs & 15, qs >> 4], 1) - 8).float()

    def q4_k(raw):
        n = raw.shape[0]
        q = raw[:, 4:16].int()
        sc = torch.cat([q[:, :4] & 63, (q[:, 8:] & 15) | ((q[:, :4] >> 6) << 4)], 1)
        mn = torch.cat([q[:, 4:8] & 63, (q[:, 8:] >> 4) | ((q[:, 4:8] >> 6) << 4)], 1)
        qs = raw[:, 16:].reshape(n, 4, 1, 32).int()
        v = torch.cat([qs & 15, qs >> 4], 2).reshape(n, 8, 32).float()
        d = (half(raw, 0) * sc.float()).unsqueeze(2)
        m = (half(raw, 2) * mn.float()).unsqueeze(2)
        return (d * v - m).reshape(n, 256)

    def q6_k(raw):
        n = raw.shape[0]
        ql = raw[:, :128].reshape(n, 2, 2, 32).int()
        qh = raw[:, 128:192].reshape(n, 2, 1, 32).int()
        low = torch.cat([ql & 15, ql >> 4], 2)                              # [n, 2, 4, 32]
        high = (qh >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
        q = (low | (high << 4)) - 32
        sc = raw[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 4, 2, 1)
        d = half(raw, 208).reshape(n, 1, 1, 1, 1)
        return ((d * sc) * q.reshape(n, 2, 4, 2, 16).float()).reshape(n, 256)

    def tq2_0(raw):
        n = raw.shape[0]
        qs = raw[:, :64].reshape(n, 2, 1, 32).int()
        c = (qs >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
        return ((c - 1).float() * half(raw, 64).reshape(n, 1, 1, 1)).reshape(n, 256)

    return {"q8_0": q8_0, "q4_0": q4_0, "q4_k": q4_k, "q6_k": q6_k, "tq2_0": tq2_0}[fmt]


def _one(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina.codegen.quant import FORMATS
    from fucina.exec import quant as xq

    torch = c.torch()
    rng = np.random.default_rng(0)
    a = rng.standard_normal(SHAPE).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        for fmt in ("q8_0", "q4_0", "q4_k", "q6_k", "tq2_0"):
            if fmt in xq.ENCODABLE:
                q = ctx.tensor(a, ("o", "i")).to(fmt)
            else:
                import libgguf
                from gguf import GGMLQuantizationType as GT

                raw = libgguf.quantize_rows(a, int(GT[fmt.upper()]))
                q = fu.Tensor(xq.from_bytes(ctx, raw.tobytes(), SHAPE, fmt), ("o", "i"))
            bs, bb = FORMATS[fmt]
            env = {"q": q}
            stmts = {"fucina": "q.to('f32')"}
            if torch is not None:
                raw = torch.from_numpy(q.data_const().reshape(-1, bb).copy())
                fn = torch_dequant(torch, fmt)
                want = fn(raw).reshape(SHAPE).numpy()
                if not np.array_equal(q.to("f32").numpy(), want):
                    raise AssertionError(f"{fmt}: Fucina and the PyTorch dequantization disagree")
                env.update(fn=fn, raw=raw)
                stmts["torch"] = "fn(raw)"
            t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                 repeats=5 if quick else 11, block_s=0.03 if quick else 0.1)
            nbytes = q.numel // bs * bb + q.numel * 4
            out.append(c.vs_torch(GROUP, f"dequantize {fmt} → f32 {list(SHAPE)}", threads,
                                  t["fucina"], t.get("torch"), load, target="≥ PyTorch ops",
                                  note=f"{nbytes / t['fucina'].median / 1e9:.1f} GB/s (blocks read "
                                       f"+ f32 written); torch = the same decode as torch tensor ops"))
        x = ctx.tensor(a, ("o", "i"))
        for fmt in xq.ENCODABLE:
            t, load = c.measured({"fucina": f"x.to('{fmt}')"}, env={"x": x}, threads=threads,
                                 quick=quick, repeats=3 if quick else 5, block_s=0.03 if quick else 0.1)
            out.append(c.vs_torch(GROUP, f"quantize f32 → {fmt} (ggml byte-exact) {list(SHAPE)}",
                                  threads, t["fucina"], None, load,
                                  note=f"{a.size / t['fucina'].median / 1e6:.0f} M elements/s"))
    finally:
        ctx.close()
    return out


def _matmul(threads: int, quick: bool) -> list[dict]:
    import fucina as fu
    from fucina.codegen.quant import FORMATS
    from fucina.exec import quant as xq

    torch = c.torch()
    rng = np.random.default_rng(1)
    N, K = SHAPE
    a = rng.standard_normal(SHAPE).astype(np.float32)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        for fmt in MATMUL_FORMATS:
            q = ctx.tensor(a, ("out", "in")).to(fmt)
            wd = q.to("f32")
            for M in MATMUL_ROWS:
                xa = rng.standard_normal((M, K)).astype(np.float32)
                x = ctx.tensor(xa, ("tok", "in"))
                env = {"x": x, "q": q, "wd": wd}
                stmts = {"fucina": "x.dot(q, 'in')", "fucina f32": "x.dot(wd, 'in')"}
                if torch is not None:
                    fn = torch_dequant(torch, fmt)
                    raw = torch.from_numpy(q.data_const().reshape(-1, FORMATS[fmt][1]).copy())
                    env.update(fn=fn, raw=raw, tx=torch.from_numpy(xa), tw=torch.from_numpy(wd.numpy()),
                               N=N, K=K)
                    stmts["torch"] = "tx @ fn(raw).reshape(N, K).T"
                    stmts["torch mm"] = "tx @ tw.T"
                    got, want = x.dot(q, "in").numpy(), (env["tx"] @ env["tw"].T).numpy()
                    if not np.allclose(got, want, rtol=1e-4, atol=1e-3):
                        raise AssertionError(f"{fmt}: Fucina's quantized dot and torch disagree")
                t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                                     repeats=5 if quick else 9, block_s=0.03 if quick else 0.1)
                fu_s = t["fucina"].median
                path = xq.matmul_path(x._raw, q._raw)
                note = f"{2 * M * N * K / fu_s / 1e9:.1f} GFLOP/s"
                if path == "gemv":   # one token: the weight's bytes are what a call streams
                    nbytes = q.numel // FORMATS[fmt][0] * FORMATS[fmt][1]
                    note += f", {nbytes / fu_s / 1e9:.1f} GB/s of blocks"
                note += (f"; path {path}; Fucina f32 GEMM on the dequantized weight "
                         f"{c.fmt_time(t['fucina f32'].median)} (x{t['fucina f32'].median / fu_s:.2f})")
                if "torch mm" in t:
                    note += (f"; torch matmul alone on a pre-dequantized weight "
                             f"{c.fmt_time(t['torch mm'].median)} (x{t['torch mm'].median / fu_s:.2f})")
                out.append(c.vs_torch(GROUP, f"dot x[{M}, {K}] · {fmt} w[{N}, {K}]ᵀ", threads,
                                      t["fucina"], t.get("torch"), load,
                                      target="≥ PyTorch dequantize + matmul",
                                      note=f"{note}; torch = dequantize (torch ops) then x @ w.T"))
    finally:
        ctx.close()
    return out


# one-token decode products at the SmolLM2-135M shapes (K-quants need K % 256 == 0: 768 there)
MATVEC_SHAPES = {32: ((1536, 576), (576, 1536), (49152, 576)), 256: ((1536, 768), (768, 1536))}
MATVEC_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
MATVEC_HEAD = ("q8_0", "q4_1")   # formats timed on the 49152-row tied head


def _blocks(ctx, a, fmt):
    import fucina as fu
    from fucina.exec import quant as xq

    if fmt in xq.ENCODABLE:
        return ctx.tensor(a, ("out", "in")).to(fmt)
    import libgguf
    from gguf import GGMLQuantizationType as GT

    raw = libgguf.quantize_rows(a, int(GT[fmt.upper()]))
    return fu.Tensor(xq.from_bytes(ctx, raw.tobytes(), a.shape, fmt), ("out", "in"))


def _matvec(threads: int, quick: bool) -> list[dict]:
    """x [1, K] · w_q [N, K]ᵀ (the gemv kernel, one row) against torch F.linear on the
    dequantized f32 weight (what transformers runs); the note gives GB/s of block bytes and
    their % of the STREAM reference bandwidth measured in this process (read + write)."""
    import fucina as fu
    from fucina.codegen.quant import FORMATS
    from fucina.exec import quant as xq

    torch = c.torch()
    rng = np.random.default_rng(2)
    bw = c.bandwidth(threads)
    ctx = fu.ExecContext(threads=threads)
    out = []
    try:
        for fmt in MATVEC_FORMATS:
            for N, K in MATVEC_SHAPES[FORMATS[fmt][0]]:
                if N > 10000 and fmt not in MATVEC_HEAD:
                    continue
                q = _blocks(ctx, rng.standard_normal((N, K)).astype(np.float32), fmt)
                xa = rng.standard_normal((1, K)).astype(np.float32)
                x = ctx.tensor(xa, ("tok", "in"))
                layouts = [("", q)]
                qi = q.for_matvec() if N < 10000 else q
                if qi is not q:   # serving's layout (fu.llm.load)
                    layouts.append((", for_matvec layout", qi))
                for label, w in layouts:
                    out.append(_matvec_row(threads, quick, torch, bw, x, xa, w, q, fmt, N, K,
                                           label))
                if xq.q8_fits(q._raw):   # fu.llm.load(matvec="q8")'s decode dots
                    out.append(_matvec_row(threads, quick, torch, bw, x, xa, q, q, fmt, N, K,
                                           ", dot_q8 (8-bit activations)", q8=True))
    finally:
        ctx.close()
    return out


def _matvec_row(threads, quick, torch, bw, x, xa, w, q, fmt, N, K, label, q8=False):
    """One matvec row: w is q (as stored) or its for_matvec copy; q8: Tensor.dot_q8 (opt-in,
    not the exact product: no target), our exact matvec timed in the same blocks."""
    from fucina.codegen.quant import FORMATS

    bs, bb = FORMATS[fmt]
    env = {"x": x, "q": w}
    stmts = {"fucina": "x.dot(q, 'in')"}
    if q8:
        stmts = {"fucina": "x.dot_q8(q, 'in')", "exact": "x.dot(q, 'in')"}
    if torch is not None:
        env.update(F=torch.nn.functional, tx=torch.from_numpy(xa),
                   tw=torch.from_numpy(q.to("f32").numpy()))
        stmts["torch"] = "F.linear(tx, tw)"
        if not np.allclose(x.dot(w, "in").numpy(), env["F"].linear(env["tx"], env["tw"]).numpy(),
                           rtol=1e-4, atol=1e-3):
            raise AssertionError(f"{fmt}: Fucina's matvec and torch F.linear disagree")
    t, load = c.measured(stmts, env=env, threads=threads, quick=quick,
                         repeats=5 if quick else 9, block_s=0.03 if quick else 0.1)
    nbytes = N * K // bs * bb
    gbs = nbytes / t["fucina"].median
    note = (f"{gbs / 1e9:.1f} GB/s of blocks = {100 * gbs / bw:.0f} % of the STREAM scale "
            f"reference {bw / 1e9:.1f} GB/s; torch = F.linear on the dequantized f32 weight")
    if q8:
        ex = t["exact"].median
        note += (f"; our exact matvec {ex * 1e6:.1f} µs in the same blocks: q8 "
                 f"{ex / t['fucina'].median:.2f}x it; opt-in, not the exact product: no target")
    return c.vs_torch(GROUP, f"matvec x[1, {K}] · {fmt} w[{N}, {K}]ᵀ{label}", threads,
                      t["fucina"], t.get("torch"), load,
                      target="" if q8 else "≥ PyTorch F.linear", note=note)


def rows(quick: bool = False) -> list[dict]:
    return c.each_thread_count(quick, (GROUP, "quant", _one), (GROUP, "quantized matmul", _matmul),
                               (GROUP, "quantized matvec", _matvec))


def matvec_rows(quick: bool = False) -> list[dict]:
    """Only the one-token matvec rows (python -c 'from benchmarks import bench_quant as b; ...')."""
    return c.each_thread_count(quick, (GROUP, "quantized matvec", _matvec))


if __name__ == "__main__":
    c.main(rows)
