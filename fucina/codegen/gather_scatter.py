"""Gather, scatter and compaction kernels (SPEC §3.16).

Indexed copies see their operands as [A, N, B] (the indexed axis N in the middle, every axis
before it folded into A, every axis after it into B; the exec layer materializes an operand
whose axes do not fold). The index picks, for position j of the dense side [A, J, B], a
position of N on the data side:

  gather        out[a, j, b] = data[a, idx, b]          data read, out written densely
  store / add   data[a, idx, b] (=|+=) src[a, j, b]     the put ops (set_rows, index_add,
  zero          data[a, idx, b] = 0                     scatter, scatter_add, backwards)

where idx = idx[j] (`rows`: one index per position, index_select and friends) or idx[a, j, b]
(per element, take_along_axis and scatter). Two loop shapes: `vec="b"` runs vectors along the
contiguous inner block B (a plain vector copy when the index is per row, lane-by-lane loads
and stores at per-lane addresses when it is per element); `vec="j"` (B == 1) runs vectors
along j for gathers (lane-by-lane loads) and a scalar loop for puts. Lane-by-lane: on Zen 5,
16 scalar loads assembled into a vector measured faster than vpgatherqps.

Determinism of the puts: the work items partition the *destination* — item (a, band, block)
owns rows [lo, hi) of N (a band) and columns [b0, b1) of B of slab a — and every item walks
j = 0 .. J-1 in order, applying only the indices that land in its band. So each destination
element receives its contributions in serial index order whoever runs it: duplicates
accumulate (add) or resolve to the last write (store) exactly as a serial loop would, bitwise
for any thread count. Scanning the J indices is the price of an item; the exec layer bounds
the band count so that scan stays small next to the rows moved.

Indices are never trusted: an index outside [0, N) (negatives included: the compare is
unsigned) is skipped, its gathered value is 0, and the kernel stores 1 into the flag slot; the
exec layer raises IndexOutOfBounds after the launch.

Argument block (indexed copies): data, dense, idx, flag, A, N, J, B, data strides (A, N),
dense strides (A, J) — inner strides are 1 — then the grid: gather `per`, the j block and the
bytes of a data row to prefetch (vec "j"); puts rows per band, bands, columns per block,
blocks, items per chunk.

Prefetch: a vec "j" gather reads its data row in index order, which the hardware prefetcher
cannot follow; with a unit-stride row the kernel prefetches, once per row, the row
PREFETCH_ROWS ahead (measured 1.5x on 1024 random columns of [4096, 1024] f32). The exec
layer passes 0 bytes when a row is too long or too sparsely indexed for that to pay.

Compaction (masked_select, nonzero, masked_select's backward) runs over a fixed grid of CHUNK
elements in three launches: `count` (truthy mask elements per chunk), `offsets` (one serial
exclusive prefix sum over the chunk counts, total last) and then `select` (compress-store the
values), `positions` (compress-store flat indices) or `expand` (expand-load a gradient back into
the masked positions, 0 elsewhere). Argument block: mask, x, out, counts, n (chunks for
`offsets`), CHUNK.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .kernels import KernelKey, register
from .reduce import truthy
from .rows import map_pass
from .target import host


def _lanes() -> int:
    return host().f32_lanes


def _ld(b, base, index, st, lanes=None, mask=None):
    """Raw storage load (no widening: data moves bit for bit); masked lanes read 0."""
    t = u.vec(st, lanes)
    p = b.gep(base, [index], source_etype=st)
    if mask is None:
        v = b.load(p, typ=t)
        v.align = _size(st)
        return v
    return u.intrinsic(b, "llvm.masked.load", t, [p, ir.Constant(u.I32, _size(st)), mask, u.const(t, 0)],
                       types=[t, u.PTR])


def _st(b, v, base, index, st, mask=None):
    p = b.gep(base, [index], source_etype=st)
    if mask is None:
        s = b.store(v, p)
        s.align = _size(st)
    else:
        u.intrinsic(b, "llvm.masked.store", u.VOID, [v, p, ir.Constant(u.I32, _size(st)), mask],
                    types=[v.type, u.PTR])


def _size(st) -> int:
    return {u.F32: 4, u.F16: 2, u.I16: 2, u.I64: 8, u.I8: 1}[st]


def _lane_loads(b, base, off, ok, st):
    """<L x st>: lane k = base[off[k]] where ok[k], else 0. One scalar load per lane, put
    together in a vector: measured on Zen 5 this beats vpgatherqps (and plain scalar loops).
    Lanes that are off read element 0 instead (always in bounds), then are zeroed."""
    L = off.type.count
    t = ir.VectorType(st, L)
    off = b.select(ok, off, u.const(off.type, 0))
    v = ir.Constant(t, ir.Undefined)
    for k in range(L):
        o = b.extract_element(off, u.i64(k))
        v = b.insert_element(v, b.load(b.gep(base, [o], source_etype=st), typ=st), u.i64(k))
    return b.select(ok, v, u.const(t, 0))


def _lane_puts(b, base, off, hit, new, op, st):
    """base[off[k]] = new[k] (or += for op "add") for the lanes k of `hit`, one lane at a time
    in lane order (the lanes of one call always address distinct elements)."""
    for k in range(off.type.count):
        with b.if_then(b.extract_element(hit, u.i64(k))):
            p = b.gep(base, [b.extract_element(off, u.i64(k))], source_etype=st)
            v = b.extract_element(new, u.i64(k))
            if op == "add":
                v = _combine(b, "add", b.load(p, typ=st), v, st)
            b.store(v, p)


def _checked_pass(b, start, stop, L, body, flag):
    """body(c, mask) -> <L x i1> of lanes with a bad index, over [start, stop): two vectors per
    step (more loads in flight), then single ones, then a masked tail; the bad lanes are OR-ed
    into a bit mask and the flag is stored once at the end (no branch per vector)."""
    bits = ir.IntType(L)
    acc = u.entry_alloca(b, bits)
    b.store(ir.Constant(bits, 0), acc)

    def run(c, m=None):
        b.store(b.or_(b.load(acc), b.bitcast(body(c, m), bits)), acc)
    n = b.sub(stop, start)
    big = b.add(start, b.and_(n, u.i64(-2 * L)))
    with u.Loop(b, start, big, 2 * L, "v2") as c:
        run(c)
        run(b.add(c, u.i64(L)))
    full = b.add(start, b.and_(n, u.i64(-L)))
    with u.Loop(b, big, full, L, "v1") as c:
        run(c)
    rest = b.sub(stop, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        run(full, u.tail_mask(b, rest, L))
    _flag_if(b, b.icmp_unsigned("!=", b.load(acc), ir.Constant(bits, 0)), flag)


def _any(b, mask):
    """Is any lane of an <L x i1> on? (one kmov + test)"""
    n = mask.type.count
    return b.icmp_unsigned("!=", b.bitcast(mask, ir.IntType(n)), ir.Constant(ir.IntType(n), 0))


def _flag_if(b, cond, flag):
    with b.if_then(cond):
        b.store(u.i64(1), flag)


def _prefetch(b, p):
    u.intrinsic(b, "llvm.prefetch", u.VOID, [p, ir.Constant(u.I32, 0), ir.Constant(u.I32, 3), ir.Constant(u.I32, 1)],
                types=[u.PTR])


def _prefetch_head(b, p, nbytes):
    """Prefetch the first min(nbytes, 1 KiB) of the row at p: a gathered row starts at an
    unrelated address, where the hardware prefetcher starts cold; its first 16 lines are
    enough to get the stream going (measured: most of prefetching the whole row's gain on
    rows fresh from memory, none of its cost on rows already in cache)."""
    with u.Loop(b, u.i64(0), u.smin(b, nbytes, u.i64(1024)), 64, "pf") as o:
        _prefetch(b, b.gep(p, [o], source_etype=u.I8))


def _row_pass(b, dst, n, st, L, value, stream=False):
    """dst[0:n] = value(c, mask) vector by vector: 4 per step (all loads before the stores,
    measured ~7 % faster), then single ones, then a masked tail. L is a power of two, so the
    bounds are masks, not divisions (this runs once per row: a division costs more than a
    vector). stream: the 4-vector steps are aligned non-temporal stores."""
    big = b.and_(n, u.i64(-4 * L))
    with u.Loop(b, u.i64(0), big, 4 * L, "cp") as c:
        cs = [b.add(c, u.i64(k * L)) for k in range(4)]
        vs = [value(ck, None) for ck in cs]
        for ck, v in zip(cs, vs):
            if stream:
                s = b.store(v, b.gep(dst, [ck], source_etype=st))
                s.align = L * _size(st)
                s.set_metadata("nontemporal", b.module.add_metadata([ir.Constant(u.I32, 1)]))
            else:
                _st(b, v, dst, ck, st)
    full = b.and_(n, u.i64(-L))
    with u.Loop(b, big, full, L, "cp1") as c:
        _st(b, value(c, None), dst, c, st)
    rest = b.sub(n, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        m = u.tail_mask(b, rest, L)
        _st(b, value(full, m), dst, full, st, m)


class _Grid:
    """`for q in [q0, q1)` with (o, i) = divmod(q, n) carried along: one division per chunk
    instead of one per item. with _Grid(b, q0, q1, n) as (q, o, i): ..."""

    def __init__(self, b, q0, q1, n, name="q"):
        self.b, self.q0, self.q1, self.n, self.name = b, q0, q1, n, name

    def __enter__(self):
        b = self.b
        self.o, self.i = u.entry_alloca(b, u.I64), u.entry_alloca(b, u.I64)
        b.store(b.sdiv(self.q0, self.n), self.o)
        b.store(b.srem(self.q0, self.n), self.i)
        self.loop = u.Loop(b, self.q0, self.q1, 1, self.name)
        q = self.loop.__enter__()
        self.cur = (b.load(self.o), b.load(self.i))
        return q, *self.cur

    def __exit__(self, *exc):
        if exc[0] is None:
            b = self.b
            o, i = self.cur
            i1 = b.add(i, u.i64(1))
            wrap = b.icmp_signed("==", i1, self.n)
            b.store(b.select(wrap, u.i64(0), i1), self.i)
            b.store(b.select(wrap, b.add(o, u.i64(1)), o), self.o)
        return self.loop.__exit__(*exc)


def _copy_row(b, src, dst, n, st, L):
    _row_pass(b, dst, n, st, L, lambda c, m: _ld(b, src, c, st, L, m))


def _combine(b, op, old, new, st):
    if op == "add":
        return b.add(old, new) if st == u.I64 else b.fadd(old, new)
    return new


@register
@dataclass(frozen=True)
class GatherScatterKey(KernelKey):
    """op: gather | store | add | zero; dtype: the data's dtype (add: f32 or i64);
    vec: "b" (vectors along B) | "j" (B == 1); rows: one index per j (else per element);
    unit: the data's indexed axis has stride 1 (gathers along j: no offset multiply)."""

    family = "gather_scatter"
    op: str
    dtype: str
    vec: str
    rows: bool
    unit: bool = False

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        (_gather if self.op == "gather" else _put)(self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _common(b, args):
    data, dense, idx, flag = (u.arg_ptr(b, args, i) for i in range(4))
    A, N, J, B, dA, dN, eA, eJ = (u.arg(b, args, i) for i in range(4, 12))
    return data, dense, idx, flag, A, N, J, B, dA, dN, eA, eJ


PREFETCH_ROWS = 2  # vec "j" gathers: prefetch the data row this many rows ahead


def _gather(key, b, args, c0, c1):
    st = u.STORAGE[key.dtype]
    L = _lanes()
    data, out, idx, flag, A, N, J, B, dA, dN, eA, eJ = _common(b, args)
    per = u.arg(b, args, 12)
    if key.vec == "j":  # B == 1: item (a, block of JB positions), vectors along j
        JB, pf = u.arg(b, args, 13), u.arg(b, args, 14)
        nblk = b.sdiv(b.add(J, b.sub(JB, u.i64(1))), JB)
        q0, q1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), b.mul(A, nblk))
        with _Grid(b, q0, q1, nblk) as (q, a, jb):
            j0 = b.mul(jb, JB)
            j1 = u.smin(b, b.add(j0, JB), J)
            ib = idx if key.rows else b.gep(idx, [b.mul(a, J)], source_etype=u.I64)
            db = b.gep(data, [b.mul(a, dA)], source_etype=st)
            ob = b.gep(out, [b.mul(a, eA)], source_etype=st)
            if key.unit:  # the first pf bytes of the data row PREFETCH_ROWS ahead, once per row
                ahead = b.add(a, u.i64(PREFETCH_ROWS))
                with b.if_then(b.and_(b.icmp_signed("==", jb, u.i64(0)), b.icmp_signed("<", ahead, A))):
                    row = b.gep(data, [b.mul(ahead, dA)], source_etype=st)
                    with u.Loop(b, u.i64(0), pf, 64, "pf") as o:
                        _prefetch(b, b.gep(row, [o], source_etype=u.I8))

            def body(j, m):
                iv = _ld(b, ib, j, u.I64, L, m)
                ok = b.icmp_unsigned("<", iv, u.splat(b, N, L))
                live = ok if m is None else b.and_(ok, m)
                off = iv if key.unit else b.mul(iv, u.splat(b, dN, L))
                _st(b, _lane_loads(b, db, off, live, st), ob, j, st, m)
                return b.xor(live, m if m is not None else u.const(live.type, 1))
            _checked_pass(b, j0, j1, L, body, flag)
        return
    # vec "b": item = one dense row (a, j); `per` rows per chunk
    q0, q1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), b.mul(A, J))
    with _Grid(b, q0, q1, J) as (q, a, j):
        db = b.gep(data, [b.mul(a, dA)], source_etype=st)
        ob = b.gep(out, [b.add(b.mul(a, eA), b.mul(j, eJ))], source_etype=st)
        if key.rows:
            i = b.load(b.gep(idx, [j], source_etype=u.I64), typ=u.I64)
            ok = b.icmp_unsigned("<", i, N)
            with b.if_else(ok) as (then, other):
                with then:
                    src = b.gep(db, [b.mul(i, dN)], source_etype=st)
                    jn = u.smin(b, b.add(j, u.i64(1)), b.sub(J, u.i64(1)))
                    nxt = b.load(b.gep(idx, [jn], source_etype=u.I64), typ=u.I64)
                    _prefetch_head(b, b.gep(db, [b.mul(nxt, dN)], source_etype=st), b.mul(B, u.i64(_size(st))))
                    _copy_row(b, src, ob, B, st, L)
                with other:
                    b.store(u.i64(1), flag)
                    map_pass(b, u.i64(0), B, L, lambda c, m: _st(b, u.const(ir.VectorType(st, L), 0), ob, c, st, m))
        else:
            ib = b.gep(idx, [b.mul(q, B)], source_etype=u.I64)

            def body(c, m):
                iv = _ld(b, ib, c, u.I64, L, m)
                ok = b.icmp_unsigned("<", iv, u.splat(b, N, L))
                live = ok if m is None else b.and_(ok, m)
                off = b.add(b.mul(iv, u.splat(b, dN, L)), b.add(u.splat(b, c, L), u.iota(L)))
                _st(b, _lane_loads(b, db, off, live, st), ob, c, st, m)
                return b.xor(live, m if m is not None else u.const(live.type, 1))
            _checked_pass(b, u.i64(0), B, L, body, flag)


