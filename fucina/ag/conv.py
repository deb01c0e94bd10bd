"""Convolution, pooling and vision ops with their backward rules (SPEC §3.13).

The 1-D family takes [time, channel] inputs (tags in that storage order, TagError otherwise)
and [tap, in/groups, out] weights; the 2-D family is channel-last: [H, W, C] maps,
[Cout, kH, kW, Cin/groups] weights, results [oH, oW, Cout] as torch computes oH. Every
operand that SPEC lists is differentiable (input, weight, bias, alpha, scale, shift) except
the streaming `state` of the causal convs and the Winograd-prepared route, which is
inference-only (GradientPreparedConv2dUnsupported under gradients).

Tolerances (tests/test_conv.py pins them). Dense and grouped convs and conv_transpose1d sum
k = taps * in-channels products in one FMA chain per output, fixed (ky, kx, c) order, so they
match torch like a GEMM of length k: |d| <= 2e-6 * k + 1e-5 * |value| (SPEC §0.5 allows
1e-5 * k); weight gradients likewise with k = output pixels. The Winograd forward (3x3
stride-1 conv2d, and conv2d_prepared) reassociates each sum through its transforms: F(2, 3)
meets the same bound against torch; F(4, 3) (conv2d_prepared on maps of 8 x 8 outputs and
more) is within 2e-5 * k * max|x| * max|w| of conv2d. Depthwise convs, pools, unfold, fold, upsampling,
prelu and channel_affine compute the stated float32 formula in order and are bitwise equal to
a numpy float32 reference.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from ..errors import (ContextMismatch, DTypeError, GradientPreparedConv2dUnsupported,
                      InvalidArgumentType, InvalidDataLength, InvalidShape, ShapeMismatch, TagError)
from ..exec import conv as exc
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..exec.raw import contiguous_strides
from .. import axes
from .checks import same_ctx
from .engine import finish_op, needs_graph

__all__ = ["PreparedConv2dWeights"]


# ---------------------------------------------------------------------------------------------
# argument checks

def _f32(op, what, r):
    if r.dtype != "f32":
        raise DTypeError(f"{op}: expected an f32 {what}, got {r.dtype}")


def _int(op, name, v, lo=1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an integer {name}, got {v!r}")
    if v < lo:
        raise InvalidShape(f"{op}: expected {name} >= {lo}, got {v}")
    return int(v)


def _pair(op, name, v, lo=1) -> tuple[int, int]:
    """An int or an (h, w) pair of ints."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise InvalidArgumentType(f"{op}: expected {name} as an int or an (h, w) pair, got {v!r}")
        return _int(op, name, v[0], lo), _int(op, name, v[1], lo)
    v = _int(op, name, v, lo)
    return v, v


def _input(op, x, rank, what="input"):
    r = x._live(op)
    if r.rank != rank:
        raise TagError(f"{op}: expected a rank-{rank} {what}, got tags {x.tags}")
    _f32(op, what, r)
    return ew.materialize(r.ctx, r)


def _operand(op, x, t, what, rank):
    same_ctx(op, x, t)
    return _input(op, t, rank, what)


def _tags_1d(op, x, time_tag, in_tag):
    if x._live(op).rank != 2 or x.tags != (time_tag, in_tag):
        raise TagError(f"{op}: expected input tags ({time_tag!r}, {in_tag!r}) in this storage order "
                       f"[time, channel], got {x.tags}")


def _weight_tags(op, w, want, what="weight"):
    if w.tags != want:
        raise TagError(f"{op}: expected {what} tags {want}, got {w.tags}")


def _bias(op, x, bias, n, what="bias"):
    if bias is None:
        return None
    br = _operand(op, x, bias, what, 1)
    if br.shape[0] != n:
        raise ShapeMismatch(f"{op}: expected {what} of length {n} (output channels), got {br.shape[0]}")
    return br


