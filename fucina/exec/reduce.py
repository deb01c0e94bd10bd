"""Reductions over one axis and over everything, in an order fixed by the problem size.

The input is viewed as [A, N, B] (materialised first if it is not contiguous). When the
reduced axis is long and there is little other parallelism, it is cut into segments whose
length depends on N alone; the partials are reduced by a second launch of the same family.
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.reduce import BLOCK, ArgKey, ReduceKey
from ..codegen.target import host
from ..errors import DTypeError
from .elementwise import f32_bits, materialize, run
from .dtypes import ITEMSIZE
from .raw import RawTensor, contiguous_strides, numel

SEGMENT = 1 << 14      # elements per segment when a long axis is split
SPLIT_AT = 1 << 16     # axes at least this long are split
WORK_PER_CHUNK = 1 << 15


def _segment(N: int) -> int:
    return SEGMENT if N >= SPLIT_AT else N


def _launch(ctx, op, dtype, post, x_addr, A, N, B, C, divisor, itemsize):
    """One pass: reduce segments of length C; returns the [A, S, B] f32 partials."""
    S = -(-N // C)
    inner = B == 1
    nblk = 1 if inner else -(-B // BLOCK)
    items = A * S * nblk
    work = C * (1 if inner else min(B, BLOCK))
    per = max(1, WORK_PER_CHUNK // max(work, 1))
    out = ctx.empty((A, S, B), "f32")
    addr = kernels.get(ReduceKey(op, dtype, post, inner))
    ctx.launch(addr, -(-items // per), A * N * B * itemsize, x_addr, out.addr,
               A, N, B, C, S, per, f32_bits(divisor))
    return out


def reduce_axis(ctx, op: str, x: RawTensor, axis: int, mean: bool = False) -> RawTensor:
    """sum | max | min (| mean with op="sum", mean=True) over `axis`; f32 result (R-11)."""
    if x.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"{op}: expected a float tensor (f32, f16, bf16), got {x.dtype}")
    x = materialize(ctx, x)
    A = numel(x.shape[:axis])
    N = x.shape[axis]
    B = numel(x.shape[axis + 1:])
    out_shape = x.shape[:axis] + x.shape[axis + 1:]
    post = "div" if mean else "none"
    C = _segment(N) if A * B < 64 else N
    part = _launch(ctx, op, x.dtype, post if C == N else "none", x.addr, A, N, B, C, float(N),
                   ITEMSIZE[x.dtype])
    if C != N:
        S = part.shape[1]
        part = _launch(ctx, op, "f32", post, part.addr, A, S, B, S, float(N), 4)
    return part.view(out_shape, contiguous_strides(out_shape), 0)


def reduce_all(ctx, op: str, x: RawTensor, mean: bool = False) -> RawTensor:
    """Reduce every element to a scalar (shape ())."""
    if x.numel == 1:  # one element: the sum is itself and the mean x/1 is exact
        return run(ctx, "copy", "f32", (), (x.view((), ()),))
    x = materialize(ctx, x)
    flat = x.view((numel(x.shape),), (1,))
    return reduce_axis(ctx, op, flat, 0, mean)


def arg_extreme(ctx, op: str, x: RawTensor, axis: int) -> RawTensor:
    """i64 index along `axis` of the first max (op="max") or min; NaN counts as the extreme."""
    x = materialize(ctx, x)
    A, N, B = numel(x.shape[:axis]), x.shape[axis], numel(x.shape[axis + 1:])
    out_shape = x.shape[:axis] + x.shape[axis + 1:]
    out = ctx.empty(out_shape, "i64")
    W = host().f32_lanes
    items = A * -(-B // W)
    per = max(1, WORK_PER_CHUNK // (N * min(B, W)))
    ctx.launch(kernels.get(ArgKey(op, x.dtype)), -(-items // per), A * N * B * 4,
               x.addr, out.addr, A, N, B, per)
    return out
