"""Elementwise ops at the exec layer: validate once, plan once per layout, launch the kernel.

A plan (the kernel address plus the static part of its argument block) is memoised on
everything that shapes it — op, dtypes, shape, strides — so a repeated op costs one dict
lookup, one pool allocation and one launch.
"""
from __future__ import annotations

import functools
import itertools
import math
import struct
from pathlib import Path

from ..codegen import kernels
from ..codegen.elementwise import TILE, ElementwiseKey, op_table, tile_chunks
from ..errors import DTypeError, ReadOnlyStorage, ShapeMismatch
from ..runtime import MAX_ARGS
from .dtypes import ITEMSIZE
from .raw import RawTensor, contiguous_layout, contiguous_strides, numel


def _last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), 32 MiB when it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or 32 << 20


STREAM_BYTES = _last_level_cache_bytes()  # fresh results at least this big use streaming stores
CHUNK = 1 << 15  # elements per chunk: the grid is fixed by n alone (elementwise results never depend on it)

_plans: dict = {}


def f32_bits(x: float) -> int:
    """The float32 nearest x (round to nearest even; beyond the range: ±inf) as its bits."""
    try:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:
        return 0x7F800000 if x > 0 else 0xFF800000


@functools.lru_cache(maxsize=4096)
def _nonzero_bits(x: float) -> int:
    return f32_bits(x)


def cached_f32_bits(x) -> int:
    """f32_bits for a hot path. Zeros bypass the cache: 0.0 == -0.0 would share an entry."""
    x = float(x)
    return _nonzero_bits(x) if x != 0.0 else (0x80000000 if math.copysign(1.0, x) < 0 else 0)


def coalesce(shape, strides_list):
    """Drop size-1 axes and merge neighbours that every operand walks contiguously."""
    dims = [(d, [s[i] for s in strides_list]) for i, d in enumerate(shape) if d != 1]
    if not dims:
        return (1,), [(0,) for _ in strides_list]
    out = [dims[0]]
    for d, st in dims[1:]:
        pd, pst = out[-1]
        if all(ps == s * d for ps, s in zip(pst, st)):
            out[-1] = (pd * d, st)
        else:
            out.append((d, st))
    return tuple(d for d, _ in out), [tuple(st[k] for _, st in out) for k in range(len(strides_list))]


def _role(stride: int) -> str:
    return "unit" if stride == 1 else "zero" if stride == 0 else "strided"


def _tile_role(st) -> str:
    """An input's role in a register tile over its last two axes (A, B): see codegen."""
    return _role(st[-1]) if st[-1] in (0, 1) else "trans" if st[-2] == 1 else "strided"


def _tile_axes(shape, strides):
    """(p, q) when an input's stride-1 axis p is not the output's stride-1 axis q (the output's
    strides come last): walking the output in order would read that input element by element
    across cache lines, so the kernel walks tiles of the (p, q) plane instead. Else None; also
    when p is shorter than a tile, as the in-order walk then reuses each line it reads
    (measured on copies of [k, 4096] transposed: in order 3x faster at k = 2..4, even at 8;
    tiles 2.2x faster at 16, 3.7x at 64)."""
    out = strides[-1]
    if 1 not in out:
        return None
    q = len(out) - 1 - out[::-1].index(1)
    for st in strides[:-1]:
        if st[q] not in (0, 1) and 1 in st and shape[st.index(1)] >= TILE:
            return st.index(1), q
    return None


STREAMS = 64  # an in-order walk feeding an operand from more runs at once than this reorders


def _streams(shape, strides, run) -> int:
    """How many runs of `run` contiguous elements one operand reads or writes at once when the
    axes are walked in this order (innermost last, that axis contiguous): the walk's inner
    axes each open as many runs as their length, up to the axis that continues them all
    contiguously. The output order of a copy from [seq, head, d] into [head, seq, d] reads
    rows 4 KiB apart, one page each, seq after seq: 1024 runs, none sequential."""
    runs, nxt = 1, run
    for n, st in zip(shape[-2::-1], strides[-2::-1]):
        if st == nxt:           # continues every open run
            if runs > 1:
                return runs
            nxt = n * st
        elif st:                # opens n runs per run (a broadcast axis revisits the same)
            runs *= n
    return runs


