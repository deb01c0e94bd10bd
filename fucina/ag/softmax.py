"""The softmax family with its backward rules (SPEC §3.9): softmax (scale, additive mask, ALiBi,
sinks, causal), log_softmax and logsumexp.

Kernels see rows [R, K] with the op axis last and contiguous: the operand is permuted so the op
axis comes last (the other axes keep their order) and materialised when that is not already its
layout; results are permuted back. Backward rules run on the same rows.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from .. import axes
from ..errors import (DTypeError, InvalidArgumentType, InvalidShape, ShapeMismatch,
                      UnsupportedGradient)
from ..exec import elementwise as ew
from ..exec import softmax as exs
from ..exec.raw import contiguous_strides, numel
from .checks import real, same_ctx
from .engine import finish_op, needs_graph

CAUSAL_KEYS = ("query_tag", "source_offset")


# ---------------------------------------------------------------------------------------------
# row layout

def to_rows(ctx, r, ax: int):
    """(perm, rows [R, K]): the op axis `ax` last, other axes in their order, contiguous."""
    perm = [i for i in range(r.rank) if i != ax] + [ax]
    K = r.shape[ax]
    rows = ew.materialize(ctx, r.permute(perm))
    return perm, rows.view((numel(r.shape[:ax] + r.shape[ax + 1:]), K), (K, 1))


def rows_of(ctx, g, perm):
    """A gradient in the operand's layout as contiguous rows [R, K] (same perm)."""
    K = g.shape[perm[-1]]
    rows = ew.materialize(ctx, g.permute(perm))
    return rows.view((numel(tuple(g.shape[i] for i in perm[:-1])), K), (K, 1))


def from_rows(ctx, rows, shape, perm):
    """Rows [R, K] back to the operand's layout `shape` (a view when perm is the identity)."""
    permuted = tuple(shape[i] for i in perm)
    v = rows.view(permuted, contiguous_strides(permuted))
    if perm == sorted(perm):
        return v
    inv = [perm.index(i) for i in range(len(shape))]
    return ew.materialize(ctx, v.permute(inv))


def _check_f32(op, r):
    if r.dtype != "f32":
        raise DTypeError(f"{op}: expected an f32 tensor, got {r.dtype}")


# ---------------------------------------------------------------------------------------------
# softmax

def _alibi_slopes(max_bias: float, H: int) -> np.ndarray:
    """SPEC §3.9: h2 = largest power of two <= H; m0 = 2^(-max_bias/h2), m1 = 2^(-(max_bias/2)/h2);
    head i: i < h2 -> m0^(i+1), else m1^(2(i-h2)+1); every step in float32."""
    h2 = 1 << (H.bit_length() - 1)
    f = np.float32
    two = f(2.0)
    m0 = two ** (-(f(max_bias) / f(h2)))
    m1 = two ** (-((f(max_bias) / f(2.0)) / f(h2)))
    out = [m0 ** f(i + 1) if i < h2 else m1 ** f(2 * (i - h2) + 1) for i in range(H)]
    return np.array(out, np.float32)


def _sink_values(sinks) -> np.ndarray:
    if hasattr(sinks, "_live"):
        if needs_graph(sinks):
            raise UnsupportedGradient("softmax: sinks contribute no gradient; expected a constant, "
                                      "got a tensor that requires grad")
        arr = sinks._live("softmax").to_numpy()
    else:
        arr = np.asarray(sinks)
    if arr.dtype.kind not in "fiu":
        raise InvalidArgumentType(f"softmax: expected sinks as real numbers, got dtype {arr.dtype}")
    return arr.astype(np.float32).reshape(-1)


