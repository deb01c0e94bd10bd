"""The gemv's register decoders of the K-quant super-blocks (q2_k, q3_k, q4_k, q5_k, q6_k):
a block's 256 weights as 16 vectors of 16 lanes (vector v holds weights 16v .. 16v + 15),
never stored, each lane bitwise the value the block decoder of fucina.codegen.quant gives.

Why not the block decoders themselves: they shift and mask each 16-byte group after a byte
widening, convert, multiply and subtract, and take each group's scale out of a vector (two
shuffles a group); on Zen 4 that is ~11 vector instructions per 16 weights. Here:

- The quant bytes are transposed once per 64 bytes by a byte permute (vpermb, VBMI): dword t
  of the result holds bytes t, 16 + t, 32 + t, 48 + t, so every lane holds the bits of its
  own weight for four groups of 16, and a group's codes are one shift away (`_codes`). Where
  a code has bits in two places (q3_k's hmask, q5_k's qh), they are merged for every byte
  of a register at once (word shifts and a ternlog), not per vector.
- The scales are computed as the decoder computes them, all groups at once, and stored to a
  small stack buffer behind a compiler barrier (`settle`): their broadcasts are loads
  (folded into the arithmetic), not register shuffles.
- Codes become weights through 16-value tables built per group with the decoder's own
  arithmetic (`table`'s exactness argument): q4_k one table per
  32-value sub-block, q5_k a 32-value one (two registers), q2_k four groups of 16 in one
  table (4 values each), q3_k two groups of 8 values. q6_k's 64 values fit no table: its
  codes are assembled 64 at a time in weight order as signed bytes 4·q in the scratch,
  sign-extended by the loads, converted and multiplied by dl/4 (see Q6K).

Each decoder is `Decoder(b, src, scratch)`; `vector(v)` emits vector v, so the gemv can
interleave the vectors of several rows of w. Narrow is the same for 8-lane hosts (AVX2).
"""
from __future__ import annotations

from llvmlite import ir

from . import irutil as u
from .quant import _bytes, _half, _load, _q3_scales, _sbytes

F16V = ir.VectorType(u.F32, 16)
I16V = ir.VectorType(u.I32, 16)
B64 = ir.VectorType(u.I8, 64)
SCRATCH = 80         # floats of stack buffer a decoder needs (scales, negated mins;
                     # q6_k's 4 runs of 64 code bytes from float 16) ...
NARROW_SCRATCH = 32 + 256 // 4   # ... and Narrow's (q2_k's code bytes after 16 scales, 16 mins)
FORMATS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def available() -> bool:
    """The host has what these decoders are written in: 16-lane f32 vectors and the byte
    permute (AVX-512 VBMI; Zen 4 / Zen 5, Ice Lake on). On 8 lanes Narrow decodes them;
    the block decoders run elsewhere."""
    from .target import host
    return host().f32_lanes == 16 and host().has("avx512vbmi")


def _load_bytes(b, src, off, n):
    """n (32 or 64) bytes at src + off as 64 byte lanes (32 bytes: repeated twice)."""
    v = b.load(b.gep(src, [u.i64(off)], source_etype=u.I8), typ=ir.VectorType(u.I8, n))
    v.align = 1
    if n == 64:
        return v
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, 64),
                                              [k % 32 for k in range(64)]))


