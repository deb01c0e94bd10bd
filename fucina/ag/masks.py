"""Masks, comparisons and conditionals with their backward rules (SPEC §3.7).

Mask producers (compare, logical_*, isnan/isinf/isfinite, any/all, band_mask) return `.bool`
tensors with no graph: caller-owned even under an exec scope (R-5, `Tensor._result` adopts only
f32 or grad-carrying results). Mask consumers (where, masked_fill, logical_*, any/all) read a
bool mask or any other tensor by truthiness (`!= 0`, NaN is truthy).

Every value is computed by a generated kernel: the elementwise generator with the emitters of
codegen/masks.py, or that module's `mask_reduce` (any/all) and `band_mask` kernels.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import axes
from ..codegen import kernels
from ..codegen.masks import BLOCK, COMPARE_OPS, BandMaskKey, MaskReduceKey
from ..errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidShape, ShapeMismatch,
                      TagError)
from ..exec import elementwise as ew
from ..exec.context import validate_shape
from ..exec.dtypes import FLOATS, ITEMSIZE
from ..exec.raw import contiguous_strides, numel
from .checks import same_ctx
from .engine import finish_op

_INT_RANGE = {"i64": (-(1 << 63), (1 << 63) - 1), "bool": (0, 1)}


# ---- operand helpers ------------------------------------------------------------------------

def _f32(v) -> float:
    """A Python number rounded to float32 (overflow gives +-inf, never an error)."""
    try:
        f = float(v)
    except OverflowError:  # an int beyond float64
        f = math.inf if v > 0 else -math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(f))


def _splat(ctx, value, dtype: str, shape):
    """A one-element `dtype` tensor read through zero strides at `shape`: the scalar operand
    for integer and bool kernels (the by-value parameter path carries f32 or i64 only)."""
    one = ctx.from_numpy([value], (1,), dtype, "scalar")
    return one.view(shape, (0,) * len(shape))


def _scalar_operand(ctx, value, dtype: str, shape):
    """`value` as an operand of a `dtype` kernel: a float32 parameter for float dtypes (16-bit
    results round once, at the store), else a splatted one-element tensor."""
    return _f32(value) if dtype in FLOATS else _splat(ctx, value, dtype, shape)


def _same_layout(op: str, x, y, what: str = "other") -> None:
    """y must have x's tags (TagError) and x's shape (ShapeMismatch)."""
    if x.tags != y.tags:
        raise TagError(f"{op}: expected {what} with tags {x.tags}, got {y.tags}")
    if x._raw.shape != y._raw.shape:
        raise ShapeMismatch(f"{op}: expected {what} of shape {x._raw.shape} (tags {x.tags}), "
                            f"got shape {y._raw.shape}")


def _into(op: str, x, m, what: str = "mask"):
    """m viewed at x's shape: m's tags must be a subset of x's, each of x's size or 1."""
    a, r = x._raw, m._raw
    if m.tags == x.tags and r.shape == a.shape:
        return r
    extra = [t for t in m.tags if t not in x.tags]
    if extra:
        raise TagError(f"{op}: expected {what} tags within self's {x.tags}, got {m.tags} "
                       f"({extra} not in self)")
    strides = []
    for t, d in zip(x.tags, a.shape):
        if t not in m.tags:
            strides.append(0)
            continue
        i = m.tags.index(t)
        if r.shape[i] not in (d, 1):
            raise ShapeMismatch(f"{op}: {what} axis {t!r} has size {r.shape[i]}, expected {d} or 1 "
                                f"(self shape {a.shape} tags {x.tags}, {what} shape {r.shape} tags {m.tags})")
        strides.append(0 if r.shape[i] != d else r.strides[i])
    return r.view(a.shape, strides)


# ---- compare --------------------------------------------------------------------------------

def _int_plan(op: str, v, lo: int, hi: int):
    """Exact comparison of integers in [lo, hi] with the real v: (op, k) with k an integer in
    [lo, hi], or (None, constant) when every element gives the same answer."""
    if isinstance(v, numbers.Integral):
        k = int(v)
    else:
        f = float(v)
        if math.isnan(f):
            return None, op == "ne"
        if math.isinf(f):
            k = hi + 1 if f > 0 else lo - 1
        elif f != math.floor(f):  # between two integers: never equal
            if op in ("eq", "ne"):
                return None, op == "ne"
            if op in ("lt", "le"):
                op, k = "le", math.floor(f)
            else:
                op, k = "ge", math.floor(f) + 1
        else:
            k = int(f)
    if k < lo or k > hi:
        if op in ("eq", "ne"):
            return None, op == "ne"
        return None, (k > hi) if op in ("lt", "le") else (k < lo)
    return op, k


def compare(x, op: str, other):
    """x op other -> bool; `other` a same-tagged same-shape tensor or a Python number."""
    if op not in COMPARE_OPS:
        raise InvalidArgument(f"compare: expected op in {COMPARE_OPS}, got {op!r}")
    a = x._raw
    ctx = a.ctx
    if a.dtype not in FLOATS and a.dtype not in _INT_RANGE:
        raise DTypeError(f"compare: expected a float, integer or bool tensor, got {a.dtype} "
                         f"(dequantize block types with .to('f32') first)")
    if isinstance(other, type(x)):
        _same_layout("compare", x, other)
        b = other._raw
        if a.dtype != b.dtype and not (a.dtype in FLOATS and b.dtype in FLOATS):
            raise DTypeError(f"compare: expected operands of one dtype (or two float dtypes), "
                             f"got {a.dtype} and {b.dtype}")
        return ew.run(ctx, "cmp_" + op, "bool", a.shape, (a, b))
    if not isinstance(other, numbers.Real):
        raise InvalidArgumentType(f"compare: expected a Tensor or a real number as other, got {type(other).__name__}")
    if a.dtype in FLOATS:  # f16/bf16 widen to f32; the number rounds to f32 (SPEC: via f32)
        return ew.run(ctx, "cmp_" + op, "bool", a.shape, (a, _f32(other)))
    lo, hi = _INT_RANGE[a.dtype]
    kop, k = _int_plan(op, other, lo, hi)
    if kop is None:
        return ctx.full_raw(a.shape, 1 if k else 0, "bool")
    return ew.run(ctx, "cmp_" + kop, "bool", a.shape, (a, _splat(ctx, k, a.dtype, a.shape)))


# ---- where / masked_fill (differentiable) ---------------------------------------------------

def where(x, cond, other):
    """cond ? x : other elementwise; all three the same tags and shape; grad to x and other."""
    a, c, o = x._raw, cond._raw, other._raw
    _same_layout("where", x, cond, "cond")
    _same_layout("where", x, other)
    if a.dtype != o.dtype:
        raise DTypeError(f"where: expected self and other of one dtype, got {a.dtype} and {o.dtype}")
    out = ew.run(a.ctx, "where", a.dtype, a.shape, (c, a, o))
    saved = (a.ctx, c, a.shape)
    return finish_op("where", out, x.tags, (x, other), lambda needs: functools.partial(_where_grads, saved, needs))


def _where_grads(saved, needs, g):
    ctx, c, shape = saved
    return (ew.run(ctx, "where", "f32", shape, (c, g, 0.0)) if needs[0] else None,
            ew.run(ctx, "where", "f32", shape, (c, 0.0, g)) if needs[1] else None)


def masked_fill(x, mask, value):
    """mask ? value : x; the mask broadcasts into x (its tags a subset of x's); grad to x."""
    a = x._raw
    ctx = a.ctx
    m = _into("masked_fill", x, mask)
    if not isinstance(value, numbers.Real):  # bools count as 0/1
        raise InvalidArgumentType(f"masked_fill: expected a real number as value, got {type(value).__name__}")
    if a.dtype == "i64":
        if not isinstance(value, numbers.Integral):
            raise DTypeError(f"masked_fill: expected an integer value for an i64 tensor, got {value!r}")
        lo, hi = _INT_RANGE["i64"]
        if not lo <= int(value) <= hi:
            raise InvalidArgument(f"masked_fill: value {value} does not fit in i64")
        value = int(value)
    elif a.dtype == "bool":
        value = 1 if value != 0 else 0  # truthiness, NaN included
    out = ew.run(ctx, "where", a.dtype, a.shape, (m, _scalar_operand(ctx, value, a.dtype, a.shape), a))
    shape = a.shape

    def vjp(needs):
        return lambda g: (ew.run(ctx, "where", "f32", shape, (m, 0.0, g)),)

    return finish_op("masked_fill", out, x.tags, (x,), vjp)


# ---- any / all ------------------------------------------------------------------------------

SEGMENT = 1 << 14   # a long axis is cut into segments of this many elements ...
SPLIT_AT = 1 << 16  # ... when it is at least this long and there is little other parallelism
WORK_PER_CHUNK = 1 << 15


def _reduce_launch(ctx, op, dtype, addr, A, N, B, C):
    """One pass over x[A, N, B]: out[A, S, B] bool partials over segments of length C."""
    S = -(-N // C)
    inner = B == 1
    nblk = 1 if inner else -(-B // BLOCK)
    items = A * S * nblk
    per = max(1, WORK_PER_CHUNK // max(1, C * (1 if inner else min(B, BLOCK))))
    out = ctx.empty((A, S, B), "bool")
    ctx.launch(kernels.get(MaskReduceKey(op, dtype, inner)), -(-items // per), A * N * B * ITEMSIZE[dtype],
               addr, out.addr, A, N, B, C, S, per)
    return out


def reduce_raw(ctx, op: str, x, axis: int):
    """any | all of x's truthiness over `axis` (a bool RawTensor without that axis)."""
    x = ew.materialize(ctx, x)
    A, N, B = numel(x.shape[:axis]), x.shape[axis], numel(x.shape[axis + 1:])
    out_shape = x.shape[:axis] + x.shape[axis + 1:]
    C = SEGMENT if N >= SPLIT_AT and A * B < 64 else N
    part = _reduce_launch(ctx, op, x.dtype, x.addr, A, N, B, C)
    if C != N:
        S = part.shape[1]
        part = _reduce_launch(ctx, op, "bool", part.addr, A, S, B, S)
    return part.view(out_shape, contiguous_strides(out_shape), 0)


def reduce_all_raw(ctx, op: str, x):
    if not x.is_contiguous():
        x = ew.materialize(ctx, x)
    return reduce_raw(ctx, op, x.view((x.numel,), (1,)), 0)


# ---- band masks -----------------------------------------------------------------------------

def _bound(name: str, v, limit: int) -> int:
    """A band bound as an int clamped to [-limit, limit]; None means unbounded (= limit)."""
    if v is None:
        return limit
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"band: expected {name} to be an int or None, got {type(v).__name__}")
    return max(-limit, min(limit, int(v)))


def band_raw(ctx, R: int, C: int, lower, upper):
    """[R, C] bool: (i, j) is True iff i - j <= lower and j - i <= upper (None: unbounded)."""
    limit = R + C
    lo, up = _bound("lower", lower, limit), _bound("upper", upper, limit)
    out = ctx.empty((R, C), "bool")
    if R * C == 0:
        return out
    per = max(1, ew.CHUNK // C)
    ctx.launch(kernels.get(BandMaskKey()), -(-R // per), R * C, out.addr, R, C, lo, up, per)
    return out


def band_mask(ctx, tags, shape, lower, upper):
    """`fu.band_mask(ctx, ("q", "k"), (Q, K), lower, upper)`: a two-tag bool constant, (i, j)
    True iff i - j <= lower and j - i <= upper; None = unbounded. causal = (None, 0), sliding
    window W = (W - 1, 0); contradictory bounds give all False."""
    from .tensor import Tensor

    ctx.check_open("band_mask")
    shape = validate_shape(shape, "band_mask")
    tags = axes.check_tags(tags, len(shape), "band_mask")
    if len(shape) != 2:
        raise InvalidShape(f"band_mask: expected a two-axis shape, got {shape}")
    return Tensor(band_raw(ctx, shape[0], shape[1], lower, upper), tags)


def band_part(x, row_tag: str, col_tag: str, lower, upper):
    """x where (i - j <= lower and j - i <= upper) for i along row_tag, j along col_tag, else 0;
    other axes pass through. Grad to x through the same band."""
    a = x._raw
    ctx = a.ctx
    r = axes.axis_of(x.tags, row_tag, "band_part")
    c = axes.axis_of(x.tags, col_tag, "band_part")
    if r == c:
        raise TagError(f"band_part: expected two different axes, got row_tag == col_tag == {row_tag!r}")
    R, C = a.shape[r], a.shape[c]
    band = band_raw(ctx, R, C, lower, upper)
    strides = [0] * a.rank
    strides[r], strides[c] = C, 1
    m = band.view(a.shape, strides)
    out = ew.run(ctx, "where", a.dtype, a.shape, (m, a, _scalar_operand(ctx, 0, a.dtype, a.shape)))
    shape = a.shape

    def vjp(needs):
        return lambda g: (ew.run(ctx, "where", "f32", shape, (m, g, 0.0)),)

    return finish_op("band_part", out, x.tags, (x,), vjp)


# ---- the Tensor methods ---------------------------------------------------------------------

class MaskMethods:
    """Tensor methods of the mask family (SPEC §3.7)."""

    __slots__ = ()

    def compare(self, op: str, other):
        """`x.compare("lt", 0)`: a bool mask (op in eq, ne, lt, le, gt, ge; IEEE: NaN compares
        False except ne). other: a tensor of the same tags and shape, or a Python number."""
        self._live("compare")
        if isinstance(other, type(self)):
            same_ctx("compare", self, other)
        return self._result(compare(self, op, other), self.tags)

    def _logical(self, op: str, other):
        self._live(op)
        same_ctx(op, self, other)
        _same_layout(op, self, other)
        r = self._raw
        return self._result(ew.run(r.ctx, op, "bool", r.shape, (r, other._raw)), self.tags)

    def logical_and(self, other):
        """Truthiness AND (bool mask, or != 0 with NaN true) -> bool; same tags and shape."""
        return self._logical("logical_and", other)

    def logical_or(self, other):
        return self._logical("logical_or", other)

    def logical_xor(self, other):
        return self._logical("logical_xor", other)

    def _mask_unary(self, op: str):
        r = self._live(op)
        return self._result(ew.run(r.ctx, op, "bool", r.shape, (r,)), self.tags)

    def logical_not(self):
        return self._mask_unary("logical_not")

    def isnan(self):
        return self._mask_unary("isnan")

    def isinf(self):
        return self._mask_unary("isinf")

    def isfinite(self):
        return self._mask_unary("isfinite")

    def where(self, cond, other):
        """`cond ? self : other` (SPEC §3.7); cond is a bool mask or a float read by truthiness."""
        self._live("where")
        same_ctx("where", self, cond)
        same_ctx("where", self, other)
        return self._result(*where(self, cond, other))

    def masked_fill(self, mask, value):
        """`mask ? value : self`; mask: bool or truthy float with self's tags (or a subset,
        broadcast); value rounds to self's dtype. Grad to self, zero where filled."""
        self._live("masked_fill")
        same_ctx("masked_fill", self, mask)
        return self._result(*masked_fill(self, mask, value))

    # ---- truthiness reductions ----
    def _any_all(self, op: str, tag: str):
        r = self._live(op)
        ax, tags = axes.reduced(self.tags, tag, op)
        return self._result(reduce_raw(r.ctx, op, r, ax), tags)

    def any(self, tag: str):
        """Is any element along `tag` truthy? (bool, tag removed)"""
        return self._any_all("any", tag)

    def all(self, tag: str):
        return self._any_all("all", tag)

    def any_all(self):
        r = self._live("any_all")
        return self._result(reduce_all_raw(r.ctx, "any", r), ())

    def all_all(self):
        r = self._live("all_all")
        return self._result(reduce_all_raw(r.ctx, "all", r), ())

    # ---- bands ----
    band_mask = staticmethod(band_mask)

    def band_part(self, row_tag: str, col_tag: str, lower, upper):
        """Zero outside the band i - j <= lower, j - i <= upper (None: unbounded)."""
        self._live("band_part")
        return self._result(*band_part(self, row_tag, col_tag, lower, upper))

    def tril(self, row_tag: str, col_tag: str, offset: int = 0):
        """torch.tril(diagonal=offset) over (row_tag, col_tag) = band_part(None, offset)."""
        self._live("tril")
        return self._result(*band_part(self, row_tag, col_tag, None, _offset("tril", offset)))

    def triu(self, row_tag: str, col_tag: str, offset: int = 0):
        """torch.triu(diagonal=offset) = band_part(-offset, None)."""
        self._live("triu")
        return self._result(*band_part(self, row_tag, col_tag, -_offset("triu", offset), None))


def _offset(op: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an int offset, got {type(v).__name__}")
    return int(v)