def _put(key, b, args, c0, c1):
    st = u.STORAGE[key.dtype]
    L = _lanes()
    vt = ir.VectorType(st, L)
    data, src, idx, flag, A, N, J, B, dA, dN, eA, eJ = _common(b, args)
    rpb, nb, BB, nbb, per = (u.arg(b, args, i) for i in range(12, 17))
    items = b.mul(b.mul(A, nb), nbb)
    with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), items), 1, "q") as q:
        blk = b.srem(q, nbb)
        t = b.sdiv(q, nbb)
        band, a = b.srem(t, nb), b.sdiv(t, nb)
        lo = b.mul(band, rpb)
        span = b.sub(u.smin(b, b.add(lo, rpb), N), lo)
        first = b.icmp_signed("==", band, u.i64(0))  # band 0 reports bad indices
        db = b.gep(data, [b.mul(a, dA)], source_etype=st)
        sb = b.gep(src, [b.mul(a, eA)], source_etype=st)
        b0 = b.mul(blk, BB)
        b1 = u.smin(b, b.add(b0, BB), B)
        with u.Loop(b, u.i64(0), J, 1, "j") as j:
            if key.rows or key.vec == "j":
                ii = j if key.rows else b.add(b.mul(a, J), j)
                i = b.load(b.gep(idx, [ii], source_etype=u.I64), typ=u.I64)
                _flag_if(b, b.and_(first, b.icmp_unsigned(">=", i, N)), flag)
                with b.if_then(b.icmp_unsigned("<", b.sub(i, lo), span)):
                    drow = b.gep(db, [b.mul(i, dN)], source_etype=st)
                    srow = b.gep(sb, [b.mul(j, eJ)], source_etype=st)
                    if key.vec == "j":
                        new = u.const(st, 0) if key.op == "zero" else _ld(b, srow, u.i64(0), st)
                        _st(b, _combine(b, key.op, _ld(b, drow, u.i64(0), st), new, st), drow, u.i64(0), st)
                    else:
                        def body(c, m):
                            new = u.const(vt, 0) if key.op == "zero" else _ld(b, srow, c, st, L, m)
                            if key.op == "add":
                                new = _combine(b, "add", _ld(b, drow, c, st, L, m), new, st)
                            _st(b, new, drow, c, st, m)
                        map_pass(b, b0, b1, L, body)
            else:  # per-element indices along B: masked gather/scatter, lanes hit distinct columns
                ib = b.gep(idx, [b.mul(b.add(b.mul(a, J), j), B)], source_etype=u.I64)
                srow = b.gep(sb, [b.mul(j, eJ)], source_etype=st)

                def body(c, m):
                    iv = _ld(b, ib, c, u.I64, L, m)
                    on = m if m is not None else u.const(ir.VectorType(u.I1, L), 1)
                    bad = b.and_(b.icmp_unsigned(">=", iv, u.splat(b, N, L)), on)
                    _flag_if(b, b.and_(first, _any(b, bad)), flag)
                    hit = b.and_(b.icmp_unsigned("<", b.sub(iv, u.splat(b, lo, L)), u.splat(b, span, L)), on)
                    off = b.add(b.mul(iv, u.splat(b, dN, L)), b.add(u.splat(b, c, L), u.iota(L)))
                    new = u.const(vt, 0) if key.op == "zero" else _ld(b, srow, c, st, L, m)
                    _lane_puts(b, db, off, hit, new, key.op, st)
                map_pass(b, b0, b1, L, body)


