"""Optimizer kernels at the exec layer: the deterministic sum of squares (SPEC T-7), in-place
gradient scaling, and the launches of the fused SGD / Adam / AdamW updates.

Operands reaching here were validated by fucina.optim (contiguous, dtypes, sizes); these
functions only pick the kernel and launch it over a chunk grid fixed by the element count.
"""
from __future__ import annotations

import dataclasses
import struct

import numpy as np

from ..codegen import kernels
from ..codegen.optim import AdamKey, ScaleKey, SgdKey, SumSquaresKey
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
    f32/f16/bf16 RawTensors (any contexts). Bitwise the same for any thread count. The chunks
    of all the tensors of one context and dtype go in one launch (a table of chunks)."""
    P = len(xs)
    offs = [0]
    for x in xs:
        offs.append(offs[-1] + -(-x.numel // SUMSQ_CHUNK))
    # one scratch buffer: offsets (i64, P+1) | partials (f64) | totals (f64, P+1)
    scratch = ctx.pool.alloc(8 * (2 * (P + 1) + offs[-1]), False)
    struct.pack_into(f"<{P + 1}q", scratch, 0, *offs)
    part = scratch.addr + 8 * (P + 1)
    out = 8 * (P + 1 + offs[-1])
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault((x.ctx, x.dtype), []).append(i)
    for (xctx, dtype), members in groups.items():
        if len(members) == 1:
            x, i = xs[members[0]], members[0]
            xctx.launch(kernel(SumSquaresKey("chunks", dtype)), offs[i + 1] - offs[i],
                        x.numel * x.lay.itemsize, x.addr, part + 8 * offs[i], x.numel,
                        SUMSQ_CHUNK)
            continue
        rows, nbytes = [], 0
        for i in members:
            x = xs[i]
            size = x.lay.itemsize
            nbytes += x.numel * size
            for k, s in enumerate(range(0, x.numel, SUMSQ_CHUNK)):
                rows.append((x.addr + s * size, min(SUMSQ_CHUNK, x.numel - s), offs[i] + k))
        table = _table(xctx, rows)
        xctx.launch(kernel(SumSquaresKey("rows", dtype)), len(rows), nbytes, table.addr, part)
    ctx.launch(kernel(_FOLD), 1, 0, part, scratch.addr, P, scratch.addr + out)
    vals = struct.unpack_from(f"<{P + 1}d", scratch, out)
    return list(vals[:-1]), vals[-1]


def _table(ctx, rows):
    """A pool buffer holding the i64 rows of a table launch (the launch reads it before this
    buffer can be reused: launches are synchronous)."""
    words = np.asarray(rows, dtype=np.uint64).ravel()
    buf = ctx.pool.alloc(8 * len(words), False)
    np.frombuffer(buf, dtype=np.uint64, count=len(words))[:] = words
    return buf


def sum_squares(ctx, x: RawTensor) -> float:
    """Σ x² in f64 (T-7) of one contiguous float tensor."""
    return sum_squares_many(ctx, [x])[1]


def scale_many(xs, factor: float) -> None:
    """x *= f32(factor) in place for every contiguous f32 x (any contexts): one launch per
    context over a table of chunks (one rounded multiply per element, as the elementwise mul)."""
    groups: dict = {}
    for x in xs:
        groups.setdefault(x.ctx, []).append(x)
    bits = ew.f32_bits(factor)
    for xctx, members in groups.items():
        rows = [(x.addr + 4 * s, min(CHUNK, x.numel - s))
                for x in members for s in range(0, x.numel, CHUNK)]
        table = _table(xctx, rows)
        xctx.launch(kernel(_SCALE), len(rows), 8 * sum(x.numel for x in members), table.addr,
                    bits)


_SCALE = ScaleKey()


def update(ctx, key, items, scalars) -> None:
    """The fused update `key` (SgdKey / AdamKey) of the slots `items` — (n, pointers) each,
    the pointers in the key's argument order (0 for an absent master or buffer) — that share
    the f32 `scalars`: one slot by the one-tensor kernel, several by one launch of its table
    form. Each element's arithmetic is the same either way."""
    if len(items) == 1:
        (n, ptrs), = items
        addr, per = _plan(key)
        ctx.launch(addr, -(-n // CHUNK), n * per, *ptrs, n, CHUNK, *scalars)
        return
    tkey = _tables.get(key)
    if tkey is None:
        tkey = _tables[key] = dataclasses.replace(key, table=True)
    addr, per = _plan(tkey)
    sizes = _pointer_sizes(key)
    rows, total = [], 0
    for n, ptrs in items:
        total += n
        for s in range(0, n, CHUNK):
            rows.append((*(p + s * z if p else 0 for p, z in zip(ptrs, sizes)),
                         min(CHUNK, n - s)))
    table = _table(ctx, rows)
    ctx.launch(addr, len(rows), total * per, table.addr, *scalars)


def _pointer_sizes(key) -> tuple:
    """Bytes per element behind each pointer of an update key (param, master, g, state...)."""
    if isinstance(key, SgdKey):
        return (_SIZE[key.param], 4, 4, _SIZE[key.state])
    return (_SIZE[key.param], 4, 4, _SIZE[key.m], _SIZE[key.v])


_plans: dict = {}
_tables: dict = {}   # update key -> its table form


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