def _state(op, x, state, rows, C):
    """The streaming state as an f32 raw [rows, C] (None when absent or rows == 0)."""
    if state is None:
        return None
    ctx = x._raw.ctx
    if isinstance(state, type(x)):
        same_ctx(op, x, state)
        r = state._live(op)
        _f32(op, "state", r)
        n = r.numel
    else:
        arr = np.asarray(state, np.float32)
        n, r = arr.size, None
    if n != rows * C:
        raise InvalidDataLength(f"{op}: expected a state of {rows} rows x {C} channels = {rows * C} "
                                f"values (dilation * (taps - 1) rows), got {n}")
    if rows == 0:
        return None
    if r is None:
        return ctx.from_numpy(arr.reshape(rows, C), (rows, C), "f32", op)
    return ew.materialize(ctx, r).view((rows, C), (C, 1), None)


def _out_tags(op, tags, n):
    return axes.check_tags(tags, n, op)


def _geo(op, **kw) -> exc.Geo:
    return exc.check_geometry(op, exc.Geo(**kw))


def _g(ctx, g, shape):
    """An upstream gradient (possibly a broadcast view) as a contiguous raw of `shape`."""
    r = ew.materialize(ctx, g)
    return r.view(shape, contiguous_strides(shape), r.offset)


# ---------------------------------------------------------------------------------------------
# the shared convolution body

def _convolve(op, x, w, bias, g: exc.Geo, layout, out_tags, relu=False, state=None):
    """Validate-free core: forward, then the record of the input / weight / bias gradients."""
    ctx = x._raw.ctx
    xr = ew.materialize(ctx, x._raw)
    wr = ew.materialize(ctx, w._raw)
    br = None if bias is None else ew.materialize(ctx, bias._raw)
    out, src = exc.conv_forward(ctx, xr, wr, g, layout, br, relu, state)
    one_d = xr.rank == 2
    oshape = (g.OW, g.Cout) if one_d else (g.OH, g.OW, g.Cout)
    out = out.view(oshape, contiguous_strides(oshape), 0)
    saved = (ctx, src, wr, g, layout, state, xr.shape, oshape)
    operands = (x, w) if bias is None else (x, w, bias)
    return finish_op(op, out, out_tags, operands,
                     None if relu else (lambda needs: functools.partial(_conv_grads, saved, needs)))


def _conv_grads(saved, needs, gy):
    ctx, src, wr, g, layout, state, xshape, oshape = saved
    g3 = _g(ctx, gy, (g.OH, g.OW, g.Cout))
    dx = dw = db = None
    if needs[0]:
        dx = exc.conv_grad_input(ctx, g3, wr, g, layout)
        dx = dx.view(xshape, contiguous_strides(xshape), dx.offset)
    if needs[1]:
        dw = exc.conv_grad_weight(ctx, src, g3, g, layout, state)
    if len(needs) > 2 and needs[2]:
        db = red.reduce_axis(ctx, "sum", g3.view((g.OH * g.OW, g.Cout), (g.Cout, 1), g3.offset), 0)
    return (dx, dw, db)[:len(needs)]


def _conv1d_common(op, x, time_tag, in_tag, tap_tag, w_in_tag, out_tag, weight, stride, pad_lo,
                   pad_hi, dilation, groups, state_value=None):
    _tags_1d(op, x, time_tag, in_tag)
    same_ctx(op, x, weight)
    _weight_tags(op, weight, (tap_tag, w_in_tag, out_tag))
    xr = _input(op, x, 2)
    wr = _input(op, weight, 3, "weight")
    T, Cin = xr.shape
    K, cinpg, Cout = wr.shape
    groups = _int(op, "groups", groups)
    if Cin % groups or Cout % groups:
        raise ShapeMismatch(f"{op}: expected groups to divide the input channels ({Cin}) and the "
                            f"output channels ({Cout}), got groups={groups}")
    if cinpg != Cin // groups:
        raise ShapeMismatch(f"{op}: expected weight axis {w_in_tag!r} of size {Cin // groups} "
                            f"(in channels / groups), got {cinpg}")
    g = _geo(op, H=1, W=T, Cin=Cin, Cout=Cout, kh=1, kw=K, sw=stride, dw=dilation, pl=pad_lo,
             pr=pad_hi, groups=groups)
    st = _state(op, x, state_value, pad_lo, Cin) if state_value is not None else None
    return _convolve(op, x, weight, None, g, "tio", (time_tag, out_tag), state=st)


# ---------------------------------------------------------------------------------------------
# conv2d (shared by the plain, relu and prepared entries)

