"""Convolution, pooling and vision kernels (SPEC §3.13). Every feature map is channel-last and
contiguous, [H, W, C] (a 1-D signal [T, C] is a map with H = 1), and every kernel vectorises
along the contiguous channel axis, so all of them share one shape of loop: pixels outside,
channel vectors (full vectors, then one masked tail) inside.

conv           direct convolution as an implicit GEMM: one work item is `rm` consecutive output
               pixels (row-major, a group may span rows) x `rn` vectors of one group's output
               channels; for each tap (ky, kx) in order and each input channel c of the group
               in order, acc = fma(src[pixel + tap, c], w[tap, c, n..n+W], acc). Bounds are
               checked once per pixel and tap, outside the channel loop: a tap off the map
               reads a row of zeros (or, left of a 1-D signal, its `state`), so padding costs
               no copy. The weight is addressed by strides (negative ones read it flipped: the
               input gradient is the same kernel over the flipped, transposed weight).
               Epilogue: + bias, relu.
               Every output's sum is one FMA chain in (ky, kx, c) order, fixed by the shape.
conv_wgrad     the weight gradient dW[tap, c, n] = sum over output pixels m of
               src[m + tap, c] * g[m, n]: `rm` input channels x `rn` output-channel vectors per
               item, one FMA chain per element over a fixed block of output pixels (row-major);
               blocks land in separate partial buffers that the exec layer folds in order.
conv_dw        depthwise convolution (groups = channels), bounds checked per tap, acc = acc +
               x * w (separately rounded, taps in (ky, kx) order from +0): bitwise equal to the
               float32 formula. Taps left of column 0 may read a 1-D `state` (the rows that
               precede a streaming chunk) instead of zeros.
conv_dw_wgrad  its weight gradient: per block of output pixels, partial[tap, c] += g * x.
conv_pool      max (first maximum; a NaN wins and the last NaN is kept, as torch does; saves
               the winning tap index as f32), avg over the valid taps (count_include_pad=False),
               sum. Taps in (ky, kx) order.
conv_pool_grad the input gradient of a pool as a gather: every input pixel sums, in output
               order, what the outputs whose window covers it send back (max: g where it won;
               avg: g / count; sum: g), so no two threads ever write one element.
conv_fold      unfold (im2col rows, element order (ky, kx, c)), fold (its adjoint as a gather:
               out = [bias +] the taps that land on a pixel, in (ky, kx) order from +0; columns
               at or past `Wv` get no taps), spread (copy a map into a zero map at a stride and an
               offset: padding, and the zero-dilated gradient of a strided conv).
conv_chan      per-channel prelu and affine (x * s + b, not fused), forward and backward; the
               backward writes per-chunk partial column sums for the channel parameters.
conv_wino      Winograd F(m x m, 3 x 3), m = 2 or 4: weight planes U = G g Gt, input planes
               V = Bt d B, output Y = At M A (+ bias, relu); the products M = V U are batched
               GEMMs run by the exec layer.

A work item never depends on the thread count and no two items write one element, so every
result is bitwise identical for any number of threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction as Fr

from llvmlite import ir

from . import irutil as u
from .emit import relu
from .kernels import KernelKey, register
from .rows import map_pass
from .target import host

UNROLL = 4       # input channels per step of the implicit-GEMM inner loop
DW_VECS = 4      # channel vectors a depthwise / pool item keeps in registers at once


def lanes() -> int:
    return host().f32_lanes


def _vt():
    return ir.VectorType(u.F32, lanes())


def _fma(b, x, y, z):
    return u.intrinsic(b, "llvm.fma", z.type, [x, y, z])


def _upto(b, count, W):
    """<W x i1>: lane t on iff t < count (count may be < 0 or > W)."""
    c = b.select(b.icmp_signed("<", count, u.i64(0)), u.i64(0), count)
    return u.tail_mask(b, u.smin(b, c, u.i64(W)), W)


def _no_lanes(W):
    return ir.Constant(ir.VectorType(u.I1, W), [ir.Constant(u.I1, 0)] * W)


def _args(b, args, first, n):
    return [u.arg(b, args, i) for i in range(first, first + n)]


def _ptrs(b, args, n):
    return [u.arg_ptr(b, args, i) for i in range(n)]


def _items(b, c0, c1, per, total):
    """The work items [q0, q1) of chunks [c0, c1) at `per` items per chunk."""
    return b.mul(c0, per), u.smin(b, b.mul(c1, per), total)


def _split(b, q, *dims):
    """Mixed-radix digits of q, fastest first: q = d0 + dims[0] * (d1 + dims[1] * ...)."""
    out = []
    for d in dims:
        out.append(b.srem(q, d))
        q = b.sdiv(q, d)
    return out + [q]


def _in(b, v, lo, hi):
    """lo <= v < hi."""
    return b.and_(b.icmp_signed(">=", v, lo), b.icmp_signed("<", v, hi))


def _channels(b, C, body, nvec=DW_VECS):
    """body(c, nv, masks) over the channels [0, C): blocks of `nvec` full vectors, then single
    full vectors, then one masked tail (masks None for full vectors)."""
    W = lanes()
    blk = nvec * W
    big = b.sub(C, b.srem(C, u.i64(blk)))
    with u.Loop(b, u.i64(0), big, blk, "cb") as c:
        body(c, nvec, None)
    full = b.sub(C, b.srem(C, u.i64(W)))
    with u.Loop(b, big, full, W, "cv") as c:
        body(c, 1, None)
    with b.if_then(b.icmp_signed("<", full, C)):
        body(full, 1, [u.tail_mask(b, b.sub(C, full), W)])


def _accs(b, n, value=0.0):
    slots = [u.entry_alloca(b, _vt()) for _ in range(n)]
    for s in slots:
        b.store(u.const(_vt(), value), s)
    return slots


def _mask(masks, v):
    return None if masks is None else masks[v]


# ---------------------------------------------------------------------------------------------
# conv: the implicit GEMM

@register
@dataclass(frozen=True)
class ConvKey(KernelKey):
    """Arguments: 0 src [H, W, groups * cin per group], 1 w, 2 out, 3 bias (0: none), 4 zeros
    (a row of cin-per-group zeros, read by taps outside the map), 5 state (1-D: rows left of
    column 0; 0: none), 6 state rows, 7 H, 8 W, 9 OH, 10 OW, 11 groups, 12 cin per group,
    13 cout per group, 14 sh, 15 sw, 16 dh, 17 dw, 18 pad top, 19 pad left (negative: a crop),
    20 b_g, 21 b_ky, 22 b_kx, 23 b_c (weight elements per group, tap row, tap column, input
    channel; unit stride along output channels), 24 kh, 25 kw, 26 relu, 27 items per chunk,
    28 pixel groups (of rm pixels, row-major over the whole output), 29 column blocks per
    group. Items: pixel groups fastest, then column blocks, then groups."""

    family = "conv"
    rm: int
    rn: int

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _conv, self)


def _pixel(b, x, state, hist, H, W, C, iy, ix):
    """(valid, pointer to channel 0) of source pixel (iy, ix): the map, or, left of column 0,
    the 1-D `state` rows (when given)."""
    row_ok = _in(b, iy, u.i64(0), H)
    in_map = b.and_(row_ok, _in(b, ix, u.i64(0), W))
    has_state = b.icmp_unsigned("!=", b.ptrtoint(state, u.I64), u.i64(0))
    from_state = b.and_(b.and_(has_state, row_ok),
                        b.and_(b.icmp_signed("<", ix, u.i64(0)),
                               b.icmp_signed(">=", b.add(ix, hist), u.i64(0))))
    xp = b.gep(x, [b.mul(b.add(b.mul(iy, W), ix), C)], source_etype=u.F32)
    sp = b.gep(state, [b.mul(b.add(ix, hist), C)], source_etype=u.F32)
    return b.or_(in_map, from_state), b.select(in_map, xp, sp)


def _conv(key, b, args, c0, c1):
    W = lanes()
    RM, RN = key.rm, key.rn
    src, wt, out, bias, zeros, state = _ptrs(b, args, 6)
    (hist, H, Wd, OH, OW, G, cinpg, coutpg, sh, sw, dh, dw, pt, pl, b_g, b_ky, b_kx, b_c, kh, kw,
     relu_on, per, nxg, ncb) = _args(b, args, 6, 24)
    Cs, Cout = b.mul(G, cinpg), b.mul(G, coutpg)
    q0, q1 = _items(b, c0, c1, per, b.mul(nxg, b.mul(ncb, G)))
    accs = [[u.entry_alloca(b, _vt()) for _ in range(RN)] for _ in range(RM)]
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bias, u.I64), u.i64(0))
    do_relu = b.icmp_signed("!=", relu_on, u.i64(0))
    npix = b.mul(OH, OW)
    with u.Loop(b, q0, q1, 1, "q") as q:
        xg, cb, g = _split(b, q, nxg, ncb)
        p0 = b.mul(xg, u.i64(RM))
        gch = b.mul(g, cinpg)
        corner = []  # window corner of each pixel; pixels past the end repeat the last one
        for r in range(RM):
            ox, oy = _split(b, u.smin(b, b.add(p0, u.i64(r)), b.sub(npix, u.i64(1))), OW)
            corner.append((b.sub(b.mul(oy, sh), pt), b.sub(b.mul(ox, sw), pl)))
        n0 = b.mul(cb, u.i64(RN * W))
        nvalid = b.sub(coutpg, n0)
        cm = [_upto(b, b.sub(nvalid, u.i64(v * W)), W) for v in range(RN)]
        bgrp = b.add(b.mul(g, b_g), n0)
        for row in accs:
            for slot in row:
                b.store(u.const(_vt(), 0.0), slot)

        def kloop(masked):
            with u.Loop(b, u.i64(0), kh, 1, "ky") as ky:
                with u.Loop(b, u.i64(0), kw, 1, "kx") as kx:
                    boff = b.add(bgrp, b.add(b.mul(ky, b_ky), b.mul(kx, b_kx)))
                    arow = []   # each pixel's tap: its source channels, or the zero row
                    for iy0, ix0 in corner:
                        ok, p = _pixel(b, src, state, hist, H, Wd, Cs,
                                       b.add(iy0, b.mul(ky, dh)), b.add(ix0, b.mul(kx, dw)))
                        arow.append(b.select(ok, b.gep(p, [gch], source_etype=u.F32), zeros))

                    def step(c):
                        bb = b.add(boff, b.mul(c, b_c))
                        bv = [u.load(b, wt, b.add(bb, u.i64(v * W)), "f32", W,
                                     cm[v] if masked else None) for v in range(RN)]
                        for r in range(RM):
                            a = u.splat(b, u.load(b, arow[r], c, "f32"), W)
                            for v in range(RN):
                                b.store(_fma(b, a, bv[v], b.load(accs[r][v])), accs[r][v])

                    u.unrolled(b, u.i64(0), cinpg, UNROLL, step, "c")

        # a full block of columns loads the weight unmasked; only a group's last block masks
        with b.if_else(b.icmp_signed(">=", nvalid, u.i64(RN * W))) as (full, edge):
            with full:
                kloop(False)
            with edge:
                kloop(True)
        ocol = b.add(b.mul(g, coutpg), n0)
        for r in range(RM):
            rowok = b.icmp_signed("<", b.add(p0, u.i64(r)), npix)
            obase = b.add(b.mul(b.add(p0, u.i64(r)), Cout), ocol)
            for v in range(RN):
                m = b.select(rowok, cm[v], _no_lanes(W))
                slot = accs[r][v]
                with b.if_then(has_bias):
                    x = b.fadd(b.load(slot), u.load(b, bias, b.add(ocol, u.i64(v * W)), "f32", W, cm[v]))
                    b.store(x, slot)
                x = b.load(slot)
                x = b.select(do_relu, relu(b, x), x)
                u.store(b, x, out, b.add(obase, u.i64(v * W)), "f32", m)


# ---------------------------------------------------------------------------------------------
# conv_wgrad: the weight gradient of conv

@register
@dataclass(frozen=True)
class ConvWgradKey(KernelKey):
    """Arguments: 0 src, 1 g (output gradient [OH, OW, Cout]), 2 dW partials
    [blocks][kh*kw][cin per group][Cout], 3 OH, 4 OW, 5 groups, 6 cin per group, 7 cout per
    group, 8 Cout, 9 a_oy, 10 a_ox (source elements per output row / column), 11 a_ky, 12 a_kx
    (per tap row / column), 13 kh, 14 kw, 15 output pixels per block, 16 blocks, 17 items per
    chunk, 18 channel groups (of rm) per group, 19 column blocks per group. The source is
    padded: no bounds are checked. Items: channel groups fastest, then taps, column blocks,
    groups, blocks."""

    family = "conv_wgrad"
    rm: int
    rn: int

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _wgrad, self)


def _wgrad(key, b, args, c0, c1):
    W = lanes()
    RM, RN = key.rm, key.rn
    src, gr, dw = _ptrs(b, args, 3)
    (OH, OW, G, cinpg, coutpg, Cout, a_oy, a_ox, a_ky, a_kx, kh, kw, ppb, nblk, per, ncg,
     ncb) = _args(b, args, 3, 17)
    taps = b.mul(kh, kw)
    total = b.mul(b.mul(b.mul(ncg, taps), b.mul(ncb, G)), nblk)
    q0, q1 = _items(b, c0, c1, per, total)
    accs = [[u.entry_alloca(b, _vt()) for _ in range(RN)] for _ in range(RM)]
    with u.Loop(b, q0, q1, 1, "q") as q:
        cg, tap, cb, g, blk = _split(b, q, ncg, taps, ncb, G)
        ky, kx = b.sdiv(tap, kw), b.srem(tap, kw)
        ci0 = b.mul(cg, u.i64(RM))
        last = b.sub(cinpg, u.i64(1))
        toff = b.add(b.add(b.mul(ky, a_ky), b.mul(kx, a_kx)), b.mul(g, cinpg))
        soff = [b.add(toff, u.smin(b, b.add(ci0, u.i64(r)), last)) for r in range(RM)]
        n0 = b.mul(cb, u.i64(RN * W))
        nvalid = b.sub(coutpg, n0)
        cm = [_upto(b, b.sub(nvalid, u.i64(v * W)), W) for v in range(RN)]
        gcol = b.add(b.mul(g, coutpg), n0)
        p0 = b.mul(blk, ppb)                               # pixels [p0, p1) of this block
        p1 = u.smin(b, b.add(p0, ppb), b.mul(OH, OW))
        y0 = b.sdiv(p0, OW)
        y1 = b.add(b.sdiv(b.sub(p1, u.i64(1)), OW), u.i64(1))
        for row in accs:
            for s in row:
                b.store(u.const(_vt(), 0.0), s)

        def ploop(masked):
            with u.Loop(b, y0, y1, 1, "oy") as oy:
                srow = b.mul(oy, a_oy)
                grow = b.add(b.mul(b.mul(oy, OW), Cout), gcol)
                first = b.sub(p0, b.mul(oy, OW))
                x0 = b.select(b.icmp_signed("<", first, u.i64(0)), u.i64(0), first)
                x1 = u.smin(b, b.sub(p1, b.mul(oy, OW)), OW)
                with u.Loop(b, x0, x1, 1, "ox") as ox:
                    p = b.add(srow, b.mul(ox, a_ox))
                    gp = b.add(grow, b.mul(ox, Cout))
                    gv = [u.load(b, gr, b.add(gp, u.i64(v * W)), "f32", W, cm[v] if masked else None)
                          for v in range(RN)]
                    for r in range(RM):
                        a = u.splat(b, u.load(b, src, b.add(p, soff[r]), "f32"), W)
                        for v in range(RN):
                            b.store(_fma(b, a, gv[v], b.load(accs[r][v])), accs[r][v])

        with b.if_else(b.icmp_signed(">=", nvalid, u.i64(RN * W))) as (full, edge):
            with full:
                ploop(False)
            with edge:
                ploop(True)
        base = b.mul(blk, b.mul(b.mul(taps, cinpg), Cout))
        for r in range(RM):
            ci = b.add(ci0, u.i64(r))
            rowok = b.icmp_signed("<", ci, cinpg)
            obase = b.add(base, b.add(b.mul(b.add(b.mul(tap, cinpg), ci), Cout), gcol))
            for v in range(RN):
                m = b.select(rowok, cm[v], _no_lanes(W))
                u.store(b, b.load(accs[r][v]), dw, b.add(obase, u.i64(v * W)), "f32", m)


# ---------------------------------------------------------------------------------------------
# geometry shared by the bounds-checked kernels

class _Geo:
    """The common argument block of the bounds-checked kernels: H, W, C, OH, OW, kh, kw, sh, sw,
    dh, dw, ph, pw (in this order, starting at `first`)."""

    NARGS = 13

    def __init__(self, b, args, first):
        (self.H, self.W, self.C, self.OH, self.OW, self.kh, self.kw, self.sh, self.sw, self.dh,
         self.dw, self.ph, self.pw) = _args(b, args, first, self.NARGS)

    def src_row(self, b, oy, ky):
        return b.sub(b.add(b.mul(oy, self.sh), b.mul(ky, self.dh)), self.ph)

    def src_col(self, b, ox, kx):
        return b.sub(b.add(b.mul(ox, self.sw), b.mul(kx, self.dw)), self.pw)

    def window(self, b, oy, ox, inside, edge):
        """inside(iy0, ix0) when the whole window of output (oy, ox) lies in the map (no tap
        needs a check), else edge(): most windows of a big map take the first branch."""
        iy0, ix0 = self.src_row(b, oy, u.i64(0)), self.src_col(b, ox, u.i64(0))
        last_y = b.add(iy0, b.mul(b.sub(self.kh, u.i64(1)), self.dh))
        last_x = b.add(ix0, b.mul(b.sub(self.kw, u.i64(1)), self.dw))
        ok = b.and_(b.and_(b.icmp_signed(">=", iy0, u.i64(0)), b.icmp_signed("<", last_y, self.H)),
                    b.and_(b.icmp_signed(">=", ix0, u.i64(0)), b.icmp_signed("<", last_x, self.W)))
        with b.if_else(ok) as (then, other):
            with then:
                inside(iy0, ix0)
            with other:
                edge()

    def tap_ptr(self, b, x, iy0, ix0, ky, kx):
        """The pixel of tap (ky, kx) of an inside window starting at (iy0, ix0)."""
        iy = b.add(iy0, b.mul(ky, self.dh))
        ix = b.add(ix0, b.mul(kx, self.dw))
        return b.gep(x, [b.mul(b.add(b.mul(iy, self.W), ix), self.C)], source_etype=u.F32)


# ---------------------------------------------------------------------------------------------
# conv_dw: depthwise

@register
@dataclass(frozen=True)
class DepthwiseKey(KernelKey):
    """Arguments: 0 x, 1 w (pointer to tap (0, 0) of [taps, C]), 2 out, 3 bias (0: none),
    4 state (0: none), 5..17 geometry (see _Geo), 18 weight elements per tap row, 19 per tap
    column (negative: flipped), 20 state rows, 21 pixels per chunk, 22 relu."""

    family = "conv_dw"

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _depthwise)


def _depthwise(b, args, c0, c1):
    W = lanes()
    x, w, out, bias, state = _ptrs(b, args, 5)
    geo = _Geo(b, args, 5)
    s_wky, s_wkx, hist, per, relu_on = _args(b, args, 18, 5)
    npix = b.mul(geo.OH, geo.OW)
    q0, q1 = _items(b, c0, c1, per, npix)
    accs = _accs(b, DW_VECS)
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bias, u.I64), u.i64(0))
    do_relu = b.icmp_signed("!=", relu_on, u.i64(0))
    with u.Loop(b, q0, q1, 1, "q") as q:
        ox, oy = _split(b, q, geo.OW)
        obase = b.mul(q, geo.C)

        def block(start):
            def run(c, nv, masks):
                for v in range(nv):
                    b.store(u.const(_vt(), 0.0), accs[v])
                with u.Loop(b, u.i64(0), geo.kh, 1, "ky") as ky:
                    with u.Loop(b, u.i64(0), geo.kw, 1, "kx") as kx:
                        woff = b.add(b.add(b.mul(ky, s_wky), b.mul(kx, s_wkx)), c)

                        def tap(sp):
                            for v in range(nv):
                                xv = u.load(b, sp, b.add(c, u.i64(v * W)), "f32", W, _mask(masks, v))
                                wv = u.load(b, w, b.add(woff, u.i64(v * W)), "f32", W, _mask(masks, v))
                                b.store(b.fadd(b.load(accs[v]), b.fmul(xv, wv)), accs[v])
                        if start is not None:
                            tap(geo.tap_ptr(b, x, *start, ky, kx))
                        else:
                            ok, sp = _pixel(b, x, state, hist, geo.H, geo.W, geo.C,
                                            geo.src_row(b, oy, ky), geo.src_col(b, ox, kx))
                            with b.if_then(ok):
                                tap(sp)
                for v in range(nv):
                    cv = b.add(c, u.i64(v * W))
                    with b.if_then(has_bias):
                        b.store(b.fadd(b.load(accs[v]), u.load(b, bias, cv, "f32", W, _mask(masks, v))),
                                accs[v])
                    y = b.load(accs[v])
                    u.store(b, b.select(do_relu, relu(b, y), y), out, b.add(obase, cv), "f32",
                            _mask(masks, v))
            return run

        geo.window(b, oy, ox, lambda iy0, ix0: _channels(b, geo.C, block((iy0, ix0))),
                   lambda: _channels(b, geo.C, block(None)))


@register
@dataclass(frozen=True)
class DepthwiseWgradKey(KernelKey):
    """Arguments: 0 x, 1 g [OH, OW, C], 2 partials [blocks][taps][C], 3 state (0: none),
    4..16 geometry, 17 state rows, 18 output pixels per block, 19 blocks, 20 channel blocks
    (of DW_VECS vectors). Items: channel blocks fastest, then pixel blocks."""

    family = "conv_dw_wgrad"

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _dw_wgrad)


def _dw_wgrad(b, args, c0, c1):
    W = lanes()
    x, g, part, state = _ptrs(b, args, 4)
    geo = _Geo(b, args, 4)
    hist, ppb, nblk, ncb = _args(b, args, 17, 4)
    taps = b.mul(geo.kh, geo.kw)
    with u.Loop(b, c0, c1, 1, "q") as q:
        cb, blk = _split(b, q, ncb)
        c = b.mul(cb, u.i64(DW_VECS * W))
        masks = [_upto(b, b.sub(geo.C, b.add(c, u.i64(v * W))), W) for v in range(DW_VECS)]
        pb = b.gep(part, [b.add(b.mul(blk, b.mul(taps, geo.C)), c)], source_etype=u.F32)
        with u.Loop(b, u.i64(0), taps, 1, "t") as t:
            for v in range(DW_VECS):
                u.store(b, u.const(_vt(), 0.0), pb, b.add(b.mul(t, geo.C), u.i64(v * W)), "f32", masks[v])
        p0 = b.mul(blk, ppb)
        p1 = u.smin(b, b.add(p0, ppb), b.mul(geo.OH, geo.OW))
        with u.Loop(b, p0, p1, 1, "p") as p:
            ox, oy = _split(b, p, geo.OW)
            gb = b.add(b.mul(p, geo.C), c)
            gv = [u.load(b, g, b.add(gb, u.i64(v * W)), "f32", W, masks[v]) for v in range(DW_VECS)]

            def taps(start):
                with u.Loop(b, u.i64(0), geo.kh, 1, "ky") as ky:
                    with u.Loop(b, u.i64(0), geo.kw, 1, "kx") as kx:
                        tb = b.mul(b.add(b.mul(ky, geo.kw), kx), geo.C)

                        def tap(sp):
                            for v in range(DW_VECS):
                                xv = u.load(b, sp, b.add(c, u.i64(v * W)), "f32", W, masks[v])
                                i = b.add(tb, u.i64(v * W))
                                acc = u.load(b, pb, i, "f32", W, masks[v])
                                u.store(b, b.fadd(acc, b.fmul(gv[v], xv)), pb, i, "f32", masks[v])
                        if start is not None:
                            tap(geo.tap_ptr(b, x, *start, ky, kx))
                        else:
                            ok, sp = _pixel(b, x, state, hist, geo.H, geo.W, geo.C,
                                            geo.src_row(b, oy, ky), geo.src_col(b, ox, kx))
                            with b.if_then(ok):
                                tap(sp)
            geo.window(b, oy, ox, lambda iy0, ix0: taps((iy0, ix0)), lambda: taps(None))


# ---------------------------------------------------------------------------------------------
# pools

POOL_OPS = ("max", "avg", "sum")


@register
@dataclass(frozen=True)
class PoolKey(KernelKey):
    """op in POOL_OPS. Arguments: 0 x, 1 out, 2 argmax (f32 tap index; 0: not saved),
    3..15 geometry (dilation 1), 16 pixels per chunk."""

    family = "conv_pool"
    op: str

    def ir(self, symbol: str) -> str:
        if self.op not in POOL_OPS:
            raise ValueError(f"pool kernel: unknown op {self.op!r}")
        return u.module(symbol, _pool, self)


def _pool(key, b, args, c0, c1):
    W = lanes()
    vt = _vt()
    x, out, arg = _ptrs(b, args, 3)
    geo = _Geo(b, args, 3)
    per = u.arg(b, args, 16)
    q0, q1 = _items(b, c0, c1, per, b.mul(geo.OH, geo.OW))
    accs = _accs(b, DW_VECS)
    idxs = _accs(b, DW_VECS)
    cnt = u.entry_alloca(b, u.I64)
    save = b.icmp_unsigned("!=", b.ptrtoint(arg, u.I64), u.i64(0))
    with u.Loop(b, q0, q1, 1, "q") as q:
        ox, oy = _split(b, q, geo.OW)
        obase = b.mul(q, geo.C)

        def block(start):
            def run(c, nv, masks):
                init = float("-inf") if key.op == "max" else 0.0
                for v in range(nv):
                    b.store(u.const(vt, init), accs[v])
                    b.store(u.const(vt, -1.0), idxs[v])
                b.store(u.i64(0), cnt)
                with u.Loop(b, u.i64(0), geo.kh, 1, "ky") as ky:
                    with u.Loop(b, u.i64(0), geo.kw, 1, "kx") as kx:
                        def tap(xp):
                            b.store(b.add(b.load(cnt), u.i64(1)), cnt)
                            tapf = u.splat(b, b.sitofp(b.add(b.mul(ky, geo.kw), kx), u.F32), W)
                            for v in range(nv):
                                xv = u.load(b, xp, b.add(c, u.i64(v * W)), "f32", W, _mask(masks, v))
                                acc = b.load(accs[v])
                                if key.op == "max":
                                    take = b.or_(b.fcmp_ordered(">", xv, acc),
                                                 b.fcmp_unordered("uno", xv, xv))
                                    b.store(b.select(take, xv, acc), accs[v])
                                    b.store(b.select(take, tapf, b.load(idxs[v])), idxs[v])
                                else:
                                    b.store(b.fadd(acc, xv), accs[v])
                        if start is not None:
                            tap(geo.tap_ptr(b, x, *start, ky, kx))
                        else:
                            iy, ix = geo.src_row(b, oy, ky), geo.src_col(b, ox, kx)
                            with b.if_then(b.and_(_in(b, iy, u.i64(0), geo.H), _in(b, ix, u.i64(0), geo.W))):
                                tap(b.gep(x, [b.mul(b.add(b.mul(iy, geo.W), ix), geo.C)], source_etype=u.F32))
                for v in range(nv):
                    cv = b.add(obase, b.add(c, u.i64(v * W)))
                    r = b.load(accs[v])
                    if key.op == "avg":
                        r = b.fdiv(r, u.splat(b, b.sitofp(b.load(cnt), u.F32), W))
                    u.store(b, r, out, cv, "f32", _mask(masks, v))
                    if key.op == "max":
                        with b.if_then(save):
                            u.store(b, b.load(idxs[v]), arg, cv, "f32", _mask(masks, v))
            return run

        geo.window(b, oy, ox, lambda iy0, ix0: _channels(b, geo.C, block((iy0, ix0))),
                   lambda: _channels(b, geo.C, block(None)))


@register
@dataclass(frozen=True)
class PoolGradKey(KernelKey):
    """op in POOL_OPS. Arguments: 0 g [OH, OW, C], 1 argmax (max), 2 dx [H, W, C],
    3..15 geometry (dilation 1), 16 input pixels per chunk."""

    family = "conv_pool_grad"
    op: str

    def ir(self, symbol: str) -> str:
        if self.op not in POOL_OPS:
            raise ValueError(f"pool kernel: unknown op {self.op!r}")
        return u.module(symbol, _pool_grad, self)


def _covering(b, i, p, k, s, n_out):
    """[lo, hi): the outputs o (0 <= o < n_out) whose window o*s - p .. o*s - p + k - 1
    covers input index i."""
    t = b.add(b.sub(i, k), b.add(p, u.i64(1)))          # i + p - k + 1
    lo = b.select(b.icmp_signed("<=", t, u.i64(0)), u.i64(0),
                  b.sdiv(b.add(t, b.sub(s, u.i64(1))), s))
    hi = u.smin(b, b.add(b.sdiv(b.add(i, p), s), u.i64(1)), n_out)
    return lo, hi


def _valid_len(b, o, s, p, k, n):
    """How many of the k taps of window o (start o*s - p) fall inside [0, n)."""
    st = b.sub(b.mul(o, s), p)
    lo = b.select(b.icmp_signed("<", st, u.i64(0)), u.i64(0), st)
    hi = u.smin(b, b.add(st, k), n)
    return b.sub(hi, lo)


def _pool_grad(key, b, args, c0, c1):
    W = lanes()
    vt = _vt()
    g, arg, dx = _ptrs(b, args, 3)
    geo = _Geo(b, args, 3)
    per = u.arg(b, args, 16)
    q0, q1 = _items(b, c0, c1, per, b.mul(geo.H, geo.W))
    accs = _accs(b, DW_VECS)
    with u.Loop(b, q0, q1, 1, "q") as q:
        ix, iy = _split(b, q, geo.W)
        ylo, yhi = _covering(b, iy, geo.ph, geo.kh, geo.sh, geo.OH)
        xlo, xhi = _covering(b, ix, geo.pw, geo.kw, geo.sw, geo.OW)
        dbase = b.mul(q, geo.C)

        def block(c, nv, masks):
            for v in range(nv):
                b.store(u.const(vt, 0.0), accs[v])
            with u.Loop(b, ylo, yhi, 1, "oy") as oy:
                with u.Loop(b, xlo, xhi, 1, "ox") as ox:
                    gb = b.add(b.mul(b.add(b.mul(oy, geo.OW), ox), geo.C), c)
                    if key.op == "max":
                        tap = b.add(b.mul(b.sub(b.add(iy, geo.ph), b.mul(oy, geo.sh)), geo.kw),
                                    b.sub(b.add(ix, geo.pw), b.mul(ox, geo.sw)))
                        tapf = u.splat(b, b.sitofp(tap, u.F32), W)
                    elif key.op == "avg":
                        n = b.mul(_valid_len(b, oy, geo.sh, geo.ph, geo.kh, geo.H),
                                  _valid_len(b, ox, geo.sw, geo.pw, geo.kw, geo.W))
                        cntv = u.splat(b, b.sitofp(n, u.F32), W)
                    for v in range(nv):
                        i = b.add(gb, u.i64(v * W))
                        gv = u.load(b, g, i, "f32", W, _mask(masks, v))
                        if key.op == "max":
                            won = b.fcmp_ordered("==", u.load(b, arg, i, "f32", W, _mask(masks, v)), tapf)
                            gv = b.select(won, gv, u.const(vt, 0.0))
                        elif key.op == "avg":
                            gv = b.fdiv(gv, cntv)
                        b.store(b.fadd(b.load(accs[v]), gv), accs[v])
            for v in range(nv):
                u.store(b, b.load(accs[v]), dx, b.add(dbase, b.add(c, u.i64(v * W))), "f32",
                        _mask(masks, v))

        _channels(b, geo.C, block)


# ---------------------------------------------------------------------------------------------
# unfold / fold / spread

FOLD_OPS = ("unfold", "fold", "spread")


@register
@dataclass(frozen=True)
class FoldKey(KernelKey):
    """op in FOLD_OPS.
    unfold: 0 x [H, W, C], 1 col [OH*OW, kh*kw*C], 2..14 geometry, 15 pixels per chunk.
    fold:   0 col, 1 out [H, W, C], 2 bias (0: none), 3..15 geometry, 16 pixels per chunk,
            17 Wv (columns at or past it get no taps: bias only).
    spread: 0 src [Hs, Ws, C], 1 dst [Hd, Wd, C], 2 Hs, 3 Ws, 4 C, 5 Hd, 6 Wd, 7 row offset,
            8 column offset, 9 row step, 10 column step, 11 pixels per chunk:
            dst[y, x] = src[(y - oy0) / sy, (x - ox0) / sx] where that divides and is in range,
            else 0."""

    family = "conv_fold"
    op: str

    def ir(self, symbol: str) -> str:
        if self.op not in FOLD_OPS:
            raise ValueError(f"fold kernel: unknown op {self.op!r}")
        return u.module(symbol, {"unfold": _unfold, "fold": _fold, "spread": _spread}[self.op])


def _copy_row(b, dst, src, C):
    W = lanes()
    map_pass(b, u.i64(0), C, W, lambda c, m: u.store(b, u.load(b, src, c, "f32", W, m), dst, c, "f32", m))


def _zero_row(b, dst, C):
    W = lanes()
    map_pass(b, u.i64(0), C, W, lambda c, m: u.store(b, u.const(_vt(), 0.0), dst, c, "f32", m))


def _unfold(b, args, c0, c1):
    x, col = _ptrs(b, args, 2)
    geo = _Geo(b, args, 2)
    per = u.arg(b, args, 15)
    taps = b.mul(geo.kh, geo.kw)
    q0, q1 = _items(b, c0, c1, per, b.mul(geo.OH, geo.OW))
    with u.Loop(b, q0, q1, 1, "q") as q:
        ox, oy = _split(b, q, geo.OW)
        with u.Loop(b, u.i64(0), geo.kh, 1, "ky") as ky:
            iy = geo.src_row(b, oy, ky)
            with u.Loop(b, u.i64(0), geo.kw, 1, "kx") as kx:
                ix = geo.src_col(b, ox, kx)
                tap = b.add(b.mul(ky, geo.kw), kx)
                dst = b.gep(col, [b.mul(b.add(b.mul(q, taps), tap), geo.C)], source_etype=u.F32)
                ok = b.and_(_in(b, iy, u.i64(0), geo.H), _in(b, ix, u.i64(0), geo.W))
                with b.if_else(ok) as (then, other):
                    with then:
                        src = b.gep(x, [b.mul(b.add(b.mul(iy, geo.W), ix), geo.C)], source_etype=u.F32)
                        _copy_row(b, dst, src, geo.C)
                    with other:
                        _zero_row(b, dst, geo.C)


def _window_of(b, i, p, k, s, n_out):
    """(ok, o): input index i is tap k of output o = (i + p - k) / s (exact, in range)."""
    t = b.sub(b.add(i, p), k)
    ok = b.and_(b.icmp_signed(">=", t, u.i64(0)), b.icmp_signed("==", b.srem(t, s), u.i64(0)))
    o = b.sdiv(t, s)
    return b.and_(ok, b.icmp_signed("<", o, n_out)), o


def _fold(b, args, c0, c1):
    W = lanes()
    col, out, bias = _ptrs(b, args, 3)
    geo = _Geo(b, args, 3)
    per, Wv = _args(b, args, 16, 2)
    taps = b.mul(geo.kh, geo.kw)
    accs = _accs(b, DW_VECS)
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bias, u.I64), u.i64(0))
    q0, q1 = _items(b, c0, c1, per, b.mul(geo.H, geo.W))
    with u.Loop(b, q0, q1, 1, "q") as q:
        ix, iy = _split(b, q, geo.W)
        live = b.icmp_signed("<", ix, Wv)
        obase = b.mul(q, geo.C)

        def block(c, nv, masks):
            for v in range(nv):
                b.store(u.const(_vt(), 0.0), accs[v])
                with b.if_then(has_bias):
                    b.store(u.load(b, bias, b.add(c, u.i64(v * W)), "f32", W, _mask(masks, v)), accs[v])
            with u.Loop(b, u.i64(0), geo.kh, 1, "ky") as ky:
                yok, oy = _window_of(b, iy, geo.ph, ky, geo.sh, geo.OH)
                with u.Loop(b, u.i64(0), geo.kw, 1, "kx") as kx:
                    xok, ox = _window_of(b, ix, geo.pw, kx, geo.sw, geo.OW)
                    with b.if_then(b.and_(live, b.and_(yok, xok))):
                        row = b.add(b.mul(oy, geo.OW), ox)
                        cb = b.add(b.mul(b.add(b.mul(row, taps), b.add(b.mul(ky, geo.kw), kx)), geo.C), c)
                        for v in range(nv):
                            xv = u.load(b, col, b.add(cb, u.i64(v * W)), "f32", W, _mask(masks, v))
                            b.store(b.fadd(b.load(accs[v]), xv), accs[v])
            for v in range(nv):
                u.store(b, b.load(accs[v]), out, b.add(obase, b.add(c, u.i64(v * W))), "f32",
                        _mask(masks, v))

        _channels(b, geo.C, block)


def _spread(b, args, c0, c1):
    src, dst = _ptrs(b, args, 2)
    Hs, Ws, C, Hd, Wd, oy0, ox0, sy, sx, per = _args(b, args, 2, 10)
    q0, q1 = _items(b, c0, c1, per, b.mul(Hd, Wd))
    with u.Loop(b, q0, q1, 1, "q") as q:
        x, y = _split(b, q, Wd)
        yok, ys = _window_of(b, y, u.i64(0), oy0, sy, Hs)
        xok, xs = _window_of(b, x, u.i64(0), ox0, sx, Ws)
        dp = b.gep(dst, [b.mul(q, C)], source_etype=u.F32)
        with b.if_else(b.and_(yok, xok)) as (then, other):
            with then:
                _copy_row(b, dp, b.gep(src, [b.mul(b.add(b.mul(ys, Ws), xs), C)], source_etype=u.F32), C)
            with other:
                _zero_row(b, dp, C)


# ---------------------------------------------------------------------------------------------
# per-channel prelu / affine

CHAN_OPS = ("prelu", "affine")


@register
@dataclass(frozen=True)
class ChanKey(KernelKey):
    """op in CHAN_OPS over rows [R, C] (C contiguous), parameters [C].
    fwd: 0 x, 1 out, 2 p (alpha | scale), 3 shift, 4 R, 5 C, 6 rows per chunk.
    bwd: 0 x, 1 g, 2 p, 3 dx, 4 partials [chunks][nparts * C] (prelu: d alpha; affine: d scale,
         d shift), 5 R, 6 C, 7 rows per chunk."""

    family = "conv_chan"
    op: str
    bwd: bool = False

    def ir(self, symbol: str) -> str:
        if self.op not in CHAN_OPS:
            raise ValueError(f"channel kernel: unknown op {self.op!r}")
        return u.module(symbol, _chan_bwd if self.bwd else _chan_fwd, self.op)


def _chan_fwd(op, b, args, c0, c1):
    W = lanes()
    x, out, p, sh = _ptrs(b, args, 4)
    R, C, per = _args(b, args, 4, 3)
    r0, r1 = _items(b, c0, c1, per, R)
    with u.Loop(b, r0, r1, 1, "r") as r:
        row = b.mul(r, C)
        xb, ob = (b.gep(t, [row], source_etype=u.F32) for t in (x, out))

        def body(c, m):
            xv = u.load(b, xb, c, "f32", W, m)
            pv = u.load(b, p, c, "f32", W, m)
            if op == "prelu":
                y = b.select(b.fcmp_ordered(">", xv, u.const(_vt(), 0.0)), xv, b.fmul(pv, xv))
            else:
                y = b.fadd(b.fmul(xv, pv), u.load(b, sh, c, "f32", W, m))
            u.store(b, y, ob, c, "f32", m)
        map_pass(b, u.i64(0), C, W, body)


def _chan_bwd(op, b, args, c0, c1):
    W = lanes()
    vt = _vt()
    x, g, p, dx, part = _ptrs(b, args, 5)
    R, C, per = _args(b, args, 5, 3)
    nparts = 1 if op == "prelu" else 2
    with u.Loop(b, c0, c1, 1, "q") as q:
        pa = b.gep(part, [b.mul(q, b.mul(C, u.i64(nparts)))], source_etype=u.F32)
        pb = b.gep(pa, [C], source_etype=u.F32)
        map_pass(b, u.i64(0), b.mul(C, u.i64(nparts)), W,
                 lambda c, m: u.store(b, u.const(vt, 0.0), pa, c, "f32", m))
        r0 = b.mul(q, per)
        with u.Loop(b, r0, u.smin(b, b.add(r0, per), R), 1, "r") as r:
            row = b.mul(r, C)
            xb, gb, db = (b.gep(t, [row], source_etype=u.F32) for t in (x, g, dx))

            def body(c, m):
                xv = u.load(b, xb, c, "f32", W, m)
                gv = u.load(b, gb, c, "f32", W, m)
                pv = u.load(b, p, c, "f32", W, m)
                if op == "prelu":
                    pos = b.fcmp_ordered(">", xv, u.const(vt, 0.0))
                    u.store(b, b.select(pos, gv, b.fmul(pv, gv)), db, c, "f32", m)
                    da = b.select(pos, u.const(vt, 0.0), b.fmul(xv, gv))
                    u.store(b, b.fadd(u.load(b, pa, c, "f32", W, m), da), pa, c, "f32", m)
                else:
                    u.store(b, b.fmul(gv, pv), db, c, "f32", m)
                    u.store(b, b.fadd(u.load(b, pa, c, "f32", W, m), b.fmul(gv, xv)), pa, c, "f32", m)
                    u.store(b, b.fadd(u.load(b, pb, c, "f32", W, m), gv), pb, c, "f32", m)
            map_pass(b, u.i64(0), C, W, body)


# ---------------------------------------------------------------------------------------------
# Winograd F(m x m, 3 x 3)

def _wino_matrices(m: int):
    """(Bt, G, At) of F(m, 3), exact fractions (the interpolation points 0, +-1, +-2, +-1/2)."""
    if m == 2:
        Bt = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
        G = [[1, 0, 0], [Fr(1, 2), Fr(1, 2), Fr(1, 2)], [Fr(1, 2), Fr(-1, 2), Fr(1, 2)], [0, 0, 1]]
        At = [[1, 1, 1, 0], [0, 1, -1, -1]]
    elif m == 4:
        Bt = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
              [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]
        G = [[Fr(1, 4), 0, 0], [Fr(-1, 6), Fr(-1, 6), Fr(-1, 6)], [Fr(-1, 6), Fr(1, 6), Fr(-1, 6)],
             [Fr(1, 24), Fr(1, 12), Fr(1, 6)], [Fr(1, 24), Fr(-1, 12), Fr(1, 6)], [0, 0, 1]]
        At = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]
    else:
        raise ValueError(f"winograd: expected m in (2, 4), got {m}")
    return Bt, G, At


WINO_OPS = ("weight", "input", "output")


def _lincomb(b, coefs, vals):
    """sum coef * val with constant coefficients: zeros skipped, +-1 as an add or a subtract."""
    acc = None
    for c, v in zip(coefs, vals):
        if c == 0:
            continue
        if abs(c) == 1:
            if acc is None:
                acc = v if c > 0 else b.fneg(v)
            else:
                acc = b.fadd(acc, v) if c > 0 else b.fsub(acc, v)
            continue
        t = b.fmul(v, u.const(v.type, float(c)))
        acc = t if acc is None else b.fadd(acc, t)
    return acc if acc is not None else u.const(vals[0].type, 0.0)


def _sandwich(b, L, X, R):
    """L X Rt for a grid X of vectors: rows of L, then rows of R."""
    rows = [[_lincomb(b, Li, [X[i][j] for i in range(len(X))]) for j in range(len(X[0]))] for Li in L]
    return [[_lincomb(b, Rj, row) for Rj in R] for row in rows]


@register
@dataclass(frozen=True)
class WinogradKey(KernelKey):
    """op in WINO_OPS, m in (2, 4); t = m + 2 and planes = t * t.
    weight: 0 w [Cout, 3, 3, Cin], 1 U [planes][Cout][Cin], 2 Cout, 3 Cin. Items: output channels.
            flip: the kernel is read rotated by 180 degrees (g[i][j] = w[co, 2-i, 2-j, ci]): the
            planes of the input gradient's conv, whose input channels are w's outputs.
    input:  0 x [H, W, C], 1 V [planes][tiles][C], 2 H, 3 W, 4 C, 5 tiles_y, 6 tiles_x, 7 pad
            top, 8 pad left, 9 tiles per chunk. Tile (ty, tx) reads rows ty*m - pt .. + t - 1.
    output: 0 M [planes][tiles][Cout], 1 out [OH, OW, Cout], 2 bias (0: none), 3 OH, 4 OW,
            5 Cout, 6 tiles_y, 7 tiles_x, 8 relu, 9 tiles per chunk."""

    family = "conv_wino"
    op: str
    m: int
    flip: bool = False

    def ir(self, symbol: str) -> str:
        if self.op not in WINO_OPS:
            raise ValueError(f"winograd kernel: unknown op {self.op!r}")
        mod, b, args, c0, c1 = u.kernel(symbol)
        if self.op == "weight":
            _wino_weight(self.m, self.flip, b, args, c0, c1)
        else:
            (_wino_input if self.op == "input" else _wino_output)(self.m, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _wino_weight(m, flip, b, args, c0, c1):
    W = lanes()
    _, G, _ = _wino_matrices(m)
    t = m + 2
    w, U = _ptrs(b, args, 2)
    Cout, Cin = _args(b, args, 2, 2)
    with u.Loop(b, c0, c1, 1, "co") as co:
        def body(c, msk):
            tap = (lambda i, j: 8 - 3 * i - j) if flip else (lambda i, j: 3 * i + j)
            gv = [[u.load(b, w, b.add(b.mul(b.add(b.mul(co, u.i64(9)), u.i64(tap(i, j))), Cin), c),
                          "f32", W, msk) for j in range(3)] for i in range(3)]
            Uv = _sandwich(b, G, gv, G)
            for a in range(t):
                for e in range(t):
                    plane = u.i64(a * t + e)
                    u.store(b, Uv[a][e], U, b.add(b.mul(b.add(b.mul(plane, Cout), co), Cin), c),
                            "f32", msk)
        map_pass(b, u.i64(0), Cin, W, body)


def _clamp(b, v, n):
    """v clamped to [0, n - 1]."""
    return u.smin(b, b.select(b.icmp_signed("<", v, u.i64(0)), u.i64(0), v), b.sub(n, u.i64(1)))


def _wino_input(m, b, args, c0, c1):
    W = lanes()
    Bt, _, _ = _wino_matrices(m)
    t = m + 2
    x, V = _ptrs(b, args, 2)
    H, Wd, C, tiles_y, tiles_x, pt, pl, per = _args(b, args, 2, 8)
    ntiles = b.mul(tiles_y, tiles_x)
    q0, q1 = _items(b, c0, c1, per, ntiles)
    with u.Loop(b, q0, q1, 1, "q") as q:
        tx, ty = _split(b, q, tiles_x)
        ys = [b.sub(b.add(b.mul(ty, u.i64(m)), u.i64(i)), pt) for i in range(t)]
        xs = [b.sub(b.add(b.mul(tx, u.i64(m)), u.i64(j)), pl) for j in range(t)]
        yok = [_in(b, y, u.i64(0), H) for y in ys]
        xok = [_in(b, xx, u.i64(0), Wd) for xx in xs]
        # rows/columns outside the map read a clamped (valid) pixel and are masked to zero
        yc = [_clamp(b, y, H) for y in ys]
        xc = [_clamp(b, xx, Wd) for xx in xs]

        def body(c, msk):
            full = msk if msk is not None else ir.Constant(ir.VectorType(u.I1, W), [ir.Constant(u.I1, 1)] * W)
            d = []
            for i in range(t):
                row = []
                for j in range(t):
                    mk = b.select(b.and_(yok[i], xok[j]), full, _no_lanes(W))
                    row.append(u.load(b, x, b.add(b.mul(b.add(b.mul(yc[i], Wd), xc[j]), C), c), "f32", W, mk))
                d.append(row)
            Vv = _sandwich(b, Bt, d, Bt)
            for a in range(t):
                for e in range(t):
                    plane = u.i64(a * t + e)
                    u.store(b, Vv[a][e], V, b.add(b.mul(b.add(b.mul(plane, ntiles), q), C), c), "f32", msk)
        map_pass(b, u.i64(0), C, W, body)


def _wino_output(m, b, args, c0, c1):
    W = lanes()
    _, _, At = _wino_matrices(m)
    t = m + 2
    M, out, bias = _ptrs(b, args, 3)
    OH, OW, Cout, tiles_y, tiles_x, relu_on, per = _args(b, args, 3, 7)
    ntiles = b.mul(tiles_y, tiles_x)
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bias, u.I64), u.i64(0))
    do_relu = b.icmp_signed("!=", relu_on, u.i64(0))
    q0, q1 = _items(b, c0, c1, per, ntiles)
    with u.Loop(b, q0, q1, 1, "q") as q:
        tx, ty = _split(b, q, tiles_x)

        def body(c, msk):
            Mv = [[u.load(b, M, b.add(b.mul(b.add(b.mul(u.i64(a * t + e), ntiles), q), Cout), c),
                          "f32", W, msk) for e in range(t)] for a in range(t)]
            Y = _sandwich(b, At, Mv, At)
            bv = u.load(b, b.select(has_bias, bias, M), c, "f32", W, msk)   # (unused without bias)
            for i in range(m):
                oy = b.add(b.mul(ty, u.i64(m)), u.i64(i))
                for j in range(m):
                    ox = b.add(b.mul(tx, u.i64(m)), u.i64(j))
                    y = Y[i][j]
                    y = b.select(has_bias, b.fadd(y, bv), y)
                    y = b.select(do_relu, relu(b, y), y)
                    with b.if_then(b.and_(b.icmp_signed("<", oy, OH), b.icmp_signed("<", ox, OW))):
                        u.store(b, y, out, b.add(b.mul(b.add(b.mul(oy, OW), ox), Cout), c), "f32", msk)
        map_pass(b, u.i64(0), Cout, W, body)
