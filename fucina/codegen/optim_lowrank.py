"""Kernels of the matrix optimizers (SPEC T-6, T-8): Muon's momentum map and apply, the
Newton–Schulz linear combination, and APOLLO's moments + scaling factors, scaled update, apply
and its legacy-HF AdamW fallback.

Element maps (the arithmetic of each is a rule in fucina/kernel_templates/optim.py; every
element independent, f32 in SPEC order, separate multiplies and adds: no
contraction, so any chunking gives the same bits) reuse the frame of codegen/optim.py: pointer
arguments, n, chunk, f32 scalars as bits; a 16-bit param steps its f32 master and is narrowed
back in the same pass.

  muon_momentum (w = 1 − β, both f32; the ATen lerp switches forms at weight 0.5):
      m1 = m0 + w·(g − m0)  if w < 0.5  else  g − (g − m0)·β;  store m1 (narrowed if bf16)
      u  = g + β·(m1 − g)   if β < 0.5  else  m1 − (m1 − g)·w   (nesterov; u uses the
           pre-narrow m1)  |  u = m1
  muon_apply:    p = p·keep − lr_eff·o
  ns_axpby:      out = s·x + t·y            (Newton–Schulz: B = b·A + c·(A·A))
  apollo_build:  u = (g·s[channel])·front   (channel: the row (tall), the column (wide), or
                 the one tensor factor)
  apollo_apply:  stepped = p − step_size·((u/limiter)·back);  p = stepped + decay·stepped
  hf_adamw:      m = β1·m + (1−β1)·g;  v = β2·v + ((1−β2)·g)·g;
                 stepped = p − step_size·(m/(sqrt(v) + eps));  p = stepped + decay·stepped

apollo_scale updates the moments of the compressed gradient r (m = β1·m + (1−β1)·r,
v = β2·v + ((1−β2)·r)·r, as hf_adamw) and folds, per channel, so = Σ f64(opt)² and
sr = Σ f64(r)² with opt = m/(sqrt(v) + eps) (f32) — each sum a plain serial f64 sum in flat
index order — then writes s[c] = f32(sqrt(so)/(sqrt(sr) + 1e-8)) (f64). Two layouts:
  rows — each channel is a contiguous run of L elements (tall: R[rows, rank], L = rank;
         tensor scaling: one channel, L = numel): vector moment updates, then the lanes are
         added to the two f64 scalars in index order. Chunks are groups of channels.
  cols — channel c is column c of R[rank, cols] (wide): W columns per vector, f64 vector
         accumulators walk the rows in order (per lane that is the flat order). Chunks are
         groups of column vectors.
Per channel the order is fixed by the shape alone, so the factors are bitwise the same for any
thread count.

Argument blocks (pointers first; f32 scalars as bits)
  muon_momentum:  g, m, u, n, chunk, w, β
  muon_apply:     p, master, o, n, chunk, keep, lr_eff
  ns_axpby:       out, x, y, n, chunk, s, t
  apollo_scale:   r, m, v, s, L (rows) | cols (cols), channels, channels per chunk,
                  rank (cols), β1, 1−β1, β2, 1−β2, eps
  apollo_build:   u, g, s, rows, cols, rows per chunk, front
  apollo_apply:   p, master, u, n, chunk, limiter, back, step_size, decay
  hf_adamw:       p, master, g, m, v, n, chunk, β1, 1−β1, β2, 1−β2, eps, step_size, decay
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import sqrt
from .kernels import KernelKey, register
from .optim import RULES, _Param, _update_kernel
from .rows import map_pass
from .target import host

F64 = ir.DoubleType()


def _f64(ty, value: float) -> ir.Constant:
    """A double constant (not rounded to f32) of scalar or vector type `ty`."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(F64, value)] * ty.count)
    return ir.Constant(ty, value)


@register
@dataclass(frozen=True)
class MuonMomentumKey(KernelKey):
    """state: momentum dtype (f32 | bf16); nesterov; m_small: w < 0.5 (the momentum lerp's
    weight); n_small: β < 0.5 (the nesterov lerp's weight)."""

    family = "muon_momentum"
    state: str = "f32"
    nesterov: bool = True
    m_small: bool = True
    n_small: bool = False

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 3, 2, self._body)

    def _body(self, b, ptrs, scalars, c, W, mask):
        g_ptr, m_ptr, u_ptr = ptrs
        w, beta = scalars
        g = u.load(b, g_ptr, c, "f32", W, mask)
        m0 = u.load(b, m_ptr, c, self.state, W, mask)
        m1 = RULES["muon_momentum_" + ("small" if self.m_small else "large")](b, m0, g, w, beta)
        u.store(b, m1, m_ptr, c, self.state, mask)
        out = m1
        if self.nesterov:
            blend = RULES["muon_nesterov_" + ("small" if self.n_small else "large")]
            out = blend(b, m1, g, w, beta)
        u.store(b, out, u_ptr, c, "f32", mask)


