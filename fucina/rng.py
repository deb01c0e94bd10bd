"""The RNG contract (SPEC §4): splitmix64, counter-based access, and the seeded fills.

Every (seed → values) mapping here is a checkpoint contract: consumers store a seed and
regenerate the values (dropout masks, APOLLO projections, ES noise), so none of these functions
may ever change behaviour.

Scalar API (pure Python ints, u64 wrapping): `GAMMA`, `splitmix64(state) -> (value, new_state)`,
`SplitMix64(seed).next()`, `at(seed, i)` (the i-th sequential output, computed directly), and the
three 53-bit uniforms `half_open_unit` [0,1), `open_closed_unit` (0,1], `open_unit` (0,1).

Fills write into a given tensor `out` — a fucina Tensor (a no-grad tensor or a variable, e.g. for
parameter init; not an op result that carries a graph) or an exec RawTensor — and return it.
Element j of the stream goes to the j-th element of `out` in row-major order (a strided view is
filled through a contiguous temporary). Each fill is one generated kernel whose outputs are pure
functions of (seed, index): bitwise identical for any thread count and any chunking.
Float parameters (lo, hi, scale, mean, std) are the reference's f32 parameters: they are
rounded to float32 first. Seeds and counters are ints taken mod 2^64.

f64 transcendentals (gaussian_fill, gaussian_fill_at, normal_fill, gumbel_fill): the kernels
compute ln, sin and cos with musl's algorithms (old fdlibm log; sin/cos with __rem_pio2), in
musl's operation order without FMA, so the contract is defined by this implementation and
tests/test_rng.py checks it bitwise against a line-by-line transcription of the C source.
Bitwise f64 parity with "the" libm is not a well-defined target: glibc is not correctly
rounded and picks FMA or non-FMA variants by CPU, and numpy's own log already differs from
glibc's in 0.35 % of arguments. Measured on 10^6 arguments of the contract's domain, ours
differs from glibc 2.36 in 7.2 % (log) and 3.1 % (sin, cos) of the f64 results, never by more
than 1 ulp; after the final rounding to float32 that vanishes: 0 differing values of
gaussian_fill in 2·10^7 (seeds 7 and 12345; test_f64_vs_libm_rate_1e7). A difference needs the
exact value within ~3 f64 ulps of a float32 rounding boundary: about 1e-9 per value.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidShape,
                     MutableDataRequiresNoGrad)
from .ag.engine import Leaf
from .ag.tensor import Tensor
from .exec import elementwise as ew
from .exec import rng as xr
from .exec.raw import RawTensor
from .exec.rng import dropout_scale, keep_cutoff

__all__ = ["GAMMA", "splitmix64", "SplitMix64", "at", "half_open_unit", "open_closed_unit", "open_unit",
           "uniform_fill", "gaussian_fill", "gaussian_fill_at", "gaussian_fill_at_fast",
           "kaiming_uniform_fill", "normal_fill", "gumbel_fill", "randint_fill", "randperm_fill",
           "multinomial", "keep_cutoff", "dropout_scale", "dropout_keeps"]

GAMMA = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
_TWO_M53 = 2.0 ** -53


# ---------------------------------------------------------------------------------------------
# scalar API (RNG-1 … RNG-3)

def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64(state: int) -> tuple[int, int]:
    """RNG-1: one step; returns (value, new_state)."""
    state = (state + GAMMA) & MASK64
    return _mix(state), state


class SplitMix64:
    """The sequential stream: `SplitMix64(seed).next()` yields at(seed, 0), at(seed, 1), ..."""

    __slots__ = ("state",)

    def __init__(self, seed: int):
        self.state = int(seed) & MASK64

    def next(self) -> int:
        value, self.state = splitmix64(self.state)
        return value


def at(seed: int, i: int) -> int:
    """RNG-2: the i-th (0-based) output of the stream started at `seed`, in O(1)."""
    return _mix((int(seed) + ((int(i) + 1) * GAMMA & MASK64)) & MASK64)


def half_open_unit(x: int) -> float:
    """RNG-3 [0, 1): (x >> 11)·2^-53."""
    return float(x >> 11) * _TWO_M53


def open_closed_unit(x: int) -> float:
    """RNG-3 (0, 1] (the Box–Muller radius input): ((x >> 11) + 1)·2^-53."""
    return (float(x >> 11) + 1.0) * _TWO_M53


def open_unit(x: int) -> float:
    """RNG-3 (0, 1) (Gumbel): ((x >> 11) + 0.5)·2^-53 in f64. NOTE: for x >> 11 >= 2^52 the
    + 0.5 rounds (ties to even), so x >> 11 == 2^53 - 1 gives exactly 1.0, as in the reference;
    gumbel_fill then yields +inf (-ln(-ln 1) = -ln(-0)), with probability 2^-53 per draw."""
    return (float(x >> 11) + 0.5) * _TWO_M53


def dropout_keeps(seed: int, i: int, p: float) -> bool:
    """RNG-8 for one flat index: is element i kept by dropout(p, seed)?"""
    return (at(seed, i) >> 11) < keep_cutoff(_f32(p, "dropout_keeps"))


# ---------------------------------------------------------------------------------------------
# argument checks

def _u64(v, op: str, what: str = "seed") -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InvalidArgumentType(f"{op}: expected an int {what}, got {type(v).__name__}")
    return int(v) & MASK64


def _f32(v, op: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidArgumentType(f"{op}: expected a real number, got {type(v).__name__}")
    return float(np.float32(v))


def _first(first, n: int, op: str) -> int:
    if isinstance(first, bool) or not isinstance(first, numbers.Integral) or first < 0:
        raise InvalidShape(f"{op}: expected an int first >= 0, got {first!r}")
    if int(first) + n > 1 << 64:
        raise InvalidShape(f"{op}: expected first + len(out) <= 2^64, got first={first} len={n}")
    return int(first)


class _Target:
    """The contiguous RawTensor a kernel writes, and the copy back into a strided view."""

    def __init__(self, out, dtype: str, op: str):
        if isinstance(out, RawTensor):
            raw = out
            raw.ctx.check_open(op)
        elif isinstance(out, Tensor):
            raw = out._live(op)
            node = out._node
            if node is not None and not isinstance(node, Leaf):
                raise MutableDataRequiresNoGrad(
                    f"{op}: expected a tensor without a gradient graph (a constant or a variable), "
                    f"got an op result that requires grad")
        else:
            raise InvalidArgumentType(f"{op}: expected out to be a Tensor, got "
                                      f"{type(out).__name__}")
        if raw.dtype != dtype:
            raise DTypeError(f"{op}: expected out of dtype {dtype}, got {raw.dtype}")
        self.out, self.view, self.ctx = out, raw, raw.ctx
        if raw.is_contiguous():
            self.raw = raw
        else:
            if any(s == 0 and d > 1 for d, s in zip(raw.shape, raw.strides)):
                raise InvalidShape(f"{op}: expected out without broadcast (zero-stride) axes, got "
                                   f"shape {raw.shape} strides {raw.strides}")
            self.raw = self.ctx.empty(raw.shape, dtype)

    def done(self):
        if self.raw is not self.view:
            ew.run(self.ctx, "copy", self.view.dtype, self.view.shape, (self.raw,), out=self.view)
        return self.out


# ---------------------------------------------------------------------------------------------
# fills (RNG-4 … RNG-7, RNG-10)

def uniform_fill(seed: int, out, lo: float, hi: float):
    """RNG-4: out[j] = f32(f64(lo) + (f64(hi) - f64(lo))·u_j), u_j = half_open_unit(at(seed, j));
    a value that rounds up to hi becomes nextafter_f32(hi, lo), so every value is in [lo, hi)
    when lo < hi. No check on lo < hi (as the reference)."""
    op = "uniform_fill"
    seed, lo, hi = _u64(seed, op), _f32(lo, op), _f32(hi, op)
    t = _Target(out, "f32", op)
    xr.uniform_fill(t.ctx, t.raw, seed, lo, hi)
    return t.done()


def kaiming_uniform_fill(seed: int, out, fan_in: int):
    """RNG-10: uniform_fill(seed, out, -b, b), b = f32(sqrt(1/f64(fan_in))) (torch's
    kaiming_uniform_(a=sqrt(5)), the nn.Linear / LoRA-A default)."""
    op = "kaiming_uniform_fill"
    if isinstance(fan_in, bool) or not isinstance(fan_in, numbers.Integral) or fan_in < 1:
        raise InvalidShape(f"{op}: expected an int fan_in >= 1, got {fan_in!r}")
    bound = float(np.float32(math.sqrt(1.0 / float(fan_in))))
    return uniform_fill(seed, out, -bound, bound)


def gaussian_fill(seed: int, out, scale: float = 1.0):
    """RNG-5: Box–Muller over the sequential stream, two outputs per pair (cos half, then sin
    half; an odd tail drops the sin half), all in f64, one rounding to f32. The same kernel as
    gaussian_fill_at with first = 0 (element j depends only on the pair at(seed, 2⌊j/2⌋), +1)."""
    return gaussian_fill_at(seed, 0, out, scale)


def gaussian_fill_at(seed: int, first: int, out, scale: float = 1.0):
    """RNG-6: elements first .. first + len(out) of gaussian_fill(seed)'s stream."""
    op = "gaussian_fill_at"
    seed, scale = _u64(seed, op), _f32(scale, op)
    t = _Target(out, "f32", op)
    xr.gaussian_fill_at(t.ctx, t.raw, seed, _first(first, t.raw.numel, op), scale)
    return t.done()


