"""Block-quantized tensors at the exec layer (SPEC R-9): their RawTensor, and encoding and
decoding through the generated kernels of fucina.codegen.quant; the ops that read blocks in
place through fucina.codegen.quant_gemm: the quantized matmul (SPEC A-8), get_rows and the
row-axis concat (SPEC §3.16).

A block spans the innermost axis, so a quantized tensor of shape (..., K) is rows of K / block
elements' worth of whole blocks laid end to end; K must be a nonzero multiple of the block size.
Quantized storage is always contiguous: the kernels see one flat run of blocks.
"""
from __future__ import annotations

import numpy as np

from ..codegen import gemm as g
from ..codegen import kernels
from ..codegen.quant import ENCODABLE, QuantKey
from ..codegen import quant_gemm, quant_q8
from ..codegen.quant_gemm import (QuantCopyKey, QuantGemvKey, QuantInterleaveKey,
                                  QuantRowsKey, QuantTileKey)
from ..errors import DTypeError, IndexOutOfBounds, InvalidShape, ShapeMismatch
from . import elementwise as ew
from . import matmul as mm
from .dtypes import BLOCKS
from .raw import RawTensor, contiguous_layout, numel

DECODE_CHUNK = 1 << 14   # elements per decode chunk
ENCODE_CHUNK = {"q8_0": 1 << 13, "tq2_0": 1 << 13}  # K-quant encoders search scales: 1 KiB-element chunks
ENCODE_DEFAULT = 1 << 10


class BlockRaw(RawTensor):
    """A RawTensor of a block dtype. Offsets count elements, as in every view; the address of
    element `offset` (a multiple of the block size) is that of its block."""

    __slots__ = ()

    def __init__(self, buf, lay, offset, ctx):
        bs, bb = BLOCKS[lay.dtype]
        self.buf, self.lay, self.offset, self.ctx = buf, lay, offset, ctx
        self.addr = buf.addr + offset // bs * bb

    @property
    def n_blocks(self) -> int:
        return self.numel // BLOCKS[self.dtype][0]

    @property
    def strides(self):
        """Element strides mean nothing inside a block: any op that walks a quantized tensor
        element by element (every op but to('f32'), get_rows, concat and the quantized
        matmul) stops here."""
        raise DTypeError(f"this op does not take a {self.dtype} tensor: block-quantized tensors "
                         f"support only .to('f32') (dequantize), get_rows, row-axis concat and "
                         f"use as the right operand of dot; expected a f32/f16/bf16 tensor, got "
                         f"{self.dtype} {self.shape}")

    def view(self, shape, strides, offset=None):
        raise DTypeError(f"view: a {self.dtype} tensor has no strided views; expected a dense "
                         f"f32/f16/bf16 tensor (dequantize with .to('f32') first)")

    def storage_view(self) -> np.ndarray:
        """The raw block bytes, one row of whole blocks per innermost row: (..., row bytes)."""
        shape = self.shape[:-1] + (row_bytes(self.dtype, self.shape[-1]),)
        return np.frombuffer(self.buf, np.uint8, count=self.lay.nbytes,
                             offset=self.addr - self.buf.addr).reshape(shape)

    def to_numpy(self) -> np.ndarray:
        """The dequantized values as float32 (the generated decoder, not numpy)."""
        return decode(self.ctx, self).to_numpy()


class GemvBlockRaw(BlockRaw):
    """A q4_0 / q4_1 / q5_0 / q5_1 weight that also holds its blocks in the gemv's
    interleaved layout (`gemv`, bytes, see interleave). Every op reads the blocks as stored;
    only the gemv (one to GEMV_MAX_ROWS rows of x) reads `gemv`, with the same bits."""

    __slots__ = ("gemv",)

    def __init__(self, source: BlockRaw, gemv: RawTensor):
        super().__init__(source.buf, source.lay, source.offset, source.ctx)
        self.gemv = gemv


def interleaves(w) -> bool:
    """interleave(w) would serve w: a 2-D contiguous q4_0 / q4_1 / q5_0 / q5_1 weight on an
    AVX-512 or AVX2 host."""
    return (isinstance(w, BlockRaw) and w.dtype in quant_gemm.INTERLEAVED and w.rank == 2
            and g.lanes() in (8, 16))


