"""Reductions over one axis and over everything, in an order fixed by the problem size.

The input is viewed as [A, N, B] (materialised first if it is not contiguous). When the
reduced axis is long and there is little other parallelism, it is cut into segments whose
length depends on N alone; the partials are reduced by a second launch of the same family.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen import kernels
from ..codegen.reduce import BLOCK, ArgKey, FinishKey, ReduceKey, SegSpreadKey, acc_dtype
from ..codegen.target import host
from ..errors import DTypeError, InvalidShape, ShapeMismatch
from .elementwise import CHUNK, f32_bits, materialize, run
from .dtypes import ITEMSIZE
from .raw import RawTensor, contiguous_strides, numel

SEGMENT = 1 << 14      # elements per segment when a long axis is split
SPLIT_AT = 1 << 16     # axes at least this long are split
WORK_PER_CHUNK = 1 << 15

FLOATS = ("f32", "f16", "bf16")
MASKS = ("bool", "f32", "f16", "bf16")
# op -> dtypes it reduces (R-11: integer sums wrap in i64; a bool sum is a count)
DTYPES = {"sum": FLOATS + ("i64",), "max": FLOATS, "min": FLOATS, "prod": FLOATS,
          "count": FLOATS + ("i64", "bool")}


def _segment(N: int) -> int:
    return SEGMENT if N >= SPLIT_AT else N


def _seg_len(A: int, N: int, B: int) -> int:
    """The segment length of an [A, N, B] reduction: N unless the axis is long and there is
    little other parallelism (a function of the sizes only, never of the thread count)."""
    return _segment(N) if A * B < 64 else N


def _dims(x: RawTensor, axis: int):
    return numel(x.shape[:axis]), x.shape[axis], numel(x.shape[axis + 1:])


_kernels: dict = {}


def _kernel(*fields) -> tuple[int, str]:
    """(address, accumulator dtype) of ReduceKey(*fields), memoised on the plain tuple (a
    reduction is on every backward path: building and hashing the key each call is not free)."""
    hit = _kernels.get(fields)
    if hit is None:
        key = ReduceKey(*fields)
        hit = _kernels[fields] = (kernels.get(key), acc_dtype(key.op, key.in_dtype))
    return hit


def _launch(ctx, fields: tuple, x: RawTensor, A, N, B, C, divisor=1.0, mask=None, centre=None,
            offsets=None):
    """One pass of ReduceKey(*fields): reduce segments of length C (or the offsets' segments);
    returns the [A, S, B] partials."""
    addr, acc = _kernel(*fields)
    S = offsets.numel - 1 if offsets is not None else -(-N // C)
    inner = B == 1
    nblk = 1 if inner else -(-B // BLOCK)
    items = A * S * nblk
    work = (N // S if offsets is not None else C) * (1 if inner else min(B, BLOCK))
    per = max(1, WORK_PER_CHUNK // max(work, 1))
    out = ctx.empty((A, S, B), acc)
    ctx.launch(addr, -(-items // per), A * N * B * ITEMSIZE[x.dtype], x.addr, out.addr,
               A, N, B, C, S, per, f32_bits(divisor), 0 if mask is None else mask.addr,
               0 if centre is None else centre.addr, 0 if offsets is None else offsets.addr)
    return out


def check_dtype(op: str, x: RawTensor, name: str | None = None) -> None:
    if x.dtype not in DTYPES[op]:
        raise DTypeError(f"{name or op}: expected a tensor of dtype {' / '.join(DTYPES[op])}, "
                         f"got {x.dtype}")


def check_mask(op: str, x: RawTensor, mask: RawTensor) -> None:
    if mask.shape != x.shape:
        raise ShapeMismatch(f"{op}: expected a mask of shape {x.shape}, got {mask.shape}")
    if mask.dtype not in MASKS:
        raise DTypeError(f"{op}: expected a bool mask or a float mask read by truthiness, "
                         f"got {mask.dtype}")


def reduce_axis(ctx, op: str, x: RawTensor, axis: int, mean: bool = False, *, pre: str = "none",
                post: str = "none", divisor: float | None = None, mask: RawTensor | None = None,
                centre: RawTensor | None = None) -> RawTensor:
    """op over `axis`: sum | max | min | prod (f32 result; f16/bf16 widen, R-11) or count
    (i64: truthy elements, or zeros with pre="zero"); an i64 sum is an i64 (wrapping) sum.

    mean=True divides by N (post="div" with divisor=N). pre: what each element contributes
    (codegen/reduce.py PRE; "dev2" reads the per-lane `centre`, shaped like the result). post:
    "div" by `divisor` or "sqrt", applied once to the final value. mask: same shape as x;
    falsy elements contribute the identity."""
    check_dtype(op, x)
    A, N, B = _dims(x, axis)
    out_shape = x.shape[:axis] + x.shape[axis + 1:]
    if mean:
        post, divisor = "div", float(N)
    if A * N * B == 0:
        return _reduce_empty(ctx, op, x, axis, out_shape, post, 1.0 if divisor is None else divisor)
    x = materialize(ctx, x)
    if mask is not None:
        check_mask(op, x, mask)
        mask = materialize(ctx, mask)
    if centre is not None:
        centre = materialize(ctx, centre)
    divisor = 1.0 if divisor is None else divisor
    C = _seg_len(A, N, B)
    inner = B == 1
    mdt = mask.dtype if mask is not None else ""
    part = _launch(ctx, (op, x.dtype, post if C == N else "none", inner, pre, mdt), x, A, N, B, C,
                   divisor, mask, centre)
    if C != N:  # the partials, reduced by the same family (a count's partials are i64 sums)
        S = part.shape[1]
        part = _launch(ctx, ("sum" if op == "count" else op, part.dtype, post, inner), part,
                       A, S, B, S, divisor)
    return part.view(out_shape, contiguous_strides(out_shape), 0)


IDENTITY = {"sum": 0, "count": 0, "prod": 1}


def check_nonempty(op: str, x: RawTensor, axis: int) -> None:
    """max, min and their arg forms have no value over an empty axis (torch refuses them too)."""
    if x.shape[axis] == 0:
        raise InvalidShape(f"{op}: expected a non-empty axis to reduce, got size 0 "
                           f"(axis {axis} of shape {x.shape})")


def _reduce_empty(ctx, op, x, axis, out_shape, post, divisor) -> RawTensor:
    """A reduction with no work: an empty result, or (over an empty axis) the identity — a sum
    of nothing is 0, a product 1, and a mean 0/0 = nan."""
    if op not in IDENTITY:
        check_nonempty(op, x, axis)
    acc = acc_dtype(op, x.dtype)
    if 0 in out_shape:
        return ctx.empty(out_shape, acc)
    v = IDENTITY[op]
    if post == "div":
        v = v / divisor if divisor else math.nan
    elif post == "sqrt":
        v = math.sqrt(v)
    return ctx.full_raw(out_shape, v, acc)


def variance(ctx, x: RawTensor, axis: int, ddof: int) -> tuple[RawTensor, RawTensor]:
    """(Σ(x − μ)²/(n − ddof), μ) over `axis`: μ = Σx/n, then the deviations — two passes in a
    fixed order. An unsplit inner lane runs both in one kernel (it re-reads the lane from
    cache); otherwise μ is a launch of its own. The bits are the same either way."""
    check_dtype("max", x, "variance")  # floats only
    A, N, B = _dims(x, axis)
    if N == 0:  # torch: nan (0/0) per lane
        mu = reduce_axis(ctx, "sum", x, axis, mean=True)
        return mu, mu
    x = materialize(ctx, x)
    divisor = float(N - ddof)
    if B == 1 and _seg_len(A, N, B) == N:
        return reduce_axis(ctx, "sum", x, axis, pre="dev2mean", post="div", divisor=divisor), None
    mu = reduce_axis(ctx, "sum", x, axis, mean=True)
    return reduce_axis(ctx, "sum", x, axis, pre="dev2", centre=mu, post="div", divisor=divisor), mu


def reduce_all(ctx, op: str, x: RawTensor, mean: bool = False, **kw) -> RawTensor:
    """Reduce every element to a scalar (shape ())."""
    check_dtype(op, x)
    if x.numel == 1 and op in ("sum", "max", "min", "prod") and not kw:
        # one element: the sum (max, min, product) is itself and the mean x/1 is exact
        return run(ctx, "copy", acc_dtype(op, x.dtype), (), (x.view((), ()),))
    x = materialize(ctx, x)
    flat = x.view((numel(x.shape),), (1,))
    if kw.get("mask") is not None:
        kw["mask"] = materialize(ctx, kw["mask"]).view((numel(x.shape),), (1,))
    return reduce_axis(ctx, op, flat, 0, mean, **kw)


def segment_sum(ctx, x: RawTensor, axis: int, offsets: RawTensor) -> RawTensor:
    """out[.., k, ..] = sum of x[.., off[k]:off[k+1], ..] (offsets: validated i64, K+1 long)."""
    check_dtype("sum", x, "segment_sum")
    x = materialize(ctx, x)
    A, N, B = _dims(x, axis)
    K = offsets.numel - 1
    part = _launch(ctx, ("sum", x.dtype, "none", B == 1, "none", "", True), x, A, N, B, N,
                   offsets=offsets)
    shape = x.shape[:axis] + (K,) + x.shape[axis + 1:]
    return part.view(shape, contiguous_strides(shape), 0)


def segment_spread(ctx, g: RawTensor, axis: int, offsets: RawTensor, shape) -> RawTensor:
    """The backward of segment_sum: each segment's gradient broadcast over the segment."""
    g = materialize(ctx, g)
    A, K, B = _dims(g, axis)
    N = shape[axis]
    out = ctx.empty(tuple(shape), "f32")
    per = max(1, WORK_PER_CHUNK // max(1, (N // K) * B))
    ctx.launch(kernels.get(SegSpreadKey(B == 1)), -(-(A * K) // per), A * N * B * 8,
               out.addr, g.addr, offsets.addr, A, K, N, B, per)
    return out


def finish(ctx, mode: str, v: RawTensor | None, cnt: RawTensor, p=0.0) -> RawTensor:
    """Per-lane fix-ups by a selected count (codegen/reduce.py FinishKey): fill, mean, tof32."""
    vdtype = v.dtype if v is not None and mode == "fill" else "f32"
    out = ctx.empty(cnt.shape, vdtype)
    M = cnt.numel
    pbits = int(p) & 0xFFFFFFFFFFFFFFFF if vdtype == "i64" else f32_bits(float(p))
    ctx.launch(kernels.get(FinishKey(mode, vdtype)), -(-M // CHUNK), M * 16, out.addr,
               0 if v is None else materialize(ctx, v).addr, materialize(ctx, cnt).addr, pbits, M,
               CHUNK)
    return out


def arg_extreme(ctx, op: str, x: RawTensor, axis: int, mask: RawTensor | None = None,
                absval: bool = False) -> RawTensor:
    """i64 index along `axis` of the first max (op="max") or min; NaN counts as the extreme.
    With a mask only selected elements count (-1 where none is); absval compares |x|."""
    check_nonempty(f"arg{op}", x, axis)
    A, N, B = _dims(x, axis)
    out_shape = x.shape[:axis] + x.shape[axis + 1:]
    out = ctx.empty(out_shape, "i64")
    if A * B == 0:
        return out
    x = materialize(ctx, x)
    if mask is not None:
        mask = materialize(ctx, mask)
    W = host().f32_lanes
    items = A * -(-B // W)
    per = max(1, WORK_PER_CHUNK // (N * min(B, W)))
    key = ArgKey(op, x.dtype, mask.dtype if mask is not None else "", absval)
    ctx.launch(kernels.get(key), -(-items // per), A * N * B * 4,
               x.addr, out.addr, A, N, B, per, 0 if mask is None else mask.addr)
    return out


def offsets_raw(ctx, offsets, n: int, op: str = "segment_sum") -> RawTensor:
    """Validate segment offsets (0 = o_0 <= o_1 <= ... <= o_K = n, K >= 1) into an i64 tensor."""
    from ..errors import InvalidShape

    arr = np.asarray(offsets)
    if arr.ndim != 1 or arr.size < 2 or arr.dtype.kind not in "iu":
        raise InvalidShape(f"{op}: expected a 1-D sequence of at least 2 integer offsets, "
                           f"got {offsets!r}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or arr[-1] != n or np.any(np.diff(arr) < 0):
        raise InvalidShape(f"{op}: expected non-decreasing offsets from 0 to the axis size {n}, "
                           f"got {arr.tolist()[:8]}{'...' if arr.size > 8 else ''}")
    return ctx.from_numpy(arr, (arr.size,), "i64", op)
