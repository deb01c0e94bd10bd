"""Optimizer kernels (SPEC T-3…T-5, T-7): the deterministic f64 sum of squares and the fused,
single-pass updates of SGD, Adam and AdamW.

sum_squares (T-7). The input is cut into chunks of a fixed length (2^15, chosen by the exec
layer, never by the thread count); chunk c writes its partial to partials[c]:
  acc0..acc3: f64 vectors of 4 lanes; each step of 16 elements adds w² (w widened to f64) of
  elements 4j..4j+3 into acc_j; then the remaining whole groups of 4 go to acc0; then
  acc = (acc0 + acc1) + (acc2 + acc3), total = ((acc[0] + acc[1]) + acc[2]) + acc[3]; then the
  scalar tail, total += w². (acc0|acc1 and acc2|acc3 are held as two 8-lane vectors: the same
  lane-wise operations with half the instructions.) A second kernel folds the partials serially
  in chunk order into one f64 per tensor, then the tensors' totals serially in order. The square
  of a widened f32 is exact in f64, so a fused multiply-add would give the same bits.

Updates (the arithmetic of each rule is a template in fucina/kernel_templates/optim.py; the
kernels here own the loads, stores and the choice of rules). One pass over the elements
[c0·chunk, min(c1·chunk, n)): read the param (or its f32 master), the gradient and the state;
write the state (narrowed to its dtype, SPEC R-9) and the param — for a 16-bit param the master
and its narrowing into the param storage. Every element is independent, so any chunking gives
the same bits. Element maps are f32 in SPEC order (separate multiplies and adds: no
contraction); the state value used within an element's update is the pre-narrow f32 one (T-3). Adam with a bf16 moment also prefetches its streams in software.

  SGD (T-4):   g = grad [+ wd·p];  buf = g (first step) | momentum·buf + (1−dampening)·g;
               g = g + momentum·buf (nesterov) | buf;  p = p − lr·g
  Adam (T-5):  g = grad [+ wd·p] (Adam) | d = p·keep (AdamW);  m = m + (1−β1)·(g − m);
               v = β2·v + ((1−β2)·g)·g;  p = d − step_size·(m / (sqrt(v)/sqrt(bc2) + eps))

Argument blocks (pointers first; f32 scalars as bits)
  sumsq:  x, partials (f64), n, chunk
  fold:   partials (f64), offsets (i64, P+1), P, out (f64, P+1: the P totals, then their sum)
  sgd:    p, master, g, buf, n, chunk, lr, momentum, 1−dampening, wd
  adam:   p, master, g, m, v, n, chunk, keep, wd, 1−β1, β2, 1−β2, eps, sqrt(bc2), step_size
(master is 0 for an f32 param; buf is 0 without momentum.)

Table forms (`table=True`, op "rows", ScaleKey): one launch for many tensors (an optimizer's
slots, a clip's gradients) instead of one each. Argument 0 is a table of i64 rows, one row per
chunk: the update's pointers at the chunk's first element, then its element count (sumsq: x,
count, partial index; scale: x, count). The scalars follow in the order above. Each element
meets the same arithmetic as in the one-tensor form, so the bits are the same.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ..kernel_templates import optim as _t
from . import irutil as u
from .kernels import KernelKey, register
from .lowering import lower_table
from .rows import chunk_pass, map_pass
from .target import host

F64 = ir.DoubleType()
D4 = ir.VectorType(F64, 4)
D8 = ir.VectorType(F64, 8)
PARAM_DTYPES = ("f32", "f16", "bf16")
RULES = {name: emit for name, (_, emit) in lower_table(_t.TEMPLATES, _t.CONSTANTS).items()}
"""The update rules of fucina/kernel_templates/optim.py: name -> emit(builder, *values)."""
STATE_DTYPES = ("f32", "bf16")


@register
@dataclass(frozen=True)
class SumSquaresKey(KernelKey):
    """op: chunks (one partial per chunk of a `dtype` tensor) | rows (one partial per row of
    a table: chunks of many `dtype` tensors) | fold (partials to totals)."""

    family = "sum_squares"
    op: str = "chunks"
    dtype: str = "f32"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        {"chunks": _sumsq_chunks, "rows": _sumsq_rows, "fold": _sumsq_fold}[self.op](
            self, b, args, c0, c1)
        b.ret_void()
        return str(mod)


def _lanes(b, v, idx):
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, len(idx)), list(idx)))


def _widen64(b, base, i, dtype, lanes):
    return b.fpext(u.load(b, base, i, dtype, lanes), ir.VectorType(F64, lanes))


def _sumsq_chunks(key, b, args, c0, c1):
    x, part = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    n, chunk = u.arg(b, args, 2), u.arg(b, args, 3)
    span = _sumsq_span(key, b)
    with u.Loop(b, c0, c1, 1, "c") as c:
        s = b.mul(c, chunk)
        span(x, s, u.smin(b, b.add(s, chunk), n), b.gep(part, [c], source_etype=F64))


def _sumsq_rows(key, b, args, c0, c1):
    table, part = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    span = _sumsq_span(key, b)
    with u.Loop(b, c0, c1, 1, "c") as c:
        x, n, slot = _row(b, table, c, 3)
        span(b.inttoptr(x, u.PTR), u.i64(0), n, b.gep(part, [slot], source_etype=F64))


def _row(b, table, c, width):
    """The `width` i64 words of row c of a table."""
    base = b.mul(c, u.i64(width))
    return [u.load(b, table, b.add(base, u.i64(i)), "i64") for i in range(width)]


def _sumsq_span(key, b):
    """span(x, s, e, dst): *dst = Σ x[s:e]² in the T-7 order of one chunk."""
    pair_a, pair_b = u.entry_alloca(b, D8), u.entry_alloca(b, D8)
    acc0, total = u.entry_alloca(b, D4), u.entry_alloca(b, F64)

    def span(x, s, e, dst):
        length = b.sub(e, s)
        big = b.add(s, b.sub(length, b.srem(length, u.i64(16))))
        full = b.add(s, b.sub(length, b.srem(length, u.i64(4))))
        for p in (pair_a, pair_b):
            b.store(u.const(D8, 0.0), p)
        with u.Loop(b, s, big, 16, "s16") as i:  # acc0|acc1 += w[0:8]², acc2|acc3 += w[8:16]²
            for p, off in ((pair_a, 0), (pair_b, 8)):
                w = _widen64(b, x, b.add(i, u.i64(off)), key.dtype, 8)
                b.store(b.fadd(b.load(p), b.fmul(w, w)), p)
        va, vb = b.load(pair_a), b.load(pair_b)
        b.store(_lanes(b, va, range(4)), acc0)
        with u.Loop(b, big, full, 4, "s4") as i:  # whole groups of 4 into acc0
            w = _widen64(b, x, i, key.dtype, 4)
            b.store(b.fadd(b.load(acc0), b.fmul(w, w)), acc0)
        acc = b.fadd(b.fadd(b.load(acc0), _lanes(b, va, range(4, 8))),
                     b.fadd(_lanes(b, vb, range(4)), _lanes(b, vb, range(4, 8))))
        lane = [b.extract_element(acc, u.i64(k)) for k in range(4)]
        b.store(b.fadd(b.fadd(b.fadd(lane[0], lane[1]), lane[2]), lane[3]), total)
        with u.Loop(b, full, e, 1, "s1") as i:  # the scalar tail
            w = b.fpext(u.load(b, x, i, key.dtype), F64)
            b.store(b.fadd(b.load(total), b.fmul(w, w)), total)
        b.store(b.load(total), dst)
    return span


def _sumsq_fold(key, b, args, c0, c1):
    part, offs = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
    P, out = u.arg(b, args, 2), u.arg_ptr(b, args, 3)
    acc, grand = u.entry_alloca(b, F64), u.entry_alloca(b, F64)
    b.store(ir.Constant(F64, 0.0), grand)
    with u.Loop(b, u.i64(0), P, 1, "p") as p:
        lo = u.load(b, offs, p, "i64")
        hi = u.load(b, offs, b.add(p, u.i64(1)), "i64")
        b.store(ir.Constant(F64, 0.0), acc)
        with u.Loop(b, lo, hi, 1, "k") as k:
            b.store(b.fadd(b.load(acc), b.load(b.gep(part, [k], source_etype=F64), typ=F64)), acc)
        t = b.load(acc)
        b.store(t, b.gep(out, [p], source_etype=F64))
        b.store(b.fadd(b.load(grand), t), grand)
    b.store(b.load(grand), b.gep(out, [P], source_etype=F64))


# ---------------------------------------------------------------------------------------------
# fused updates

class _Param:
    """The param as an update kernel sees it: the f32 values it steps (the param itself, or the
    f32 master of a 16-bit param) and the write-back (master + narrowed param). Shared with
    codegen/optim_lowrank.py, like _update_kernel."""

    def __init__(self, b, dtype, p, master):
        self.b, self.dtype, self.p = b, dtype, p
        self.src = p if dtype == "f32" else master

    def load(self, c, W, m):
        return u.load(self.b, self.src, c, "f32", W, m)

    def store(self, v, c, m):
        u.store(self.b, v, self.src, c, "f32", m)
        if self.dtype != "f32":
            u.store(self.b, v, self.p, c, self.dtype, m)


PREFETCH = 2048  # elements ahead of the software prefetch (see AdamKey.ir)


@register
@dataclass(frozen=True)
class ScaleKey(KernelKey):
    """x *= f for the f32 tensors of a table (rows: x, count; then f's bits): a clip's
    gradients in one launch. One rounded multiply per element, as the elementwise mul."""

    family = "grad_scale"

    def ir(self, symbol: str) -> str:
        def body(b, ptrs, scalars, c, W, mask):
            u.store(b, b.fmul(u.load(b, ptrs[0], c, "f32", W, mask), scalars[0]), ptrs[0], c,
                    "f32", mask)
        return _update_kernel(symbol, 1, 1, body, table=True)


def _update_kernel(symbol, nptrs, nscalars, body, streams=(), table=False):
    """The shared frame: pointer args, n, chunk, f32 scalars (splatted), one chunk_pass over the
    elements of chunks [c0, c1); body(b, ptrs, scalars, c, W, mask). streams: the (pointer
    index, dtype) to prefetch PREFETCH elements ahead (none: the hardware prefetcher alone).
    table: argument 0 is a table of chunks (rows of nptrs pointers and a count), the scalars
    follow; each row is one pass over its elements."""
    mod, b, args, c0, c1 = u.kernel(symbol)
    W = host().f32_lanes
    first = 1 if table else nptrs + 2
    scalars = [u.splat(b, u.arg_f32(b, args, first + k), W) for k in range(nscalars)]

    def steps(ptrs):
        def step(c, mask):
            if mask is None:  # a prefetch never faults, past the end included
                ahead = b.add(c, u.i64(PREFETCH))
                for i, dtype in streams:
                    u.prefetch(b, ptrs[i], ahead, dtype)
            body(b, ptrs, scalars, c, W, mask)
        return step

    if table:
        rows = u.arg_ptr(b, args, 0)
        with u.Loop(b, c0, c1, 1, "row") as c:
            *words, n = _row(b, rows, c, nptrs + 1)
            map_pass(b, u.i64(0), n, W, steps([b.inttoptr(w, u.PTR) for w in words]))
    else:
        ptrs = [u.arg_ptr(b, args, i) for i in range(nptrs)]
        n, chunk = u.arg(b, args, nptrs), u.arg(b, args, nptrs + 1)
        chunk_pass(b, c0, c1, n, chunk, W, steps(ptrs))
    b.ret_void()
    return str(mod)


def _param_streams(dtype: str) -> list:
    """The param side's streams: the f32 values (param or master) and a 16-bit param."""
    return [(0, "f32")] if dtype == "f32" else [(1, "f32"), (0, dtype)]


@register
@dataclass(frozen=True)
class SgdKey(KernelKey):
    """param: f32 | f16 | bf16 (16-bit: step the f32 master); state: momentum buffer dtype, or
    "none" (momentum == 0); decay: wd != 0; first: the slot's first step (buf = g, not read)."""

    family = "sgd"
    param: str = "f32"
    state: str = "none"
    decay: bool = False
    nesterov: bool = False
    first: bool = False
    table: bool = False   # the table form (module docstring)

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 4, 4, self._body, table=self.table)

    def _body(self, b, ptrs, scalars, c, W, m):
        p_ptr, master, g_ptr, buf = ptrs
        lr, mom, omd, wd = scalars
        par = _Param(b, self.param, p_ptr, master)
        p = par.load(c, W, m)
        g = u.load(b, g_ptr, c, "f32", W, m)
        if self.decay:
            g = RULES["l2_decay"](b, g, p, wd)
        if self.state != "none":
            if self.first:
                nb = g
            else:
                nb = RULES["sgd_momentum"](b, u.load(b, buf, c, self.state, W, m), g, mom, omd)
            u.store(b, nb, buf, c, self.state, m)
            g = RULES["sgd_nesterov"](b, g, nb, mom) if self.nesterov else nb
        par.store(RULES["sgd_step"](b, p, g, lr), c, m)


