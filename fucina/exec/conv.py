"""Convolution, pooling and vision ops at the exec layer (SPEC §3.13): geometry checks, layouts,
and the launches of codegen/conv.py's kernels. Maps are channel-last [H, W, C]; a 1-D signal
[T, C] is the map [1, T, C] (time along W, where the kernels tile pixels).

Dense and grouped convolutions are one implicit-GEMM kernel that checks bounds per pixel and
tap (padding costs no copy). Its input gradient is the same kernel over the output gradient
(spread onto the input grid with stride - 1 zeros between rows and columns when the conv is
strided) with the weight read flipped and transposed; its weight gradient is a second kernel
reducing over output pixels of a zero-padded copy of the input. A 3x3, stride-1, one-group
conv2d with at least WINO_MIN_CHANNELS channels each side and WINO_MIN_PIXELS output pixels
computes its forward, and its input gradient (again such a conv), by Winograd F(2x2, 3x3):
2.25x fewer multiplies than any direct method (which, at this machine's FMA peak, can at best
tie PyTorch), with rounding errors of the same size as the direct chain's. conv2d_prepared
reuses the weight planes and takes F(4x4, 3x3) on larger maps. Depthwise convolutions (one
channel per group) check bounds per tap too, so a streaming 1-D chunk reads its `state` (the
rows before it) in place. conv_transpose1d is a GEMM then fold (col2im), as in ggml.

Every reduction has an order fixed by the shapes (pixel blocks of a fixed size, folded in
order), so every result is bitwise identical for any thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen import conv as cg
from ..codegen import kernels
from ..errors import InvalidShape, ShapeMismatch
from . import elementwise as ew
from . import matmul as mm
from . import reduce as red
from .raw import RawTensor

WORK_PER_CHUNK = 1 << 20   # multiply-adds per chunk of the conv kernels
PIX_PER_CHUNK = 1 << 16    # channel values per chunk of the per-pixel kernels
PIX_BLOCK = 8192           # output pixels per partial sum of a weight gradient


# ---------------------------------------------------------------------------------------------
# geometry

@dataclass(frozen=True)
class Geo:
    """One convolution (or pool) over a map [H, W, Cin] with a kh x kw window: strides,
    dilations, padding top/bottom/left/right, groups. OH, OW as torch computes them."""

    H: int
    W: int
    Cin: int
    Cout: int
    kh: int
    kw: int
    sh: int = 1
    sw: int = 1
    dh: int = 1
    dw: int = 1
    pt: int = 0
    pb: int = 0
    pl: int = 0
    pr: int = 0
    groups: int = 1

    @property
    def OH(self) -> int:
        return (self.H + self.pt + self.pb - self.dh * (self.kh - 1) - 1) // self.sh + 1

    @property
    def OW(self) -> int:
        return (self.W + self.pl + self.pr - self.dw * (self.kw - 1) - 1) // self.sw + 1

    @property
    def cinpg(self) -> int:
        return self.Cin // self.groups

    @property
    def coutpg(self) -> int:
        return self.Cout // self.groups

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def depthwise(self) -> bool:
        return self.cinpg == 1 and self.coutpg == 1

    def args(self) -> tuple:
        """The bounds-checked kernels' geometry block (top and left padding)."""
        return (self.H, self.W, self.Cin, self.OH, self.OW, self.kh, self.kw, self.sh, self.sw,
                self.dh, self.dw, self.pt, self.pl)


def check_geometry(op: str, g: Geo) -> Geo:
    """Positive sizes, strides and dilations, non-negative padding, groups dividing both channel
    counts, and a window that fits the padded input (ShapeMismatch / InvalidShape otherwise)."""
    for name, v in (("stride", (g.sh, g.sw)), ("dilation", (g.dh, g.dw)), ("kernel", (g.kh, g.kw))):
        if min(v) < 1:
            raise InvalidShape(f"{op}: expected {name} >= 1 along (h, w), got {v}")
    if min(g.pt, g.pb, g.pl, g.pr) < 0:
        raise InvalidShape(f"{op}: expected padding >= 0, got {(g.pt, g.pb, g.pl, g.pr)}")
    if g.groups < 1:
        raise ShapeMismatch(f"{op}: expected groups >= 1, got {g.groups}")
    if g.Cin % g.groups or g.Cout % g.groups:
        raise ShapeMismatch(f"{op}: expected groups to divide the input channels ({g.Cin}) and the "
                            f"output channels ({g.Cout}), got groups={g.groups}")
    extent = (g.dh * (g.kh - 1) + 1, g.dw * (g.kw - 1) + 1)
    padded = (g.H + g.pt + g.pb, g.W + g.pl + g.pr)
    if extent[0] > padded[0] or extent[1] > padded[1]:
        raise ShapeMismatch(f"{op}: kernel extent (h, w) {extent} is larger than the padded input "
                            f"{padded}")
    return g


