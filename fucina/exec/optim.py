"""Optimizer kernels at the exec layer: the deterministic sum of squares (SPEC T-7), in-place
gradient scaling, and the launches of the fused SGD / Adam / AdamW updates.

Operands reaching here were validated by fucina.optim (contiguous, dtypes, sizes); these
functions only pick the kernel and launch it over a chunk grid fixed by the element count.
"""
from __future__ import annotations

import struct

from ..codegen import kernels
from ..codegen.optim import AdamKey, SgdKey, SumSquaresKey
from . import elementwise as ew
from .raw import RawTensor

SUMSQ_CHUNK = 1 << 15  # T-7's fixed grid: elements per partial
CHUNK = 1 << 15        # elements per update chunk (results never depend on it)

_addr: dict = {}
_FOLD = SumSquaresKey("fold")


def kernel(key) -> int:
    """kernels.get, memoised here on the key (a dict hit instead of a digest walk)."""
    a = _addr.get(key)
    if a is None:
        a = _addr[key] = kernels.get(key)
    return a


def sum_squares_many(ctx, xs) -> tuple[list[float], float]:
    """([Σ x² of each tensor], Σ of those in order), all f64 in the T-7 order; xs: contiguous
    f32/f16/bf16 RawTensors (any contexts). Bitwise the same for any thread count."""
    P = len(xs)
    offs = [0]
    for x in xs:
        offs.append(offs[-1] + -(-x.numel // SUMSQ_CHUNK))
    # one scratch buffer: offsets (i64, P+1) | partials (f64) | totals (f64, P+1)
    scratch = ctx.pool.alloc(8 * (2 * (P + 1) + offs[-1]), False)
    struct.pack_into(f"<{P + 1}q", scratch, 0, *offs)
    part = scratch.addr + 8 * (P + 1)
    out = 8 * (P + 1 + offs[-1])
    for i, x in enumerate(xs):
        x.ctx.launch(kernel(SumSquaresKey("chunks", x.dtype)), offs[i + 1] - offs[i],
                     x.numel * x.lay.itemsize, x.addr, part + 8 * offs[i], x.numel, SUMSQ_CHUNK)
    ctx.launch(kernel(_FOLD), 1, 0, part, scratch.addr, P, scratch.addr + out)
    vals = struct.unpack_from(f"<{P + 1}d", scratch, out)
    return list(vals[:-1]), vals[-1]


def sum_squares(ctx, x: RawTensor) -> float:
    """Σ x² in f64 (T-7) of one contiguous float tensor."""
    return sum_squares_many(ctx, [x])[1]


def scale_(ctx, x: RawTensor, factor: float) -> None:
    """x *= f32(factor) in place (contiguous f32), by the elementwise kernel."""
    ew.run(ctx, "mul", "f32", x.shape, (x, factor), out=x)


def sgd_step(ctx, key: SgdKey, n: int, p: int, master: int, g: int, buf: int, scalars) -> None:
    """One fused SGD update over n elements; scalars: f32 bits of lr, momentum, 1−dampening, wd."""
    addr, per = _plan(key)
    ctx.launch(addr, -(-n // CHUNK), n * per, p, master, g, buf, n, CHUNK, *scalars)


def adam_step(ctx, key: AdamKey, n: int, p: int, master: int, g: int, m: int, v: int,
              scalars) -> None:
    """One fused Adam/AdamW update over n elements; scalars: f32 bits of keep, wd, 1−β1, β2,
    1−β2, eps (config-wide), then sqrt(bc2), step_size (per slot)."""
    addr, per = _plan(key)
    ctx.launch(addr, -(-n // CHUNK), n * per, p, master, g, m, v, n, CHUNK, *scalars)


_plans: dict = {}


def _plan(key) -> tuple[int, int]:
    """(kernel address, bytes moved per element) of an update key."""
    plan = _plans.get(key)
    if plan is None:
        per = _sgd_bytes(key) if isinstance(key, SgdKey) else _adam_bytes(key)
        plan = _plans[key] = (kernel(key), per)
    return plan


_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "none": 0}


def _param_bytes(dtype: str) -> int:
    """Bytes per element the param side moves: read + write, plus the narrowed copy."""
    return 8 if dtype == "f32" else 8 + _SIZE[dtype]


def _sgd_bytes(key: SgdKey) -> int:
    return _param_bytes(key.param) + 4 + _SIZE[key.state] * (1 if key.first else 2)


def _adam_bytes(key: AdamKey) -> int:
    return _param_bytes(key.param) + 4 + 2 * (_SIZE[key.m] + _SIZE[key.v])
