"""In-place and consuming helpers (SPEC R-7): inference and optimizer plumbing that writes
into existing storage. All refuse operands that require grad (a graph may have saved them)."""
from __future__ import annotations

import sys

import numpy as np

from .. import axes
from ..errors import ActiveExecScopeUnsupported, InvalidArgument, ShapeMismatch, UnsupportedGradient
from ..exec import elementwise as ew
from .activations import UNARY
from .checks import real, same_ctx
from .engine import finish_op


def _no_grad_operands(op, *ts):
    for t in ts:
        if t._node is not None:
            raise UnsupportedGradient(f"{op}: expected operands that do not require grad, got {t!r}")


def _last_axis_bias(op, x, bias, tag):
    """bias[tag] viewed over x's shape (stride 0 on every other axis); tag must be x's last axis."""
    if not x.tags or x.tags[-1] != tag:
        raise axes.TagError(f"{op}: expected {tag!r} to be the last axis of {x.tags}")
    if bias.tags != (tag,) or bias._raw.shape[0] != x._raw.shape[-1]:
        raise ShapeMismatch(f"{op}: expected bias tagged ({tag!r},) of size {x._raw.shape[-1]}, "
                            f"got {bias.tags} shape {bias._raw.shape}")
    r = x._raw
    return bias._raw.view(r.shape, (0,) * (r.rank - 1) + (bias._raw.strides[0],))


def _uniquely_owned(raw) -> bool:
    """No other view or numpy export holds this storage (refs: raw.buf and the call's argument)."""
    return raw.offset == 0 and raw.is_contiguous() and sys.getrefcount(raw.buf) == 2


class InplaceMethods:
    """Tensor methods that mutate or consume their receiver."""

    __slots__ = ()

    def add_axis_vector_in_place(self, bias, axis_tag: str):
        """self[..., j] += bias[j] along the last axis `axis_tag`."""
        r = self._live("add_axis_vector_in_place")
        same_ctx("add_axis_vector_in_place", self, bias)
        _no_grad_operands("add_axis_vector_in_place", self, bias)
        bv = _last_axis_bias("add_axis_vector_in_place", self, bias, axis_tag)
        ew.run(r.ctx, "add", r.dtype, r.shape, (r, bv), out=r)
        return self

    def add_axis_vector_unary_in_place(self, op: str, bias, axis_tag: str):
        """self = unary(op, self + bias) in one pass over self's storage."""
        r = self._live("add_axis_vector_unary_in_place")
        same_ctx("add_axis_vector_unary_in_place", self, bias)
        _no_grad_operands("add_axis_vector_unary_in_place", self, bias)
        if op not in UNARY:
            raise InvalidArgument(f"add_axis_vector_unary_in_place: expected one of {UNARY}, got {op!r}")
        bv = _last_axis_bias("add_axis_vector_unary_in_place", self, bias, axis_tag)
        ew.compute_dtype_of("add", (r.dtype, bias._raw.dtype))
        ew.run(r.ctx, "add_then:" + op, r.dtype, r.shape, (r, bv), out=r)
        return self

    def add_scaled_in_place(self, other, alpha: float):
        """self += alpha * other (same tags and shape)."""
        r = self._live("add_scaled_in_place")
        same_ctx("add_scaled_in_place", self, other)
        _no_grad_operands("add_scaled_in_place", self, other)
        o = other._raw
        if other.tags != self.tags or o.shape != r.shape:
            raise ShapeMismatch(f"add_scaled_in_place: expected other with tags {self.tags} shape "
                                f"{r.shape}, got {other.tags} {o.shape}")
        ew.compute_dtype_of("add", (r.dtype, o.dtype))
        ew.run(r.ctx, "add_scaled", r.dtype, r.shape, (r, o, real("add_scaled_in_place", alpha)), out=r)
        return self

    def _take(self, op, operands_of):
        r = self._live(op)
        if self._scope is not None:
            raise ActiveExecScopeUnsupported(f"{op}: expected a caller-owned tensor, got a scope borrow")
        _no_grad_operands(op, self)
        reuse = _uniquely_owned(r)
        out = ew.run(r.ctx, *operands_of(r), out=r if reuse else None)
        self._raw = None  # consumed
        return type(self)(out, self.tags)

    def take_add_no_grad(self, other):
        """Consume self and return self + other (same tags and shape), in self's storage when
        nothing else holds it."""
        same_ctx("take_add_no_grad", self, other)
        _no_grad_operands("take_add_no_grad", other)
        if other.tags != self.tags or other._raw.shape != self._live("take_add_no_grad").shape:
            raise ShapeMismatch(f"take_add_no_grad: expected other with tags {self.tags} shape "
                                f"{self._raw.shape}, got {other.tags} {other._raw.shape}")
        dtype = ew.compute_dtype_of("add", (self._raw.dtype, other._raw.dtype))
        return self._take("take_add_no_grad", lambda r: ("add", dtype, r.shape, (r, other._raw)))

    def take_scale_no_grad(self, s: float):
        """Consume self and return self * s, in self's storage when nothing else holds it."""
        s = real("take_scale_no_grad", s)
        dtype = ew.compute_dtype_of("mul", (self._live("take_scale_no_grad").dtype,))
        return self._take("take_scale_no_grad", lambda r: ("mul", dtype, r.shape, (r, s)))

    def bias_add(self, bias_slice, axis_tag: str):
        """Out of place self + bias along `axis_tag` (host values); grad to self only."""
        r = self._live("bias_add")
        ax = axes.axis_of(self.tags, axis_tag, "bias_add")
        values = np.asarray(bias_slice, dtype=np.float32).reshape(-1)
        if values.size != r.shape[ax]:
            raise ShapeMismatch(f"bias_add: expected {r.shape[ax]} bias values for axis {axis_tag!r}, "
                                f"got {values.size}")
        b = r.ctx.from_numpy(values, (values.size,), "f32", "bias_add")
        strides = [0] * r.rank
        strides[ax] = 1
        out = ew.run(r.ctx, "add", ew.compute_dtype_of("add", (r.dtype, "f32")), r.shape,
                     (r, b.view(r.shape, strides)))
        return self._result(*finish_op("bias_add", out, self.tags, (self,),
                                       lambda needs: lambda g: (g,)))
