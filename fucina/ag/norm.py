"""Normalization with its backward rules (SPEC §3.10): layer_norm, rms_norm, rms_norm_mul,
rms_norm_mul_add, standardize_axis, l2_normalize, group_norm and snake, differentiable in every
tensor operand.

One fused row kernel per direction: the forward saves per-row statistics (mean, 1/denominator,
std for eps outside the sqrt), the backward is one pass per row plus the weight/bias sums over
rows (per-chunk partials over a fixed row grid, folded in chunk order). Rows are laid out as in
ag/softmax.py: the normalized axis last and contiguous. group_norm has its own kernels that
read [*batch, time, channel] in place (statistics, then one normalize + affine pass; backward
likewise), the whole batch in one set of launches.
"""
from __future__ import annotations

import functools
import numbers

from .. import axes
from ..errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidShape, ShapeMismatch,
                      TagError)
from ..exec import elementwise as ew
from ..exec import norm as exn
from .checks import real, require_scope, same_ctx
from .engine import finish_op
from .rope import RopeTable
from .softmax import from_rows, rows_of, to_rows

EPS_MODES = {"outside_sqrt": "outside", "inside_sqrt": "inside"}
ACCUMULATIONS = ("f32", "f64")


def _f32(op, what, r):
    if r.dtype != "f32":
        raise DTypeError(f"{op}: expected an f32 {what}, got {r.dtype}")


def _param(op, what, x, p, tag, K, strict: bool):
    """A rank-1 weight/bias of length K: tagged (tag,), or (strict=False) any single tag."""
    same_ctx(op, x, p)
    r = p._live(op)
    if r.rank != 1 or (strict and p.tags != (tag,)):
        raise TagError(f"{op}: expected {what} tagged ({tag!r},), got tags {p.tags}")
    if r.shape[0] != K:
        raise ShapeMismatch(f"{op}: expected {what} of length {K} (dim of {tag!r}), got {r.shape[0]}")
    _f32(op, what, r)
    return ew.materialize(r.ctx, r)  # the kernels read it with unit stride


def normalize(op, x, tag, spec: exn.NormSpec, weight=None, bias=None, residual=None,
              strict_tags: bool = False):
    """The shared body: validate, lay out rows, run the forward, record the backward."""
    r = x._live(op)
    ctx = r.ctx
    ax = axes.axis_of(x.tags, tag, op)
    K = r.shape[ax]
    rv = None
    if residual is not None:
        same_ctx(op, x, residual)
        rr = residual._live(op)
        if set(residual.tags) != set(x.tags) or len(residual.tags) != len(x.tags):
            raise TagError(f"{op}: expected residual with self's tags {x.tags}, got {residual.tags}")
        rv = rr.permute([residual.tags.index(t) for t in x.tags])  # in self's axis order
    wr = _param(op, "weight", x, weight, tag, K, strict_tags) if weight is not None else None
    br = _param(op, "bias", x, bias, tag, K, strict_tags) if bias is not None else None
    if rv is not None and rv.shape != r.shape:
        raise ShapeMismatch(f"{op}: expected residual of shape {r.shape} (self's), got {rv.shape} "
                            f"in self's axis order")
    _f32(op, "tensor", r)
    if rv is not None:
        _f32(op, "residual", rv)
    perm, rows = to_rows(ctx, r, ax)
    res_rows = rows_of(ctx, rv, perm) if rv is not None else None
    y, stats = exn.forward(ctx, spec, rows, wr, br, res_rows)
    out = from_rows(ctx, y, r.shape, perm)
    operands = (x, weight, bias, residual)
    rperm = None if residual is None else [x.tags.index(t) for t in residual.tags]
    saved = (ctx, spec, rows, stats, wr, br is not None, perm, r.shape, rperm)
    return finish_op(op, out, x.tags, operands,
                     lambda needs: functools.partial(_grads, saved, needs))


def _grads(saved, needs, g):
    ctx, spec, rows, stats, wr, has_bias, perm, shape, rperm = saved
    gr = rows_of(ctx, g, perm)
    dx, dw, db = exn.backward(ctx, spec, rows, gr, stats, wr, has_bias,
                              param_grads=needs[1] or needs[2])
    gres = None
    if needs[3]:  # the residual's gradient is g, in the residual's own axis order
        gres = g if rperm == sorted(rperm) else ew.materialize(ctx, g.permute(rperm))
    return (from_rows(ctx, dx, shape, perm) if needs[0] else None,
            dw if needs[1] else None, db if needs[2] else None, gres)


