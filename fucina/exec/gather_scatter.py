"""Indexed copies and compaction at the exec layer (SPEC §3.16): fold operands to [A, N, B],
pick the loop shape, launch, then turn the kernels' bad-index flag into IndexOutOfBounds.

Grids are fixed by the problem size. Gathers split the dense side (disjoint output rows). Puts
split the destination into (slab, band of rows, block of columns) items that each walk the
indices in order (codegen/gather_scatter.py), so duplicates combine in serial index order for
any thread count. Affine copies (concat, pad, narrow backward, roll, flip ...) are strided
views: those that fold to rows of contiguous bytes run the block and join kernels, the rest
the elementwise copy kernel, which walks any strides on both sides. Launch plans are memoised
per interned layout, so a repeated call is a dict hit, an allocation and a launch.
"""
from __future__ import annotations

import struct

import numpy as np

from ..codegen import kernels
from ..codegen.gather_scatter import BlockKey, CompactKey, GatherScatterKey, JoinKey
from ..errors import DTypeError, IndexOutOfBounds
from ..runtime import _rt
from . import elementwise as ew
from .dtypes import to_storage
from .raw import RawTensor, contiguous_layout, contiguous_strides, numel

WORK_PER_CHUNK = 1 << 15  # elements moved per work item (gathers) / per item target (puts)
JBLOCK = 4096             # vec "j" gathers: positions per item
COLUMNS = 256             # puts: columns per item when a row is longer than 2 * COLUMNS
MAX_BANDS = 16            # puts: at most this many row bands (each one rescans the indices)
CHUNK = 1 << 15           # compaction: elements per chunk
ADD_DTYPES = ("f32", "i64")
PREFETCH_ROW_BYTES = 1 << 14  # vec "j" gathers: longest data row prefetched (a few fit in L1)


_kernels: dict = {}  # key fields -> kernel address (building a key dataclass costs microseconds)
_folds: dict = {}    # (interned layout, axis) -> _fold of the outer and inner axis groups


def _kernel(cls, *fields) -> int:
    addr = _kernels.get((cls, fields))
    if addr is None:
        addr = _kernels[(cls, fields)] = kernels.get(cls(*fields))
    return addr


# ---- folding ---------------------------------------------------------------------------------

def _fold(shape, strides):
    """(size, innermost stride) of a group of axes walked as one, or None if they do not fold."""
    dims = [(d, s) for d, s in zip(shape, strides) if d != 1]
    if not dims:
        return 1, 1
    n, s = dims[-1]
    for d, st in reversed(dims[:-1]):
        if st != s * n:
            return None
        n *= d
    return n, s


def folded(ctx, r: RawTensor, axis: int):
    """(r or a contiguous copy, A, N, B, stride of A, stride of N) with r's inner block at unit
    stride: the axes before `axis` fold into A, those after it into B."""
    k = (r.lay, axis)
    f = _folds.get(k)
    if f is None:
        outer = _fold(r.shape[:axis], r.strides[:axis])
        inner = _fold(r.shape[axis + 1:], r.strides[axis + 1:])
        ok = outer is not None and inner is not None and (inner[0] == 1 or inner[1] == 1)
        f = _folds[k] = (outer[0], outer[1], inner[0]) if ok else None
    if f is None:
        return folded(ctx, ew.materialize(ctx, r), axis)
    A, sA, B = f
    return r, A, r.shape[axis], B, sA, r.strides[axis]


# ---- bad-index flag --------------------------------------------------------------------------

def _flag(ctx):
    return ctx.pool.alloc(8, False, True)


_FLAG = struct.Struct("q")


def _check(flag, idx: RawTensor, N: int, op: str, where: str) -> None:
    if _FLAG.unpack_from(flag)[0]:
        _raise_bad(idx, N, op, where)


def _raise_bad(idx: RawTensor, N: int, op: str, where: str):
    """The kernel flagged an index outside [0, N): name the first one (the error path only)."""
    vals = idx.to_numpy()
    bad = np.argwhere((vals < 0) | (vals >= N))[0]
    pos = tuple(int(k) for k in bad)
    raise IndexOutOfBounds(
        f"{op}: index {int(vals[pos])} at position {pos[0] if len(pos) == 1 else pos} is out of "
        f"range for {where} of size {N}; expected 0 <= index < {N}")