def _conv2d_geo(op, x, weight, bias, stride, padding, groups):
    same_ctx(op, x, weight)
    xr = _input(op, x, 3)
    wr = _input(op, weight, 4, "weight")
    H, W, Cin = xr.shape
    Cout, kh, kw, cinpg = wr.shape
    groups = _int(op, "groups", groups)
    sh, sw = _pair(op, "stride", stride)
    ph, pw = _pair(op, "padding", padding, 0)
    if Cin % groups or Cout % groups:
        raise ShapeMismatch(f"{op}: expected groups to divide the input channels ({Cin}) and the "
                            f"output channels ({Cout}), got groups={groups}")
    if cinpg != Cin // groups:
        raise ShapeMismatch(f"{op}: expected weight [Cout, kH, kW, Cin/groups] with Cin/groups = "
                            f"{Cin // groups}, got {cinpg} (weight shape {wr.shape})")
    _bias(op, x, bias, Cout)
    return _geo(op, H=H, W=W, Cin=Cin, Cout=Cout, kh=kh, kw=kw, sh=sh, sw=sw, pt=ph, pb=ph, pl=pw,
                pr=pw, groups=groups)


def _conv2d(op, x, weight, bias, stride, padding, groups, out_tags, relu):
    g = _conv2d_geo(op, x, weight, bias, stride, padding, groups)
    tags = _out_tags(op, (x.tags[0], x.tags[1], weight.tags[0]) if out_tags is None else out_tags, 3)
    if relu and needs_graph(x, weight, bias):    # under gradients: the composition
        y = x._result(*_convolve(op, x, weight, bias, g, "oc", tags))
        return y.relu()
    return x._result(*_convolve(op, x, weight, bias, g, "oc", tags, relu=relu))


class PreparedConv2dWeights:
    """Winograd weight planes of one conv2d weight [Cout, 3, 3, Cin] (F(2, 3) and F(4, 3)),
    built once by `weight.prepare_conv2d_weights()` for `conv2d_prepared`. Empty (and inert:
    every call takes the direct route) for a weight that can never take the Winograd route."""

    __slots__ = ("ctx", "shape", "planes")

    def __init__(self, ctx, shape, planes):
        self.ctx, self.shape, self.planes = ctx, shape, planes

    @property
    def empty(self) -> bool:
        return not self.planes

    def __repr__(self):
        kinds = ", ".join(f"F({m}, 3)" for m in sorted(self.planes)) or "empty"
        return f"PreparedConv2dWeights(weight shape {self.shape}: {kinds})"


def _conv2d_prepared(op, x, weight, prepared, bias, stride, padding, groups, out_tags, relu):
    if needs_graph(x, weight, bias):
        raise GradientPreparedConv2dUnsupported(
            f"{op}: the Winograd-prepared route is inference-only; expected operands without "
            f"gradients (use conv2d, or fu.no_grad())")
    if not isinstance(prepared, PreparedConv2dWeights):
        raise InvalidArgumentType(f"{op}: expected prepared weights from weight.prepare_conv2d_weights(), "
                        f"got {type(prepared).__name__}")
    g = _conv2d_geo(op, x, weight, bias, stride, padding, groups)
    if prepared.ctx is not x._raw.ctx:
        raise ContextMismatch(f"{op}: the prepared weights belong to another ExecContext")
    if not prepared.empty and prepared.shape != weight.shape:
        raise ShapeMismatch(f"{op}: prepared weights are for a weight of shape {prepared.shape}, "
                            f"got a weight of shape {weight.shape}")
    tags = _out_tags(op, (x.tags[0], x.tags[1], weight.tags[0]) if out_tags is None else out_tags, 3)
    if prepared.empty or not exc.wino_eligible(g):
        return x._result(*_convolve(op, x, weight, bias, g, "oc", tags, relu=True) if relu else
                         _convolve(op, x, weight, bias, g, "oc", tags))
    ctx = x._raw.ctx
    m = exc.wino_tile(g)
    br = None if bias is None else ew.materialize(ctx, bias._raw)
    out = exc.wino_conv(ctx, ew.materialize(ctx, x._raw), prepared.planes[m], m, g, br, relu)
    return x._result(out, tags)


# ---------------------------------------------------------------------------------------------
# pools, unfold / fold