@register
@dataclass(frozen=True)
class AdamKey(KernelKey):
    """decoupled: AdamW (p·keep before the step) or Adam (coupled L2); param: f32 | f16 | bf16;
    m, v: state dtypes; decay: wd != 0."""

    family = "adam"
    decoupled: bool = False
    param: str = "f32"
    m: str = "f32"
    v: str = "f32"
    decay: bool = False
    table: bool = False   # the table form (module docstring)

    def ir(self, symbol: str) -> str:
        # Software prefetch of every stream pays only with a bf16 moment (its widen/narrow makes
        # the loop long enough to hide less latency): measured on Zen 5, ~20 % faster there,
        # ~5 % slower for the all-f32 kernel and for SGD, so those rely on the hardware alone.
        streams = []
        if "bf16" in (self.m, self.v):
            streams = _param_streams(self.param) + [(2, "f32"), (3, self.m), (4, self.v)]
        return _update_kernel(symbol, 5, 8, self._body, streams, self.table)

    def _body(self, b, ptrs, scalars, c, W, mask):
        p_ptr, master, g_ptr, m_ptr, v_ptr = ptrs
        keep, wd, omb1, beta2, omb2, eps, bc2s, step_size = scalars
        par = _Param(b, self.param, p_ptr, master)
        p = par.load(c, W, mask)
        g = u.load(b, g_ptr, c, "f32", W, mask)
        d = p
        if self.decay:
            if self.decoupled:
                d = RULES["adamw_decay"](b, p, keep)
            else:
                g = RULES["l2_decay"](b, g, p, wd)
        m0 = u.load(b, m_ptr, c, self.m, W, mask)
        v0 = u.load(b, v_ptr, c, self.v, W, mask)
        m1 = RULES["adam_m"](b, m0, g, omb1)
        v1 = RULES["ema_sq"](b, v0, g, beta2, omb2)
        u.store(b, m1, m_ptr, c, self.m, mask)
        u.store(b, v1, v_ptr, c, self.v, mask)
        par.store(RULES["adam_step"](b, d, m1, v1, eps, bc2s, step_size), c, mask)
