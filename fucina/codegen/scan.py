"""Scan kernels (SPEC §3.8): cumsum, cumprod, linear_recurrence and their backward scans.

Every scan is serial along its axis for each lane, in the order the op states (left to right;
right to left for the backward scans), so a result never depends on how rows are split among
threads: the input is viewed as [A, N, B] and each work item owns whole lanes.

  inner (B == 1): a lane is a row. An item takes W rows (W = vector lanes) and walks them in
                  W x W tiles: W row vectors are loaded, transposed in registers, and the W
                  serial chains advance together as one vector chain (lane r = row r), then the
                  tile is transposed back and stored. Columns past the last whole tile are
                  gathered one at a time; rows past the last whole group run as scalar chains.
  outer (B > 1):  item = (a, block of BLOCK columns); rows stream in memory order and the
                  previous output row (L1-hot) is the carry: out[n, j] = op(out[n-1, j], x[n, j]),
                  vectorized across j. Each column is still a serial chain over n.
  cumprod_grad:   lanes are single rows (inner) or W columns (outer), state in registers.

Each chain starts from an exact identity, so no element is special: cumsum from -0.0 (-0 + x
is x for every x, signed zeros included), cumprod from 1.0, linrec from `init` (or +0.0, the
h[-1] = 0 of the reference loop).

ops (x is the scanned input, out the result; all f32):
  cumsum        out[t] = out[t-1] + x[t]          (reverse: out[t] = out[t+1] + x[t])
  cumprod       out[t] = out[t-1] * x[t]
  linrec        out[t] = a[t] * out[t-1] + x[t]   (multiply, then add: never fused). Reverse
                (the backward scan): out[t] = a[t] * out[t+1] + x[t] from -0.0, where the caller
                passes a[t] = decay[t+1] and a[N-1] = 0, so out[N-1] = x[N-1] exactly.
  cumprod_grad  x = forward input, p1 = forward output y, p2 = upstream g; per lane:
                no zero in the lane: gx[t] = (sum_{j>=t} g[j] y[j]) / x[t], the sum serial from the end;
                a zero in the lane:  gx[t] = P[t-1] * S[t], S[t] = x[t+1] * S[t+1] + g[t] (S[N-1] = g[N-1]),
                P[t-1] = x[0] * ... * x[t-1] (P[-1] = 1) — division-free, the same value as
                sum_{j>=t} g[j] prod_{k<=j, k!=t} x[k], computed in O(n).

Argument block: out, x, p1, p2, A, N, B, items per chunk. p1 = decay a (linrec) or y
(cumprod_grad); p2 = init [A, B] (linrec, when has_init) or g (cumprod_grad).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .kernels import KernelKey, register
from .target import host

BLOCK = 2048  # outer scans: columns per work item

OPS = ("cumsum", "cumprod", "linrec", "cumprod_grad")


@register
@dataclass(frozen=True)
class ScanKey(KernelKey):
    family = "scan"
    op: str
    inner: bool
    reverse: bool = False
    has_init: bool = False

    def ir(self, symbol: str) -> str:
        return str(_build(self, symbol))


def _step(b, op, prev, xv, av):
    if op == "cumsum":
        return b.fadd(prev, xv)
    if op == "cumprod":
        return b.fmul(prev, xv)
    return b.fadd(b.fmul(av, prev), xv)  # linrec: multiply, then add (never fused)


def _start(key: ScanKey) -> float:
    """The carry before the first element (see the module doc)."""
    if key.op == "cumprod":
        return 1.0
    if key.op == "linrec" and not key.reverse:
        return 0.0
    return -0.0


def _transpose(b, rows):
    """A W x W transpose of W vectors in log2(W) stages of two-source shuffles: stage k swaps
    bit k of the row index with bit k of the lane index."""
    W = len(rows)
    v = list(rows)
    h = 1
    while h < W:
        lo_mask = [c if not c & h else W + c - h for c in range(W)]
        hi_mask = [c + h if not c & h else W + c for c in range(W)]
        lo_c = ir.Constant(ir.VectorType(u.I32, W), lo_mask)
        hi_c = ir.Constant(ir.VectorType(u.I32, W), hi_mask)
        nv = list(v)
        for r in range(W):
            if r & h:
                continue
            nv[r] = b.shuffle_vector(v[r], v[r | h], lo_c)
            nv[r | h] = b.shuffle_vector(v[r], v[r | h], hi_c)
        v = nv
        h *= 2
    return v


def _tile_scan(b, key: ScanKey, W, N, r0, ptrs):
    """W whole rows r0 .. r0+W-1 (inner layout, stride N): W x W tiles, then a gathered tail."""
    out, x, p1, p2 = ptrs
    vt = ir.VectorType(u.F32, W)
    acc = u.entry_alloca(b, vt)
    if key.op == "linrec" and key.has_init:
        b.store(u.load(b, p2, r0, "f32", W), acc)  # init[r0 .. r0+W-1] (B == 1: contiguous)
    else:
        b.store(u.const(vt, _start(key)), acc)
    base = b.mul(r0, N)
    row_off = [b.add(base, b.mul(u.i64(r), N)) for r in range(W)]
    full = b.sub(N, b.srem(N, u.i64(W)))
    order = range(W - 1, -1, -1) if key.reverse else range(W)

    def tiles():
        n_tiles = b.sdiv(full, u.i64(W))
        with u.Loop(b, u.i64(0), n_tiles, 1, "tile") as k:
            j = b.mul(b.sub(b.sub(n_tiles, u.i64(1)), k) if key.reverse else k, u.i64(W))
            xt = _transpose(b, [u.load(b, x, b.add(o, j), "f32", W) for o in row_off])
            at = None
            if key.op == "linrec":
                at = _transpose(b, [u.load(b, p1, b.add(o, j), "f32", W) for o in row_off])
            yt = [None] * W
            cur = b.load(acc)
            for c in order:
                cur = _step(b, key.op, cur, xt[c], at[c] if at else None)
                yt[c] = cur
            b.store(cur, acc)
            for o, y in zip(row_off, _transpose(b, yt)):
                u.store(b, y, out, b.add(o, j), "f32")

    def gather(ptr, t):
        v = ir.Constant(vt, ir.Undefined)
        for r, o in enumerate(row_off):
            v = b.insert_element(v, u.load(b, ptr, b.add(o, t), "f32"), u.i64(r))
        return v

    def tail():
        n_tail = b.sub(N, full)
        with u.Loop(b, u.i64(0), n_tail, 1, "tail") as k:
            t = b.sub(b.sub(N, u.i64(1)), k) if key.reverse else b.add(full, k)
            cur = _step(b, key.op, b.load(acc), gather(x, t),
                        gather(p1, t) if key.op == "linrec" else None)
            b.store(cur, acc)
            for r, o in enumerate(row_off):
                u.store(b, b.extract_element(cur, u.i64(r)), out, b.add(o, t), "f32")

    if key.reverse:
        tail()
        tiles()
    else:
        tiles()
        tail()


def _row_chain(b, key: ScanKey, N, row, ptrs):
    """One row (inner layout) as a scalar chain."""
    out, x, p1, p2 = ptrs
    acc = u.entry_alloca(b, u.F32)
    if key.op == "linrec" and key.has_init:
        b.store(u.load(b, p2, row, "f32"), acc)
    else:
        b.store(u.const(u.F32, _start(key)), acc)
    base = b.mul(row, N)
    with u.Loop(b, u.i64(0), N, 1, "t") as k:
        t = b.add(base, b.sub(b.sub(N, u.i64(1)), k) if key.reverse else k)
        av = u.load(b, p1, t, "f32") if key.op == "linrec" else None
        cur = _step(b, key.op, b.load(acc), u.load(b, x, t, "f32"), av)
        b.store(cur, acc)
        u.store(b, cur, out, t, "f32")


def _row_scan(b, key: ScanKey, W, N, B, a, blk, ptrs):
    """Outer cumsum / cumprod / linrec: stream rows, the previous output row is the carry."""
    out, x, p1, p2 = ptrs
    vt = ir.VectorType(u.F32, W)
    b0 = b.mul(blk, u.i64(BLOCK))
    width = u.smin(b, u.i64(BLOCK), b.sub(B, b0))
    full = b.sub(width, b.srem(width, u.i64(W)))
    tail = b.sub(width, full)
    tmask = u.tail_mask(b, tail, W)
    lane0 = b.add(b.mul(b.mul(a, N), B), b0)  # element offset of (a, n=0, b0)
    init0 = b.add(b.mul(a, B), b0)

    def each(t, prev_t):
        def body(j, m):
            at = b.add(b.add(lane0, b.mul(t, B)), j)
            if prev_t is None:  # the first row: the carry is the start value (or init)
                if key.op == "linrec" and key.has_init:
                    pv = u.load(b, p2, b.add(init0, j), "f32", W, m)
                else:
                    pv = u.const(vt, _start(key))
            else:
                pv = u.load(b, out, b.add(b.add(lane0, b.mul(prev_t, B)), j), "f32", W, m)
            av = u.load(b, p1, at, "f32", W, m) if key.op == "linrec" else None
            u.store(b, _step(b, key.op, pv, u.load(b, x, at, "f32", W, m), av), out, at, "f32", m)

        with u.Loop(b, u.i64(0), full, W, "j") as j:
            body(j, None)
        with b.if_then(b.icmp_signed(">", tail, u.i64(0))):
            body(full, tmask)

    last = b.sub(N, u.i64(1))
    each(last if key.reverse else u.i64(0), None)
    with u.Loop(b, u.i64(1), N, 1, "t") as k:
        t = b.sub(last, k) if key.reverse else k
        each(t, b.add(t, u.i64(1)) if key.reverse else b.sub(t, u.i64(1)))


class _Lanes:
    """Lanes scanned together by cumprod_grad: `base` (element offset of t = 0) with `stride`
    between consecutive t; values are scalars (width None) or W-vectors under `mask`."""

    def __init__(self, b, base, stride, width=None, mask=None):
        self.b, self.base, self.stride, self.width, self.mask = b, base, stride, width, mask
        self.ty = u.F32 if width is None else ir.VectorType(u.F32, width)

    def load(self, ptr, t):
        return u.load(self.b, ptr, self.b.add(self.base, self.b.mul(t, self.stride)), "f32",
                      self.width, self.mask)

    def store(self, v, ptr, t):
        u.store(self.b, v, ptr, self.b.add(self.base, self.b.mul(t, self.stride)), "f32", self.mask)


def _cumprod_grad(b, lanes: _Lanes, N, ptrs):
    """The backward of cumprod over `lanes` (see the module doc): three serial passes."""
    out, x, y, g = ptrs
    ty = lanes.ty
    bt = u.I1 if lanes.width is None else ir.VectorType(u.I1, lanes.width)
    hz, acc, s = u.entry_alloca(b, bt), u.entry_alloca(b, ty), u.entry_alloca(b, ty)
    b.store(u.const(bt, 0), hz)
    with u.Loop(b, u.i64(0), N, 1, "z") as t:  # pass 0: does the lane hold a zero?
        b.store(b.or_(b.load(hz), b.fcmp_ordered("==", lanes.load(x, t), u.const(ty, 0.0))), hz)
    zero_in = b.load(hz)
    last = b.sub(N, u.i64(1))
    # pass 1 (right to left): both candidates; the zero-free one is final
    gl = lanes.load(g, last)
    w = b.fmul(gl, lanes.load(y, last))
    b.store(w, acc)
    b.store(gl, s)
    lanes.store(b.select(zero_in, gl, b.fdiv(w, lanes.load(x, last))), out, last)
    with u.Loop(b, u.i64(1), N, 1, "r") as kk:
        t = b.sub(last, kk)
        gt = lanes.load(g, t)
        a = b.fadd(b.load(acc), b.fmul(gt, lanes.load(y, t)))
        b.store(a, acc)
        sv = b.fadd(b.fmul(lanes.load(x, b.add(t, u.i64(1))), b.load(s)), gt)
        b.store(sv, s)
        lanes.store(b.select(zero_in, sv, b.fdiv(a, lanes.load(x, t))), out, t)
    # pass 2 (left to right): lanes with a zero take the exclusive prefix product P[t-1]
    b.store(u.const(ty, 1.0), acc)
    with u.Loop(b, u.i64(0), N, 1, "f") as t:
        pp, cur = b.load(acc), lanes.load(out, t)
        lanes.store(b.select(zero_in, b.fmul(pp, cur), cur), out, t)
        b.store(b.fmul(pp, lanes.load(x, t)), acc)


def _build(key: ScanKey, symbol: str) -> ir.Module:
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    ptrs = [u.arg_ptr(b, args, i) for i in range(4)]
    A, N, B, per = (u.arg(b, args, i) for i in range(4, 8))
    if key.inner:
        # items: groups of W rows (tiles) when the op has a tiled form, else single rows
        width = 1 if key.op == "cumprod_grad" else W
        groups = b.sdiv(b.add(A, u.i64(width - 1)), u.i64(width))
        q0 = b.mul(c0, per)
        q1 = u.smin(b, b.mul(c1, per), groups)
        with u.Loop(b, q0, q1, 1, "q") as q:
            r0 = b.mul(q, u.i64(width))
            if key.op == "cumprod_grad":
                _cumprod_grad(b, _Lanes(b, b.mul(r0, N), u.i64(1)), N, ptrs)
            else:
                whole = b.icmp_signed("<=", b.add(r0, u.i64(W)), A)
                with b.if_else(whole) as (then, otherwise):
                    with then:
                        _tile_scan(b, key, W, N, r0, ptrs)
                    with otherwise:
                        with u.Loop(b, r0, A, 1, "row") as r:
                            _row_chain(b, key, N, r, ptrs)
    elif key.op == "cumprod_grad":
        nblk = b.sdiv(b.add(B, u.i64(W - 1)), u.i64(W))
        q0 = b.mul(c0, per)
        q1 = u.smin(b, b.mul(c1, per), b.mul(A, nblk))
        with u.Loop(b, q0, q1, 1, "q") as q:
            a = b.sdiv(q, nblk)
            b0 = b.mul(b.srem(q, nblk), u.i64(W))
            mask = u.tail_mask(b, u.smin(b, u.i64(W), b.sub(B, b0)), W)
            _cumprod_grad(b, _Lanes(b, b.add(b.mul(b.mul(a, N), B), b0), B, W, mask), N, ptrs)
    else:
        nblk = b.sdiv(b.add(B, u.i64(BLOCK - 1)), u.i64(BLOCK))
        q0 = b.mul(c0, per)
        q1 = u.smin(b, b.mul(c1, per), b.mul(A, nblk))
        with u.Loop(b, q0, q1, 1, "q") as q:
            _row_scan(b, key, W, N, B, b.sdiv(q, nblk), b.srem(q, nblk), ptrs)
    b.ret_void()
    return mod
