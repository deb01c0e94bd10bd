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
        table, n = _chunk_table(xctx, [(xs[i].numel, (xs[i].addr,)) for i in members],
                                (xs[members[0]].lay.itemsize,), SUMSQ_CHUNK,
                                [offs[i] for i in members])
        if n:
            xctx.launch(kernel(SumSquaresKey("rows", dtype)), n,
                        sum(xs[i].numel * xs[i].lay.itemsize for i in members), table.addr, part)
    ctx.launch(kernel(_FOLD), 1, 0, part, scratch.addr, P, scratch.addr + out)
    vals = struct.unpack_from(f"<{P + 1}d", scratch, out)
    return list(vals[:-1]), vals[-1]


def _chunk_table(ctx, items, sizes, chunk, first=None):
    """(pool buffer, rows) of a table launch over the slots `items`, (n, pointers) each with
    `sizes` the bytes per element behind each pointer: one i64 row per `chunk` elements of a
    slot, each pointer advanced to the chunk (a 0 pointer, an absent master or buffer, stays
    0), then the chunk's element count, then with `first` (each slot's first partial) the
    chunk's partial index. The launch reads the buffer before it can be reused (launches are
    synchronous). A slot of one chunk is one Python tuple, a longer one numpy rows: tuples
    chunk by chunk took 0.74 ms for the 480 rows of a Qwen3-0.6B block (6 % of its AdamW step
    at one thread), numpy costs ~20 µs a call (LoRA's many one-chunk adapters)."""
    blocks, small = [], []
    for i, (n, ptrs) in enumerate(items):
        extra = () if first is None else (first[i],)
        if n <= chunk:
            if n:
                small.append((*ptrs, n, *extra))
            continue
        starts = np.arange(0, n, chunk, dtype=np.uint64)
        rows = np.zeros((len(starts), len(ptrs) + 1 + len(extra)), np.uint64)
        for j, (p, z) in enumerate(zip(ptrs, sizes)):
            if p:
                rows[:, j] = np.uint64(p) + starts * np.uint64(z)
        rows[:, len(ptrs)] = np.minimum(np.uint64(chunk), np.uint64(n) - starts)
        if extra:
            rows[:, -1] = np.arange(first[i], first[i] + len(starts), dtype=np.uint64)
        blocks.append(rows)
    if small:
        blocks.append(np.array(small, dtype=np.uint64))
    if not blocks:
        return None, 0
    words = np.concatenate(blocks).ravel()
    buf = ctx.pool.alloc(8 * len(words), False)
    np.frombuffer(buf, dtype=np.uint64, count=len(words))[:] = words
    return buf, len(words) // blocks[0].shape[1]


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
        table, n = _chunk_table(xctx, [(x.numel, (x.addr,)) for x in members], (4,), CHUNK)
        if n:
            xctx.launch(kernel(_SCALE), n, 8 * sum(x.numel for x in members), table.addr, bits)


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
    table, rows = _chunk_table(ctx, items, _pointer_sizes(key), CHUNK)
    if rows:
        ctx.launch(addr, rows, sum(n for n, _ in items) * per, table.addr, *scalars)


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