def _pool_geo(op, x, kernel, stride, padding):
    r = _input(op, x, 3)
    H, W, C = r.shape
    kh, kw = _pair(op, "kernel", kernel)
    sh, sw = _pair(op, "stride", (kh, kw) if stride is None else stride)
    ph, pw = _pair(op, "padding", padding, 0)
    if ph >= kh or pw >= kw:
        raise InvalidShape(f"{op}: expected padding < kernel on each axis, got padding {(ph, pw)} "
                           f"for kernel {(kh, kw)}")
    g = _geo(op, H=H, W=W, Cin=C, Cout=C, kh=kh, kw=kw, sh=sh, sw=sw, pt=ph, pb=ph, pl=pw, pr=pw)
    return r, g


def _pool(op, kind, x, kernel, stride, padding):
    r, g = _pool_geo(op, x, kernel, stride, padding)
    ctx = r.ctx
    save = kind == "max" and needs_graph(x)
    out, arg = exc.pool(ctx, kind, r, g, save)
    return x._result(*finish_op(op, out, x.tags, (x,),
                                lambda needs: functools.partial(_pool_grads, ctx, kind, arg, g)))


def _pool_grads(ctx, kind, arg, g, gy):
    return (exc.pool_grad(ctx, kind, _g(ctx, gy, (g.OH, g.OW, g.Cin)), arg, g),)


def _fold_geo(op, H, W, C, kernel, stride, padding):
    kh, kw = _pair(op, "kernel", kernel)
    sh, sw = _pair(op, "stride", stride)
    ph, pw = _pair(op, "padding", padding, 0)
    return _geo(op, H=H, W=W, Cin=C, Cout=C, kh=kh, kw=kw, sh=sh, sw=sw, pt=ph, pb=ph, pl=pw, pr=pw)


def _unfold_grads(ctx, g, gy):
    return (exc.fold(ctx, _g(ctx, gy, (g.OH * g.OW, g.taps * g.Cin)), g),)


def _fold_grads(ctx, g, gy):
    return (exc.unfold(ctx, _g(ctx, gy, (g.H, g.W, g.Cin)), g),)


# ---------------------------------------------------------------------------------------------
# per-channel ops

def _channel_param(op, x, p, what):
    same_ctx(op, x, p)
    want = (x.tags[-1],)
    if p.tags != want:
        raise TagError(f"{op}: expected {what} tagged {want} (the innermost, channel axis of the "
                       f"input), got {p.tags}")
    r = _input(op, p, 1, what)
    if r.shape[0] != x._raw.shape[-1]:
        raise ShapeMismatch(f"{op}: expected {what} of length {x._raw.shape[-1]} (channels), "
                            f"got {r.shape[0]}")
    return r