def _byte_transpose(b, v):
    """64 byte lanes with dword t = bytes (t, 16 + t, 32 + t, 48 + t): one vpermb; every lane
    then holds its own weight's bits."""
    idx = ir.Constant(B64, [16 * (k % 4) + k // 4 for k in range(64)])
    v = u.intrinsic(b, "llvm.x86.avx512.permvar.qi.512", B64, [v, idx], types=[])
    return b.bitcast(v, I16V)


def _transposed(b, src, off, n=64):
    """The n bytes at src + off, byte-transposed (32 bytes: dword t = (t, 16 + t, t, 16 + t))."""
    return _byte_transpose(b, _load_bytes(b, src, off, n))


def _codes(b, v, shift):
    """v moved right by `shift` bits (left when negative): a field's bits to a lane's bottom."""
    if shift > 0:
        return b.lshr(v, u.const(v.type, shift))
    if shift < 0:
        return b.shl(v, u.const(v.type, -shift))
    return v


def _word_shift(b, v, lo, hi):
    """Each dword's low 16-bit word shifted left by `lo` bits, its high word by `hi` (right
    when negative; both the same direction): one vpsllvw / vpsrlvw aligns two fields of
    different positions at once."""
    words = ir.VectorType(u.I16, 32)
    w = b.bitcast(v, words)
    if lo >= 0 and hi >= 0:
        w = b.shl(w, ir.Constant(words, [lo, hi] * 16))
    else:
        assert lo <= 0 and hi <= 0, (lo, hi)
        w = b.lshr(w, ir.Constant(words, [-lo, -hi] * 16))
    return b.bitcast(w, I16V)


def _merge(b, low, high, mask):
    """Bits of `low` where mask is set, of `high` elsewhere: one vpternlogd, called as the
    intrinsic (as and/or, LLVM splits it back into an and plus a ternlog around the shifts)."""
    imm = sum(1 << (4 * a + 2 * h + m) for a in (0, 1) for h in (0, 1) for m in (0, 1)
              if (a if m else h))
    return u.intrinsic(b, "llvm.x86.avx512.pternlog.d.512", I16V,
                       [low, high, u.const(I16V, mask), ir.Constant(u.I32, imm)], types=[])


def permute(b, table, idx):
    """table[idx & 15] per lane (vpermps: it reads an index's low 4 bits only)."""
    return u.intrinsic(b, "llvm.x86.avx512.permvar.sf.512", F16V, [table, idx], types=[])


def permute2(b, lo, hi, idx):
    """(lo ++ hi)[idx & 31] per lane (vpermi2ps: it reads an index's low 5 bits only)."""
    return u.intrinsic(b, "llvm.x86.avx512.vpermi2var.ps.512", F16V, [lo, idx, hi], types=[])


def _barrier(b, buffers):
    """A compiler memory barrier that sees the buffers (so they stay memory, not registers):
    the scales just stored are reloaded as broadcasts from memory (folded into the
    arithmetic), not taken from the vectors they were stored from (register shuffles)."""
    ptr = [buf.type for buf in buffers]
    b.asm(ir.FunctionType(u.VOID, ptr), "", ",".join(["r"] * len(buffers) + ["~{memory}"]),
          list(buffers), True)


def table(b, codes, scale, offset=None):
    """The values a block's codes decode to, codes · scale + offset, as its decoder computes
    them (a product rounded, then a sum rounded) but in one FMA: a code has at most 5 bits
    and the scale at most 17 (an f16 d, times a 6-bit sub-scale), so the product is exact
    in f32 and the FMA's one rounding is the sum's. The FMA runs on the two pipes the
    multiply would; the add it saves shared a pipe with the table permutes (Zen 5). Shared
    by these decoders and quant_gemm's q4 / q5 tables."""
    if offset is None:
        return b.fmul(codes, scale)
    return u.intrinsic(b, "llvm.fma", codes.type, [codes, scale, offset])


def _iota(values):
    """A constant 16-lane f32 vector of the given codes (a table's arguments)."""
    return ir.Constant(F16V, [float(v) for v in values])


class _Decoder:
    """Common part: the block's stack buffer (SCRATCH floats, NARROW_SCRATCH on 8 lanes: its
    scales and negated mins, laid out per format), and broadcasts from it."""

    def __init__(self, b, src, scratch):
        self.b, self.src, self.scratch = b, src, scratch

    def _store(self, v, at):
        st = self.b.store(v, self.b.gep(self.scratch, [u.i64(at)], source_etype=u.F32))
        st.align = 4

    def _bcast(self, at, lanes=1):
        """floats at .. at + lanes − 1 of the buffer, repeated over the W lanes."""
        b, W = self.b, self.W
        v = b.load(b.gep(self.scratch, [u.i64(at)], source_etype=u.F32),
                   typ=ir.VectorType(u.F32, lanes))
        v.align = 4
        return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, W),
                                                  [k % lanes for k in range(W)]))

    W = 16           # lanes of a decoded vector
    vectors = 16     # a block's vectors; vector(v) emits vector v (weights 16v .. 16v + 15)