def _walk_order(shape, strides):
    """The order of the outer axes to walk (the contiguous inner axis stays last), or None to
    walk the output's: the order in which the operand fed from the most runs at once is fed
    from the fewest, when the output's order feeds one from more than STREAMS. All operands
    move whole rows of 16+ elements along the inner axis. [seq 1024, head 16, d 64] copied
    into [head, seq, d], Zen 3: the input's order (16 output runs, each sequential) 240 ->
    164 µs at 1 thread, 120 -> 77 µs at 2."""
    r = len(shape)
    if r < 3 or r > 5 or shape[-1] < 16 or any(st[-1] != 1 for st in strides):
        return None
    def worst(order):
        sh = tuple(shape[d] for d in order)
        return max(_streams(sh, tuple(st[d] for d in order), shape[-1]) for st in strides)
    ident = tuple(range(r))
    if worst(ident) <= STREAMS:
        return None
    best = min(((*p, r - 1) for p in itertools.permutations(range(r - 1))), key=worst)
    return best if worst(best) < worst(ident) else None


def _plan(op, out_dtype, shape, ins, params, out_strides=None):
    """ins: tuple of (dtype, strides); params: tuple of param dtypes at their input positions;
    out_strides: None for a fresh contiguous result, else the strides of the output view."""
    pk = (op, out_dtype, shape, ins, params, out_strides)
    plan = _plans.get(pk)
    if plan is None:
        key, n_chunks, cost, tail = _layout_plan(*pk)
        plan = _plans[pk] = (kernels.get(key), n_chunks, cost, tail)
    return plan


