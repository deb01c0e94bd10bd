"""Selection at the exec layer (SPEC §3.15): argmax, top-k, sort, the top-k / sort value
gradient and the MoE router, over a contiguous input viewed as [A, N, B] (N the selected axis).

Work items are rows (B == 1) or blocks of W columns (B > 1), a fixed number per chunk chosen
from the problem size; each output element is written by exactly one item, so results never
depend on the thread count. Top-k keeps its slots by insertion up to INSERT_MAX slots and uses
the sort kernel's top-k mode beyond (same slots, O(N) per row).
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.selection import INSERT_MAX, SelectGradKey, SelectKey, SortKey
from ..codegen.target import host
from ..errors import IndexOutOfBounds, InvalidShape
from .reduce import check_nonempty
from .elementwise import materialize
from .raw import RawTensor, numel

WORK_PER_CHUNK = 1 << 15   # elements one chunk reads
SORT_SCRATCH = 16 << 20    # bytes of sort scratch (16 per element per chunk) to aim for ...
SORT_MIN_CHUNKS = 8        # ... but at least this many chunks when there are as many rows


def dims(shape, axis: int):
    return numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])


def _grid(A: int, N: int, B: int):
    """(rows walker?, items, items per chunk, chunks) for an [A, N, B] selection."""
    if B == 1:
        items, width = A, N
    else:
        W = host().f32_lanes
        items, width = A * -(-B // W), N * min(B, W)
    per = max(1, WORK_PER_CHUNK // width)
    return B == 1, items, per, -(-items // per)


def check_k(op: str, k: int, n: int, tag: str) -> None:
    if k < 1:
        raise InvalidShape(f"{op}: expected k >= 1, got k={k}")
    if k > n:
        raise IndexOutOfBounds(f"{op}: expected k <= {n} (the size of {tag!r}), got k={k}")


def argmax(ctx, x: RawTensor, axis: int) -> RawTensor:
    """i64 index of the first maximum along `axis` (NaN never wins; see codegen/selection.py)."""
    A, N, B = dims(x.shape, axis)
    check_nonempty("argmax", x, axis)
    out = ctx.empty(x.shape[:axis] + x.shape[axis + 1:], "i64")
    if A * B == 0:
        return out
    x = materialize(ctx, x)
    rows, items, per, chunks = _grid(A, N, B)
    ctx.launch(kernels.get(SelectKey("argmax", x.dtype, rows)), chunks, x.numel * x.lay.itemsize,
               x.addr, out.addr, A, N, B, per)
    return out


def top_k(ctx, x: RawTensor, axis: int, k: int) -> tuple[RawTensor, RawTensor]:
    """(values in x's dtype, i64 indices), both x's shape with axis -> k; 1 <= k <= N."""
    x = materialize(ctx, x)
    A, N, B = dims(x.shape, axis)
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    if A * B == 0:  # no rows: nothing to select
        return ctx.empty(shape, x.dtype), ctx.empty(shape, "i64")
    if k > INSERT_MAX:
        return _sort(ctx, x, A, N, B, True, k, "topk", shape)
    values, indices = ctx.empty(shape, x.dtype), ctx.empty(shape, "i64")
    rows, items, per, chunks = _grid(A, N, B)
    ctx.launch(kernels.get(SelectKey("topk", x.dtype, rows)), chunks, x.numel * x.lay.itemsize,
               x.addr, values.addr, indices.addr, A, N, B, k, per)
    return values, indices


def sort(ctx, x: RawTensor, axis: int, descending: bool) -> tuple[RawTensor, RawTensor]:
    """(values, i64 source indices), x's shape; NaN last in either direction."""
    x = materialize(ctx, x)
    A, N, B = dims(x.shape, axis)
    if x.numel == 0:
        return ctx.empty(x.shape, x.dtype), ctx.empty(x.shape, "i64")
    return _sort(ctx, x, A, N, B, descending, N, "sort", x.shape)


def _sort(ctx, x, A, N, B, descending, kout, mode, shape):
    if N >= 1 << 31:  # the kernel carries u32 source indices
        raise InvalidShape(f"sort: expected at most {(1 << 31) - 1} elements along the axis, got {N}")
    rows = A * B
    per = max(1, WORK_PER_CHUNK // N)
    if -(-rows // per) * 16 * N > SORT_SCRATCH:  # long rows: fewer, longer chunks
        per = -(-rows // max(min(rows, SORT_MIN_CHUNKS), SORT_SCRATCH // (16 * N)))
    chunks = -(-rows // per)
    values, indices = ctx.empty(shape, x.dtype), ctx.empty(shape, "i64")
    scratch = ctx.empty((chunks, 4 * N), "f32")  # u32 keys and indices, two of each
    ctx.launch(kernels.get(SortKey(x.dtype, mode)), chunks, x.numel * 24,
               x.addr, values.addr, indices.addr, scratch.addr, A, N, B, per, int(descending), kout)
    return values, indices


def select_grad(ctx, g: RawTensor, indices: RawTensor, axis: int, n: int) -> RawTensor:
    """dx (f32, indices' shape with axis -> n): g scattered back through the saved indices,
    added in slot order (an unfilled top-k slot, index 0, adds its gradient to element 0)."""
    g = materialize(ctx, g)
    A, k, B = dims(indices.shape, axis)
    shape = indices.shape[:axis] + (n,) + indices.shape[axis + 1:]
    dx = ctx.empty(shape, "f32")
    if dx.numel == 0:
        return dx
    per = max(1, WORK_PER_CHUNK // (n * B + k * B))
    ctx.launch(kernels.get(SelectGradKey()), -(-A // per), (n + 2 * k) * B * A * 4,
               g.addr, indices.addr, dx.addr, A, n, k, B, per)
    return dx


def router_top_k(ctx, logits: RawTensor, k: int, normalize: bool) -> tuple[RawTensor, RawTensor]:
    """(selected i64 [R, k], weights f32 [R, k]) from f32 logits [R, E] (see codegen)."""
    x = materialize(ctx, logits)
    R, E = x.shape
    selected, weights = ctx.empty((R, k), "i64"), ctx.empty((R, k), "f32")
    per = max(1, WORK_PER_CHUNK // E)
    ctx.launch(kernels.get(SelectKey("router", "f32", True)), -(-R // per), x.numel * 8,
               x.addr, weights.addr, selected.addr, R, E, k, per, int(bool(normalize)))
    return selected, weights
