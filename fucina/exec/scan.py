"""Scans along one axis (SPEC §3.8): cumsum, cumprod, linear recurrences and the backward scans.

Operands are materialised contiguous and viewed as [A, N, B]; every lane is scanned serially by
one work item (codegen/scan.py), so results are bitwise identical for any thread count.
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.scan import BLOCK, ScanKey
from ..codegen.target import host
from ..errors import DTypeError
from .elementwise import materialize
from .raw import RawTensor, numel

WORK_PER_CHUNK = 1 << 15


def _dims(x: RawTensor, axis: int):
    return numel(x.shape[:axis]), x.shape[axis], numel(x.shape[axis + 1:])


def scan(ctx, op: str, x: RawTensor, axis: int, *, reverse: bool = False, p1: RawTensor | None = None,
         p2: RawTensor | None = None) -> RawTensor:
    """out = scan of `x` along `axis` (f32, same shape). p1/p2 as in codegen/scan.py: the decay
    and init of a linear recurrence (init shaped like x without `axis`; for reverse=True the
    decay already shifted: a[t] = decay[t+1], a[N-1] = 0), or y and g of cumprod_grad."""
    if x.dtype != "f32":
        raise DTypeError(f"{op}: expected an f32 tensor, got {x.dtype}")
    if x.numel == 0:  # no lane to scan
        return ctx.empty(x.shape, "f32")
    x = materialize(ctx, x)
    p1 = materialize(ctx, p1) if p1 is not None else None
    p2 = materialize(ctx, p2) if p2 is not None else None
    A, N, B = _dims(x, axis)
    inner = B == 1
    W = host().f32_lanes
    if inner:
        width = 1 if op == "cumprod_grad" else W
        lanes = -(-A // width)
    elif op == "cumprod_grad":
        lanes, width = A * -(-B // W), min(B, W)
    else:
        lanes, width = A * -(-B // BLOCK), min(B, BLOCK)
    per = max(1, WORK_PER_CHUNK // max(1, N * width))
    out = ctx.empty(x.shape, "f32")
    key = ScanKey(op, inner, reverse, has_init=op == "linrec" and p2 is not None)
    reads = 1 + (p1 is not None) + (p2 is not None and op != "linrec")
    ctx.launch(kernels.get(key), -(-lanes // per), A * N * B * 4 * (reads + 1),
               out.addr, x.addr, 0 if p1 is None else p1.addr, 0 if p2 is None else p2.addr,
               A, N, B, per)
    return out
