"""The routed expert FFN (SPEC §3.17) at the exec layer: validate the expert stacks and the
routes, group the (token, slot) pairs by expert, then two launches (codegen/selection.py MoeKey):
gate/up + gated activation per expert group, and down + the route-weighted sum per row block.

Grouping pairs by expert means each routed expert's weights are read once per call however
many tokens chose it (one GEMV per token for decode, a skinny GEMM for a batch). The routing
tables are host-side bookkeeping of a few hundred integers; the kernels do all tensor math.
"""
from __future__ import annotations

import time

import numpy as np

from ..codegen import kernels
from ..codegen.selection import MoeKey
from ..errors import (DTypeError, IndexOutOfBounds, InvalidArgumentType, InvalidDataLength,
                      InvalidShape, ShapeMismatch)
from .raw import RawTensor

GATE_WORK = 1 << 15      # gate/up weight elements (of each) per work item: FB = GATE_WORK // H rows
DOWN_ROWS = 16           # output rows per down work item
WEIGHT_DTYPES = ("f32", "f16")


def expert_stack(op: str, name: str, w: RawTensor, rows: int, cols: int) -> int:
    """The number of experts in a stack of [rows, cols] matrices: rank 3 [E, rows, cols] or the
    rank-2 stacking [E * rows, cols] (SPEC's MoeRhs geometry), contiguous, f32 or f16."""
    if w.dtype not in WEIGHT_DTYPES:
        raise DTypeError(f"{op}: {name}: expected f32 or f16 expert weights, got {w.dtype}")
    if w.rank == 3:
        E, r, c = w.shape
        if (r, c) != (rows, cols):
            raise ShapeMismatch(f"{op}: {name}: expected [experts, {rows}, {cols}], got {w.shape}")
    elif w.rank == 2:
        r, c = w.shape
        if c != cols or r % rows:
            raise ShapeMismatch(f"{op}: {name}: expected [experts * {rows}, {cols}], got {w.shape}")
        E = r // rows
    else:
        raise ShapeMismatch(f"{op}: {name}: expected a rank-2 or rank-3 expert stack, got shape {w.shape}")
    if not w.is_contiguous():
        raise InvalidShape(f"{op}: {name}: expected a contiguous expert stack (each expert a "
                           f"row-contiguous block), got strides {w.strides} for shape {w.shape}")
    return E


def routes(op: str, selected, weights, pairs: int, experts: int):
    """(selected i64, weights f32) as numpy arrays of `pairs` entries, experts in range."""
    sel = np.asarray(selected)
    if sel.ndim != 1 or (sel.size and sel.dtype.kind not in "iu"):
        raise InvalidArgumentType(f"{op}: selected: expected a flat sequence of expert indices, "
                                  f"got {selected!r}")
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 1:
        raise InvalidArgumentType(f"{op}: weights: expected a flat sequence of floats, got shape "
                                  f"{w.shape}")
    if pairs == 0 or sel.size != pairs or w.size != pairs:
        raise InvalidDataLength(f"{op}: expected {pairs} selected experts and {pairs} weights "
                                f"(tokens * top_k, >= 1), got {sel.size} and {w.size}")
    bad = (sel < 0) | (sel >= experts)
    if bad.any():
        raise IndexOutOfBounds(f"{op}: selected: expected expert indices in [0, {experts}), got "
                               f"{int(sel[np.argmax(bad)])}")
    return sel.astype(np.int64), w


def expert_ffn(ctx, x: RawTensor, gate: RawTensor, up: RawTensor, down: RawTensor, sel, w,
               top_k: int, F: int, act: str, profile: dict | None = None) -> RawTensor:
    """y [T, H] (f32) = for each token t: sum over its slots s (in order) of
    w[t, s] · down_e(act(gate_e(x_t), up_e(x_t))), e = sel[t, s]. x: contiguous f32 [T, H];
    stacks validated by expert_stack; sel/w: numpy [T * top_k] from routes()."""
    t0 = time.perf_counter_ns()
    T, H = x.shape
    order = np.argsort(sel, kind="stable")        # pairs grouped by expert, then token, slot
    experts, first, counts = np.unique(sel[order], return_index=True, return_counts=True)
    G, P = experts.size, order.size
    slot_pair = np.empty(P, np.int64)
    slot_pair[order] = np.arange(P)
    # one i64 buffer: groups [G, 3] = (expert, first pair, count), ptok [P], slot_pair [P]
    tables = ctx.from_numpy(np.concatenate([np.stack([experts, first, counts], 1).reshape(-1),
                                            order // top_k, slot_pair]), (3 * G + 2 * P,), "i64", "moe")
    groups, ptok, spair = tables.addr, tables.addr + 24 * G, tables.addr + 8 * (3 * G + P)
    rw = ctx.from_numpy(w, (P,), "f32", "moe")
    h, o, y = ctx.empty((P, F)), ctx.empty((P, H)), ctx.empty((T, H))
    t1 = time.perf_counter_ns()

    FB = max(1, GATE_WORK // H)
    nrb = -(-F // FB)
    ctx.launch(kernels.get(MoeKey("gate_up", gate.dtype, act)), G * nrb,
               2 * G * F * H * gate.lay.itemsize, x.addr, gate.addr, up.addr, h.addr, groups,
               ptok, H, F, nrb, FB, 1, G * nrb)
    t2 = time.perf_counter_ns()
    nhb = -(-H // DOWN_ROWS)
    ctx.launch(kernels.get(MoeKey("down", down.dtype)), nhb, G * F * H * down.lay.itemsize,
               h.addr, down.addr, o.addr, y.addr, groups, spair, rw.addr,
               H, F, G, T, top_k, DOWN_ROWS, 1, nhb)
    if profile is not None:
        t3 = time.perf_counter_ns()
        profile.update(total_ns=t3 - t0, plan_ns=t1 - t0, gate_up_ns=t2 - t1, down_ns=t3 - t2,
                       pairs=P, active_experts=G, max_expert_m=int(counts.max()), tokens=T)
    return y
