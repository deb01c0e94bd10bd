"""GEMM kernels: packed panels, a register-blocked micro-kernel, cache blocking, a fixed k order.

The exec layer (fucina/exec/matmul.py) views the operands as a[batch, M, K], b[batch, K, N]
with arbitrary element strides and computes a contiguous f32 c[batch, M, N]. Three families:

  gemm_pack  copies an operand into panels of `width` rows (A: MR rows of a; B: NR columns of
             b), in f32 (f16 / bf16 widen exactly on the way). Panel layout, per packed batch:
                 P[kb][panel][k - kb*KC][w]        (w = 0 .. width-1, zero beyond the edge)
             i.e. for each KC block of k the panels follow each other, and inside a panel the
             `width` values of one k are contiguous. Three copy loops, chosen by the strides:
               wvec — unit stride along the panel width: vector loads along w;
               kvec — unit stride along k (a transposed operand): W x W register transposes;
               any  — scalar loads.
  gemm_tile  one chunk = one (batch, MC-row block, NC-column block) tile of C. For each KC
             block in increasing order, for each NR panel of the tile's columns, for each MR
             panel of its rows: MR x NR accumulators (MR * NR/W vector registers; 8 x 2 zmm on
             AVX-512, FMAs with broadcasts from packed A — or from A's rows in place, a_rows —
             and vector loads from packed B; the last panel of rows runs the smallest
             EDGE_ROWS-row micro-tile that covers it) run one FMA chain per output element over k in
             increasing order, starting from the partial sum of the previous KC block
             (reloaded from memory: storing and reloading an f32 does not change it). So
             every c[i, j] = fma(a[i,K-1], b[K-1,j], ... fma(a[i,0], b[0,j], 0)) in that
             order whatever MC, NC or the thread count, and the chunk grid is fixed by the
             problem size: bitwise identical for any thread count.
             With `accumulate` the chain's result is added to c in one final rounding
             (c = c + sum); partial sums of earlier KC blocks then live in a scratch buffer.
             A long k may run as several launches over k slices of whole KC blocks, each
             continuing the partial sums the previous one left (flags argument): the same
             chains, the same bits.
             A key's `scale` s != 1 rounds s·sum once more before it is stored or added
             (c = c + s·sum, two roundings: x.add(y.scale(s)) with y = the product).
             emit_tile builds it around a hook that produces each KC x NR panel of B: a
             pointer into gemm_pack's panels here, the quantized matmul's blocks decoded on
             the fly into a stack buffer (fucina.codegen.quant_gemm) — one micro-kernel, so
             the two give the same bits.
  gemm_tile_direct  gemm_tile with B read from the operand itself (no gemm_pack pass over it):
             each KC x NR panel is copied or register-transposed into a stack buffer right
             before the micro-kernel uses it, the next panel prefetched meanwhile — the same
             micro-kernel, so gemm_tile's bits. For one M block of A (the LoRA step's 256-row
             products): b is then read once, where packing reads it, writes it and reads it.
  gemm_small direct kernels, no packing of A, for shapes where packing costs more than it
             saves: `rowvec` (few rows of C, or b small enough for L2) runs the very same FMA
             chain per element as gemm_tile — the two give identical bits; `dot` (a and b
             contiguous along k: x·Wᵀ for one token, skinny outputs) sums each element in W
             lanes and folds them by a fixed tree. See GemmSmallKey.

Argument blocks are documented at each key.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import lane_tree
from .kernels import KernelKey, register
from .rows import fadd
from .target import host

# ---- micro-tile, blocking and packing constants (the kernels take MC, NC and the k block as
# runtime arguments: exec/matmul.py picks MC and NC, and passes KC) ---------------------------
NR_VECS = 2      # vectors across the micro-tile (NR = NR_VECS * lanes columns)
KC = 256         # k block: a KC x NR panel of B stays in L1 across the MR panels of A (and
                 # fits the stack buffer the quantized tile decodes its panels into)
UNROLL = 4       # k steps per iteration of the micro-kernel's inner loop
EDGE_ROWS = (2, 4, 6)   # the last panel of rows runs the smallest of these micro-tiles that
                        # covers it (a sequence of 50 tokens: 6 x 8 + 2 rows, not 7 x 8)
SLICE_ACC, SLICE_CONT, SLICE_MORE = 1, 2, 4   # gemm_tile's flags (argument 14)
DIRECT_PF_LOCALITY = 2   # gemm_tile_direct prefetches its next panel into L2 (prefetcht1): a t0
                         # stream of far-apart rows throttles on Zen 4 (LoRA step at seq 50,
                         # 1 thread: 416 -> 378 ms; at 256, where each panel serves 32
                         # micro-tiles, no change)
RV_PF_ROWS = 64  # rowvec prefetches b's row k + this into L2 (prefetcht1): the first row
RV_PF_LINES = 4  # group of a column block streams it from memory, which no hardware prefetcher
                 # follows in pieces of at most this many lines, far apart. x[48, 576] ·
                 # w[576, 1536] with w not cached, 1 thread: 90 -> 101 GFLOP/s (t0: 91; 16 rows
                 # ahead: 97). The wide strips of one or two rows of C (GEMV) stream well
                 # without: there the prefetches cost 16 % when b is in L3
PF_ITEMS = 2     # rowvec writing C row by row: prefetch its lines this many items ahead
PF_ROWS = 8      # packing along rows far apart (wvec): prefetch this many rows ahead ...
PF_K = 256       # ... along k-contiguous rows (kvec): this many elements ahead


def lanes() -> int:
    return host().f32_lanes


def mr() -> int:
    """Rows of the micro-tile. AVX-512: 8 x 2 zmm accumulators (16 FMA chains cover two FMA
    pipes' latency; a B vector load per 8 FMAs is well within two loads a cycle), and 8
    divides the row counts training runs at (256, 1024 tokens): no edge panel of mostly
    padding rows (14 rows, the register file's limit, left 256 = 18 x 14 + 4 and measured
    3-7 % slower on the LoRA step's shapes). Elsewhere 6 x 2 of 16 registers."""
    return 8 if host().vector_bits >= 512 else 6


def nr() -> int:
    return NR_VECS * lanes()


# ---------------------------------------------------------------------------------------------
# helpers

def _vt(W):
    return ir.VectorType(u.F32, W)


def mask_upto(b, count, W):
    """<W x i1>: lane t on iff t < count (count may be negative or > W)."""
    c = b.select(b.icmp_signed("<", count, u.i64(0)), u.i64(0), count)
    c = u.smin(b, c, u.i64(W))
    return u.tail_mask(b, c, W)


def zero_mask(W):
    return ir.Constant(ir.VectorType(u.I1, W), [ir.Constant(u.I1, 0)] * W)


def row_masks(b, mvalid, cmask, R):
    """masks[r][v]: the column mask cmask[v] on rows r < mvalid of a block of R rows, none past."""
    W = lanes()
    return [[b.select(b.icmp_signed("<", u.i64(r), mvalid), m, zero_mask(W)) for m in cmask]
            for r in range(R)]


def _fma(b, x, y, z):
    return u.intrinsic(b, "llvm.fma", z.type, [x, y, z])


def by_height(b, mvalid, R, heights, micro):
    """micro(R) for a full panel of rows (mvalid >= R); for the last one, micro(h) with h the
    smallest of `heights` covering its mvalid rows (micro(R) when none does): rows past M
    cost no FMAs, and each row keeps its FMA chain whatever the micro-tile's height."""
    edge = [h for h in heights if h < R]

    def pick(i):
        if i == len(edge):
            micro(R)
            return
        with b.if_else(b.icmp_signed("<=", mvalid, u.i64(edge[i]))) as (lo, hi):
            with lo:
                micro(edge[i])
            with hi:
                pick(i + 1)
    with b.if_else(b.icmp_signed(">=", mvalid, u.i64(R))) as (full, part):
        with full:
            micro(R)
        with part:
            pick(0)


def chunk_block(b, t, mfast, nmb, nnb, MC, NC, M, N):
    """(row0, row1, col0, col1) of the C block of chunk t in a grid of nmb M blocks of MC
    rows by nnb N blocks of NC columns, M blocks fastest when mfast != 0 (else N blocks)."""
    by_m = b.icmp_signed("!=", mfast, u.i64(0))
    mb = b.select(by_m, b.srem(t, nmb), b.sdiv(t, nnb))
    nb = b.select(by_m, b.sdiv(t, nmb), b.srem(t, nnb))
    row0 = b.mul(mb, MC)
    col0 = b.mul(nb, NC)
    return row0, u.smin(b, b.add(row0, MC), M), col0, u.smin(b, b.add(col0, NC), N)


def prefetch_next_tile(b, ptr, off, N, R, NRc):
    """Prefetch for writing the R x NRc block of C (row length N) at element `off`: the next
    micro-tile's rows, so that its stores (or the reload of a partial sum) do not miss every
    cache — an output too big for the caches (the head's logits) otherwise stalls each tile."""
    for r in range(R):
        for ln in range(-(-NRc * 4 // 64)):
            u.prefetch(b, ptr, b.add(off, b.add(b.mul(u.i64(r), N), u.i64(ln * 16))), "f32",
                       write=True)


def next_tile_offset(b, i0, j0, row0, row1, N, R, NRc):
    """The element offset of the micro-tile after (i0, j0): the next R rows of this panel, or
    the first rows of the next panel."""
    more = b.icmp_signed("<", b.add(i0, u.i64(R)), row1)
    return b.select(more, b.add(b.mul(b.add(i0, u.i64(R)), N), j0),
                    b.add(b.mul(row0, N), b.add(j0, u.i64(NRc))))


def transpose(b, rows):
    """Transpose a square block held as len(rows) vectors of len(rows) lanes (a power of two):
    swap the off-diagonal s x s sub-blocks for s = n/2, n/4, ..., 1."""
    n = len(rows)
    rows = list(rows)
    s = n // 2
    while s >= 1:
        lo_mask = ir.Constant(ir.VectorType(u.I32, n),
                              [l if not l & s else n + l - s for l in range(n)])
        hi_mask = ir.Constant(ir.VectorType(u.I32, n),
                              [l + s if not l & s else n + l for l in range(n)])
        new = list(rows)
        for i in range(n):
            if i & s:
                continue
            a, c = rows[i], rows[i + s]
            new[i] = b.shuffle_vector(a, c, lo_mask)
            new[i + s] = b.shuffle_vector(a, c, hi_mask)
        rows = new
        s //= 2
    return rows


def _batch_offsets(b, bt, nbatch, d1, d2, *strides):
    """_batch_offset of batch bt for each (s0, s1, s2) in strides; 0 without a batch, where
    the four divisions each would cost per item are skipped (a small problem's items are
    short: [64, 64] x [64, 64] is 44 items of 64 k steps on AVX2)."""
    slots = [u.entry_alloca(b, u.I64) for _ in strides]
    for slot in slots:
        b.store(u.i64(0), slot)
    with b.if_then(b.icmp_signed(">", nbatch, u.i64(1))):
        for slot, st in zip(slots, strides):
            b.store(_batch_offset(b, bt, d1, d2, *st), slot)
    return [b.load(slot) for slot in slots]


def _batch_offset(b, pb, d1, d2, s0, s1, s2):
    """Element offset of flat batch index pb over dims (*, d1, d2) with strides (s0, s1, s2)."""
    i2 = b.srem(pb, d2)
    t = b.sdiv(pb, d2)
    i1 = b.srem(t, d1)
    i0 = b.sdiv(t, d1)
    return b.add(b.add(b.mul(i0, s0), b.mul(i1, s1)), b.mul(i2, s2))


# ---------------------------------------------------------------------------------------------
# packing

@register
@dataclass(frozen=True)
class GemmPackKey(KernelKey):
    """Copy an operand into panels of `width` along its free axis (see the module docstring).

    Arguments: 0 src, 1 dst, 2 rows (extent along the panel width), 3 K, 4 s_w, 5 s_k, 6 KC,
    7 panels, 8 panels per chunk, 9 panel groups, 10 d1, 11 d2, 12 bs0, 13 bs1, 14 bs2 (batch
    decomposition and strides of the source), 15 dst batch stride (floats).
    Chunk c = ((pb * KC blocks) + kb) * groups + g packs KC block kb of panels
    [g*per, (g+1)*per) of packed batch pb.
    """
    family = "gemm_pack"
    dtype: str    # source storage dtype: f32 | f16 | bf16
    width: int    # panel width (MR for A, NR for B)
    mode: str     # wvec | kvec | any

    def ir(self, symbol: str) -> str:
        return str(_build_pack(self, symbol))


def _build_pack(key: GemmPackKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    Wp = key.width
    dt = key.dtype
    src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    rows, K, s_w, s_k, KC, npan, per, ngroups, d1, d2, bs0, bs1, bs2, dstride = (
        u.arg(b, args, i) for i in range(2, 16))
    ppad = b.mul(npan, u.i64(Wp))
    nvec = -(-Wp // W)
    nkb = b.sdiv(b.add(K, b.sub(KC, u.i64(1))), KC)
    with u.Loop(b, c0, c1, 1, "q") as q:
        grp = b.srem(q, ngroups)
        t = b.sdiv(q, ngroups)
        kb = b.srem(t, nkb)
        pb = b.sdiv(t, nkb)
        p0 = b.mul(grp, per)
        p1 = u.smin(b, b.add(p0, per), npan)
        sbat = _batch_offset(b, pb, d1, d2, bs0, bs1, bs2)
        dbase = b.mul(pb, dstride)
        k0 = b.mul(kb, KC)
        kcl = u.smin(b, KC, b.sub(K, k0))
        blk = b.add(dbase, b.mul(k0, ppad))      # this KC block of the packed batch
        pstride = b.mul(kcl, u.i64(Wp))            # floats per panel in the block
        sk0 = b.add(sbat, b.mul(k0, s_k))
        if key.mode == "wvec":
            # a few panels side by side, row by row: each source row piece spans >= 4 whole
            # cache lines, and only that many write streams are open at once (the panels of a
            # block lie a multiple of 4 KiB apart: more streams would thrash L1 sets)
            sub = max(1, -(-(4 * W) // Wp))
            mask_of = [(lambda k: None) if Wp - v * W >= W else
                       row_spill(b, u.tail_mask(b, u.i64(Wp - v * W), W), kcl, W)
                       for v in range(nvec)]
            with u.Loop(b, p0, p1, sub, "sg") as sg:
                sg1 = u.smin(b, b.add(sg, u.i64(sub)), p1)

                def rows_of(k, panels):
                    srow = b.add(sk0, b.mul(k, s_k))
                    drow = b.add(blk, b.mul(k, u.i64(Wp)))
                    # the same piece PF_ROWS rows on (rows are far apart: no HW prefetch)
                    ahead = b.add(b.add(srow, b.mul(u.i64(PF_ROWS), s_k)), b.mul(sg, u.i64(Wp)))
                    for line in range(-(-(sub * Wp * u.ITEMSIZE[dt]) // 64)):
                        u.prefetch(b, src, b.add(ahead, u.i64(line * 64 // u.ITEMSIZE[dt])), dt)
                    panels(k, srow, drow)

                def whole(k, srow, drow):
                    """Every row of the group's panels valid: plain loads and stores,
                    unrolled over the panels (no mask to build per row and panel)."""
                    for j in range(sub):
                        p = b.add(sg, u.i64(j))
                        w0 = b.mul(p, u.i64(Wp))
                        for v in range(nvec):
                            copy_pieces(b, src, b.add(srow, b.add(w0, u.i64(v * W))), dt, dst,
                                        b.add(b.add(drow, b.mul(p, pstride)), u.i64(v * W)),
                                        min(W, Wp - v * W))

                def edge(k, srow, drow):
                    with u.Loop(b, sg, sg1, 1, "p") as p:
                        w0 = b.mul(p, u.i64(Wp))
                        wvalid = b.sub(rows, w0)
                        for v in range(nvec):
                            m = mask_upto(b, b.sub(wvalid, u.i64(v * W)), W)
                            x = u.load(b, src, b.add(srow, b.add(w0, u.i64(v * W))), dt, W, m)
                            u.store(b, x, dst, b.add(b.add(drow, b.mul(p, pstride)),
                                                     u.i64(v * W)), "f32", mask_of[v](k))

                fits = b.and_(b.icmp_signed("==", b.sub(sg1, sg), u.i64(sub)),
                              b.icmp_signed("<=", b.mul(sg1, u.i64(Wp)), rows))
                with b.if_else(fits, likely=True) as (then, other):
                    with then:
                        with u.Loop(b, u.i64(0), kcl, 1, "k") as k:
                            rows_of(k, whole)
                    with other:
                        with u.Loop(b, u.i64(0), kcl, 1, "k") as k:
                            rows_of(k, edge)
        else:
            with u.Loop(b, p0, p1, 1, "p") as p:
                w0 = b.mul(p, u.i64(Wp))
                wvalid = u.smin(b, u.i64(Wp), b.sub(rows, w0))
                optr = b.gep(dst, [b.add(blk, b.mul(p, pstride))], source_etype=u.F32)
                iptr = b.gep(src, [b.add(sk0, b.mul(w0, s_w))], source_etype=u.STORAGE[dt])
                if key.mode == "kvec":
                    _pack_kvec(b, iptr, optr, kcl, wvalid, s_w, Wp, dt, W)
                else:
                    _pack_any(b, iptr, optr, kcl, wvalid, s_w, s_k, Wp, dt)
    b.ret_void()
    return mod


def copy_pieces(b, src, sidx, dt, dst, didx, n):
    """n consecutive elements of src (dtype dt) to f32 dst in power-of-two pieces (n = 6:
    4 + 2): plain loads and stores that touch nothing past the n elements, where a masked
    load and store cost ~12 cycles each on AVX2 (bf16 ones are split into single elements)."""
    at = 0
    while at < n:
        size = 1 << ((n - at).bit_length() - 1)
        x = u.load(b, src, b.add(sidx, u.i64(at)), dt, None if size == 1 else size)
        u.store(b, x, dst, b.add(didx, u.i64(at)), "f32")
        at += size


def row_spill(b, sm, kcl, W):
    """The store mask of a panel row's last vector, sm covering fewer than its W lanes
    (AVX2's 6-row A panels: 6 of 8), as a function of the row's k. Without mask registers a
    partial store is a slow vmaskmovps, so each row but the panel's last stores the whole
    vector: its extra lanes land on the next row's first elements, which that row's own
    store (later, k increasing) overwrites. With AVX-512 the masked store is as cheap: sm
    itself."""
    if host().mask_registers:
        return lambda k: sm
    full = ir.Constant(sm.type, [ir.Constant(u.I1, 1)] * W)
    last = b.sub(kcl, u.i64(1))
    return lambda k: b.select(b.icmp_signed("<", k, last), full, sm)


def _pack_kvec(b, iptr, optr, kcl, wvalid, s_w, Wp, dt, W, pf=None):
    """Unit stride along k: W panel rows x W consecutive k at a time, loaded along k and
    transposed in registers; one group of W rows after the other (W read streams at once).
    Each load prefetches the line `pf` elements on (default PF_K along its row; False: none)."""
    nvec = -(-Wp // W)
    for g in range(nvec):
        width_g = min(W, Wp - g * W)
        spill = width_g < W and not host().mask_registers
        mask_of = ((lambda k: None) if width_g == W else
                   row_spill(b, u.tail_mask(b, u.i64(width_g), W), kcl, W))

        def group(kt, kn, plain):
            """W k of the group's rows; plain: all rows valid, W k, none of them the block's
            last where a row's store would spill (unmasked loads and stores: AVX2 has no
            cheap masked ones)."""
            kmask = None if plain else u.tail_mask(b, kn, W)
            vecs = []
            for t in range(W):
                w = g * W + t
                if w >= Wp:
                    vecs.append(u.const(_vt(W), 0.0))
                    continue
                m = None if plain else b.select(b.icmp_signed("<", u.i64(w), wvalid), kmask,
                                                zero_mask(W))
                row = b.add(b.mul(u.i64(w), s_w), kt)
                if pf is not False:
                    u.prefetch(b, iptr, b.add(row, u.i64(PF_K) if pf is None else pf), dt)
                vecs.append(u.load(b, iptr, row, dt, W, m))
            cols = transpose(b, vecs)

            def put(j):
                k = b.add(kt, u.i64(j))
                u.store(b, cols[j], optr, b.add(b.mul(k, u.i64(Wp)), u.i64(g * W)), "f32",
                        None if plain and (spill or width_g == W) else mask_of(k))

            if plain:
                for j in range(W):
                    put(j)
                return
            with b.if_else(b.icmp_signed("==", kn, u.i64(W))) as (then, other):
                with then:
                    for j in range(W):
                        put(j)
                with other:
                    for j in range(W):
                        with b.if_then(b.icmp_signed("<", u.i64(j), kn)):
                            put(j)

        rows_ok = b.icmp_signed(">=", wvalid, u.i64(g * W + width_g))
        with u.Loop(b, u.i64(0), kcl, W, f"kt{g}") as kt:
            kn = u.smin(b, u.i64(W), b.sub(kcl, kt))
            # a spilling store must not be the block's last k: its extra lanes would land on
            # the next panel (another chunk's, or past the buffer)
            room = b.icmp_signed("<" if spill else "<=", b.add(kt, u.i64(W)), kcl)
            with b.if_else(b.and_(rows_ok, room)) as (fast, slow):
                with fast:
                    group(kt, kn, True)
                with slow:
                    group(kt, kn, False)


def _pack_any(b, iptr, optr, kcl, wvalid, s_w, s_k, Wp, dt):
    """Any strides: scalar loads, zeros beyond the panel's valid rows."""
    with u.Loop(b, u.i64(0), kcl, 1, "k") as k:
        row = b.mul(k, s_k)
        with u.Loop(b, u.i64(0), u.i64(Wp), 1, "w") as w:
            slot = u.entry_alloca(b, u.F32)
            b.store(u.const(u.F32, 0.0), slot)
            with b.if_then(b.icmp_signed("<", w, wvalid)):
                b.store(u.load(b, iptr, b.add(row, b.mul(w, s_w)), dt), slot)
            b.store(b.load(slot), b.gep(optr, [b.add(b.mul(k, u.i64(Wp)), w)], source_etype=u.F32))


# ---------------------------------------------------------------------------------------------
# the tile kernel: one emitter, the B panels come from a hook

@register
@dataclass(frozen=True)
class GemmTileKey(KernelKey):
    """C tiles from packed panels (see the module docstring).

    Arguments: 0 Ap, 1 Bp, 2 C, 3 Cpart, 4 M, 5 N, 6 K, 7 KC, 8 MC, 9 NC, 10 M blocks,
    11 N blocks, 12 Ap batch stride (floats; with a_rows, 0 is A itself and 12 its row
    stride, one batch), 13 Bp batch stride (floats; 0 = broadcast), 14 flags
    (SLICE_* bits: accumulate; a k slice that continues the sums in Cpart; one that leaves its
    sums there for a next slice), 15 M blocks fastest (else N blocks fastest) in the chunk
    order. C is contiguous [batch, M, N]; Cpart (partial sums when accumulate and K > KC, or
    between k slices) likewise.
    pf_c: prefetch the next micro-tile's C lines (exec sets it for a C too big to stay cached).
    scale: each result is s·sum (see the module docstring).
    a_rows: A read in place from a row-major operand (emit_tile), no gemm_pack pass over it.
    rank_add: arguments 16..21 add a rank-r product to the final results (emit_tile).
    """
    family = "gemm_tile"
    mr: int
    nr_vecs: int
    unroll: int
    pf_c: bool = False
    scale: float = 1.0
    a_rows: bool = False
    rank_add: bool = False

    def ir(self, symbol: str) -> str:
        return str(emit_tile(symbol, self.mr, self.nr_vecs, self.unroll, _packed_b, self.pf_c,
                             self.scale, self.a_rows, 16 if self.rank_add else None))


def _packed_b(b, args, N, K, NRc):
    """gemm_pack's B panels: argument 1, batch stride argument 13 (floats)."""
    Bp, sBp = u.arg_ptr(b, args, 1), u.arg(b, args, 13)
    Np = b.mul(b.sdiv(b.add(N, u.i64(NRc - 1)), u.i64(NRc)), u.i64(NRc))

    def panel(bt, k0, kcl, j0):
        off = b.add(b.add(b.mul(bt, sBp), b.mul(k0, Np)), b.mul(j0, kcl))
        return b.gep(Bp, [off], source_etype=u.F32)
    return panel


@register
@dataclass(frozen=True)
class GemmTileDirectKey(KernelKey):
    """gemm_tile reading B from the operand itself, no gemm_pack pass over it: each KC x NR
    panel of B is copied (wvec: b has unit stride along n) or W x W register-transposed (kvec:
    unit stride along k, b = Wᵀ of a row-major W) into a stack buffer laid out as gemm_pack
    lays out B, right before the micro-kernel runs it against the tile's MR panels of A. The
    B operand is read once per M block instead of read, written packed and read again; the
    micro-kernel is gemm_tile's, so the bits are gemm_tile's.

    Arguments: gemm_tile's, with 1 = b (the operand, `dtype`), 13 = b's batch stride
    (elements; 0 = broadcast over a batch of one coalesced axis), 16 s_bk, 17 s_bn; with
    rank_add, 18..23 its block (emit_tile). pf_c and scale as gemm_tile's.
    """
    family = "gemm_tile_direct"
    dtype: str    # b's storage dtype: f32 | f16 | bf16
    mode: str     # wvec | kvec
    mr: int
    nr_vecs: int
    unroll: int
    pf_c: bool = False
    scale: float = 1.0
    rank_add: bool = False

    def ir(self, symbol: str) -> str:
        return str(emit_tile(symbol, self.mr, self.nr_vecs, self.unroll,
                             lambda b, args, N, K, NRc: _direct_b(self.dtype, self.mode, b,
                                                                  args, N, K, NRc), self.pf_c,
                             self.scale, rank_add=18 if self.rank_add else None))


def panel_buffer(b, floats):
    """A 64-byte aligned f32 stack buffer in the entry block (one per kernel call)."""
    p = u.entry_alloca(b, ir.ArrayType(u.F32, floats))
    p.align = 64
    p.type = u.PTR
    return p


def next_panel(b, k0, j0, kc, col0, col1, NR):
    """(k0, j0) of the panel a tile reads after the one at (k0, j0): its next NR columns,
    or its first ones in the next KC block (k0 >= K: none)."""
    jn = b.add(j0, u.i64(NR))
    wrap = b.icmp_signed(">=", jn, col1)
    return b.select(wrap, b.add(k0, kc), k0), b.select(wrap, col0, jn)


def share(b, total, part, parts):
    """[lo, hi) of part `part` of `parts` equal shares of range(total)."""
    return (b.sdiv(b.mul(total, part), parts),
            b.sdiv(b.mul(total, b.add(part, u.i64(1))), parts))


def _direct_b(dt, mode, b, args, N, K, NRc):
    """The B panel hook of gemm_tile_direct: panel[k - k0][j - j0] = b[k, j] (zeros past N)."""
    W = lanes()
    V = NRc // W
    src = u.arg_ptr(b, args, 1)
    sbat, s_bk, s_bn = (u.arg(b, args, i) for i in (13, 16, 17))
    kc = u.arg(b, args, 7)
    panel = panel_buffer(b, KC * NRc)

    isz = u.ITEMSIZE[dt]
    per_line = 64 // isz

    def make(bt, k0, kcl, j0):
        base = b.add(b.mul(bt, sbat), b.add(b.mul(k0, s_bk), b.mul(j0, s_bn)))
        iptr = b.gep(src, [base], source_etype=u.STORAGE[dt])
        wvalid = u.smin(b, u.i64(NRc), b.sub(N, j0))
        if mode == "kvec":
            _pack_kvec(b, iptr, panel, kcl, wvalid, s_bn, NRc, dt, W, pf=False)
            return panel

        def rows(masks):
            with u.Loop(b, u.i64(0), kcl, 1, "kb") as k:
                row = b.mul(k, s_bk)
                for v in range(V):
                    x = u.load(b, iptr, b.add(row, u.i64(v * W)), dt, W, masks[v])
                    u.store(b, x, panel, b.add(b.mul(k, u.i64(NRc)), u.i64(v * W)), "f32")

        # a whole panel's rows load plainly: AVX2 has no masked load of 16-bit lanes (LLVM
        # split each f16 / bf16 row into single elements and branches)
        with b.if_else(b.icmp_signed(">=", wvalid, u.i64(NRc)), likely=True) as (whole, edge):
            with whole:
                rows([None] * V)
            with edge:
                rows([mask_upto(b, b.sub(wvalid, u.i64(v * W)), W) for v in range(V)])
        return panel

    def ahead(bt, k0, j0, col0, col1, part, parts):
        """The next panel's lines (next_panel), a 1/parts share per MR panel run: the rows
        of a KC block are far apart and each is read only NR wide (kvec: KC long), which no
        hardware prefetcher follows, and one burst per panel would overrun the core's
        outstanding-miss slots."""
        kn, jn = next_panel(b, k0, j0, kc, col0, col1, NRc)
        with b.if_then(b.icmp_signed("<", kn, K)):
            kl = u.smin(b, kc, b.sub(K, kn))
            base = b.add(b.mul(bt, sbat), b.add(b.mul(kn, s_bk), b.mul(jn, s_bn)))
            if mode == "kvec":      # NR rows of W, each kl long
                rows, stride = u.smin(b, u.i64(NRc), b.sub(N, jn)), s_bn
                lpr = b.sdiv(b.add(kl, u.i64(per_line - 1)), u.i64(per_line))
            else:                   # kl rows of b, each NR wide
                rows, stride = kl, s_bk
                lpr = u.i64(-(-NRc // per_line))
            with u.Loop(b, *share(b, b.mul(rows, lpr), part, parts), 1, "pf") as ln:
                r, c = b.sdiv(ln, lpr), b.srem(ln, lpr)
                u.prefetch(b, src, b.add(base, b.add(b.mul(r, stride),
                                                     b.mul(c, u.i64(per_line)))), dt,
                           locality=DIRECT_PF_LOCALITY)
    return make, ahead


def rank_block(b, args, e):
    """The rank_add argument block at index e: (x, y, x's row stride, y's row stride, r, s)."""
    return (u.arg_ptr(b, args, e), u.arg_ptr(b, args, e + 1),
            *(u.arg(b, args, e + i) for i in (2, 3, 4)),
            u.splat(b, u.arg_f32(b, args, e + 5), lanes()))


def add_rank(b, rk, accs, i0, j0, cmask, masks, C, cbase, N, last_row):
    """C += s·(x[rows, :]·y[:, cols]) over a block of C just stored (rank_add): rows i0.. of
    len(masks), columns j0.. of len(cmask) vectors, C[i0 + r, j0 + v·W] at cbase + r·N + v·W.
    The rank-r FMA chains run in the freed accumulators from 0 over r in increasing order,
    then C is reloaded (from L1) and c + s·t stored: the bits of gemm(x, y, out=c,
    accumulate=True, scale=s) run after the product."""
    rx, ry, s_rx, s_ry, rank, rscale = rk
    W = lanes()
    vt = _vt(W)
    R, V = len(masks), len(cmask)
    xrow = [b.gep(rx, [b.mul(u.smin(b, b.add(i0, u.i64(r)), last_row), s_rx)],
                  source_etype=u.F32) for r in range(R)]
    for r in range(R):
        for v in range(V):
            b.store(u.const(vt, 0.0), accs[r][v])
    with u.Loop(b, u.i64(0), rank, 1, "q") as q:
        yrow = b.add(b.mul(q, s_ry), j0)
        yv = [u.load(b, ry, b.add(yrow, u.i64(v * W)), "f32", W, cmask[v]) for v in range(V)]
        for r in range(R):
            xv = u.splat(b, u.load(b, xrow[r], q, "f32"), W)
            for v in range(V):
                b.store(_fma(b, xv, yv[v], b.load(accs[r][v])), accs[r][v])
    for r in range(R):
        for v in range(V):
            idx = b.add(cbase, b.add(b.mul(u.i64(r), N), u.i64(v * W)))
            old = u.load(b, C, idx, "f32", W, masks[r][v])
            u.store(b, b.fadd(old, b.fmul(b.load(accs[r][v]), rscale)), C, idx, "f32",
                    masks[r][v])


def emit_tile(symbol: str, R: int, V: int, U: int, b_panel, pf_c: bool = False,
              scale: float = 1.0, a_rows: bool = False, rank_add: int | None = None
              ) -> ir.Module:
    """The tile kernel of gemm_tile's argument block, MR = R rows x V vectors of accumulators,
    the k loop unrolled U times. Where its B panels come from is the hook's business (the
    packed panels of gemm_pack here; blocks decoded on the fly for the quantized matmul):
    b_panel(b, args, N, K, NR) runs once at the kernel's entry and returns
    panel(bt, k0, kcl, j0) -> the address of the kcl x NR panel of batch bt for k0 .. k0+kcl-1
    and columns j0 .. j0+NR-1 in gemm_pack's layout (element [k - k0][j - j0], zeros past N),
    emitted inside the loop over a tile's NR panels; or (panel, ahead) with
    ahead(bt, k0, j0, col0, col1, part, parts) emitted before each MR panel's micro-kernel
    run (part of parts), to prefetch a share of what the tile's next panel will read.
    pf_c: each micro-tile prefetches the next one's C lines (prefetch_next_tile).
    scale: the final sums are multiplied by it (rounded) before they are stored or added.
    a_rows: argument 0 is A itself, row-major (unit stride along k, row stride argument 12,
    one batch), read in place: row i0 + r of a micro-tile is A's row min(i0 + r, M - 1) (a
    row past M feeds only accumulators that are never stored), so no gemm_pack pass over A
    and the same FMA chains.
    rank_add: the index e of an argument block (e x, e+1 y, e+2 x's row stride, e+3 y's row
    stride, e+4 r, e+5 s as f32 bits; one batch) that adds s·(x[M, r]·y[r, N]) to each final
    result as it is stored: c = (the result as stored without it) + s·t, t the FMA chain
    over r in increasing order from 0 — the bits of a separate gemm(x, y, out=c,
    accumulate=True, scale=s) run after this one (its rowvec kernel's chain and roundings),
    without that pass over C: a LoRA delta added in the base projection's tile stores."""
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    vt = _vt(W)
    NRc = V * W
    Ap, C, Cpart = (u.arg_ptr(b, args, i) for i in (0, 2, 3))
    M, N, K, kc, MC, NC, nmb, nnb, sAp, accflag, mfast = (
        u.arg(b, args, i) for i in (4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15))
    Mp = b.mul(b.sdiv(b.add(M, u.i64(R - 1)), u.i64(R)), u.i64(R))
    last_row = b.sub(M, u.i64(1))
    hook = b_panel(b, args, N, K, NRc)
    panel_of, ahead = hook if isinstance(hook, tuple) else (hook, None)
    accumulate, cont, more = (b.icmp_signed("!=", b.and_(accflag, u.i64(bit)), u.i64(0))
                              for bit in (SLICE_ACC, SLICE_CONT, SLICE_MORE))
    accs = [[u.entry_alloca(b, vt, f"acc{r}_{v}") for v in range(V)] for r in range(R)]
    rk = None if rank_add is None else rank_block(b, args, rank_add)

    with u.Loop(b, c0, c1, 1, "c") as c:
        # consecutive chunks share the block of the bigger operand (it streams from memory
        # once; the smaller one is re-read from cache): N blocks fastest, or M blocks
        bt = b.sdiv(c, b.mul(nmb, nnb))
        row0, row1, col0, col1 = chunk_block(b, b.srem(c, b.mul(nmb, nnb)), mfast, nmb, nnb,
                                             MC, NC, M, N)
        abat = b.mul(bt, sAp)
        cbat = b.mul(bt, b.mul(M, N))
        with u.Loop(b, u.i64(0), K, kc, "k0") as k0:
            kcl = u.smin(b, kc, b.sub(K, k0))
            first = b.and_(b.icmp_signed("==", k0, u.i64(0)), b.not_(cont))
            last = b.and_(b.icmp_signed(">=", b.add(k0, kc), K), b.not_(more))
            dst = b.select(last, C, Cpart)     # where this k block's sums go
            ablk = b.add(abat, b.mul(k0, Mp))
            with u.Loop(b, col0, col1, NRc, "j0") as j0:
                bp = panel_of(bt, k0, kcl, j0)
                nvalid = b.sub(N, j0)
                cmask = [mask_upto(b, b.sub(nvalid, u.i64(v * W)), W) for v in range(V)]
                nparts = b.sdiv(b.add(b.sub(row1, row0), u.i64(R - 1)), u.i64(R))
                with u.Loop(b, row0, row1, R, "i0") as i0:
                    if ahead is not None:
                        ahead(bt, k0, j0, col0, col1, b.sdiv(b.sub(i0, row0), u.i64(R)), nparts)
                    mvalid = b.sub(M, i0)
                    if a_rows:
                        arow = [b.gep(Ap, [b.add(b.mul(u.smin(b, b.add(i0, u.i64(r)), last_row),
                                                       sAp), k0)], source_etype=u.F32)
                                for r in range(R)]
                    else:
                        ap = b.gep(Ap, [b.add(ablk, b.mul(i0, kcl))], source_etype=u.F32)
                    coff = b.add(cbat, b.add(b.mul(i0, N), j0))
                    if pf_c:
                        nxt = b.add(cbat, next_tile_offset(b, i0, j0, row0, row1, N, R, NRc))
                        prefetch_next_tile(b, dst, nxt, N, R, NRc)

                    def micro(Rk):
                        """The micro-tile on its first Rk rows (Rk <= R): the rows past M
                        of an edge panel cost no FMAs; every row keeps its FMA chain."""
                        masks = row_masks(b, mvalid, cmask, Rk)

                        def tile_io(ptr, load, add=False, scaled=None):
                            """Load the micro-tile from ptr, or store the accumulators there (added
                            to what it holds with `add`; times `scale` where the i1 `scaled` is
                            set)."""
                            out = []
                            for r in range(Rk):
                                for v in range(V):
                                    idx = b.add(coff, b.add(b.mul(u.i64(r), N), u.i64(v * W)))
                                    if load:
                                        out.append(u.load(b, ptr, idx, "f32", W, masks[r][v]))
                                    else:
                                        x = b.load(accs[r][v])
                                        if scaled is not None:
                                            x = b.select(scaled, _scaled(b, x, scale), x)
                                        if add:
                                            x = b.fadd(u.load(b, ptr, idx, "f32", W,
                                                              masks[r][v]), x)
                                        u.store(b, x, ptr, idx, "f32", masks[r][v])
                            return out

                        with b.if_else(first) as (then, other):
                            with then:
                                for r in range(Rk):
                                    for v in range(V):
                                        b.store(u.const(vt, 0.0), accs[r][v])
                            with other:
                                vals = tile_io(Cpart, True)
                                for r in range(Rk):
                                    for v in range(V):
                                        b.store(vals[r * V + v], accs[r][v])

                        def step(kk):
                            bv = [u.load(b, bp, b.add(b.mul(kk, u.i64(NRc)), u.i64(v * W)),
                                         "f32", W) for v in range(V)]
                            for r in range(Rk):
                                a = b.load(b.gep(arow[r], [kk], source_etype=u.F32) if a_rows else
                                           b.gep(ap, [b.add(b.mul(kk, u.i64(R)), u.i64(r))],
                                                 source_etype=u.F32), typ=u.F32)
                                av = u.splat(b, a, W)
                                for v in range(V):
                                    b.store(_fma(b, av, bv[v], b.load(accs[r][v])), accs[r][v])

                        u.unrolled(b, u.i64(0), kcl, U, step)

                        final_add = b.and_(last, accumulate)
                        # the final sums are scaled; partial sums of earlier k blocks are not
                        scaled = last if scale != 1.0 else None
                        with b.if_else(final_add) as (then, other):
                            with then:
                                tile_io(C, False, add=True, scaled=scaled)
                            with other:
                                tile_io(dst, False, scaled=scaled)
                        if rank_add is not None:
                            with b.if_then(last):
                                add_rank(b, rk, accs, i0, j0, cmask, masks, C, coff, N, last_row)

                    by_height(b, mvalid, R, EDGE_ROWS, micro)
    b.ret_void()
    return mod


# ---------------------------------------------------------------------------------------------
# direct kernels for small or skinny problems

@register
@dataclass(frozen=True)
class GemmSmallKey(KernelKey):
    """C computed straight from the operands, no packing of A: for few rows of C (GEMV),
    problems whose b fits in L2, and skinny outputs with both operands contiguous along k.

      rowvec — b has unit stride along n (as given, or packed into column blocks of rn*W
               first): each item is `rm` rows x `rn` vectors of C; for k in increasing order,
               acc = fma(a[i,k], b[k, j..j+W], acc) — the same FMA chain per element as the
               packed path, so the two give the same bits.
      dot    — a and b have unit stride along k: each item is `rm` rows x `rn` columns of C;
               lane t of an accumulator sums k = t, t+W, ... in increasing order (one FMA
               chain, a masked tail last), then a fixed halving tree folds the lanes.

    Arguments: 0 a, 1 b, 2 c, 3 M, 4 N, 5 K, 6 s_am, 7 s_ak, 8 s_bk, 9 s_bn (rowvec: the
    distance between consecutive column blocks of rn*W columns), 10 d1, 11 d2, 12..14 a batch
    strides, 15..17 b batch strides, 18 accumulate, 19 items per chunk, 20 row groups,
    21 column blocks, 22 batches, 23 column blocks fastest. C is contiguous [batch, M, N].
    Items run row groups fastest, so consecutive items reuse one block of b; or, with argument
    23 set (a short k: each item's C is more than its block of b), column blocks fastest, so
    C is written row after row as it lies in memory. scale: as gemm_tile's.
    rank_add (rowvec, one batch): arguments 24..29 are emit_tile's rank_add block, added to
    each stored result the way gemm_tile adds it (the bits of the separate pass).
    """
    family = "gemm_small"
    b_dtype: str
    mode: str     # rowvec | dot
    rm: int
    rn: int
    scale: float = 1.0
    rank_add: bool = False

    def ir(self, symbol: str) -> str:
        return str(_build_small(self, symbol))


def _scaled(b, x, scale):
    """scale·x (rounded), x itself when scale is 1."""
    return x if scale == 1.0 else b.fmul(x, u.const(x.type, scale))


def _build_small(key: GemmSmallKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = lanes()
    vt = _vt(W)
    RM, RN, bdt = key.rm, key.rn, key.b_dtype
    A, B, C = (u.arg_ptr(b, args, i) for i in range(3))
    (M, N, K, s_am, s_ak, s_bk, s_bn, d1, d2, as0, as1, as2, bs0, bs1, bs2, accflag, per,
     nrg, ncb, nbatch, cfast) = (u.arg(b, args, i) for i in range(3, 24))
    accumulate = b.icmp_signed("!=", accflag, u.i64(0))
    items = b.mul(nbatch, b.mul(nrg, ncb))
    q0 = b.mul(c0, per)
    q1 = u.smin(b, b.mul(c1, per), items)
    accs = [[u.entry_alloca(b, vt) for _ in range(RN)] for _ in range(RM)]
    rk = rank_block(b, args, 24) if key.rank_add else None
    last_row = b.sub(M, u.i64(1))
    with u.Loop(b, q0, q1, 1, "q") as q:
        by_c = b.icmp_signed("!=", cfast, u.i64(0))
        bt = b.sdiv(q, b.mul(nrg, ncb))
        t = b.srem(q, b.mul(nrg, ncb))
        rg = b.select(by_c, b.sdiv(t, ncb), b.srem(t, nrg))
        cb = b.select(by_c, b.srem(t, ncb), b.sdiv(t, nrg))
        aoff, boff = _batch_offsets(b, bt, nbatch, d1, d2, (as0, as1, as2), (bs0, bs1, bs2))
        coff = b.mul(bt, b.mul(M, N))
        i0 = b.mul(rg, u.i64(RM))
        mvalid = b.sub(M, i0)
        # rows past the edge read row M-1 (in bounds) and are never stored
        arow = [b.add(aoff, b.mul(u.smin(b, b.add(i0, u.i64(r)), last_row), s_am))
                for r in range(RM)]
        for r in range(RM):
            for v in range(RN):
                b.store(u.const(vt, 0.0), accs[r][v])
        if key.mode == "rowvec":
            j0 = b.mul(cb, u.i64(RN * W))
            nvalid = b.sub(N, j0)
            cm = [mask_upto(b, b.sub(nvalid, u.i64(v * W)), W) for v in range(RN)]
            bcol = b.add(boff, b.mul(cb, s_bn))   # s_bn: the distance between column blocks
            with b.if_then(by_c):   # C row by row: its lines PF_ITEMS items ahead, owned
                for r in range(RM):
                    row = b.add(coff, b.mul(b.add(i0, u.i64(r)), N))
                    for v in range(RN):
                        u.prefetch(b, C, b.add(row, b.add(j0, u.i64((PF_ITEMS * RN + v) * W))),
                                   "f32", write=True)

            isz = u.ITEMSIZE[bdt]
            lines = -(-RN * W * isz // 64)
            pf = RV_PF_ROWS and lines <= RV_PF_LINES
            if pf:
                # the first row group of a block prefetches its rows RV_PF_ROWS ahead, the
                # second the next block's (its first row group then finds them in L2), the
                # others again their own rows (cached by then: a few load slots)
                nxt = b.and_(b.icmp_signed("==", rg, u.i64(1)),
                             b.icmp_signed("<", b.add(cb, u.i64(1)), ncb))
                pf_col = b.select(nxt, b.add(bcol, s_bn), bcol)
                pf_ahead = b.select(nxt, u.i64(0), u.i64(RV_PF_ROWS))

            def kloop(masked):
                with u.Loop(b, u.i64(0), K, 1, "k") as k:
                    brow = b.add(bcol, b.mul(k, s_bk))
                    if pf:
                        kp = u.smin(b, b.add(k, pf_ahead), b.sub(K, u.i64(1)))
                        prow = b.add(pf_col, b.mul(kp, s_bk))
                        for ln in range(lines):
                            u.prefetch(b, B, b.add(prow, u.i64(ln * 64 // isz)), bdt,
                                       locality=2)
                    bv = [u.load(b, B, b.add(brow, u.i64(v * W)), bdt, W, cm[v] if masked else None)
                          for v in range(RN)]
                    ka = b.mul(k, s_ak)
                    for r in range(RM):
                        av = u.splat(b, u.load(b, A, b.add(arow[r], ka), "f32"), W)
                        for v in range(RN):
                            b.store(_fma(b, av, bv[v], b.load(accs[r][v])), accs[r][v])

            # a full block loads b unmasked (RN masks would not fit the 8 mask registers);
            # only the last, partial block of a row masks its loads
            with b.if_else(b.icmp_signed(">=", nvalid, u.i64(RN * W))) as (full, edge):
                with full:
                    kloop(False)
                with edge:
                    kloop(True)
            masks = row_masks(b, mvalid, cm, RM)
            cbase = b.add(coff, b.add(b.mul(i0, N), j0))   # C[i0, j0]

            def put(add):
                """Store the tile (added to C's values with `add`: C is read only then)."""
                for r in range(RM):
                    for v in range(RN):
                        idx = b.add(cbase, b.add(b.mul(u.i64(r), N), u.i64(v * W)))
                        x = _scaled(b, b.load(accs[r][v]), key.scale)
                        if add:
                            x = b.fadd(u.load(b, C, idx, "f32", W, masks[r][v]), x)
                        u.store(b, x, C, idx, "f32", masks[r][v])
            with b.if_else(accumulate) as (then, other):
                with then:
                    put(True)
                with other:
                    put(False)
            if rk is not None:
                add_rank(b, rk, accs, i0, j0, cm, masks, C, cbase, N, last_row)
        else:
            j0 = b.mul(cb, u.i64(RN))
            nvalid = b.sub(N, j0)
            bcol = [b.add(boff, b.mul(u.smin(b, b.add(j0, u.i64(c)), b.sub(N, u.i64(1))), s_bn))
                    for c in range(RN)]

            def step(kt, mask):
                av = [u.load(b, A, b.add(arow[r], kt), "f32", W, mask) for r in range(RM)]
                for c in range(RN):
                    bv = u.load(b, B, b.add(bcol[c], kt), bdt, W, mask)
                    for r in range(RM):
                        b.store(_fma(b, av[r], bv, b.load(accs[r][c])), accs[r][c])

            kfull = b.sub(K, b.srem(K, u.i64(W)))
            with u.Loop(b, u.i64(0), kfull, W, "k") as kt:
                step(kt, None)
            with b.if_then(b.icmp_signed("<", kfull, K)):
                step(kfull, u.tail_mask(b, b.sub(K, kfull), W))
            for r in range(RM):
                for c in range(RN):
                    ok = b.and_(b.icmp_signed("<", u.i64(r), mvalid),
                                b.icmp_signed("<", u.i64(c), nvalid))
                    with b.if_then(ok):
                        idx = b.add(coff, b.add(b.mul(b.add(i0, u.i64(r)), N), b.add(j0, u.i64(c))))
                        x = _scaled(b, lane_tree(b, b.load(accs[r][c]), fadd), key.scale)
                        p = b.gep(C, [idx], source_etype=u.F32)
                        with b.if_else(accumulate) as (then, other):
                            with then:
                                b.store(b.fadd(b.load(p, typ=u.F32), x), p)
                            with other:
                                b.store(x, p)
    b.ret_void()
    return mod
