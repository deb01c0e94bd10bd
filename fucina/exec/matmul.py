"""Matrix multiplication at the exec layer: validate once, plan once per layout, launch.

`gemm(ctx, a, b)` views a as [*batch, M, K] and b as [*batch, K, N] with any element strides
(a transposed operand is only swapped strides: packing reads every orientation) and returns a
contiguous f32 [*batch, M, N].

Paths (codegen/gemm.py), chosen from the shapes and strides alone:
  packed  — pack A and B into panels (one launch each, parallel over panels; a batch-broadcast
            operand is packed once), then one launch over a grid of (batch, M-block, N-block)
            tiles of C. The grid is a function of the problem size only.
            "packed direct-b" when A is one M block (M <= DIRECT_MC_ROWS) and b has a unit
            stride (along n, or along k: b = Wᵀ): only A is packed, the tile kernel reads b's
            panels in place (gemm_tile_direct) — the same bits as packing both.
            Beside packed B, a row-major A of one batch is read in place instead (its MR
            rows stream from cache as well as its panels would; measured 2-10 % faster for
            M >= 512): only B is packed, the same bits.
  rowvec  — up to RV_ROWS rows of C with K <= RV_ROWS_K and b contiguous along n (x · W, the
            dx = g · W of a frozen weight), or tiny problems: no packing; A's rows read in
            place, b's rows prefetched ahead of the first row group streaming them.
  dot     — few rows (or few columns) of C with a and b contiguous along k (x · Wᵀ for one
            token, a skinny output): dot products vectorised along k.
Every path fixes the order of each element's k-sum by the shape, so a result is bitwise
identical for any thread count. Different shapes may take different paths.

A plan (kernel addresses, chunk counts and the static argument tails) is memoised on the
operands' layouts, so a repeated call costs a dict lookup, a pool allocation and the launches.
"""
from __future__ import annotations

import math
import struct

from ..codegen import gemm as g
from ..codegen import kernels
from ..codegen.irutil import ITEMSIZE
from ..codegen.target import host
from ..errors import DTypeError, InvalidArgument, InvalidArgumentType, ShapeMismatch
from .raw import RawTensor, numel

MC_ROWS = 64             # at most this many rows of A per tile, whole MR panels (MC x KC of A
                         # stays in L2; a prompt of up to 60 tokens is one M block, so the
                         # quantized tile decodes each weight panel once: with AVX2's 6-row
                         # panels 8 of them made 48 rows, and a 55-token prefill product 12-16 %
                         # slower on Zen 3)
NC_PANELS = 8            # at most this many NR panels of B per tile
DIRECT_A = True          # a row-major A read in place by the tile kernels (no pack pass)
DIRECT_B = True          # b read in place by gemm_tile_direct (no pack pass) when A makes at
DIRECT_MAX_MB = 1        # most this many M blocks (each derives its b panels anew) of at most
DIRECT_MC_ROWS = 288     # this many rows (MC x KC of A stays in L2); then an A of at most
DIRECT_MAX_A = 1 << 20   # this many floats is re-read from cache per N block, and N blocks get
DIRECT_MIN_CHUNKS = 8    # fewer panels until there are this many (thread balance); else two
PACK_CHUNK = 1 << 17     # floats packed per chunk (one KC block of a group of panels)
SMALL_CHUNK = 1 << 19    # multiply-adds per chunk of the direct kernels (a few µs of work)
SMALL_M = 4              # at most this many rows of C go the direct way (rowvec / dot)
DOT_N = 8                # at most this many columns of C go the dot way when K >= DOT_MIN_K,
DOT_MIN_K = 16           # twice as many when K >= DOT_COPY_MIN_K; a b that is not contiguous
DOT_COPY_MIN_K = 256     # along k is copied so first when N <= DOT_N and K >= DOT_COPY_MIN_K
# register tiles of the direct kernels, by the vector registers a kernel keeps live (32 zmm
# with AVX-512, 16 ymm with AVX2): rowvec up to rv_rn vectors across and rv_acc accumulators,
# or for one or two rows of C rv_wide / rows vectors across; dot up to dot_rn columns and
# dot_acc accumulators. The 32-register tiles spill on 16 registers: on Zen 3, 1 thread, the
# rowvec [256, 576] x [576, 576] 21 -> 72 GFLOP/s (6 x 2 ymm), dot [256, 576] x [576, 8]ᵀ
# 33 -> 70 GFLOP/s (3 x 4 columns). The tile shapes group outputs only: each one's FMA chain
# (its bits) is fixed by K.
TILES = {32: {"rv_rn": 4, "rv_acc": 16, "rv_wide": 16, "dot_rn": 8, "dot_acc": 24},
         16: {"rv_rn": 2, "rv_acc": 12, "rv_wide": 12, "dot_rn": 4, "dot_acc": 12}}