@register
@dataclass(frozen=True)
class MuonApplyKey(KernelKey):
    """param: f32 | f16 | bf16 (16-bit: step the f32 master, narrow into the param)."""

    family = "muon_apply"
    param: str = "f32"

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 3, 2, self._body)

    def _body(self, b, ptrs, scalars, c, W, mask):
        p_ptr, master, o_ptr = ptrs
        keep, lr_eff = scalars
        par = _Param(b, self.param, p_ptr, master)
        o = u.load(b, o_ptr, c, "f32", W, mask)
        par.store(RULES["muon_apply"](b, par.load(c, W, mask), o, keep, lr_eff), c, mask)


@register
@dataclass(frozen=True)
class AxpbyKey(KernelKey):
    """out = s·x + t·y over contiguous f32 (out may be x or y: element-independent)."""

    family = "ns_axpby"

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 3, 2, self._body)

    def _body(self, b, ptrs, scalars, c, W, mask):
        out, x, y = ptrs
        s, t = scalars
        xv = u.load(b, x, c, "f32", W, mask)
        yv = u.load(b, y, c, "f32", W, mask)
        u.store(b, RULES["ns_axpby"](b, xv, yv, s, t), out, c, "f32", mask)


def _moments(b, m_ptr, v_ptr, x, c, W, mask, beta1, omb1, beta2, omb2):
    """m = β1·m + (1−β1)·x; v = β2·v + ((1−β2)·x)·x, stored; returns (m, v)."""
    m = RULES["ema"](b, u.load(b, m_ptr, c, "f32", W, mask), x, beta1, omb1)
    v = RULES["ema_sq"](b, u.load(b, v_ptr, c, "f32", W, mask), x, beta2, omb2)
    u.store(b, m, m_ptr, c, "f32", mask)
    u.store(b, v, v_ptr, c, "f32", mask)
    return m, v


