"""bf16 GEMM kernels: both operands rounded to bf16 when packed, products summed in f32 through
AVX-512 BF16's dot instruction (vdpbf16ps), or its exact emulation where the host lacks it.

The exec layer (fucina/exec/matmul_bf16.py) views a[M, K] (f32) and b[K, N] (f32 or bf16)
with any element strides and computes a contiguous f32 c[M, N]. Two families:

  gemm_bf16_pack  copies an operand into panels of `width` rows along its free axis (A: MR rows
                  of a; B: NR columns of b), as bf16 k-pairs: one 32-bit word per (pair, row)
                  holds k = 2p in its low half and k = 2p + 1 in its high half (zero past K).
                  Layout: P[kb][panel][p - kb*KC/2][w] (words); `wide` (the emulation's):
                  P[kb][panel][2(p - kb*KC/2) + j][w], j = 0 the odd element, 1 the even, each
                  an f32. An f32 value becomes bf16 by the round-to-nearest-even of
                  Tensor.to("bf16") (SPEC R-9: NaN kept quiet); then any bf16 denormal becomes
                  a zero of its sign (the instruction reads them as zeros).
  gemm_bf16_tile  the f32 GEMM's tile structure (fucina.codegen.gemm): one chunk = one (MC-row,
                  NC-column) tile of C, for each KC block in increasing order, NR panels of B,
                  MR panels of A, MR x NR f32 accumulators; for each k pair in increasing order
                  acc = dpbf16(acc, a pair, b pair). A comes packed by gemm_bf16_pack; each
                  KC x NR panel of B is packed by the same loops straight from b into a 32 KiB
                  stack buffer (L1) where the MR panels of A run over it: the frozen weight is
                  read once per M block, never written back packed. Partial sums of earlier KC
                  blocks go to C and are reloaded (exact). The k order is fixed, the chunk grid
                  depends on the problem size only: bitwise identical for any thread count.

What vdpbf16ps computes, probed on this project's Zen 5 host (tests/test_gemm_bf16.py keeps the
probe): per f32 lane, acc' = R(R(acc + a₁·b₁) + a₀·b₀) — the odd element of the pair first,
each product exact (a bf16 product fits in 16 bits), each sum rounded once to nearest even,
then flushed to a zero of its sign when tiny, tininess judged after rounding with an unbounded
exponent (a sum just below 2^-126 that rounds up to it stays); bf16 denormal inputs and a
denormal acc read as zeros. That is Intel's pseudo-code; products that are themselves below the
f32 range still count exactly. The emulation (`native=False`, hosts without the instruction)
computes the same bits at the f32 GEMM's rate: both operands are packed `wide`, one f32 slot per
element (the bf16 widened exactly), each pair's odd element before its even one, and the
micro-kernel runs plain FMAs (the exact product added, rounded once) with the thread's MXCSR in
flush-to-zero / denormals-are-zero mode for its k loop. x86 judges tininess after rounding with
an unbounded exponent, so a tiny sum becomes a zero of its sign exactly where the instruction's
does, the band just below 2^-126 included; the caller's mode is back before any store adds to
C. Its k blocks are WIDE_KC long (the same bytes per panel). NaN results are NaN in both, their
payloads may differ.

Argument blocks are documented at each key.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .gemm import (add_rank, by_height, chunk_block, lanes, mask_upto, next_tile_offset,
                   prefetch_next_tile, rank_block, row_masks, transpose, zero_mask)
from .kernels import KernelKey, register
from .target import host

KC = 512          # at most this many k per block (even): a KC x NR panel of B is 32 KiB of
                  # bf16 pairs, in L1 (exec splits K into equal even blocks up to KC) ...
WIDE_KC = 256     # ... and as the emulation's f32 slots, as many bytes at half the k
NR_VECS = 2       # vectors of f32 accumulators across the micro-tile (NR = NR_VECS * lanes)
UNROLL = 2        # k pairs per iteration of the micro-kernel's loop
EDGE_ROWS = (4, 8, 12)   # heights of the last panel's micro-tile (gemm.by_height): 50 rows
                         # = 3 x 14 + 8, 256 = 18 x 14 + 4
PANEL_PF_LOCALITY = 2   # the next panel of b is prefetched into L2 (prefetcht1), as
                        # gemm_tile_direct's (LoRA step, bf16 compute, all seven, seq 50:
                        # 1 thread 268 -> 254 ms, 2 threads 216/175 -> 200/165)
PF_ROWS = 16      # packing along rows far apart (wvec): prefetch this many rows ahead ...
PF_K = 128        # ... along k-contiguous rows (kvec): this many elements ahead
FTZ_DAZ = 0x8040  # MXCSR: flush-to-zero (bit 15) and denormals-are-zero (bit 6)


def native() -> bool:
    """The host has vdpbf16ps on 512-bit vectors (Zen 4 / Zen 5, Sapphire Rapids)."""
    return host().vector_bits == 512 and host().has("avx512bf16")


def kc_of(native: bool) -> int:
    """The longest k block of the instruction's layout, or of the emulation's."""
    return KC if native else WIDE_KC


def pair_words(wide: bool) -> int:
    """Words a k pair of one panel row takes: the bf16 pair, or the emulation's two f32
    slots (_put)."""
    return 2 if wide else 1


def mr() -> int:
    """MR x NR_VECS accumulators + NR_VECS B vectors + a broadcast in 32 zmm (14 x 2 + 3)."""
    return 14 if host().vector_bits >= 512 else 6


def nr() -> int:
    return NR_VECS * lanes()


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no such type): only the intrinsic's signature needs it."""

    def __str__(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _iv(W):
    return ir.VectorType(u.I32, W)


def _fv(W):
    return ir.VectorType(u.F32, W)


def _flush16(b, h):
    """bf16 bits (i16 lanes): a denormal becomes a zero of its sign."""
    t = h.type
    den = b.icmp_unsigned("==", b.and_(h, u.const(t, 0x7F80)), u.const(t, 0))
    return b.select(den, b.and_(h, u.const(t, 0x8000)), h)


def _convert_native(b, v):
    """f32 lanes (W or 2W) -> flushed bf16 bits by vcvtneps2bf16 / vcvtne2ps2bf16: the same
    nearest-even rounding and quiet NaN as u.narrow, and a denormal input becomes a zero of its
    sign, as the flush after u.narrow makes it — except the f32 denormals that round up to
    2^-126 (magnitude bits 0x7F8000..0x7FFFFF), which stay 2^-126: put back by one select."""
    n, W = v.type.count, lanes()
    fv = _fv(W)
    if n == W:
        name, args = "llvm.x86.avx512bf16.cvtneps2bf16.512", [v]
    else:
        name = "llvm.x86.avx512bf16.cvtne2ps2bf16.512"
        args = [b.shuffle_vector(v, v, ir.Constant(_iv(W), list(range(o, o + W))))
                for o in (W, 0)]                       # (high half, low half)
    vb = ir.VectorType(_BFloat(), n)
    fn = b.module.globals.get(name) or ir.Function(
        b.module, ir.FunctionType(vb, [fv] * len(args)), name=name)
    t16, t32 = ir.VectorType(u.I16, n), ir.VectorType(u.I32, n)
    h = b.bitcast(b.call(fn, args), t16)
    mag = b.and_(b.bitcast(v, t32), u.const(t32, 0x7FFFFFFF))
    up = b.icmp_unsigned("<", b.sub(mag, u.const(t32, 0x7F8000)), u.const(t32, 0x8000))
    return b.select(up, b.or_(h, u.const(t16, 0x80)), h)


def load_bits(b, base, index, dt, n, mask=None):
    """n elements of an f32 or bf16 array as flushed bf16 bits (<n x i16>), f32 rounded to
    nearest even (u.narrow, or the convert instruction where the host has it: the same bits);
    masked-off lanes read zero."""
    if dt == "f32":
        v = u.load(b, base, index, "f32", n, mask)
        if native() and n in (lanes(), 2 * lanes()):
            return _convert_native(b, v)
        h = u.narrow(b, v, "bf16")
    else:
        st = ir.VectorType(u.I16, n)
        p = b.gep(base, [index], source_etype=u.I16)
        if mask is None:
            h = b.load(p, typ=st)
            h.align = 2
        else:
            h = u.intrinsic(b, "llvm.masked.load", st, [p, ir.Constant(u.I32, 2), mask,
                                                        u.const(st, 0)], types=[st, u.PTR])
    return _flush16(b, h)


def _load_bit(b, base, index, dt):
    """One element as flushed bf16 bits (i16)."""
    if dt == "f32":
        h = u.narrow(b, u.load(b, base, index, "f32"), "bf16")
    else:
        h = b.load(b.gep(base, [index], source_etype=u.I16), typ=u.I16)
    return _flush16(b, h)


def _pair(b, lo, hi):
    """Two i16 (vectors) -> the i32 word(s) holding lo in the low half, hi in the high half."""
    t = ir.VectorType(u.I32, lo.type.count) if isinstance(lo.type, ir.VectorType) else u.I32
    return b.or_(b.zext(lo, t), b.shl(b.zext(hi, t), u.const(t, 16)))


# ---------------------------------------------------------------------------------------------
# packing

@register
@dataclass(frozen=True)
class GemmBf16PackKey(KernelKey):
    """Copy an operand into bf16 pair panels of `width` along its free axis (module docstring).

    Arguments: 0 src, 1 dst, 2 rows (extent along the panel width), 3 K, 4 s_w, 5 s_k, 6 KC
    (even), 7 panels, 8 panels per chunk, 9 panel groups. Chunk c = kb * groups + g packs KC
    block kb of panels [g*per, (g+1)*per).
      wvec — unit stride along the width: vector loads of two k rows, interleaved;
      kvec — unit stride along k: W rows x W pairs loaded along k, transposed in registers;
      any  — scalar loads.
    """
    family = "gemm_bf16_pack"
    dtype: str    # source dtype: f32 | bf16
    width: int
    mode: str     # wvec | kvec | any
    wide: bool = False   # the emulation's layout: two f32 slots per pair (_put)
    tiles: bool = False  # AMX B tiles (gemm_bf16_amx): each block's pairs padded with zero words
                         # to a multiple of 16, so a tile of 16 pair rows never reads past it

    def ir(self, symbol: str) -> str:
        return str(_build_pack(self, symbol))


def _build_pack(key: GemmBf16PackKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    Wp, dt = key.width, key.dtype
    src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    rows, K, s_w, s_k, KC, npan, per, ngroups = (u.arg(b, args, i) for i in range(2, 10))
    one = u.i64(1)
    ppad = b.mul(npan, u.i64(Wp))
    nkb = b.sdiv(b.add(K, b.sub(KC, one)), KC)
    with u.Loop(b, c0, c1, 1, "q") as q:
        grp = b.srem(q, ngroups)
        kb = b.sdiv(q, ngroups)
        p0 = b.mul(grp, per)
        p1 = u.smin(b, b.add(p0, per), npan)
        k0 = b.mul(kb, KC)
        kcl = u.smin(b, KC, b.sub(K, k0))
        kpl = b.sdiv(b.add(kcl, one), u.i64(2))             # pairs in this block
        F = pair_words(key.wide)
        blk = b.mul(b.mul(b.sdiv(k0, u.i64(2)), ppad), u.i64(F))   # words before this block
        rows_pad = kpl
        if key.tiles:
            rows_pad = b.mul(b.sdiv(b.add(kpl, u.i64(15)), u.i64(16)), u.i64(16))
        pstride = b.mul(rows_pad, u.i64(F * Wp))
        sk0 = b.mul(k0, s_k)
        with u.Loop(b, p0, p1, 1, "p") as p:
            w0 = b.mul(p, u.i64(Wp))
            wvalid = u.smin(b, u.i64(Wp), b.sub(rows, w0))
            panel = b.add(blk, b.mul(p, pstride))
            sbase = b.add(sk0, b.mul(w0, s_w))
            if key.mode == "wvec":
                _pack_wvec(b, src, dst, sbase, panel, kpl, kcl, wvalid, s_k, Wp, dt, W, key.wide)
            elif key.mode == "kvec":
                _pack_kvec(b, src, dst, sbase, panel, kcl, wvalid, s_w, Wp, dt, W, key.wide)
            else:
                _pack_any(b, src, dst, sbase, panel, kpl, kcl, wvalid, s_w, s_k, Wp, dt,
                          key.wide)
            if key.tiles:
                zero_rows(b, dst, panel, kpl, rows_pad, Wp)
    b.ret_void()
    return mod


def zero_rows(b, dst, panel, kp0, kp1, Wp):
    """Pair rows kp0 .. kp1 - 1 of the Wp-word panel at word `panel` of dst set to zero words
    (the padding of AMX B tiles past K)."""
    W = lanes()
    with u.Loop(b, kp0, kp1, 1, "zp") as kp:
        for v in range(-(-Wp // W)):
            sm = None if Wp - v * W >= W else u.tail_mask(b, u.i64(Wp - v * W), W)
            _put(b, dst, b.add(b.add(panel, b.mul(kp, u.i64(Wp))), u.i64(v * W)),
                 u.const(_iv(W), 0), Wp, False, sm)


def _put(b, dst, at, word, Wp, wide, mask=None):
    """Pair word(s) (i32 or <W x i32>) to word `at` of a panel — as they are, or `wide`: as two
    f32 slots Wp words apart, the odd element first (the order the instruction adds them),
    each a bf16 widened exactly (its bits in the high half)."""
    if wide:
        t = word.type
        parts = ((at, b.and_(word, u.const(t, -65536))),
                 (b.add(at, u.i64(Wp)), b.shl(word, u.const(t, 16))))
    else:
        parts = ((at, word),)
    for i, w in parts:
        p = b.gep(dst, [i], source_etype=u.I32)
        if mask is None:
            s = b.store(w, p)
            s.align = 4
        else:
            u.intrinsic(b, "llvm.masked.store", u.VOID, [w, p, ir.Constant(u.I32, 4), mask],
                        types=[w.type, u.PTR])


def _pack_wvec(b, src, dst, sbase, panel, kpl, kcl, wvalid, s_k, Wp, dt, W, wide):
    nvec = -(-Wp // W)
    F = pair_words(wide)
    with u.Loop(b, u.i64(0), kpl, 1, "kp") as kp:
        k = b.mul(kp, u.i64(2))
        row0 = b.add(sbase, b.mul(k, s_k))
        row1 = b.add(row0, s_k)
        has1 = b.icmp_signed("<", b.add(k, u.i64(1)), kcl)
        # rows far apart: fetch the piece PF_ROWS rows on (its lines are in no stream yet)
        ahead = b.add(row0, b.mul(u.i64(PF_ROWS), s_k))
        for line in range(-(-(Wp * u.ITEMSIZE[dt]) // 64)):
            u.prefetch(b, src, b.add(ahead, u.i64(line * 64 // u.ITEMSIZE[dt])), dt)
            u.prefetch(b, src, b.add(b.add(ahead, s_k), u.i64(line * 64 // u.ITEMSIZE[dt])), dt)
        for v in range(nvec):
            m = mask_upto(b, b.sub(wvalid, u.i64(v * W)), W)
            lo = load_bits(b, src, b.add(row0, u.i64(v * W)), dt, W, m)
            # the odd row past K reads nothing (its address may lie past the operand)
            m1 = b.select(has1, m, zero_mask(W))
            hi = load_bits(b, src, b.select(has1, b.add(row1, u.i64(v * W)), row0), dt, W, m1)
            sm = None if Wp - v * W >= W else u.tail_mask(b, u.i64(Wp - v * W), W)
            at = b.add(b.add(panel, b.mul(kp, u.i64(F * Wp))), u.i64(v * W))
            _put(b, dst, at, _pair(b, lo, hi), Wp, wide, sm)


def _pack_kvec(b, src, dst, sbase, panel, kcl, wvalid, s_w, Wp, dt, W, wide):
    """Unit stride along k: for each group of W rows, 2W consecutive k of every row (W pairs)
    are loaded and transposed, so each vector holds one pair of W rows. A group of 2W k of
    all Wp rows (every one but a panel's last or a block's last) takes unmasked loads and
    unconditional stores."""
    nvec = -(-Wp // W)
    F = pair_words(wide)
    iv = _iv(W)
    zero2 = ir.Constant(ir.VectorType(u.I1, 2 * W), [ir.Constant(u.I1, 0)] * (2 * W))
    for g in range(nvec):
        width_g = min(W, Wp - g * W)
        sm = None if width_g == W else u.tail_mask(b, u.i64(width_g), W)

        def group(kt, kn, full):
            kmask = None if full else u.tail_mask(b, kn, 2 * W)
            vecs = []
            for t in range(W):
                w = g * W + t
                if w >= Wp:
                    vecs.append(u.const(iv, 0))
                    continue
                m = None if full else b.select(b.icmp_signed("<", u.i64(w), wvalid), kmask,
                                               zero2)
                at = b.add(b.add(sbase, b.mul(u.i64(w), s_w)), kt)
                u.prefetch(b, src, b.add(at, u.i64(PF_K)), dt)
                h = load_bits(b, src, at, dt, 2 * W, m)
                vecs.append(b.bitcast(h, iv))           # little endian: even k in the low half
            cols = transpose(b, vecs)
            npairs = b.sdiv(b.add(kn, u.i64(1)), u.i64(2))
            kp0 = b.sdiv(kt, u.i64(2))
            for j in range(W):
                def put():
                    at = b.add(panel, b.add(b.mul(b.add(kp0, u.i64(j)), u.i64(F * Wp)),
                                            u.i64(g * W)))
                    _put(b, dst, at, cols[j], Wp, wide, sm)
                if full:
                    put()
                else:
                    with b.if_then(b.icmp_signed("<", u.i64(j), npairs)):
                        put()

        with u.Loop(b, u.i64(0), kcl, 2 * W, f"kt{g}") as kt:
            kn = u.smin(b, u.i64(2 * W), b.sub(kcl, kt))
            full = b.and_(b.icmp_signed("==", kn, u.i64(2 * W)),
                          b.icmp_signed(">=", wvalid, u.i64(min(Wp, (g + 1) * W))))
            with b.if_else(full) as (fast, slow):
                with fast:
                    group(kt, kn, True)
                with slow:
                    group(kt, kn, False)


def _pack_any(b, src, dst, sbase, panel, kpl, kcl, wvalid, s_w, s_k, Wp, dt, wide):
    with u.Loop(b, u.i64(0), kpl, 1, "kp") as kp:
        k = b.mul(kp, u.i64(2))
        with u.Loop(b, u.i64(0), u.i64(Wp), 1, "w") as w:
            slot = u.entry_alloca(b, u.I32)
            b.store(u.const(u.I32, 0), slot)
            with b.if_then(b.icmp_signed("<", w, wvalid)):
                at = b.add(sbase, b.add(b.mul(w, s_w), b.mul(k, s_k)))
                lo = _load_bit(b, src, at, dt)
                hslot = u.entry_alloca(b, u.I16)
                b.store(u.const(u.I16, 0), hslot)
                with b.if_then(b.icmp_signed("<", b.add(k, u.i64(1)), kcl)):
                    b.store(_load_bit(b, src, b.add(at, s_k), dt), hslot)
                b.store(_pair(b, lo, b.load(hslot)), slot)
            _put(b, dst, b.add(panel, b.add(b.mul(kp, u.i64(pair_words(wide) * Wp)), w)),
                 b.load(slot), Wp, wide)


# ---------------------------------------------------------------------------------------------
# the tile kernel

@register
@dataclass(frozen=True)
class GemmBf16TileKey(KernelKey):
    """C tiles from A's pair panels and b itself (module docstring).

    Arguments: 0 Ap, 1 b, 2 C, 3 M, 4 N, 5 K, 6 KC (even), 7 MC, 8 NC, 9 M blocks, 10 N
    blocks, 11 M blocks fastest (else N blocks fastest) in the chunk order, 12 s_bk, 13 s_bn
    (b's element strides), 14 continue: a k slice after the first, whose sums start from
    the partial sums the previous slice left in C (the chain goes on: the bits of one pass).
    C contiguous [M, N].
    native: vdpbf16ps (AVX-512 BF16) or its FMA emulation — the same bits. b_mode: how b's
    panels are packed (gemm_bf16_pack's modes: wvec = unit stride along n, kvec = along k).
    accumulate (one k slice): C += the product, each final sum added to C's value as it is
    stored (one rounding: the bits of the product added after it); 15 = P, a contiguous
    [M, N] place for the partial sums of earlier KC blocks (C when K is one block).
    ranked (one k slice): the argument block after those (gemm.rank_block) adds s·(x·y) to
    each final result as it is stored (gemm.add_rank: the bits of the separate pass after).
    """
    family = "gemm_bf16_tile"
    mr: int
    nr_vecs: int
    unroll: int
    native: bool
    b_dtype: str   # f32 | bf16
    b_mode: str    # wvec | kvec | any
    pf_c: bool = False   # prefetch the next micro-tile's C lines (gemm.prefetch_next_tile)
    accumulate: bool = False
    ranked: bool = False

    def ir(self, symbol: str) -> str:
        return str(_build_tile(self, symbol))


def _next_panel_lines(b, key, src, sbase, kcl, wvalid, s_bk, s_bn, ok):
    """(line count, prefetch(line)) of the KC x NR panel of b at sbase: kvec — wvalid rows of
    kcl k-contiguous elements; wvec — kcl rows of wvalid n-contiguous ones. No lines unless
    `ok` (there is a next panel)."""
    dt = key.b_dtype
    epl = 64 // u.ITEMSIZE[dt]                     # elements per cache line
    if key.b_mode == "kvec":
        per_row = b.sdiv(b.add(kcl, u.i64(epl - 1)), u.i64(epl))
        rows, stride = wvalid, s_bn
    else:
        per_row = b.sdiv(b.add(wvalid, u.i64(epl - 1)), u.i64(epl))
        rows, stride = kcl, s_bk
    total = b.select(ok, b.mul(rows, per_row), u.i64(0))

    def prefetch_line(ln):
        r = b.sdiv(ln, per_row)
        e = b.mul(b.srem(ln, per_row), u.i64(epl))
        u.prefetch(b, src, b.add(sbase, b.add(b.mul(r, stride), e)), dt,
                   locality=PANEL_PF_LOCALITY)
    return total, prefetch_line


def _dp_native(b, W):
    vb = ir.VectorType(_BFloat(), 2 * W)
    fv = _fv(W)
    name = "llvm.x86.avx512bf16.dpbf16ps.512"
    fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(fv, [fv, vb, vb]),
                                                   name=name)

    def dp(acc, a, bv):
        return b.call(fn, [acc, b.bitcast(a, vb), b.bitcast(bv, vb)])
    return dp


def _flush_mode(b):
    """(on, off): calls that switch this thread's MXCSR to flush tiny results to zero and read
    denormal inputs as zero (FTZ | DAZ; x86 judges tininess after rounding, with an unbounded
    exponent: the instruction's flush), and back to the caller's mode. The state is read once
    at the kernel's entry."""
    old, ftz = (u.entry_alloca(b, u.I32, name) for name in ("old", "ftz"))

    def fn(name):
        return b.module.globals.get(name) or ir.Function(
            b.module, ir.FunctionType(u.VOID, [u.PTR]), name=name)
    b.call(fn("llvm.x86.sse.stmxcsr"), [old])
    b.store(b.or_(b.load(old), u.const(u.I32, FTZ_DAZ)), ftz)
    ld = fn("llvm.x86.sse.ldmxcsr")
    return (lambda: b.call(ld, [ftz])), (lambda: b.call(ld, [old]))


def _build_tile(key: GemmBf16TileKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    R, V, U = key.mr, key.nr_vecs, key.unroll
    fv, iv = _fv(W), _iv(W)
    NRc = V * W
    Ap, Bsrc, C = (u.arg_ptr(b, args, i) for i in range(3))
    M, N, K, kc, MC, NC, nmb, nnb, mfast, s_bk, s_bn, cflag = (u.arg(b, args, i)
                                                               for i in range(3, 15))
    cont = b.icmp_signed("!=", cflag, u.i64(0))
    Mp = b.mul(b.sdiv(b.add(M, u.i64(R - 1)), u.i64(R)), u.i64(R))
    # where the partial sums of earlier KC blocks wait: C itself, or P when C is added to
    part = u.arg_ptr(b, args, 15) if key.accumulate else C
    rk = rank_block(b, args, 16 if key.accumulate else 15) if key.ranked else None
    last_row = b.sub(M, u.i64(1))
    wide = not key.native
    F = pair_words(wide)
    if wide:
        flush_on, flush_off = _flush_mode(b)
    else:
        dp = _dp_native(b, W)
    bp = u.entry_alloca(b, ir.ArrayType(u.I32, kc_of(key.native) // 2 * F * NRc))
    bp.align = 64
    bp.type = u.PTR
    accs = [[u.entry_alloca(b, fv, f"acc{r}_{v}") for v in range(V)] for r in range(R)]
    two = u.i64(2)

    with u.Loop(b, c0, c1, 1, "c") as c:
        row0, row1, col0, col1 = chunk_block(b, c, mfast, nmb, nnb, MC, NC, M, N)
        with u.Loop(b, u.i64(0), K, kc, "k0") as k0:
            kcl = u.smin(b, kc, b.sub(K, k0))
            kpl = b.sdiv(b.add(kcl, u.i64(1)), two)
            first = b.and_(b.icmp_signed("==", k0, u.i64(0)), b.not_(cont))
            last = b.icmp_signed(">=", b.add(k0, kcl), K)
            kp0 = b.sdiv(k0, two)
            ablk = b.mul(b.mul(kp0, Mp), u.i64(F))
            with u.Loop(b, col0, col1, NRc, "j0") as j0:
                nvalid = b.sub(N, j0)
                # this KC x NR panel of b, packed into the stack buffer
                sbase = b.add(b.mul(k0, s_bk), b.mul(j0, s_bn))
                wvalid = u.smin(b, u.i64(NRc), nvalid)
                if key.b_mode == "wvec":
                    _pack_wvec(b, Bsrc, bp, sbase, u.i64(0), kpl, kcl, wvalid, s_bk, NRc,
                               key.b_dtype, W, wide)
                elif key.b_mode == "kvec":
                    _pack_kvec(b, Bsrc, bp, sbase, u.i64(0), kcl, wvalid, s_bn, NRc,
                               key.b_dtype, W, wide)
                else:
                    _pack_any(b, Bsrc, bp, sbase, u.i64(0), kpl, kcl, wvalid, s_bn, s_bk, NRc,
                              key.b_dtype, wide)
                cmask = [mask_upto(b, b.sub(nvalid, u.i64(v * W)), W) for v in range(V)]
                pf = None
                if key.b_mode in ("wvec", "kvec"):
                    # the next panel: along this block's columns, else the next k block's
                    # first, else the first of the columns after this chunk's
                    nxt = b.add(j0, u.i64(NRc))
                    in_blk = b.icmp_signed("<", nxt, col1)
                    k1 = b.add(k0, kc)
                    in_k = b.icmp_signed("<", k1, K)
                    pk = b.select(in_blk, k0, b.select(in_k, k1, u.i64(0)))
                    pj = b.select(in_blk, nxt, b.select(in_k, col0, col1))
                    pkl = u.smin(b, kc, b.sub(K, pk))
                    pf = _next_panel_lines(b, key, Bsrc, b.add(b.mul(pk, s_bk), b.mul(pj, s_bn)),
                                           pkl, u.smin(b, u.i64(NRc), b.sub(N, pj)), s_bk, s_bn,
                                           b.icmp_signed("<", pj, N))
                n_i0 = b.sdiv(b.add(b.sub(row1, row0), u.i64(R - 1)), u.i64(R))
                with u.Loop(b, row0, row1, R, "i0") as i0:
                    if pf is not None:
                        # a share of the next panel's lines on their way while this one computes
                        total, prefetch_line = pf
                        per = b.sdiv(b.add(total, b.sub(n_i0, u.i64(1))), n_i0)
                        l0 = b.mul(b.sdiv(b.sub(i0, row0), u.i64(R)), per)
                        with u.Loop(b, l0, u.smin(b, b.add(l0, per), total), 1, "pf") as ln:
                            prefetch_line(ln)
                    mvalid = b.sub(M, i0)
                    ap = b.gep(Ap, [b.add(ablk, b.mul(b.mul(i0, kpl), u.i64(F)))],
                               source_etype=u.I32)
                    coff = b.add(b.mul(i0, N), j0)
                    if key.pf_c:
                        prefetch_next_tile(b, C, next_tile_offset(b, i0, j0, row0, row1, N, R,
                                                                  NRc), N, R, NRc)

                    def micro(Rk):
                        """The micro-tile on its first Rk rows (gemm.by_height)."""
                        masks = row_masks(b, mvalid, cmask, Rk)

                        def cidx(r, v):
                            return b.add(coff, b.add(b.mul(u.i64(r), N), u.i64(v * W)))

                        with b.if_else(first) as (then, other):
                            with then:
                                for r in range(Rk):
                                    for v in range(V):
                                        b.store(u.const(fv, 0.0), accs[r][v])
                            with other:
                                for r in range(Rk):
                                    for v in range(V):
                                        b.store(u.load(b, part, cidx(r, v), "f32", W,
                                                       masks[r][v]), accs[r][v])

                        def step(kk):
                            """One k pair's word (native), one element's f32 slot (wide)."""
                            bv = []
                            for v in range(V):
                                x = b.load(b.gep(bp, [b.add(b.mul(kk, u.i64(NRc)), u.i64(v * W))],
                                                 source_etype=u.I32), typ=fv if wide else iv)
                                x.align = 4
                                bv.append(x)
                            for r in range(Rk):
                                a = b.load(b.gep(ap, [b.add(b.mul(kk, u.i64(R)), u.i64(r))],
                                                 source_etype=u.I32), typ=u.F32 if wide else u.I32)
                                av = u.splat(b, a, W)
                                for v in range(V):
                                    acc = b.load(accs[r][v])
                                    b.store(u.intrinsic(b, "llvm.fma", fv, [av, bv[v], acc])
                                            if wide else dp(acc, av, bv[v]), accs[r][v])

                        if wide:
                            flush_on()
                        u.unrolled(b, u.i64(0), b.mul(kpl, u.i64(F)), F * U, step)
                        if wide:
                            flush_off()

                        def store(ptr, add=False):
                            for r in range(Rk):
                                for v in range(V):
                                    x = b.load(accs[r][v])
                                    if add:
                                        x = b.fadd(u.load(b, ptr, cidx(r, v), "f32", W,
                                                          masks[r][v]), x)
                                    u.store(b, x, ptr, cidx(r, v), "f32", masks[r][v])

                        if not key.accumulate:
                            store(C)
                        else:
                            with b.if_else(last) as (then, other):
                                with then:
                                    store(C, add=True)
                                with other:
                                    store(part)
                        if rk is not None:
                            with b.if_then(last):
                                add_rank(b, rk, accs, i0, j0, cmask, masks, C, coff, N,
                                         last_row)
                    by_height(b, mvalid, R, EDGE_ROWS, micro)
    b.ret_void()
    return mod