def gaussian_fill_at_fast(seed: int, first: int, out, scale: float = 1.0):
    """RNG-7, the ES noise contract: the same pairs and uniforms as gaussian_fill_at but float32
    Cephes ln/sin/cos in the spec's exact operation order. A DISTINCT mapping: agrees with
    gaussian_fill_at to a few f32 ulps, never bitwise."""
    op = "gaussian_fill_at_fast"
    seed, scale = _u64(seed, op), _f32(scale, op)
    t = _Target(out, "f32", op)
    xr.gaussian_fill_at_fast(t.ctx, t.raw, seed, _first(first, t.raw.numel, op), scale)
    return t.done()


def normal_fill(seed: int, out, mean: float = 0.0, std: float = 1.0):
    """RNG-10: gaussian_fill(seed, out, std), then out += mean (f32 add) when mean != 0 —
    fused into the same kernel."""
    op = "normal_fill"
    seed, mean, std = _u64(seed, op), _f32(mean, op), _f32(std, op)
    t = _Target(out, "f32", op)
    xr.gaussian_fill_at(t.ctx, t.raw, seed, 0, std, mean)
    return t.done()


def gumbel_fill(seed: int, out):
    """RNG-10: out[j] = f32(-ln(-ln u_j)) in f64, u_j = open_unit(at(seed, j))."""
    op = "gumbel_fill"
    seed = _u64(seed, op)
    t = _Target(out, "f32", op)
    xr.gumbel_fill(t.ctx, t.raw, seed)
    return t.done()


