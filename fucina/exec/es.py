"""Evolution-strategies launches at the exec layer (SPEC T-25, T-26).

Callers (fucina.es) validated everything: slots are contiguous f32/f16/bf16 RawTensors, tables
hold the right number of entries. Here each call picks its kernel and lays the chunk grid out
from the element count alone — every ES kernel is an element-independent map, so the grid
never changes a bit, whatever the thread count.
"""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.es import EsCopyKey, EsMembersKey, EsPerturbKey, EsUpdateKey
from .elementwise import f32_bits

PERTURB_CHUNK = 1 << 14  # elements per chunk of perturb/restore/materialize (SPEC T-25's split)
UPDATE_CHUNK = 1 << 11   # elements per update chunk: each element regenerates S streams
COPY_CHUNK = 1 << 18     # bytes per chunk of a snapshot / anchor copy
NOISE_COST = 16          # nominal bytes per generated value (compute-bound: ~4 stored bytes)

_addr: dict = {}


def kernel(key) -> int:
    """kernels.get, memoised here on the key."""
    a = _addr.get(key)
    if a is None:
        a = _addr[key] = kernels.get(key)
    return a


def _chunks(n: int, per: int) -> int:
    return -(-n // per)


def perturb(ctx, src, dst, seed: int, scaled32: float, cache=None, fill: bool = False) -> None:
    """dst = to_dtype(src + to_dtype(scaled·eps)), eps = RNG-7 stream `seed` from element 0.
    cache (an f32 RawTensor of src.numel, or None): with fill, eps is also written there;
    without, eps is read from it instead of regenerated. dst may be src (in place)."""
    n = src.numel
    noise = "rng" if cache is None else ("fill" if fill else "cache")
    ctx.launch(kernel(EsPerturbKey(src.dtype, noise)), _chunks(n, PERTURB_CHUNK), n * NOISE_COST,
               src.addr, dst.addr, 0 if cache is None else cache.addr, n, PERTURB_CHUNK,
               seed, f32_bits(scaled32))


def perturb_members(ctx, src, dst, seeds: int, scaled: int, count: int) -> None:
    """dst holds `count` replicas of src back to back: replica g = to_dtype(src +
    to_dtype(scaled[g]·eps)), eps = RNG-7 stream seeds[g]. seeds, scaled: addresses of `count`
    u64 / f32."""
    n = src.numel
    per = _chunks(n, PERTURB_CHUNK)
    ctx.launch(kernel(EsMembersKey(src.dtype)), count * per, count * n * NOISE_COST, src.addr,
               dst.addr, seeds, scaled, n, PERTURB_CHUNK, per)


def update(ctx, p, table: int, coeffs: int, streams: int, scale32: float, cached: bool,
           decay: str = "none", anchor=None, knob32: float = 0.0) -> None:
    """The ES update of slot p in place: table (the address of `streams` i64: stream seeds, or
    the addresses of cached noise when `cached`), coeffs (the address of `streams` f32), then the
    AWD step (decay l1 | l2: anchor RawTensor of p's dtype; knob32 = f32(1 − step) for l2, the
    step for l1)."""
    n = p.numel
    ctx.launch(kernel(EsUpdateKey(p.dtype, cached, decay)), _chunks(n, UPDATE_CHUNK),
               n * streams * (4 if cached else NOISE_COST), p.addr,
               0 if anchor is None else anchor.addr, table, coeffs, n, UPDATE_CHUNK,
               streams, f32_bits(scale32), f32_bits(knob32))


def copy_bytes(ctx, src, dst) -> None:
    """dst's storage = src's (same byte length; a bitwise copy)."""
    nbytes = src.lay.nbytes
    ctx.launch(kernel(EsCopyKey()), _chunks(nbytes, COPY_CHUNK), 2 * nbytes, src.addr, dst.addr,
               nbytes, COPY_CHUNK)
