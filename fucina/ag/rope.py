"""Rotary position embeddings (SPEC §3.11): `RopeTable` (prepared once per context, built by a
generated kernel in f32 exactly as SPEC defines it), `RopeTheta` (on-the-fly source) and the
`rope` op in half / interleaved / interleaved_tail modes, with partial rotary spans and negative
positions. Backward is the inverse rotation of g (angle negated); differentiable in self only.

The kernel sees rows [R, F]: self permuted to (position_tag, other axes in order, feature_tag)
and materialised when that is not already its layout; results are permuted back.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import axes
from ..errors import (ContextMismatch, DTypeError, InvalidArgument, InvalidArgumentType,
                      InvalidShape, ShapeMismatch, TagError)
from ..exec import elementwise as ew
from ..exec import rope as exr
from .checks import real
from .engine import finish_op
from .softmax import from_rows, rows_of

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


class RopeTable:
    """cos/sin tables [positions, pairs] (f32, row-major) of one context; read-only.

    Attributes: positions (tuple of int), feature_dim (D), pairs (D/2), theta_base, inverse."""

    __slots__ = ("ctx", "positions", "feature_dim", "pairs", "theta_base", "inverse", "_cos", "_sin")

    def __init__(self, ctx, positions, feature_dim, theta_base, inverse, cos, sin):
        self.ctx, self.positions, self.feature_dim = ctx, positions, feature_dim
        self.pairs, self.theta_base, self.inverse = feature_dim // 2, theta_base, inverse
        self._cos, self._sin = cos, sin

    def cos(self):
        """A numpy copy of the cos table [positions, pairs]."""
        return self._cos.to_numpy()

    def sin(self):
        """A numpy copy of the (signed) sin table [positions, pairs]."""
        return self._sin.to_numpy()

    def __repr__(self):
        return (f"RopeTable(positions={len(self.positions)}, feature_dim={self.feature_dim}, "
                f"theta_base={self.theta_base}, inverse={self.inverse})")


@dataclass(frozen=True)
class RopeTheta:
    """On-the-fly RoPE source: full rotation, D = dim(feature_tag)."""

    positions: tuple
    theta_base: float


def _positions(op, positions):
    try:
        pos = list(positions)
    except TypeError:
        raise InvalidArgumentType(f"{op}: expected positions as a sequence of ints, got "
                        f"{type(positions).__name__}") from None
    out = []
    for p in pos:
        if isinstance(p, bool) or not isinstance(p, numbers.Integral):
            raise InvalidArgumentType(f"{op}: expected integer positions, got {p!r}")
        p = int(p)
        if not INT32_MIN <= p <= INT32_MAX:
            raise InvalidShape(f"{op}: position {p} does not fit in int32")
        out.append(p)
    if not out:
        raise InvalidShape(f"{op}: expected at least one position, got none")
    return tuple(out)


def prepare_rope_table(ctx, positions, feature_dim, theta_base, inverse=False, freq_factors=None):
    """SPEC §3.11 `ctx.prepare_rope_table`: cos/sin tables for `positions` (int32), rotary span
    `feature_dim` (even), pw[i] = powf(theta_base, f32(2i)/f32(D)), theta = f32(p)/pw[i]
    (/ freq_factors[i]), sin negated iff `inverse`. Every step in f32, in a generated kernel."""
    op = "prepare_rope_table"
    pos = _positions(op, positions)
    if isinstance(feature_dim, bool) or not isinstance(feature_dim, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an integer feature_dim, got {feature_dim!r}")
    D = int(feature_dim)
    if D <= 0 or D % 2:
        raise InvalidShape(f"{op}: expected a positive even feature_dim, got {D}")
    theta = real(op, theta_base)
    if not (math.isfinite(theta) and theta > 0):
        raise InvalidShape(f"{op}: expected a finite theta_base > 0, got {theta}")
    if not isinstance(inverse, bool):
        raise InvalidArgumentType(f"{op}: expected inverse as a bool, got {inverse!r}")
    ff = None
    if freq_factors is not None:
        ff = [real(op, f) for f in freq_factors]
        if len(ff) != D // 2:
            raise ShapeMismatch(f"{op}: expected {D // 2} freq_factors (one per pair), got {len(ff)}")
    cs, sn = exr.table(ctx, pos, D, theta, inverse, ff)
    return RopeTable(ctx, pos, D, theta, inverse, cs, sn)


def prepare_rope_table_inv_freqs_f64(ctx, pos0, count, inv_freq, inverse=False):
    """A table for positions pos0 .. pos0 + count - 1 from per-pair inverse frequencies given in
    f64 (schedules the f32 construction cannot rebuild, e.g. YaRN blends): angle = f64(p) ·
    inv_freq[i] in f64, sin and cos in f64, each rounded once to f32; sin negated iff inverse.
    The rotary span is 2·len(inv_freq). Host-side: a table is built once per run."""
    op = "prepare_rope_table_inv_freqs_f64"
    for what, v in (("pos0", pos0), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidArgumentType(f"{op}: expected an integer {what}, got {v!r}")
    if count < 1:
        raise InvalidShape(f"{op}: expected count >= 1, got {count}")
    pos = _positions(op, range(int(pos0), int(pos0) + int(count)))
    freqs = np.asarray([real(op, f) for f in inv_freq], dtype=np.float64)
    if freqs.size == 0:
        raise InvalidShape(f"{op}: expected at least one inverse frequency, got none")
    if not isinstance(inverse, bool):
        raise InvalidArgumentType(f"{op}: expected inverse as a bool, got {inverse!r}")
    angle = np.asarray(pos, dtype=np.float64)[:, None] * freqs[None, :]
    sn = np.sin(angle).astype(np.float32)
    cs = np.cos(angle).astype(np.float32)
    if inverse:
        sn = -sn
    shape = (len(pos), freqs.size)
    return RopeTable(ctx, pos, 2 * freqs.size, 0.0, inverse, ctx.from_numpy(cs, shape, "f32", op),
                     ctx.from_numpy(sn, shape, "f32", op))


def yarn_blend_inv_freqs_f64(dim, base, factor, orig_ctx):
    """DeepSeek-family YaRN inverse frequencies in f64: the plain schedule base^(-2i/dim),
    blended toward freq/factor across the correction ramp between 32 and 1 rotations of the
    original context. factor <= 1 or orig_ctx == 0 gives the plain schedule. (The magnitude
    correction, mscale, belongs to the attention scale.) Returns a list of floats."""
    op = "yarn_blend_inv_freqs_f64"
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
        raise InvalidShape(f"{op}: expected a positive even dim, got {dim!r}")
    base, factor = real(op, base), real(op, factor)
    pairs = dim // 2
    freq = [base ** -((2 * i) / dim) for i in range(pairs)]
    if factor > 1.0 and orig_ctx > 0:
        def dim_for(rotations):
            return dim * math.log(orig_ctx / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))
        low = max(math.floor(dim_for(32.0)), 0.0)
        high = min(math.ceil(dim_for(1.0)), dim - 1.0)
        for i, f in enumerate(freq):
            ramp = min(max((i - low) / max(high - low, 0.001), 0.0), 1.0)
            keep = 1.0 - ramp   # the fast-rotating pairs keep their original frequency
            freq[i] = (f / factor) * (1.0 - keep) + f * keep
    return freq


def prepare_rope_table_range(ctx, axis_range, feature_dim, theta_base, inverse=False,
                             freq_factors=None):
    """prepare_rope_table over positions origin .. origin + len - 1 of an AxisRange (any object
    with integer `origin` and `len`); bitwise identical to the explicit list form."""
    origin, n = axis_range.origin, axis_range.len
    return prepare_rope_table(ctx, range(origin, origin + n), feature_dim, theta_base, inverse,
                              freq_factors)


def rope(x, position_tag, feature_tag, source, mode):
    op = "rope"
    r = x._live(op)
    ctx = r.ctx
    pax = axes.axis_of(x.tags, position_tag, op)
    fax = axes.axis_of(x.tags, feature_tag, op)
    if pax == fax:
        raise TagError(f"{op}: position_tag and feature_tag are the same axis {position_tag!r}")
    if not isinstance(mode, str) or mode not in exr.MODES:
        raise InvalidArgument(f"{op}: expected mode one of {exr.MODES}, got {mode!r}")
    if r.dtype != "f32":
        raise DTypeError(f"{op}: expected an f32 tensor, got {r.dtype}")
    P, F = r.shape[pax], r.shape[fax]
    if isinstance(source, RopeTable):
        if source.ctx is not ctx:
            raise ContextMismatch(f"{op}: the RopeTable belongs to a different ExecContext")
        table = source
    elif isinstance(source, RopeTheta):
        table = None
    else:
        raise InvalidArgumentType(f"{op}: expected source as a RopeTable or RopeTheta, got {type(source).__name__}")
    if table is None:
        pos = _positions(op, source.positions)
        if len(pos) != P:
            raise ShapeMismatch(f"{op}: expected {P} positions (dim({position_tag!r})), got {len(pos)}")
        if F % 2:
            raise InvalidShape(f"{op}: RopeTheta rotates all of {feature_tag!r}; expected an even "
                               f"dim, got {F}")
        table = prepare_rope_table(ctx, pos, F, source.theta_base)
    if len(table.positions) != P:
        raise ShapeMismatch(f"{op}: table has {len(table.positions)} positions, expected {P} "
                            f"(dim({position_tag!r}))")
    D = table.feature_dim
    if D > F:
        raise ShapeMismatch(f"{op}: rotary span {D} exceeds dim({feature_tag!r}) = {F}")
    start = F - D if mode == "interleaved_tail" else 0
    perm = [pax] + [i for i in range(r.rank) if i not in (pax, fax)] + [fax]
    R = r.numel // F
    rows = ew.materialize(ctx, r.permute(perm)).view((R, F), (F, 1))
    y = exr.apply(ctx, rows, R // P, table._cos, table._sin, start, mode, False)
    out = from_rows(ctx, y, r.shape, perm)
    saved = (ctx, table, R // P, start, mode, perm, r.shape)
    return finish_op(op, out, x.tags, (x,), lambda needs: functools.partial(_rope_grads, saved))


def _rope_grads(saved, g):
    ctx, table, M, start, mode, perm, shape = saved
    dx = exr.apply(ctx, rows_of(ctx, g, perm), M, table._cos, table._sin, start, mode, True)
    return (from_rows(ctx, dx, shape, perm),)


class RopeMethods:
    """Tensor methods of RoPE (SPEC §3.11)."""

    __slots__ = ()

    def rope(self, position_tag: str, feature_tag: str, source, mode: str):
        """Rotate feature pairs by position: `half` pairs (x[i], x[i + D/2]), `interleaved`
        (x[2i], x[2i+1]), `interleaved_tail` interleaved within the trailing D features; D is
        the table's feature_dim (RopeTable) or dim(feature_tag) (RopeTheta); other features pass
        through. first' = first*cos - second*sin, second' = first*sin + second*cos. Backward:
        the inverse rotation."""
        return self._result(*rope(self, position_tag, feature_tag, source, mode))
