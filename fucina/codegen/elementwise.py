"""Elementwise kernels: one generator for every pointwise op, every dtype and every layout.

The exec layer broadcasts the operands to the output shape and coalesces the axes, so a kernel
sees an output of rank r (contiguous) and inputs whose strides are runtime arguments. What the
key fixes is the *role* of each input's innermost axis:

  unit    — stride 1: vector loads          (a contiguous operand, a tail-broadcast bias)
  zero    — stride 0: one load, splatted     (a scalar, a column broadcast)
  strided — any other stride: scalar loop   (a transposed view)
  param   — no tensor: a scalar passed by value in the argument block (x * 2.0)

The outer axes are walked with a carried multi-index, so one kernel serves every shape of its
class. Vector width comes from the target; the last partial vector uses masked loads/stores.
A long lane formula (exp, tanh, erf, a sigmoid: rows.LONG_FORMULA instructions or more) runs
rows.WIDE_STEP vectors per step on 8-lane hosts, then single vectors (vectors_per_step).

Argument block: out, in_0..in_{k-1} (pointer, or the param's bits), n, chunk, shape[r],
then r strides per tensor input.

Transposed operands (out_role "tile"). Walking the output in order while reading an operand
whose stride-1 axis is another one touches a new cache line per element (~2 GB/s). The exec
layer then moves that operand's stride-1 axis to position r-2 (A) and the output's to r-1 (B),
and this kernel walks V x V register tiles instead: such a "trans" operand is read as V vectors
along A, transposed in registers with shuffles, and every row of the tile is stored as one
vector along B, so reads and writes both use whole vectors. The chunk grid is blocks of
BLOCK x BLOCK elements of the (A, B) plane (fixed by the shape). Per tile, an input's role is:

  unit    — stride 1 along B: a vector load per row
  zero    — stride 0 along B: one load per row, splatted
  trans   — stride 1 along A: V vectors along A, transposed
  strided — neither: per-element loads
  param   — a scalar by value

Argument block of a tiled kernel: out, in_0..in_{k-1}, shape[r] (A and B last), r strides per
tensor input, then r strides of the output.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from llvmlite import ir

from ..kernel_templates import arithmetic as _arith
from . import activations, loss, masks, typed
from . import irutil as u
from .kernels import KernelKey, register
from .lowering import lower_table
from .rows import map_pass, wide_step
from .target import host


ARITHMETIC = lower_table(_arith.TEMPLATES, _arith.CONSTANTS, _arith.KERNELS)

# every float op: arithmetic, activations, losses (formulas in fucina/kernel_templates/) and masks
FLOAT_OPS = {**ARITHMETIC, **activations.OPS, **loss.OPS, **masks.OPS, **typed.CASTS}

INT_OPS = typed.OPS  # i64 and bool arithmetic lives in codegen/typed.py


def op_table(compute_dtype: str, op: str = "") -> dict:
    if op.startswith("elemental:") and compute_dtype == "f32":  # user scalar ops (SPEC §3.5)
        from .elemental import op_entry

        return {op: op_entry(op)}
    if op.startswith("add_then:") and compute_dtype == "f32":  # x + bias, then an activation
        act = FLOAT_OPS[op[len("add_then:"):]][1]
        return {op: (2, lambda b, x, y: act(b, b.fadd(x, y)))}
    return INT_OPS if compute_dtype in ("i64", "bool") else FLOAT_OPS


def domain(in_dtypes) -> str:
    """Which table an op comes from: the compute dtype of the first non-bool input (a bool
    condition or mask does not make `where` an integer op)."""
    return next((compute_dtype(d) for d in in_dtypes if d != "bool"), "bool")


def compute_dtype(dtype: str) -> str:
    return {"f16": "f32", "bf16": "f32"}.get(dtype, dtype)


@register
@dataclass(frozen=True)
class ElementwiseKey(KernelKey):
    family = "elementwise"
    op: str
    in_dtypes: tuple   # storage dtype per input (a param's dtype is its compute dtype)
    out_dtype: str
    rank: int          # coalesced rank of the output
    roles: tuple       # per input: "unit" | "zero" | "strided" | "param" (| "trans" when tiled)
    out_role: str = "linear"  # "linear" (a fresh contiguous result) | "unit" | "strided" (a view)
    #                           | "tile" (V x V register tiles over the last two axes)
    stream: bool = False  # rank-1 linear result larger than the LLC: non-temporal vector stores

    def ir(self, symbol: str) -> str:
        return str(_build_tiled(self, symbol) if self.out_role == "tile" else _build(self, symbol))


def _setup(key: ElementwiseKey, symbol: str):
    """The kernel function, its op, compute type and vector lanes, and the operand pointers
    (or by-value params) read from the argument block."""
    mod, b, args, c0, c1 = u.kernel(symbol)
    cdt = domain(key.in_dtypes)
    arity, fn = op_table(cdt, key.op)[key.op]
    assert arity == len(key.roles), (key.op, len(key.roles))
    ctype = u.COMPUTE[cdt]
    lanes = host().vector_bits // (ctype.width if isinstance(ctype, ir.IntType) else 32)
    out = u.arg_ptr(b, args, 0)
    ins = []
    for j, role in enumerate(key.roles):
        if role == "param":
            raw = u.arg(b, args, 1 + j)
            ins.append(b.bitcast(b.trunc(raw, u.I32), u.F32) if ctype == u.F32 else raw)
        else:
            ins.append(u.arg_ptr(b, args, 1 + j))
    return mod, b, args, c0, c1, fn, lanes, out, ins


@functools.lru_cache(maxsize=None)
def vectors_per_step(op: str, in_dtypes: tuple, lanes: int) -> int:
    """rows.wide_step of the op's lane formula, emitted once into a throwaway function to
    count its instructions (8 lanes only: elsewhere it is 1 without a probe)."""
    if lanes != 8:
        return 1
    fn = op_table(domain(in_dtypes), op)[op][1]
    types = [u.vec(u.COMPUTE[d], lanes) for d in in_dtypes]
    probe = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), types), "probe")
    pb = ir.IRBuilder(probe.append_basic_block())
    fn(pb, *probe.args)
    return wide_step(sum(len(block.instructions) for block in probe.blocks), lanes)


def _build(key: ElementwiseKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1, fn, lanes, out, ins = _setup(key, symbol)
    k, r = len(key.roles), key.rank
    n = u.arg(b, args, k + 1)
    chunk = u.arg(b, args, k + 2)
    shape = [u.arg(b, args, k + 3 + d) for d in range(r)]
    tensors = [j for j, role in enumerate(key.roles) if role != "param"]
    if key.out_role != "linear":
        tensors.append(-1)  # the output is a strided view: its strides come last
    strides = {j: [u.arg(b, args, k + 3 + r + t * r + d) for d in range(r)]
               for t, j in enumerate(tensors)}

    e0 = b.mul(c0, chunk)
    e1 = u.smin(b, b.mul(c1, chunk), n)
    scalar_only = "strided" in key.roles or key.out_role == "strided"

    def inner(e, offs, length):
        """out[e : e+length] = op(inputs at offs ...), along the innermost axis."""
        bases = {}
        for j in tensors:
            if j >= 0:
                bases[j] = b.gep(ins[j], [offs[j]], source_etype=u.STORAGE[key.in_dtypes[j]])
        obase = b.gep(out, [offs[-1] if key.out_role != "linear" else e],
                      source_etype=u.STORAGE[key.out_dtype])

        def operands(i, width, mask=None):
            vals = []
            for j, role in enumerate(key.roles):
                if role == "param":
                    vals.append(ins[j] if width is None else u.splat(b, ins[j], width))
                elif role == "zero":
                    s = u.load(b, bases[j], u.i64(0), key.in_dtypes[j])
                    vals.append(s if width is None else u.splat(b, s, width))
                elif role == "unit":
                    vals.append(u.load(b, bases[j], i, key.in_dtypes[j], width, mask))
                else:
                    vals.append(u.load(b, bases[j], b.mul(i, strides[j][r - 1]), key.in_dtypes[j]))
            return vals

        if scalar_only:
            with u.Loop(b, u.i64(0), length, 1, "s") as i:
                o = b.mul(i, strides[-1][r - 1]) if key.out_role == "strided" else i
                u.store(b, fn(b, *operands(i, None)), obase, o, key.out_dtype)
            return
        def vector(i, mask, lanes=lanes):
            u.store(b, fn(b, *operands(i, lanes, mask)), obase, i, key.out_dtype, mask,
                    stream=key.stream and mask is None)

        map_pass(b, u.i64(0), length, lanes, vector,
                 vectors_per_step(key.op, key.in_dtypes, lanes))

    if r == 1:
        offs = {j: b.mul(e0, strides[j][0]) for j in tensors}
        inner(e0, offs, b.sub(e1, e0))
        if key.stream:  # order the weakly-ordered streaming stores before the chunk counts as done
            b.fence("seq_cst")  # (mfence on x86: it orders non-temporal stores too)
        b.ret_void()
        return mod

    # Multi-index of e0, innermost last; offsets are recomputed from it after each row.
    idx = [u.entry_alloca(b, u.I64, f"idx{d}") for d in range(r)]
    rem = e0
    for d in reversed(range(r)):
        b.store(b.srem(rem, shape[d]), idx[d])
        rem = b.sdiv(rem, shape[d])
    e_var = u.entry_alloca(b, u.I64, "e")
    b.store(e0, e_var)
    head = b.function.append_basic_block("row.head")
    body = b.function.append_basic_block("row.body")
    done = b.function.append_basic_block("row.done")
    b.branch(head)
    b.position_at_end(head)
    e = b.load(e_var)
    b.cbranch(b.icmp_signed("<", e, e1), body, done)
    b.position_at_end(body)
    cur = [b.load(p) for p in idx]
    offs = {}
    for j in tensors:
        acc = u.i64(0)
        for d in range(r):
            acc = b.add(acc, b.mul(cur[d], strides[j][d]))
        offs[j] = acc
    length = u.smin(b, b.sub(shape[r - 1], cur[r - 1]), b.sub(e1, e))
    inner(e, offs, length)
    b.store(b.add(e, length), e_var)
    # advance the multi-index by `length` (which always ends the row or the chunk)
    last = b.add(cur[r - 1], length)
    b.store(last, idx[r - 1])
    carry = b.icmp_signed("==", last, shape[r - 1])
    for d in reversed(range(r - 1)):
        with b.if_then(carry):
            b.store(u.i64(0), idx[d + 1])
            b.store(b.add(b.load(idx[d]), u.i64(1)), idx[d])
        carry = b.and_(carry, b.icmp_signed("==", b.load(idx[d]), shape[d]))
    b.branch(head)
    b.position_at_end(done)
    b.ret_void()
    return mod


TILE = 16    # lanes of a register tile at most (a V x V tile of f32 is half the AVX-512 registers)
BLOCK = 64   # a tiled kernel's chunk: BLOCK x BLOCK elements of the (A, B) plane


def tile_chunks(shape) -> int:
    """The chunk grid of a tiled kernel over `shape` (A, B last): fixed by the shape alone."""
    outer = 1
    for d in shape[:-2]:
        outer *= d
    return outer * -(-shape[-2] // BLOCK) * -(-shape[-1] // BLOCK)


def transpose(b, rows):
    """rows[i] lane j -> result[j] lane i, for V = len(rows) a power of two: log2(V) stages,
    stage t swapping bit t of the row index with bit t of the lane index (2 shuffles a pair)."""
    V = len(rows)
    t = 1
    while t < V:
        lo = ir.Constant(ir.VectorType(u.I32, V), [L if not L & t else V + (L ^ t) for L in range(V)])
        hi = ir.Constant(ir.VectorType(u.I32, V), [V + L if L & t else L | t for L in range(V)])
        new = list(rows)
        for i in range(V):
            if not i & t:
                new[i] = b.shuffle_vector(rows[i], rows[i | t], lo)
                new[i | t] = b.shuffle_vector(rows[i], rows[i | t], hi)
        rows, t = new, t << 1
    return rows


def _load_stored(b, base, index, dtype, lanes, mask):
    """A vector of `dtype` as stored (irutil.load before its widening): a tile is transposed
    before it is widened, so the shuffles move 16-bit lanes, and an f16 copy stays a copy of
    bits as in the in-order kernel (LLVM folds fptrunc(fpext x) only when they are adjacent)."""
    st = ir.VectorType(u.STORAGE[dtype], lanes)
    p = b.gep(base, [index], source_etype=u.STORAGE[dtype])
    if mask is None:
        v = b.load(p, typ=st)
        v.align = u.ITEMSIZE[dtype]
        return v
    return u.intrinsic(b, "llvm.masked.load", st, [p, ir.Constant(u.I32, u.ITEMSIZE[dtype]), mask,
                                                   ir.Constant(st, None)], types=[st, u.PTR])


def _build_tiled(key: ElementwiseKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1, fn, lanes, out, ins = _setup(key, symbol)
    k, r = len(key.roles), key.rank
    V = min(lanes, TILE)
    shape = [u.arg(b, args, k + 1 + d) for d in range(r)]
    tensors = [j for j, role in enumerate(key.roles) if role != "param"] + [-1]
    strides = {j: [u.arg(b, args, k + 1 + r + t * r + d) for d in range(r)]
               for t, j in enumerate(tensors)}
    dtypes = {**dict(enumerate(key.in_dtypes)), -1: key.out_dtype}
    ptrs = {**dict(enumerate(ins)), -1: out}
    A, B = shape[r - 2], shape[r - 1]
    blk = u.i64(BLOCK)
    nA = b.sdiv(b.add(A, u.i64(BLOCK - 1)), blk)
    nB = b.sdiv(b.add(B, u.i64(BLOCK - 1)), blk)
    none = ir.Constant(ir.VectorType(u.I1, V), [0] * V)

    def tile(bases, a, col, ra=None, rb=None):
        """The V x V tile at rows a.., columns col..; ra/rb (rows, columns in range) only on
        the edge of the plane, where loads and stores are masked and row indices clamped."""
        masked = ra is not None
        mask_a = mask_b = last_row = last_col = None
        if masked:
            mask_a, mask_b = u.tail_mask(b, ra, V), u.tail_mask(b, rb, V)
            last_row, last_col = b.add(a, b.sub(ra, u.i64(1))), b.add(col, b.sub(rb, u.i64(1)))

        def within(kk, extent, mask):
            return None if not masked else b.select(b.icmp_signed("<", u.i64(kk), extent), mask, none)

        moved = {}
        for j, role in enumerate(key.roles):
            if role == "trans":  # V vectors along A, one per column of the tile, moved as stored
                rows = [_load_stored(b, bases[j], b.add(b.mul(b.add(col, u.i64(kk)), strides[j][r - 1]), a),
                                     dtypes[j], V, within(kk, rb, mask_a)) for kk in range(V)]
                moved[j] = [u.widen(b, v, dtypes[j]) for v in transpose(b, rows)]
        for kk in range(V):
            row = b.add(a, u.i64(kk))
            crow = u.smin(b, row, last_row) if masked else row
            m = within(kk, ra, mask_b)
            vals = []
            for j, role in enumerate(key.roles):
                if role == "param":
                    vals.append(u.splat(b, ins[j], V))
                elif role == "trans":
                    vals.append(moved[j][kk])
                elif role == "unit":
                    at = b.add(b.mul(row, strides[j][r - 2]), col)
                    vals.append(u.load(b, bases[j], at, dtypes[j], V, m))
                elif role == "zero":
                    s = u.load(b, bases[j], b.mul(crow, strides[j][r - 2]), dtypes[j])
                    vals.append(u.splat(b, s, V))
                else:  # strided: element by element (in-range indices only)
                    v = ir.Constant(ir.VectorType(u.COMPUTE[dtypes[j]], V), ir.Undefined)
                    for lane in range(V):
                        c = b.add(col, u.i64(lane))
                        c = u.smin(b, c, last_col) if masked else c
                        at = b.add(b.mul(crow, strides[j][r - 2]), b.mul(c, strides[j][r - 1]))
                        v = b.insert_element(v, u.load(b, bases[j], at, dtypes[j]), u.i64(lane))
                    vals.append(v)
            at = b.add(b.mul(row, strides[-1][r - 2]), col)
            u.store(b, fn(b, *vals), bases[-1], at, key.out_dtype, m)

    with u.Loop(b, c0, c1, 1, "c") as c:
        ib, rest = b.srem(c, nB), b.sdiv(c, nB)
        ia, rest = b.srem(rest, nA), b.sdiv(rest, nA)
        offs = {j: u.i64(0) for j in tensors}
        for d in reversed(range(r - 2)):  # the outer multi-index of this chunk
            i_d, rest = b.srem(rest, shape[d]), b.sdiv(rest, shape[d])
            offs = {j: b.add(offs[j], b.mul(i_d, strides[j][d])) for j in tensors}
        bases = {j: b.gep(ptrs[j], [offs[j]], source_etype=u.STORAGE[dtypes[j]]) for j in tensors}
        a0, b0 = b.mul(ia, blk), b.mul(ib, blk)
        a1, b1 = u.smin(b, b.add(a0, blk), A), u.smin(b, b.add(b0, blk), B)
        with u.Loop(b, a0, a1, V, "a") as a:
            ra = u.smin(b, b.sub(a1, a), u.i64(V))
            with u.Loop(b, b0, b1, V, "b") as col:
                rb = u.smin(b, b.sub(b1, col), u.i64(V))
                full = b.and_(b.icmp_signed("==", ra, u.i64(V)), b.icmp_signed("==", rb, u.i64(V)))
                with b.if_else(full) as (whole, edge):
                    with whole:
                        tile(bases, a, col)
                    with edge:
                        tile(bases, a, col, ra, rb)
    b.ret_void()
    return mod
