"""Kernels that read block-quantized tensors in place (SPEC A-8, §3.16): the quantized matmul
y[M, N] = x[M, K] · dequant(w[N, K])ᵀ, the fused get_rows (gather + dequantize) and the row
copies of a quantized concat.

Every block is decoded by the very decoder of fucina.codegen.quant (ggml's dequantize_row_*
arithmetic, vectorised), into a small stack buffer (L1, or registers once LLVM promotes it),
or in the gemv by table and register decoders that compute each weight with that same
arithmetic (tested bitwise against the block decoders): the f32 weights are never
materialised in memory as a whole. So each weight the matmul multiplies is bitwise the value
`w.to("f32")` holds, and the products accumulate in f32.

  quant_gemv  few rows of x (1..4 per launch): one item = `cols` rows of w (outputs
              n .. n+cols-1). For each block of k in increasing order the item decodes the
              block of a row of w and at once runs FMAs against the matching slice of every
              row of x (the decoded block never leaves registers). q4 blocks decode through
              16-value tables, q5 through 32-value ones; the 32-blocks' scales are converted
              a segment ahead (staged), and q4_0 / q4_1 / q5_0 / q5_1 weights may come in an
              interleaved layout (exec.quant.interleave) whose index vectors are one shift
              each (no byte widening, no fifth-bit masks; on AVX2 each code two shifts,
              _narrow_group). The K-quants (q2_k .. q6_k) decode by register decoders of
              their own (quant_kgemv: bytes transposed by a byte permute, scales broadcast
              from a stack buffer, tables of scale·code where they fit), every row of the
              item at once, 16 weights at a time interleaved across the rows. On 8-lane
              hosts (AVX2) the 32-blocks are converted and scaled per vector
              (_narrow_block), q2_k .. q6_k by quant_kgemv.Narrow, 8 weights at a
              time across the rows. Two accumulators per output: lane t of accumulator s
              sums k = s*W + t + 2W*i over i in increasing order; they add, then a fixed
              halving tree folds the lanes. The order of every sum is fixed by K alone (not
              by M: a row of a batch is bitwise the row alone).
  quant_tile  many rows of x: the f32 GEMM's tile kernel (fucina.codegen.gemm.emit_tile:
              packed A panels, MR x NR register tile, one FMA chain per element over k in
              increasing order) with a B panel hook that decodes w, one NR x KC panel at a
              time into an L1 buffer, by the same decoders and W x W register transposes. The
              result is bitwise that of the f32 GEMM on w.to("f32").
  quant_rows  get_rows: out row r = decode(source row of index r), a chunk flag for an index
              out of range (the host turns it into IndexOutOfBounds).
  quant_copy  equal-length byte segments copied between strided places (concat of quantized
              tensors along a row axis is whole rows of blocks moved).
  quant_interleave  rows of q4 / q5 blocks rewritten in the gemv's interleaved layout, once
              per weight (Tensor.for_matvec, when a model is loaded for serving).

Argument blocks are documented at each key.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from llvmlite import ir

from . import irutil as u
from . import quant_kgemv as kq
from .emit import lane_tree
from .gemm import KC, emit_tile, lanes, next_panel, share, transpose
from .kernels import KernelKey, register
from .quant import DECODERS as DECODERS
from .quant import FORMATS, _load
from .rows import fadd


X_REGS = 8   # vector registers the gemv may hold x in
SPLIT = 2    # gemv accumulators per output: even and odd vectors of k
PF_LOCALITY = 2      # the gemv's prefetches fill L2, not L1 (prefetcht1): on Zen 4 a t0 burst
                     # throttles the stream (decode per token, 1 thread: Qwen2.5-0.5B Q4_K_M
                     # 64.6 -> 42.9 ms, Gemma-3-270M 27.9 -> 22.5, SmolLM2 Q4_1 9.0 -> 8.4)
PREFETCH_ITEMS = 4   # the gemv prefetches the rows of w this many items ahead
SPREAD_BLOCKS = 24   # rows of at least this many blocks prefetch as the item goes (spread)
SPREAD_BYTES_Q5 = 1536   # interleaved q5 rows: spread from this many bytes (see spreads)
BIG_BLOCK = 128      # bytes from which a decoded block's every line is prefetched, not its first
                     # (streamed q6_k 2-2.7x, q4_k / q5_k ~20 % faster; below it the extra
                     # prefetches cost more in cache than they win from memory)


def _block_ptr(b, base, row, row_bytes, blk, nbytes):
    """Address of block `blk` of row `row` in a run of rows of `row_bytes` bytes."""
    off = b.add(b.mul(row, row_bytes), b.mul(blk, u.i64(nbytes)))
    return b.gep(base, [off], source_etype=u.I8)


def _buffer(b, floats):
    """A 64-byte aligned f32 stack buffer (entry block, so one per kernel call), typed as an
    opaque pointer like the kernel arguments the decoders normally write through (the IR
    text of an alloca's result is `ptr` either way)."""
    p = u.entry_alloca(b, ir.ArrayType(u.F32, floats))
    p.align = 64
    p.type = u.PTR
    return p


# ---------------------------------------------------------------------------------------------
# few rows of x: decode each block of w once and use it against every row

LUT_FORMATS = ("q4_0", "q4_1")   # the K-quants decode by quant_kgemv


HEADS = {"q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4}   # bytes of f16 d (and m) opening a block
OFFSET = {"q4_0": 8, "q5_0": 16}   # what the decoder subtracts from a code (the rest: 0)


def _code_values(fmt, t=0):
    """The 16 values codes 16t .. 16t + 15 stand for before scaling, as the decoder takes them
    (q − 8, q4_0; q − 16, q5_0; q itself with a min): a table's arguments (kq.table)."""
    offset = OFFSET.get(fmt, 0)
    return ir.Constant(ir.VectorType(u.F32, 16), [float(16 * t + q - offset) for q in range(16)])


def _q5_indices(b, src, fmt):
    """A q5_0 / q5_1 block's two 16-lane index vectors (weights 0-15, 16-31): the nibble with
    bit j of qh as its fifth bit (a test-under-mask and a masked or)."""
    i16 = ir.VectorType(u.I32, 16)
    qh = b.load(b.gep(src, [u.i64(HEADS[fmt])], source_etype=u.I8), typ=u.I32)
    qh.align = 1
    qh = u.splat(b, qh, 16)
    qs = b.load(b.gep(src, [u.i64(HEADS[fmt] + 4)], source_etype=u.I8),
                typ=ir.VectorType(u.I8, 16))
    qs.align = 1
    q = b.zext(qs, i16)
    out = []
    for h, nib in enumerate((b.and_(q, u.const(i16, 15)), b.lshr(q, u.const(i16, 4)))):
        bit = ir.Constant(i16, [1 << (16 * h + j) for j in range(16)])
        high = b.icmp_unsigned("!=", b.and_(qh, bit), u.const(i16, 0))
        out.append(b.select(high, b.or_(nib, u.const(i16, 16)), nib))
    return out


def _lut_block(b, src, fmt, dm=None, finite=False):
    """A q4_0 / q4_1 block as two 16-lane f32 vectors (elements 0-15, 16-31), decoded through
    a table of the 16 values a nibble can take, built with the decoder's own arithmetic
    (float(q − 8) · d, or float(q) · d + m): each weight is bitwise what the decoder gives,
    for one permute per 16 weights instead of a convert, a multiply and an add."""
    f16 = ir.VectorType(u.F32, 16)
    i16 = ir.VectorType(u.I32, 16)
    if fmt in ("q5_0", "q5_1"):
        return _lut_q5(b, src, fmt, dm, finite)
    if fmt == "q8_0":    # staged only: float(q) · d, in registers (no table to build)
        d = u.splat(b, dm[0], 16)
        out = []
        for h in range(2):
            qs = b.load(b.gep(src, [u.i64(2 + 16 * h)], source_etype=u.I8),
                        typ=ir.VectorType(u.I8, 16))
            qs.align = 1
            out.append(b.fmul(b.sitofp(qs, f16), d))
        return out
    if dm is not None:   # d (and m) already f32 scalars (staged): broadcasts from memory
        d, m = (u.splat(b, v, 16) for v in dm)
    elif fmt == "q4_0":
        d = u.splat(b, b.fpext(b.load(src, typ=u.F16), u.F32), 16)
    else:       # d and m converted together (one load, one vcvtph2ps), then each broadcast
        pair = b.fpext(_load_dm(b, src), ir.VectorType(u.F32, 2))
        d, m = (b.shuffle_vector(pair, pair, ir.Constant(i16, [k] * 16)) for k in (0, 1))
    table, = _tables(b, fmt, d, None if fmt == "q4_0" else m)
    qs = b.load(b.gep(src, [u.i64(HEADS[fmt])], source_etype=u.I8), typ=ir.VectorType(u.I8, 16))
    qs.align = 1
    q = b.zext(qs, i16)
    # the permute reads an index's low 4 bits
    return [kq.permute(b, table, idx) for idx in (q, b.lshr(q, u.const(i16, 4)))]


def _lut_q5(b, src, fmt, dm, finite=False):
    """A q5_0 / q5_1 block (staged scales) as two 16-lane vectors through a 32-value table
    in two registers, (q − 16)·d or q·d + m built as the decoder computes them: one
    two-register permute per 16 weights of the 5-bit indices (_q5_indices). finite: the
    segment's q5_0 scales are finite and dm[1] is 16·d (_tables)."""
    d = u.splat(b, dm[0], 16)
    m = u.splat(b, dm[1], 16) if fmt == "q5_1" else None
    lo, hi = _tables(b, fmt, d, m, u.splat(b, dm[1], 16) if finite else None)
    return [kq.permute2(b, lo, hi, idx) for idx in _q5_indices(b, src, fmt)]


def _tables(b, fmt, d, m=None, d16=None):
    """The 16-value tables of a q4 (one) or q5 (two) block, the decoder's values of codes
    0-15 and 16-31. d16 (q5_0 with a finite d: 16·d broadcast) builds the second as the
    first plus 16·d, an add for the second multiply: on Zen 4 the multiplies, the block's
    FMAs and its two-table permutes all take the FMA pipes, which bind the gemv, and an add
    runs beside them (an interleaved q5_0 block 2.98 -> 2.56 cycles a 16 weights in a
    register-only model of its loop; the kernel 1.08-1.21x in cache). (k − 16)·d + 16·d is k·d exactly (both multiples of d's last place, the sum
    representable), so each weight is the decoder's, but for the sign of a zero: code 16
    gives +0, the decoder −0 when d < 0. A zero weight's sign cannot reach the output: the
    accumulators start at +0, and an FMA adding ±0 to a sum returns the sum (+0 + −0 is +0
    under round-to-nearest), so the bits stay the decoder's. An infinite d would make
    −inf + inf = NaN of the weights +inf, hence finite only (_finite_flag)."""
    lo = kq.table(b, _code_values(fmt), d, m)
    if CODE_BITS[fmt] == 4:
        return [lo]
    if d16 is not None:
        return [lo, b.fadd(lo, d16)]
    return [lo, kq.table(b, _code_values(fmt, 1), d, m)]


def _sixteens_lanes(n: int) -> int:
    """Lanes of _with_sixteens' vector for n d's: 2n values and n or more products by 0."""
    return 4 if n == 1 else 16


def _finite_flag(b, n):
    """A flag for a segment of q5_0 scales, n at a time (_with_sixteens): the bits of their
    products by 0 or-ed, an exponent of all ones when a d is an inf or a NaN; the segment
    then builds its tables with two multiplies (_tables, _by_finite)."""
    ty = ir.VectorType(u.I32, _sixteens_lanes(n))
    flag = u.entry_alloca(b, ty)
    b.store(u.const(ty, 0), flag)
    return flag


def _with_sixteens(b, h, n, flag):
    """The first n f16 d's of h (a q5_0 block's d, n = 1, or an interleaved group's 3) as a
    scale slot's floats for _tables: the d's, then their 16·d's (exact), from one convert
    and one multiply of the d's repeated across a vector (4 lanes, or 16); its other lanes,
    the d's times 0 (0 for a finite d, NaN for an inf or a NaN), are or-ed into flag."""
    lanes = _sixteens_lanes(n)
    rep = b.shuffle_vector(h, h, ir.Constant(ir.VectorType(u.I32, lanes),
                                             [k % n for k in range(lanes)]))
    scale = [1.0] * n + [16.0] * n + [0.0] * (lanes - 2 * n)
    v = b.fmul(b.fpext(rep, ir.VectorType(u.F32, lanes)),
               ir.Constant(ir.VectorType(u.F32, lanes), scale))
    b.store(b.or_(b.load(flag), b.bitcast(v, ir.VectorType(u.I32, lanes))), flag)
    keep = 2 if n == 1 else 8   # a slot's 2n floats, as a power of two (lanes 6, 7 unused)
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, keep), list(range(keep))))


