"""Normalization at the exec layer: rows [R, K] with the normalized axis contiguous, per-row
statistics saved by the forward, and the weight/bias gradients folded from per-chunk partials
over a row grid fixed by K (so they are bitwise identical for any thread count). group_norm
reads its [*batch, time, channel] data in place (either of the last two axes contiguous) over
a grid of (item, time chunk), the time chunks fixed by the channel count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..codegen import kernels
from ..codegen.norm import BLOCK_CHANNELS, GroupNormKey, NormKey
from .elementwise import f32_bits
from .raw import RawTensor
from . import reduce as red

WORK_PER_CHUNK = 1 << 15


def _per(K: int) -> int:
    return max(1, WORK_PER_CHUNK // max(K, 1))


@dataclass(frozen=True)
class NormSpec:
    """What a normalization computes: center (subtract the mean), eps and where it goes, the
    variance divisor offset ddof, the row-sum accumulator type, the normalized prefix length;
    mean=False divides the sum of squares by nothing (l2_normalize: x·rsqrt(Σx² + eps))."""

    center: bool
    eps: float
    eps_mode: str = "inside"   # inside | outside (the sqrt)
    ddof: int = 0
    acc: str = "f32"
    valid_len: int | None = None
    mean: bool = True

    def n(self, K: int) -> int:
        return K if self.valid_len is None else self.valid_len

    def divisor(self, K: int) -> int:
        return self.n(K) - self.ddof if self.mean else 1


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
    if R * K == 0:  # nothing to normalise (the statistics are never read): no launch
        return out, NormStats(mean, inv, std)
    per = _per(K)
    ctx.launch(kernels.get(key), -(-R // per), R * K * 4 * (3 if residual is not None else 2),
               x.addr, out.addr, _a(w), _a(b), _a(residual), _a(mean), inv.addr, _a(std),
               R, K, n, f32_bits(spec.eps), f32_bits(float(spec.divisor(K))), per)
    return out, NormStats(mean, inv, std)


def backward(ctx, spec: NormSpec, x: RawTensor, g: RawTensor, stats: NormStats, w=None,
             has_bias: bool = False, param_grads: bool = True):
    """(dx [R, K], dw [K] | None, db [K] | None) for rows x and their upstream gradient g."""
    R, K = x.shape
    n = spec.n(K)
    affine = "none" if w is None else ("wb" if has_bias else "w")
    nparts = {"none": 0, "w": 1, "wb": 2}[affine]
    key = NormKey("bwd", spec.center, affine, False, spec.eps_mode, spec.acc)
    if R * K == 0:  # no row contributes: an empty dx, zero parameter gradients
        want = nparts if param_grads else 0
        return (ctx.empty((R, K), "f32"), ctx.full_raw((K,), 0.0) if want else None,
                ctx.full_raw((K,), 0.0) if want == 2 else None)
    per = _per(K)
    chunks = -(-R // per)
    dx = ctx.empty((R, K), "f32")
    part = ctx.empty((chunks, nparts * K), "f32") if nparts else None
    ctx.launch(kernels.get(key), chunks, R * K * 4 * 3,
               x.addr, g.addr, _a(w), _a(stats.mean), stats.inv.addr, _a(stats.std), dx.addr,
               _a(part), R, K, n, f32_bits(spec.eps), f32_bits(float(spec.divisor(K))), per)
    dw = db = None
    if nparts and param_grads:
        total = red.reduce_axis(ctx, "sum", part, 0)  # chunk partials folded in chunk order
        dw = total.view((K,), (1,), total.offset)
        if nparts == 2:
            db = total.view((K,), (1,), total.offset + K)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# group_norm

GROUP_ROWS_MIN = 64   # per-chunk partials cost 16·C bytes: keep them small against 4·C·rows
# below this many elements the fused kernel runs even on a team: three fork-joins cost what a
# second thread saves (measured at 2 threads: even at 64K elements, 1.6x faster at 256K)
GROUP_TEAM_MIN = 1 << 17
_group_kernels: dict[tuple, int] = {}


class GroupPlan:
    """group_norm on x viewed as N items of T x C: layout tc (channel axis contiguous) or ct
    (time axis contiguous), G groups, time chunks of `per` rows (fixed by C), nq of them per
    item, N·nq chunks in all; one per shape (group_plan). A forward fills one i64-typed buffer
    of saved_shape that its backward reuses: the per-item channel table (f32 [N, 6, C], rows
    codegen.norm.MEAN_HI..SHIFT), the f64 partial sums [2, N, nq, C] (the forward's, then the
    backward's), the backward's coefficients (f32 [N, 2, C])."""

    __slots__ = ("layout", "N", "T", "C", "blocks", "nq", "tail", "saved_shape", "offsets")

    def __init__(self, layout: str, N: int, T: int, C: int, G: int, eps: float):
        per = max(GROUP_ROWS_MIN, WORK_PER_CHUNK // max(C, 1))
        self.layout, self.N, self.T, self.C, self.nq = layout, N, T, C, -(-T // per)
        gpb = max(1, BLOCK_CHANNELS // max(C // G, 1))   # groups per combine chunk
        self.blocks = -(-G // gpb)
        self.tail = (T, C, C // G, per, self.nq, f32_bits(eps), N)
        table, part = 24 * C * N, 16 * C * self.nq * N   # bytes
        self.offsets = (table, table + part)             # of the partials and the coefficients
        self.saved_shape = ((table + part + 8 * C * N) // 8,)

    @property
    def empty(self) -> bool:
        return self.N * self.T * self.C == 0

    def run(self, ctx, fused: str, ops, addrs, weight: bool, bias: bool) -> None:
        """The ops in order, one launch each (data passes over the (item, time chunk) grid,
        combines over blocks of groups, every item in each); for small problems, or when the
        first would run inline on the caller anyway, the fused kernel instead: the same ops in
        the same order in one launch, hence the same bits."""
        chunks, cost = self.N * self.nq, self.N * self.T * self.C * 8
        if self.N * self.T * self.C < GROUP_TEAM_MIN or ctx.team_for(chunks, cost) is None:
            ctx.launch(_group_kernel(fused, self.layout, weight, bias), 1, cost, *addrs, *self.tail)
            return
        for op in ops:
            if op.endswith("combine"):
                ctx.launch(_group_kernel(op, self.layout, weight, bias), self.blocks,
                           self.N * self.C * self.nq * 16, *addrs, *self.tail)
            else:
                ctx.launch(_group_kernel(op, self.layout, False, False), chunks, cost, *addrs,
                           *self.tail)


def _group_kernel(*fields) -> int:
    addr = _group_kernels.get(fields)
    if addr is None:
        addr = _group_kernels[fields] = kernels.get(GroupNormKey(*fields))
    return addr


group_plan = functools.lru_cache(maxsize=256)(GroupPlan)


def group_forward(ctx, plan: GroupPlan, x: RawTensor, w=None, b=None):
    """(y in x's shape and layout, the saved buffer). x contiguous f32 [*batch, T, C] (tc) or
    [*batch, C, T] (ct), N items; w, b: f32 [C] or None. Empty work: no launch."""
    y = ctx.empty(x.shape, "f32")
    saved = ctx.empty(plan.saved_shape, "i64")
    if plan.empty:
        return y, saved
    table = saved.addr
    plan.run(ctx, "forward", ("stats", "combine", "apply"),
             (x.addr, y.addr, 0, _a(w), _a(b), table + plan.offsets[0], table, 0, 0, 0),
             w is not None, b is not None)
    return y, saved


def group_backward(ctx, plan: GroupPlan, saved: RawTensor, x: RawTensor, g: RawTensor, w=None,
                   has_bias=False, need_dx=True):
    """(dx | None, dw | None, db | None): dw when w is given, db when has_bias (each summed
    over the items), dx when asked; g contiguous in x's layout; saved: the forward's."""
    dx = ctx.empty(x.shape, "f32") if need_dx else None
    C = plan.C
    if plan.empty:   # no element contributes: zero parameter gradients
        return (dx, ctx.full_raw((C,), 0.0) if w is not None else None,
                ctx.full_raw((C,), 0.0) if has_bias else None)
    dw = ctx.empty((C,), "f32") if w is not None else None
    db = ctx.empty((C,), "f32") if has_bias else None
    table = saved.addr
    part, coef = (table + o for o in plan.offsets)
    addrs = (x.addr, g.addr, _a(dx), _a(w), 0, part, table, coef, _a(dw), _a(db))
    ops = ("grad_sums", "grad_combine", "grad_apply")
    plan.run(ctx, "backward" if need_dx else "backward_params", ops if need_dx else ops[:2],
             addrs, w is not None, has_bias)
    return dx, dw, db


def _a(t) -> int:
    return 0 if t is None else t.addr