def _rows(op, x):
    r = x._live(op)
    if r.rank < 1:
        raise TagError(f"{op}: expected a tensor with a channel axis, got a scalar")
    _f32(op, "input", r)
    r = ew.materialize(r.ctx, r)
    C = r.shape[-1]
    return r, r.view((r.numel // C, C), (C, 1), None)


def _chan_grads(ctx, kind, rows, p, shape, needs, gy):
    R, C = rows.shape
    dx, parts = exc.chan_backward(ctx, kind, rows, _g(ctx, gy, (R, C)), p)
    out = [dx.view(shape, contiguous_strides(shape), 0) if needs[0] else None]
    out += [pp if n else None for pp, n in zip(parts, needs[1:])]
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# conv_transpose1d

def _convt_grads(ctx, xr, wr, K, stride, pad, output_pad, needs, gy):
    L, OC = gy.shape
    g2 = _g(ctx, gy, (L, OC))
    dx, dw, db = exc.conv_transpose1d_grads(ctx, xr, wr, g2, K, stride, pad, output_pad,
                                            needs + (False,) * (3 - len(needs)))
    return (dx, dw, db)[:len(needs)]


class ConvMethods:
    """Tensor methods of the convolution / pooling / vision family (SPEC §3.13)."""

    __slots__ = ()

    # ---- 1-D ----
    def conv1d(self, time_tag, in_tag, tap_tag, out_tag, weight, stride=1, padding=0, dilation=1,
               groups=1):
        """Cross-correlation over [time, in] with weight [tap, in/groups, out] (tags
        (tap, in, out)); result [t_out, out], t_out = (T + 2p - d(taps-1) - 1) // stride + 1."""
        op = "conv1d"
        stride, dilation = _int(op, "stride", stride), _int(op, "dilation", dilation)
        padding = _int(op, "padding", padding, 0)
        return self._result(*_conv1d_common(op, self, time_tag, in_tag, tap_tag, in_tag, out_tag,
                                            weight, stride, padding, padding, dilation, groups))

    def causal_conv1d(self, time_tag, in_tag, tap_tag, out_tag, weight, dilation=1, state=None):
        """y[t] = sum_k sum_c x[t - d(taps-1-k), c] w[k, c, :] (tap taps-1 is the newest sample);
        history before t = 0 is `state` (d(taps-1) rows [row, in], oldest first; no gradient
        flows into it) or zeros."""
        op = "causal_conv1d"
        dilation = _int(op, "dilation", dilation)
        K = _taps(op, self, weight)
        return self._result(*_conv1d_common(op, self, time_tag, in_tag, tap_tag, in_tag, out_tag,
                                            weight, 1, dilation * (K - 1), 0, dilation, 1, state))

    def grouped_causal_conv1d(self, time_tag, in_tag, tap_tag, in_per_group_tag, out_tag, weight,
                              dilation=1, groups=1, state=None):
        """causal_conv1d with groups: weight [tap, in/groups, out] tagged (tap, in_per_group,
        out); output channel o reads the input group o // (out / groups)."""
        op = "grouped_causal_conv1d"
        dilation = _int(op, "dilation", dilation)
        K = _taps(op, self, weight)
        return self._result(*_conv1d_common(op, self, time_tag, in_tag, tap_tag, in_per_group_tag,
                                            out_tag, weight, 1, dilation * (K - 1), 0, dilation,
                                            groups, state))

    def causal_depthwise_conv1d(self, time_tag, channel_tag, tap_tag, kernel, dilation=1, state=None):
        """y[t, c] = sum_k x[t - d(taps-1-k), c] w[c, k], kernel tagged (channel, tap); history
        from `state` (d(taps-1) rows, oldest first; no gradient) or zeros. Result: self's tags."""
        op = "causal_depthwise_conv1d"
        _tags_1d(op, self, time_tag, channel_tag)
        same_ctx(op, self, kernel)
        _weight_tags(op, kernel, (channel_tag, tap_tag), "kernel")
        dilation = _int(op, "dilation", dilation)
        xr = _input(op, self, 2)
        kr = _input(op, kernel, 2, "kernel")
        T, C = xr.shape
        if kr.shape[0] != C:
            raise ShapeMismatch(f"{op}: expected kernel axis {channel_tag!r} of size {C}, got {kr.shape[0]}")
        K = kr.shape[1]
        hist = dilation * (K - 1)
        g = _geo(op, H=1, W=T, Cin=C, Cout=C, kh=1, kw=K, dw=dilation, pl=hist, groups=C)
        st = _state(op, self, state, hist, C)
        ctx = xr.ctx
        out = exc.causal_depthwise(ctx, xr, kr, g, st)
        out = out.view((T, C), (C, 1), 0)

        def vjp(needs):
            def grads(gy):
                dx, dk = exc.causal_depthwise_grads(ctx, xr, _g(ctx, gy, (T, C)), kr, g, st,
                                                    needs[0], needs[1])
                return (None if dx is None else dx.view((T, C), (C, 1), 0), dk)
            return grads
        return self._result(*finish_op(op, out, self.tags, (self, kernel), vjp))

    def conv_transpose1d(self, time_tag, in_tag, kout_tag, out_tag, weight2, bias, out_channels,
                         taps, stride=1, padding=0, output_pad=0):
        """Transposed conv over [time, in] as GEMM + col2im: weight2 [taps*out, in] tagged
        (kout, in) with the tap fastest inside each output channel's block; bias None or
        [out]; result [(T-1)*stride + taps - 2*padding + output_pad, out] whose output_pad
        trailing rows are bias-only (the ggml convention; torch fills them when padding > 0)."""
        op = "conv_transpose1d"
        _tags_1d(op, self, time_tag, in_tag)
        same_ctx(op, self, weight2)
        _weight_tags(op, weight2, (kout_tag, in_tag), "weight2")
        OC, K = _int(op, "out_channels", out_channels), _int(op, "taps", taps)
        stride = _int(op, "stride", stride)
        padding = _int(op, "padding", padding, 0)
        output_pad = _int(op, "output_pad", output_pad, 0)
        xr = _input(op, self, 2)
        wr = _input(op, weight2, 2, "weight2")
        T, IC = xr.shape
        if wr.shape != (K * OC, IC):
            raise ShapeMismatch(f"{op}: expected weight2 of shape ({K * OC}, {IC}) = (taps * "
                                f"out_channels, in), got {wr.shape}")
        br = _bias(op, self, bias, OC)
        if bias is not None and bias.tags != (out_tag,):
            raise TagError(f"{op}: expected bias tagged ({out_tag!r},), got {bias.tags}")
        if (T - 1) * stride + K <= 2 * padding:
            raise InvalidShape(f"{op}: expected (T-1)*stride + taps > 2*padding, got "
                               f"{(T - 1) * stride + K} <= {2 * padding}")
        ctx = xr.ctx
        out, wre = exc.conv_transpose1d(ctx, xr, wr, br, OC, K, stride, padding, output_pad)
        operands = (self, weight2) if bias is None else (self, weight2, bias)
        return self._result(*finish_op(op, out, (time_tag, out_tag), operands,
                                       lambda needs: functools.partial(
                                           _convt_grads, ctx, xr, wre, K, stride, padding,
                                           output_pad, needs)))

    # ---- 2-D ----
    def conv2d(self, weight, bias=None, stride=1, padding=0, groups=1, out_tags=None):
        """Channel-last conv: self [H, W, Cin], weight [Cout, kH, kW, Cin/groups], bias None or
        [Cout]; stride / padding an int or an (h, w) pair; result [oH, oW, Cout] tagged
        out_tags (default: self's two spatial tags and weight's first tag)."""
        return _conv2d("conv2d", self, weight, bias, stride, padding, groups, out_tags, False)

    def conv2d_relu(self, weight, bias=None, stride=1, padding=0, groups=1, out_tags=None):
        """relu(conv2d(...)): fused into the conv's store without gradients, the composition
        conv2d then relu with them (same values either way)."""
        return _conv2d("conv2d_relu", self, weight, bias, stride, padding, groups, out_tags, True)

    def prepare_conv2d_weights(self) -> PreparedConv2dWeights:
        """Winograd planes of this conv2d weight [Cout, 3, 3, Cin] for conv2d_prepared (built
        once, no gradients); empty for any other kernel size."""
        op = "prepare_conv2d_weights"
        r = _input(op, self, 4, "weight")
        if needs_graph(self):
            raise GradientPreparedConv2dUnsupported(
                f"{op}: prepared weights live outside the gradient graph; expected a weight "
                f"without gradients (a constant, or call under fu.no_grad())")
        ctx = r.ctx
        if r.shape[1:3] != (3, 3):
            return PreparedConv2dWeights(ctx, r.shape, {})
        return PreparedConv2dWeights(ctx, r.shape, {m: exc.wino_weights(ctx, r, m) for m in (2, 4)})

    def conv2d_prepared(self, weight, prepared, bias=None, stride=1, padding=0, groups=1,
                        out_tags=None):
        """conv2d through prepared Winograd planes (3x3, stride 1, groups 1, padding <= 1; any
        other shape takes the direct route); inference-only."""
        return _conv2d_prepared("conv2d_prepared", self, weight, prepared, bias, stride, padding,
                                groups, out_tags, False)

    def conv2d_prepared_relu(self, weight, prepared, bias=None, stride=1, padding=0, groups=1,
                             out_tags=None):
        """conv2d_prepared with relu fused into the output transform."""
        return _conv2d_prepared("conv2d_prepared_relu", self, weight, prepared, bias, stride,
                                padding, groups, out_tags, True)

    def max_pool2d(self, kernel, stride=None, padding=0):
        """Max over each window of a channel-last [H, W, C] map (stride defaults to kernel);
        padding reads -inf. Gradient to the first maximum of each window."""
        return _pool("max_pool2d", "max", self, kernel, stride, padding)

    def avg_pool2d(self, kernel, stride=None, padding=0):
        """Mean over the valid taps of each window (count_include_pad=False)."""
        return _pool("avg_pool2d", "avg", self, kernel, stride, padding)

    def upsample2x_nearest(self):
        """[H, W, C] -> [2H, 2W, C], each pixel repeated 2 x 2; gradient: 2x2 stride-2 sum-pool."""
        op = "upsample2x_nearest"
        r = _input(op, self, 3)
        ctx = r.ctx
        H, W, C = r.shape
        g = exc.Geo(2 * H, 2 * W, C, C, 2, 2, 2, 2)
        return self._result(*finish_op(op, exc.upsample2x(ctx, r), self.tags, (self,),
                                       lambda needs: functools.partial(_pool_grads_sum, ctx, g)))

    def unfold(self, kernel, stride, padding, out_tags):
        """im2col of a channel-last [H, W, C] map: [oH*oW, kH*kW*C], row oy*oW + ox, elements
        (ky, kx, c) with c fastest; pad taps read 0. Gradient: fold."""
        op = "unfold"
        r = _input(op, self, 3)
        tags = _out_tags(op, out_tags, 2)
        H, W, C = r.shape
        g = _fold_geo(op, H, W, C, kernel, stride, padding)
        ctx = r.ctx
        return self._result(*finish_op(op, exc.unfold(ctx, r, g), tags, (self,),
                                       lambda needs: functools.partial(_unfold_grads, ctx, g)))

    def fold(self, output_size, kernel, stride, padding, out_tags):
        """The adjoint of unfold: [oH*oW, kH*kW*C] patch rows summed back into an
        output_size = (H, W) map [H, W, C] (overlaps accumulate, pad taps drop)."""
        op = "fold"
        r = _input(op, self, 2)
        tags = _out_tags(op, out_tags, 3)
        H, W = _pair(op, "output_size", output_size)
        kh, kw = _pair(op, "kernel", kernel)
        if r.shape[1] % (kh * kw):
            raise ShapeMismatch(f"{op}: expected patch rows of kH*kW*C elements (a multiple of "
                                f"{kh * kw}), got {r.shape[1]}")
        g = _fold_geo(op, H, W, r.shape[1] // (kh * kw), kernel, stride, padding)
        if r.shape[0] != g.OH * g.OW:
            raise ShapeMismatch(f"{op}: expected {g.OH * g.OW} patch rows ({g.OH} x {g.OW} "
                                f"windows for output_size {(H, W)}), got {r.shape[0]}")
        ctx = r.ctx
        return self._result(*finish_op(op, exc.fold(ctx, r, g), tags, (self,),
                                       lambda needs: functools.partial(_fold_grads, ctx, g)))

    # ---- per-channel ----
    def prelu(self, alpha):
        """x > 0 ? x : alpha[c] * x over the innermost (channel) axis; alpha tagged (channel,)."""
        op = "prelu"
        r, rows = _rows(op, self)
        ar = _channel_param(op, self, alpha, "alpha")
        ctx = r.ctx
        out = exc.chan_forward(ctx, "prelu", rows, ar)
        out = out.view(r.shape, contiguous_strides(r.shape), 0)
        return self._result(*finish_op(op, out, self.tags, (self, alpha), lambda needs: functools.partial(
            _chan_grads, ctx, "prelu", rows, ar, r.shape, needs)))

    def channel_affine(self, scale, shift):
        """x * scale[c] + shift[c] (two roundings) over the innermost (channel) axis."""
        op = "channel_affine"
        r, rows = _rows(op, self)
        sr = _channel_param(op, self, scale, "scale")
        hr = _channel_param(op, self, shift, "shift")
        ctx = r.ctx
        out = exc.chan_forward(ctx, "affine", rows, sr, hr)
        out = out.view(r.shape, contiguous_strides(r.shape), 0)
        return self._result(*finish_op(op, out, self.tags, (self, scale, shift),
                                       lambda needs: functools.partial(
                                           _chan_grads, ctx, "affine", rows, sr, r.shape, needs)))


def _taps(op, x, weight):
    same_ctx(op, x, weight)
    r = weight._live(op)
    if r.rank != 3:
        raise TagError(f"{op}: expected a rank-3 weight [tap, in, out], got tags {weight.tags}")
    return r.shape[0]


def _pool_grads_sum(ctx, g, gy):
    return (exc.pool(ctx, "sum", _g(ctx, gy, (g.H, g.W, g.Cin)), g)[0],)
