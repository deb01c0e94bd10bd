"""Evolution-strategies kernels (SPEC T-25, T-26): perturb / restore / materialize, the ES update
with anchored weight decay fused in, and the byte copy behind snapshots and anchors.

Noise. Element j of a slot's stream is RNG-7 `gaussian_fill_at_fast(stream_seed, j, 1 value,
scale=1.0)`: the pair at(seed, 2P), at(seed, 2P+1) with P = j >> 1 gives elements 2P (cos half)
and 2P + 1 (sin half). Slots always start at element 0, so a vector step of L pairs covers the
2L elements 2·pb .. 2·pb + 2L − 1 and the pair math is exactly the `fucina.codegen.rng` builders
(at, ln_poly, sin_cos_turn) — the same bits as the RNG-7 fill kernel, lane for lane.

Every kernel is an element-independent map over [c0·chunk, min(c1·chunk, n)) with chunk a
multiple of 2L: which thread runs which chunk never changes a bit. No fast-math flags anywhere,
so no multiply-add is ever contracted; each float op rounds where SPEC T-25 says.

to_dtype(v) (SPEC: identity for f32, RNE for f16, f32_to_bf16 for bf16) is narrow-then-widen.

  perturb:  t = to_dtype(scaled·eps);  dst = to_dtype(f32(src) + f32(t))
            (perturb and restore: dst == src; materialize: dst is a replica)
  update:   acc = Σ_s f32(C_s·eps_s) (stream order, from 0);  delta = to_dtype(scale·acc);
            p = to_dtype(f32(p) + f32(delta));  then AWD (T-26) on the post-update p:
            l2: d = to_dtype(p − a);  kept = to_dtype(d·keep);  p = to_dtype(kept + a)
            l1: d = to_dtype(p − a);  th = to_dtype(|d| − step);  c = max(th, 0);
                p = to_dtype((d < 0 ? −c : c) + a)

Argument blocks (pointers first; f32 scalars as bits)
  perturb:  src, dst, cache, n, chunk, stream seed, scaled
            (noise "rng": cache unused; "fill": regenerate and also store eps to cache;
             "cache": read eps from cache)
  members:  src, dst (G replicas of n elements back to back), seeds (G × u64), scaled (G × f32),
            n, chunk, chunks per replica C; chunk c is chunk c mod C of replica c / C
  update:   p, anchor, table (S × u64: stream seeds, or cache addresses), coeffs (S × f32),
            n, chunk, S, scale, keep (l2: f32(1 − step)) | step (l1)
  copy:     src, dst, nbytes, bytes per chunk
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import sqrt
from .kernels import KernelKey, register
from .rng import TWO_M53, _interleave, at, cf, ci, ln_poly, sin_cos_turn, u53
from .rows import chunk_pass
from .target import host

DTYPES = ("f32", "f16", "bf16")
NOISE = ("rng", "fill", "cache")
DECAY = ("none", "l1", "l2")


def noise_pairs(b, seed, pb, L: int):
    """RNG-7 (scale 1) for pairs pb .. pb + L − 1 of stream `seed`, interleaved: the
    <2L x float> of elements 2·pb .. 2·pb + 2L − 1."""
    ft = ir.VectorType(u.F32, L)
    p2 = b.add(pb, pb)
    a = at(b, seed, p2, L, stride=2)
    bb = at(b, seed, b.add(p2, u.i64(1)), L, stride=2)
    # f32(k + 1)·2^-53 is the spec's f32((f64(k) + 1)·2^-53): one rounding of the same exact value
    ka = b.add(b.lshr(a, ci(a.type, 11)), ci(a.type, 1))
    ua = b.fmul(b.sitofp(ka, ft), cf(ft, TWO_M53))
    ub = b.fmul(u53(b, bb, u.F32), cf(ft, TWO_M53))
    radius = sqrt(b, b.fmul(cf(ft, -2.0), ln_poly(b, ua)))
    s, c = sin_cos_turn(b, ub)
    return _interleave(b, b.fmul(radius, c), b.fmul(radius, s))


def to_dtype(b, v, dtype: str):
    """Round an f32 value to `dtype` and widen it back (identity for f32)."""
    return v if dtype == "f32" else u.widen(b, u.narrow(b, v, dtype), dtype)


@register
@dataclass(frozen=True)
class EsPerturbKey(KernelKey):
    """dst = to_dtype(src + to_dtype(scaled·eps)) for one slot; dtype: the slot's storage;
    noise: where eps comes from (rng | fill | cache, see the module docstring)."""

    family = "es_perturb"
    dtype: str = "f32"
    noise: str = "rng"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        W = 2 * L
        src, dst, cache = (u.arg_ptr(b, args, i) for i in range(3))
        n, chunk, seed = (u.arg(b, args, i) for i in (3, 4, 5))
        scaled = u.splat(b, u.arg_f32(b, args, 6), W)
        dt = self.dtype

        def body(e, mask):
            if self.noise == "cache":
                eps = u.load(b, cache, e, "f32", W, mask)
            else:
                eps = noise_pairs(b, seed, b.lshr(e, u.i64(1)), L)
                if self.noise == "fill":
                    u.store(b, eps, cache, e, "f32", mask)
            t = to_dtype(b, b.fmul(scaled, eps), dt)
            p = u.load(b, src, e, dt, W, mask)
            u.store(b, b.fadd(p, t), dst, e, dt, mask)

        chunk_pass(b, c0, c1, n, chunk, W, body)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class EsMembersKey(KernelKey):
    """perturb's map for G members at once into G back-to-back replicas of one slot (a block
    of stacked replicas filled by one launch)."""

    family = "es_members"
    dtype: str = "f32"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        W = 2 * L
        src, dst, seeds, scaled = (u.arg_ptr(b, args, i) for i in range(4))
        n, chunk, per = (u.arg(b, args, i) for i in (4, 5, 6))
        dt = self.dtype
        with u.Loop(b, c0, c1, 1, "c") as c:
            g = b.udiv(c, per)
            cc = b.urem(c, per)
            seed = u.load(b, seeds, g, "i64")
            sc = u.splat(b, u.load(b, scaled, g, "f32"), W)
            out = b.gep(dst, [b.mul(g, n)], source_etype=u.STORAGE[dt])

            def body(e, mask):
                t = to_dtype(b, b.fmul(sc, noise_pairs(b, seed, b.lshr(e, u.i64(1)), L)), dt)
                p = u.load(b, src, e, dt, W, mask)
                u.store(b, b.fadd(p, t), out, e, dt, mask)

            chunk_pass(b, cc, b.add(cc, u.i64(1)), n, chunk, W, body)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class EsUpdateKey(KernelKey):
    """The ES update of one slot, anchored weight decay fused after it. cached: the table
    holds cache addresses (eps read from RAM) instead of stream seeds; decay: none | l1 | l2."""

    family = "es_update"
    dtype: str = "f32"
    cached: bool = False
    decay: str = "none"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        L = host().f32_lanes
        W = 2 * L
        vt = ir.VectorType(u.F32, W)
        p_ptr, anchor, table, coeffs = (u.arg_ptr(b, args, i) for i in range(4))
        n, chunk, S = (u.arg(b, args, i) for i in (4, 5, 6))
        scale = u.splat(b, u.arg_f32(b, args, 7), W)
        knob = u.splat(b, u.arg_f32(b, args, 8), W)
        acc = u.entry_alloca(b, vt, "acc")
        dt = self.dtype

        def body(e, mask):
            b.store(u.const(vt, 0.0), acc)
            pb = b.lshr(e, u.i64(1))
            with u.Loop(b, u.i64(0), S, 1, "s") as s:
                entry = u.load(b, table, s, "i64")
                c = u.splat(b, u.load(b, coeffs, s, "f32"), W)
                if self.cached:
                    eps = u.load(b, b.inttoptr(entry, u.PTR), e, "f32", W, mask)
                else:
                    eps = noise_pairs(b, entry, pb, L)
                b.store(b.fadd(b.load(acc), b.fmul(c, eps)), acc)
            delta = to_dtype(b, b.fmul(scale, b.load(acc)), dt)
            p = to_dtype(b, b.fadd(u.load(b, p_ptr, e, dt, W, mask), delta), dt)
            if self.decay != "none":
                a = u.load(b, anchor, e, dt, W, mask)
                d = to_dtype(b, b.fsub(p, a), dt)
                if self.decay == "l2":
                    shrunk = to_dtype(b, b.fmul(d, knob), dt)
                else:
                    zero = u.const(vt, 0.0)
                    th = to_dtype(b, b.fsub(u.intrinsic(b, "llvm.fabs", vt, [d]), knob), dt)
                    c = b.select(b.fcmp_ordered(">", th, zero), th, zero)
                    shrunk = b.select(b.fcmp_ordered("<", d, zero), b.fneg(c), c)
                p = b.fadd(shrunk, a)
            u.store(b, p, p_ptr, e, dt, mask)

        chunk_pass(b, c0, c1, n, chunk, W, body)
        b.ret_void()
        return str(mod)


@register
@dataclass(frozen=True)
class EsCopyKey(KernelKey):
    """A byte copy (snapshots, anchors): bitwise, NaN payloads included."""

    family = "es_copy"

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        W = host().vector_bits // 8
        src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        n, chunk = u.arg(b, args, 2), u.arg(b, args, 3)

        def body(e, mask):
            u.store(b, u.load(b, src, e, "bool", W, mask), dst, e, "bool", mask)

        chunk_pass(b, c0, c1, n, chunk, W, body)
        b.ret_void()
        return str(mod)