def _layout_plan(op, out_dtype, shape, ins, params, out_strides):
    """(kernel key, chunks, cost, static argument tail): coalesce the axes, pick the walk
    (in output order; outer axes reordered when that order scatters an operand's rows over
    too many runs (_walk_order); register tiles when an input reads across the output's
    lines)."""
    walk = [x[1] for x in ins if x is not None]
    ostr = contiguous_strides(shape) if out_strides is None else out_strides
    cshape, cstrides = coalesce(shape, walk + [ostr])
    tiled = _tile_axes(cshape, cstrides)
    if tiled is not None:  # the tile axes last, then merge what the new order allows
        order = [d for d in range(len(cshape)) if d not in tiled] + list(tiled)
        tshape, tstrides = coalesce(tuple(cshape[d] for d in order),
                                    [tuple(st[d] for d in order) for st in cstrides])
        if 1 + len(ins) + len(tshape) * (1 + len(tstrides)) <= MAX_ARGS:
            cshape, cstrides = tshape, tstrides
        else:  # the output's strides would not fit in the launch's arguments
            tiled = None
    order = None if tiled is not None else _walk_order(cshape, cstrides)
    if order is not None and 3 + len(ins) + len(cshape) * (1 + len(cstrides)) <= MAX_ARGS:
        cshape = tuple(cshape[d] for d in order)
        cstrides = [tuple(st[d] for d in order) for st in cstrides]
    else:
        order = None
    if tiled is not None:
        out_role, role = "tile", _tile_role
    else:
        out_role, role = "linear", (lambda st: _role(st[-1]))
        if out_strides is not None or order is not None:
            out_role = "unit" if cstrides[-1][-1] == 1 else "strided"
        else:
            cstrides = cstrides[:-1]  # a fresh result is walked in order: no strides
    roles, dtypes = [], []
    it = iter(cstrides)
    for i, x in enumerate(ins):
        if x is None:
            roles.append("param")
            dtypes.append(params[i])
        else:
            roles.append(role(next(it)))
            dtypes.append(x[0])
    n = numel(shape)
    # A fresh result larger than the last-level cache is streamed past it: every chunk starts
    # on a 64-byte line (pool buffers are 64-byte aligned, CHUNK elements are whole lines).
    stream = (out_role == "linear" and len(cshape) == 1 and "strided" not in roles
              and n * ITEMSIZE[out_dtype] >= STREAM_BYTES)
    key = ElementwiseKey(op, tuple(dtypes), out_dtype, len(cshape), tuple(roles), out_role, stream)
    cost = n * (ITEMSIZE[out_dtype] + sum(ITEMSIZE[x[0]] for x in ins if x is not None))
    strides = tuple(s for st in cstrides for s in st)
    if tiled is not None:
        return key, tile_chunks(cshape), cost, cshape + strides
    return key, -(-n // CHUNK), cost, (n, CHUNK) + cshape + strides


def _describe(operands, out_dtype):
    ins, params, ptrs = [], [], []
    for x in operands:
        if isinstance(x, RawTensor):
            ins.append((x.dtype, x.strides))
            params.append(None)
            ptrs.append(x.addr)
        else:
            ins.append(None)
            pdt = "i64" if out_dtype == "i64" else "f32"
            params.append(pdt)
            ptrs.append(int(x) & 0xFFFFFFFFFFFFFFFF if pdt == "i64" else f32_bits(float(x)))
    return tuple(ins), tuple(params), ptrs


def plan_of(op: str, out_dtype: str, shape, operands):
    """(kernel address, chunks, cost, static argument tail) for these operands' layouts."""
    ins, params, _ = _describe(operands, out_dtype)
    return _plan(op, out_dtype, tuple(shape), ins, params)


def key_of(op: str, out_dtype: str, shape, operands, out: RawTensor | None = None) -> ElementwiseKey:
    """The kernel key these operands' layouts get (which walk, which role per operand)."""
    ins, params, _ = _describe(operands, out_dtype)
    ostr = None if out is None or out.is_contiguous() else out.strides
    return _layout_plan(op, out_dtype, tuple(shape), ins, params, ostr)[0]


_PARAM = object()  # stands for a by-value scalar operand in a run-plan key
_runs: dict = {}   # (op, out dtype, shape, out layout, operand layouts) -> (kernel, chunks, cost, tail, out layout)


def _param_bits(x, out_dtype: str) -> int:
    return int(x) & 0xFFFFFFFFFFFFFFFF if out_dtype == "i64" else cached_f32_bits(x)


def run(ctx, op: str, out_dtype: str, shape, operands, out: RawTensor | None = None) -> RawTensor:
    """out[shape] = op(*operands); each operand a RawTensor already viewed at `shape`
    (zero strides where it broadcasts) or a Python scalar (a by-value parameter).
    Plans are remembered per interned layout, so a repeated call is a lookup and a launch."""
    shape = tuple(shape)
    if 0 in shape:  # no elements: no plan, no launch
        return _run_empty(ctx, op, out_dtype, shape, out)
    key = (op, out_dtype, shape, None if out is None else out.lay,
           *[x.lay if type(x) is RawTensor else _PARAM for x in operands])
    plan = _runs.get(key)
    if plan is None:
        plan = _runs[key] = _new_plan(op, out_dtype, shape, operands, out)
    addr, n_chunks, cost, tail, lay = plan
    if ctx.closed:
        ctx.check_open(op)
    if out is None:
        out = RawTensor(ctx.pool.alloc(max(lay.nbytes, 64), out_dtype == "f32"), lay, 0, ctx)
    elif out.buf.readonly:  # the kernel's store would fault
        raise ReadOnlyStorage(f"{op}: expected a writable destination, got read-only storage "
                              f"(a GGUF mapping or read-only array); copy it first with to()")
    ctx.launch(addr, n_chunks, cost, out.addr,
               *[x.addr if type(x) is RawTensor else _param_bits(x, out_dtype) for x in operands],
               *tail)
    return out


def _run_empty(ctx, op, out_dtype, shape, out):
    if ctx.closed:
        ctx.check_open(op)
    if out is None:
        return ctx.empty(shape, out_dtype)
    if out.shape != shape or out.dtype != out_dtype:
        raise ShapeMismatch(f"{op}: expected out of shape {shape} {out_dtype}, got {out.shape} {out.dtype}")
    return out


def _new_plan(op, out_dtype, shape, operands, out):
    ins, params, _ = _describe(operands, out_dtype)
    if out is None:
        return _plan(op, out_dtype, shape, ins, params) + (contiguous_layout(out_dtype, shape),)
    if out.shape != shape or out.dtype != out_dtype:
        raise ShapeMismatch(f"{op}: expected out of shape {shape} {out_dtype}, got {out.shape} {out.dtype}")
    ostr = None if out.is_contiguous() else out.strides
    return _plan(op, out_dtype, shape, ins, params, ostr) + (out.lay,)


def compute_dtype_of(op: str, dtypes) -> str:
    """The common dtype of a pointwise op's operands (mixed dtypes are an error), checked
    against SPEC R-11: bool has no arithmetic, i64 has no plain `div`, and an op must exist in
    the dtype's table (so div_trunc, div_floor, rem, mod and bit_* refuse floats)."""
    first = dtypes[0]
    for d in dtypes[1:]:
        if d != first:
            raise DTypeError(f"{op}: expected operands of one dtype, got {tuple(dtypes)}")
    if first == "bool":
        raise DTypeError(f"{op}: bool tensors have no arithmetic; expected f32/f16/bf16/i64 "
                         f"operands (cast with .to('i64') or .to('f32') first)")
    if first == "i64" and op == "div":
        raise DTypeError("div: integer tensors have no plain division; expected div_trunc "
                         "(toward zero) or div_floor (toward -inf), or rem/mod for the remainder")
    cdt = "f32" if first in ("f16", "bf16") else first
    if op not in op_table(cdt):  # the integer-only ops (div_trunc, rem, bit_and...) are not float ops
        raise DTypeError(f"{op}: not defined for dtype {first}")
    return first


def materialize(ctx, x: RawTensor) -> RawTensor:
    """A contiguous copy of any view (the input itself if already contiguous)."""
    if x.is_contiguous():
        return x
    return run(ctx, "copy", x.dtype, x.shape, [x])


def cast(ctx, x: RawTensor, dtype: str) -> RawTensor:
    """to(dtype), SPEC R-10: always a copy, one generated kernel for every pair of dtypes.

    float -> float   copy (16-bit loads widen exactly, the store narrows once: f16 IEEE RNE,
                     bf16 the R-9 formula)
    float -> i64     truncate toward zero, saturate at the bounds, NaN -> 0
    i64/bool -> float  signed convert to f32 (round to nearest even), then the narrowing store
                     (i64 -> bf16 is therefore f32_to_bf16(float32(x)), as torch does)
    bool -> i64      0/1
    any -> bool      x != 0 (NaN -> True)
    same dtype       copy (i64 -> i64 is the identity: int->int casts wrap trivially)"""
    src = x.dtype
    if dtype not in ITEMSIZE:
        raise DTypeError(f"to: expected a dtype in {tuple(ITEMSIZE)}, got {dtype!r}")
    floats = ("f32", "f16", "bf16")
    if src == dtype or (src in floats and dtype in floats):
        op = "copy"
    elif dtype == "bool":
        op = "to_bool"
    elif dtype == "i64":
        op = "to_i64"
    else:
        op = "to_f32"
    return run(ctx, op, dtype, x.shape, [x])


def check_same_shape(op, a: RawTensor, b: RawTensor):
    if a.shape != b.shape:
        raise ShapeMismatch(f"{op}: expected equal shapes, got {a.shape} and {b.shape}")


__all__ = ["run", "materialize", "cast", "coalesce", "contiguous_strides"]
