"""The bf16 GEMM at the exec layer: validate once, plan once per layout, launch.

`gemm_bf16(ctx, a, b)` views a as [M, K] (f32) and b as [K, N] (f32 or bf16), any element
strides, and returns a contiguous f32 c[M, N] = bf16(a) · bf16(b) with f32 accumulation
(fucina/codegen/gemm_bf16.py: operands rounded to nearest even when packed, bf16 denormals
read as zero, vdpbf16ps where the host has it, its bit-exact emulation elsewhere). Always the
packed path: pack A and B into pair panels (one launch each), then one launch over a grid of
(M-block, N-block) tiles fixed by the problem size — bitwise identical for any thread count.
"""
from __future__ import annotations

from ..codegen import gemm_bf16 as g
from ..codegen import kernels
from ..errors import DTypeError, ShapeMismatch
from .matmul import MC_PANELS, NC_PANELS, PACK_CHUNK, blocks
from .raw import RawTensor

_plans: dict = {}


class Plan:
    """The launches of one layout pair: (addr, n_chunks, cost, tail) for pack A, pack B and
    the tiles; `bofs` is where B's panels start in the scratch buffer (words)."""

    __slots__ = ("shape", "words", "bofs", "pack_a", "pack_b", "tile")


def _check(a, b):
    op = "matmul_bf16"
    if not isinstance(a, RawTensor) or not isinstance(b, RawTensor):
        raise TypeError(f"{op}: expected RawTensor operands, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    if a.dtype != "f32":
        raise DTypeError(f"{op}: operand a: expected dtype f32, got {a.dtype}")
    if b.dtype not in ("f32", "bf16"):
        raise DTypeError(f"{op}: operand b: expected dtype f32 or bf16, got {b.dtype}")
    if a.rank != 2 or b.rank != 2:
        raise ShapeMismatch(f"{op}: expected a [M, K] and b [K, N], got shapes {a.shape} and "
                            f"{b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ShapeMismatch(f"{op}: operand b: expected contraction length {a.shape[1]} (a's "
                            f"last axis), got {b.shape[0]} (shapes {a.shape}, {b.shape})")
    if 0 in a.shape or 0 in b.shape:
        raise ShapeMismatch(f"{op}: expected non-empty operands, got shapes {a.shape} and "
                            f"{b.shape}")


def gemm_bf16(ctx, a: RawTensor, b: RawTensor, native: bool | None = None) -> RawTensor:
    """c[M, N] = bf16(a[M, K]) · bf16(b[K, N]), f32 sums over k pairs in increasing order.
    native: None = the instruction when the host has it; False = the emulation (tests)."""
    try:
        plan = _plans[(a.lay, b.lay, native)]
    except (KeyError, AttributeError):
        _check(a, b)
        plan = _plans[(a.lay, b.lay, native)] = _make_plan(a, b, g.native() if native is None
                                                           else native)
    if ctx.closed:
        ctx.check_open("matmul_bf16")
    out = ctx.empty(plan.shape)
    s = ctx.empty((plan.words,), "f32")
    sp = s.addr
    addr, n, cost, tail = plan.pack_a
    ctx.launch(addr, n, cost, a.addr, sp, *tail)
    addr, n, cost, tail = plan.pack_b
    ctx.launch(addr, n, cost, b.addr, sp + plan.bofs * 4, *tail)
    addr, n, cost, tail = plan.tile
    ctx.launch(addr, n, cost, sp, sp + plan.bofs * 4, out.addr, *tail)
    del s
    return out


def _pack(dtype, width, rows, K, s_w, s_k):
    """One gemm_bf16_pack launch: (addr, chunks, cost, tail), words written."""
    if s_w == 1 or rows == 1:
        mode = "wvec"
    elif s_k == 1 or K == 1:
        mode = "kvec"
    else:
        mode = "any"
    npan = -(-rows // width)
    per = max(1, min(npan, PACK_CHUNK // (width * min(K, g.KC))))
    groups = -(-npan // per)
    addr = kernels.get(g.GemmBf16PackKey(dtype, width, mode))
    words = npan * width * (-(-K // 2))
    return (addr, -(-K // g.KC) * groups, npan * width * K * 4,
            (rows, K, s_w, s_k, g.KC, npan, per, groups)), words


def _make_plan(a, b, native: bool) -> Plan:
    plan = Plan()
    M, K = a.shape
    N = b.shape[1]
    plan.shape = (M, N)
    MR, NR = g.mr(), g.nr()
    plan.pack_a, aw = _pack("f32", MR, M, K, a.strides[0], a.strides[1])
    plan.pack_b, bw = _pack(b.dtype, NR, N, K, b.strides[1], b.strides[0])
    plan.bofs = -(-aw // 16) * 16
    plan.words = plan.bofs + bw
    MC = blocks(-(-M // MR), MC_PANELS) * MR
    NC = blocks(-(-N // NR), NC_PANELS) * NR
    nmb, nnb = -(-M // MC), -(-N // NC)
    addr = kernels.get(g.GemmBf16TileKey(MR, g.NR_VECS, g.UNROLL, native))
    plan.tile = (addr, nmb * nnb, M * N * K, (M, N, K, g.KC, MC, NC, nmb, nnb, int(N > M)))
    return plan