# ---------------------------------------------------------------------------------------------
# blocks: the affine copies (concat, pad, roll, set_slice, narrow backward ...)

FILL_BITS = {"f32": u.I32, "f16": u.I16, "bf16": u.I16, "i64": u.I64, "bool": u.I8}


@register
@dataclass(frozen=True)
class BlockKey(KernelKey):
    """Rows of a 2-D block [A, W] with contiguous rows and any row strides: op "copy" moves
    bytes (any dtype), op "fill" stores one `dtype` value; stream: non-temporal stores (a fill
    far larger than the caches, 64-byte aligned). A work item is (row, span of CW columns).
    Argument block: src (copy) or the value's bits (fill), dst, A, W, src row stride, dst row
    stride (bytes for copy, elements for fill), CW, items per chunk."""

    family = "gather_scatter_block"
    op: str
    dtype: str = ""
    stream: bool = False

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        dst = u.arg_ptr(b, args, 1)
        A, W, sA, dA, CW, per = (u.arg(b, args, i) for i in range(2, 8))
        st = u.I8 if self.op == "copy" else u.STORAGE[self.dtype]
        L = host().vector_bits // (8 * _size(st))
        if self.op == "copy":
            src = u.arg_ptr(b, args, 0)
        else:
            bits = u.arg(b, args, 0)
            one = b.bitcast(b.trunc(bits, FILL_BITS[self.dtype]) if self.dtype != "i64" else bits, st)
            full = u.splat(b, one, L)
        nk = b.sdiv(b.add(W, b.sub(CW, u.i64(1))), CW)
        with _Grid(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), b.mul(A, nk)), nk) as (q, a, k):
            k0 = b.mul(k, CW)
            n = u.smin(b, CW, b.sub(W, k0))
            drow = b.gep(dst, [b.add(b.mul(a, dA), k0)], source_etype=st)
            if self.op == "copy":
                _copy_row(b, b.gep(src, [b.add(b.mul(a, sA), k0)], source_etype=st), drow, n, st, L)
            else:
                _row_pass(b, drow, n, st, L, lambda c, m: full, stream=self.stream)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class JoinKey(KernelKey):
    """Output rows [A, RW bytes] assembled from K pieces side by side (concat, stack): piece p
    supplies bytes [off_p, off_p + w_p) of every row from src_p + a * stride_p. One launch for
    the whole result, written front to back (measured faster than piece after piece).
    spans=False: an item is a whole output row; spans=True (rows longer than CW): an item is a
    span of CW bytes of a row, clipped against each piece. Argument block: dst, A, RW, K, CW,
    items per chunk, the piece table's address, or 0 when the table follows in the argument
    block itself (a few pieces: no table buffer to fill per call). The table (i64): the K
    source addresses, then K x [row stride, off, w] (fixed per layout, filled once)."""

    family = "gather_scatter_join"
    spans: bool = False

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        dst = u.arg_ptr(b, args, 0)
        A, RW, K, CW, per, tp = (u.arg(b, args, i) for i in range(1, 7))
        table = b.select(b.icmp_signed("==", tp, u.i64(0)), b.gep(args, [u.i64(7)], source_etype=u.I64),
                         b.inttoptr(tp, u.PTR))
        L = host().vector_bits // 8
        nk = b.sdiv(b.add(RW, b.sub(CW, u.i64(1))), CW) if self.spans else u.i64(1)
        q0, q1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), b.mul(A, nk))

        def piece(p):
            fixed = b.add(K, b.mul(p, u.i64(3)))
            return (_ld(b, table, p, u.I64), *(_ld(b, table, b.add(fixed, u.i64(f)), u.I64) for f in range(3)))
        if not self.spans:  # rows outer, pieces inner: the output is written front to back
            with u.Loop(b, q0, q1, 1, "a") as a:
                drow = b.gep(dst, [b.mul(a, RW)], source_etype=u.I8)
                with u.Loop(b, u.i64(0), K, 1, "p") as p:
                    src, stride, off, w = piece(p)
                    s = b.inttoptr(b.add(src, b.mul(a, stride)), u.PTR)
                    _copy_row(b, s, b.gep(drow, [off], source_etype=u.I8), w, u.I8, L)
        else:
            with _Grid(b, q0, q1, nk) as (q, a, k):
                x0 = b.mul(k, CW)
                x1 = u.smin(b, b.add(x0, CW), RW)
                with u.Loop(b, u.i64(0), K, 1, "p") as p:
                    src, stride, off, w = piece(p)
                    lo = b.select(b.icmp_signed(">", off, x0), off, x0)
                    hi = u.smin(b, x1, b.add(off, w))
                    with b.if_then(b.icmp_signed("<", lo, hi)):
                        s = b.inttoptr(b.add(b.add(src, b.mul(a, stride)), b.sub(lo, off)), u.PTR)
                        d = b.gep(dst, [b.add(b.mul(a, RW), lo)], source_etype=u.I8)
                        _copy_row(b, s, d, b.sub(hi, lo), u.I8, L)
        b.ret_void()
        return str(mod)