def _chunks(items: int, work: int) -> tuple[int, int]:
    """(items per chunk, chunks) for `items` work items of `work` multiply-adds each."""
    per = max(1, WORK_PER_CHUNK // max(work, 1))
    return per, -(-items // per)


def _per_pixel(C: int) -> int:
    return max(1, PIX_PER_CHUNK // max(C, 1))


def _tile(cols: int) -> tuple[int, int]:
    """(rm pixels or channels, rn vectors) of an implicit-GEMM tile for `cols` output columns:
    rm * rn accumulators + rn weight vectors + a broadcast fill the vector registers."""
    W = cg.lanes()
    regs = 32 if W >= 16 else 16
    rn = min(4, -(-cols // W))
    return max(1, min(14, (regs - rn - 2) // rn)), rn


def _a(t) -> int:
    return 0 if t is None else t.addr


def _map3(x: RawTensor) -> RawTensor:
    """A 2-D [T, C] signal as the map [1, T, C]; a 3-D map as it is (contiguous)."""
    x = ew.materialize(x.ctx, x)
    return x.view((1,) + x.shape, (0,) + x.strides) if x.rank == 2 else x


# ---------------------------------------------------------------------------------------------
# layout helpers

def spread(ctx, src: RawTensor, Hd: int, Wd: int, oy0: int, ox0: int, sy: int = 1, sx: int = 1):
    """A zero map [Hd, Wd, C] holding src[i, j] at (oy0 + i*sy, ox0 + j*sx) (parts that fall
    outside are dropped): zero padding, and the zero-dilated gradient of a strided conv."""
    Hs, Ws, C = src.shape
    if (Hd, Wd, oy0, ox0, sy, sx) == (Hs, Ws, 0, 0, 1, 1):
        return src
    dst = ctx.empty((Hd, Wd, C))
    per = _per_pixel(C)
    ctx.launch(kernels.get(cg.FoldKey("spread")), -(-(Hd * Wd) // per), Hd * Wd * C * 8,
               src.addr, dst.addr, Hs, Ws, C, Hd, Wd, oy0, ox0, sy, sx, per)
    return dst


def padded_source(ctx, x: RawTensor, g: Geo, state: RawTensor | None = None) -> RawTensor:
    """The conv input [H + pt + pb, W + pl + pr, Cin] with zeros around it; with a 1-D
    `state` [pl, Cin], its rows fill the left padding instead (oldest first)."""
    x = _map3(x)
    src = spread(ctx, x, g.H + g.pt + g.pb, g.W + g.pl + g.pr, g.pt, g.pl)
    if state is not None:
        if src is x:
            raise AssertionError("padded_source: a state needs left padding to land in")
        rows = state.shape[0]
        ew.run(ctx, "copy", "f32", (rows, g.Cin), [state],
               out=src.view((rows, g.Cin), (g.Cin, 1), src.offset))
    return src


# ---------------------------------------------------------------------------------------------
# the implicit GEMM

def _gemm_conv(ctx, src: RawTensor, g: Geo, w_addr: int, bstr: tuple, bias=None, relu=False,
               state=None) -> RawTensor:
    """out[OH, OW, Cout] of the conv `g` over the map src [H, W, Cin] (bounds checked in the
    kernel: padding may be negative, a crop); bstr = (b_g, b_ky, b_kx, b_c) weight strides
    (unit along output channels); state: 1-D rows left of column 0, or None."""
    cinpg, coutpg = g.cinpg, g.coutpg
    rm, rn = _tile(coutpg)
    OH, OW = g.OH, g.OW
    nxg = -(-(OH * OW) // rm)
    ncb = -(-coutpg // (rn * cg.lanes()))
    per, chunks = _chunks(nxg * ncb * g.groups, rm * rn * cg.lanes() * g.taps * cinpg)
    out = ctx.empty((OH, OW, g.Cout))
    zeros = ctx.full_raw((cinpg,), 0.0)
    ctx.launch(kernels.get(cg.ConvKey(rm, rn)), chunks, 2 * OH * OW * g.Cout * g.taps * cinpg,
               src.addr, w_addr, out.addr, _a(bias), zeros.addr, _a(state),
               0 if state is None else state.shape[0], g.H, g.W, OH, OW, g.groups, cinpg, coutpg,
               g.sh, g.sw, g.dh, g.dw, g.pt, g.pl, *bstr, g.kh, g.kw, int(relu), per, nxg, ncb)
    return out


def wgrad_partials(ctx, src: RawTensor, g: RawTensor, geo: Geo) -> RawTensor:
    """Per-block weight gradients [blocks, kh*kw, cinpg, Cout]: block b sums output pixels
    [b*ppb, (b+1)*ppb) (row-major; ppb fixed by the pixel count) of src[pixel + tap] x g[pixel],
    src being the zero-padded input map."""
    _, Ws, Cs = src.shape
    OH, OW = g.shape[0], g.shape[1]
    cinpg, coutpg = geo.cinpg, geo.coutpg
    rm, rn = _tile(coutpg)
    ncg = -(-cinpg // rm)
    ncb = -(-coutpg // (rn * cg.lanes()))
    npix = OH * OW
    nblk = -(-npix // PIX_BLOCK)
    ppb = -(-npix // nblk)
    items = ncg * geo.taps * ncb * geo.groups * nblk
    per, chunks = _chunks(items, rm * rn * cg.lanes() * ppb)
    part = ctx.empty((nblk, geo.taps, cinpg, geo.Cout))
    ctx.launch(kernels.get(cg.ConvWgradKey(rm, rn)), chunks,
               2 * npix * geo.Cout * geo.taps * cinpg,
               src.addr, g.addr, part.addr, OH, OW, geo.groups, cinpg, coutpg, geo.Cout,
               geo.sh * Ws * Cs, geo.sw * Cs, geo.dh * Ws * Cs, geo.dw * Cs, geo.kh, geo.kw,
               ppb, nblk, per, ncg, ncb)
    return part


def _gemm_wgrad(ctx, src: RawTensor, g: RawTensor, geo: Geo) -> RawTensor:
    """dW[kh*kw, cinpg, Cout]: the blocks' partial sums folded in block order."""
    part = wgrad_partials(ctx, src, g, geo)
    if part.shape[0] == 1:
        return part.view(part.shape[1:], part.strides[1:], 0)
    return red.reduce_axis(ctx, "sum", part, 0)


# ---------------------------------------------------------------------------------------------
# dense / grouped convolution: forward and gradients
#
# Two weight layouts: "oc" = [Cout, kh, kw, cinpg] (conv2d) and "tio" = [taps, cinpg, Cout]
# (the 1-D family, whose layout the kernel reads as it is).

def _weight_for_forward(ctx, w: RawTensor, g: Geo, layout: str):
    """(address, (b_g, b_ky, b_kx, b_c), keep-alive) of the weight as the kernel reads it."""
    if layout == "oc":
        wt = ew.materialize(ctx, w.permute((1, 2, 3, 0)))   # [kh, kw, cinpg, Cout]
    else:
        wt = ew.materialize(ctx, w)
    return wt.addr, (g.coutpg, g.kw * g.cinpg * g.Cout, g.cinpg * g.Cout, g.Cout), wt


def conv_forward(ctx, x: RawTensor, w: RawTensor, g: Geo, layout: str, bias=None, relu=False,
                 state=None):
    """(out [OH, OW, Cout], the input as a map, saved for the weight gradient); x is [H, W, Cin]
    or [T, Cin]; bias None or [Cout]; state (1-D) None or [pl, Cin]."""
    xs = _map3(x)
    if g.depthwise:
        return _dw_run(ctx, xs, _dw_weight(ctx, w, g, layout), g, bias=bias, relu=relu, state=state), xs
    if layout == "oc" and wino_pays(g):
        return wino_conv(ctx, xs, wino_weights(ctx, w, 2), 2, g, bias, relu), xs
    addr, bstr, keep = _weight_for_forward(ctx, w, g, layout)
    out = _gemm_conv(ctx, xs, g, addr, bstr, bias, relu, state)
    del keep
    return out, xs


def _grad_geo(g: Geo, src_shape) -> Geo:
    """The input gradient as a stride-1 conv (flipped kernel, channels swapped) over src: the
    output gradient itself with padding (k-1)d - p (stride 1), or spread (strided convs)."""
    eh, ew_ = (g.kh - 1) * g.dh, (g.kw - 1) * g.dw
    pads = (eh - g.pt, eh - g.pb, ew_ - g.pl, ew_ - g.pr) if g.sh == g.sw == 1 else (0, 0, 0, 0)
    return Geo(src_shape[0], src_shape[1], g.Cout, g.Cin, g.kh, g.kw, 1, 1, g.dh, g.dw, *pads,
               g.groups)


def _grad_source(ctx, gy: RawTensor, g: Geo) -> RawTensor:
    """The output gradient on the input grid of a strided conv: B[t] = gy[o] at
    t = o*s + (k-1)*d - p_lo, zeros between (a map [H + (kh-1)dh, W + (kw-1)dw])."""
    if g.sh == g.sw == 1:
        return gy
    return spread(ctx, gy, g.H + (g.kh - 1) * g.dh, g.W + (g.kw - 1) * g.dw,
                  (g.kh - 1) * g.dh - g.pt, (g.kw - 1) * g.dw - g.pl, g.sh, g.sw)


def conv_grad_input(ctx, gy: RawTensor, w: RawTensor, g: Geo, layout: str) -> RawTensor:
    """dx [H, W, Cin] for the output gradient gy [OH, OW, Cout]."""
    if g.depthwise:
        return _dw_grad_input(ctx, gy, _dw_weight(ctx, w, g, layout), g)
    if layout == "oc" and wino_pays(g):
        return wino_conv(ctx, gy, wino_weights(ctx, w, 2, flip=True), 2, _grad_geo(g, gy.shape))
    src = _grad_source(ctx, gy, g)
    T, ci, co = g.taps, g.cinpg, g.coutpg
    if layout == "oc":    # w[co, ky, kx, ci] read at the flipped tap
        wt = w
        base = (T - 1) * ci
        bstr = (co * T * ci, -g.kw * ci, -ci, T * ci)
    else:                 # [taps, cinpg, Cout] -> [taps, Cout, cinpg], read flipped
        wt = ew.materialize(ctx, w.permute((0, 2, 1)))
        base = (T - 1) * g.Cout * ci
        bstr = (co * ci, -g.kw * g.Cout * ci, -g.Cout * ci, ci)
    return _gemm_conv(ctx, src, _grad_geo(g, src.shape), wt.addr + 4 * base, bstr)


def conv_grad_weight(ctx, x: RawTensor, gy: RawTensor, g: Geo, layout: str,
                     state=None) -> RawTensor:
    """dW in `layout` from the input map x (and 1-D state) and the output gradient gy."""
    if g.depthwise:
        return _dw_grad_weight(ctx, x, gy, g, layout, state)
    d = _gemm_wgrad(ctx, padded_source(ctx, x, g, state), gy, g)       # [taps, cinpg, Cout]
    if layout == "oc":
        d4 = d.view((g.kh, g.kw, g.cinpg, g.Cout), (g.kw * g.cinpg * g.Cout, g.cinpg * g.Cout, g.Cout, 1))
        return ew.materialize(ctx, d4.permute((3, 0, 1, 2)))
    return d


# ---------------------------------------------------------------------------------------------
# depthwise (groups == channels, one output per input channel)
#
# Weight layouts: "oc" [C, kh, kw, 1], "tio" [taps, 1, C], "ct" [C, taps] (causal depthwise).

def _dw_weight(ctx, w: RawTensor, g: Geo, layout: str) -> RawTensor:
    """The depthwise weight as [taps, C] (contiguous)."""
    C, T = g.Cout, g.taps
    w = ew.materialize(ctx, w)     # may be w itself: keep its offset
    if layout == "tio":
        return w.view((T, C), (C, 1), w.offset)
    return ew.materialize(ctx, w.view((C, T), (T, 1), w.offset).permute((1, 0)))


def _dw_launch(ctx, x, w_addr, wstr, out_shape, g: Geo, bias=None, relu=False, state=None):
    OH, OW, C = out_shape
    out = ctx.empty(out_shape)
    per = _per_pixel(C * g.taps)
    hist = 0 if state is None else state.shape[0]
    ctx.launch(kernels.get(cg.DepthwiseKey()), -(-(OH * OW) // per), OH * OW * C * g.taps * 8,
               x.addr, w_addr, out.addr, _a(bias), _a(state), *g.args(), *wstr, hist, per, int(relu))
    return out


def _dw_run(ctx, x, wt, g: Geo, bias=None, relu=False, state=None):
    return _dw_launch(ctx, x, wt.addr, (g.kw * g.Cout, g.Cout), (g.OH, g.OW, g.Cout), g, bias,
                      relu, state)


def _dw_grad_input(ctx, gy, wt, g: Geo):
    """dx: the depthwise conv of the (spread, when strided) output gradient with the flipped
    kernel (see _grad_geo)."""
    src = _grad_source(ctx, gy, g)
    addr = wt.addr + 4 * (g.taps - 1) * g.Cout
    return _dw_launch(ctx, src, addr, (-g.kw * g.Cout, -g.Cout), (g.H, g.W, g.Cin),
                      _grad_geo(g, src.shape))


def dw_grad_weight_raw(ctx, x, gy, g: Geo, state=None) -> RawTensor:
    """dW [taps, C] of a depthwise conv (x the unpadded map, state as in the forward)."""
    C = g.Cout
    npix = g.OH * g.OW
    nblk = -(-npix // PIX_BLOCK)
    ppb = -(-npix // nblk)
    ncb = -(-C // (cg.DW_VECS * cg.lanes()))
    part = ctx.empty((nblk, g.taps, C))
    hist = 0 if state is None else state.shape[0]
    ctx.launch(kernels.get(cg.DepthwiseWgradKey()), nblk * ncb, npix * C * g.taps * 8,
               x.addr, gy.addr, part.addr, _a(state), *g.args(), hist, ppb, nblk, ncb)
    if nblk == 1:
        return part.view(part.shape[1:], part.strides[1:], 0)
    return red.reduce_axis(ctx, "sum", part, 0)


def _dw_grad_weight(ctx, x, gy, g: Geo, layout: str, state=None):
    d = dw_grad_weight_raw(ctx, x, gy, g, state)       # [taps, C]
    C, T = g.Cout, g.taps
    if layout == "tio":
        return d.view((T, 1, C), (C, C, 1), d.offset)
    t = ew.materialize(ctx, d.permute((1, 0)))          # [C, taps]
    if layout == "oc":
        return t.view((C, g.kh, g.kw, 1), (T, g.kw, 1, 1), t.offset)
    return t


def causal_depthwise(ctx, x, kernel_ct, g: Geo, state=None):
    """Causal depthwise conv1d forward: x [T, C], kernel [C, taps] (SPEC §3.13)."""
    wt = _dw_weight(ctx, kernel_ct, g, "ct")
    return _dw_run(ctx, _map3(x), wt, g, state=state)


def causal_depthwise_grads(ctx, x, gy, kernel_ct, g: Geo, state, need_x: bool, need_w: bool):
    gy3 = _map3(gy)
    dx = dk = None
    if need_x:
        dx = _dw_grad_input(ctx, gy3, _dw_weight(ctx, kernel_ct, g, "ct"), g)
    if need_w:
        dk = _dw_grad_weight(ctx, _map3(x), gy3, g, "ct", state)
    return dx, dk


# ---------------------------------------------------------------------------------------------
# conv_transpose1d (GEMM + col2im)

def conv_transpose1d(ctx, x: RawTensor, w2: RawTensor, bias, OC: int, K: int, stride: int,
                     pad: int, output_pad: int):
    """x [T, IC], w2 [K*OC, IC] (k fastest within each oc block) -> [Lc + output_pad, OC] with
    Lc = (T-1)*stride + K - 2*pad; the output_pad trailing rows are bias-only (ggml).
    Returns (out, w2 reordered [K, OC, IC] for the backward)."""
    T, IC = x.shape
    wr = ew.materialize(ctx, w2.view((OC, K, IC), (K * IC, IC, 1)).permute((1, 0, 2)))
    col = mm.gemm(ctx, ew.materialize(ctx, x), wr.view((IC, K * OC), (1, IC), wr.offset))  # [T, K*OC]
    Lc = (T - 1) * stride + K - 2 * pad
    L = Lc + output_pad
    out = ctx.empty((1, L, OC))
    per = _per_pixel(OC * K)
    ctx.launch(kernels.get(cg.FoldKey("fold")), -(-L // per), L * OC * K * 8,
               col.addr, out.addr, _a(bias), 1, L, OC, 1, T, 1, K, 1, stride, 1, 1, 0, pad, per, Lc)
    return out.view((L, OC), (OC, 1), 0), wr


def conv_transpose1d_grads(ctx, x, wr, gy, K: int, stride: int, pad: int, output_pad: int,
                           needs):
    """(dx [T, IC], dw2 [K*OC, IC], dbias [OC]) — each only when needed."""
    T, IC = x.shape
    L, OC = gy.shape
    Lc = L - output_pad
    g1 = gy.view((1, Lc, OC), (0, OC, 1), gy.offset)   # the output_pad rows take no taps
    g = Geo(1, Lc, OC, IC, 1, K, 1, stride, pl=pad, pr=pad)
    dx = dw = db = None
    if needs[0]:    # dx = the conv of gy (cropped, padded) with weight [K, OC, IC], stride s
        dx = _gemm_conv(ctx, g1, g, wr.addr, (0, 0, OC * IC, IC)).view((T, IC), (IC, 1), 0)
    if needs[1]:
        d = _gemm_wgrad(ctx, padded_source(ctx, g1, g), _map3(x), g)        # [K, OC, IC]
        dw = ew.materialize(ctx, d.view((K, OC, IC), (OC * IC, IC, 1)).permute((1, 0, 2)))
        dw = dw.view((OC * K, IC), (IC, 1), dw.offset)
    if needs[2]:
        db = red.reduce_axis(ctx, "sum", gy, 0)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# pools, upsampling, unfold / fold

def pool(ctx, op: str, x: RawTensor, g: Geo, save_argmax: bool = False):
    """(out [OH, OW, C], argmax f32 tap indices or None) of a max / avg / sum pool."""
    C = g.Cin
    out = ctx.empty((g.OH, g.OW, C))
    arg = ctx.empty((g.OH, g.OW, C)) if save_argmax else None
    per = _per_pixel(C * g.taps)
    ctx.launch(kernels.get(cg.PoolKey(op)), -(-(g.OH * g.OW) // per), g.OH * g.OW * C * g.taps * 4,
               x.addr, out.addr, _a(arg), *g.args(), per)
    return out, arg


def pool_grad(ctx, op: str, gy: RawTensor, arg, g: Geo) -> RawTensor:
    C = g.Cin
    dx = ctx.empty((g.H, g.W, C))
    per = _per_pixel(C * g.taps)
    ctx.launch(kernels.get(cg.PoolGradKey(op)), -(-(g.H * g.W) // per), g.H * g.W * C * g.taps * 8,
               gy.addr, _a(arg), dx.addr, *g.args(), per)
    return dx


def upsample2x(ctx, x: RawTensor) -> RawTensor:
    """[H, W, C] -> [2H, 2W, C]: the copy kernel over a view repeating each pixel 2 x 2."""
    H, W, C = x.shape
    src = x.view((H, 2, W, 2, C), (x.strides[0], 0, x.strides[1], 0, x.strides[2]))
    out = ew.run(ctx, "copy", "f32", (H, 2, W, 2, C), [src])
    return out.view((2 * H, 2 * W, C), (2 * W * C, C, 1), 0)


def unfold(ctx, x: RawTensor, g: Geo) -> RawTensor:
    """im2col [OH*OW, kh*kw*C]: row oy*OW + ox, elements (ky, kx, c), pad taps 0."""
    C = g.Cin
    col = ctx.empty((g.OH * g.OW, g.taps * C))
    per = _per_pixel(C * g.taps)
    ctx.launch(kernels.get(cg.FoldKey("unfold")), -(-(g.OH * g.OW) // per), g.OH * g.OW * g.taps * C * 8,
               x.addr, col.addr, *g.args(), per)
    return col


def fold(ctx, col: RawTensor, g: Geo) -> RawTensor:
    """col2im: [H, W, C] summing every patch element that lands on a pixel (the adjoint of
    unfold), taps in (ky, kx) order."""
    C = g.Cin
    out = ctx.empty((g.H, g.W, C))
    per = _per_pixel(C * g.taps)
    ctx.launch(kernels.get(cg.FoldKey("fold")), -(-(g.H * g.W) // per), g.H * g.W * g.taps * C * 8,
               col.addr, out.addr, 0, *g.args(), per, g.W)
    return out


# ---------------------------------------------------------------------------------------------
# per-channel prelu / affine over rows [R, C]

def chan_forward(ctx, op: str, x: RawTensor, p: RawTensor, shift: RawTensor | None = None):
    R, C = x.shape
    out = ctx.empty((R, C))
    per = _per_pixel(C)
    ctx.launch(kernels.get(cg.ChanKey(op)), -(-R // per), R * C * 8, x.addr, out.addr, p.addr,
               _a(shift), R, C, per)
    return out


def chan_backward(ctx, op: str, x: RawTensor, gy: RawTensor, p: RawTensor):
    """(dx [R, C], [d alpha] or [d scale, d shift]) — parameter sums folded over a fixed grid
    of row chunks in chunk order."""
    R, C = x.shape
    nparts = 1 if op == "prelu" else 2
    per = _per_pixel(C)
    chunks = -(-R // per)
    dx = ctx.empty((R, C))
    part = ctx.empty((chunks, nparts * C))
    ctx.launch(kernels.get(cg.ChanKey(op, True)), chunks, R * C * 12, x.addr, gy.addr, p.addr,
               dx.addr, part.addr, R, C, per)
    total = part if chunks == 1 else red.reduce_axis(ctx, "sum", part, 0)
    off = total.offset
    return dx, [total.view((C,), (1,), off + i * C) for i in range(nparts)]


# ---------------------------------------------------------------------------------------------
# Winograd (conv2d_prepared)

WINO_MIN_CHANNELS = 16   # conv2d's own Winograd route (measured crossovers, weight transform
WINO_MIN_PIXELS = 256    # included): fewer channels either side or output pixels: direct


def wino_eligible(g: Geo) -> bool:
    """A Winograd F(m, 3) shape: 3x3, stride 1, no dilation, one group (any padding: the input
    transform reads zeros off the map)."""
    return (g.groups == 1 and g.kh == 3 and g.kw == 3 and g.sh == 1 and g.sw == 1 and
            g.dh == 1 and g.dw == 1)


def wino_pays(g: Geo) -> bool:
    """conv2d's route: a Winograd shape with enough channels and pixels to beat the direct
    kernel, the per-call weight transform included."""
    return (wino_eligible(g) and min(g.Cin, g.Cout) >= WINO_MIN_CHANNELS
            and g.OH * g.OW >= WINO_MIN_PIXELS)


def wino_tile(g: Geo) -> int:
    """conv2d_prepared: F(4, 3) on maps big enough to fill its 4 x 4 tiles, else F(2, 3)."""
    return 4 if min(g.OH, g.OW) >= 8 else 2


def wino_weights(ctx, w: RawTensor, m: int, flip: bool = False) -> RawTensor:
    """The weight planes of w [Cout, 3, 3, Cin] as the GEMMs' right operand: [t*t, Cin, Cout];
    flip: the planes of the input gradient's conv (kernel rotated, channels swapped),
    [t*t, Cout, Cin]."""
    Cout, _, _, Cin = w.shape
    t = m + 2
    U = ctx.empty((t * t, Cout, Cin))
    ctx.launch(kernels.get(cg.WinogradKey("weight", m, flip)), Cout, Cout * Cin * t * t * 8,
               ew.materialize(ctx, w).addr, U.addr, Cout, Cin)
    return U if flip else ew.materialize(ctx, U.permute((0, 2, 1)))


def wino_conv(ctx, x: RawTensor, U: RawTensor, m: int, g: Geo, bias=None, relu=False) -> RawTensor:
    t = m + 2
    ty, tx = -(-g.OH // m), -(-g.OW // m)
    ntiles = ty * tx
    C, Cout = g.Cin, g.Cout
    V = ctx.empty((t * t, ntiles, C))
    per = max(1, PIX_PER_CHUNK // (C * t * t))
    ctx.launch(kernels.get(cg.WinogradKey("input", m)), -(-ntiles // per), ntiles * C * t * t * 8,
               x.addr, V.addr, g.H, g.W, C, ty, tx, g.pt, g.pl, per)
    M = mm.gemm(ctx, V, U)                                   # [t*t, tiles, Cout]
    out = ctx.empty((g.OH, g.OW, Cout))
    per = max(1, PIX_PER_CHUNK // (Cout * t * t))
    ctx.launch(kernels.get(cg.WinogradKey("output", m)), -(-ntiles // per), ntiles * Cout * t * t * 8,
               M.addr, out.addr, _a(bias), g.OH, g.OW, Cout, ty, tx, int(relu), per)
    return out