def sums_tables(fmt: str) -> bool:
    """Whether fmt's 16-lane gemv builds its second table with an add (_tables): q5_0."""
    return fmt == "q5_0" and lanes() == 16


def _by_finite(b, flag, n, emit):
    """emit(finite) under a branch on a segment's flag (n scales at a time): emit(True) when
    every scale is finite, emit(False) otherwise."""
    v = b.load(flag)
    lanes = v.type.count
    zeros = ir.Constant(v.type, [0x7F800000 if k >= 2 * n else 0 for k in range(lanes)])
    full = b.icmp_unsigned("==", b.and_(v, zeros), u.const(v.type, 0x7F800000))
    ok = b.icmp_unsigned("==", b.bitcast(full, ir.IntType(lanes)), ir.Constant(ir.IntType(lanes), 0))
    with b.if_else(ok) as (fin, other):
        with fin:
            emit(True)
        with other:
            emit(False)


def _narrow_block(b, src, fmt, dm, W):
    """A staged q4_0 / q4_1 / q5_0 / q5_1 / q8_0 block as 32 // W vectors of W lanes (a host
    without 16-lane permutes: AVX2), each weight converted and scaled in registers with the
    decoder's arithmetic: float(q − 8)·d, float(q)·d + m in one FMA (kq.table: the product
    is exact), float(q − 16)·d, float(q)·d for q8_0. No table to build, no trip through a
    stack buffer; dm holds the staged f32 scales. (Folding q4_0's − 8 into an FMA with
    −8·d would save an instruction per W weights but part from the decoder for an infinite
    d: (0 − 8)·inf is −inf, 0·inf − 8·inf NaN.) Zen 3, [1536, 576] at one thread:
    q4_1 176 -> 85 µs, q5_0 161 -> ~120 µs."""
    i16, iw, fw = ir.VectorType(u.I32, 16), ir.VectorType(u.I32, W), ir.VectorType(u.F32, W)
    b16 = ir.VectorType(u.I8, 16)
    offset = OFFSET.get(fmt)
    d = u.splat(b, dm[0], W)
    m = u.splat(b, dm[1], W) if fmt in ("q4_1", "q5_1") else None
    if fmt == "q8_0":
        codes = [b.sext(_load(b, src, 2 + 16 * h, b16), i16) for h in range(2)]
    else:
        q = b.zext(_load(b, src, HEADS[fmt] + (4 if fmt in ("q5_0", "q5_1") else 0), b16), i16)
        codes = [b.and_(q, u.const(i16, 15)), b.lshr(q, u.const(i16, 4))]
    out = []
    for h, q in enumerate(codes):
        for j in range(0, 16, W):
            code = b.shuffle_vector(q, q, ir.Constant(iw, list(range(j, j + W))))
            if fmt in ("q5_0", "q5_1"):
                code = b.or_(code, _fifth_bits(b, src, fmt, 16 * h + j, W))
            if offset:
                code = b.sub(code, u.const(iw, offset))
            out.append(kq.table(b, b.sitofp(code, fw), d, m))
    return out


