"""The dtypes a RawTensor can hold and their numpy twins (numpy is only the I/O bridge)."""
from __future__ import annotations

import numpy as np

from ..codegen.quant import FORMATS
from ..errors import DTypeError, InvalidArgument, InvalidArgumentType

DTYPES = ("f32", "f16", "bf16", "i64", "bool")
NUMPY = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16),
         "i64": np.dtype(np.int64), "bool": np.dtype(np.bool_)}
ITEMSIZE = {k: v.itemsize for k, v in NUMPY.items()}
FLOATS = ("f32", "f16", "bf16")
# block-quantized dtypes (SPEC R-9): name -> (elements per block, bytes per block); a block
# spans the innermost axis, so their storage is sized by blocks, not by elements
BLOCKS = FORMATS


def check(dtype, op: str = "dtype") -> str:
    if dtype not in NUMPY:
        raise DTypeError(f"{op}: expected dtype in {DTYPES}, got {dtype!r}")
    return dtype


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """SPEC R-9 NaN-guarded round-to-nearest-even, as uint16 bits (construction bridge only;
    tensors convert with the generated kernel, which uses the same formula)."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rne = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, (b >> np.uint32(16)) | np.uint32(0x40), rne).astype(np.uint16)


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def host_array(data, op: str) -> np.ndarray:
    """Array-like construction data as numpy, refusing what is not numbers (strings, ragged
    nesting, objects) with the op named instead of numpy's bare ValueError."""
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidArgumentType(f"{op}: expected numeric array-like data, got "
                                  f"{type(data).__name__} ({e})") from None
    if arr.dtype.kind in "OUSMmV" and not (arr.dtype.kind == "V" and arr.dtype.itemsize == 2):
        raise InvalidArgumentType(f"{op}: expected numeric data (bool, int or float), got "
                                  f"numpy dtype {arr.dtype}")
    return arr


def checked_storage(data, dtype: str, op: str) -> np.ndarray:
    """to_storage of host_array(data): an i64 tensor refuses nan and inf (no integer holds
    them; numpy would store an arbitrary value) and out-of-range integers."""
    arr = host_array(data, op)
    if dtype == "i64" and arr.dtype.kind == "f" and arr.size and not np.all(np.isfinite(arr)):
        raise InvalidArgument(f"{op}: expected finite values for an i64 tensor, got nan or inf")
    try:
        return to_storage(arr, dtype)
    except OverflowError as e:
        raise InvalidArgument(f"{op}: a value does not fit dtype {dtype} ({e})") from None


def to_storage(data, dtype: str) -> np.ndarray:
    """Python/numpy data as a contiguous array of `dtype`'s storage type."""
    if dtype == "bf16":
        return f32_to_bf16_bits(np.asarray(data, dtype=np.float32))
    return np.ascontiguousarray(data, dtype=NUMPY[dtype])
