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

Where the CPU has AMX (Sapphire Rapids and later) and the OS grants this process its tile
state, the products run on tiles instead (fucina/codegen/gemm_bf16_amx.py): the same
roundings of the operands, f32 sums grouped by tile (32 k a group) — bits of their own, the
same at any thread count. Three launches: A's tiles, B's pair panels, then the C blocks (a
k longer than 2048 runs in slices, the tile kernel packing each slice's panels of B itself);
a bf16 weight with unit stride along k (the forward x · wᵀ of a frozen [out, in] weight) is
read in place as the A side of Cᵀ = w · xᵀ, its block turned as it is stored.
"""
from __future__ import annotations

import functools
import platform
import sys

from ..codegen import gemm_bf16 as g
from ..codegen import gemm_bf16_amx as amx
from ..codegen import kernels
from ..errors import DTypeError, InvalidArgument, InvalidArgumentType, ShapeMismatch
from . import elementwise as ew
from . import matmul as mm
from .matmul import PACK_CHUNK, PF_C_MIN, blocks, pack_groups
from .raw import RawTensor

MC_PANELS = 48   # at most this many MR panels of A per tile (MC x KC of A, 688 KiB, stays in L2)
NC_PANELS = 8    # at most this many NR panels of B per tile ...
N_CHUNKS = 8     # ... and fewer when that leaves N with fewer blocks than this
K_SLICE = 1024   # a k longer than twice this runs in slices of this many (even, a multiple of
                 # KC): the head's [1024, 49152] x [49152, 576] product 345 -> ~370 GFLOP/s
ENGINES = ("amx", "dot", "emulated")   # AMX tiles, vdpbf16ps, vdpbf16ps's FMA emulation
AMX_NC = 256         # at most this many columns of B in an AMX chunk ...
AMX_CHUNKS = 8       # ... and rows in blocks small enough for this many chunks
AMX_A_BYTES = 1 << 20   # at most this many bytes of A tiles in a chunk (they stay in L2)
AMX_LONG_K = 64      # a k of more than this many tiles (of 32) runs in slices of ...
AMX_K_SLICE = 16     # ... this many (a 32-column panel of B, 32 KiB, stays in L1 across A's
                     # rows; slices at K = 1536 cost 16 %: [256, 1536] x [1536, 576] 758 -> 633)
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


@functools.lru_cache(maxsize=None)
def amx_granted() -> bool:
    """The CPU has AMX bf16 tiles and Linux lets this process use them: it asks each process
    to request the tile state first (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, 0x1023 and
    18; a tile instruction without it is a fatal signal), once, for every thread."""
    if not amx.supported() or sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0


def host_engine() -> tuple[str, str]:
    """(the engine bf16 products run on here, the CPU's LLVM name): "amx" (tiles), "dot"
    (vdpbf16ps), or "emulated" — vdpbf16ps's exact emulation at the f32 GEMM's rate (the
    memory of bf16 operands, no speed-up over f32)."""
    from ..codegen.target import host

    return ("amx" if amx_granted() else "dot" if g.native() else "emulated"), host().cpu


def _engine(engine):
    if engine is None:
        return host_engine()[0]
    if engine not in ENGINES:
        raise InvalidArgument(f"matmul_bf16: engine: expected one of {', '.join(ENGINES)} or "
                              f"None, got {engine!r}")
    if engine == "amx" and not amx_granted() or engine == "dot" and not g.native():
        raise InvalidArgument(f"matmul_bf16: engine: this host cannot run {engine!r} "
                              f"(it runs {host_engine()[0]!r})")
    return engine


def gemm_bf16(ctx, a: RawTensor, b: RawTensor, engine: str | None = None,
              out: RawTensor | None = None, accumulate: bool = False,
              rank_add=None) -> RawTensor:
    """c[M, N] = bf16(a[M, K]) · bf16(b[K, N]) with f32 sums: over k pairs in increasing
    order ("dot", "emulated": the same bits), or over tiles of 32 k ("amx").
    engine: None = the host's fastest (host_engine); a name forces one (tests).
    out: the contiguous f32 [M, N] to write (accumulate=True: out += the product, each sum
    added to out's value once). rank_add (x [M, r], y [r, N], s): then c += s·(x·y) exactly
    as matmul.gemm(x, y, out=c, accumulate=True, scale=s) run after this one — in the tile
    kernel's stores (a LoRA delta on a bf16 projection, forward, and its dx), or as that pass
    when k runs in slices."""
    ranked = rank_add is not None
    key = (a.lay, b.lay, engine, accumulate, ranked)
    try:
        plan = _plans[key]
    except (KeyError, AttributeError):
        _check(a, b)
        eng = _engine(engine)
        plan = _plans[key] = (_amx_plan(a, b, accumulate, ranked) if eng == "amx" else
                              _make_plan(a, b, eng == "dot", accumulate, ranked))
    if ctx.closed:
        ctx.check_open("matmul_bf16")
    if out is None:
        if accumulate:
            raise InvalidArgument("matmul_bf16: accumulate=True needs out, the tensor to add to")
        out = ctx.empty(plan.shape)
    else:
        _check_out(a, b, out, plan.shape)
    rargs = mm.rank_args(out, rank_add) if ranked else ()   # checked before any pass runs
    if isinstance(plan, AmxPlan):
        return _run_amx(ctx, plan, a, b, out, rargs)
    if len(plan.slices) > 1 and (accumulate or ranked):
        # k in slices continues its sums in C: the product, then its addition, then the rank
        # term, each its own pass (the same roundings)
        if accumulate:
            c = gemm_bf16(ctx, a, b, engine)
            ew.run(ctx, "add", "f32", plan.shape, (out, c), out=out)
            del c
        else:
            gemm_bf16(ctx, a, b, engine, out=out)
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


# ---------------------------------------------------------------------------------------------
# AMX

class AmxPlan:
    """The launches of one layout pair on tiles: A's tiles (None: read in place), B's pair
    panels (None: packed by the tile kernel, whose extra arguments are `btail`), the C
    blocks, each (addr, n_chunks, cost, tail); the operands' sides (`swapped`:
    b is the A side, a the B side, C turned as stored) and the scratch words of each pack."""

    __slots__ = ("shape", "swapped", "apack", "bpack", "tile", "awords", "bwords", "partial",
                 "btail")


def _amx_plan(a, b, accumulate: bool, ranked: bool) -> AmxPlan:
    plan = AmxPlan()
    M, K = a.shape
    N = b.shape[1]
    plan.shape = (M, N)
    s_am, s_ak = a.strides
    s_bk, s_bn = b.strides
    G = -(-K // amx.TILE_K)
    Kp = G * amx.TILE_K
    # a bf16 b whose k is unit stride is a frozen weight as held: the A side, read in place
    plan.swapped = b.dtype == "bf16" and s_bk == 1 and K % amx.TILE_K == 0 \
        and N % 16 == 0
    if plan.swapped:
        rows, cols = N, M                          # A side b^T [N, K], B side a^T [K, M]
        bside = (a.dtype, M, s_am, s_ak)
        plan.apack, plan.awords = None, 0
        s_a = s_bn
    else:
        rows, cols = M, N
        bside = (b.dtype, N, s_bn, s_bk)
        npan = -(-M // 16)
        per, groups = pack_groups(npan, 16 * Kp, 1)
        addr = kernels.get(amx.GemmBf16RowsKey(a.dtype, "kvec" if s_ak == 1 else "any"))
        plan.apack = (addr, groups, npan * 16 * Kp, (M, K, s_am, s_ak, G, npan, per))
        plan.awords = npan * 16 * Kp // 2
        s_a = 0
    dt, width, s_w, s_k = bside
    mode = _mode(width, K, s_w, s_k)
    # a long k in slices, the sums of the earlier ones waiting in a place of their own
    KS = G if G <= AMX_LONG_K else AMX_K_SLICE
    long_k = KS < G
    # streaming (a long k): the tile kernel packs each panel of a slice itself, once
    inline = long_k and mode != "any" and KS <= amx.SLICE_TILES
    if inline:
        plan.bpack, plan.bwords, plan.btail = None, 0, (K, s_k, s_w)
    else:
        (plan.bpack, plan.bwords), plan.btail = _amx_bpack(bside, mode, K, Kp), ()
    plan.partial = 0 if KS == G else -(-rows // amx.BLOCK) * amx.BLOCK * \
        (-(-cols // amx.BLOCK) * amx.BLOCK)
    # chunks: B in column blocks of at most AMX_NC, A's rows in blocks of 32 small enough for
    # AMX_CHUNKS chunks in all and for a slice of their tiles to stay in L2. A k in slices
    # streams both operands from memory once per chunk of the other's: two column halves, A's
    # rows whole (the head's dx [256, 49152] x [49152, 576]: 243 -> 106 MB read, its tiles at
    # 1 thread 553 -> 737 GFLOP/s with slices of 16 tiles, whose B panel fits L1)
    mblocks = -(-rows // amx.BLOCK)
    cap = max(1, AMX_A_BYTES // (2 * KS * amx.TILE_K * amx.BLOCK))
    nnb = min(2, -(-cols // amx.BLOCK)) if long_k else -(-cols // AMX_NC)
    NC = -(-(-(-cols // nnb)) // amx.BLOCK) * amx.BLOCK
    nnb = -(-cols // NC)
    want = 1 if long_k else -(-AMX_CHUNKS // nnb)
    MC = min(cap, -(-mblocks // want)) * amx.BLOCK
    nmb = -(-rows // MC)
    key = amx.GemmBf16AmxKey(plan.apack is None, plan.swapped, accumulate, ranked,
                             mode if inline else "", dt)
    plan.tile = (kernels.get(key), nmb * nnb, M * N * K,
                 (rows, cols, G, s_a, MC, NC, nmb, nnb, int(cols > rows), N, KS))
    return plan


def _amx_bpack(bside, mode, K, Kp):
    """(the launch packing B's pair panels, the words they take) for the B side (dtype,
    width, s_w, s_k) laid out as `mode`."""
    dt, width, s_w, s_k = bside
    npan = -(-width // amx.BLOCK)
    if mode == "wvec":       # rows of b in order (a frozen weight's dx: no page walk a row)
        prows = Kp // 2
        per = max(1, min(prows, PACK_CHUNK // (npan * amx.BLOCK)))
        addr = kernels.get(amx.GemmBf16PairRowsKey(dt))
        pack = (addr, -(-prows // per), npan * amx.BLOCK * Kp, (width, K, s_k, prows, npan, per))
    else:
        per, groups = pack_groups(npan, amx.BLOCK * Kp, 1)
        addr = kernels.get(g.GemmBf16PackKey(dt, amx.BLOCK, mode, False, True))
        pack = (addr, groups, npan * amx.BLOCK * Kp, (width, K, s_w, s_k, Kp, npan, per, groups))
    return pack, npan * amx.BLOCK * Kp // 2


def _packed(ctx, pack, words, src):
    """(scratch, address) of one side's tiles: src itself when its plan has no pack launch."""
    if pack is None:
        return None, src.addr
    s = ctx.empty((words,), "f32")
    addr, n, cost, tail = pack
    ctx.launch(addr, n, cost, src.addr, s.addr, *tail)
    return s, s.addr


def _run_amx(ctx, plan: AmxPlan, a, b, out, rargs):
    aside, bside = (b, a) if plan.swapped else (a, b)
    bp, b_addr = _packed(ctx, plan.bpack, plan.bwords, bside)
    ap, a_addr = _packed(ctx, plan.apack, plan.awords, aside)
    part = ctx.empty((plan.partial,), "f32") if plan.partial else None
    addr, n, cost, tail = plan.tile
    ctx.launch(addr, n, cost, a_addr, b_addr, out.addr, *tail,
               part.addr if part is not None else 0, *plan.btail, *rargs)
    del ap, bp, part
    return out