# ---- gathers ---------------------------------------------------------------------------------

def gather(ctx, x: RawTensor, axis: int, idx: RawTensor, *, rows: bool, op: str, where: str) -> RawTensor:
    """out[..., j, ...] = x[..., idx, ...] along `axis`: idx[j] (rows: idx is i64 [J]) or
    idx[..., j, ...] (idx i64 shaped like the result). A fresh contiguous result.
    Operands that need a copy first (an unfoldable x, a strided idx) are planned on the copy."""
    pk = (x.lay, idx.lay, axis, rows)
    plan = _gathers.get(pk)
    if plan is None:
        xf = folded(ctx, x, axis)[0]
        if xf is not x or not idx.is_contiguous():
            return gather(ctx, xf, axis, ew.materialize(ctx, idx), rows=rows, op=op, where=where)
        plan = _gathers[pk] = _gather_plan(x, axis, idx, rows)
    lay, addr, n_chunks, cost, tail, N = plan
    pool = ctx.pool
    out = RawTensor(pool.alloc(max(lay.nbytes, 64), lay.dtype == "f32"), lay, 0, ctx)
    if not n_chunks:  # no index: an empty result
        return out
    flag = pool.alloc(8, False, True)
    ctx.launch(addr, n_chunks, cost, x.addr, out.addr, idx.addr, flag.addr, *tail)
    if _FLAG.unpack_from(flag)[0]:
        _raise_bad(idx, N, op, where)
    return out


_gathers: dict = {}


