"""Seed-driven Tensor ops (SPEC §3.4 dropout / RNG-8, §3.15 multinomial / RNG-9).

Dropout stores no mask: the forward, the backward and a checkpoint recompute all regenerate it
from (seed, flat index), so its grad node holds only (p, seed) and the shape's context.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from .. import axes
from ..errors import DTypeError, InvalidArgumentType, InvalidShape, TagError
from ..exec import elementwise as ew
from ..exec import rng as xr
from .engine import finish_op

MASK64 = (1 << 64) - 1
FLOATS = ("f32", "f16", "bf16")


def _seed(op: str, seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an int seed, got {type(seed).__name__}")
    return int(seed) & MASK64


def dropout(x, p, seed):
    """Inverted dropout: out[i] = x[i]·s where (at(seed, i) >> 11) < ceil((1 - p)·2^53), else 0,
    i the flat row-major index of the materialised input, s = f32(1)/(f32(1) - f32(p)).
    p is the reference's f32 parameter (rounded to float32 first); 0 <= p < 1 else InvalidShape;
    p == 0 is a zero-copy identity view (a new Tensor on the same storage)."""
    op = "dropout"
    r = x._raw
    if r.dtype not in FLOATS:
        raise DTypeError(f"{op}: expected a float tensor (f32, f16, bf16), got {r.dtype}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise InvalidArgumentType(f"{op}: expected a real p, got {type(p).__name__}")
    p32 = float(np.float32(p))
    if not 0.0 <= p32 < 1.0:
        raise InvalidShape(f"{op}: expected 0 <= p < 1, got p={p!r}")
    seed = _seed(op, seed)
    if p32 == 0.0:
        return finish_op(op, r, x.tags, (x,), _identity_vjp)
    ctx = r.ctx
    out = xr.dropout(ctx, ew.materialize(ctx, r), seed, p32)
    return finish_op(op, out, x.tags, (x,), lambda needs: functools.partial(_dropout_grad, ctx, seed, p32))


def _identity_vjp(needs):
    return _pass


def _pass(g):
    return (g,)


def _dropout_grad(ctx, seed, p32, g):
    """The same mask and scale applied to g (the kernel is the forward's, on g)."""
    return (xr.dropout(ctx, ew.materialize(ctx, g), seed, p32),)


def multinomial(x, class_tag, out_tag, num_samples, seed, replacement):
    """RNG-9: i64 draws per row of non-negative weights (rank 1 or 2, class axis last)."""
    op = "multinomial"
    r = x._raw
    tags = x.tags
    if r.rank not in (1, 2):
        raise TagError(f"{op}: expected a rank-1 or rank-2 tensor of weights, got tags {tags}")
    if tags[-1] != class_tag:
        raise TagError(f"{op}: expected the class tag {class_tag!r} to be the last axis, got tags {tags}")
    out_tags = axes.check_tags(tags[:-1] + (out_tag,), r.rank, op)
    if r.dtype not in FLOATS:
        raise DTypeError(f"{op}: expected float weights (f32, f16, bf16), got {r.dtype}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise InvalidShape(f"{op}: expected num_samples >= 1, got {num_samples!r}")
    if not isinstance(replacement, bool):
        raise InvalidArgumentType(f"{op}: expected replacement to be a bool, got {type(replacement).__name__}")
    seed = _seed(op, seed)
    K = r.shape[-1]
    S = int(num_samples)
    if not replacement and S > K:
        raise InvalidShape(f"{op}: expected num_samples <= {K} classes without replacement, got {S}")
    ctx = r.ctx
    w = ew.materialize(ctx, r)
    R = r.numel // K
    out = xr.multinomial(ctx, w.view((R, K), (K, 1)), S, seed, replacement, op)
    if r.rank == 1:
        out = out.view((S,), (1,))
    return out, out_tags, None


class RngMethods:
    """Tensor methods of the seed-driven family."""

    __slots__ = ()

    def dropout(self, p: float, seed: int):
        """SPEC §3.4 / RNG-8: inverted dropout with a mask regenerated from (seed, flat index);
        use a fresh seed per call (reusing one reuses the mask); eval = do not call it."""
        self._live("dropout")
        return self._result(*dropout(self, p, seed))

    def multinomial(self, class_tag: str, out_tag: str, num_samples: int, seed: int, replacement: bool):
        """SPEC §3.15 / RNG-9: `num_samples` class indices (i64, no grad, caller-owned) per row."""
        self._live("multinomial")
        return self._result(*multinomial(self, class_tag, out_tag, num_samples, seed, replacement))