def group_norm(x, channel_tag, groups, eps, weight=None, bias=None):
    """group_norm over [*batch, time, channel] (the last two axes in either order): per batch
    item, channels split into `groups` consecutive groups, each standardized over time ×
    C/groups (f64 statistics, biased variance, eps inside the sqrt), then · weight[c] +
    bias[c] (each optional, shared by the items), the whole batch in one set of launches over
    x read in place (exec/norm.py, codegen/norm.py GroupNormKey)."""
    op = "group_norm"
    r = x._live(op)
    ctx = r.ctx
    if r.rank < 2:
        raise InvalidShape(f"{op}: expected a [*batch, time, channel] tensor of rank >= 2, got "
                           f"shape {r.shape}")
    cax = axes.axis_of(x.tags, channel_tag, op)
    if cax < r.rank - 2:
        raise TagError(f"{op}: expected the channel tag {channel_tag!r} among the last two axes "
                       f"(time and channel after the batch axes), got tags {x.tags}")
    _f32(op, "tensor", r)
    integral = type(groups) is int or (not isinstance(groups, bool)
                                       and isinstance(groups, numbers.Integral))
    if not integral or groups < 1:
        raise InvalidShape(f"{op}: expected groups an int >= 1, got {groups!r}")
    last = cax == r.rank - 1
    C, T = r.shape[cax], r.shape[-2 if last else -1]
    G = int(groups)
    if C % G:
        raise InvalidShape(f"{op}: {C} channels do not split into {G} equal groups")
    wr = _param(op, "weight", x, weight, channel_tag, C, True) if weight is not None else None
    br = _param(op, "bias", x, bias, channel_tag, C, True) if bias is not None else None
    # the kernels read x's memory as it is: items of rows [T, C] (tc) or [C, T] (ct); x with
    # its last two axes transposed over contiguous memory is read through that transpose
    # (swap), any other strides are copied first
    swap = not r.is_contiguous() and _swapped(r).is_contiguous()
    xr = _swapped(r) if swap else ew.materialize(ctx, r)
    N = _batch(r.shape)
    plan = exn.group_plan("tc" if last != swap else "ct", N, T, C, G, _eps(op, eps))
    y, saved = exn.group_forward(ctx, plan, xr, wr, br)

    def grads(needs, g):
        gk = ew.materialize(ctx, _swapped(g) if swap else g)
        dx, dw, db = exn.group_backward(ctx, plan, saved, xr, gk, wr, br is not None, needs[0])
        if needs[0] and swap:
            dx = _swapped(dx)
        return dx, dw if needs[1] else None, db if needs[2] else None

    return finish_op(op, _swapped(y) if swap else y, x.tags, (x, weight, bias),
                     lambda needs: functools.partial(grads, needs))


def _swapped(r):
    """r with its last two axes exchanged (a view)."""
    s, st = list(r.shape), list(r.strides)
    s[-2:], st[-2:] = s[:-3:-1], st[:-3:-1]
    return r.view(s, st)


def _batch(shape) -> int:
    n = 1
    for d in shape[:-2]:
        n *= d
    return n


def _eps(op, eps) -> float:
    return eps if type(eps) is float else real(op, eps)  # a float is the common case