def randint_fill(seed: int, out, low: int, high: int):
    """RNG-10: out[j] = low + ((at(seed, j)·span) >> 64) (128-bit product, wrapping add),
    span = (high - low) mod 2^64; i64 out; low < high else ValueError (the reference asserts)."""
    op = "randint_fill"
    seed = _u64(seed, op)
    for v in (low, high):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not -(1 << 63) <= v < 1 << 63:
            raise InvalidArgumentType(f"{op}: expected low and high to be i64 ints, got {v!r}")
    if not low < high:
        raise InvalidArgument(f"{op}: expected low < high, got low={low} high={high}")
    t = _Target(out, "i64", op)
    xr.randint_fill(t.ctx, t.raw, seed, int(low), int(high))
    return t.done()


def randperm_fill(seed: int, out):
    """RNG-10: a permutation of 0..n-1 (Fisher–Yates: for k = n-1 … 1 with counter c = 0, 1, …,
    swap out[k] and out[(at(seed, c)·(k+1)) >> 64]); i64 out, one sequential kernel."""
    op = "randperm_fill"
    seed = _u64(seed, op)
    t = _Target(out, "i64", op)
    xr.randperm_fill(t.ctx, t.raw, seed)
    return t.done()


def multinomial(weights, class_tag: str, out_tag: str, num_samples: int, seed: int, replacement: bool):
    """RNG-9 on a Tensor of weights (rank 1 or 2, class axis last): i64 draws, class_tag
    replaced by out_tag. Same as weights.multinomial(...)."""
    return weights.multinomial(class_tag, out_tag, num_samples, seed, replacement)
