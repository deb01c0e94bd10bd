"""Softmax family at the exec layer: rows [R, K] with the op axis contiguous, the options of
SPEC §3.9 already resolved to row geometry (the autograd layer permutes and validates).

A work item is a run of whole rows (how many depends on K alone), so results never depend on
the thread count.
"""
from __future__ import annotations

import math

from ..codegen import kernels
from ..codegen.softmax import MASK_DIMS, SoftmaxKey
from .elementwise import f32_bits, run
from .raw import RawTensor, numel

WORK_PER_CHUNK = 1 << 15


def _per(K: int) -> int:
    return max(1, WORK_PER_CHUNK // max(K, 1))


def _inner(shape, pos: int) -> int:
    return numel(shape[pos + 1:])


def mask_dims(outer_shape, strides):
    """Coalesce the outer axes of a mask view: drop size-1 axes, merge neighbours the mask walks
    contiguously (or broadcasts over both). -> [(inner, dim, stride)] outermost first, where
    inner = the number of rows one step of that axis spans."""
    dims = [(d, s) for d, s in zip(outer_shape, strides) if d != 1]
    merged = []
    for d, s in dims:
        if merged and merged[-1][1] == s * d:
            pd, _ = merged[-1]
            merged[-1] = (pd * d, s)
        else:
            merged.append((d, s))
    out, inner = [], 1
    for d, s in reversed(merged):
        out.append((inner, d, s))
        inner *= d
    return out[::-1]


def softmax(ctx, x: RawTensor, outer_shape, scale: float, mask=None, slopes=None, sinks=None,
            head=None, causal=None) -> RawTensor:
    """Softmax of contiguous rows x [R, K] (R = prod(outer_shape)).

    mask: None or a view of shape outer_shape + (K,) (zero strides where it broadcasts) of an
    f32/f16/bf16 tensor whose row axis stride is 1 or 0; slopes/sinks: None or f32 [H] raws;
    head: position of the head axis in outer_shape (needed by slopes/sinks, else None);
    causal: (position of the query axis in outer_shape, source offset) or None."""
    R, K = x.shape
    out = ctx.empty((R, K), "f32")
    if R * K == 0:  # nothing to normalise: no launch
        return out
    geo = [0] * (3 * MASK_DIMS)
    mdt, mcol, maddr = "none", "unit", 0
    if mask is not None:
        mdt = mask.dtype
        mcol = "zero" if mask.strides[-1] == 0 else "unit"
        dims = mask_dims(outer_shape, mask.strides[:-1])
        if len(dims) > MASK_DIMS:  # a pathological broadcast pattern: spell the mask out
            full = run(ctx, "copy", mdt, mask.shape, [mask])
            mcol = "unit"
            dims = [(1, R, K)]
            mask = full
        geo = [1, 1, 0] * MASK_DIMS
        for i, d in enumerate(dims):
            geo[3 * i:3 * i + 3] = d
        maddr = mask.addr
    hin, H = (1, 1) if head is None else (_inner(outer_shape, head), outer_shape[head])
    qin, Q, off = (1, 1, 0) if causal is None else (_inner(outer_shape, causal[0]),
                                                    outer_shape[causal[0]], causal[1])
    key = SoftmaxKey("softmax", mdt, mcol, slopes is not None, sinks is not None, causal is not None)
    per = _per(K)
    ctx.launch(kernels.get(key), -(-R // per), R * K * 4 * (2 if mask is None else 3),
               x.addr, out.addr, maddr, 0 if slopes is None else slopes.addr,
               0 if sinks is None else sinks.addr, R, K, f32_bits(scale), per, *geo,
               hin, H, qin, Q, off)
    return out


def _rows_op(ctx, op: str, out_shape, x_shape, bytes_per, ins, after) -> RawTensor:
    """Launch a plain row kernel: argument block = the inputs' addresses, the new output's,
    rows, row length, `after`, rows per chunk."""
    R, K = x_shape
    if R * K == 0:  # no launch; the log of an empty sum (logsumexp over K == 0) is -inf
        return ctx.empty(out_shape, "f32") if 0 in out_shape else ctx.full_raw(out_shape, -math.inf)
    out = ctx.empty(out_shape, "f32")
    per = _per(K)
    ctx.launch(kernels.get(SoftmaxKey(op)), -(-R // per), R * K * bytes_per,
               *[t.addr for t in ins], out.addr, R, K, *after, per)
    return out


def softmax_backward(ctx, y: RawTensor, g: RawTensor, scale: float) -> RawTensor:
    """dx = (y * (g - sum(g*y))) * scale per row; y, g contiguous [R, K]."""
    return _rows_op(ctx, "softmax_bwd", y.shape, y.shape, 12, (y, g), (f32_bits(scale),))


def log_softmax(ctx, x: RawTensor) -> RawTensor:
    """(x - m) - log sum exp(x - m) per row, m shifted to 0 when not finite."""
    return _rows_op(ctx, "log_softmax", x.shape, x.shape, 8, (x,), ())


def log_softmax_backward(ctx, y: RawTensor, g: RawTensor) -> RawTensor:
    """dx = g - exp(y) * sum g per row."""
    return _rows_op(ctx, "log_softmax_bwd", y.shape, y.shape, 12, (y, g), ())


def logsumexp(ctx, x: RawTensor) -> RawTensor:
    """log sum exp(x - m) + m per row -> [R]; m shifted to 0 when not finite."""
    return _rows_op(ctx, "logsumexp", (x.shape[0],), x.shape, 4, (x,), ())


def logsumexp_backward(ctx, x: RawTensor, lse: RawTensor, g: RawTensor) -> RawTensor:
    """dx = g[r] * exp(x - lse[r]); g contiguous [R]."""
    return _rows_op(ctx, "logsumexp_bwd", x.shape, x.shape, 8, (x, lse, g), ())