def _causal(causal, tags, shape, tag, ax):
    if not isinstance(causal, dict):
        raise InvalidArgumentType(f"softmax: expected causal as a dict with 'query_tag' (and optional "
                        f"'source_offset'), got {type(causal).__name__}")
    unknown = sorted(set(causal) - set(CAUSAL_KEYS))
    if unknown:
        raise InvalidArgumentType(f"softmax: unknown causal option(s) {unknown}; expected keys {CAUSAL_KEYS}")
    if "query_tag" not in causal:
        raise InvalidArgumentType("softmax: causal needs 'query_tag'")
    q = causal["query_tag"]
    qa = axes.axis_of(tags, q, "softmax")
    off = causal.get("source_offset", 0)
    if isinstance(off, bool) or not isinstance(off, numbers.Integral):
        raise InvalidArgumentType(f"softmax: expected an integer causal source_offset, got {off!r}")
    off = int(off)
    if qa == ax:
        raise InvalidShape(f"softmax: causal query_tag {q!r} is the softmax axis; expected another axis")
    if off < 0:
        raise InvalidShape(f"softmax: expected causal source_offset >= 0, got {off}")
    if off + shape[qa] > shape[ax]:
        raise InvalidShape(f"softmax: causal needs source_offset + dim({q!r}) <= dim({tag!r}); "
                           f"got {off} + {shape[qa]} > {shape[ax]}")
    return q, off


def _check_mask(x, mask):
    """The mask's dtype, and A-2 alignment that must land exactly on self's tags and shape."""
    m = mask._live("softmax")
    if m.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"softmax: expected an f32/f16/bf16 additive mask, got {m.dtype}")
    out_tags, out_shape, _, _ = axes.pointwise("softmax", x.tags, x._raw.shape, mask.tags, m.shape)
    if out_tags != x.tags or out_shape != x._raw.shape:
        raise ShapeMismatch(f"softmax: mask {mask.tags}{m.shape} does not broadcast into self's "
                            f"shape {x.tags}{x._raw.shape}")
    return m


def _mask_view(ctx, m, mask_tags, row_tags, row_shape):
    """The mask laid out for the rows: its own axes in row order (materialised), viewed at the
    row shape with zero strides where it broadcasts."""
    own = [t for t in row_tags if t in mask_tags]
    mm = ew.materialize(ctx, m.permute([mask_tags.index(t) for t in own]))
    strides = []
    for t, d in zip(row_tags, row_shape):
        if t in own and mm.shape[own.index(t)] == d and d != 1:
            strides.append(mm.strides[own.index(t)])
        else:
            strides.append(0)
    if row_shape[-1] == 1 and row_tags[-1] in own:
        strides[-1] = 1  # a single-column row: read the one value as a unit-stride vector
    return mm.view(row_shape, strides)


def softmax(x, tag, scale, mask, max_bias, head_tag, sinks, causal):
    """Validate everything (tags first, then extents), then one kernel over the rows."""
    op = "softmax"
    r = x._live(op)
    ctx = r.ctx
    ax = axes.axis_of(x.tags, tag, op)
    if head_tag is not None:
        hax = axes.axis_of(x.tags, head_tag, op)
    cz = _causal(causal, x.tags, r.shape, tag, ax) if causal is not None else None
    scale = real(op, scale)
    max_bias = real(op, max_bias)
    if head_tag is not None and hax == ax:
        raise InvalidShape(f"softmax: head_tag {head_tag!r} is the softmax axis; expected another axis")
    m = None
    if mask is not None:
        same_ctx(op, x, mask)
        if needs_graph(mask):
            raise UnsupportedGradient("softmax: the mask contributes no gradient; expected a constant "
                                      "mask, got one that requires grad")
        m = _check_mask(x, mask)
    _check_f32(op, r)
    if not max_bias >= 0 or not np.isfinite(max_bias):
        raise InvalidShape(f"softmax: expected a finite max_bias >= 0, got {max_bias}")
    if max_bias > 0 and (mask is None or head_tag is None):
        raise InvalidShape("softmax: ALiBi (max_bias > 0) needs both mask and head_tag")
    H = r.shape[hax] if head_tag is not None else 1
    sv = None
    if sinks is not None:
        sv = _sink_values(sinks)
        if head_tag is None and sv.size != 1:
            raise InvalidShape(f"softmax: {sv.size} sinks need head_tag (one sink per head); "
                               f"without it expected exactly 1 sink")
        if sv.size != H:
            raise InvalidShape(f"softmax: expected {H} sinks (one per {head_tag!r} head), got {sv.size}")
    # compute
    perm, rows = to_rows(ctx, r, ax)
    row_tags = tuple(x.tags[i] for i in perm)
    row_shape = tuple(r.shape[i] for i in perm)
    mview = _mask_view(ctx, m, mask.tags, row_tags, row_shape) if mask is not None else None
    slopes = ctx.from_numpy(_alibi_slopes(max_bias, H), (H,), "f32", op) if max_bias > 0 else None
    sink_raw = ctx.from_numpy(sv, (H,), "f32", op) if sv is not None else None
    per_head = slopes is not None or sink_raw is not None
    head = row_tags.index(head_tag) if per_head and head_tag is not None else None
    causal_geo = (row_tags.index(cz[0]), cz[1]) if cz is not None else None
    y = exs.softmax(ctx, rows, row_shape[:-1], scale, mview, slopes, sink_raw, head, causal_geo)
    out = from_rows(ctx, y, r.shape, perm)
    saved = (ctx, y, scale, perm, r.shape)
    return finish_op(op, out, x.tags, (x,), lambda needs: functools.partial(_softmax_grads, saved))