RV_MAX_B = 1 << 18       # b up to this many elements (1 MiB f32, L2-sized): rowvec, A unpacked
RV_COLS_K = 16           # rowvec with K at most this: column blocks fastest (C row by row)
RV_ROWS, RV_ROWS_K = 512, 2048  # up to this many rows of C, K up to this, b unit-stride along
                                # n: rowvec, whatever b's size (each K x rn*W block of b stays in
                                # L2 for the row groups; A's 4 rows in L1). Against packed
                                # direct-b, b not cached, 1 / 2 threads (GFLOP/s): [48, 576] x
                                # [576, 1536] 92 -> 101 / 177 -> 196, [256, 1536] x [1536, 576]
                                # 106 -> 110 / 180 -> 221, [512, 576] x [576, 1536] 105 -> 113 /
                                # 217 -> 224; at 1024 rows packed is as fast
INTEL_ROWS, INTEL_WORK = 32, 1 << 20   # rowvec on Intel AVX-512 only up to this many rows of C
                                      # or multiply-adds (_rowvec_pays)
AVX2_ROWS, AVX2_BIG_ROWS = 32, 8   # rowvec's bounds with 16 registers (_rowvec_pays): rows
AVX2_NARROW = (128, 256)          # of C with a small b / a big one; N below and M up to these
K_SLICE = 2048           # a longer k runs in slices of this many (a multiple of KC): the
                         # [1024, 49152] x [49152, 576] head product 172 -> 213 GFLOP/s
PF_C_MIN = 1 << 20       # a C of this many floats (4 MiB) or more does not stay cached: each
                         # micro-tile prefetches the next one's lines (the head's logits)

_plans: dict = {}
A, B, C, S, P = range(5)  # pointer bases of a plan step


class Plan:
    """What one layout triple needs: the output shape, scratch sizes and the launches.

    Each step is (addr, n_chunks, cost, ptrs, tail): `ptrs` name the pointer arguments as
    (base, byte offset) with base one of A, B, C, S (scratch), P (partial sums)."""

    __slots__ = ("shape", "kind", "scratch", "partial", "steps", "b_copy", "outer",
                 "direct", "ranked")

    def __init__(self, shape):
        self.shape = shape
        self.direct = None    # (addr, n, cost, tail) when the plan is one launch on (a, b, c)
        self.kind = ""        # packed | rowvec [packed-b] | dot [copied-b] (tests, benchmarks)
        self.ranked = False   # its tile kernels add a rank term (gemm's rank_add) themselves
        self.scratch = 0      # floats
        self.partial = 0      # floats (accumulate with more than one KC block)
        self.steps = []
        self.b_copy = ""      # "nk": b is first copied contiguous as [*batch, N, K]
        self.outer = None     # leading batch axes run in Python: (shape, a strides, b strides)


