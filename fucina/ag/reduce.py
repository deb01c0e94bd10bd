"""Reductions and scans with their backward rules (SPEC §3.8, A-3, R-11).

sum/mean broadcast the gradient back; max/min send it to the first occurrence of the extremum
(the first *selected* one under a mask); prod divides the product by each element in a
zero-free lane and handles lanes with zeros exactly; cumsum's backward is the reversed suffix
sum, cumprod's a reverse scan (codegen/scan.py); linear_recurrence's the reverse scan
gh[t] = a[t+1]·gh[t+1] + g[t]. Typed inputs: f16/bf16 reduce to f32 (no gradient through
them, R-11), an i64 sum stays i64 and a bool sum counts (i64).

Backward rules that are pointwise with a per-lane value broadcast over the reduced axis run as
elementwise kernels whose operands are zero-stride views; the few formulas the elementwise op
table lacks are written as `elemental:` expressions (codegen/elemental.py's canonical text).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import axes
from ..errors import DTypeError, InvalidArgument, InvalidArgumentType, ShapeMismatch, TagError
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..exec import scan as sc
from ..exec.raw import contiguous_strides
from .checks import real, require_scope, same_ctx
from .elementwise import unbroadcast
from .engine import finish_op

_Z, _ONE = "#00000000", "#3f800000"
# g * sign(x) (sign(0) = sign(NaN) = 0): inputs g, x
SIGN_GRAD = ("elemental:v1 i2 p0;%0=gt i1 " + _Z + ";%1=lt i1 " + _Z + ";%2=neg i0;"
             "%3=where %1 %2 " + _Z + ";%4=where %0 i0 %3;ret %4")
# x * (g / norm): inputs x, g, norm — NaN where the norm is 0 (SPEC: like torch's sqrt(sum(x²)))
L2_GRAD = "elemental:v1 i3 p0;%0=div i1 i2;%1=mul i0 %0;ret %1"
# (c * g) * (x - mu), c = 2 / (n - ddof): inputs x, mu, g; param c (torch's var_backward order)
VAR_GRAD = "elemental:v1 i3 p1;%0=mul p0 i2;%1=sub i0 i1;%2=mul %0 %1;ret %2"
# prod: inputs g, x, out, zeros (lane count, f32), pnz (lane product of the nonzeros)
PROD_GRAD = ("elemental:v1 i5 p0;%0=div i2 i1;%1=mul i0 %0;%2=mul i0 i4;%3=eq i1 " + _Z + ";"
             "%4=where %3 %2 " + _Z + ";%5=eq i3 " + _ONE + ";%6=where %5 %4 " + _Z + ";"
             "%7=eq i3 " + _Z + ";%8=where %7 %1 %6;ret %8")

NORM_ORDERS = {"l1": "l1", "l2": "l2", "inf": "inf", 1: "l1", 2: "l2", math.inf: "inf"}


# ---------------------------------------------------------------------------------------------
# helpers

def _spread(g, shape, axis):
    """A view of g (shape without `axis`) broadcast back over `axis` (stride 0)."""
    strides = list(g.strides)
    strides.insert(axis, 0)
    return g.view(shape, strides)


def _spread_many(g, shape, removed):
    """A view of g broadcast back over the `removed` axes (ascending positions of `shape`)."""
    it = iter(g.strides)
    return g.view(shape, [0 if i in removed else next(it) for i in range(len(shape))])


def _positions(ctx, n, shape, axis):
    """0..n-1 along `axis`, as an i64 view broadcast over the other axes."""
    pos = ctx.from_numpy(np.arange(n, dtype=np.int64), (n,), "i64", "backward")
    st = [0] * len(shape)
    st[axis] = 1
    return pos.view(shape, st)


def _pick(ctx, g_full, idx, shape, axis):
    """g where the index along `axis` equals idx (the lane's chosen element), else 0."""
    return ew.run(ctx, "pick", "f32", shape,
                  (g_full, _spread(idx, shape, axis), _positions(ctx, shape[axis], shape, axis)))


def _typed_op(op: str, dtype: str, name: str) -> str:
    """R-11: a bool sum counts; integer and bool tensors have no mean/max/min/prod."""
    if dtype == "bool" and op == "sum":
        return "count"
    if dtype in ("i64", "bool") and op != "sum":
        raise DTypeError(f"{name}: expected a float tensor (f32, f16, bf16), got {dtype}"
                         + ("; sum/sum_all count a bool mask" if dtype == "bool" else
                            "; integer tensors have sum/sum_all only"))
    return op


def _empty_value(name, empty, dtype):
    if empty is None:
        return None
    if dtype in ("i64", "bool"):
        if isinstance(empty, bool) or not isinstance(empty, numbers.Integral):
            raise InvalidArgumentType(f"{name}: expected an integer empty= for an integer sum, got {empty!r}")
        return int(empty)
    return real(name, empty)


# ---------------------------------------------------------------------------------------------
# reductions over one axis

def reduce_axis(op: str, x, axis: int, tags, mean: bool = False, mask=None, empty=None):
    """sum | max | min (mean: op="sum", mean=True) over `axis`, optionally masked."""
    name = "mean" if mean else op
    r = x._raw
    ctx = r.ctx
    if mean and r.dtype in ("i64", "bool"):
        raise DTypeError(f"mean: expected a float tensor (f32, f16, bf16), got {r.dtype}; "
                         f"integer tensors have sum/sum_all only")
    kop = _typed_op(op, r.dtype, name)
    empty = _empty_value(name, empty, r.dtype)
    if mask is not None:
        return _masked(kop, x, axis, tags, mask._raw, empty, mean, name)
    out = red.reduce_axis(ctx, kop, r, axis, mean)
    shape, n = r.shape, r.shape[axis]

    def vjp(needs):
        def run(g):
            gx = _spread(g, shape, axis)
            if op == "sum":
                return (ew.run(ctx, "div", "f32", shape, (gx, float(n))) if mean else gx,)
            return (_pick(ctx, gx, red.arg_extreme(ctx, op, r, axis), shape, axis),)
        return run

    return finish_op(name, out, tags, (x,), vjp)


def _masked(op, x, axis, tags, m, empty, mean, name):
    """SPEC §3.8 masked reductions: falsy elements contribute the identity; an empty lane
    gives the identity (mean: NaN) unless `empty`; mean divides by the selected count."""
    r = x._raw
    ctx = r.ctx
    red.check_dtype(op, r, name)
    red.check_mask(name, r, m)
    out = red.reduce_axis(ctx, op, r, axis, mask=m)
    cnt = None
    if mean or empty is not None:
        cnt = red.reduce_axis(ctx, "count", m, axis)
        if mean:
            out = red.finish(ctx, "mean", out, cnt, math.nan if empty is None else empty)
        else:
            out = red.finish(ctx, "fill", out, cnt, empty)
    shape = r.shape

    def vjp(needs):
        def run(g):
            if op in ("max", "min"):
                idx = red.arg_extreme(ctx, op, r, axis, mask=m)
                return (_pick(ctx, _spread(g, shape, axis), idx, shape, axis),)
            if mean:
                g = red.finish(ctx, "mean", g, cnt, 0.0)  # g / count; an empty lane gets none
            return (ew.run(ctx, "where", "f32", shape, (m, _spread(g, shape, axis), 0.0)),)
        return run

    return finish_op(name, out, tags, (x,), vjp)


def reduce_all(x, mean: bool = False):
    """sum_all / mean_all: every element to a scalar (); the gradient broadcasts back."""
    r = x._raw
    ctx = r.ctx
    name = "mean_all" if mean else "sum_all"
    if mean and r.dtype in ("i64", "bool"):
        raise DTypeError(f"mean_all: expected a float tensor (f32, f16, bf16), got {r.dtype}; "
                         f"integer tensors have sum/sum_all only")
    out = red.reduce_all(ctx, _typed_op("sum", r.dtype, name), r, mean)
    shape, n = r.shape, r.numel

    def vjp(needs):
        def run(g):
            gx = g.view(shape, (0,) * len(shape))
            return (ew.run(ctx, "div", "f32", shape, (gx, float(n))) if mean else gx,)
        return run

    return finish_op(name, out, (), (x,), vjp)


def sum_many(x, tag_list):
    """Sum over several tags, innermost axis first; the gradient broadcasts back over all."""
    r = x._raw
    ctx = r.ctx
    tag_list = tuple(tag_list)
    if not tag_list:
        raise TagError("sum_many: expected at least one tag to sum over, got none")
    if len(set(tag_list)) != len(tag_list):
        raise TagError(f"sum_many: expected distinct tags, got {tag_list}")
    removed = sorted((axes.axis_of(x.tags, t, "sum_many") for t in tag_list), reverse=True)
    op = _typed_op("sum", r.dtype, "sum_many")
    cur = r
    for ax in removed:
        cur = red.reduce_axis(ctx, op, cur, ax)
        op = "sum"  # a count's partial sums are i64 sums
    tags = tuple(t for t in x.tags if t not in tag_list)
    shape, gone = r.shape, set(removed)
    return finish_op("sum_many", cur, tags, (x,),
                     lambda needs: lambda g: (_spread_many(g, shape, gone),))


def prod(x, axis: int, tags):
    r = x._raw
    ctx = r.ctx
    _typed_op("prod", r.dtype, "prod")
    out = red.reduce_axis(ctx, "prod", r, axis)
    shape = r.shape

    def vjp(needs):
        def run(g):
            zc = red.finish(ctx, "tof32", None, red.reduce_axis(ctx, "count", r, axis, pre="zero"))
            pnz = red.reduce_axis(ctx, "prod", r, axis, pre="nonzero")
            ops = (_spread(g, shape, axis), r, _spread(out, shape, axis), _spread(zc, shape, axis),
                   _spread(pnz, shape, axis))
            return (ew.run(ctx, PROD_GRAD, "f32", shape, ops),)
        return run

    return finish_op("prod", out, tags, (x,), vjp)


def variance(x, axis: int, tags, ddof: int):
    """Two passes in a fixed order: mu = sum / n, then sum (x - mu)² / (n - ddof); the
    backward g·2(x − μ)/(n − ddof) (μ recomputed, bitwise, when the forward fused it)."""
    r = x._raw
    ctx = r.ctx
    _typed_op("variance", r.dtype, "variance")
    n = r.shape[axis]
    out, mu = red.variance(ctx, r, axis, ddof)
    shape = r.shape
    c = float(np.float32(2.0) / np.float32(n - ddof)) if n != ddof else math.inf

    def vjp(needs):
        def run(g):
            m = mu if mu is not None else red.reduce_axis(ctx, "sum", r, axis, mean=True)
            ops = (r, _spread(m, shape, axis), _spread(g, shape, axis), c)
            return (ew.run(ctx, VAR_GRAD, "f32", shape, ops),)
        return run

    return finish_op("variance", out, tags, (x,), vjp)


# order -> (reduce op, what each element contributes, final transform)
NORM_KERNELS = {"l1": ("sum", "abs", "none"), "l2": ("sum", "sq", "sqrt"), "inf": ("max", "abs", "none")}


def norm(x, axis: int | None, tags, order):
    """order l1 | l2 | inf over `axis` (None: every element, a scalar). Forward: one reduction
    (Σ|x|, √Σx², max|x|); backward: g·sign(x), x·g/‖x‖, g·sign(x) at the first max |x|."""
    name = "norm_all" if axis is None else "norm"
    kind = None
    if isinstance(order, (str, int, float)) and not isinstance(order, bool):
        kind = NORM_ORDERS.get(order)
    if kind is None:
        raise InvalidArgument(f"{name}: expected order 'l1', 'l2' or 'inf', got {order!r}")
    r = x._raw
    ctx = r.ctx
    _typed_op("norm", r.dtype, name)
    require_scope(name, x)
    op, pre, post = NORM_KERNELS[kind]
    shape = r.shape
    if axis is None:  # every element: a flat view, and the result broadcasts back over all
        flat = ew.materialize(ctx, r).view((r.numel,), (1,))
        out = red.reduce_axis(ctx, op, flat, 0, pre=pre, post=post).view((), ())
    else:
        out = red.reduce_axis(ctx, op, r, axis, pre=pre, post=post)

    def vjp(needs):
        def run(g):
            if axis is None:
                zeros = (0,) * len(shape)
                gx, ov = g.view(shape, zeros), out.view(shape, zeros)
            else:
                gx, ov = _spread(g, shape, axis), _spread(out, shape, axis)
            if kind == "l2":
                return (ew.run(ctx, L2_GRAD, "f32", shape, (r, gx, ov)),)
            gs = ew.run(ctx, SIGN_GRAD, "f32", shape, (gx, r))
            if kind == "l1":
                return (gs,)
            if axis is None:
                idx = red.arg_extreme(ctx, "max", flat, 0, absval=True)
                n = (r.numel,)
                return (_pick(ctx, gs.view(n, (1,)), idx, n, 0).view(shape, contiguous_strides(shape)),)
            return (_pick(ctx, gs, red.arg_extreme(ctx, "max", r, axis, absval=True), shape, axis),)
        return run

    return finish_op(name, out, tags, (x,), vjp)


# ---------------------------------------------------------------------------------------------
# scans and segments

def cumsum(x, axis: int):
    r = x._raw
    ctx = r.ctx
    out = sc.scan(ctx, "cumsum", r, axis)
    return finish_op("cumsum", out, x.tags, (x,),
                     lambda needs: lambda g: (sc.scan(ctx, "cumsum", g, axis, reverse=True),))


def cumprod(x, axis: int):
    r = x._raw
    ctx = r.ctx
    out = sc.scan(ctx, "cumprod", r, axis)
    return finish_op("cumprod", out, x.tags, (x,),
                     lambda needs: lambda g: (sc.scan(ctx, "cumprod_grad", r, axis, p1=out, p2=g),))


def segment_sum(x, axis: int, offsets):
    r = x._raw
    ctx = r.ctx
    offs = red.offsets_raw(ctx, offsets, r.shape[axis])
    out = red.segment_sum(ctx, r, axis, offs)
    shape = r.shape
    return finish_op("segment_sum", out, x.tags, (x,),
                     lambda needs: lambda g: (red.segment_spread(ctx, g, axis, offs, shape),))


def _align_into(name, what, t, tags, shape):
    """t viewed at (tags, shape) by A-2 broadcasting, which must not grow the target."""
    a = t._raw
    extra = [tg for tg in t.tags if tg not in tags]
    if extra:
        raise TagError(f"{name}: {what} has tags {t.tags}; expected a subset of {tags} "
                       f"({extra} not among them)")
    out_tags, out_shape, _, rmap = axes.pointwise(name, tags, shape, t.tags, a.shape)
    if out_shape != shape:
        raise ShapeMismatch(f"{name}: {what} of shape {a.shape} ({t.tags}) does not broadcast "
                            f"into {shape} ({tags})")
    return a.view(shape, axes.aligned_strides(rmap, shape, a.shape, a.strides))


def linear_recurrence(x, axis: int, decay, initial=None):
    """h[t] = decay[t] * h[t-1] + x[t] along `axis` (h[-1] = initial or 0), serial."""
    name = "linear_recurrence"
    r = x._raw
    ctx = r.ctx
    for t in (x, decay) + ((initial,) if initial is not None else ()):
        if t._raw.dtype != "f32":
            raise DTypeError(f"{name}: expected f32 operands, got {t._raw.dtype}")
    shape = r.shape
    a = ew.materialize(ctx, _align_into(name, "decay", decay, x.tags, shape))
    itags = x.tags[:axis] + x.tags[axis + 1:]
    ishape = shape[:axis] + shape[axis + 1:]
    h0 = None
    if initial is not None:
        h0 = ew.materialize(ctx, _align_into(name, "initial", initial, itags, ishape))
    out = sc.scan(ctx, "linrec", r, axis, p1=a, p2=h0)
    operands = (x, decay) + ((initial,) if initial is not None else ())
    N = shape[axis]

    def vjp(needs):
        def run(g):
            # gh[t] = a[t+1] gh[t+1] + g[t]: the kernel reads the decay shifted one step
            shifted = ctx.full_raw(shape, 0.0, "f32")
            if N > 1:
                ew.run(ctx, "copy", "f32", a.narrow(axis, 1, N - 1).shape,
                       (a.narrow(axis, 1, N - 1),), out=shifted.narrow(axis, 0, N - 1))
            gh = sc.scan(ctx, "linrec", g, axis, reverse=True, p1=shifted)
            grads = [gh if needs[0] else None]
            if needs[1]:
                prev = ctx.full_raw(shape, 0.0, "f32")
                if N > 1:
                    ew.run(ctx, "copy", "f32", out.narrow(axis, 0, N - 1).shape,
                           (out.narrow(axis, 0, N - 1),), out=prev.narrow(axis, 1, N - 1))
                if h0 is not None:
                    first = prev.narrow(axis, 0, 1)
                    ew.run(ctx, "copy", "f32", first.shape, (_spread(h0, first.shape, axis),),
                           out=first)
                ga = ew.run(ctx, "mul", "f32", shape, (gh, prev))
                grads.append(unbroadcast(ctx, ga, x.tags, decay.tags, decay._raw.shape))
            else:
                grads.append(None)
            if initial is not None:
                if needs[2]:
                    gi = ew.run(ctx, "mul", "f32", ishape, (_drop(a, axis), _drop(gh, axis)))
                    grads.append(unbroadcast(ctx, gi, itags, initial.tags, initial._raw.shape))
                else:
                    grads.append(None)
            return tuple(grads)
        return run

    return finish_op(name, out, x.tags, operands, vjp)


def _drop(t, axis):
    """The t = 0 slice of `axis` as a view without that axis."""
    s = t.narrow(axis, 0, 1)
    return s.view(s.shape[:axis] + s.shape[axis + 1:], s.strides[:axis] + s.strides[axis + 1:])


# ---------------------------------------------------------------------------------------------
# the Tensor methods

def _ddof(ddof) -> int:
    if isinstance(ddof, bool) or not isinstance(ddof, numbers.Integral) or int(ddof) not in (0, 1):
        raise InvalidArgument(f"variance: expected ddof 0 (divide by n) or 1 (by n - 1), got {ddof!r}")
    return int(ddof)


class ReduceMethods:
    """Tensor methods of the reduction family (SPEC §3.8, A-3)."""

    __slots__ = ()

    # ---- reductions (A-3) ----
    def _reduce(self, op: str, tag: str, mean: bool = False, mask=None, empty=None):
        name = "mean" if mean else op
        self._live(name)
        ax, tags = axes.reduced(self.tags, tag, name)
        if mask is not None:
            same_ctx(name, self, mask)
            if mask.tags != self.tags or mask._raw.shape != self._raw.shape:
                raise ShapeMismatch(f"{name}: expected a mask with exactly the tags and shape of "
                                    f"self {self.tags}{self._raw.shape}, got "
                                    f"{mask.tags}{mask._raw.shape}")
        return self._result(*reduce_axis(op, self, ax, tags, mean, mask, empty))

    def sum(self, tag: str, mask=None, empty=None):
        """Σ over `tag` (masked: falsy elements excluded; an empty lane gives 0 or `empty`).
        i64 tensors sum in i64; a bool tensor's sum counts its True elements (i64)."""
        return self._reduce("sum", tag, mask=mask, empty=empty)

    def mean(self, tag: str, mask=None, empty=None):
        """Σ/n over `tag`; masked: divided by the selected count (an empty lane: NaN or `empty`)."""
        return self._reduce("sum", tag, True, mask, empty)

    def max(self, tag: str, mask=None, empty=None):
        return self._reduce("max", tag, mask=mask, empty=empty)

    def min(self, tag: str, mask=None, empty=None):
        return self._reduce("min", tag, mask=mask, empty=empty)

    def sum_all(self):
        """Every element summed to a scalar `()` (i64 for i64 and bool tensors: the counting idiom)."""
        self._live("sum_all")
        return self._result(*reduce_all(self))

    def mean_all(self):
        self._live("mean_all")
        return self._result(*reduce_all(self, mean=True))

    def sum_many(self, tags):
        """Σ over several tags (innermost axis first)."""
        self._live("sum_many")
        if isinstance(tags, str):
            tags = (tags,)
        return self._result(*sum_many(self, tags))

    def prod(self, tag: str):
        self._live("prod")
        ax, tags = axes.reduced(self.tags, tag, "prod")
        return self._result(*prod(self, ax, tags))

    def variance(self, tag: str, ddof):
        """Σ(x − μ)²/(n − ddof) over `tag`; ddof (0 or 1) is required."""
        self._live("variance")
        ax, tags = axes.reduced(self.tags, tag, "variance")
        return self._result(*variance(self, ax, tags, _ddof(ddof)))

    def norm(self, tag: str, order):
        """Σ|x| ("l1"), √Σx² ("l2") or max|x| ("inf") over `tag` (a composed op: under
        gradients it needs an open exec scope)."""
        self._live("norm")
        ax, tags = axes.reduced(self.tags, tag, "norm")
        return self._result(*norm(self, ax, tags, order))

    def norm_all(self, order):
        self._live("norm_all")
        return self._result(*norm(self, None, (), order))

    # ---- scans and segments (tags kept) ----
    def cumsum(self, tag: str):
        """Inclusive prefix sum along `tag`, serial left to right (bitwise deterministic)."""
        self._live("cumsum")
        return self._result(*cumsum(self, axes.axis_of(self.tags, tag, "cumsum")))

    def cumprod(self, tag: str):
        """Inclusive prefix product along `tag`, serial left to right."""
        self._live("cumprod")
        return self._result(*cumprod(self, axes.axis_of(self.tags, tag, "cumprod")))

    def segment_sum(self, tag: str, offsets):
        """out[k] = Σ x[offsets[k]:offsets[k+1]] along `tag` (which keeps its name, with size
        len(offsets) − 1); offsets: ints from 0 to the axis size, non-decreasing."""
        self._live("segment_sum")
        ax = axes.axis_of(self.tags, tag, "segment_sum")
        if hasattr(offsets, "_raw") and hasattr(offsets, "tags"):
            same_ctx("segment_sum", self, offsets)
            offsets = offsets.numpy()
        return self._result(*segment_sum(self, ax, offsets))

    def linear_recurrence(self, time_tag: str, decay, initial=None):
        """h[t] = decay[t]·h[t−1] + self[t] along `time_tag` (multiply, then add; serial);
        decay broadcasts into self by tag, initial (h[−1], default 0) into self minus time."""
        self._live("linear_recurrence")
        ax = axes.axis_of(self.tags, time_tag, "linear_recurrence")
        same_ctx("linear_recurrence", self, decay)
        if initial is not None:
            same_ctx("linear_recurrence", self, initial)
        return self._result(*linear_recurrence(self, ax, decay, initial))
