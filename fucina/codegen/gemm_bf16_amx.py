"""bf16 GEMM kernels on AMX tiles (Sapphire Rapids and later): the bf16 compute's products at
tile rate (one tdpbf16ps is 16 x 16 x 32 multiply-adds, measured ~45x the f32 FMA rate of the
same core), the operands rounded to bf16 exactly as fucina.codegen.gemm_bf16 rounds them.

What tdpbf16ps computes (SDM pseudo-code, checked bit for bit on an Intel Xeon with AMX:
every one of 768,000 random results, 1 to 16 pairs a tile; tests/test_gemm_bf16_amx.py keeps
the model): for each C element and each call, two f32 chains from +0 — one over the even elements
of its 16 k pairs, one over the odd — each step an FMA of an exact bf16 product rounded once
to nearest even, then C + (even + odd), each sum rounded once; results below 2^-126 flushed to
a zero of their sign, bf16 denormal inputs read as zero, MXCSR not consulted. Its bits are not
vdpbf16ps's (one chain over the pairs, odd element first): a product here is a sum over groups
of 32 k, g = 0, 1, ... from k = 0, each group's (even + odd) added to the running C in order.
The groups depend on K only, so the bits do not depend on the thread count.

Layouts (words are bf16 pairs, elements bf16):
  gemm_bf16_rows  the A side from f32 (or bf16) [M, K], any strides: panels of 16 rows, each
                  a run of G = ceil(K / 32) tiles of 16 rows x 32 k (1 KiB, row r's k
                  contiguous); element (p, g, r, t) at ((p·G + g)·16 + r)·32 + t, zeros past M
                  and past K.
  B side          gemm_bf16_pack's layout with width 32 and `tiles` (gemm_bf16_pair_rows
                  writes it from a row-major b): panels of 32 columns, pair row kp of a panel
                  = 32 words (128 bytes), pair rows padded with zeros to G·16. Its columns
                  0-15 and 16-31 are two B tiles of 16 pair rows at a 128-byte stride. A long
                  k's tile kernel packs each slice of a panel itself, on its stack (b_mode).
  direct A        a bf16 [M, K] whose k is unit stride, K % 32 == 0, M % 16 == 0 (a frozen
                  weight as it is held: no copy): tile (rows i.., group g) read in place.
The tile kernel: one chunk = an (MC-row, NC-column) block of C; for each slice of k (a long k
in slices of KS tiles: the A and B tiles of a slice stay in L2 across the chunk's blocks), for
each 32 rows of A (16 for a last panel of at most 16 rows), for each 32-column panel of B,
four C tiles from zero — or from the previous slice's sums, stored exactly — over the slice's
k in order (A0·B0, A0·B1, A1·B0, A1·B1 a group), then after the last slice the tiles through a
stack buffer to C — transposed when the kernel computes Cᵀ = Bᵀ·Aᵀ (`transposed`: the exec
layer swaps the operands so that a bf16 weight is the direct A side) — adding C's value
(accumulate) and a LoRA rank term (ranked: gemm.add_rank, eight rows at a time) as the
vdpbf16ps kernel does.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .gemm import (add_rank, by_height, chunk_block, mask_upto, panel_buffer, rank_block,
                   row_masks, transpose)
from .gemm_bf16 import _load_bit, _pack_kvec, _pack_wvec, _pair, load_bits, zero_rows
from .kernels import KernelKey, register
from .target import host

TILE_K = 32       # k of one tile product (16 pairs)
BLOCK = 32        # rows and columns of C a micro-kernel computes: four 16 x 16 f32 tiles
RANK_ROWS = 8     # rows of C a rank term's chains cover at once (16 zmm accumulators)
SLICE_TILES = 16  # k tiles of a slice whose B panels a kernel packs itself (32 KiB on the stack)
# tile registers: 0-3 the C tiles (rows 0-15 / 16-31 of A x columns 0-15 / 16-31 of B),
# 4-5 the two A tiles, 6-7 the two B tiles; every one 16 rows x 64 bytes
_C, _A, _B = (0, 1, 2, 3), (4, 5), (6, 7)


def supported() -> bool:
    """The host CPU has AMX tiles with bf16 products (the OS must still grant the tile state:
    exec.matmul_bf16 asks before it runs any)."""
    return host().vector_bits == 512 and host().has("amx-tile", "amx-bf16", "avx512bf16")


def _fn(b, name, args):
    return b.module.globals.get(name) or ir.Function(
        b.module, ir.FunctionType(u.VOID, args), name=name)


def _i8(v):
    return ir.Constant(u.I8, v)


def _config(b):
    """ldtilecfg of palette 1 with all eight tiles 16 rows x 64 bytes (the 64-byte block:
    palette, start row, 14 reserved, 16 column widths in bytes (u16), 16 row counts (u8))."""
    cfg = [0] * 64
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    ty = ir.ArrayType(u.I8, 64)
    slot = u.entry_alloca(b, ty, "tilecfg")
    slot.align = 64
    b.store(ir.Constant(ty, [ir.Constant(u.I8, x) for x in cfg]), slot)
    b.call(_fn(b, "llvm.x86.ldtilecfg", [u.PTR]), [slot])


def _tile_ops(b):
    load = _fn(b, "llvm.x86.tileloadd64", [u.I8, u.PTR, u.I64])
    store = _fn(b, "llvm.x86.tilestored64", [u.I8, u.PTR, u.I64])
    zero = _fn(b, "llvm.x86.tilezero", [u.I8])
    dp = _fn(b, "llvm.x86.tdpbf16ps", [u.I8, u.I8, u.I8])
    return (lambda t, p, stride: b.call(load, [_i8(t), p, stride]),
            lambda t, p, stride: b.call(store, [_i8(t), p, stride]),
            lambda t: b.call(zero, [_i8(t)]),
            lambda c, a, bt: b.call(dp, [_i8(c), _i8(a), _i8(bt)]))


# ---------------------------------------------------------------------------------------------
# the A side's tiles

@register
@dataclass(frozen=True)
class GemmBf16RowsKey(KernelKey):
    """Copy a[M, K] into 16-row panels of 16 x 32 bf16 tiles (module docstring).

    Arguments: 0 src, 1 dst, 2 M, 3 K, 4 s_m, 5 s_k (element strides), 6 G (tiles along k),
    7 panels, 8 panels per chunk. kvec: unit stride along k (two vector loads a tile row);
    any: one element at a time."""
    family = "gemm_bf16_rows"
    dtype: str    # f32 | bf16
    mode: str     # kvec | any

    def ir(self, symbol: str) -> str:
        return str(_build_rows(self, symbol))


def _build_rows(key: GemmBf16RowsKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    M, K, s_m, s_k, G, npan, per = (u.arg(b, args, i) for i in range(2, 9))
    with u.Loop(b, c0, c1, 1, "q") as q:
        p0 = b.mul(q, per)
        with u.Loop(b, p0, u.smin(b, b.add(p0, per), npan), 1, "p") as p:
            with u.Loop(b, u.i64(0), u.i64(16), 1, "r") as r:
                m = b.add(b.mul(p, u.i64(16)), r)
                valid = b.icmp_signed("<", m, M)
                with u.Loop(b, u.i64(0), G, 1, "g") as g:
                    k0 = b.mul(g, u.i64(TILE_K))
                    at = b.mul(b.add(b.mul(b.add(b.mul(p, G), g), u.i64(16)), r),
                               u.i64(TILE_K))
                    kn = b.select(valid, b.sub(K, k0), u.i64(0))
                    if key.mode == "kvec":
                        h = load_bits(b, src, b.add(b.mul(m, s_m), k0), key.dtype, TILE_K,
                                      mask_upto(b, kn, TILE_K))
                    else:
                        h = _gather_row(b, src, b.add(b.mul(m, s_m), b.mul(k0, s_k)), s_k, kn,
                                        key.dtype)
                    s = b.store(h, b.gep(dst, [at], source_etype=u.I16))
                    s.align = 64
    b.ret_void()
    return mod


def _gather_row(b, src, base, s_k, kn, dt):
    """32 elements base, base + s_k, ... as flushed bf16 bits, zeros from element kn on."""
    slot = u.entry_alloca(b, ir.VectorType(u.I16, TILE_K), "row")
    b.store(u.const(ir.VectorType(u.I16, TILE_K), 0), slot)
    with u.Loop(b, u.i64(0), u.smin(b, kn, u.i64(TILE_K)), 1, "t") as t:
        h = _load_bit(b, src, b.add(base, b.mul(t, s_k)), dt)
        b.store(b.insert_element(b.load(slot), h, t), slot)
    return b.load(slot)


# ---------------------------------------------------------------------------------------------
# the B side's panels from a b with unit stride along n

@register
@dataclass(frozen=True)
class GemmBf16PairRowsKey(KernelKey):
    """B's pair panels (gemm_bf16_pack's layout with width 32 and `tiles`) from b[K, N] with
    unit stride along n, two rows of b at a time across every panel: b is read in order, row
    after row. Packed a panel at a time, each pair row of a panel is 64 bytes of a different
    row of b, so a frozen weight larger than the TLB's reach costs a page walk per row (the
    head's [49152, 576] bf16 dx: 3.8 GB/s that way).

    Arguments: 0 src, 1 dst, 2 N, 3 K, 4 s_k (b's row stride, elements), 5 pair rows of a
    panel (G·16), 6 panels, 7 pair rows per chunk. Elements are rounded and flushed as
    gemm_bf16.load_bits does (the same bits as gemm_bf16_pack's); pair rows past K are
    zeros."""
    family = "gemm_bf16_pair_rows"
    dtype: str    # f32 | bf16

    def ir(self, symbol: str) -> str:
        return str(_build_pair_rows(self, symbol))


def _build_pair_rows(key: GemmBf16PairRowsKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = 16
    src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    N, K, s_k, prows, npan, per = (u.arg(b, args, i) for i in range(2, 8))
    pstride = b.mul(prows, u.i64(BLOCK))               # words of a panel
    with u.Loop(b, c0, c1, 1, "q") as q:
        r0 = b.mul(q, per)
        with u.Loop(b, r0, u.smin(b, b.add(r0, per), prows), 1, "kp") as kp:
            k = b.mul(kp, u.i64(2))
            in_k = b.icmp_signed("<", k, K)
            has1 = b.icmp_signed("<", b.add(k, u.i64(1)), K)
            row0 = b.mul(u.smin(b, k, b.sub(K, u.i64(1))), s_k)
            row1 = b.select(has1, b.add(row0, s_k), row0)
            with u.Loop(b, u.i64(0), npan, 1, "p") as p:
                for v in range(BLOCK // W):
                    col = b.add(b.mul(p, u.i64(BLOCK)), u.i64(v * W))
                    m = mask_upto(b, b.select(in_k, b.sub(N, col), u.i64(0)), W)
                    lo = load_bits(b, src, b.add(row0, col), key.dtype, W, m)
                    hi = load_bits(b, src, b.add(row1, col), key.dtype, W,
                                   b.select(has1, m, mask_upto(b, u.i64(0), W)))
                    at = b.add(b.mul(p, pstride), b.add(b.mul(kp, u.i64(BLOCK)), u.i64(v * W)))
                    st = b.store(_pair(b, lo, hi), b.gep(dst, [at], source_etype=u.I32))
                    st.align = 4
    b.ret_void()
    return mod


# ---------------------------------------------------------------------------------------------
# the tile kernel

@register
@dataclass(frozen=True)
class GemmBf16AmxKey(KernelKey):
    """C blocks from A tiles (packed by gemm_bf16_rows, or read in place) and B's packed
    panels (module docstring).

    Arguments: 0 A, 1 Bp, 2 C, 3 M (A's rows), 4 N (B's columns), 5 G (k tiles), 6 s_a (A's
    row stride in elements, direct), 7 MC, 8 NC, 9 M blocks, 10 N blocks, 11 M blocks fastest
    in the chunk order, 12 ldc (C's row length), 13 KS (k tiles a slice), 14 P: the sums of
    the slices before the last wait there, [M, N] padded to 32 columns (unused with one
    slice). C[i, j] (row i of A, column j of B) is stored at i·ldc + j, or at j·ldc + i when
    transposed. accumulate: C's value plus the product, one rounding. b_mode: argument 1 is b
    itself, 15 K, 16 s_bk, 17 s_bn its element strides; each 32-column panel of a slice is
    packed into a stack buffer before A's rows run over it (the streaming products: a long k
    whose chunks each take a panel once). ranked: the rank_add block (gemm.rank_block) from
    15 (18 with b_mode), in C's own orientation."""
    family = "gemm_bf16_amx"
    direct: bool
    transposed: bool = False
    accumulate: bool = False
    ranked: bool = False
    b_mode: str = ""       # "": B packed by gemm_bf16_pair_rows / gemm_bf16_pack; wvec | kvec:
    b_dtype: str = "bf16"  # b itself (f32 or bf16), packed slice by slice (SLICE_TILES at most)

    def ir(self, symbol: str) -> str:
        return str(_build_amx(self, symbol))


def _build_amx(key: GemmBf16AmxKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = 16
    fv = ir.VectorType(u.F32, W)
    A, Bp, C = (u.arg_ptr(b, args, i) for i in range(3))
    M, N, G, s_a, MC, NC, nmb, nnb, mfast, ldc, KS = (u.arg(b, args, i) for i in range(3, 14))
    P = u.arg_ptr(b, args, 14)
    ldp = b.mul(b.sdiv(b.add(N, u.i64(BLOCK - 1)), u.i64(BLOCK)), u.i64(BLOCK))
    p_bytes = b.mul(ldp, u.i64(4))
    if key.b_mode:           # B is b itself: its panels packed slice by slice on the stack
        Kb, s_bk, s_bn = (u.arg(b, args, i) for i in range(15, 18))
        bstack = panel_buffer(b, SLICE_TILES * 16 * BLOCK)   # pair words, as many as floats
    rk = rank_block(b, args, 18 if key.b_mode else 15) if key.ranked else None
    tload, tstore, tzero, tdp = _tile_ops(b)
    _config(b)
    bufs = [panel_buffer(b, BLOCK * BLOCK) for _ in range(1 + key.transposed)]   # tiles, turned
    racc = ([[u.entry_alloca(b, fv, f"r{r}_{v}") for v in range(2)] for r in range(RANK_ROWS)]
            if key.ranked else None)
    a_stride = b.mul(s_a, u.i64(2)) if key.direct else u.i64(64)
    row_bytes = u.i64(BLOCK * 4)
    pairs = b.mul(G, u.i64(TILE_K // 2))            # pair rows of a B panel
    last_row = b.sub(N if key.transposed else M, u.i64(1))      # C's last row

    with u.Loop(b, c0, c1, 1, "c") as c:
        row0, row1, col0, col1 = chunk_block(b, c, mfast, nmb, nnb, MC, NC, M, N)
        with u.Loop(b, u.i64(0), G, KS, "s") as g0:
            g1 = u.smin(b, b.add(g0, KS), G)
            first = b.icmp_signed("==", g0, u.i64(0))
            last = b.icmp_signed(">=", g1, G)

            def block(i0, j0, bbase, panel):
                """The 32 x 32 block of C at rows i0 of A, columns j0 of B, for this slice: B's
                panel at word `panel` of bbase, its tile rows numbered from the slice's
                start (packed in place) or from k = 0 (the packed operand)."""

                def a_tile(h, g):
                    rows = b.add(i0, u.i64(16 * h))
                    if key.direct:
                        at = b.add(b.mul(rows, s_a), b.mul(g, u.i64(TILE_K)))
                    else:
                        at = b.mul(b.add(b.mul(b.sdiv(rows, u.i64(16)), G), g),
                                   u.i64(16 * TILE_K))
                    return b.gep(A, [at], source_etype=u.I16)

                def b_tile(h, g):
                    if key.b_mode:
                        g = b.sub(g, g0)
                    at = b.add(panel, b.add(b.mul(g, u.i64(16 * BLOCK)), u.i64(16 * h)))
                    return b.gep(bbase, [at], source_etype=u.I32)

                def part_tile(t):
                    at = b.add(b.mul(b.add(i0, u.i64(16 * (t // 2))), ldp),
                               b.add(j0, u.i64(16 * (t % 2))))
                    return b.gep(P, [at], source_etype=u.F32)

                def micro(R):
                    tiles = range(2 * (R // 16))
                    with b.if_else(first) as (then, other):
                        with then:
                            for t in tiles:
                                tzero(_C[t])
                        with other:          # the sums of the slices before, exact
                            for t in tiles:
                                tload(_C[t], part_tile(t), p_bytes)
                    with u.Loop(b, g0, g1, 1, "g") as g:
                        tload(_B[0], b_tile(0, g), row_bytes)
                        tload(_B[1], b_tile(1, g), row_bytes)
                        for h in range(R // 16):
                            tload(_A[h], a_tile(h, g), a_stride)
                            tdp(_C[2 * h], _A[h], _B[0])
                            tdp(_C[2 * h + 1], _A[h], _B[1])
                    with b.if_else(last) as (then, other):
                        with then:
                            for t in tiles:
                                at = (t // 2) * 16 * BLOCK + (t % 2) * 16
                                tstore(_C[t], b.gep(bufs[0], [u.i64(at)],
                                                    source_etype=u.F32), row_bytes)
                            _epilogue(b, key, bufs, R, i0, j0, M, N, C, ldc, rk, racc,
                                      last_row)
                        with other:
                            for t in tiles:
                                tstore(_C[t], part_tile(t), p_bytes)

                by_height(b, b.sub(M, i0), BLOCK, (16,), micro)

            # B's panels outside, A's rows inside: a panel of B (32 columns x the slice's k)
            # stays in L1 across the rows (A's rows outside, 1 thread: [256, 576] x [576,
            # 1536] with the weight in place 592 -> 710 GFLOP/s, the head [256, 576] x [576,
            # 49152] 400 -> 344; the others within 6 %)
            with u.Loop(b, col0, col1, BLOCK, "j0") as j0:
                if key.b_mode:
                    _pack_slice(b, key, Bp, bstack, g0, g1, j0, Kb, N, s_bk, s_bn)
                    bbase, panel = bstack, u.i64(0)
                else:
                    bbase = Bp
                    panel = b.mul(b.sdiv(j0, u.i64(BLOCK)), b.mul(pairs, u.i64(BLOCK)))
                with u.Loop(b, row0, row1, BLOCK, "i0") as i0:
                    block(i0, j0, bbase, panel)
    b.call(_fn(b, "llvm.x86.tilerelease", []), [])
    b.ret_void()
    return mod


def _pack_slice(b, key, src, dst, g0, g1, j0, K, N, s_bk, s_bn):
    """The pair rows of tiles g0 .. g1 of b's 32-column panel at j0 into dst, as
    gemm_bf16_pack lays out a panel (the same loops: the same bits), zero rows past K."""
    W = 16
    k0 = b.mul(g0, u.i64(TILE_K))
    kcl = b.sub(u.smin(b, b.mul(g1, u.i64(TILE_K)), K), k0)
    kpl = b.sdiv(b.add(kcl, u.i64(1)), u.i64(2))
    sbase = b.add(b.mul(k0, s_bk), b.mul(j0, s_bn))
    wvalid = u.smin(b, u.i64(BLOCK), b.sub(N, j0))
    if key.b_mode == "wvec":
        _pack_wvec(b, src, dst, sbase, u.i64(0), kpl, kcl, wvalid, s_bk, BLOCK, key.b_dtype, W,
                   False)
    else:
        _pack_kvec(b, src, dst, sbase, u.i64(0), kcl, wvalid, s_bn, BLOCK, key.b_dtype, W,
                   False)
    zero_rows(b, dst, u.i64(0), kpl, b.mul(b.sub(g1, g0), u.i64(TILE_K // 2)), BLOCK)


def _epilogue(b, key, bufs, R, i0, j0, M, N, C, ldc, rk, racc, last_row):
    """The R x 32 block in bufs[0] (rows of A x columns of B) to C: turned first when C is
    the transpose, then each row's two vectors stored (C's value added first when
    accumulating), then the rank term over the stored block, RANK_ROWS rows at a time."""
    W = 16
    fv = ir.VectorType(u.F32, W)

    def vec_at(buf, r, v):
        return b.gep(buf, [u.i64(r * BLOCK + v * W)], source_etype=u.F32)

    if key.transposed:
        src, dst = bufs
        for ib in range(R // W):
            for jb in range(BLOCK // W):
                rows = []
                for t in range(W):
                    x = b.load(vec_at(src, ib * W + t, jb), typ=fv)
                    x.align = 64
                    rows.append(x)
                for s, col in enumerate(transpose(b, rows)):
                    st = b.store(col, vec_at(dst, jb * W + s, ib))
                    st.align = 64
        buf, y0, x0, nrows, ncols, height = dst, j0, i0, b.sub(N, j0), b.sub(M, i0), BLOCK
    else:
        buf, y0, x0, nrows, ncols, height = bufs[0], i0, j0, b.sub(M, i0), b.sub(N, j0), R
    cmask = [mask_upto(b, b.sub(ncols, u.i64(v * W)), W) for v in range(BLOCK // W)]
    masks = row_masks(b, nrows, cmask, height)
    coff = b.add(b.mul(y0, ldc), x0)
    for r in range(height):
        for v in range(BLOCK // W):
            x = b.load(vec_at(buf, r, v), typ=fv)
            x.align = 64
            idx = b.add(coff, b.add(b.mul(u.i64(r), ldc), u.i64(v * W)))
            if key.accumulate:
                x = b.fadd(u.load(b, C, idx, "f32", W, masks[r][v]), x)
            u.store(b, x, C, idx, "f32", masks[r][v])
    if rk is not None:
        for q in range(0, height, RANK_ROWS):
            add_rank(b, rk, racc, b.add(y0, u.i64(q)), x0, cmask, masks[q:q + RANK_ROWS], C,
                     b.add(coff, b.mul(u.i64(q), ldc)), ldc, last_row)