def _scales_mins_k4(b, src):
    """A q4_k / q5_k block's 8 sub-block scales d·float(sc_j) (lanes 0-7) and negated mins
    −dmin·float(m_j) (lanes 8-15) in one 16-lane vector: the 6-bit pairs unpacked as
    fucina.codegen.quant.scales_mins_k4 unpacks them (ggml's get_scale_min_k4), all 16 at
    once, and each product the decoder's (a negated product is the product by −dmin,
    bitwise: rounding is symmetric). A third of the instructions of the two 8-lane vectors
    the block decoder builds, which cost the gemv ~2 instructions per 16 weights."""
    v = _bytes(b, src, 4, 16)          # the 12 scale bytes q[0..11] (and 4 quant bytes)

    def pick(lanes):
        return b.shuffle_vector(v, v, ir.Constant(I16V, lanes))
    low = pick([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])   # sc_j, m_j low bits
    top = pick([0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])       # their bits 4-5 (j >= 4)
    low = b.lshr(low, ir.Constant(I16V, [0] * 12 + [4] * 4))
    low = b.and_(low, ir.Constant(I16V, ([63] * 4 + [15] * 4) * 2))
    top = b.and_(b.lshr(top, u.const(I16V, 2)), ir.Constant(I16V, ([0] * 4 + [0x30] * 4) * 2))
    pair = b.load(src, typ=ir.VectorType(u.F16, 2))    # d, dmin
    pair.align = 2
    pair = b.fpext(pair, ir.VectorType(u.F32, 2))
    scale = b.shuffle_vector(pair, b.fneg(pair), ir.Constant(I16V, [0] * 8 + [3] * 8))
    return b.fmul(scale, b.sitofp(b.or_(low, top), F16V))


def group_scales(b, src, fmt):
    """(scales, mins) of a K-quant block for its decoders: q2_k / q3_k / q6_k's 16 group
    scales dl = d·float(sc) (q2_k: sc the low nibble, its mins ml = dmin·float(sc >> 4) as
    well, else None); q4_k / q5_k's 8 scales and 8 negated mins in one vector
    (_scales_mins_k4), mins None."""
    if fmt in ("q4_k", "q5_k"):
        return _scales_mins_k4(b, src), None
    if fmt == "q2_k":
        d, dmin = _half(b, src, 80), _half(b, src, 82)
        sc = _bytes(b, src, 0, 16)     # the 16 groups' scale (low nibble) and min (high)
        dls = b.fmul(u.splat(b, d, 16), b.sitofp(b.and_(sc, u.const(I16V, 15)), F16V))
        mls = b.fmul(u.splat(b, dmin, 16), b.sitofp(b.lshr(sc, u.const(I16V, 4)), F16V))
        return dls, mls
    if fmt == "q3_k":
        d = _half(b, src, 108)
        return b.fmul(u.splat(b, d, 16), b.sitofp(_q3_scales(b, src), F16V)), None
    sc = _sbytes(b, src, 192, 16)
    return b.fmul(u.splat(b, _half(b, src, 208), 16), b.sitofp(sc, F16V)), None


