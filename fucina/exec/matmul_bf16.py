"""The bf16 GEMM at the exec layer: validate once, plan once per layout, launch.

`gemm_bf16(ctx, a, b)` views a as [M, K] (f32) and b as [K, N] (f32 or bf16), any element
strides, and returns a contiguous f32 c[M, N] = bf16(a) · bf16(b) with f32 accumulation
(fucina/codegen/gemm_bf16.py: operands rounded to nearest even when packed, bf16 denormals
read as zero, vdpbf16ps where the host has it, its bit-exact emulation elsewhere). Two
launches (per k slice, for a long k): pack A into pair panels, then a grid of (M-block,
N-block) tiles fixed by the problem size, each packing its panels of b into L1 as it goes —
bitwise identical for any thread count. M blocks are large (b, the frozen weight, is read
once per M block) and N blocks small enough that there are several chunks for the threads.
The tile kernel can also add the product to out and a LoRA delta in its stores (accumulate,
rank_add: a bf16 projection with its adapter in one GEMM, forward and dx).
"""
from __future__ import annotations

from ..codegen import gemm_bf16 as g
from ..codegen import kernels
from ..errors import DTypeError, InvalidArgument, InvalidArgumentType, ShapeMismatch
from . import elementwise as ew
from . import matmul as mm
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
    n_chunks, cost, tail); `words` is the size of a slice of A's panels; `partial` the floats
    of the partial sums' place when C is added to over several KC blocks; `ranked` whether
    the tile kernel adds a rank_add term."""

    __slots__ = ("shape", "words", "slices", "partial", "ranked")


def _check(a, b):
    op = "matmul_bf16"
    if not isinstance(a, RawTensor) or not isinstance(b, RawTensor):
        raise InvalidArgumentType(f"{op}: expected RawTensor operands, got {type(a).__name__} and "
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


def host_has_dot() -> tuple[bool, str]:
    """(this CPU has vdpbf16ps, its LLVM name): without it the bf16 products run the
    instruction's exact emulation, at the f32 GEMM's rate (the memory of bf16 operands, no
    speed-up over f32)."""
    from ..codegen.target import host

    return g.native(), host().cpu


def gemm_bf16(ctx, a: RawTensor, b: RawTensor, native: bool | None = None,
              out: RawTensor | None = None, accumulate: bool = False,
              rank_add=None) -> RawTensor:
    """c[M, N] = bf16(a[M, K]) · bf16(b[K, N]), f32 sums over k pairs in increasing order.
    native: None = the instruction when the host has it; False = the emulation (tests).
    out: the contiguous f32 [M, N] to write (accumulate=True: out += the product, each sum
    added to out's value once). rank_add (x [M, r], y [r, N], s): then c += s·(x·y) exactly
    as matmul.gemm(x, y, out=c, accumulate=True, scale=s) run after this one — in the tile
    kernel's stores (a LoRA delta on a bf16 projection, forward, and its dx), or as that pass
    when k runs in slices."""
    ranked = rank_add is not None
    key = (a.lay, b.lay, native, accumulate, ranked)
    try:
        plan = _plans[key]
    except (KeyError, AttributeError):
        _check(a, b)
        plan = _plans[key] = _make_plan(a, b, g.native() if native is None else native,
                                        accumulate, ranked)
    if ctx.closed:
        ctx.check_open("matmul_bf16")
    if out is None:
        if accumulate:
            raise InvalidArgument("matmul_bf16: accumulate=True needs out, the tensor to add to")
        out = ctx.empty(plan.shape)
    else:
        _check_out(a, b, out, plan.shape)
    rargs = mm.rank_args(out, rank_add) if ranked else ()   # checked before any pass runs
    if len(plan.slices) > 1 and (accumulate or ranked):
        # k in slices continues its sums in C: the product, then its addition, then the rank
        # term, each its own pass (the same roundings)
        if accumulate:
            c = gemm_bf16(ctx, a, b, native)
            ew.run(ctx, "add", "f32", plan.shape, (out, c), out=out)
            del c
        else:
            gemm_bf16(ctx, a, b, native, out=out)
        if ranked:
            x, y, scale = rank_add
            mm.gemm(ctx, x, y, out=out, accumulate=True, scale=scale)
        return out
    extra = ()
    if accumulate:
        p = ctx.empty((plan.partial,), "f32") if plan.partial else out
        extra = (p.addr,)
    extra += rargs
    s = ctx.empty((plan.words,), "f32")
    sp = s.addr
    sa, sb = a.strides[1] * 4, b.strides[0] * b.lay.itemsize
    for k0, (addr, n, cost, tail), (taddr, tn, tcost, ttail) in plan.slices:
        ctx.launch(addr, n, cost, a.addr + k0 * sa, sp, *tail)
        ctx.launch(taddr, tn, tcost, sp, b.addr + k0 * sb, out.addr, *ttail, *extra)
    del s
    return out


def _check_out(a, b, out, shape):
    op = "matmul_bf16"
    if not isinstance(out, RawTensor) or out.dtype != "f32" or out.shape != shape \
            or not out.is_contiguous():
        raise ShapeMismatch(f"{op}: operand out: expected a contiguous f32 tensor of shape "
                            f"{shape}, got {getattr(out, 'dtype', type(out).__name__)} "
                            f"{getattr(out, 'shape', '')}")
    if out.buf is a.buf or out.buf is b.buf:
        raise InvalidArgument(f"{op}: operand out: expected a buffer distinct from a's and b's")


def _mode(rows, K, s_w, s_k):
    if s_w == 1 or rows == 1:
        return "wvec"
    return "kvec" if s_k == 1 or K == 1 else "any"


def _kc(K, native):
    """K in equal even blocks of at most the layout's KC (a short last block would cost its
    own pass)."""
    c = -(-K // -(-K // g.kc_of(native)))
    return c + c % 2


def _pack(dtype, width, rows, K, s_w, s_k, kc, native):
    """One gemm_bf16_pack launch: (addr, chunks, cost, tail), words written (the emulation's
    layout holds two per pair)."""
    npan = -(-rows // width)
    per, groups = pack_groups(npan, width * min(K, kc), -(-K // kc))
    addr = kernels.get(g.GemmBf16PackKey(dtype, width, _mode(rows, K, s_w, s_k), not native))
    words = npan * width * (-(-K // 2)) * g.pair_words(not native)
    return (addr, -(-K // kc) * groups, npan * width * K * 4,
            (rows, K, s_w, s_k, kc, npan, per, groups)), words


def _make_plan(a, b, native: bool, accumulate: bool = False, ranked: bool = False) -> Plan:
    plan = Plan()
    M, K = a.shape
    N = b.shape[1]
    plan.shape = (M, N)
    MR, NR = g.mr(), g.nr()
    # a long k in slices (even, whole KC blocks), each packing and multiplying its share and
    # continuing the sums the previous one left in C: the bits of one pass, and the slice of
    # A stays in cache across the N blocks instead of streaming from memory once per N block
    KS = K if K <= 2 * K_SLICE else K_SLICE
    kc = _kc(KS, native)
    fused = KS == K      # one slice: the tile kernel adds to C and the rank term itself
    plan.ranked = ranked and fused
    plan.partial = M * N if fused and accumulate and K > kc else 0
    s_bk, s_bn = b.strides
    mpn, npn = -(-M // MR), -(-N // NR)
    MC = blocks(mpn, MC_PANELS) * MR
    NC = min(blocks(npn, NC_PANELS), -(-npn // N_CHUNKS)) * NR
    nmb, nnb = -(-M // MC), -(-N // NC)
    addr = kernels.get(g.GemmBf16TileKey(MR, g.NR_VECS, g.UNROLL, native, b.dtype,
                                         _mode(N, K, s_bn, s_bk), M * N >= PF_C_MIN,
                                         accumulate and fused, plan.ranked))
    plan.slices = []
    plan.words = 0
    for k0 in range(0, K, KS):
        ks = min(KS, K - k0)
        pack, words = _pack("f32", MR, M, ks, a.strides[0], a.strides[1], kc, native)
        plan.words = max(plan.words, words)
        plan.slices.append((k0, pack, (addr, nmb * nnb, M * N * ks,
                                       (M, N, ks, kc, MC, NC, nmb, nnb, int(N > M), s_bk, s_bn,
                                        int(k0 > 0)))))
    return plan
