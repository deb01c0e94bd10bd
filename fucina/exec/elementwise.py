"""Elementwise ops at the exec layer: validate once, plan once per layout, launch the kernel.

A plan (the kernel address plus the static part of its argument block) is memoised on
everything that shapes it — op, dtypes, shape, strides — so a repeated op costs one dict
lookup, one pool allocation and one launch.
"""
from __future__ import annotations

import functools
import struct

from ..codegen import kernels
from ..codegen.elementwise import ElementwiseKey, op_table
from ..errors import DTypeError, ShapeMismatch
from .dtypes import ITEMSIZE
from .raw import RawTensor, contiguous_layout, contiguous_strides, numel

CHUNK = 1 << 15  # elements per chunk: the grid is fixed by n alone (elementwise results never depend on it)

_plans: dict = {}


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


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


def _plan(op, out_dtype, shape, ins, params, out_strides=None):
    """ins: tuple of (dtype, strides); params: tuple of param dtypes at their input positions;
    out_strides: None for a fresh contiguous result, else the strides of the output view."""
    pk = (op, out_dtype, shape, ins, params, out_strides)
    plan = _plans.get(pk)
    if plan is not None:
        return plan
    tensor_pos = [i for i, x in enumerate(ins) if x is not None]
    walk = [ins[i][1] for i in tensor_pos] + ([out_strides] if out_strides is not None else [])
    cshape, cstrides = coalesce(shape, walk)
    out_role = "linear"
    if out_strides is not None:
        out_role = "unit" if cstrides[-1][-1] == 1 else "strided"
    roles, dtypes = [], []
    it = iter(cstrides)
    for i, x in enumerate(ins):
        if x is None:
            roles.append("param")
            dtypes.append(params[i])
        else:
            st = next(it)
            roles.append(_role(st[-1]))
            dtypes.append(x[0])
    key = ElementwiseKey(op, tuple(dtypes), out_dtype, len(cshape), tuple(roles), out_role)
    n = numel(shape)
    cost = n * (ITEMSIZE[out_dtype] + sum(ITEMSIZE[x[0]] for x in ins if x is not None))
    tail = (n, CHUNK) + cshape + tuple(s for st in cstrides for s in st)
    plan = _plans[pk] = (kernels.get(key), -(-n // CHUNK), cost, tail)
    return plan


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


_PARAM = object()  # stands for a by-value scalar operand in a run-plan key
_runs: dict = {}   # (op, out dtype, shape, out layout, operand layouts) -> (kernel, chunks, cost, tail, out layout)


@functools.lru_cache(maxsize=4096)
def _param_bits(x, out_dtype: str) -> int:
    return int(x) & 0xFFFFFFFFFFFFFFFF if out_dtype == "i64" else f32_bits(float(x))


def run(ctx, op: str, out_dtype: str, shape, operands, out: RawTensor | None = None) -> RawTensor:
    """out[shape] = op(*operands); each operand a RawTensor already viewed at `shape`
    (zero strides where it broadcasts) or a Python scalar (a by-value parameter).
    Plans are remembered per interned layout, so a repeated call is a lookup and a launch."""
    shape = tuple(shape)
    key = (op, out_dtype, shape, None if out is None else out.lay,
           *[x.lay if type(x) is RawTensor else _PARAM for x in operands])
    plan = _runs.get(key)
    if plan is None:
        plan = _runs[key] = _new_plan(op, out_dtype, shape, operands, out)
    addr, n_chunks, cost, tail, lay = plan
    if ctx.closed:
        ctx.check_open(op)
    if out is None:
        out = RawTensor(ctx.pool.alloc(lay.nbytes, out_dtype == "f32"), lay, 0, ctx)
    ctx.launch(addr, n_chunks, cost, out.addr,
               *[x.addr if type(x) is RawTensor else _param_bits(x, out_dtype) for x in operands],
               *tail)
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
    """The common dtype of a pointwise op's operands; mixed dtypes are an error."""
    first = dtypes[0]
    for d in dtypes[1:]:
        if d != first:
            raise DTypeError(f"{op}: expected operands of one dtype, got {tuple(dtypes)}")
    cdt = "f32" if first in ("f16", "bf16") else first
    if op not in op_table(cdt) or first == "bool":
        raise DTypeError(f"{op}: not defined for dtype {first}")
    return first


def materialize(ctx, x: RawTensor) -> RawTensor:
    """A contiguous copy of any view (the input itself if already contiguous)."""
    if x.is_contiguous():
        return x
    return run(ctx, "copy", x.dtype, x.shape, [x])


def cast(ctx, x: RawTensor, dtype: str) -> RawTensor:
    """Always a copy: f32 <-> f16/bf16 convert (R-9 rounding), same-dtype copies any dtype."""
    if dtype != x.dtype and not ({x.dtype, dtype} <= {"f32", "f16", "bf16"}):
        raise DTypeError(f"to: casting {x.dtype} -> {dtype} is not supported yet")
    return run(ctx, "copy", dtype, x.shape, [x])


def check_same_shape(op, a: RawTensor, b: RawTensor):
    if a.shape != b.shape:
        raise ShapeMismatch(f"{op}: expected equal shapes, got {a.shape} and {b.shape}")


__all__ = ["run", "materialize", "cast", "coalesce", "contiguous_strides"]
