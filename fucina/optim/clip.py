"""Gradient norms, scaling and clipping (SPEC T-7, T-11), shared by every optimizer and by
OptimizerSet (whose clip is global over its members), and the public sum_squares.

The norm is Σ over params of sum_squares(grad): f64, per-tensor partials over a fixed chunk grid
folded in order, so it is bitwise the same for any thread count. Scaling multiplies each
gradient accumulator in place (no copy)."""
from __future__ import annotations

import math

from ..ag.tensor import Tensor
from ..errors import DTypeError, InvalidArgumentType
from ..exec import elementwise as ew
from ..exec import optim as xo
from .frames import f32


def sum_squares(t: Tensor) -> float:
    """Σ x² of an f32/f16/bf16 tensor as a Python float (f64), in the T-7 order."""
    if not isinstance(t, Tensor):
        raise InvalidArgumentType(f"sum_squares: expected a fucina Tensor, got {type(t).__name__}")
    raw = t._live("sum_squares")
    if raw.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"sum_squares: expected an f32/f16/bf16 tensor, got {raw.dtype}")
    raw = ew.materialize(raw.ctx, raw)
    return xo.sum_squares(raw.ctx, raw)


def grad_squared_norm(grads) -> float:
    """Σ sum_squares(g) over `grads` in order (f64)."""
    if not grads:
        return 0.0
    return xo.sum_squares_many(grads[0].ctx, grads)[1]


def scale_grads(grads, factor: float) -> None:
    """g *= f32(factor) for every gradient (each leaf owns its accumulator: ag/engine.py)."""
    xo.scale_many(grads, factor)


def clip(grads, squared_norm: float, max_norm: float) -> float:
    """total = f32(sqrt(squared_norm)); coef = f32(max_norm) / (total + f32(1e-6)) in f32;
    if coef < 1 every gradient in `grads` is scaled by it. Returns the pre-clip total."""
    total = f32(math.sqrt(squared_norm))
    coef = f32(f32(max_norm) / f32(total + f32(1e-6)))
    if coef < 1.0:
        scale_grads(grads, coef)
    return total

