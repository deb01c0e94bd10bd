"""The bf16 GEMM at the exec layer: validate once, plan once per layout, launch.

`gemm_bf16(ctx, a, b)` views a as [M, K] (f32) and b as [K, N] (f32 or bf16), any element
strides, and returns a contiguous f32 c[M, N] = bf16(a) · bf16(b) with f32 accumulation
(fucina/codegen/gemm_bf16.py: operands rounded to nearest even when packed, bf16 denormals
read as zero, vdpbf16ps where the host has it, its bit-exact emulation elsewhere). Two
launches (per k slice, for a long k): pack A into pair panels, then a grid of (M-block,
N-block) tiles fixed by the problem size, each packing its panels of b into L1 as it goes —
bitwise identical for any thread count. M blocks are large (b, the frozen weight, is read
once per M block) and N blocks small enough that there are several chunks for the threads.
"""
from __future__ import annotations

from ..codegen import gemm_bf16 as g
from ..codegen import kernels
from ..errors import DTypeError, ShapeMismatch
from .matmul import PF_C_MIN, blocks, pack_groups
from .raw import RawTensor

MC_PANELS = 48   # at most this many MR panels of A per tile (MC x KC of A, 688 KiB, stays in L2)
NC_PANELS = 8    # at most this many NR panels of B per tile ...
N_CHUNKS = 8     # ... and fewer when that leaves N with fewer blocks than this
K_SLICE = 1024   # a k longer than twice this runs in slices of this many (even, a multiple of
                 # KC): the head's [1024, 49152] x [49152, 576] product 345 -> ~370 GFLOP/s
_plans: dict = {}


class Plan:
    """The launches of one layout pair: per k slice, (k0, pack A, tiles), each an (addr,
    n_chunks, cost, tail); `words` is the size of a slice of A's panels."""

    __slots__ = ("shape", "words", "slices")


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
    sa, sb = a.strides[1] * 4, b.strides[0] * b.lay.itemsize
    for k0, (addr, n, cost, tail), (taddr, tn, tcost, ttail) in plan.slices:
        ctx.launch(addr, n, cost, a.addr + k0 * sa, sp, *tail)
        ctx.launch(taddr, tn, tcost, sp, b.addr + k0 * sb, out.addr, *ttail)
    del s
    return out


def _mode(rows, K, s_w, s_k):
    if s_w == 1 or rows == 1:
        return "wvec"
    return "kvec" if s_k == 1 or K == 1 else "any"


def _kc(K):
    """K in equal even blocks of at most g.KC (a short last block would cost its own pass)."""
    c = -(-K // -(-K // g.KC))
    return c + c % 2


def _pack(dtype, width, rows, K, s_w, s_k, kc):
    """One gemm_bf16_pack launch: (addr, chunks, cost, tail), words written."""
    npan = -(-rows // width)
    per, groups = pack_groups(npan, width * min(K, kc), -(-K // kc))
    addr = kernels.get(g.GemmBf16PackKey(dtype, width, _mode(rows, K, s_w, s_k)))
    words = npan * width * (-(-K // 2))
    return (addr, -(-K // kc) * groups, npan * width * K * 4,
            (rows, K, s_w, s_k, kc, npan, per, groups)), words


def _make_plan(a, b, native: bool) -> Plan:
    plan = Plan()
    M, K = a.shape
    N = b.shape[1]
    plan.shape = (M, N)
    MR, NR = g.mr(), g.nr()
    # a long k in slices (even, whole KC blocks), each packing and multiplying its share and
    # continuing the sums the previous one left in C: the bits of one pass, and the slice of
    # A stays in cache across the N blocks instead of streaming from memory once per N block
    KS = K if K <= 2 * K_SLICE else K_SLICE
    kc = _kc(KS)
    s_bk, s_bn = b.strides
    mpn, npn = -(-M // MR), -(-N // NR)
    MC = blocks(mpn, MC_PANELS) * MR
    NC = min(blocks(npn, NC_PANELS), -(-npn // N_CHUNKS)) * NR
    nmb, nnb = -(-M // MC), -(-N // NC)
    addr = kernels.get(g.GemmBf16TileKey(MR, g.NR_VECS, g.UNROLL, native, b.dtype,
                                         _mode(N, K, s_bn, s_bk), M * N >= PF_C_MIN))
    plan.slices = []
    plan.words = 0
    for k0 in range(0, K, KS):
        ks = min(KS, K - k0)
        pack, words = _pack("f32", MR, M, ks, a.strides[0], a.strides[1], kc)
        plan.words = max(plan.words, words)
        plan.slices.append((k0, pack, (addr, nmb * nnb, M * N * ks,
                                       (M, N, ks, kc, MC, NC, nmb, nnb, int(N > M), s_bk, s_bn,
                                        int(k0 > 0)))))
    return plan