class Q4K(_Decoder):
    """q4_k: weight = float(q)·(d·sc) − dmin·m through a table per 32-value sub-block; the
    128 quant bytes as two transposed 64-byte halves (sub-blocks 0-3, 4-7)."""

    QS = 16

    def __init__(self, b, src, scratch):
        super().__init__(b, src, scratch)
        self._store(group_scales(b, src, "q4_k")[0], 0)
        self.q = [None, None]
        self.tables = {}

    def _quants(self, half):
        if self.q[half] is None:
            self.q[half] = _transposed(self.b, self.src, self.QS + 64 * half)
        return self.q[half]

    def table(self, sub):
        if sub not in self.tables:
            self.tables[sub] = table(self.b, _iota(range(16)), self._bcast(sub),
                                          self._bcast(8 + sub))
        return self.tables[sub]

    def nibble(self, v):
        """Codes of vector v (low 4 bits of each lane), and its sub-block."""
        c, r = divmod(v, 4)           # 64-value chunk c: sub-blocks 2c (low nibbles), 2c + 1
        p, i = divmod(r, 2)           # p: high nibble; i: second 16 bytes of the chunk
        shift = 8 * (2 * (c % 2) + i) + 4 * p
        return _codes(self.b, self._quants(c // 2), shift), 2 * c + p

    def vector(self, v):
        idx, sub = self.nibble(v)
        return permute(self.b, self.table(sub), idx)


class Q5K(Q4K):
    """q5_k: as q4_k with the fifth bit from qh (bit 2c + p of byte i of 32), the index of a
    32-value table in two registers. Each byte of a transposed half of the quants gets its
    fifth bit at bit 4 once (per half and nibble: a word shift of the transposed qh and a
    ternlog), so a vector's index is one shift of that merged register."""

    QS = 48

    def __init__(self, b, src, scratch):
        super().__init__(b, src, scratch)
        self.qh = _transposed(b, src, 16, 32)     # byte k of a lane: qh[16·(k % 2) + t]
        self.merged = {}

    def table(self, sub):
        if sub not in self.tables:
            dl, ml = self._bcast(sub), self._bcast(8 + sub)
            self.tables[sub] = [table(self.b, _iota(range(16 * t, 16 * t + 16)), dl, ml)
                                for t in range(2)]
        return self.tables[sub]

    def _merged(self, half, p):
        """Byte k = 2·(c % 2) + i of each lane (chunk c of this half): the 4-bit code of
        sub-block 2c + p with its qh bit (bit 2c + p) as bit 4."""
        if (half, p) not in self.merged:
            b = self.b
            q = _codes(b, self._quants(half), 4 * p)
            bit = 4 * half + p          # qh bit of bytes 0-1; bytes 2-3: bit + 2
            high = _word_shift(b, self.qh, 4 - bit, 2 - bit)
            self.merged[(half, p)] = _merge(b, q, high, 0x0F0F0F0F)
        return self.merged[(half, p)]

    def vector(self, v):
        c, r = divmod(v, 4)
        p, i = divmod(r, 2)
        idx = _codes(self.b, self._merged(c // 2, p), 8 * (2 * (c % 2) + i))
        lo, hi = self.table(2 * c + p)
        return permute2(self.b, lo, hi, idx)


class Q2K(_Decoder):
    """q2_k: weight = float(q)·(d·(sc & 15)) − dmin·(sc >> 4) per 16-value group; one table
    holds groups 4t .. 4t + 3 (vectors 4t .. 4t + 3), entry 4q + slot, so an index is the
    2-bit code moved to bits 2-3 with the group's slot below."""

    def __init__(self, b, src, scratch):
        super().__init__(b, src, scratch)
        dls, mls = group_scales(b, src, "q2_k")
        self._store(dls, 0)
        self._store(b.fneg(mls), 16)
        self.q = _transposed(b, src, 16)
        self.tables = {}

    def vector(self, v):
        t = v // 4
        if t not in self.tables:
            self.tables[t] = table(self.b, _iota([k // 4 for k in range(16)]),
                                        self._bcast(4 * t, 4), self._bcast(16 + 4 * t, 4))
        h, r = divmod(v, 8)
        j, p = divmod(r, 2)
        code = _codes(self.b, self.q, 8 * (2 * h + p) + 2 * j - 2)   # the 2 bits -> bits 2-3
        return permute(self.b, self.tables[t], _merge(self.b, u.const(I16V, v % 4), code, 3))


class Q3K(_Decoder):
    """q3_k: weight = float(q)·(d·(sc − 32)), q = 2-bit code − 4 unless its hmask bit is set.
    The table of groups v and v + 1 (v even: the p = 0 and p = 1 halves of a (h, j)) holds
    float(c − 4)·dl at entry 2c + slot, c = 0..7. For each j one register holds every byte's
    index at once (bit 0 its slot p, bits 1-2 the code, bit 3 the hmask bit): byte
    k = 2h + p of a lane serves vector 8h + 2j + p, one shift away."""

    def __init__(self, b, src, scratch):
        super().__init__(b, src, scratch)
        self._store(group_scales(b, src, "q3_k")[0], 0)
        self.q = _transposed(b, src, 32)          # byte k = 2h + p: qs[32 + 16k + t]
        # hmask with bytes 2-3 (h = 1) moved down 4 bits: bit j of byte k is hmask bit 4h + j
        hm = b.bitcast(_load_bytes(b, src, 0, 32), ir.VectorType(u.I16, 32))
        hm = b.lshr(hm, ir.Constant(ir.VectorType(u.I16, 32), [0] * 16 + [4] * 16))
        self.hm = _byte_transpose(b, b.bitcast(hm, B64))
        self.merged, self.tables = {}, {}

    def _merged(self, j):
        if j not in self.merged:
            b = self.b
            code = _merge(b, _codes(b, self.q, 2 * j - 1), _codes(b, self.hm, j - 3),
                          0x06060606)
            self.merged[j] = _merge(b, code, u.const(I16V, 0x01000100), ~0x01010101)
        return self.merged[j]

    def vector(self, v):
        h, r = divmod(v, 8)
        j, p = divmod(r, 2)
        v0 = v - p
        if v0 not in self.tables:
            self.tables[v0] = table(self.b, _iota([k // 2 - 4 for k in range(16)]),
                                    self._bcast(v0, 2))
        idx = _codes(self.b, self._merged(j), 8 * (2 * h + p))
        return permute(self.b, self.tables[v0], idx)


class Q6K(_Decoder):
    """q6_k: weight = float(q)·(d·sc), q = (low nibble | 2 high bits << 4) − 32, whose 64
    values fit no table. In weight order, the nibbles of ql's half n are weights 128n ..
    128n + 63 (low) and 128n + 64 .. 128n + 127 (high), their qh bits the 2-bit fields of
    qh[32n + i % 32]: per run of 64, every byte becomes 4·q as a signed byte at once (the
    nibble at bits 2-5 by a word shift, the qh field at bits 6-7 with its top bit flipped,
    bits 0-1 cleared: two shifts, a ternlog, an and) and is stored to the scratch. A vector
    is 16 of those bytes sign-extended by the load (vpmovsxbd), converted (4q, exact) and
    multiplied by dl/4 (exact: a power of two), so the product is the decoder's fl(q·dl)
    bit for bit: 0.94 ns per 16 weights where moving each code to a lane's top and back
    (two shifts a vector) took 1.12."""

    def __init__(self, b, src, scratch):
        super().__init__(b, src, scratch)
        dls = group_scales(b, src, "q6_k")[0]
        self._store(b.fmul(dls, u.const(F16V, 0.25)), 0)
        words = ir.VectorType(u.I16, 32)
        for n in range(2):
            ql = b.bitcast(_load_bytes(b, src, 64 * n, 64), words)
            qh = b.xor(_load_bytes(b, src, 128 + 32 * n, 32), ir.Constant(B64, [0xAA] * 64))
            qh = b.bitcast(qh, words)
            for nh in range(2):
                low = (b.shl if nh == 0 else b.lshr)(ql, ir.Constant(words, [2] * 32))
                high = b.shl(qh, ir.Constant(words, [6 - 4 * nh] * 16 + [4 - 4 * nh] * 16))
                code = _merge(b, b.bitcast(low, I16V), b.bitcast(high, I16V), 0x3C3C3C3C)
                code = b.and_(code, u.const(I16V, -0x03030304))     # 0xFCFCFCFC
                self._store(code, 16 + 16 * (2 * n + nh))

    def vector(self, v):
        b = self.b
        n, r = divmod(v, 8)          # weights 128n + 16r: run 2n + r // 4, bytes 16·(r % 4)
        at = 4 * (16 + 16 * (2 * n + r // 4)) + 16 * (r % 4)
        q4 = b.load(b.gep(self.scratch, [u.i64(at)], source_etype=u.I8),
                    typ=ir.VectorType(u.I8, 16))
        q4.align = 1
        return b.fmul(b.sitofp(b.sext(q4, I16V), F16V), self._bcast(v))


DECODERS = {"q2_k": Q2K, "q3_k": Q3K, "q4_k": Q4K, "q5_k": Q5K, "q6_k": Q6K}


BYTE_CODES = ("q2_k", "q3_k", "q5_k", "q6_k")   # Narrow builds their codes in byte lanes


class Narrow(_Decoder):
    """The K-quants on W = 8 lanes (a host without 16-lane permutes: AVX2), each lane the
    block decoder's value: a vector's codes widen to i32 lanes from their bytes (vpmovzxbd)
    and are masked and shifted there (q4_k), or come whole from codes built 32 at a time in
    byte lanes (q2_k, q3_k, q5_k, q6_k: _byte_codes); then converted and scaled through
    `table` (q4_k / q5_k / q2_k: q·dl − ml in one FMA, exact as argued there; q6_k:
    (q − 32)·dl, q3_k: q·dl with q −4 .. 3), the group scales (and negated mins) broadcast
    from the scratch as the 16-lane decoders do. On Zen 3 the block decoders' 16- and
    32-lane shuffles and the trip through a stack buffer ran these at ~0.5x torch's f32
    matvec; the byte codes made q3_k's gemv 1.45x and q2_k's 1.1x faster again (one
    thread, [1536, 768] and [768, 1536]: 170 -> 115 µs and 119 -> 107 µs)."""

    def __init__(self, b, fmt, src, scratch, W):
        super().__init__(b, src, scratch)
        self.fmt, self.W = fmt, W
        self.vectors = 256 // W
        scales, mins = group_scales(b, src, fmt)
        self.codes_at = 64 if mins is None else 128   # bytes: the codes follow the 16 scales
        if mins is not None:   # q2_k: its 16 negated mins come between them
            self._store(b.fneg(mins), 16)
        if fmt in BYTE_CODES:
            self._byte_codes()
        self._store(scales, 0)

    def _byte_codes(self):
        """The 256 codes of a q2_k, q3_k, q5_k or q6_k block in weight order as bytes (q6_k:
        q − 32, q3_k: q − 4, signed), stored to the scratch after the scales (codes_at), 32 at
        a time in byte lanes: vector() then widens 8 of them by one extending load, where
        shifting and masking their i32 lanes took three to seven instructions (q6_k: weights
        128n + 32r .. + 31 are nibble r // 2 of ql[64n + 32·(r % 2) ..] and bits 2r of
        qh[32n ..]; q5_k: weights 64c + 32p .. + 31 nibble p of ql[32c ..] and bit 2c + p of
        qh[0 ..]; q2_k / q3_k: weights 128h + 32j .. + 31 bits 2j of qs[32h ..], and for
        q3_k bit 4h + j of hmask[0 ..], which adds the 4 back)."""
        b = self.b
        t = ir.VectorType(u.I8, 32)

        def load(off):
            return _load(b, self.src, off, t)

        def store(code, run):
            st = b.store(code, b.gep(self.scratch, [u.i64(self.codes_at + 32 * run)],
                                     source_etype=u.I8))
            st.align = 1

        if self.fmt in ("q2_k", "q3_k"):
            hmask = load(0) if self.fmt == "q3_k" else None
            for h in range(2):
                qs = load((16 if self.fmt == "q2_k" else 32) + 32 * h)
                for j in range(4):
                    code = self._field(qs, 2 * j, 3)
                    if self.fmt == "q3_k":
                        code = b.sub(b.or_(code, self._field(hmask, 4 * h + j - 2, 4)),
                                     u.const(t, 4))
                    store(code, 4 * h + j)
            return
        if self.fmt == "q5_k":
            qh = load(16)
            for c in range(4):
                for p in range(2):
                    low = self._field(load(48 + 32 * c), 4 * p, 15)
                    store(b.or_(low, self._field(qh, 2 * c + p - 4, 16)), 2 * c + p)
            return
        for n in range(2):
            qh = load(128 + 32 * n)
            for r in range(4):
                low = self._field(load(64 * n + 32 * (r % 2)), 4 * (r // 2), 15)
                code = b.sub(b.or_(low, self._field(qh, 2 * r - 4, 0x30)), u.const(t, 32))
                store(code, 4 * n + r)

    def _bytes(self, off):
        return _bytes(self.b, self.src, off, self.W)

    def _field(self, v, shift, mask):
        """(v >> shift) & mask, shift < 0 a left shift."""
        return self.b.and_(_codes(self.b, v, shift), u.const(v.type, mask))

    def vector(self, v):
        b, W = self.b, self.W
        w0 = v * W
        fw = ir.VectorType(u.F32, W)
        if self.fmt in BYTE_CODES:   # codes from _byte_codes
            q = b.load(b.gep(self.scratch, [u.i64(self.codes_at + w0)], source_etype=u.I8),
                       typ=ir.VectorType(u.I8, W))
            q.align = 1
            iw = ir.VectorType(u.I32, W)
            if self.fmt in ("q3_k", "q6_k"):   # signed codes, a scale per 16 weights
                return table(b, b.sitofp(b.sext(q, iw), fw), self._bcast(w0 // 16))
            if self.fmt == "q2_k":   # a scale and a (negated) min per 16 weights
                return table(b, b.sitofp(b.zext(q, iw), fw), self._bcast(w0 // 16),
                             self._bcast(16 + w0 // 16))
            return table(b, b.sitofp(b.zext(q, iw), fw), self._bcast(w0 // 32),
                         self._bcast(8 + w0 // 32))
        c, r = divmod(w0, 64)       # q4_k: weight 64c + 32p + k is nibble p of ql[32c + k]
        p, k = divmod(r, 32)
        q = self._field(self._bytes(16 + 32 * c + k), 4 * p, 15)
        return table(b, b.sitofp(q, fw), self._bcast(2 * c + p), self._bcast(8 + 2 * c + p))


def prepare(b, fmt, src, scratch, W=16):
    """The decoder of the block at src (its scales stored to scratch, SCRATCH floats): the
    16-lane one, or on W = 8 lanes Narrow."""
    if W < 16:
        return Narrow(b, fmt, src, scratch, W)
    return DECODERS[fmt](b, src, scratch)


def settle(b, buffers):
    """Call once after every block of an iteration is prepared (see _barrier)."""
    _barrier(b, buffers)