def _gather_plan(x: RawTensor, axis: int, idx: RawTensor, rows: bool):
    """(out layout, kernel, chunks, cost, argument tail, N) for foldable x and contiguous idx."""
    J = idx.shape[0] if rows else idx.shape[axis]
    _, A, N, B, dA, dN = folded(None, x, axis)
    lay = contiguous_layout(x.dtype, x.shape[:axis] + (J,) + x.shape[axis + 1:])
    cost = lay.numel * (2 * lay.itemsize + (0 if rows else 8))
    if B == 1:
        jb = max(1, min(J, JBLOCK))  # J == 0: no block, no chunk
        per = max(1, WORK_PER_CHUNK // jb)
        row = N * lay.itemsize  # prefetched ahead when short and covered by the indices
        pf = row if dN == 1 and row <= PREFETCH_ROW_BYTES and row <= 64 * J else 0
        return (lay, _kernel(GatherScatterKey, "gather", x.dtype, "j", rows, dN == 1),
                -(-(A * -(-J // jb)) // per), cost, (A, N, J, 1, dA, dN, J, 1, per, jb, pf), N)
    per = max(1, WORK_PER_CHUNK // max(B, 1))
    return (lay, _kernel(GatherScatterKey, "gather", x.dtype, "b", rows), -(-(A * J) // per), cost,
            (A, N, J, B, dA, dN, J * B, B, per), N)


# ---- puts ------------------------------------------------------------------------------------

def put(ctx, dst: RawTensor, axis: int, idx: RawTensor, src: RawTensor | None, mode: str, *,
        rows: bool, op: str, where: str) -> None:
    """In place on `dst` (a fresh contiguous tensor the caller owns): along `axis`,
    dst[..., idx, ...] = src (mode "store"), += src ("add") or = 0 ("zero", src None); src is
    shaped like dst with `axis` of size J = len(idx) (rows) or like idx (per element).
    Duplicates apply in serial index order: the last store wins, adds accumulate in order."""
    if mode == "add" and dst.dtype not in ADD_DTYPES:
        raise DTypeError(f"{op}: accumulation is defined for {ADD_DTYPES}, got {dst.dtype}")
    A, N, B = numel(dst.shape[:axis]), dst.shape[axis], numel(dst.shape[axis + 1:])
    J = idx.shape[0] if rows else idx.shape[axis]
    if A * J * B == 0:  # no index and no element to put: no launch
        return
    idx = ew.materialize(ctx, idx)
    src_addr = 0
    if src is not None:
        if src.dtype != dst.dtype:
            raise DTypeError(f"{op}: expected the source in the destination's dtype {dst.dtype}, "
                             f"got {src.dtype}")
        src = ew.materialize(ctx, src)
        src_addr = src.addr
    vec = "j" if B == 1 else "b"
    BB = B if B <= 2 * COLUMNS else COLUMNS
    nbb = -(-B // BB)
    nb = 1
    if rows and vec == "b":  # bands: more items when slabs x column blocks are too few
        want = -(-(A * J * B) // WORK_PER_CHUNK)
        nb = max(1, min(MAX_BANDS, N, -(-want // (A * nbb))))
    rpb = -(-N // nb)
    nb = -(-N // rpb)
    items = A * nb * nbb
    per = max(1, WORK_PER_CHUNK // (J * min(B, BB)))  # small items are grouped into chunks
    flag = _flag(ctx)
    cost = A * J * B * (3 * dst.lay.itemsize + (0 if rows else 8))
    ctx.launch(_kernel(GatherScatterKey, mode, dst.dtype, vec, rows), -(-items // per), cost, dst.addr,
               src_addr, idx.addr, flag.addr, A, N, J, B, N * B, B, J * B, B, rpb, nb, BB, nbb, per)
    _check(flag, idx, N, op, where)


# ---- affine copies ---------------------------------------------------------------------------
# A copy (or fill) whose axes coalesce into rows of contiguous elements, [A, W] with any row
# strides, runs the block kernel (4x-unrolled byte rows); anything else (a reversed last axis,
# a broadcast inner axis, a permuted operand) goes to the elementwise copy, which walks any
# strides.

BLOCK_BYTES = 1 << 17    # block kernels: bytes per chunk
STREAM_BYTES = 64 << 20  # fills at least this big bypass the caches (non-temporal stores)
_blocks: dict = {}       # (dst layout, src layout or None) -> block plan, or None for the fallback


def _block_plan(dst: RawTensor, src: RawTensor | None):
    k = (dst.lay, None if src is None else src.lay)
    if k in _blocks:
        return _blocks[k]
    walks = [dst.strides] if src is None else [src.strides, dst.strides]
    cshape, cstr = ew.coalesce(dst.shape, walks)
    plan = None
    if dst.numel == 1:
        plan = (1, 1, (0,) * len(walks))
    elif len(cshape) <= 2 and all(st[-1] == 1 for st in cstr):
        plan = ((1, cshape[0], (0,) * len(walks)) if len(cshape) == 1 else
                (cshape[0], cshape[1], tuple(st[0] for st in cstr)))
    elif len(cshape) == 1 and all(st[0] >= 0 for st in cstr):  # a column: rows of one element
        plan = (cshape[0], 1, tuple(st[0] for st in cstr))
    _blocks[k] = plan
    return plan


def copy(ctx, r: RawTensor) -> RawTensor:
    """A fresh contiguous copy (even of a contiguous tensor)."""
    out = ctx.empty(r.shape, r.dtype)
    copy_into(ctx, out, r)
    return out


def copy_into(ctx, dst: RawTensor, src: RawTensor) -> None:
    """dst (a view) = src (a view of the same shape and dtype)."""
    if dst.numel == 0:
        return
    plan = _block_plan(dst, src)
    if plan is None:
        ew.run(ctx, "copy", dst.dtype, dst.shape, (src,), out=dst)
        return
    A, W, (sA, dA) = plan
    isz = dst.lay.itemsize
    CW, n_chunks = _block_grid(A, W * isz)
    ctx.launch(_kernel(BlockKey, "copy", "", False), n_chunks, 2 * A * W * isz, src.addr, dst.addr,
               A, W * isz, sA * isz, dA * isz, CW, max(1, BLOCK_BYTES // CW))


def fill(ctx, dst: RawTensor, value) -> None:
    """Every element of the view `dst` = value (rounded to its dtype as a store would)."""
    if dst.numel == 0:
        return
    plan = _block_plan(dst, None)
    if plan is None:
        one = ctx.from_numpy([value], (1,), dst.dtype)
        ew.run(ctx, "copy", dst.dtype, dst.shape, (one.view(dst.shape, (0,) * dst.rank),), out=dst)
        return
    A, W, (dA,) = plan
    isz = dst.lay.itemsize
    bits = _fill_bits(dst.dtype, value)
    stream = A == 1 and W * isz >= STREAM_BYTES and dst.addr % 64 == 0
    CW, n_chunks = _block_grid(A, W * isz)
    ctx.launch(_kernel(BlockKey, "fill", dst.dtype, stream), n_chunks, A * W * isz, bits, dst.addr,
               A, W, 0, dA, CW // isz, max(1, BLOCK_BYTES // CW))


_bits: dict = {}  # (dtype, type, the value's exact bytes) -> its bits as stored


def _fill_bits(dtype: str, value) -> int:
    """The storage bits of `value` in `dtype` (memoised by the value's exact representation:
    0.0 and -0.0 differ)."""
    k = (dtype, type(value), struct.pack("<d", value) if isinstance(value, (float, np.floating)) else value)
    bits = _bits.get(k)
    if bits is None:
        arr = to_storage(np.array([value]), dtype)
        bits = _bits[k] = int(arr.view(f"u{arr.itemsize}")[0])
    return bits


def zeros(ctx, shape) -> RawTensor:
    """A new f32 tensor of zeros (large ones are streamed past the caches)."""
    out = ctx.empty(shape, "f32")
    fill(ctx, out, 0.0)
    return out


def _block_grid(A: int, row_bytes: int):
    """(bytes per work item along a row, chunks): items are (row, span of the row), a span
    being BLOCK_BYTES (a multiple of any vector) or the whole row when shorter."""
    CW = min(row_bytes, BLOCK_BYTES)
    items = A * -(-row_bytes // CW)
    return CW, -(-items // max(1, BLOCK_BYTES // CW))


def assemble(ctx, shape, dtype: str, axis: int, pieces) -> RawTensor:
    """A new tensor laid out along `axis` from consecutive pieces: (RawTensor, n) copies a view
    of n positions, (number, n) fills them. Tensor-only pieces whose rows are contiguous are
    joined in one launch; otherwise piece by piece."""
    if 0 in shape:
        return ctx.empty(shape, dtype)
    pieces = [(p, n) for p, n in pieces if n]  # an empty piece adds nothing
    if all(isinstance(p, RawTensor) or n == 0 for p, n in pieces):
        pieces = [p for p, n in pieces if n]
        lay = contiguous_layout(dtype, shape)
        key = (lay, axis, *[p.lay for p in pieces])
        plan = _joins.get(key)
        if plan is None:
            plan = _joins[key] = join_plan(lay, axis, [p.lay for p in pieces])
        if plan:
            return join(ctx, plan, pieces)
        pieces = [(p, p.shape[axis]) for p in pieces]
    out = ctx.empty(shape, dtype)
    pos = 0
    for piece, n in pieces:
        if n:
            part = out.narrow(axis, pos, n)
            if isinstance(piece, RawTensor):
                copy_into(ctx, part, piece)
            else:
                fill(ctx, part, piece)
        pos += n
    return out


_joins: dict = {}  # (out layout, axis, piece layouts...) -> join plan, or False (piece by piece)


JOIN_INLINE = (_rt.MAX_ARGS - 7) // 4  # joins of at most this many pieces pass their table as arguments


def join_plan(out, axis: int, lays):
    """How to join pieces of layouts `lays` side by side along `axis` into a new tensor of
    the contiguous layout `out` in one launch, or False when a piece's rows are not contiguous.
    out is seen as rows [A, RW bytes], piece p as rows [A, n_p * B] at some row stride: the
    piece table's fixed part (row stride, offset, width in bytes per piece) is worked out here,
    only the pieces' addresses come per call. Empty pieces or result: False (assemble skips them)."""
    if 0 in out.shape or any(0 in lay.shape for lay in lays):
        return False
    A, isz = numel(out.shape[:axis]), out.itemsize
    fixed, off = [], 0
    for lay in lays:
        inner = _fold(lay.shape[axis:], lay.strides[axis:])
        outer = _fold(lay.shape[:axis], lay.strides[:axis])
        if outer is None or inner is None or (inner[0] > 1 and inner[1] != 1):
            return False
        w = inner[0] * isz
        fixed += (outer[1] * isz if A > 1 else 0, off, w)
        off += w
    K = len(lays)
    CW, n_chunks = _block_grid(A, off)
    table = None if K <= JOIN_INLINE else struct.Struct(f"{4 * K}q")
    return (out, _kernel(JoinKey, off > CW), n_chunks, 2 * A * off, (A, off, K, CW, max(1, BLOCK_BYTES // CW)),
            tuple(fixed), table)


def join(ctx, plan, pieces) -> RawTensor:
    """The new tensor `plan` (from join_plan) makes of `pieces` (RawTensors of its layouts).
    A few pieces pass their table in the argument block, more fill a table buffer."""
    lay, addr, n_chunks, cost, grid, fixed, table = plan
    pool = ctx.pool
    out = RawTensor(pool.alloc(max(lay.nbytes, 64), lay.dtype == "f32"), lay, 0, ctx)
    if table is None:
        ctx.launch(addr, n_chunks, cost, out.addr, *grid, 0, *[p.addr for p in pieces], *fixed)
    else:
        buf = pool.alloc(table.size, False)
        table.pack_into(buf, 0, *[p.addr for p in pieces], *fixed)
        ctx.launch(addr, n_chunks, cost, out.addr, *grid, buf.addr)
    return out


def reversed_view(r: RawTensor, axis: int) -> RawTensor:
    """r read backwards along `axis` (a negative stride; only the copy kernel ever sees it)."""
    st = list(r.strides)
    off = r.offset + (r.shape[axis] - 1) * st[axis]
    st[axis] = -st[axis]
    return r.view(r.shape, st, off)


def split_view(r: RawTensor, axis: int, n: int) -> RawTensor:
    """A contiguous r with `axis` (size n*d) seen as two axes (n, d)."""
    d = r.shape[axis] // n
    shape = r.shape[:axis] + (n, d) + r.shape[axis + 1:]
    return r.view(shape, contiguous_strides(shape), r.offset)


# ---- compaction ------------------------------------------------------------------------------

def mask_offsets(ctx, mask: RawTensor) -> tuple[RawTensor, int]:
    """(per-chunk exclusive offsets of the truthy elements of a contiguous mask, total)."""
    n = mask.numel
    nq = -(-n // CHUNK)
    counts = ctx.empty((nq + 1,), "i64")
    ctx.launch(_kernel(CompactKey, "count", "", mask.dtype), nq, n * mask.lay.itemsize,
               mask.addr, 0, 0, counts.addr, n, CHUNK)
    ctx.launch(_kernel(CompactKey, "offsets", "", ""), 1, 0, 0, 0, 0, counts.addr, nq, CHUNK)
    total = int(np.frombuffer(counts.buf, np.int64, 1, (nq + counts.offset) * 8)[0])
    return counts, total


def compact(ctx, what: str, mask: RawTensor, x: RawTensor | None, offsets: RawTensor, total: int) -> RawTensor:
    """what="select": x's elements where mask is truthy, row-major ([total], x's dtype);
    "positions": their flat indices (i64). mask (and x) contiguous, same shape."""
    dtype = x.dtype if what == "select" else "i64"
    out = ctx.empty((total,), dtype)
    n = mask.numel
    ctx.launch(_kernel(CompactKey, what, x.dtype if what == "select" else "", mask.dtype),
               -(-n // CHUNK), n * 9, mask.addr, 0 if x is None else x.addr, out.addr, offsets.addr,
               n, CHUNK)
    return out


def expand(ctx, mask: RawTensor, g: RawTensor, offsets: RawTensor) -> RawTensor:
    """The inverse of select: mask's shape, g's values at the truthy positions in row-major
    order, 0 elsewhere (f32)."""
    g = ew.materialize(ctx, g)
    out = ctx.empty(mask.shape, "f32")
    n = mask.numel
    ctx.launch(_kernel(CompactKey, "expand", "f32", mask.dtype), -(-n // CHUNK), n * 9,
               mask.addr, g.addr, out.addr, offsets.addr, n, CHUNK)
    return out