def _check(op, a, b, out):
    if not isinstance(a, RawTensor) or not isinstance(b, RawTensor):
        raise InvalidArgumentType(f"{op}: expected RawTensor operands, got {type(a).__name__} and "
                                  f"{type(b).__name__}")
    if a.dtype != "f32":
        raise DTypeError(f"{op}: operand a: expected dtype f32, got {a.dtype}")
    if b.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: operand b: expected dtype f32, f16 or bf16, got {b.dtype}")
    if a.rank < 2 or b.rank < 2 or a.rank != b.rank:
        raise ShapeMismatch(f"{op}: expected a [*batch, M, K] and b [*batch, K, N] of equal rank "
                            f">= 2, got shapes {a.shape} and {b.shape}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ShapeMismatch(f"{op}: operand b: expected batch shape {a.shape[:-2]} (a's), "
                            f"got {b.shape[:-2]}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeMismatch(f"{op}: operand b: expected contraction length {a.shape[-1]} "
                            f"(a's last axis), got {b.shape[-2]} (shapes {a.shape}, {b.shape})")
    shape = a.shape[:-1] + b.shape[-1:]
    if out is not None:
        if not isinstance(out, RawTensor):
            raise InvalidArgumentType(f"{op}: operand out: expected a RawTensor, got "
                                      f"{type(out).__name__}")
        if out.dtype != "f32":
            raise DTypeError(f"{op}: operand out: expected dtype f32, got {out.dtype}")
        if out.shape != shape:
            raise ShapeMismatch(f"{op}: operand out: expected shape {shape}, got {out.shape}")
        if not out.is_contiguous():
            raise ShapeMismatch(f"{op}: operand out: expected a contiguous tensor, got strides "
                                f"{out.strides} for shape {out.shape}")
        if out.buf is a.buf or out.buf is b.buf:
            raise InvalidArgument(f"{op}: operand out: expected a buffer distinct from a's and b's")
    return shape


def gemm(ctx, a: RawTensor, b: RawTensor, out: RawTensor | None = None,
         accumulate: bool = False, scale: float = 1.0, rank_add=None) -> RawTensor:
    """c[*batch, M, N] = a[*batch, M, K] · b[*batch, K, N] (f32 accumulate); into `out` if given;
    with accumulate=True, out += a·b — one final rounding per element after the full k-sum.
    scale (an f32 value): each sum is rounded once more as scale·sum before it is stored or
    added — out + scale·(a·b) is then exactly out.add((a·b).scale(scale)), in one pass.
    rank_add (x [M, r], y [r, N], s) for 2-D operands: then c += s·(x·y), exactly as
    gemm(x, y, out=c, accumulate=True, scale=s) run after this one — inside the tile kernels'
    stores where the plan has them (a LoRA delta in its base projection), else that pass."""
    ranked = rank_add is not None
    if ranked and (a.rank != 2 or b.rank != 2):
        raise InvalidArgument(f"matmul: rank_add: expected 2-D operands, got shapes {a.shape} "
                              f"and {b.shape}")
    if 0 in a.lay.shape or 0 in b.lay.shape:
        out = _gemm_empty(ctx, a, b, out, accumulate)
        return out if rank_add is None else _rank_pass(ctx, out, rank_add)
    try:
        plan = _plans[(a.lay, b.lay, None if out is None else out.lay, accumulate, scale, ranked)]
    except (KeyError, AttributeError):
        plan = _new_plan(a, b, out, accumulate, scale, ranked)
    if ctx.closed:
        ctx.check_open("add_dot" if accumulate else "matmul")
    if out is None:
        out = ctx.empty(plan.shape)
    elif out.buf is a.buf or out.buf is b.buf:
        raise InvalidArgument(f"{'add_dot' if accumulate else 'matmul'}: operand out: expected a "
                              f"buffer distinct from a's and b's")
    if plan.direct is not None:        # one launch, no scratch: the common small case
        addr, n, cost, tail = plan.direct
        ctx.launch(addr, n, cost, a.addr, b.addr, out.addr, *tail)
    elif plan.outer is None:
        run_plan(ctx, plan, a, b, out, 0, 0, 0, _rank_args(plan, out, rank_add))
    else:
        oshape, ast, bst = plan.outer
        inner = numel(plan.shape[len(oshape):])
        for idx in range(numel(oshape)):
            ao = bo = 0
            rem = idx
            for d in range(len(oshape) - 1, -1, -1):
                rem, i = divmod(rem, oshape[d])
                ao += i * ast[d]
                bo += i * bst[d]
            run_plan(ctx, plan, a, b, out, ao * 4, bo * b.lay.itemsize, idx * inner * 4)
    if ranked and not plan.ranked:
        _rank_pass(ctx, out, rank_add)
    return out


def _rank_args(plan, out, rank_add) -> tuple:
    """The tile kernels' rank_add block (emit_tile), checked; () when the plan has none."""
    return rank_args(out, rank_add) if plan.ranked else ()


def rank_args(out, rank_add) -> tuple:
    """rank_add = (x, y, s) checked against out [M, N], as the kernels' argument block."""
    x, y, s = rank_add
    M, N = out.shape
    if x.shape[0] != M or y.shape[1] != N or x.shape[1] != y.shape[0] or x.shape[1] < 1:
        raise ShapeMismatch(f"matmul: rank_add: expected x [{M}, r] and y [r, {N}] with r >= 1, "
                            f"got {x.shape} and {y.shape}")
    if x.dtype != "f32" or y.dtype != "f32" or x.strides[1] != 1 or y.strides[1] != 1:
        raise InvalidArgument("matmul: rank_add: expected f32 x and y with unit column strides")
    if out.buf is x.buf or out.buf is y.buf:
        raise InvalidArgument("matmul: rank_add: expected x and y in buffers distinct from out's")
    return (x.addr, y.addr, x.strides[0], y.strides[0], x.shape[1], _f32_bits("matmul", s))


def _f32_bits(op, scale) -> int:
    """scale's f32 bit pattern, for a finite float that is an f32 value."""
    if not isinstance(scale, float) or not math.isfinite(scale) or \
            struct.unpack("<f", struct.pack("<f", scale))[0] != scale:
        raise InvalidArgument(f"{op}: expected scale a finite f32 value (a float), got {scale!r}")
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def _rank_pass(ctx, out, rank_add):
    """The rank term as its own pass over out (plans whose kernels do not add it)."""
    x, y, s = rank_add
    return gemm(ctx, x, y, out=out, accumulate=True, scale=s)


def _gemm_empty(ctx, a, b, out, accumulate):
    """No launch: an empty result, or (K == 0, a sum of no products) zeros, or out unchanged
    when accumulating nothing."""
    op = "add_dot" if accumulate else "matmul"
    shape = _check(op, a, b, out)
    if accumulate and out is None:
        raise InvalidArgument(f"{op}: accumulate=True needs out= (the tensor to add to)")
    if ctx.closed:
        ctx.check_open(op)
    if out is None:
        return ctx.empty(shape) if 0 in shape else ctx.full_raw(shape, 0.0)
    if not accumulate and 0 not in shape:
        ctx.full_raw(shape, 0.0, out=out)
    return out


def _new_plan(a, b, out, accumulate, scale, ranked=False) -> "Plan":
    op = "add_dot" if accumulate else "matmul"
    shape = _check(op, a, b, out)
    if accumulate and out is None:
        raise InvalidArgument(f"{op}: accumulate=True needs out= (the tensor to add to)")
    _f32_bits(op, scale)
    plan = _make_plan(a, b, shape, accumulate, scale, ranked)
    _plans[(a.lay, b.lay, None if out is None else out.lay, accumulate, scale, ranked)] = plan
    return plan


def path_of(a: RawTensor, b: RawTensor) -> str:
    """Which path gemm takes for these operands: packed | rowvec [packed-b] | dot [copied-b]
    (+ " outer" when leading batch axes loop here), e.g. for tests and benchmarks."""
    shape = _check("matmul", a, b, None)
    plan = _make_plan(a, b, shape, False, 1.0)
    return plan.kind + (" outer" if plan.outer else "")


def copies_b(a: RawTensor, b: RawTensor) -> bool:
    """gemm(a, b) would first copy b contiguous along k, as [N, K] (a caller holding that
    copy can pass its transposed view instead: the same kernel, the same bits)."""
    plan = _plans.get((a.lay, b.lay, None, False, 1.0, False))
    if plan is None:
        plan = _new_plan(a, b, None, False, 1.0)
    return plan.b_copy == "nk"


def run_plan(ctx, plan, a, b, out, aoff, boff, coff, extra=()):
    base = [a.addr + aoff, b.addr + boff, out.addr + coff, 0, 0]   # a b c s p
    keep = []
    if plan.scratch:
        s = ctx.empty((plan.scratch,), "f32")
        keep.append(s)
        base[3] = s.addr
    if plan.partial:
        p = ctx.empty((plan.partial,), "f32")
        keep.append(p)
        base[4] = p.addr
    if plan.b_copy:
        bc = _copy_b(ctx, b, plan.b_copy)
        keep.append(bc)
        base[1] = bc.addr
    launch = ctx.launch
    for addr, n, cost, ptrs, tail in plan.steps:   # extra: read by the tile kernels only
        launch(addr, n, cost, *[base[r] + o for r, o in ptrs], *tail, *extra)
    del keep


def _copy_b(ctx, b, order):
    """A skinny b[*batch, K, N] copied contiguous as [*batch, N, K] (order "nk": the dot path
    wants k unit-stride)."""
    from . import elementwise as ew

    r = b.rank
    src = b.permute(tuple(range(r - 2)) + (r - 1, r - 2))
    return ew.run(ctx, "copy", b.dtype, src.shape, [src])


# ---------------------------------------------------------------------------------------------
# planning

def _coalesce_batch(shape, strides_list):
    """Merge batch axes that every operand (and the contiguous output) walks in step."""
    from .elementwise import coalesce

    if not shape or numel(shape) == 1:
        return (), [() for _ in strides_list]
    cs, cst = coalesce(shape, strides_list)
    return cs, cst


def _make_plan(a, b, shape, accumulate, scale, ranked=False) -> Plan:
    plan = Plan(shape)
    M, K = a.shape[-2:]
    N = b.shape[-1]
    bshape = a.shape[:-2]
    cstr = tuple(st * M * N for st in _contig(bshape))
    bs, (ast, bst, _) = _coalesce_batch(bshape, [a.strides[:-2], b.strides[:-2], cstr])
    if len(bs) > 3:
        plan.outer = (bs[:-3], ast[:-3], bst[:-3])
        bs, ast, bst = bs[-3:], ast[-3:], bst[-3:]
    nbatch = numel(bs)
    while len(bs) < 3:
        bs, ast, bst = (1,) + bs, (0,) + ast, (0,) + bst
    s_am, s_ak = a.strides[-2:]
    s_bk, s_bn = b.strides[-2:]
    unit_n = s_bn == 1 or N == 1
    unit_ka = s_ak == 1 or K == 1
    unit_kb = s_bk == 1 or K == 1
    args = (b.dtype, M, N, K, bs, ast, nbatch, accumulate, scale)
    one = nbatch == 1 and plan.outer is None
    if M <= SMALL_M and unit_n:
        _plan_rowvec(plan, (s_am, s_ak), (s_bk, s_bn), bst, *args, ranked=ranked and one)
    elif M <= SMALL_M and unit_ka and unit_kb:
        _plan_small(plan, "dot", None, (s_am, 1, 1, s_bn), bst, *args)
    elif unit_ka and unit_kb and ((N <= DOT_N and K >= DOT_MIN_K) or
                                  (N <= 2 * DOT_N and K >= DOT_COPY_MIN_K)):
        _plan_small(plan, "dot", None, (s_am, 1, 1, s_bn), bst, *args)
    elif unit_ka and N <= DOT_N and K >= DOT_COPY_MIN_K and plan.outer is None:
        # b has only N <= DOT_N columns: copy it k-contiguous, [*batch, N, K], first
        plan.b_copy = "nk"
        _plan_small(plan, "dot", None, (s_am, 1, 1, K), tuple(st * N * K for st in _contig(bs)),
                    *args)
        plan.kind = "dot copied-b"
    elif _rowvec_pays(M, N, K, unit_n):
        _plan_rowvec(plan, (s_am, s_ak), (s_bk, s_bn), bst, *args, ranked=ranked and one)
    else:
        plan.ranked = ranked and one
        _plan_packed(plan, (s_am, s_ak), (s_bk, s_bn), bst, *args)
    if (not plan.ranked and len(plan.steps) == 1 and not plan.scratch and not plan.partial and not plan.b_copy
            and plan.outer is None):
        addr, n, cost, ptrs, tail = plan.steps[0]
        if ptrs == ((A, 0), (B, 0), (C, 0)):
            plan.direct = (addr, n, cost, tail)
    return plan


def _contig(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _rowvec_tile(M, N):
    """(rm rows, rn vectors) of the rowvec tile: up to rv_acc accumulators (tiles()); a wide
    strip of b for one or two rows of C (GEMV reads long contiguous pieces of each row of b)."""
    W, t = g.lanes(), tiles()
    nv = -(-N // W)
    if M <= 2:
        rn = min(nv, t["rv_wide"] // M)
        return M, rn
    rn = min(t["rv_rn"], nv)
    return min(M, max(1, t["rv_acc"] // rn)), rn


def mc_panels() -> int:
    """MR panels of A per tile (MC_ROWS)."""
    return max(1, MC_ROWS // g.mr())


def tiles() -> dict:
    """This host's register tiles of the direct kernels (TILES)."""
    return TILES[host().vector_regs]


def _rowvec_pays(M, N, K, unit_n) -> bool:
    """rowvec rather than the packed path, past SMALL_M rows: a b small enough for L2
    (K·N <= RV_MAX_B), or one contiguous along n with up to RV_ROWS rows of C and K up to
    RV_ROWS_K. With 16 registers rowvec's 6 x 2 tile reloads b from L2 and spills A's row
    pointers, and the packed micro-kernel wins wherever packing A pays: there rowvec keeps a
    small b with M <= AVX2_ROWS or a narrow one (AVX2_NARROW), a big b with M <=
    AVX2_BIG_ROWS. Zen 3, 1 thread, GFLOP/s rowvec -> packed direct-b: [256, 576] x [576, 576]
    72 -> 89, [48, 576] x [576, 1536] 60 -> 82, [256, 8] x [8, 576] 29 -> 53; packed loses at
    [64, 64] x [64, 64] 61 -> 39, [256, 576] x [576, 96] 75 -> 65."""
    small = K * N <= RV_MAX_B
    big = M <= rowvec_rows() and K <= RV_ROWS_K and unit_n
    if host().vector_regs >= 32 and host().amd:
        return small or big
    if host().vector_regs >= 32:
        # Intel's two 512-bit FMA pipes outrun rowvec's reloads of b from L2 past a few dozen
        # rows (rowvec_rows): 1 thread, GFLOP/s rowvec -> packed direct-b (an Intel Xeon with
        # AMX): [256, 576] x [576, 1536] 87 -> 119, [256, 1536] x [1536, 576] 95 -> 122, [100,
        # 300] x [300, 200] 75 -> 108, [256, 8] x [8, 576] 68 -> 84; rowvec keeps [16, 256] x
        # [256, 256] 97 / 64, [64, 64] x [64, 64] 86 / 57, [12, 576] x [576, 1536] 64 / 49
        return (small and (M <= INTEL_ROWS or M * N * K <= INTEL_WORK)) or big
    narrow = N < AVX2_NARROW[0] and M <= AVX2_NARROW[1]
    return (small and (M <= AVX2_ROWS or narrow)) or big


def rowvec_rows() -> int:
    """Rows of C up to which rowvec takes a b of any size (contiguous along n) on this host."""
    if host().vector_regs < 32:
        return min(RV_ROWS, AVX2_BIG_ROWS)
    return RV_ROWS if host().amd else min(RV_ROWS, INTEL_ROWS)


def _plan_rowvec(plan, sa, sb, bst, bdt, M, N, K, bs, ast, nbatch, acc, scale, ranked=False):
    """rowvec over b as given (unit stride along n) or packed first into column blocks;
    ranked: its kernel adds gemm's rank_add term in its stores."""
    W = g.lanes()
    rm, rn = _rowvec_tile(M, N)
    s_bk, s_bn = sb
    plan.ranked = ranked
    if s_bn == 1 or N == 1:
        _plan_small(plan, "rowvec", (rm, rn), (*sa, s_bk, rn * W), bst, bdt, M, N, K, bs, ast,
                    nbatch, acc, scale)
        return
    # pack b into [block][k][rn*W] (one KC block of length K): unit stride along n
    step, npb, size = pack_step(B, bdt, rn * W, N, K, s_bn, s_bk, bs, bst, nbatch, 0, K)
    plan.steps.append(step)
    plan.scratch = size
    blk = -(-N // (rn * W)) * rn * W * K
    pst = (0, 0, 0) if npb == 1 else tuple(st * blk for st in _contig(bs))
    _plan_small(plan, "rowvec", (rm, rn), (*sa, rn * W, rn * W * K), pst, "f32", M, N, K, bs,
                ast, nbatch, acc, scale, b_base=S)
    plan.kind = "rowvec packed-b"


def _plan_small(plan, mode, tile, strides, bst, bdt, M, N, K, bs, ast, nbatch, acc, scale,
                b_base=B):
    W = g.lanes()
    plan.kind = mode
    if mode == "rowvec":
        rm, rn = tile
        ncb = -(-N // (rn * W))
        work = rm * min(N, rn * W) * K
    else:
        t = tiles()
        rn = min(t["dot_rn"], N)
        rm = min(M, max(1, t["dot_acc"] // rn))
        ncb = -(-N // rn)
        work = rm * rn * K
    nrg = -(-M // rm)
    items = nbatch * nrg * ncb
    per = even_chunks(items, max(1, SMALL_CHUNK // max(work, 1)))
    addr = kernels.get(g.GemmSmallKey(bdt, mode, rm, rn, scale, plan.ranked))
    plan.steps.append((addr, -(-items // per), nbatch * M * N * K,
                       ((A, 0), (b_base, 0), (C, 0)),
                       (M, N, K, *strides, bs[1], bs[2], *ast, *bst, int(acc), per, nrg, ncb,
                        nbatch, int(mode == "rowvec" and K <= RV_COLS_K))))


def pack_groups(npan, panel_floats, blocks):
    """(panels per chunk, groups) of a pack launch of npan panels in `blocks` k blocks (and
    batches): about PACK_CHUNK floats per chunk, and an even chunk count where the panels
    allow one, so two threads get equal halves."""
    per = max(1, min(npan, PACK_CHUNK // panel_floats))
    groups = -(-npan // per)
    if blocks * groups % 2 and npan > 1:
        groups = -(-npan // -(-npan // (2 * groups)))
        per = -(-npan // groups)
    return per, groups


def pack_step(src, dtype, width, rows, K, s_w, s_k, bs, bst, nbatch, dst_off, kc=None):
    """One gemm_pack launch (k blocks of kc, default g.KC); returns (step, packed batches,
    floats written)."""
    kc = g.KC if kc is None else kc
    npb = nbatch if any(bst) else 1
    if s_w == 1 or rows == 1:
        mode = "wvec"
    elif s_k == 1 or K == 1:
        mode = "kvec"
    else:
        mode = "any"
    npan = -(-rows // width)
    pad = npan * width
    per, groups = pack_groups(npan, width * min(K, kc), npb * -(-K // kc))
    addr = kernels.get(g.GemmPackKey(dtype, width, mode))
    step = (addr, npb * -(-K // kc) * groups, npb * pad * K * 8, ((src, 0), (S, dst_off)),
            (rows, K, s_w, s_k, kc, npan, per, groups, bs[1], bs[2], *bst, pad * K))
    return step, npb, npb * pad * K


def blocks(n_panels, max_per):
    """Split n_panels into equal-ish blocks of at most max_per panels: panels per block."""
    nblk = -(-n_panels // max_per)
    return -(-n_panels // nblk)


def even_chunks(items, max_per):
    """Items per chunk, at most max_per, for an even chunk count when there are several (two
    threads take contiguous halves: the [256, 576] x [576, 8] adapter product's 37-item
    chunks made 3 chunks, run as 2 + 1)."""
    n = -(-items // max_per)
    if n % 2 and n > 1:
        return -(-items // (n + 1))
    return max_per


def even_blocks(n_panels, max_per):
    """Panels per block, at most max_per, that leave the fewest panels to the busier of two
    threads (the runtime hands each a contiguous half of the chunks, the first the odd one:
    9 blocks of two run as 5 + 4, 10 % slower at 2 threads than 18 of one as 9 + 9 on the
    [256, 576] x [576, 576] product; 28 panels as 10 blocks of three run as 15 + 13, as 14 of
    two as 14 + 14); among equals the largest blocks (fewest chunks)."""
    def busier(per):
        return min(n_panels, (-(-n_panels // per) + 1) // 2 * per)
    return min(range(max(1, min(max_per, n_panels)), 0, -1), key=busier)


def balanced_nc(panels, min_chunks, m_blocks=1):
    """Panels per N block: at most NC_PANELS, fewer until the m_blocks x N-block tiles are
    at least min_chunks where the panels allow, and split evenly for two threads
    (even_blocks)."""
    return even_blocks(panels, min(NC_PANELS, max(1, panels * m_blocks // min_chunks)))


def _plan_packed(plan, sa, sb, bst, bdt, M, N, K, bs, ast, nbatch, acc, scale):
    MR, NR = g.mr(), g.nr()
    Mp = -(-M // MR) * MR
    Np = -(-N // NR) * NR
    # a long k runs in slices of whole KC blocks, each packing and multiplying its share: the
    # packed slice of b is then reused from cache by every M block instead of streaming the
    # whole packed b from memory once per M block. Each slice continues the sums the previous
    # left in Cpart (gemm_tile's flags), so the bits are those of one pass.
    KS = K if K <= K_SLICE or nbatch > 1 else K_SLICE
    s_bk, s_bn = sb
    bmode = "wvec" if s_bn == 1 or N == 1 else "kvec" if s_bk == 1 or K == 1 else "any"
    # b read in place (no pack pass) when A is one M block: every panel of b is then read
    # once, straight from the operand, and A once per N block
    MCd = blocks(Mp // MR, max(1, DIRECT_MC_ROWS // MR)) * MR
    direct = (DIRECT_B and bmode != "any" and -(-M // MCd) <= DIRECT_MAX_MB
              and (nbatch == 1 or bs[:2] == (1, 1)))
    # else a row-major A read in place: its rows stream from cache as well as packed panels
    # do once b is packed (beside direct b it measured no faster in the LoRA step: packed)
    a_rows = DIRECT_A and not direct and nbatch == 1 and sa[1] == 1 and M > 1
    if a_rows:
        a_step, npa, asz = None, 1, 0
    else:
        a_step, npa, asz = pack_step(A, "f32", MR, M, KS, sa[0], sa[1], bs, ast, nbatch, 0)
        asz = -(-asz // 16) * 16
    MC = MCd if direct else blocks(Mp // MR, mc_panels()) * MR
    pf_c = nbatch * M * N >= PF_C_MIN
    nmb = -(-M // MC)
    if direct:
        plan.kind = "packed direct-b"
        plan.scratch = asz
        panels = Np // NR
        if MC * K <= DIRECT_MAX_A:      # A re-read from cache: N blocks enough to balance
            NC = balanced_nc(panels, DIRECT_MIN_CHUNKS) * NR
        else:                           # A from memory: two N blocks (one per thread of two)
            NC = blocks(panels, -(-panels // 2)) * NR
        b_ptr, b_bat = (B, 0), (bst[2] if nbatch > 1 else 0)
        addr = kernels.get(g.GemmTileDirectKey(bdt, bmode, MR, g.NR_VECS, g.UNROLL, pf_c,
                                               scale, plan.ranked))
        extra = (s_bk, s_bn)
    else:
        plan.kind = "packed"
        b_step, npb, bsz = pack_step(B, bdt, NR, N, KS, s_bn, s_bk, bs, bst, nbatch, asz * 4)
        plan.scratch = asz + bsz
        NC = blocks(Np // NR, NC_PANELS) * NR
        b_ptr, b_bat = (S, asz * 4), (0 if npb == 1 else Np * KS)
        addr = kernels.get(g.GemmTileKey(MR, g.NR_VECS, g.UNROLL, pf_c, scale, a_rows,
                                         plan.ranked))
        extra = ()
    nnb = -(-N // NC)
    if acc and K > g.KC:
        plan.partial = nbatch * M * N
    bsize = ITEMSIZE[bdt]
    for k0 in range(0, K, KS):
        ks = min(KS, K - k0)
        last = k0 + ks == K
        if ks != KS:
            if not a_rows:
                a_step = pack_step(A, "f32", MR, M, ks, sa[0], sa[1], bs, ast, nbatch, 0)[0]
            if not direct:
                b_step = pack_step(B, bdt, NR, N, ks, s_bn, s_bk, bs, bst, nbatch, asz * 4)[0]
        if not a_rows:
            plan.steps.append(_from(a_step, k0 * sa[1] * 4))
        if not direct:
            plan.steps.append(_from(b_step, k0 * s_bk * bsize))
        flags = (g.SLICE_ACC if acc else 0) | (g.SLICE_CONT if k0 else 0) | \
            (0 if last else g.SLICE_MORE)
        plan.steps.append((addr, nbatch * nmb * nnb, nbatch * M * N * ks,
                           ((A, k0 * 4) if a_rows else (S, 0),
                            (b_ptr[0], b_ptr[1] + (k0 * s_bk * bsize if direct else 0)),
                            (C, 0), (P if plan.partial else C, 0)),
                           (M, N, ks, g.KC, MC, NC, nmb, nnb,
                            sa[0] if a_rows else 0 if npa == 1 else Mp * KS,
                            b_bat, flags, int(N > M), *extra)))


def _from(step, off):
    """A pack step reading its source `off` bytes further on (a k slice)."""
    addr, n, cost, ((src, o), dst), tail = step
    return addr, n, cost, ((src, o + off), dst), tail