# ---------------------------------------------------------------------------------------------
# compaction

@register
@dataclass(frozen=True)
class CompactKey(KernelKey):
    """op: count | offsets | select | positions | expand; dtype: the values' dtype (select,
    expand); mask: the mask's dtype (truthy = nonzero, NaN included)."""

    family = "compact"
    op: str
    dtype: str = ""
    mask: str = ""

    def ir(self, symbol: str) -> str:
        return u.module(symbol, _compact, self)


def _popcount(b, m):
    n = m.type.count
    bits = b.zext(b.bitcast(m, ir.IntType(n)), u.I64)
    return u.intrinsic(b, "llvm.ctpop", u.I64, [bits])


def _compact(key, b, args, c0, c1):
    L = _lanes()
    mask, x, out, counts = (u.arg_ptr(b, args, i) for i in range(4))
    n, CH = u.arg(b, args, 4), u.arg(b, args, 5)
    if key.op == "offsets":  # one item: exclusive prefix sum of n chunk counts, total at [n]
        run = u.entry_alloca(b, u.I64)
        b.store(u.i64(0), run)
        with u.Loop(b, u.i64(0), n, 1, "q") as q:
            p = b.gep(counts, [q], source_etype=u.I64)
            c = b.load(p, typ=u.I64)
            b.store(b.load(run), p)
            b.store(b.add(b.load(run), c), run)
        b.store(b.load(run), b.gep(counts, [n], source_etype=u.I64))
        return
    pos = u.entry_alloca(b, u.I64)
    st = u.STORAGE[key.dtype] if key.dtype else None
    with u.Loop(b, c0, c1, 1, "q") as q:
        e0 = b.mul(q, CH)
        e1 = u.smin(b, b.add(e0, CH), n)
        slot = b.gep(counts, [q], source_etype=u.I64)
        b.store(u.i64(0) if key.op == "count" else b.load(slot, typ=u.I64), pos)

        def body(e, m):
            on = truthy(b, u.load(b, mask, e, key.mask, L, m))
            if m is not None:
                on = b.and_(on, m)
            p = b.load(pos)
            if key.op == "select":
                v = _ld(b, x, e, st, L, m)
                u.intrinsic(b, "llvm.masked.compressstore", u.VOID,
                            [v, b.gep(out, [p], source_etype=st), on], types=[v.type])
            elif key.op == "positions":
                v = b.add(u.splat(b, e, L), u.iota(L))
                u.intrinsic(b, "llvm.masked.compressstore", u.VOID,
                            [v, b.gep(out, [p], source_etype=u.I64), on], types=[v.type])
            elif key.op == "expand":
                t = ir.VectorType(st, L)
                v = u.intrinsic(b, "llvm.masked.expandload", t,
                                [b.gep(x, [p], source_etype=st), on, u.const(t, 0)], types=[t])
                _st(b, v, out, e, st, m)
            b.store(b.add(p, _popcount(b, on)), pos)
        map_pass(b, e0, e1, L, body)
        if key.op == "count":
            b.store(b.load(pos), slot)
