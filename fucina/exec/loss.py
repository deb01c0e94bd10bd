"""Cross-entropy at the exec layer: rows of logits [R, K] (class axis contiguous), labels as
i64 with -1 for ignored rows; per-row losses and the saved {max, sum exp} statistics."""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.loss import CeBackwardKey, CeForwardKey
from .elementwise import f32_bits

WORK_PER_CHUNK = 1 << 15


def _per(K: int) -> int:
    return max(1, WORK_PER_CHUNK // K)


def ce_forward(ctx, x, labels, eps: float):
    """(loss[R], m[R], s[R]) for contiguous x [R, K] and i64 labels [R]."""
    R, K = x.shape
    loss, m, s = ctx.empty((R,), "f32"), ctx.empty((R,), "f32"), ctx.empty((R,), "f32")
    per = _per(K)
    ctx.launch(kernels.get(CeForwardKey()), -(-R // per), R * K * 4 * 3,
               x.addr, labels.addr, loss.addr, m.addr, s.addr, R, K, f32_bits(eps), per)
    return loss, m, s


def ce_backward(ctx, x, labels, m, s, g, eps: float, scale: float):
    """dx [R, K]; g is a scalar (the same coefficient for every row) or one value per row."""
    R, K = x.shape
    dx = ctx.empty((R, K), "f32")
    per = _per(K)
    ctx.launch(kernels.get(CeBackwardKey()), -(-R // per), R * K * 4 * 2,
               x.addr, labels.addr, m.addr, s.addr, g.addr, 0 if g.numel == 1 else 1, dx.addr,
               R, K, f32_bits(eps), f32_bits(scale), per)
    return dx