def interleave(ctx, w: BlockRaw) -> GemvBlockRaw:
    """w with a copy of its blocks in the gemv's interleaved layout (codegen/quant_gemm.py,
    _interleaved_blocks): per row, groups of G blocks (4 for q4, 3 for q5) as [G d's]
    [G m's, q4_1 / q5_1][64 bytes: dword j holds the codes of weights j and 16 + j of each
    block g at bits CODE_BITS·(2g + half)], then the last blocks as stored. The copy has
    w's size for q4, 6 % more for q5, written in one pass (QuantInterleaveKey). Decode
    (matvec) steps read it: 30-40 % fewer instructions per block (AVX2: 1.07x the stored
    blocks' one-row gemv for q4, 1.4-1.6x for q5; INTERLEAVED_ROWS)."""
    if not interleaves(w):
        raise DTypeError(f"interleave: expected a 2-D q4_0 / q4_1 / q5_0 / q5_1 weight on an "
                         f"AVX-512 or AVX2 host, got {getattr(w, 'dtype', type(w).__name__)} "
                         f"of rank {getattr(w, 'rank', '?')}")
    N, K = w.shape
    rb = quant_gemm.interleaved_row_bytes(w.dtype, K)
    out = ctx.empty((N * rb,), "bool")
    per = max(1, COPY_CHUNK // rb)
    ctx.launch(kernels.get(QuantInterleaveKey(w.dtype)), -(-N // per), 2 * N * rb, w.addr,
               out.addr, N, K, per)
    return GemvBlockRaw(w, out)


def row_bytes(fmt: str, K: int) -> int:
    bs, bb = BLOCKS[fmt]
    return K // bs * bb


def check_shape(op: str, fmt: str, shape) -> None:
    """The innermost axis must hold a nonzero whole number of blocks."""
    bs = BLOCKS[fmt][0]
    if len(shape) == 0 or shape[-1] == 0 or shape[-1] % bs:
        inner = shape[-1] if shape else "none (a scalar)"
        raise InvalidShape(f"{op}: a {fmt} tensor needs an innermost axis that is a nonzero "
                           f"multiple of {bs}; got shape {tuple(shape)} (innermost {inner})")


def wrap(ctx, buf, shape, fmt: str) -> BlockRaw:
    """A quantized tensor over existing storage (a pooled buffer or a borrowed file mapping)."""
    check_shape("quantized tensor", fmt, shape)
    lay = contiguous_layout(fmt, tuple(shape))
    if buf.nbytes < lay.nbytes:
        raise InvalidShape(f"quantized tensor: {fmt} {tuple(shape)} needs {lay.nbytes} bytes, "
                           f"the storage holds {buf.nbytes}")
    return BlockRaw(buf, lay, 0, ctx)


def empty(ctx, shape, fmt: str) -> BlockRaw:
    check_shape("quantized tensor", fmt, shape)
    t = ctx.empty(tuple(shape), fmt)
    return BlockRaw(t.buf, t.lay, 0, ctx)


def from_bytes(ctx, data, shape, fmt: str) -> BlockRaw:
    """Copy raw ggml block bytes into a new pooled quantized tensor."""
    out = empty(ctx, shape, fmt)
    src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    if src.size != out.lay.nbytes:
        raise InvalidShape(f"quantized tensor: {fmt} {tuple(shape)} takes {out.lay.nbytes} bytes, "
                           f"got {src.size}")
    np.frombuffer(out.buf, np.uint8, count=src.size)[:] = src
    return out


def decode(ctx, q: BlockRaw) -> RawTensor:
    """The f32 tensor of q's values (ggml's dequantize_row_* for its format)."""
    out = ctx.empty(q.shape, "f32")
    n = q.n_blocks
    bs, bb = BLOCKS[q.dtype]
    per = max(1, DECODE_CHUNK // bs)
    ctx.launch(kernels.get(QuantKey(q.dtype, "decode")), -(-n // per), n * (bb + 4 * bs),
               q.addr, out.addr, n, per)
    return out


def encode(ctx, x: RawTensor, fmt: str) -> BlockRaw:
    """x (contiguous f32) quantized to `fmt`, byte for byte as ggml's reference quantizer."""
    if fmt not in ENCODABLE:
        raise DTypeError(f"to: quantizing to {fmt} is not supported; expected one of {ENCODABLE} "
                         f"(every block format decodes)")
    check_shape("to", fmt, x.shape)
    if x.dtype != "f32" or not x.is_contiguous():
        raise DTypeError(f"to: quantizing expects a contiguous f32 tensor, got {x.dtype}")
    out = empty(ctx, x.shape, fmt)
    n = out.n_blocks
    bs, bb = BLOCKS[fmt]
    per = max(1, ENCODE_CHUNK.get(fmt, ENCODE_DEFAULT) // bs)
    # the launch cost (bytes touched) is scaled up: the scale searches are compute-bound
    ctx.launch(kernels.get(QuantKey(fmt, "encode")), -(-n // per), n * (bb + 4 * bs) * 16,
               x.addr, out.addr, n, per)
    return out


# ---------------------------------------------------------------------------------------------
# quantized matmul (SPEC A-8): y[M, N] = x[M, K] · dequant(w[N, K])ᵀ

GEMV_ROWS = 4            # rows of x per gemv launch ...
GEMV_MAX_ROWS = 8        # ... up to this many rows (a launch per 4 rows), the tiled GEMM beyond
GEMV_WORK = 1 << 16      # weights decoded per chunk of a gemv launch
# outputs per gemv item. One row of x: 4 (8 accumulators), not 8 (16 accumulators plus the
# decoded blocks live: probably spilling, not checked in the asm). Measured at one token, one
# thread: q8_0 [49152, 576] 4.2 ms -> 1.9-2.2 ms (13-16 GB/s; numpy reads ~17 GB/s on one
# thread), q4_k [12288, 768] 1.0 ms -> 0.47 ms, the other formats within noise. Cols only
# group outputs: each output's sum order is fixed by K, so the bits do not change. On 8
# lanes (AVX2, 16 registers) 2: with 4 a row's 8 accumulators, x's 4 vectors and the
# decode spill (Zen 3, one thread, q4_1 [1536, 4608]: 7.8 -> 11.8 G weights/s).
GEMV_COLS = {1: 4, 2: 4, 3: 2, 4: 2} if g.lanes() == 16 else {1: 2, 2: 2, 3: 2, 4: 2}
# One row of x on 16 lanes, (format, interleaved) -> outputs per item where 2 beat 4: the
# item's rows of w are as many streams from memory (Zen 4, one thread, in-process A/B:
# q8_0 [49152, 576] / [65536, 640] from memory 1.22-1.29x, [32768, 896] 1.28x, in cache
# [1536, 576] 1.07x; interleaved q5_0 [4864, 896] 1.16x, [640, 2048] 1.18x, [896, 4864]
# 0.96x; decode, 1 / 2 threads, against two loads of the same model kept at 4 (the first
# model loaded in a process decodes up to ~10 % slower, so controls): Qwen2.5-Coder-0.5B
# Q4_K_M 1.10 / 1.10x, Gemma-3-270M Q4_K_M 1.18 / 1.12x, SmolLM2 Q4_1 (its q8_0 head)
# ~1.05x). q4_0 / q4_1 within noise at 2, q5_1 mixed, the K-quants 7-20 % slower.
ONE_ROW_COLS = {("q8_0", False): 2, ("q5_0", True): 2} if g.lanes() == 16 else {}


def gemv_cols(rows: int, fmt: str, interleaved: bool) -> int:
    """Outputs per item of a gemv of `rows` rows of x against a fmt weight (GEMV_COLS,
    ONE_ROW_COLS): they only group outputs, each output's sum order is fixed by K."""
    if rows == 1 and (fmt, interleaved) in ONE_ROW_COLS:
        return ONE_ROW_COLS[fmt, interleaved]
    return GEMV_COLS[rows]
# rows of x the interleaved copy (interleave) serves: every gemv on AVX-512; on AVX2 one or two,
# whose x fits in registers (Zen 3, one thread, [1536, 576]: at 1 row 1.07x (q4) to 1.64x
# (q5_0) the stored blocks' gemv, at 2 rows 0.92-1.31x, at 3 or 4 rows 0.57-0.94x)
INTERLEAVED_ROWS = GEMV_MAX_ROWS if g.lanes() == 16 else 2
TILE_MIN_CHUNKS = 8      # the tiled path makes at least this many tiles where N allows (two
                         # threads; see _mm_plan). Prefill, 2 threads: SmolLM2 Q4_1 (55 tokens)
                         # 95.3 -> 82.0 ms, Gemma-3-270M Q4_K_M (35) 73.9 -> 64.7 ms
_mm_plans: dict = {}


def matmul(ctx, x: RawTensor, w: BlockRaw) -> RawTensor:
    """x [M, K] f32 (any strides) times the quantized w [N, K] transposed: a contiguous f32
    [M, N]. Every product uses the weight exactly as w.to('f32') holds it and accumulates in
    f32, in a k order fixed by the shapes: bitwise identical for any thread count.

    M <= GEMV_MAX_ROWS: the gemv kernel, one launch per 4 rows of x, decodes each block of w
    once per launch and multiplies it with those rows. More rows: x packed into the f32 GEMM's
    A panels, then its tile kernel with the B panels decoded from w on the fly (bitwise the
    f32 GEMM of x and w.to('f32')ᵀ, whose packed and rowvec paths share one FMA chain per
    element)."""
    inter = isinstance(w, GemvBlockRaw) and x.shape[0] <= INTERLEAVED_ROWS
    try:
        plan = _mm_plans[(x.lay, w.lay, inter)]
    except KeyError:
        plan = _mm_plans[(x.lay, w.lay, inter)] = _mm_plan(x, w, inter)
    if ctx.closed:
        ctx.check_open("dot")
    if x.strides[-1] != 1:
        x = ew.materialize(ctx, x)
    out = ctx.empty(plan.shape)
    if inter:
        w = w.gemv
    if plan.direct is not None:
        addr, n, cost, tail = plan.direct
        ctx.launch(addr, n, cost, x.addr, w.addr, out.addr, *tail)
    else:
        mm.run_plan(ctx, plan, x, w, out, 0, 0, 0)
    return out


# outputs per q8 gemv item; q8_0 on AVX2: 2 (its 34-byte blocks streamed from memory, Zen 3:
# SmolLM2's [49152, 576] head, cold, 2.9-3.2 -> 2.6-2.7 ms; q4_1's [49152, 576] 1.8 ms at 2,
# 1.7 at 4); the K-quants 2 (4: the same or up to 5 % slower, Zen 3)
Q8_COLS = {"q4_0": 4, "q4_1": 4, "q5_0": 4, "q5_1": 4, "q8_0": 4 if g.lanes() == 16 else 2,
           "q2_k": 2, "q3_k": 2, "q4_k": 2, "q5_k": 2, "q6_k": 2}


def q8_fits(w: RawTensor) -> bool:
    """matvec_q8 serves w: a q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / q2_k .. q6_k weight whose rows
    hold at least 128 values (the whole-pair kernel's 64-byte loads stay inside a row; the
    same rule for every format and host) on a host with AVX2 (quant_q8.available)."""
    return w.dtype in quant_q8.FMTS and w.shape[1] >= 128 and quant_q8.available()


def matvec_q8(ctx, x: RawTensor, w: BlockRaw) -> RawTensor:
    """One row x [1, K] (unit stride along K) times the q4_0 / q4_1 / q5_0 / q5_1 / q8_0 /
    q2_k .. q6_k w [N, K]ᵀ with x rounded to 8 bits per group of 4 (codegen/quant_q8.py): a contiguous f32
    [1, N]. Two launches: x quantized once, then the integer-dot gemv over N. Bitwise
    identical for any thread count and vector width; not the exact product (see quant_q8)."""
    if ctx.closed:
        ctx.check_open("dot_q8")
    N, K = w.shape
    pairs = -(-K // 64)
    q = ctx.empty((pairs * quant_q8.PAIR // 4,), "f32")
    ctx.launch(kernels.get(quant_q8.Q8RowKey()), 1, K * 4, x.addr, q.addr, K)
    out = ctx.empty((1, N))
    cols = Q8_COLS[w.dtype]
    items = -(-N // cols)
    per = max(1, GEMV_WORK // (cols * K))
    ctx.launch(kernels.get(quant_q8.Q8GemvKey(w.dtype, cols)), -(-items // per),
               w.lay.nbytes + pairs * quant_q8.PAIR + N * 4, q.addr, w.addr, out.addr, N, K, per)
    return out


def matmul_path(x: RawTensor, w: BlockRaw) -> str:
    """gemv | packed: which kernels matmul(x, w) runs (tests, benchmarks)."""
    return _mm_plan(x, w).kind


def _mm_plan(x, w, interleaved: bool = False) -> "mm.Plan":
    op = "dot"
    if not isinstance(w, BlockRaw):
        raise DTypeError(f"{op}: right operand: expected a block-quantized tensor, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if x.dtype != "f32":
        raise DTypeError(f"{op}: left operand: expected f32 activations against a {w.dtype} "
                         f"weight, got {x.dtype}")
    if x.rank != 2 or w.rank != 2:
        raise ShapeMismatch(f"{op}: expected x [M, K] and w [N, K], got shapes {x.shape} and "
                            f"{w.shape}")
    (M, K), (N, Kw) = x.shape, w.shape
    if K != Kw:
        raise ShapeMismatch(f"{op}: contraction length: x has {K}, the {w.dtype} weight {Kw}; "
                            f"expected equal")
    plan = mm.Plan((M, N))
    s_xm = x.strides[0] if x.strides[-1] == 1 else K   # otherwise x is copied contiguous first
    if M <= GEMV_MAX_ROWS:
        plan.kind = "gemv"
        for m0 in range(0, M, GEMV_ROWS):
            rows = min(GEMV_ROWS, M - m0)
            cols = gemv_cols(rows, w.dtype, interleaved)
            items = -(-N // cols)
            per = max(1, GEMV_WORK // (cols * K))
            key = QuantGemvKey(w.dtype, rows, cols, interleaved=interleaved,
                               spread=quant_gemm.spreads(w.dtype, K, interleaved))
            plan.steps.append((kernels.get(key), -(-items // per),
                               w.lay.nbytes + rows * (K + N) * 4,
                               ((mm.A, m0 * s_xm * 4), (mm.B, 0), (mm.C, m0 * N * 4)),
                               (N, K, s_xm, per)))
        if len(plan.steps) == 1:
            addr, n, cost, _, tail = plan.steps[0]
            plan.direct = (addr, n, cost, tail)
        return plan
    plan.kind = "packed"
    assert all(g.KC % BLOCKS[f][0] == 0 for f in BLOCKS)
    MR, NR = g.mr(), g.nr()
    one, none = (1, 1, 1), (0, 0, 0)
    a_step, _, asz = mm.pack_step(mm.A, "f32", MR, M, K, s_xm, 1, one, none, 1, 0)
    MC = mm.blocks(-(-M // MR), mm.mc_panels()) * MR
    nmb = -(-M // MC)
    # N blocks for the threads: an even split of the panels, finer when the tiles are few (a
    # prompt of tens of rows: one M block). Each panel is decoded once per M block whatever
    # the blocking, and A's panels are re-read from cache.
    panels = -(-N // NR)
    NC = mm.balanced_nc(panels, TILE_MIN_CHUNKS, nmb) * NR
    nnb = -(-N // NC)
    # gemm_tile's argument block: one batch, partial sums of earlier k blocks kept in C itself
    # (no accumulate), M blocks fastest (consecutive chunks decode the same rows of w)
    tile = (kernels.get(QuantTileKey(w.dtype, MR, g.NR_VECS, g.UNROLL)), nmb * nnb,
            M * N * K + nmb * w.lay.nbytes, ((mm.S, 0), (mm.B, 0), (mm.C, 0), (mm.C, 0)),
            (M, N, K, g.KC, MC, NC, nmb, nnb, 0, 0, 0, 1))
    plan.steps = [a_step, tile]
    plan.scratch = asz
    return plan


# ---------------------------------------------------------------------------------------------
# get_rows and row-axis concat (SPEC §3.16)

COPY_CHUNK = 1 << 16     # bytes per chunk of a row copy


def get_rows(ctx, q: BlockRaw, axis: int, idx: RawTensor, op: str = "get_rows",
             tag: str | None = None) -> RawTensor:
    """f32 rows of q gathered along `axis` (not the innermost) at the i64 indices idx [J]:
    shape q.shape with axis resized to J. Fused: each selected row is decoded straight into
    the output. An index outside [0, size) raises IndexOutOfBounds."""
    if not isinstance(q, BlockRaw):
        raise DTypeError(f"{op}: expected a block-quantized tensor, got {q.dtype}")
    if not 0 <= axis < q.rank - 1:
        raise InvalidShape(f"{op}: expected a row axis (0 .. {q.rank - 2}) of the {q.dtype} "
                           f"tensor {q.shape}, got axis {axis}")
    if idx.dtype != "i64" or idx.rank != 1:
        raise DTypeError(f"{op}: expected rank-1 i64 indices, got {idx.dtype} {idx.shape}")
    idx = ew.materialize(ctx, idx)
    n, J, K = q.shape[axis], idx.shape[0], q.shape[-1]
    outer, inner = numel(q.shape[:axis]), numel(q.shape[axis + 1:-1])
    shape = q.shape[:axis] + (J,) + q.shape[axis + 1:]
    out = ctx.empty(shape, "f32")
    rows = outer * J * inner
    per = max(1, DECODE_CHUNK // K)
    chunks = -(-rows // per)
    flags = np.zeros(chunks, np.uint8)
    bs, bb = BLOCKS[q.dtype]
    ctx.launch(kernels.get(QuantRowsKey(q.dtype)), chunks, rows * K // bs * (bb + 4 * bs),
               q.addr, idx.addr, out.addr, n, J, inner, outer, K, per, flags.ctypes.data)
    if flags.any():
        v = idx.to_numpy()
        j = int(np.nonzero((v < 0) | (v >= n))[0][0])
        name = f"axis {tag!r}" if tag is not None else f"axis {axis}"
        raise IndexOutOfBounds(f"{op}: index {int(v[j])} at position {j} is out of range for "
                               f"{name} of size {n}; expected 0 <= index < {n}")
    return out


def concat_rows(ctx, parts, axis: int, op: str = "concat") -> BlockRaw:
    """Quantized tensors of one dtype and equal sizes off `axis` (a row axis, not the
    innermost) joined along it: whole rows of blocks copied, bytes unchanged."""
    first = parts[0]
    fmt = first.dtype
    if not 0 <= axis < first.rank - 1:
        raise InvalidShape(f"{op}: expected a row axis (0 .. {first.rank - 2}) of the {fmt} "
                           f"tensor {first.shape}, got axis {axis}")
    for k, p in enumerate(parts):
        if not isinstance(p, BlockRaw) or p.dtype != fmt:
            raise DTypeError(f"{op}: operand {k}: expected a {fmt} tensor like operand 0, "
                             f"got {p.dtype}")
        if p.rank != first.rank or any(d != e for i, (d, e) in enumerate(zip(p.shape, first.shape))
                                       if i != axis):
            raise ShapeMismatch(f"{op}: operand {k}: expected the sizes of operand 0 "
                                f"{first.shape} off axis {axis}, got {p.shape}")
    shape = list(first.shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    out = empty(ctx, tuple(shape), fmt)
    outer = numel(first.shape[:axis])
    slab = numel(first.shape[axis + 1:-1]) * row_bytes(fmt, first.shape[-1])  # bytes per index
    total = shape[axis] * slab
    addr = kernels.get(QuantCopyKey())
    off = 0
    for p in parts:
        seg = p.shape[axis] * slab
        per = max(1, COPY_CHUNK // seg)
        ctx.launch(addr, -(-outer // per), 2 * outer * seg, p.addr, out.addr + off, outer, seg,
                   seg, total, per)
        off += seg
    return out


__all__ = ["BlockRaw", "BLOCKS", "ENCODABLE", "check_shape", "concat_rows", "decode", "empty",
           "encode", "from_bytes", "get_rows", "matmul", "matmul_path", "row_bytes", "wrap"]
