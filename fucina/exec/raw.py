"""RawTensor: storage + shape + strides + offset + dtype, and the views that never copy.

Strides and offsets count elements. A zero stride is a broadcast. Layout classes (SPEC R-4)
are what kernels specialise on; `layout_class` computes them in the reference's order.
"""
from __future__ import annotations

import enum

import numpy as np

from ..errors import InvalidShape, ShapeMismatch
from .dtypes import BLOCKS, ITEMSIZE, NUMPY, bf16_bits_to_f32

MAX_RANK = 8


class LayoutClass(enum.Enum):
    CONTIGUOUS = "contiguous"
    SCALAR = "scalar"
    TAIL_BROADCAST = "tail_broadcast"
    ARBITRARY = "arbitrary"


def contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Layout:
    """dtype + shape + strides, interned: equal layouts are the same object, so plan caches
    hash and compare them by identity (the per-op fast path depends on it)."""

    __slots__ = ("dtype", "shape", "strides", "numel", "itemsize", "nbytes", "contiguous")

    def __init__(self, dtype, shape, strides):
        self.dtype, self.shape, self.strides = dtype, shape, strides
        self.numel = numel(shape)
        block = BLOCKS.get(dtype)
        if block is None:
            self.itemsize = ITEMSIZE[dtype]
            self.nbytes = self.numel * self.itemsize
        else:  # block-quantized: whole blocks along the innermost axis (fucina.exec.quant)
            self.itemsize = 0
            self.nbytes = self.numel // block[0] * block[1]
        self.contiguous = all(s == c or d == 1 for d, s, c in
                              zip(shape, strides, contiguous_strides(shape)))

    def __repr__(self):
        return f"Layout({self.dtype}, {self.shape}, {self.strides})"


_layouts: dict = {}


def layout(dtype: str, shape: tuple, strides: tuple) -> Layout:
    k = (dtype, shape, strides)
    lay = _layouts.get(k)
    if lay is None:
        lay = _layouts[k] = Layout(dtype, shape, strides)
    return lay


_contiguous: dict = {}


def contiguous_layout(dtype: str, shape) -> Layout:
    """The row-major layout of `shape` (memoised: this is on every op's path)."""
    if type(shape) is not tuple:
        shape = tuple(shape)
    k = (dtype, shape)
    lay = _contiguous.get(k)
    if lay is None:
        lay = _contiguous[k] = layout(dtype, shape, contiguous_strides(shape))
    return lay


class RawTensor:
    """A view of a runtime Buffer; the buffer returns to the pool when the last view dies."""

    __slots__ = ("buf", "lay", "offset", "addr", "ctx", "__weakref__")

    def __init__(self, buf, lay: Layout, offset: int, ctx):
        self.buf, self.lay, self.offset, self.ctx = buf, lay, offset, ctx
        self.addr = buf.addr + offset * lay.itemsize

    @property
    def shape(self) -> tuple:
        return self.lay.shape

    @property
    def strides(self) -> tuple:
        return self.lay.strides

    @property
    def dtype(self) -> str:
        return self.lay.dtype

    @property
    def numel(self) -> int:
        return self.lay.numel

    @property
    def rank(self) -> int:
        return len(self.lay.shape)

    def is_contiguous(self) -> bool:
        return self.lay.contiguous

    def layout_class(self) -> LayoutClass:
        if self.numel == 1:
            return LayoutClass.SCALAR
        if self.is_contiguous():
            return LayoutClass.CONTIGUOUS
        s = next((i for i, st in enumerate(self.strides) if st != 0), len(self.shape))
        inner = self.shape[s:]
        if all(st == 0 for st in self.strides[:s]) and all(
                st == c or d == 1 for d, st, c in zip(inner, self.strides[s:], contiguous_strides(inner))):
            return LayoutClass.TAIL_BROADCAST
        return LayoutClass.ARBITRARY

    # ---- views (no copy) ----
    def view(self, shape, strides, offset=None) -> "RawTensor":
        return RawTensor(self.buf, layout(self.dtype, tuple(shape), tuple(strides)),
                         self.offset if offset is None else offset, self.ctx)

    def broadcast_to(self, shape) -> "RawTensor":
        """Same rank; every size-1 axis may stretch (stride 0)."""
        if len(shape) != self.rank:
            raise ShapeMismatch(f"broadcast_to: expected rank {self.rank}, got shape {tuple(shape)}")
        strides = []
        for ax, (have, want, st) in enumerate(zip(self.shape, shape, self.strides)):
            if have == want:
                strides.append(st)
            elif have == 1:
                strides.append(0)
            else:
                raise ShapeMismatch(f"broadcast_to: axis {ax} has size {have}, cannot become {want}")
        return self.view(shape, strides)

    def narrow(self, axis: int, start: int, length: int) -> "RawTensor":
        if not (0 <= start and length >= 0 and start + length <= self.shape[axis]):
            raise InvalidShape(f"narrow: axis {axis} of size {self.shape[axis]}: "
                               f"expected 0 <= start and start+length <= size, got start={start} length={length}")
        shape = list(self.shape)
        shape[axis] = length
        return self.view(shape, self.strides, self.offset + start * self.strides[axis])

    def permute(self, perm) -> "RawTensor":
        if sorted(perm) != list(range(self.rank)):
            raise InvalidShape(f"permute: expected a permutation of 0..{self.rank - 1}, got {tuple(perm)}")
        return self.view([self.shape[p] for p in perm], [self.strides[p] for p in perm])

    # ---- numpy bridge ----
    def storage_view(self) -> np.ndarray:
        """The strided numpy view of this tensor's storage (storage dtype; bf16 as uint16)."""
        dt = NUMPY[self.dtype]
        base = np.frombuffer(self.buf, dtype=dt)
        return np.lib.stride_tricks.as_strided(
            base[self.offset:], shape=self.shape, strides=[s * dt.itemsize for s in self.strides])

    def to_numpy(self) -> np.ndarray:
        """A copy as numpy; bf16 widens to float32."""
        a = np.array(self.storage_view())
        return bf16_bits_to_f32(a) if self.dtype == "bf16" else a
