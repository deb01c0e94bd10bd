"""Block-quantized tensors at the exec layer (SPEC R-9): their RawTensor, and encoding and
decoding through the generated kernels of fucina.codegen.quant.

A block spans the innermost axis, so a quantized tensor of shape (..., K) is rows of K / block
elements' worth of whole blocks laid end to end; K must be a nonzero multiple of the block size.
Quantized storage is always contiguous: the kernels see one flat run of blocks.
"""
from __future__ import annotations

import numpy as np

from ..codegen import kernels
from ..codegen.quant import ENCODABLE, QuantKey
from ..errors import DTypeError, InvalidShape
from .dtypes import BLOCKS
from .raw import RawTensor, contiguous_layout

DECODE_CHUNK = 1 << 14   # elements per decode chunk
ENCODE_CHUNK = {"q8_0": 1 << 13, "tq2_0": 1 << 13}  # K-quant encoders search scales: 1 KiB-element chunks
ENCODE_DEFAULT = 1 << 10


class BlockRaw(RawTensor):
    """A RawTensor of a block dtype. Offsets count elements, as in every view; the address of
    element `offset` (a multiple of the block size) is that of its block."""

    __slots__ = ()

    def __init__(self, buf, lay, offset, ctx):
        bs, bb = BLOCKS[lay.dtype]
        self.buf, self.lay, self.offset, self.ctx = buf, lay, offset, ctx
        self.addr = buf.addr + offset // bs * bb

    @property
    def n_blocks(self) -> int:
        return self.numel // BLOCKS[self.dtype][0]

    @property
    def strides(self):
        """Element strides mean nothing inside a block: any op that walks a quantized tensor
        element by element (every op but to('f32') and the quantized matmul) stops here."""
        raise DTypeError(f"this op does not take a {self.dtype} tensor: block-quantized tensors "
                         f"support only .to('f32') (dequantize) and use as the right operand of "
                         f"dot; expected a f32/f16/bf16 tensor, got {self.dtype} {self.shape}")

    def view(self, shape, strides, offset=None):
        raise DTypeError(f"view: a {self.dtype} tensor has no strided views; expected a dense "
                         f"f32/f16/bf16 tensor (dequantize with .to('f32') first)")

    def storage_view(self) -> np.ndarray:
        """The raw block bytes, one row of whole blocks per innermost row: (..., row bytes)."""
        shape = self.shape[:-1] + (row_bytes(self.dtype, self.shape[-1]),)
        return np.frombuffer(self.buf, np.uint8, count=self.lay.nbytes,
                             offset=self.addr - self.buf.addr).reshape(shape)

    def to_numpy(self) -> np.ndarray:
        """The dequantized values as float32 (the generated decoder, not numpy)."""
        return decode(self.ctx, self).to_numpy()


def row_bytes(fmt: str, K: int) -> int:
    bs, bb = BLOCKS[fmt]
    return K // bs * bb


def check_shape(op: str, fmt: str, shape) -> None:
    """The innermost axis must hold a nonzero whole number of blocks."""
    bs = BLOCKS[fmt][0]
    if len(shape) == 0 or shape[-1] == 0 or shape[-1] % bs:
        inner = shape[-1] if shape else "none (a scalar)"
        raise InvalidShape(f"{op}: a {fmt} tensor needs an innermost axis that is a nonzero "
                           f"multiple of {bs}; got shape {tuple(shape)} (innermost {inner})")


def wrap(ctx, buf, shape, fmt: str) -> BlockRaw:
    """A quantized tensor over existing storage (a pooled buffer or a borrowed file mapping)."""
    check_shape("quantized tensor", fmt, shape)
    lay = contiguous_layout(fmt, tuple(shape))
    if buf.nbytes < lay.nbytes:
        raise InvalidShape(f"quantized tensor: {fmt} {tuple(shape)} needs {lay.nbytes} bytes, "
                           f"the storage holds {buf.nbytes}")
    return BlockRaw(buf, lay, 0, ctx)


def empty(ctx, shape, fmt: str) -> BlockRaw:
    check_shape("quantized tensor", fmt, shape)
    t = ctx.empty(tuple(shape), fmt)
    return BlockRaw(t.buf, t.lay, 0, ctx)


def from_bytes(ctx, data, shape, fmt: str) -> BlockRaw:
    """Copy raw ggml block bytes into a new pooled quantized tensor."""
    out = empty(ctx, shape, fmt)
    src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    if src.size != out.lay.nbytes:
        raise InvalidShape(f"quantized tensor: {fmt} {tuple(shape)} takes {out.lay.nbytes} bytes, "
                           f"got {src.size}")
    np.frombuffer(out.buf, np.uint8, count=src.size)[:] = src
    return out


def decode(ctx, q: BlockRaw) -> RawTensor:
    """The f32 tensor of q's values (ggml's dequantize_row_* for its format)."""
    out = ctx.empty(q.shape, "f32")
    n = q.n_blocks
    bs, bb = BLOCKS[q.dtype]
    per = max(1, DECODE_CHUNK // bs)
    ctx.launch(kernels.get(QuantKey(q.dtype, "decode")), -(-n // per), n * (bb + 4 * bs),
               q.addr, out.addr, n, per)
    return out


def encode(ctx, x: RawTensor, fmt: str) -> BlockRaw:
    """x (contiguous f32) quantized to `fmt`, byte for byte as ggml's reference quantizer."""
    if fmt not in ENCODABLE:
        raise DTypeError(f"to: quantizing to {fmt} is not supported; expected one of {ENCODABLE} "
                         f"(every block format decodes)")
    check_shape("to", fmt, x.shape)
    if x.dtype != "f32" or not x.is_contiguous():
        raise DTypeError(f"to: quantizing expects a contiguous f32 tensor, got {x.dtype}")
    out = empty(ctx, x.shape, fmt)
    n = out.n_blocks
    bs, bb = BLOCKS[fmt]
    per = max(1, ENCODE_CHUNK.get(fmt, ENCODE_DEFAULT) // bs)
    # the launch cost (bytes touched) is scaled up: the scale searches are compute-bound
    ctx.launch(kernels.get(QuantKey(fmt, "encode")), -(-n // per), n * (bb + 4 * bs) * 16,
               x.addr, out.addr, n, per)
    return out


__all__ = ["BlockRaw", "BLOCKS", "ENCODABLE", "check_shape", "decode", "empty", "encode",
           "from_bytes", "row_bytes", "wrap"]
