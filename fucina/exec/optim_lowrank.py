"""The matrix optimizers' compute at the exec layer (SPEC T-6, T-8): Newton–Schulz
orthogonalization on the generated GEMM, and the launches of Muon's and APOLLO's fused maps.

Operands reaching here were validated by fucina.optim (contiguous f32 or 16-bit params with f32
masters, matching sizes); these functions lay out the chunk grid from the problem size alone and
launch, so every result is bitwise the same for any thread count.
"""
from __future__ import annotations

from ..codegen.optim_lowrank import (ApolloApplyKey, ApolloBuildKey, ApolloScaleKey, AxpbyKey,
                                     HfAdamwKey, MuonApplyKey, MuonMomentumKey)
from ..codegen.target import host
from . import elementwise as ew
from .elementwise import f32_bits
from .matmul import gemm
from .matmul_bf16 import gemm_bf16
from .optim import CHUNK, kernel, sum_squares
from .raw import RawTensor

# Keller Jordan's quintic coefficients (f32): X <- a·X + (b·A + c·A·A)·X, A = X·Xᵀ
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
NS_EPS = 1e-7
ROW_WORK = 1 << 15   # elements per chunk of the row-walking APOLLO kernels
_AXPBY = AxpbyKey()


def _chunks(n: int, per: int) -> int:
    return -(-n // per)


def _a(t) -> int:
    return 0 if t is None else t.addr


def newton_schulz5(ctx, u: RawTensor, steps: int, bf16: bool = False) -> RawTensor:
    """≈ U·Vᵀ of a rank-2 f32 `u` (never written): Frobenius-normalise, then `steps` quintic
    iterations; a tall input (rows > cols) iterates on its transpose so the Gram matrix has the
    small side. inv = f32(1/(sqrt(Σx²) + 1e-7)) with Σx² the T-7 sum over the (transposed)
    iterate's flat order. Returns a new contiguous [rows, cols] tensor. bf16: the three GEMMs
    of each iteration through gemm_bf16 (operands rounded to bf16, f32 sums), B·X then added
    to a·X in a second rounding; the rest stays f32."""
    rows, cols = u.shape
    transposed = rows > cols
    src = u.permute((1, 0)) if transposed else u
    if src.is_contiguous():  # the sum reads u directly; the scaled copy is the iterate
        inv = 1.0 / (sum_squares(ctx, src) ** 0.5 + NS_EPS)
        x = ew.run(ctx, "mul", "f32", src.shape, (src, inv))
    else:
        x = ew.run(ctx, "copy", "f32", src.shape, (src,))
        inv = 1.0 / (sum_squares(ctx, x) ** 0.5 + NS_EPS)
        ew.run(ctx, "mul", "f32", x.shape, (x, inv), out=x)
    for _ in range(steps):
        if bf16:
            a = gemm_bf16(ctx, x, x.permute((1, 0)))
            q = gemm_bf16(ctx, a, a)
            axpby(ctx, q, a, q, NS_B, NS_C)
            nxt = gemm_bf16(ctx, q, x)
            axpby(ctx, nxt, x, nxt, NS_A, 1.0)
        else:
            a = gemm(ctx, x, x.permute((1, 0)))               # A = X·Xᵀ (the short side²)
            q = gemm(ctx, a, a)                               # Q = A·A
            axpby(ctx, q, a, q, NS_B, NS_C)                   # B = b·A + c·Q   (into q)
            nxt = ew.run(ctx, "mul", "f32", x.shape, (x, NS_A))   # a·X ...
            gemm(ctx, q, x, out=nxt, accumulate=True)         # ... + B·X, one rounding
        x = nxt
        del a, q
    if transposed:
        return ew.run(ctx, "copy", "f32", (rows, cols), (x.permute((1, 0)),))
    return x


def axpby(ctx, out: RawTensor, x: RawTensor, y: RawTensor, s: float, t: float) -> None:
    """out = f32(s)·x + f32(t)·y over equal-sized contiguous f32 tensors (out may alias)."""
    n = out.numel
    ctx.launch(kernel(_AXPBY), _chunks(n, CHUNK), 12 * n, out.addr, x.addr, y.addr, n, CHUNK,
               f32_bits(s), f32_bits(t))


def muon_momentum(ctx, key: MuonMomentumKey, g: RawTensor, m: int, out: RawTensor,
                  w: float, beta: float) -> None:
    """m <- lerp(m, g, w) (momentum buffer at address m, key.state dtype); out <- the update
    (nesterov blend or m1); w, beta: float32 values."""
    n = g.numel
    per = 4 if key.state == "f32" else 2
    ctx.launch(kernel(key), _chunks(n, CHUNK), n * (8 + 2 * per), g.addr, m, out.addr, n, CHUNK,
               f32_bits(w), f32_bits(beta))


def muon_apply(ctx, key: MuonApplyKey, p: RawTensor, master, o: RawTensor, keep: float,
               lr_eff: float) -> None:
    """p = p·keep − lr_eff·o (the master of a 16-bit p, narrowed back into p)."""
    n = p.numel
    ctx.launch(kernel(key), _chunks(n, CHUNK), 12 * n, p.addr, _a(master), o.addr, n, CHUNK,
               f32_bits(keep), f32_bits(lr_eff))


def apollo_scale(ctx, r: RawTensor, m: int, v: int, s: RawTensor, mode: str, scalars) -> None:
    """Moments of r [R0, R1] (buffers at m, v) and the channel factors into s.
    mode: tall (channel = row of r) | wide (channel = column) | tensor (one channel);
    scalars: β1, 1−β1, β2, 1−β2, eps (float32 values)."""
    R0, R1 = r.shape
    n = r.numel
    bits = [f32_bits(x) for x in scalars]
    if mode == "wide":
        W = host().f32_lanes
        per = W * max(1, ROW_WORK // (W * R0))       # column vectors per chunk
        ctx.launch(kernel(ApolloScaleKey("cols")), _chunks(R1, per), 16 * n, r.addr, m, v,
                   s.addr, R1, R1, per, R0, *bits)
        return
    length, channels = (R1, R0) if mode == "tall" else (n, 1)
    per = max(1, ROW_WORK // length)
    ctx.launch(kernel(ApolloScaleKey("rows")), _chunks(channels, per), 16 * n, r.addr, m, v,
               s.addr, length, channels, per, 0, *bits)


def apollo_build(ctx, out: RawTensor, g: RawTensor, s: RawTensor, mode: str,
                 front: float | None) -> None:
    """out = (g·s[channel])·front over [rows, cols]; front None: no multiply (it is 1)."""
    rows, cols = out.shape
    per = max(1, ROW_WORK // cols)
    key = ApolloBuildKey(mode, front is not None)
    ctx.launch(kernel(key), _chunks(rows, per), 8 * out.numel, out.addr, g.addr, s.addr, rows,
               cols, per, f32_bits(1.0 if front is None else front))


def apollo_apply(ctx, key: ApolloApplyKey, p: RawTensor, master, upd: RawTensor, scalars) -> None:
    """stepped = p − step_size·((u/limiter)·back); p = stepped + decay·stepped.
    scalars: limiter, back, step_size, decay (float32 values)."""
    n = p.numel
    ctx.launch(kernel(key), _chunks(n, CHUNK), 12 * n, p.addr, _a(master), upd.addr, n, CHUNK,
               *[f32_bits(x) for x in scalars])


def hf_adamw(ctx, key: HfAdamwKey, p: RawTensor, master, g: RawTensor, m: int, v: int,
             scalars) -> None:
    """The legacy-HF AdamW step; scalars: β1, 1−β1, β2, 1−β2, eps, step_size, decay."""
    n = p.numel
    ctx.launch(kernel(key), _chunks(n, CHUNK), 24 * n, p.addr, _a(master), g.addr, m, v, n,
               CHUNK, *[f32_bits(x) for x in scalars])