def _softmax_grads(saved, g):
    ctx, y, scale, perm, shape = saved
    dx = exs.softmax_backward(ctx, y, rows_of(ctx, g, perm), scale)
    return (from_rows(ctx, dx, shape, perm),)


# ---------------------------------------------------------------------------------------------
# log_softmax, logsumexp

def log_softmax(x, tag):
    op = "log_softmax"
    r = x._live(op)
    ctx = r.ctx
    ax = axes.axis_of(x.tags, tag, op)
    _check_f32(op, r)
    perm, rows = to_rows(ctx, r, ax)
    y = exs.log_softmax(ctx, rows)
    out = from_rows(ctx, y, r.shape, perm)
    saved = (ctx, y, perm, r.shape)
    return finish_op(op, out, x.tags, (x,), lambda needs: functools.partial(_log_softmax_grads, saved))


def _log_softmax_grads(saved, g):
    ctx, y, perm, shape = saved
    dx = exs.log_softmax_backward(ctx, y, rows_of(ctx, g, perm))
    return (from_rows(ctx, dx, shape, perm),)


def logsumexp(x, tag):
    op = "logsumexp"
    r = x._live(op)
    ctx = r.ctx
    ax, rest = axes.reduced(x.tags, tag, op)
    _check_f32(op, r)
    perm, rows = to_rows(ctx, r, ax)
    lse = exs.logsumexp(ctx, rows)
    rest_shape = r.shape[:ax] + r.shape[ax + 1:]
    out = lse.view(rest_shape, contiguous_strides(rest_shape))
    saved = (ctx, rows, lse, perm, r.shape)
    return finish_op(op, out, rest, (x,), lambda needs: functools.partial(_logsumexp_grads, saved))


def _logsumexp_grads(saved, g):
    ctx, rows, lse, perm, shape = saved
    gr = ew.materialize(ctx, g).view((rows.shape[0],), (1,))
    dx = exs.logsumexp_backward(ctx, rows, lse, gr)
    return (from_rows(ctx, dx, shape, perm),)


class SoftmaxMethods:
    """Tensor methods of the softmax family (SPEC §3.9)."""

    __slots__ = ()

    def softmax(self, tag: str, *, scale: float = 1.0, mask=None, max_bias: float = 0.0,
                head_tag: str | None = None, sinks=None, causal=None):
        """Max-shifted softmax over `tag` of z = x*scale + slope*mask (slope 1 unless ALiBi).

        mask: additive, broadcast into self's shape by tags (no gradient); max_bias > 0: ALiBi
        slopes per `head_tag` head; sinks: one extra logit per head (joins max and denominator);
        causal={"query_tag": q, "source_offset": o}: query row i normalizes over [0, o + i],
        the rest is exactly 0."""
        return self._result(*softmax(self, tag, scale, mask, max_bias, head_tag, sinks, causal))

    def log_softmax(self, tag: str):
        """x - logsumexp(x) over `tag`, computed as (x - m) - log sum exp(x - m)."""
        return self._result(*log_softmax(self, tag))

    def logsumexp(self, tag: str):
        """m + log sum exp(x - m) over `tag` (removed); m shifted to 0 when it is +-inf."""
        return self._result(*logsumexp(self, tag))