@register
@dataclass(frozen=True)
class ApolloScaleKey(KernelKey):
    """layout: rows (channel = a contiguous run: tall, or tensor scaling) | cols (channel =
    a column of R: wide). See the module docstring."""

    family = "apollo_scale"
    layout: str = "rows"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().f32_lanes
        r, m, v, s = (u.arg_ptr(b, args, i) for i in range(4))
        length, channels, per, rank = (u.arg(b, args, i) for i in range(4, 8))
        sc = [u.arg_f32(b, args, 8 + k) for k in range(5)]
        beta1, omb1, beta2, omb2, eps = (u.splat(b, x, W) for x in sc)
        ch0, ch1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), channels)

        def opt_terms(c, mask):
            """(opt², r²) as f64 vectors (0 in masked-off lanes) after the moment update."""
            x = u.load(b, r, c, "f32", W, mask)
            mv, vv = _moments(b, m, v, x, c, W, mask, beta1, omb1, beta2, omb2)
            opt = RULES["adam_direction"](b, mv, vv, eps)
            d = ir.VectorType(F64, W)
            o2, r2 = b.fpext(opt, d), b.fpext(x, d)
            o2, r2 = b.fmul(o2, o2), b.fmul(r2, r2)
            if mask is not None:
                zero = _f64(d, 0.0)
                o2, r2 = b.select(mask, o2, zero), b.select(mask, r2, zero)
            return o2, r2

        def factor(so, sr):
            """f32(sqrt(so) / (sqrt(sr) + 1e-8)), scalar or vector."""
            lanes = so.type.count if isinstance(so.type, ir.VectorType) else None
            q = b.fdiv(sqrt(b, so), b.fadd(sqrt(b, sr), _f64(so.type, 1e-8)))
            return b.fptrunc(q, u.vec(u.F32, lanes))

        if self.layout == "rows":
            so, sr = u.entry_alloca(b, F64), u.entry_alloca(b, F64)
            with u.Loop(b, ch0, ch1, 1, "ch") as ch:
                base = b.mul(ch, length)
                b.store(_f64(F64, 0.0), so)
                b.store(_f64(F64, 0.0), sr)

                def body(c, mask):
                    o2, r2 = opt_terms(c, mask)
                    a_o, a_r = b.load(so), b.load(sr)
                    for k in range(W):  # lanes in index order: the serial flat-order sum
                        a_o = b.fadd(a_o, b.extract_element(o2, u.i64(k)))
                        a_r = b.fadd(a_r, b.extract_element(r2, u.i64(k)))
                    b.store(a_o, so)
                    b.store(a_r, sr)
                map_pass(b, base, b.add(base, length), W, body)
                u.store(b, factor(b.load(so), b.load(sr)), s, ch, "f32")
        else:
            cols = length
            d = ir.VectorType(F64, W)
            so, sr = u.entry_alloca(b, d), u.entry_alloca(b, d)
            with u.Loop(b, ch0, ch1, W, "cv") as col:  # ch0, ch1: multiples of W or the end
                mask = u.tail_mask(b, u.smin(b, b.sub(ch1, col), u.i64(W)), W)
                b.store(_f64(d, 0.0), so)
                b.store(_f64(d, 0.0), sr)
                with u.Loop(b, u.i64(0), rank, 1, "k") as k:
                    o2, r2 = opt_terms(b.add(b.mul(k, cols), col), mask)
                    b.store(b.fadd(b.load(so), o2), so)
                    b.store(b.fadd(b.load(sr), r2), sr)
                u.store(b, factor(b.load(so), b.load(sr)), s, col, "f32", mask)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class ApolloBuildKey(KernelKey):
    """mode: tall (s per row of G) | wide (s per column) | tensor (s[0]); front: multiply by
    the front scale (sqrt(scale) when scale_front and scale != 1)."""

    family = "apollo_build"
    mode: str = "tall"
    front: bool = False

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().f32_lanes
        out, g, s = (u.arg_ptr(b, args, i) for i in range(3))
        rows, cols, per = (u.arg(b, args, i) for i in range(3, 6))
        front = u.splat(b, u.arg_f32(b, args, 6), W)
        r0, r1 = b.mul(c0, per), u.smin(b, b.mul(c1, per), rows)
        if self.mode == "tensor":
            s0 = u.splat(b, u.load(b, s, u.i64(0), "f32"), W)
        with u.Loop(b, r0, r1, 1, "r") as row:
            base = b.mul(row, cols)
            ob, gb = (b.gep(p, [base], source_etype=u.F32) for p in (out, g))
            if self.mode == "tall":
                srow = u.splat(b, u.load(b, s, row, "f32"), W)

            def body(c, mask):
                if self.mode == "wide":
                    sv = u.load(b, s, c, "f32", W, mask)
                else:
                    sv = s0 if self.mode == "tensor" else srow
                gv = u.load(b, gb, c, "f32", W, mask)
                val = RULES["apollo_build_front"](b, gv, sv, front) if self.front \
                    else RULES["apollo_build"](b, gv, sv)
                u.store(b, val, ob, c, "f32", mask)
            map_pass(b, u.i64(0), cols, W, body)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class ApolloApplyKey(KernelKey):
    """param: f32 | f16 | bf16."""

    family = "apollo_apply"
    param: str = "f32"

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 3, 4, self._body)

    def _body(self, b, ptrs, scalars, c, W, mask):
        p_ptr, master, u_ptr = ptrs
        limiter, back, step_size, decay = scalars
        par = _Param(b, self.param, p_ptr, master)
        upd = u.load(b, u_ptr, c, "f32", W, mask)
        par.store(RULES["apollo_apply"](b, par.load(c, W, mask), upd, limiter, back, step_size,
                                        decay), c, mask)


@register
@dataclass(frozen=True)
class HfAdamwKey(KernelKey):
    """APOLLO's fallback: the legacy Hugging Face AdamW (eps outside the bias correction,
    decay after the step). param: f32 | f16 | bf16; state always f32."""

    family = "hf_adamw"
    param: str = "f32"

    def ir(self, symbol: str) -> str:
        return _update_kernel(symbol, 5, 7, self._body)

    def _body(self, b, ptrs, scalars, c, W, mask):
        p_ptr, master, g_ptr, m_ptr, v_ptr = ptrs
        beta1, omb1, beta2, omb2, eps, step_size, decay = scalars
        par = _Param(b, self.param, p_ptr, master)
        g = u.load(b, g_ptr, c, "f32", W, mask)
        m, v = _moments(b, m_ptr, v_ptr, g, c, W, mask, beta1, omb1, beta2, omb2)
        par.store(RULES["hf_adamw_step"](b, par.load(c, W, mask), m, v, eps, step_size, decay),
                  c, mask)
