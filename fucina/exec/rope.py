"""RoPE at the exec layer (SPEC §3.11): build a cos/sin table, rotate contiguous rows [R, F]
whose position is r / M (the autograd layer permutes and validates).

A table work item is one position; an apply work item is a run of whole rows (how many depends
on F alone), so results never depend on the thread count.
"""
from __future__ import annotations

import numpy as np

from ..codegen import kernels
from ..codegen.rope import MODES, RopeKey
from .elementwise import f32_bits
from .raw import RawTensor

__all__ = ["MODES", "table", "apply"]

WORK_PER_CHUNK = 1 << 14


def table(ctx, positions, D: int, theta_base: float, inverse: bool, freq_factors=None):
    """(cos, sin) f32 raws [P, D/2] for int32 positions; freq_factors: None or f32 [D/2]."""
    P, pairs = len(positions), D // 2
    pos = ctx.from_numpy(np.asarray(positions, np.int64), (P,), "i64", "prepare_rope_table")
    ff = None
    if freq_factors is not None:
        ff = ctx.from_numpy(np.asarray(freq_factors, np.float32), (pairs,), "f32", "prepare_rope_table")
    cs = ctx.empty((P, pairs), "f32")
    sn = ctx.empty((P, pairs), "f32")
    key = RopeKey("table", inverse=bool(inverse), ff=ff is not None)
    ctx.launch(kernels.get(key), P, P * pairs * 64, pos.addr, 0 if ff is None else ff.addr,
               cs.addr, sn.addr, P, pairs, D, f32_bits(theta_base))
    return cs, sn


def apply(ctx, x: RawTensor, M: int, cos: RawTensor, sin: RawTensor, start: int, mode: str,
          negate: bool) -> RawTensor:
    """Rotate the span [start, start + D) of every row of x [R, F]; row r uses table row r // M."""
    R, F = x.shape
    pairs = cos.shape[1]
    out = ctx.empty((R, F), "f32")
    per = max(1, WORK_PER_CHUNK // F)
    ctx.launch(kernels.get(RopeKey("apply", mode=mode, negate=bool(negate))), -(-R // per),
               R * F * 8, x.addr, out.addr, cos.addr, sin.addr, R, F, M, pairs, start, per)
    return out
