"""The 8-bit-activation matvec of q4_0 / q4_1 / q5_0 / q5_1 / q8_0 and q2_k .. q6_k weights: one
row of x against a quantized w as integer dot products (ggml's decode fast path): q4_0 / q4_1 /
q8_0 in whole pairs of blocks with AVX-512 VNNI + VBMI, every format a block at a time with
AVX2 (_q8_gemv_halves), the same bits either way.

A decode step multiplies one activation row by every weight matrix; decoding each block to f32
keeps the exact kernel (quant_gemm's gemv) compute-bound. Here x is first rounded to signed
8-bit values, and a pair of blocks of w then costs a whole-vector load, a byte permute
(vpermt2b), one `vpdpbusd` (unsigned weight byte × signed x byte, 4 products per i32 lane) and
two FMAs of scale vectors:

  y[n] = Σ_pairs Σ_lanes d_w · dx_lane · Σ_4 u_w · q_x  + (m_w, or −8 | −16 | −128 · d_w) · sx_block

u_w is the weight's unsigned code (q4_1's nibble; q4_0's nibble = q + 8; q5's five bits, q5_0's
= q + 16; q8_0's byte + 128, so the zero point comes back through sx = Σ dx·q over the block). x is scaled per group of 4
values — one per vpdpbusd lane, so finer groups cost the gemv nothing: dx = max|x| / 127 over
the group, q = round-half-even(x · 127 / max|x|). Real hidden states have outlier channels
(SmolLM2's final one: max 33 against a median of 0.8); with ggml's 32-value groups they round
their 31 neighbours coarsely (logit errors ~1 %), with 4-value groups only their 3 neighbours.
It is still not the exact product: each x is off by at most 1/254 of its group's largest |x|.
The sum order is fixed by K alone (per output: pairs in increasing order into one vector, then
a fixed lane tree), so the bits do not depend on the thread count, nor on the vector width:
with AVX2 each pair is two 8-lane halves with the same integer lanes and the same f32
operations per lane (tests/test_quant_matvec.py's q8_model spells them out). Zen 3, one
thread: q4_1 [1536, 576] 17-18 G weights/s against the exact gemv's 11-12, q5_0 14 against
7.3, q4_k 16 / q6_k 15.5 / q5_k 14 / q2_k 14 against 10-11.5, q3_k 14.7 against 6.5; decode
SmolLM2 Q4_1 ~1.3x, Qwen2.5-Coder-0.5B Q4_K_M (q5_0 layers, q8_0 head) ~1.5x.

  q8_row     x [K] f32 -> per pair of blocks 192 bytes: q_x of both blocks (64 bytes), dx per
             4-value group (16 f32, lane i for values 4i .. 4i+3 of the pair), sx of block 0 in
             lane 0 and of block 1 in lane 8 (16 f32, zeros elsewhere); an odd last block is
             paired with zeros.
  q8_gemv    y [N] from the q8_row buffer and w [N, K]; one item = `cols` rows of w.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from . import quant_kgemv as kq
from .emit import lane_tree
from .kernels import KernelKey, register
from .quant import FORMATS
from .rows import fadd
from .target import host

FMTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
WHOLE = ("q4_0", "q4_1", "q8_0")   # with whole pairs on AVX-512; the others in halves anywhere
PAIR = 192          # bytes of the q8_row buffer per pair of blocks
PREFETCH_ITEMS = 4  # the gemv prefetches the rows this many items ahead, every line of them,
PF_LOCALITY = 2     # into L2 (prefetcht1), as quant_gemm's exact gemv. Zen 4, four weights
                    # [49152, K] streamed from memory, one thread (two): t0 -> t1 q6_k 2.71 ->
                    # 1.88 ms (1.38 -> 0.99), q5_k 2.15 -> 1.95, q4_k and q4_1 within 5 % either
                    # way. q8_0's 68-byte pairs took one prefetch each, so one line in 17 came
                    # on demand: 3.33 ms (9 GB/s) -> 1.24 ms (24 GB/s) with both ends of the
                    # pair prefetched into L2 (t0 both ends: no faster, session 30)


@functools.lru_cache(maxsize=None)
def whole_pairs() -> bool:
    """A pair of blocks per instruction: AVX-512 VNNI and VBMI (Zen 4 / Zen 5)."""
    return host().has("avx512f", "avx512bw", "avx512vnni", "avx512vbmi")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """The host runs these kernels: whole pairs (whole_pairs), or AVX2 with F16C and FMA,
    a block (8 lanes) at a time through vpmaddubsw / vpmaddwd."""
    return whole_pairs() or host().has("avx2", "fma", "f16c")


def _v(elem, n):
    return ir.VectorType(elem, n)


F8, I8X32 = _v(u.F32, 8), _v(u.I8, 32)   # the halves kernel's lanes: 8 f32, 32 bytes


def _shuffle(b, v, idx):
    return b.shuffle_vector(v, ir.Constant(v.type, None),
                            ir.Constant(_v(u.I32, len(idx)), list(idx)))


@register
@dataclass(frozen=True)
class Q8RowKey(KernelKey):
    """x quantized per block for q8_gemv. Arguments: 0 x (f32 [K]), 1 out (the pair buffer,
    -(-K // 64) · 192 bytes, 64-byte aligned), 2 K (a multiple of 32). One chunk."""

    family = "quant_q8_row"

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _q8_row)


def _q8_row(b, args, c0, c1):
    f16 = _v(u.F32, 16)
    x, out = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    K = u.arg(b, args, 2)
    zero = u.const(f16, 0.0)
    nblk = b.sdiv(K, u.i64(32))
    npair = b.sdiv(b.add(nblk, u.i64(1)), u.i64(2))
    with u.Loop(b, u.i64(0), npair, 1, "p") as p:      # zero the scale vectors of the pair
        base = b.mul(p, u.i64(PAIR // 4))
        for off in (16, 32):
            u.store(b, zero, out, b.add(base, u.i64(off)), "f32")
        with b.if_then(b.icmp_signed("==", b.add(b.mul(p, u.i64(2)), u.i64(1)), nblk)):
            qz = b.gep(out, [b.add(b.mul(p, u.i64(PAIR)), u.i64(32))], source_etype=u.I8)
            b.store(u.const(_v(u.I8, 32), 0), qz)       # the zero partner of an odd last block
    with u.Loop(b, u.i64(0), nblk, 1, "j") as j:
        p, half = b.sdiv(j, u.i64(2)), b.srem(j, u.i64(2))
        pb = b.gep(out, [b.mul(p, u.i64(PAIR))], source_etype=u.I8)
        sx = u.const(u.F32, 0.0)
        for h in (0, 1):
            v = u.load(b, x, b.add(b.mul(j, u.i64(32)), u.i64(16 * h)), "f32", 16)
            amax = _group_fold(b, u.intrinsic(b, "llvm.fabs", f16, [v]),
                               lambda a, c: u.intrinsic(b, "llvm.maxnum", f16, [a, c]))
            d = b.fdiv(amax, u.const(f16, 127.0))
            inv = b.select(b.fcmp_ordered(">", amax, zero),
                           b.fdiv(u.const(f16, 127.0), amax), zero)
            q = b.fptosi(u.intrinsic(b, "llvm.roundeven", f16, [b.fmul(v, inv)]), _v(u.I32, 16))
            at = b.add(b.mul(half, u.i64(32)), u.i64(16 * h))
            b.store(b.trunc(q, _v(u.I8, 16)), b.gep(pb, [at], source_etype=u.I8))
            lane = b.add(b.mul(half, u.i64(8)), u.i64(4 * h))    # the pair's lane of group 0
            groups = [0, 4, 8, 12]
            b.store(_shuffle(b, d, groups),
                    b.gep(b.gep(pb, [u.i64(64)], source_etype=u.I8), [lane], source_etype=u.F32))
            qsum = _group_fold(b, q, lambda a, c: b.add(a, c))
            part = b.fmul(d, b.sitofp(qsum, f16))
            for g in groups:
                sx = b.fadd(sx, b.extract_element(part, u.i64(g)))
        sxp = b.gep(pb, [u.i64(128)], source_etype=u.I8)
        u.store(b, sx, sxp, b.mul(half, u.i64(8)), "f32")


def _group_fold(b, v, op):
    """Every lane of a 16-lane vector gets op folded over its aligned group of 4 lanes."""
    v = op(v, _shuffle(b, v, [k ^ 1 for k in range(16)]))
    return op(v, _shuffle(b, v, [k ^ 2 for k in range(16)]))


@register
@dataclass(frozen=True)
class Q8GemvKey(KernelKey):
    """y[n] = w[n, :] · x through q8_row's buffer. Arguments: 0 the q8_row buffer, 1 w (fmt
    blocks [N, K]), 2 y (f32 [N]), 3 N, 4 K, 5 items per chunk. Item q computes outputs
    q·cols .. q·cols + cols − 1; an item past N's edge re-reads row N − 1 and stores nothing."""

    family = "quant_q8_gemv"
    fmt: str
    cols: int

    def ir(self, symbol: str) -> str:
        if self.fmt not in FMTS:
            raise ValueError(f"q8 gemv: expected a format in {FMTS}, got {self.fmt!r}")
        return u.module(symbol, _q8_gemv, self)


def dpbusd(b, uq, xq):
    """vpdpbusd from zero: per i32 lane of two 16-lane vectors the sum of its four unsigned
    (uq) by signed (xq) byte products."""
    return u.intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", _v(u.I32, 16),
                       [u.const(_v(u.I32, 16), 0), uq, xq], types=[])


def _q8_gemv(key, b, args, c0, c1):
    if not (whole_pairs() and key.fmt in WHOLE):
        return _q8_gemv_halves(key, b, args, c0, c1)
    f16, i8x64 = _v(u.F32, 16), _v(u.I8, 64)
    CN = key.cols
    bs, nbytes = FORMATS[key.fmt]
    nib = key.fmt != "q8_0"
    qoff = 2 if key.fmt != "q4_1" else 4       # the quants follow d (and m)
    px, w, y = (u.arg_ptr(b, args, i) for i in range(3))
    N, K, per = (u.arg(b, args, i) for i in range(3, 6))
    nblk = b.sdiv(K, u.i64(32))
    full = b.sdiv(nblk, u.i64(2))              # pairs with both blocks
    row_bytes = b.mul(nblk, u.i64(nbytes))
    items = b.sdiv(b.add(N, u.i64(CN - 1)), u.i64(CN))
    ahead = b.mul(row_bytes, u.i64(CN * PREFETCH_ITEMS))
    accs = [u.entry_alloca(b, f16) for _ in range(CN)]
    # sx's factor: m for q4_1; the zero point of the unsigned quants for the others (q4_0
    # stores q + 8; q8_0's signed bytes are flipped to q + 128 for vpdpbusd's unsigned side)
    offset = {"q4_0": -8.0, "q8_0": -128.0}.get(key.fmt)
    pf_offsets = (0,) if 2 * nbytes <= 64 else (0, 2 * nbytes - 1)   # the pair's lines

    def load(at, shift, valid):
        v = b.load(b.gep(w, [b.sub(at, u.i64(shift))], source_etype=u.I8), typ=i8x64)
        v.align = 1
        return v if valid is None else b.select(valid, v, u.const(i8x64, 0))

    def weights(at, shift, valid):
        """(the pair's 64 quants as unsigned bytes in x's order, the loaded words holding the
        scales, the word of d per lane). A lone block (`valid` given) pairs with byte 0,
        which `valid` zeroed."""
        second = shift + nbytes if valid is None else None
        dw = [shift // 2] * 8 + [0 if second is None else second // 2] * 8
        v = load(at, shift, valid)
        if nib:     # block 0's low nibbles (its elements 0-15), high nibbles (16-31), block 1's
            pick = [0 if k >= 32 and second is None else
                    (second if k >= 32 else shift) + qoff + k % 16 + (64 if (k // 16) % 2 else 0)
                    for k in range(64)]
            hi = b.bitcast(b.lshr(b.bitcast(v, _v(u.I16, 32)), u.const(_v(u.I16, 32), 4)), i8x64)
            q = b.shuffle_vector(b.and_(v, u.const(i8x64, 15)), b.and_(hi, u.const(i8x64, 15)),
                                 ir.Constant(_v(u.I32, 64), pick))          # vpermt2b
        elif second is None:
            q = b.shuffle_vector(v, v, ir.Constant(_v(u.I32, 64), [shift + qoff + k if k < 32
                                                                   else 0 for k in range(64)]))
        else:       # 68 bytes: block 1's quants from a second load 4 bytes on
            v4 = load(b.add(at, u.i64(4)), 0, None)
            q = b.shuffle_vector(v, v4, ir.Constant(_v(u.I32, 64), [
                qoff + k if k < 32 else 64 + k for k in range(64)]))
        if not nib:
            q = b.xor(q, u.const(i8x64, 0x80))
        return q, b.bitcast(v, _v(u.I16, 32)), dw

    def pair(p, rows, shift, valid=None):
        """Blocks 2p and 2p + 1 (or 2p alone) of every row. Loads are whole 64-byte loads;
        those of a row's last pairs start `shift` bytes early so that they end inside the row
        (a masked load is an order of magnitude slower on memory not yet in cache)."""
        pb = b.gep(px, [b.mul(p, u.i64(PAIR))], source_etype=u.I8)
        xq = b.bitcast(b.load(pb, typ=i8x64), _v(u.I32, 16))
        dx = b.load(b.gep(pb, [u.i64(64)], source_etype=u.I8), typ=f16)
        sx = b.load(b.gep(pb, [u.i64(128)], source_etype=u.I8), typ=f16)
        if offset is not None:
            sx = b.fmul(sx, u.const(f16, offset))
        for c in range(CN):
            at = b.add(rows[c], b.mul(p, u.i64(2 * nbytes)))
            for off in pf_offsets:
                u.prefetch(b, w, b.add(b.add(at, ahead), u.i64(off)), "bool",
                           locality=PF_LOCALITY)
            q, hw, dw = weights(at, shift, valid)
            dot = dpbusd(b, b.bitcast(q, _v(u.I32, 16)), xq)
            d = b.fpext(b.bitcast(_shuffle(b, hw, dw), _v(u.F16, 16)), f16)
            acc = b.load(accs[c])
            acc = u.intrinsic(b, "llvm.fma", f16, [b.sitofp(dot, f16), b.fmul(d, dx), acc])
            if key.fmt == "q4_1":
                m = b.fpext(b.bitcast(_shuffle(b, hw, [k + 1 for k in dw]), _v(u.F16, 16)), f16)
                acc = u.intrinsic(b, "llvm.fma", f16, [m, sx, acc])
            else:
                acc = u.intrinsic(b, "llvm.fma", f16, [d, sx, acc])
            b.store(acc, accs[c])

    with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), items), 1, "q") as q:
        n0 = b.mul(q, u.i64(CN))
        rows = [b.mul(u.smin(b, b.add(n0, u.i64(c)), b.sub(N, u.i64(1))), row_bytes)
                for c in range(CN)]
        for a in accs:
            b.store(u.const(f16, 0.0), a)
        # pairs whose 64 bytes from the pair on stay inside the row, then the rest (q8_0's
        # pairs read 68 bytes by two loads, both inside)
        if nib:
            inside = b.sdiv(b.sub(row_bytes, u.i64(64 - 2 * nbytes)), u.i64(2 * nbytes))
            inside = u.smin(b, b.select(b.icmp_signed("<", inside, u.i64(0)), u.i64(0), inside),
                            full)
        else:
            inside = full
        with u.Loop(b, u.i64(0), inside, 1, "p") as p:
            pair(p, rows, 0)
        if nib:
            with u.Loop(b, inside, full, 1, "pe") as p:
                pair(p, rows, 64 - 2 * nbytes)
        with b.if_then(b.icmp_signed("!=", b.mul(full, u.i64(2)), nblk)):
            keep = ir.Constant(_v(u.I1, 64), [k >= 64 - nbytes for k in range(64)])
            pair(full, rows, 64 - nbytes, keep)
        for c in range(CN):
            with b.if_then(b.icmp_signed("<", b.add(n0, u.i64(c)), N)):
                s = lane_tree(b, b.load(accs[c]), fadd)
                b.store(s, b.gep(y, [b.add(n0, u.i64(c))], source_etype=u.F32))


def _load(b, w, at, typ):
    v = b.load(b.gep(w, [at], source_etype=u.I8), typ=typ)
    v.align = 1
    return v


def _madd(b, uq, xq):
    """Per i32 lane the sum of its four unsigned-by-signed byte products."""
    pairs = u.intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", _v(u.I16, 16), [uq, xq], types=[])
    return u.intrinsic(b, "llvm.x86.avx2.pmadd.wd", _v(u.I32, 8),
                       [pairs, u.const(_v(u.I16, 16), 1)], types=[])


def _signed_dot(b, v, xq):
    """Σ of the four products of signed code bytes v and x's bytes per lane: magnitudes
    times x's bytes carrying the codes' signs (vpmaddubsw's unsigned side)."""
    sign = "llvm.x86.avx2.psign.b"
    return _madd(b, u.intrinsic(b, sign, I8X32, [v, v], types=[]),
                 u.intrinsic(b, sign, I8X32, [xq, v], types=[]))


def _shift_bytes(b, v, k):
    """32 bytes shifted as 16 words by k bits (left for k < 0); a mask then keeps the bits
    that stayed inside their byte."""
    if k == 0:
        return v
    words = b.bitcast(v, _v(u.I16, 16))
    op = b.lshr if k > 0 else b.shl
    return b.bitcast(op(words, u.const(_v(u.I16, 16), abs(k))), I8X32)


def _bit_to(b, v, bit, to):
    """Bit `bit` of every byte of v moved to bit `to` (the rest zero)."""
    return b.and_(_shift_bytes(b, v, bit - to), u.const(I8X32, 1 << to))


def _pick(b, v, lanes):
    return b.shuffle_vector(v, v, ir.Constant(_v(u.I32, 8), lanes))


def _sixteens(s8):
    """The lanes of a superblock's 16 per-16-value scales that its 32-value sub-block s8
    reads: lanes 0-3 (its values 0-15) scale 2·s8, lanes 4-7 scale 2·s8 + 1."""
    return [2 * s8] * 4 + [2 * s8 + 1] * 4


def _q6_codes(b, w, at, hh, sub):
    """q6_k: sub-block `sub` (0-3) of 128-value half hh as signed bytes q − 32: four bits
    from ql (low or high nibbles of one of its 32-byte rows), two from qh (bits 2·sub)."""
    ql = _load(b, w, b.add(at, u.i64(64 * hh + 32 * (sub % 2))), I8X32)
    qh = _load(b, w, b.add(at, u.i64(128 + 32 * hh)), I8X32)
    lo = b.and_(_shift_bytes(b, ql, 4 * (sub // 2)), u.const(I8X32, 15))
    hi = b.shl(b.and_(_shift_bytes(b, qh, 2 * sub), u.const(I8X32, 3)), u.const(I8X32, 4))
    return b.sub(b.or_(lo, hi), u.const(I8X32, 32))


class _KQuant:
    """What the halves kernel needs of a K-quant superblock: `scales` once per superblock
    and row, then per 32-value sub-block s8 (0-7, x's block 8·sb + s8) `sub` gives
    (the lanes' integer dot with x's bytes as f32, d per lane, the zero-point factor m per
    lane or None). q4_k / q5_k: m = −dmin·m of the sub-block, against the block's sx;
    q2_k: m = dmin·m per 16 values, times −dx against each lane's own Σ of x (per_lane;
    (dmin·m)·(−dx) is bitwise −(dmin·m·dx))."""

    def __init__(self, fmt, b, w):
        self.fmt, self.b, self.w = fmt, b, w
        self.per_lane = fmt == "q2_k"

    def scales(self, at):
        """The 16-lane decoders' group scales (quant_kgemv.group_scales; each product exact):
        q2_k / q3_k / q6_k d·sc per 16 values (q2_k and dmin·m), q4_k / q5_k d·sc of the 8
        sub-blocks and their −dmin·m in one vector."""
        return kq.group_scales(self.b, self.b.gep(self.w, [at], source_etype=u.I8), self.fmt)

    def sub(self, at, scales, s8, xq):
        b, w, fmt = self.b, self.w, self.fmt
        hh, sub = divmod(s8, 4)
        groups, mins = scales
        if fmt == "q6_k":
            dot = b.sitofp(_signed_dot(b, _q6_codes(b, w, at, hh, sub), xq), F8)
            return dot, _pick(b, groups, _sixteens(s8)), None
        if fmt == "q3_k":   # 2 bits from qs, the third from hmask bit s8: signed q − 4
            lo = _bit_pair(b, _load(b, w, b.add(at, u.i64(32 + 32 * hh)), I8X32), 2 * sub)
            hm = _bit_to(b, _load(b, w, at, I8X32), s8, 2)
            codes = b.sub(b.or_(lo, hm), u.const(I8X32, 4))
            dot = b.sitofp(_signed_dot(b, codes, xq), F8)
            return dot, _pick(b, groups, _sixteens(s8)), None
        if fmt == "q2_k":
            codes = _bit_pair(b, _load(b, w, b.add(at, u.i64(16 + 32 * hh)), I8X32), 2 * sub)
            dot = b.sitofp(_madd(b, codes, xq), F8)
            return dot, _pick(b, groups, _sixteens(s8)), _pick(b, mins, _sixteens(s8))
        # q4_k / q5_k: the low nibbles of 32 code bytes for an even s8, their high ones
        # for an odd one; q5_k's fifth bit is bit s8 of qh's byte
        lp, h = divmod(s8, 2)
        v = _load(b, w, b.add(at, u.i64((16 if fmt == "q4_k" else 48) + 32 * lp)), I8X32)
        codes = b.and_(_shift_bytes(b, v, 4 * h), u.const(I8X32, 15))
        if fmt == "q5_k":
            codes = b.or_(codes, _bit_to(b, _load(b, w, b.add(at, u.i64(16)), I8X32), s8, 4))
        dot = b.sitofp(_madd(b, codes, xq), F8)
        return dot, _pick(b, groups, [s8] * 8), _pick(b, groups, [8 + s8] * 8)


def _bit_pair(b, v, shift):
    """Bits shift, shift + 1 of every byte of v as its value 0-3."""
    return b.and_(_shift_bytes(b, v, shift), u.const(I8X32, 3))


def _q8_gemv_halves(key, b, args, c0, c1):
    """_q8_gemv on AVX2, a pair's two blocks as two 8-lane halves (lanes 0-7 and 8-15 of the
    whole-pair kernel), with the same integer lanes and the same f32 operations per lane, so
    the same bits: a block's unsigned codes times x's bytes by vpmaddubsw (pairs of products,
    at most 2·31·127 in int16 for the 5-bit codes) and vpmaddwd (the lane's four); q8_0's
    signed bytes by their magnitude times x's bytes carrying their sign (at most 2·128·127),
    plus 128·Σ x per lane (the zero point the whole-pair kernel adds through its unsigned
    codes). A lone last block's second half is the whole-pair kernel's zeroed partner: no
    codes, d = m = 0. q5_0 / q5_1 (no whole-pair kernel: these AVX2 instructions serve them
    on AVX-512 hosts too) take their fifth bit from qh into the byte lanes (qh's bytes
    broadcast, an OR with every bit but the lane's own, a compare with all ones) and are then
    q4_0 / q4_1 with 32 codes and zero point 16. The K-quants' superblocks are 8 sub-blocks
    of 32 (_KQuant): q4_k / q5_k with d = d·sc and m = −dmin·m of ggml's 6-bit scales (the
    low and the high nibbles of 32 code bytes, q5_k's fifth bit from qh), decoded for all 8
    at once per superblock and row; q6_k's signed codes q − 32 and q3_k's q − 4 (the third
    bit from hmask) under d·sc per 16 values (signed dots, no zero-point term); q2_k's 2-bit
    codes under d·sc per 16 values with the zero point −dmin·m·dx per lane against the
    lane's own Σ of x's bytes: acc = fma(dot, d·dx, acc), acc = fma(m·dx, Σq_x, acc)."""
    CN = key.cols
    bs, nbytes = FORMATS[key.fmt]
    nib = key.fmt != "q8_0"
    pair_scale = key.fmt in ("q4_1", "q5_1")       # d and m, else d alone
    fifth = key.fmt in ("q5_0", "q5_1")
    hoff = 4 if pair_scale else 2                   # q5: qh after the scales, then the nibbles
    qoff = hoff + (4 if fifth else 0)
    px, w, y = (u.arg_ptr(b, args, i) for i in range(3))
    N, K, per = (u.arg(b, args, i) for i in range(3, 6))
    if bs == 32:
        nblk = b.sdiv(K, u.i64(32))
        full = b.sdiv(nblk, u.i64(2))
    row_bytes = b.mul(b.sdiv(K, u.i64(bs)), u.i64(nbytes))
    items = b.sdiv(b.add(N, u.i64(CN - 1)), u.i64(CN))
    ahead = b.mul(row_bytes, u.i64(CN * PREFETCH_ITEMS))
    accs = [[u.entry_alloca(b, F8) for _ in range(2)] for _ in range(CN)]
    offset = {"q4_0": -8.0, "q5_0": -16.0, "q8_0": -128.0}.get(key.fmt)
    zero8 = u.const(F8, 0.0)

    def load(at, typ):
        return _load(b, w, at, typ)

    def scales(at):
        """(d, m) of the block at `at` widened, each in all 8 lanes (m: d again but for q4_1):
        one 4-byte broadcast, one vcvtph2ps and a lane duplicate each."""
        if not pair_scale:
            d = b.fpext(u.splat(b, load(at, u.F16), 8), F8)
            return d, d
        dm = b.fpext(b.shuffle_vector(load(at, _v(u.F16, 2)), ir.Constant(_v(u.F16, 2), None),
                                      ir.Constant(_v(u.I32, 8), [0, 1] * 4)), F8)
        return tuple(b.shuffle_vector(dm, dm, ir.Constant(_v(u.I32, 8), [k & ~1 | h
                                                                         for k in range(8)]))
                     for h in (0, 1))

    def codes(at, xq, xs):
        """The block's dot with x's bytes per lane (the whole-pair kernel's vpdpbusd lanes)."""
        if nib:     # 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones
            v = load(b.add(at, u.i64(qoff)), _v(u.I8, 16))
            hi = b.bitcast(b.lshr(b.bitcast(v, _v(u.I16, 8)), u.const(_v(u.I16, 8), 4)),
                           _v(u.I8, 16))
            q = b.and_(b.shuffle_vector(v, hi, ir.Constant(_v(u.I32, 32), list(range(32)))),
                       u.const(I8X32, 15))
            if fifth:   # byte j |= 16 when bit j of qh is set
                qh = b.bitcast(u.splat(b, load(b.add(at, u.i64(hoff)), u.I32), 8), I8X32)
                qh = b.shuffle_vector(qh, qh, ir.Constant(_v(u.I32, 32),
                                                          [16 * (j // 16) + j // 8
                                                           for j in range(32)]))
                others = ir.Constant(I8X32, [0xFF ^ (1 << (j % 8)) for j in range(32)])
                lit = b.icmp_unsigned("==", b.or_(qh, others), u.const(I8X32, -1))
                q = b.or_(q, b.and_(b.sext(lit, I8X32), u.const(I8X32, 16)))
            return _madd(b, q, xq)
        return b.add(_signed_dot(b, load(b.add(at, u.i64(qoff)), I8X32), xq), xs)

    def x_half(p, h):
        """(x's bytes, dx, sx·offset) of block 2p + h from the q8_row buffer."""
        pb = b.gep(px, [b.mul(p, u.i64(PAIR))], source_etype=u.I8)
        xq = b.load(b.gep(pb, [u.i64(32 * h)], source_etype=u.I8), typ=I8X32)
        dx = b.load(b.gep(pb, [u.i64(64 + 32 * h)], source_etype=u.I8), typ=F8)
        sx = b.load(b.gep(pb, [u.i64(128 + 32 * h)], source_etype=u.I8), typ=F8)
        return xq, dx, (sx if offset is None else b.fmul(sx, u.const(F8, offset)))

    def step(c, h, dot, d, m, dx, sx):
        """The whole-pair kernel's two FMAs on lanes 8h .. 8h + 7 of output c (m None: the
        first alone, signed codes having no zero point)."""
        acc = b.load(accs[c][h])
        acc = u.intrinsic(b, "llvm.fma", F8, [dot, b.fmul(d, dx), acc])
        if m is not None:
            acc = u.intrinsic(b, "llvm.fma", F8, [m, sx, acc])
        b.store(acc, accs[c][h])

    def kquant(sb, rows, kq):
        """Superblock sb of every row as 4 pairs of 32-value sub-blocks (_KQuant)."""
        scaled = []
        for c in range(CN):
            at = b.add(rows[c], b.mul(sb, u.i64(nbytes)))
            for off in range(0, nbytes, 64):
                u.prefetch(b, w, b.add(b.add(at, ahead), u.i64(off)), "bool",
                           locality=PF_LOCALITY)
            scaled.append((at, kq.scales(at)))
        for lp in range(4):
            p = b.add(b.mul(sb, u.i64(4)), u.i64(lp))
            for h in (0, 1):
                xq, dx, sx = x_half(p, h)
                if kq.per_lane:     # each lane's Σ of x's bytes; −dx for dmin·m·(−dx)
                    sx = b.sitofp(_madd(b, u.const(I8X32, 1), xq), F8)
                    ndx = b.fneg(dx)
                for c, (at, s) in enumerate(scaled):
                    dot, d, m = kq.sub(at, s, 2 * lp + h, xq)
                    step(c, h, dot, d, m if m is None or not kq.per_lane else b.fmul(m, ndx),
                         dx, sx)

    def pair(p, rows, lone=False):
        for h in (0, 1):
            xq, dx, sx = x_half(p, h)
            xs = None if nib else _madd(b, u.const(I8X32, -128), xq)   # 0x80: 128 unsigned
            for c in range(CN):
                if lone and h:     # the zeroed partner
                    dot, d, m = u.const(F8, 0.0), zero8, zero8
                else:
                    at = b.add(rows[c], b.mul(b.add(b.mul(p, u.i64(2)), u.i64(h)),
                                              u.i64(nbytes)))
                    u.prefetch(b, w, b.add(at, ahead), "bool",   # every block: every line
                               locality=PF_LOCALITY)
                    dot = b.sitofp(codes(at, xq, xs), F8)
                    d, m = scales(at)
                step(c, h, dot, d, m, dx, sx)

    with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), items), 1, "q") as q:
        n0 = b.mul(q, u.i64(CN))
        rows = [b.mul(u.smin(b, b.add(n0, u.i64(c)), b.sub(N, u.i64(1))), row_bytes)
                for c in range(CN)]
        for pair_accs in accs:
            for a in pair_accs:
                b.store(zero8, a)
        if bs == 256:
            with u.Loop(b, u.i64(0), b.sdiv(K, u.i64(bs)), 1, "sb") as sb:
                kquant(sb, rows, _KQuant(key.fmt, b, w))
        else:
            with u.Loop(b, u.i64(0), full, 1, "p") as p:
                pair(p, rows)
            with b.if_then(b.icmp_signed("!=", b.mul(full, u.i64(2)), nblk)):
                pair(full, rows, lone=True)
        for c in range(CN):
            with b.if_then(b.icmp_signed("<", b.add(n0, u.i64(c)), N)):
                whole = b.shuffle_vector(b.load(accs[c][0]), b.load(accs[c][1]),
                                         ir.Constant(_v(u.I32, 16), list(range(16))))
                s = lane_tree(b, whole, fadd)
                b.store(s, b.gep(y, [b.add(n0, u.i64(c))], source_etype=u.F32))