def _fifth_bits(b, src, fmt, first, W):
    """The fifth bits (16 or 0) of weights first .. first + W − 1 of a q5 block (W = 8),
    bit j of its qh each: the 4 bytes from qh's byte first / 8 − 1 broadcast (so the bits
    sit at 8 .. 15 whichever run this is), one shift per lane (vpsrlvd by 4 + t, the same
    constant for every run) bringing lane t's bit to bit 4, a mask."""
    iw = ir.VectorType(u.I32, W)
    qh = b.load(b.gep(src, [u.i64(HEADS[fmt] + first // 8 - 1)], source_etype=u.I8),
                typ=u.I32)
    qh.align = 1
    shifts = ir.Constant(iw, [4 + t for t in range(W)])
    return b.and_(b.lshr(u.splat(b, qh, W), shifts), u.const(iw, 16))


def _load_dm(b, src):
    """The f16 pair (d, m) that opens a q4_1 block (d alone for q4_0: lane 1 unused)."""
    v = b.load(src, typ=ir.VectorType(u.F16, 2))
    v.align = 2
    return v


def _prefetch_ahead(b, src, ahead, offsets):
    """Prefetch the lines holding src[ahead + off] for each byte offset off."""
    for off in offsets:
        u.prefetch(b, src, b.add(ahead, u.i64(off)), "bool", locality=PF_LOCALITY)


def _prefetch_rows(b, w, rows, row_bytes, ahead):
    """Prefetch, line by line, the item's rows of w (consecutive rows, one contiguous span)
    `ahead` bytes on: one prefetch per line, none lost in the middle of a block."""
    first = b.gep(w, [b.add(b.mul(rows[0], row_bytes), ahead)], source_etype=u.I8)
    with u.Loop(b, u.i64(0), b.mul(row_bytes, u.i64(len(rows))), 64, "pf") as off:
        u.prefetch(b, first, off, "bool", locality=PF_LOCALITY)


STAGED = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")   # f16 d (and m) open each block
SEGMENT = 64   # blocks of k whose scales a staged gemv converts ahead, per row of w


def _staged_blocks(b, key, w, rows, row_bytes, nblk, ahead, sbuf, block):
    """The blocks of k in segments of SEGMENT (_staged_range). Rows ahead are prefetched as
    a burst at the item's start, or with key.spread (long rows) a line per block as the
    scales are staged (see _interleaved_blocks)."""
    _, nbytes = FORMATS[key.fmt]
    if key.spread:   # each row's first line now, the rest block by block below
        for r in rows:
            _prefetch_ahead(b, _block_ptr(b, w, r, row_bytes, u.i64(0), nbytes), ahead, (0,))
    else:
        _prefetch_rows(b, w, rows, row_bytes, ahead)
    prefetch = ((lambda src: _prefetch_ahead(b, src, ahead, (nbytes - 1,))) if key.spread
                else None)
    _staged_range(b, key, w, rows, row_bytes, u.i64(0), nblk, sbuf, block, prefetch)


def _staged_range(b, key, w, rows, row_bytes, k0, k1, sbuf, block, prefetch=None,
                  short=False):
    """Blocks k0 .. k1 − 1 of k in segments of SEGMENT (short: k1 − k0 < SEGMENT, one
    segment, no loop over them): first every block's f16 scales of the segment, for each
    row of w, converted to f32 into an L1 buffer (sbuf, 2·SEGMENT floats a row: d and m, or
    for q5_0 d and 16·d with a finite flag, _tables), then the segment's blocks decoded
    with their scales broadcast from that buffer (a broadcast from
    memory folds into the table's multiply; from a register it is one more vector
    instruction, and the block loop is bound by vector instructions: 5-10 % faster at the
    SmolLM2 shapes, 1 thread). The blocks and their sums keep their order: the bits are the
    unstaged kernel's. prefetch(src), when given, runs for each block as it is staged."""
    _, nbytes = FORMATS[key.fmt]
    pair = ir.VectorType(u.F32, 2)
    sums = sums_tables(key.fmt)

    def segment(s0, s1):
        def slot(c, kb, i):   # (d, m) of block kb of row c: floats 2·(c·SEGMENT + kb − s0) + i
            at = b.add(u.i64(c * SEGMENT), b.sub(kb, s0))
            return b.gep(sbuf, [b.add(b.mul(at, u.i64(2)), u.i64(i))], source_etype=u.F32)

        flag = _finite_flag(b, 1) if sums else None
        with u.Loop(b, s0, s1, 1, "kbs") as kb:
            for c in range(len(rows)):
                src = _block_ptr(b, w, rows[c], row_bytes, kb, nbytes)
                if prefetch is not None:
                    prefetch(src)
                if sums:   # (d, 16·d): q5_0 has no m
                    h = b.load(src, typ=ir.VectorType(u.F16, 1))
                    h.align = 2
                    dm = _with_sixteens(b, h, 1, flag)
                else:
                    dm = b.fpext(_load_dm(b, src), pair)
                b.store(dm, slot(c, kb, 0)).align = 8

        def blocks(finite):
            with u.Loop(b, s0, s1, 1, "kb") as kb:
                for c in range(len(rows)):
                    block(c, kb, [b.load(slot(c, kb, i), typ=u.F32) for i in range(2)],
                          finite=finite)
        if sums:
            _by_finite(b, flag, 1, blocks)
        else:
            blocks(False)

    if short:
        segment(k0, k1)
        return
    with u.Loop(b, k0, k1, SEGMENT, "seg") as s0:
        segment(s0, u.smin(b, b.add(s0, u.i64(SEGMENT)), k1))


INTERLEAVED = ("q4_0", "q4_1", "q5_0", "q5_1")
GROUPS = {"q4_0": 4, "q4_1": 4, "q5_0": 3, "q5_1": 3}   # blocks per interleaved group
CODE_BITS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5}   # bits of a weight's code in a group
SEG_GROUPS = 16         # groups whose scales an interleaved gemv converts ahead, per row


def spreads(fmt: str, K: int, interleaved: bool) -> bool:
    """Whether the gemv of a [.., K] weight prefetches as the item goes (QuantGemvKey.spread)
    rather than in one burst per item: from SPREAD_BLOCKS blocks a row, or for interleaved
    q5 rows from SPREAD_BYTES_Q5 bytes. Streamed from memory (1 thread, Zen 4) the
    interleaved q5_0 rows of K = 896 / 1152 / 1536 run 2.44 / 2.51 / 2.62 ns a block with
    the burst and 2.96 / 2.96 / 2.82 spread, K = 2304 / 4864 2.82 / 3.11 burst and 2.53 /
    2.61 spread; the stored rows and interleaved q4 ones (K = 896: 1.92 spread, 2.18
    burst) gain from spreading from 24 blocks."""
    if interleaved and fmt in ("q5_0", "q5_1"):
        return interleaved_row_bytes(fmt, K) >= SPREAD_BYTES_Q5
    return K // FORMATS[fmt][0] >= SPREAD_BLOCKS


def interleaved_scale_bytes(fmt: str) -> int:
    """Bytes of f16 scales that open an interleaved group: its d's, then its m's (q4_1, q5_1)."""
    return GROUPS[fmt] * HEADS[fmt]


def _interleaved_row_ir(b, fmt, nblk):
    """(groups, bytes of a row) of a row of nblk blocks in the interleaved layout, in IR
    (interleaved_row_bytes at run time)."""
    G, nbytes = GROUPS[fmt], FORMATS[fmt][1]
    groups = b.sdiv(nblk, u.i64(G))
    tail = b.mul(b.sub(nblk, b.mul(groups, u.i64(G))), u.i64(nbytes))
    return groups, b.add(b.mul(groups, u.i64(interleaved_scale_bytes(fmt) + 64)), tail)


def interleaved_row_bytes(fmt: str, K: int) -> int:
    """Bytes of a row of K values in the interleaved layout: whole groups (scales + 64 bytes
    of codes), then the last blocks as stored."""
    bs, nbytes = FORMATS[fmt]
    nblk = K // bs
    groups = nblk // GROUPS[fmt]
    return groups * (interleaved_scale_bytes(fmt) + 64) + (nblk - groups * GROUPS[fmt]) * nbytes


@register
@dataclass(frozen=True)
class QuantInterleaveKey(KernelKey):
    """Rows of fmt blocks rewritten in the gemv's interleaved layout (_interleaved_blocks):
    per group of G blocks the G d's, the G m's (q4_1 / q5_1), then 16 dwords, lane j holding
    the codes of weights j and 16 + j of each block g at bits CODE_BITS·(2g + half) (q4: the
    qs byte j of block g at byte g; q5: the nibble with its qh bit above it); the row's
    last blocks copied as they are.

    Arguments: 0 src (blocks [N, K]), 1 dst (interleaved_row_bytes(fmt, K) a row), 2 N,
    3 K, 4 rows per chunk."""

    family = "quant_interleave"
    fmt: str

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        N, K, per = (u.arg(b, args, i) for i in range(2, 5))
        fmt = self.fmt
        bs, nb = FORMATS[fmt]
        G, bits = GROUPS[fmt], CODE_BITS[fmt]
        gbytes = interleaved_scale_bytes(fmt) + 64
        i16 = ir.VectorType(u.I32, 16)
        nblk = b.sdiv(K, u.i64(bs))
        groups, dst_row = _interleaved_row_ir(b, fmt, nblk)
        src_row = b.mul(nblk, u.i64(nb))
        tail = b.sub(src_row, b.mul(groups, u.i64(G * nb)))

        def at(base, off):
            return b.gep(base, [off], source_etype=u.I8)

        with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), N), 1, "r") as r:
            sr, dr = at(src, b.mul(r, src_row)), at(dst, b.mul(r, dst_row))
            with u.Loop(b, u.i64(0), groups, 1, "g") as g:
                sg = at(sr, b.mul(g, u.i64(G * nb)))
                dg = at(dr, b.mul(g, u.i64(gbytes)))
                lanes = u.const(i16, 0)
                for blk in range(G):
                    sb = at(sg, u.i64(blk * nb))
                    for h in range(HEADS[fmt] // 2):    # d to slot blk, m to slot G + blk
                        v = b.load(at(sb, u.i64(2 * h)), typ=u.I16)
                        v.align = 1
                        b.store(v, at(dg, u.i64(2 * (h * G + blk)))).align = 1
                    if bits == 4:   # byte j of block blk at byte blk of lane j
                        qs = b.load(at(sb, u.i64(HEADS[fmt])), typ=ir.VectorType(u.I8, 16))
                        qs.align = 1
                        lanes = b.or_(lanes, b.shl(b.zext(qs, i16), u.const(i16, 8 * blk)))
                        continue
                    for half, code in enumerate(_q5_indices(b, sb, fmt)):
                        lanes = b.or_(lanes, b.shl(code, u.const(i16, bits * (2 * blk + half))))
                st = b.store(lanes, at(dg, u.i64(interleaved_scale_bytes(fmt))))
                st.align = 1
            so, do = at(sr, b.mul(groups, u.i64(G * nb))), at(dr, b.mul(groups, u.i64(gbytes)))
            with u.Loop(b, u.i64(0), tail, 1, "t") as t:
                b.store(b.load(at(so, t), typ=u.I8), at(do, t))
        b.ret_void()
        return str(mod)


def _narrow_group(b, fmt, src):
    """An interleaved group's codes on 8 lanes (AVX2): its 64 bytes as two vectors (weights
    j and 16 + j of each block for j < 8, then for 8 <= j < 16), and field(f, v), the code
    at bits CODE_BITS·f of vector v as the decoder takes it, an integer: q − 8 (q4_0) and
    q − 16 (q5_0) by a shift left and an arithmetic shift right of the codes with their top
    bit flipped once per group (a signed field), q (q4_1, q5_1) by a shift and a mask. Two
    instructions a code instead of the stored blocks' four to six (widening, fifth bits,
    offset): the same integers, so the same weights."""
    bits = CODE_BITS[fmt]
    i8v = ir.VectorType(u.I32, 8)
    vecs = []
    for v in range(2):
        codes = b.load(b.gep(src, [u.i64(32 * v)], source_etype=u.I8), typ=i8v)
        codes.align = 1
        if fmt in OFFSET:   # code ^ 2^(bits-1) read as signed is code - 2^(bits-1), the offset
            top = sum(1 << (bits * f + bits - 1) for f in range(32 // bits))
            codes = b.xor(codes, u.const(i8v, top - (1 << 32) if top >= 1 << 31 else top))
        vecs.append(codes)

    def field(f, v):
        at, codes = bits * f, vecs[v]
        if fmt in ("q4_1", "q5_1"):
            if at:
                codes = b.lshr(codes, u.const(i8v, at))
            return codes if at + bits == 32 else b.and_(codes, u.const(i8v, (1 << bits) - 1))
        if at + bits < 32:
            codes = b.shl(codes, u.const(i8v, 32 - bits - at))
        return b.ashr(codes, u.const(i8v, 32 - bits))
    return field


def _interleaved_blocks(b, key, w, rows, row_bytes, nblk, ahead, sbuf, use, block):
    """A row of w in the gemv's interleaved layout (fucina.exec.quant.interleave): groups of
    G = GROUPS[fmt] blocks of k, each [the G d's (f16)][the G m's, q4_1 / q5_1][64 bytes of
    codes], then the row's last nblk % G blocks as stored. Dword j of the codes holds the
    code of weight j (half 0) and of weight 16 + j (half 1) of each block g of the group, at
    bit CODE_BITS·(2g + half): one 64-byte load gives every lane its codes for the whole
    group, so a block's index vectors are shifts (a permute reads only the index's low 4
    bits, q4, or 5, q5, where the fifth picks the second table: no masks, no widening), and
    the scales of a segment of groups are converted to f32 ahead (their broadcasts are
    loads). On 8 lanes (AVX2) the codes are two vectors whose fields are converted and
    scaled per vector (_narrow_group), the stored blocks' arithmetic (_narrow_block) without
    their widening and fifth bits. q4 groups are the bytes of their 4 blocks; a q5 group of
    3 takes 70 (q5_0) or 76 bytes (q5_1) for the 66 / 72 of its blocks.
    The rows PREFETCH_ITEMS items ahead are prefetched at the item's start, line by line, or
    with key.spread group by group as the item goes (two lines a group): on long rows a
    burst of 40+ prefetches stalls the loads behind it (SmolLM2's [576, 1536] q4_1 streamed
    from memory: 0.80 -> 0.65 ns a block), on short ones the burst is cheaper.
    use(c, kb, vectors) runs block kb of row c from its decoded 16-lane halves (or 8-lane
    quarters), in the unpacked kernel's order: the bits are its bits."""
    fmt, W = key.fmt, lanes()
    _, nbytes = FORMATS[fmt]
    G, bits = GROUPS[fmt], CODE_BITS[fmt]
    i16, fw = ir.VectorType(u.I32, 16), ir.VectorType(u.F32, W)
    nsc = interleaved_scale_bytes(fmt) // 2
    gbytes = nsc * 2 + 64
    groups = b.sdiv(nblk, u.i64(G))
    sums = sums_tables(fmt)
    if not key.spread:
        _prefetch_rows(b, w, rows, row_bytes, ahead)

    def gptr(c, g, off=0):
        return b.gep(w, [b.add(b.add(b.mul(rows[c], row_bytes), b.mul(g, u.i64(gbytes))),
                               u.i64(off))], source_etype=u.I8)

    def spread(src, nbytes):   # the first and last line of nbytes at src, ahead
        if key.spread:
            _prefetch_ahead(b, src, ahead, (0, nbytes - 1))

    with u.Loop(b, u.i64(0), groups, SEG_GROUPS, "gseg") as g0:
        g1 = u.smin(b, b.add(g0, u.i64(SEG_GROUPS)), groups)

        def slot(c, g, i):   # scale i (the d's, then the m's) of group g of row c, converted
            at = b.add(u.i64(c * SEG_GROUPS), b.sub(g, g0))
            return b.gep(sbuf, [b.add(b.mul(at, u.i64(8)), u.i64(i))], source_etype=u.F32)

        flag = _finite_flag(b, nsc) if sums else None
        with u.Loop(b, g0, g1, 1, "gs") as g:
            for c in range(len(rows)):
                src = gptr(c, g)
                if sums:   # the d's, then their 16·d's (4 f16: the 3 d's, 2 code bytes)
                    hv = b.load(src, typ=ir.VectorType(u.F16, 4))
                    hv.align = 2
                    dv = _with_sixteens(b, hv, nsc, flag)
                else:      # the d's (and m's)
                    hv = b.load(src, typ=ir.VectorType(u.F16, nsc))
                    hv.align = 2
                    dv = b.fpext(hv, ir.VectorType(u.F32, nsc))
                b.store(dv, slot(c, g, 0)).align = 4

        def group_loop(finite):
            with u.Loop(b, g0, g1, 1, "g") as g:
                for c in range(len(rows)):
                    spread(gptr(c, g), gbytes)
                    if W == 8:
                        field = _narrow_group(b, fmt, gptr(c, g, nsc * 2))
                    else:
                        codes = b.load(gptr(c, g, nsc * 2), typ=i16)
                        codes.align = 1
                    for j in range(G):
                        d = u.splat(b, b.load(slot(c, g, j), typ=u.F32), W)
                        m = None if nsc == G else u.splat(b, b.load(slot(c, g, G + j),
                                                                     typ=u.F32), W)
                        if W == 8:   # weights 0-7, 8-15, 16-23, 24-31 of block j
                            decoded = [kq.table(b, b.sitofp(field(2 * j + h, v), fw), d, m)
                                       for h in range(2) for v in range(2)]
                        else:
                            d16 = (u.splat(b, b.load(slot(c, g, nsc + j), typ=u.F32), W)
                                   if finite else None)
                            tables = _tables(b, fmt, d, m, d16)
                            decoded = []
                            for h in range(2):
                                sh = bits * (2 * j + h)
                                idx = codes if sh == 0 else b.lshr(codes, u.const(i16, sh))
                                decoded.append(kq.permute(b, tables[0], idx) if bits == 4 else
                                               kq.permute2(b, tables[0], tables[1], idx))
                        use(c, b.add(b.mul(g, u.i64(G)), u.i64(j)), decoded)
        if sums:
            _by_finite(b, flag, nsc, group_loop)
        else:
            group_loop(False)
    # the row's last nblk % G blocks, as stored: staged like a stored row's (block(...)),
    # through a base that puts block kb of a row at row·row_bytes + kb·nbytes
    tail = b.gep(w, [b.sub(b.mul(groups, u.i64(gbytes)), b.mul(groups, u.i64(G * nbytes)))],
                 source_etype=u.I8)
    _staged_range(b, key, tail, rows, row_bytes, b.mul(groups, u.i64(G)), nblk,
                  b.gep(sbuf, [u.i64(len(rows) * SEG_GROUPS * 8)], source_etype=u.F32),
                  partial(block, base=tail), lambda src: spread(src, nbytes), short=True)


def _kquant_blocks(b, key, w, rows, row_bytes, nblk, ahead, kbufs, use):
    """The K-quant super-blocks of k in increasing order, each decoded in registers
    (fucina.codegen.quant_kgemv) for every row of w of the item in one loop body, a vector
    (16 weights; 8 on AVX2) at a time across the rows: 2·len(rows) accumulator chains in
    flight, and each decoded vector used as soon as it is made (a loop
    over one row of w at a time has 2, and the FMA latency bounds them at 2 cycles per 16
    weights). Each row's vectors still reach its accumulators in increasing k: the bits are
    the block decoders'.
    Every line of the block PREFETCH_ITEMS items ahead is prefetched, q2_k and q3_k (below
    BIG_BLOCK) too: streamed from memory ([16384, 1536], 1 thread) they run 0.84 / 0.99 ns
    per 16 weights so, 0.85-0.91 / 1.02 with the first line only."""
    _, nbytes = FORMATS[key.fmt]
    with u.Loop(b, u.i64(0), nblk, 1, "kb") as kb:
        decs = []
        for c, buf in enumerate(kbufs):
            src = _block_ptr(b, w, rows[c], row_bytes, kb, nbytes)
            _prefetch_ahead(b, src, ahead, range(0, nbytes, 64))
            decs.append(kq.prepare(b, key.fmt, src, buf, lanes()))
        kq.settle(b, kbufs)
        for v in range(decs[0].vectors):
            for c, dec in enumerate(decs):
                use(c, kb, [dec.vector(v)], v)


@register
@dataclass(frozen=True)
class QuantGemvKey(KernelKey):
    """y[m, n] = sum_k x[m, k] · dequant(w)[n, k] for the `rows` (1..4) rows of x.

    Arguments: 0 x (f32, rows of K at stride s_xm), 1 w (blocks, [N, K]), 2 y (f32 [rows, N],
    contiguous), 3 N, 4 K, 5 s_xm, 6 items per chunk. Item q computes outputs
    q*cols .. q*cols+cols-1 of every row; an item past N's edge re-reads row N-1 of w and
    stores nothing for it."""

    family = "quant_gemv"
    fmt: str
    rows: int
    cols: int
    table: bool = True   # q4_0 / q4_1 / q5_0 / q5_1 through tables (_lut_block), K-quants by
                         # the register decoders (quant_kgemv); False: the block decoders
    staged: bool = True  # scales converted per segment ahead (q4_0 / q4_1 with tables, q8_0)
    interleaved: bool = False   # w in the interleaved layout (q4 / q5; _interleaved_blocks)
    spread: bool = False        # prefetch as the item goes, not in one burst (long rows)

    def ir(self, symbol: str) -> str:
        return str(_build_gemv(self, symbol))


def _gemv_walk(key: QuantGemvKey, W: int) -> str:
    """The loop a gemv key runs over the blocks of its rows of w:
      interleaved  w in the interleaved layout (_interleaved_blocks; x in registers)
      staged       scales converted per segment ahead (_staged_blocks): q4_0 / q4_1 through
                   tables and q8_0 on 16 lanes, the narrow decoders on AVX2
      kregs        the K-quants' register decoders (_kquant_blocks)
      blocks       block by block over k, all rows of w per block (x's slice of a block fits
                   in registers: loaded once per block)
      rows         one row of w at a time over all k, x re-read from L1"""
    bs = FORMATS[key.fmt][0]
    x_regs = key.rows * bs // W <= X_REGS
    fits = W == 16 and x_regs
    if key.interleaved:
        if not (x_regs and W in (8, 16) and key.fmt in INTERLEAVED):
            raise ValueError(f"quant_gemv: no interleaved layout for {key.fmt} at {key.rows} "
                             f"rows, {W} lanes")
        return "interleaved"
    if key.staged and key.fmt in STAGED and (fits and (_lut(key, W) or key.fmt not in LUT_FORMATS)
                                             or key.table and W < 16 and x_regs):
        return "staged"
    if key.table and key.fmt in kq.FORMATS and (kq.available() or W < 16):
        return "kregs"
    return "blocks" if x_regs else "rows"


def _lut(key, W) -> bool:
    """key's blocks decode through the 16-lane tables (_lut_block)."""
    return key.table and key.fmt in LUT_FORMATS and W == 16


def _build_gemv(key: QuantGemvKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    bs, nbytes = FORMATS[key.fmt]
    RM, CN = key.rows, key.cols
    x, w, y = (u.arg_ptr(b, args, i) for i in range(3))
    N, K, s_xm, per = (u.arg(b, args, i) for i in range(3, 7))
    nblk = b.sdiv(K, u.i64(bs))
    walk = _gemv_walk(key, W)
    row_bytes = (_interleaved_row_ir(b, key.fmt, nblk)[1] if walk == "interleaved" else
                 b.mul(nblk, u.i64(nbytes)))
    items = b.sdiv(b.add(N, u.i64(CN - 1)), u.i64(CN))
    ahead = b.mul(row_bytes, u.i64(CN * PREFETCH_ITEMS))
    lut = _lut(key, W)
    narrow = key.table and W < 16    # staged blocks decoded by _narrow_block (AVX2)
    bufs = [_buffer(b, bs) for _ in range(CN)]
    sbuf = (_buffer(b, CN * SEGMENT * 2) if walk == "staged" else
            _buffer(b, CN * (SEG_GROUPS * 8 + SEGMENT * 2)) if walk == "interleaved" else None)
    kbufs = ([_buffer(b, kq.SCRATCH if W == 16 else kq.NARROW_SCRATCH) for _ in range(CN)]
             if walk == "kregs" else None)
    accs = [[[u.entry_alloca(b, u.vec(u.F32, W)) for _ in range(SPLIT)] for _ in range(CN)]
            for _ in range(RM)]
    with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), items), 1, "q") as q:
        n0 = b.mul(q, u.i64(CN))
        rows = [u.smin(b, b.add(n0, u.i64(c)), b.sub(N, u.i64(1))) for c in range(CN)]
        for r in range(RM):
            for c in range(CN):
                for a in accs[r][c]:
                    b.store(u.const(u.vec(u.F32, W), 0.0), a)

        def block(c, kb, dm=None, base=w, finite=False):   # decode a block of row c, use it
            src = _block_ptr(b, base, rows[c], row_bytes, kb, nbytes)
            if dm is None:   # the block ahead: every line of a large one (q4_k .. q6_k)
                _prefetch_ahead(b, src, ahead, range(0, nbytes, 64) if nbytes >= BIG_BLOCK
                                else (0,))
            if narrow and dm is not None:
                decoded = _narrow_block(b, src, key.fmt, dm, W)
            elif lut or dm is not None:
                decoded = _lut_block(b, src, key.fmt, dm, finite)
            else:
                DECODERS[key.fmt](b, src, bufs[c])
                decoded = [u.load(b, bufs[c], u.i64(v * W), "f32", W) for v in range(bs // W)]
            use(c, kb, decoded)

        def use(c, kb, decoded, v0=0):   # FMAs of decoded vectors v0.. of a block of row c
            k0 = b.mul(kb, u.i64(bs))
            for v, wv in enumerate(decoded, v0):
                for r in range(RM):
                    xoff = b.add(b.mul(u.i64(r), s_xm), b.add(k0, u.i64(v * W)))
                    xv = u.load(b, x, xoff, "f32", W)
                    acc = accs[r][c][v % SPLIT]
                    b.store(u.intrinsic(b, "llvm.fma", wv.type, [xv, wv, b.load(acc)]), acc)

        if walk == "interleaved":
            _interleaved_blocks(b, key, w, rows, row_bytes, nblk, ahead, sbuf, use, block)
        elif walk == "staged":
            _staged_blocks(b, key, w, rows, row_bytes, nblk, ahead, sbuf, block)
        elif walk == "kregs":
            _kquant_blocks(b, key, w, rows, row_bytes, nblk, ahead, kbufs, use)
        elif walk == "blocks":
            with u.Loop(b, u.i64(0), nblk, 1, "kb") as kb:
                for c in range(CN):
                    block(c, kb)
        else:
            for c in range(CN):
                with u.Loop(b, u.i64(0), nblk, 1, f"kb{c}") as kb:
                    block(c, kb)
        for c in range(CN):
            with b.if_then(b.icmp_signed("<", b.add(n0, u.i64(c)), N)):
                for r in range(RM):
                    v = b.load(accs[r][c][0])
                    for a in accs[r][c][1:]:
                        v = b.fadd(v, b.load(a))
                    s = lane_tree(b, v, fadd)
                    idx = b.add(b.mul(u.i64(r), N), b.add(n0, u.i64(c)))
                    b.store(s, b.gep(y, [idx], source_etype=u.F32))
    b.ret_void()
    return mod


# ---------------------------------------------------------------------------------------------
# many rows of x: the f32 GEMM's tile kernel, its B panels decoded on the fly

@register
@dataclass(frozen=True)
class QuantTileKey(KernelKey):
    """gemm_tile (fucina.codegen.gemm.emit_tile) with the B panel hook decoding w: for each KC
    block of k, for each NR panel of a tile's columns, the panel's NR rows of w x KC are
    decoded into a stack buffer laid out as gemm_pack lays out B, and the very micro-kernel
    of gemm_tile runs on it. So every element is bitwise what the f32 GEMM computes on
    w.to('f32')ᵀ, for any tile sizes and thread count.

    Arguments: gemm_tile's, with 1 = w (blocks, [N, K]), 6 K and 7 KC multiples of the block
    size, KC at most gemm.KC (the panel buffer's depth), and one batch (12, 13 = 0)."""

    family = "quant_tile"
    fmt: str
    mr: int
    nr_vecs: int
    unroll: int

    def ir(self, symbol: str) -> str:
        return str(emit_tile(symbol, self.mr, self.nr_vecs, self.unroll,
                             partial(_decoded_b, self.fmt)))


def _decoded_b(fmt, b, args, N, K, NR):
    """The B panel hook: w (argument 1) has one batch; each panel is decoded into one buffer.
    Its lookahead prefetches the next panel's blocks while this one's MR panels run: NR rows
    of w, each read a KC block's worth of bytes at a time, row_bytes apart — no hardware
    prefetcher follows that (a prompt's rows stream the whole weight from memory)."""
    W = lanes()
    bs, nbytes = FORMATS[fmt]
    assert bs % W == 0, (bs, W)
    w = u.arg_ptr(b, args, 1)
    kc = u.arg(b, args, 7)
    row_bytes = b.mul(b.sdiv(K, u.i64(bs)), u.i64(nbytes))
    panel = _buffer(b, KC * NR)
    tmp = _buffer(b, W * bs)

    def decode(bt, k0, kcl, j0):
        _decode_panel(b, fmt, w, row_bytes, j0, N, k0, kcl, tmp, panel, NR)
        return panel

    def ahead(bt, k0, j0, col0, col1, part, parts):
        """A 1/parts share of the next panel's lines (gemm.next_panel: NR rows of w), per
        MR panel run (as gemm_tile_direct's)."""
        kn, jn = next_panel(b, k0, j0, kc, col0, col1, NR)
        with b.if_then(b.icmp_signed("<", kn, K)):
            span = b.mul(b.sdiv(u.smin(b, kc, b.sub(K, kn)), u.i64(bs)), u.i64(nbytes))
            lpr = b.add(b.sdiv(span, u.i64(64)), u.i64(2))       # lines a row's span may touch
            total = b.mul(u.smin(b, u.i64(NR), b.sub(N, jn)), lpr)
            first = b.mul(b.sdiv(kn, u.i64(bs)), u.i64(nbytes))
            with u.Loop(b, *share(b, total, part, parts), 1, "pf") as ln:
                r, c = b.sdiv(ln, lpr), b.srem(ln, lpr)
                start = b.add(b.mul(b.add(jn, r), row_bytes), first)
                off = u.smin(b, b.mul(c, u.i64(64)), b.sub(span, u.i64(1)))
                u.prefetch(b, w, b.add(start, off), "bool", locality=PF_LOCALITY)
    return decode, ahead


def _decode_panel(b, fmt, w, row_bytes, n0, N, k0, kcl, tmp, panel, Wp):
    """Rows n0 .. n0+Wp-1 of w (zeros past N) over k0 .. k0+kcl-1 into panel[k - k0][n - n0]:
    W rows one block at a time, decoded into tmp (a runtime loop over rows keeps tmp in
    memory), then W x W register transposes."""
    W = lanes()
    bs, nbytes = FORMATS[fmt]
    for s in range(Wp // W):
        with u.Loop(b, u.i64(0), kcl, bs, "kk") as kk:
            qb = b.sdiv(b.add(k0, kk), u.i64(bs))
            with u.Loop(b, u.i64(0), u.i64(W), 1, "t") as t:
                n = b.add(n0, b.add(t, u.i64(s * W)))
                dst = b.gep(tmp, [b.mul(t, u.i64(bs))], source_etype=u.F32)
                with b.if_else(b.icmp_signed("<", n, N)) as (inside, past):
                    with inside:
                        DECODERS[fmt](b, _block_ptr(b, w, n, row_bytes, qb, nbytes), dst)
                    with past:
                        for v in range(bs // W):
                            u.store(b, u.const(u.vec(u.F32, W), 0.0), dst, u.i64(v * W), "f32")
            for j in range(bs // W):
                cols = transpose(b, [u.load(b, tmp, u.i64(t * bs + j * W), "f32", W)
                                     for t in range(W)])
                for i, vec in enumerate(cols):
                    k = b.add(kk, u.i64(j * W + i))
                    u.store(b, vec, panel, b.add(b.mul(k, u.i64(Wp)), u.i64(s * W)), "f32")


# ---------------------------------------------------------------------------------------------
# get_rows and row copies

@register
@dataclass(frozen=True)
class QuantRowsKey(KernelKey):
    """get_rows: the source viewed as [outer, n, inner] rows of K, out as [outer, J, inner]
    rows; out row (o, j, i) = decode(source row (o, idx[j], i)).

    Arguments: 0 src (blocks), 1 idx (i64 [J]), 2 out (f32), 3 n, 4 J, 5 inner, 6 outer,
    7 K, 8 rows per chunk, 9 flags (one byte per chunk, set to 1 when the chunk met an index
    outside [0, n); its rows for that index are left unwritten)."""

    family = "quant_rows"
    fmt: str

    def ir(self, symbol: str) -> str:
        return str(_build_rows(self, symbol))


def _build_rows(key: QuantRowsKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    bs, nbytes = FORMATS[key.fmt]
    src, idx, out = (u.arg_ptr(b, args, i) for i in range(3))
    n, J, inner, outer, K, per = (u.arg(b, args, i) for i in range(3, 9))
    flags = u.arg_ptr(b, args, 9)
    nblk = b.sdiv(K, u.i64(bs))
    row_bytes = b.mul(nblk, u.i64(nbytes))
    total = b.mul(outer, b.mul(J, inner))
    with u.Loop(b, c0, c1, 1, "c") as c:
        with u.Loop(b, b.mul(c, per), u.smin(b, b.mul(b.add(c, u.i64(1)), per), total), 1, "r") as r:
            i = b.srem(r, inner)
            t = b.sdiv(r, inner)
            j = b.srem(t, J)
            o = b.sdiv(t, J)
            sel = b.load(b.gep(idx, [j], source_etype=u.I64), typ=u.I64)
            ok = b.and_(b.icmp_signed(">=", sel, u.i64(0)), b.icmp_signed("<", sel, n))
            with b.if_else(ok) as (good, bad):
                with good:
                    srow = b.add(b.mul(b.add(b.mul(o, n), sel), inner), i)
                    orow = b.gep(out, [b.mul(r, K)], source_etype=u.F32)
                    with u.Loop(b, u.i64(0), nblk, 1, "kb") as kb:
                        DECODERS[key.fmt](b, _block_ptr(b, src, srow, row_bytes, kb, nbytes),
                                          b.gep(orow, [b.mul(kb, u.i64(bs))], source_etype=u.F32))
                with bad:
                    b.store(ir.Constant(u.I8, 1), b.gep(flags, [c], source_etype=u.I8))
    b.ret_void()
    return mod


@register
@dataclass(frozen=True)
class QuantCopyKey(KernelKey):
    """Copy `segments` byte runs of equal length: segment s goes from src + s*src_stride to
    dst + s*dst_stride. 64-byte vectors, then single bytes.

    Arguments: 0 src, 1 dst, 2 segments, 3 segment bytes, 4 src stride, 5 dst stride,
    6 segments per chunk."""

    family = "quant_copy"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        nseg, length, s_src, s_dst, per = (u.arg(b, args, i) for i in range(2, 7))
        vt = ir.VectorType(u.I8, 64)
        full = b.sub(length, b.srem(length, u.i64(64)))
        with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), nseg), 1, "s") as s:
            sp = b.gep(src, [b.mul(s, s_src)], source_etype=u.I8)
            dp = b.gep(dst, [b.mul(s, s_dst)], source_etype=u.I8)
            with u.Loop(b, u.i64(0), full, 64, "v") as v:
                x = b.load(b.gep(sp, [v], source_etype=u.I8), typ=vt)
                x.align = 1
                b.store(x, b.gep(dp, [v], source_etype=u.I8)).align = 1
            with u.Loop(b, full, length, 1, "t") as t:
                b.store(b.load(b.gep(sp, [t], source_etype=u.I8), typ=u.I8),
                        b.gep(dp, [t], source_etype=u.I8))
        b.ret_void()
        return str(mod)
