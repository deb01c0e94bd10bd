"""RNG fills, dropout and multinomial draws at the exec layer (SPEC §4).

Callers (fucina.rng, fucina.ag.rng) validated the arguments; here the chunk grid is laid out
from the problem size alone and one generated kernel runs. Every kernel writes each output as a
pure function of (seed, its index), so the grid never changes a bit of the result.

Scalars that parameterise a kernel (the dropout cutoff and scale, the uniform bounds) are
computed here on the host from the caller's scalars, exactly as SPEC §4 states them.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ..codegen import kernels
from ..codegen.rng import (DropoutKey, GaussianFastKey, GaussianFillKey, GumbelFillKey, MultinomialKey,
                           RandintFillKey, RandpermFillKey, UniformFillKey)
from ..errors import InvalidShape
from .elementwise import f32_bits

MASK64 = (1 << 64) - 1
CHUNK = 1 << 15        # elements per chunk of the element-wise fills and of dropout
PAIR_CHUNK = 1 << 13   # Box–Muller pairs per chunk (a multiple of every vector width)
ROW_WORK = 1 << 14     # multinomial: about this many (class visits) per chunk


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def _chunks(n: int, per: int) -> int:
    return -(-n // per)


# ---- scalars of the contract ----

def keep_cutoff(p32: float) -> int:
    """RNG-8: ceil((1 - f64(p))·2^53) for the float32 p (exact: 2^53 scales by a power of two)."""
    return int(math.ceil((1.0 - float(p32)) * 2.0 ** 53))


def dropout_scale(p32: float) -> float:
    """RNG-8: f32(1) / (f32(1) - f32(p)), computed in float32."""
    one = np.float32(1.0)
    return float(one / (one - np.float32(p32)))


# ---- fills (out: a contiguous RawTensor of the right dtype) ----

def uniform_fill(ctx, out, seed: int, lo32: float, hi32: float) -> None:
    """RNG-4 with lo, hi already float32 values."""
    n = out.numel
    lo64 = float(lo32)
    span = float(hi32) - lo64
    below = float(np.nextafter(np.float32(hi32), np.float32(lo32)))
    ctx.launch(kernels.get(UniformFillKey()), _chunks(n, CHUNK), n * 16,
               out.addr, n, CHUNK, seed, f64_bits(lo64), f64_bits(span), f32_bits(hi32), f32_bits(below))


def gumbel_fill(ctx, out, seed: int) -> None:
    n = out.numel
    ctx.launch(kernels.get(GumbelFillKey()), _chunks(n, CHUNK), n * 128, out.addr, n, CHUNK, seed)


def _pairs(first: int, n: int) -> int:
    return ((first + n - 1) >> 1) - (first >> 1) + 1


def gaussian_fill_at(ctx, out, seed: int, first: int, scale32: float, mean32: float = 0.0) -> None:
    """RNG-6 (f64 Box–Muller) over elements first .. first + n; then + mean (f32) if mean != 0."""
    n = out.numel
    ctx.launch(kernels.get(GaussianFillKey()), _chunks(_pairs(first, n), PAIR_CHUNK), n * 128,
               out.addr, n, first, seed, PAIR_CHUNK, f64_bits(scale32), f32_bits(mean32))


def gaussian_fill_at_fast(ctx, out, seed: int, first: int, scale32: float) -> None:
    """RNG-7 (float32 Cephes polynomials) over elements first .. first + n."""
    n = out.numel
    ctx.launch(kernels.get(GaussianFastKey()), _chunks(_pairs(first, n), PAIR_CHUNK), n * 16,
               out.addr, n, first, seed, PAIR_CHUNK, f32_bits(scale32))


def randint_fill(ctx, out, seed: int, low: int, high: int) -> None:
    n = out.numel
    span = (high - low) & MASK64
    ctx.launch(kernels.get(RandintFillKey()), _chunks(n, CHUNK), n * 32, out.addr, n, CHUNK, seed,
               low & MASK64, span)


def randperm_fill(ctx, out, seed: int) -> None:
    """Fisher–Yates is sequential: one chunk, run inline."""
    n = out.numel
    ctx.launch(kernels.get(RandpermFillKey()), 1, n * 16, out.addr, n, seed)


# ---- ops ----

def dropout(ctx, x, seed: int, p32: float):
    """A new tensor: x[i]·s where (at(seed, i) >> 11) < cutoff, else 0 (x contiguous)."""
    n = x.numel
    out = ctx.empty(x.shape, x.dtype)
    ctx.launch(kernels.get(DropoutKey(x.dtype)), _chunks(n, CHUNK), n * 8,
               x.addr, out.addr, n, CHUNK, seed, keep_cutoff(p32), f32_bits(dropout_scale(p32)))
    return out


def multinomial(ctx, w, num_samples: int, seed: int, replacement: bool, op: str = "multinomial"):
    """i64 [R, S] draws from contiguous weights [R, K]; InvalidShape on a row whose weights are
    negative, not finite or sum to 0, or (without replacement) run out of nonzero classes."""
    R, K = w.shape
    S = num_samples
    out = ctx.empty((R, S), "i64")
    scratch = ctx.empty((R, K), "i64")       # f64 prefix sums / remaining weights, 8 bytes each
    status = ctx.empty((R,), "i64")
    per = max(1, ROW_WORK // (K * (1 if replacement else S)))
    ctx.launch(kernels.get(MultinomialKey(w.dtype, bool(replacement))), _chunks(R, per),
               R * K * (8 if replacement else 8 * S), w.addr, out.addr, scratch.addr, status.addr,
               R, K, S, seed, per)
    st = status.to_numpy()                    # the I/O bridge: R status words back to Python
    bad = np.flatnonzero(st)
    if bad.size:
        r = int(bad[0])
        if st[r] == 1:
            raise InvalidShape(f"{op}: row {r}: expected finite weights >= 0 with a positive sum")
        raise InvalidShape(f"{op}: row {r}: expected at least {S} classes with nonzero weight to draw "
                           f"{S} samples without replacement")
    return out


def math64(ctx, fn: str, x):
    """The kernels' f64 log/sin/cos over an i64 RawTensor holding f64 bit patterns (testing aid)."""
    from ..codegen.rng import Math64Key

    n = x.numel
    out = ctx.empty(x.shape, "i64")
    ctx.launch(kernels.get(Math64Key(fn)), _chunks(n, CHUNK), n * 64, x.addr, out.addr, n, CHUNK)
    return out
