"""Normalization at the exec layer: rows [R, K] with the normalized axis contiguous, per-row
statistics saved by the forward, and the weight/bias gradients folded from per-chunk partials
over a row grid fixed by K (so they are bitwise identical for any thread count).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen import kernels
from ..codegen.norm import NormKey
from .elementwise import f32_bits
from .raw import RawTensor
from . import reduce as red

WORK_PER_CHUNK = 1 << 15


def _per(K: int) -> int:
    return max(1, WORK_PER_CHUNK // K)


@dataclass(frozen=True)
class NormSpec:
    """What a normalization computes: center (subtract the mean), eps and where it goes, the
    variance divisor offset ddof, the row-sum accumulator type, the normalized prefix length."""

    center: bool
    eps: float
    eps_mode: str = "inside"   # inside | outside (the sqrt)
    ddof: int = 0
    acc: str = "f32"
    valid_len: int | None = None

    def n(self, K: int) -> int:
        return K if self.valid_len is None else self.valid_len


@dataclass
class NormStats:
    """Per-row statistics saved by the forward: mean (centered), 1/denominator, std (outside)."""

    mean: RawTensor | None
    inv: RawTensor
    std: RawTensor | None


def forward(ctx, spec: NormSpec, x: RawTensor, w=None, b=None, residual=None):
    """(y [R, K], stats) for contiguous rows x; w, b: f32 [K] or None; residual: rows or None."""
    R, K = x.shape
    n = spec.n(K)
    affine = "none" if w is None else ("w" if b is None else "wb")
    key = NormKey("fwd", spec.center, affine, residual is not None, spec.eps_mode, spec.acc)
    out = ctx.empty((R, K), "f32")
    mean = ctx.empty((R,), "f32") if spec.center else None
    inv = ctx.empty((R,), "f32")
    std = ctx.empty((R,), "f32") if spec.eps_mode == "outside" else None
    per = _per(K)
    ctx.launch(kernels.get(key), -(-R // per), R * K * 4 * (3 if residual is not None else 2),
               x.addr, out.addr, _a(w), _a(b), _a(residual), _a(mean), inv.addr, _a(std),
               R, K, n, f32_bits(spec.eps), f32_bits(float(n - spec.ddof)), per)
    return out, NormStats(mean, inv, std)


def backward(ctx, spec: NormSpec, x: RawTensor, g: RawTensor, stats: NormStats, w=None,
             has_bias: bool = False, param_grads: bool = True):
    """(dx [R, K], dw [K] | None, db [K] | None) for rows x and their upstream gradient g."""
    R, K = x.shape
    n = spec.n(K)
    affine = "none" if w is None else ("wb" if has_bias else "w")
    nparts = {"none": 0, "w": 1, "wb": 2}[affine]
    key = NormKey("bwd", spec.center, affine, False, spec.eps_mode, spec.acc)
    per = _per(K)
    chunks = -(-R // per)
    dx = ctx.empty((R, K), "f32")
    part = ctx.empty((chunks, nparts * K), "f32") if nparts else None
    ctx.launch(kernels.get(key), chunks, R * K * 4 * 3,
               x.addr, g.addr, _a(w), _a(stats.mean), stats.inv.addr, _a(stats.std), dx.addr,
               _a(part), R, K, n, f32_bits(spec.eps), f32_bits(float(n - spec.ddof)), per)
    dw = db = None
    if nparts and param_grads:
        total = red.reduce_axis(ctx, "sum", part, 0)  # chunk partials folded in chunk order
        dw = total.view((K,), (1,), total.offset)
        if nparts == 2:
            db = total.view((K,), (1,), total.offset + K)
    return dx, dw, db


def _a(t) -> int:
    return 0 if t is None else t.addr