class NormMethods:
    """Tensor methods of the normalization family (SPEC §3.10)."""

    __slots__ = ()

    def layer_norm(self, tag: str, eps: float, weight=None, bias=None):
        """(x - mean) / sqrt(var + eps) over `tag` (biased var), then * weight + bias when given
        (both or neither); weight/bias rank-1 of length dim(tag)."""
        op = "layer_norm"
        if (weight is None) != (bias is None):
            raise InvalidArgumentType(f"{op}: weight and bias must be given together (both or neither)")
        spec = exn.NormSpec(center=True, eps=_eps(op, eps))
        return self._result(*normalize(op, self, tag, spec, weight, bias))

    def rms_norm(self, tag: str, eps: float, weight=None):
        """x / sqrt(mean(x^2) + eps) over `tag`, times weight (tags (tag,)) when given."""
        op = "rms_norm"
        spec = exn.NormSpec(center=False, eps=_eps(op, eps))
        return self._result(*normalize(op, self, tag, spec, weight, strict_tags=True))

    def rms_norm_mul(self, tag: str, weight, eps: float):
        """rms_norm(x) * weight, weight tagged (tag,)."""
        op = "rms_norm_mul"
        spec = exn.NormSpec(center=False, eps=_eps(op, eps))
        if weight is None:
            raise InvalidArgumentType(f"{op}: expected a weight tensor, got None")
        return self._result(*normalize(op, self, tag, spec, weight, strict_tags=True))

    def rms_norm_mul_add(self, tag: str, weight, residual, eps: float):
        """rms_norm(x) * weight + residual (residual with self's tags and shape)."""
        op = "rms_norm_mul_add"
        spec = exn.NormSpec(center=False, eps=_eps(op, eps))
        if weight is None or residual is None:
            raise InvalidArgumentType(f"{op}: expected weight and residual tensors")
        return self._result(*normalize(op, self, tag, spec, weight, residual=residual,
                                       strict_tags=True))

    def rms_norm_mul_rope_half_prepared(self, position_tag: str, feature_tag: str, weight,
                                        eps: float, table):
        """rope(rms_norm(x over feature_tag) · weight, table, "half"): the QK-norm + RoPE step
        of Qwen3-style attention, with a prepared RopeTable. Runs as the norm kernel then the
        rotation kernel; differentiable in x and weight."""
        op = "rms_norm_mul_rope_half_prepared"
        if not isinstance(table, RopeTable):
            raise InvalidArgumentType(f"{op}: expected a prepared RopeTable (ctx.prepare_rope_table), got "
                            f"{type(table).__name__}")
        return self.rms_norm_mul(feature_tag, weight, eps).rope(position_tag, feature_tag, table,
                                                                "half")

    def group_norm(self, channel_tag: str, groups: int, eps: float, weight=None, bias=None):
        """[*batch, time, channel] (the last two axes in either order): per batch item, each
        of `groups` consecutive channel groups standardized over time × C/groups (f64
        statistics, biased variance, eps inside the sqrt), then · weight[c] and + bias[c] when
        given (each optional, tagged (channel_tag,)). torch: F.group_norm on [N, C, time]."""
        return self._result(*group_norm(self, channel_tag, groups, eps, weight, bias))

    def l2_normalize(self, tag: str, eps: float):
        """x · rsqrt(Σ_tag x² + eps) (eps added to the squared norm; differs from F.normalize's
        x / max(‖x‖, eps)): the rms_norm row kernel with the sum of squares left undivided.
        SPEC §3.0 lists it as composed, so it still needs an exec scope under gradients."""
        op = "l2_normalize"
        require_scope(op, self)
        spec = exn.NormSpec(center=False, eps=_eps(op, eps), mean=False)
        return self._result(*normalize(op, self, tag, spec))

    def snake(self, channel_tag: str, alpha, inv_b):
        """x + inv_b[c] · sin(alpha[c] · x)² over [time, channel] (the Snake activation);
        alpha and inv_b tagged (channel_tag,); differentiable in all three."""
        op = "snake"
        K = self.shape[axes.axis_of(self.tags, channel_tag, op)]
        for what, p in (("alpha", alpha), ("inv_b", inv_b)):
            if p is None:
                raise InvalidArgumentType(f"{op}: expected {what} as a tensor, got None")
            _param(op, what, self, p, channel_tag, K, True)
        s = (self * alpha).unary("sin")
        return self + (s * s) * inv_b  # x-major operand first: the result keeps x's axis order

    def standardize_axis(self, tag: str, *, ddof: int = 0, eps: float = 0.0,
                         eps_mode: str = "outside_sqrt", accumulation: str = "f32",
                         valid_len: int | None = None):
        """(x - mean) / denom over `tag`: outside_sqrt denom = sqrt(var_ddof) + eps, inside_sqrt
        sqrt(var_ddof + eps); accumulation f32 | f64; valid_len: only the first valid_len
        entries are standardized, the rest are 0 (with 0 gradient)."""
        op = "standardize_axis"
        r = self._live(op)
        ax = axes.axis_of(self.tags, tag, op)
        if eps_mode not in EPS_MODES:
            raise InvalidArgument(f"{op}: expected eps_mode in {tuple(EPS_MODES)}, got {eps_mode!r}")
        if accumulation not in ACCUMULATIONS:
            raise InvalidArgument(f"{op}: expected accumulation in {ACCUMULATIONS}, got {accumulation!r}")
        if isinstance(ddof, bool) or not isinstance(ddof, numbers.Integral):
            raise InvalidArgumentType(f"{op}: expected an integer ddof, got {ddof!r}")
        if ddof < 0:
            raise InvalidShape(f"{op}: expected ddof >= 0, got {ddof}")
        K = r.shape[ax]
        if valid_len is not None:
            if isinstance(valid_len, bool) or not isinstance(valid_len, numbers.Integral):
                raise InvalidArgumentType(f"{op}: expected an integer valid_len, got {valid_len!r}")
            if not 0 <= valid_len <= K:
                raise InvalidShape(f"{op}: expected 0 <= valid_len <= {K} (dim of {tag!r}), got {valid_len}")
            valid_len = int(valid_len)
        spec = exn.NormSpec(center=True, eps=_eps(op, eps), eps_mode=EPS_MODES[eps_mode],
                            ddof=int(ddof), acc=accumulation, valid_len=valid_len)
        return self._result(*normalize(op, self, tag, spec))
