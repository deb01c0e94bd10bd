"""Typed (non-f32) Tensor methods (SPEC R-11): the integer division family and bitwise ops.

i64 add/sub/mul/maximum/minimum go through the elementwise family's methods (they wrap); here
are the ops only integers have. All are no-grad (integer tensors never carry gradients), all
follow A-2 broadcasting, and the other operand may be an i64 tensor or a Python int.

  div_trunc  quotient toward zero                 minInt.div_trunc(-1) == minInt (wraps)
  div_floor  quotient toward -inf  (x // y)       minInt // -1 == minInt (wraps)
  rem        remainder, sign of the dividend       minInt.rem(-1) == 0
  mod        remainder, sign of the divisor (x % y)
  bit_and, bit_or, bit_xor

A zero divisor raises DivisionByZero. The generated division kernel never traps on one (it
divides by a guarded divisor, see fucina.codegen.typed); the host finds zeros afterwards with
the `zero_scan` kernel over the divisor's own elements (see `any_zero`).
"""
from __future__ import annotations

import numbers

import numpy as np

from ..codegen import kernels
from ..codegen.typed import ZeroScanKey
from ..errors import DivisionByZero, DTypeError, GradientCastUnsupported
from ..exec import elementwise as ew
from ..exec import quant as xq
from ..exec.dtypes import BLOCKS, FLOATS
from ..exec.raw import RawTensor
from .engine import needs_graph

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def any_zero(raw: RawTensor) -> bool:
    """True iff some element of an i64 tensor is 0: one read of its elements by a generated
    kernel writing a flag byte per 32768-element chunk (no atomics, any grid gives the same
    flags), which the host ORs. A non-contiguous view is materialised first."""
    ctx = raw.ctx
    if not raw.is_contiguous():
        raw = ew.materialize(ctx, raw)
    n = raw.numel
    if n == 0:
        return False
    chunks = -(-n // ew.CHUNK)
    flags = np.zeros(chunks, np.uint8)
    ctx.launch(kernels.get(ZeroScanKey(raw.dtype)), chunks, n * raw.lay.itemsize,
               raw.addr, n, ew.CHUNK, flags.ctypes.data)
    return bool(flags.any())


def block_cast(x, dtype: str):
    """to() when either side is a block-quantized dtype (SPEC R-9, R-10): f32/f16/bf16 -> block
    quantizes (byte-exact to ggml), block -> f32 dequantizes. Never differentiable: a tensor
    that requires grad raises GradientCastUnsupported; quantized tensors never carry grad."""
    r = x._raw
    src = r.dtype
    if src in BLOCKS:
        if dtype != "f32":
            raise DTypeError(f"to: a {src} tensor converts only to 'f32' (dequantize), got {dtype!r}")
        return x._result(xq.decode(r.ctx, r), x.tags)
    if src not in FLOATS:
        raise DTypeError(f"to: quantizing to {dtype} expects an f32/f16/bf16 tensor, got {src}")
    if needs_graph(x):
        raise GradientCastUnsupported(
            f"to: quantizing ({src} -> {dtype}) is not differentiable, got a tensor that requires "
            f"grad; expected .detach() or fu.no_grad() (quantized tensors never carry gradients)")
    xq.check_shape("to", dtype, r.shape)
    f = ew.cast(r.ctx, r, "f32") if src != "f32" or not r.is_contiguous() else r
    return x._result(xq.encode(r.ctx, f, dtype), x.tags)


def _check_int_scalar(op: str, other) -> None:
    """A Python integer operand must fit in i64 (it is passed to the kernel as 64 bits)."""
    if isinstance(other, numbers.Integral) and not isinstance(other, bool):
        if not I64_MIN <= int(other) <= I64_MAX:
            raise DTypeError(f"{op}: expected an integer scalar in the i64 range, got {other}")


def _divide(x, op: str, other, reflected: bool = False):
    """x op other (other op x when reflected). The op runs first — so tag, context and dtype
    errors come before any work — then the divisor is checked and a zero raises."""
    x._live(op)
    _check_int_scalar(op, other)
    out = x._binary(op, other, reflected)
    divisor = x if reflected else other
    if isinstance(divisor, numbers.Number):
        zero = divisor == 0
    else:
        zero = any_zero(divisor._raw)
    if zero:
        out.release()
        raise DivisionByZero(f"{op}: the divisor holds a zero; expected every divisor element nonzero")
    return out


def _bitwise(x, op: str, other):
    x._live(op)
    _check_int_scalar(op, other)
    return x._binary(op, other)


class TypedMethods:
    """Tensor methods only integer tensors have (SPEC R-11)."""

    __slots__ = ()

    def div_trunc(self, other):
        """Integer division rounded toward zero (C `/`); other: an i64 tensor or an int."""
        return _divide(self, "div_trunc", other)

    def div_floor(self, other):
        """Integer division rounded toward -inf (Python `//`)."""
        return _divide(self, "div_floor", other)

    def rem(self, other):
        """Remainder with the sign of the dividend (C `%`, torch.fmod)."""
        return _divide(self, "rem", other)

    def mod(self, other):
        """Remainder with the sign of the divisor (Python `%`, torch.remainder)."""
        return _divide(self, "mod", other)

    def __floordiv__(self, other):
        return _divide(self, "div_floor", other)

    def __rfloordiv__(self, other):
        return _divide(self, "div_floor", other, reflected=True)

    def __mod__(self, other):
        return _divide(self, "mod", other)

    def __rmod__(self, other):
        return _divide(self, "mod", other, reflected=True)

    def bit_and(self, other):
        """Bitwise AND of two's-complement i64 values."""
        return _bitwise(self, "bit_and", other)

    def bit_or(self, other):
        return _bitwise(self, "bit_or", other)

    def bit_xor(self, other):
        return _bitwise(self, "bit_xor", other)
