"""What every file format here shares: exact reads that never trust a length field with an
allocation, byte views of tensor storage, and "a path or an open binary file" arguments.

Sizes read from a file are only ever allocated after they were checked against a destination,
or read in bounded chunks, so a corrupt length field costs an error, never the process.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from ..ag.tensor import Tensor
from ..exec.dtypes import ITEMSIZE, NUMPY
from ..errors import DTypeError, InvalidArgumentType, InvalidDataLength, NonContiguousParam
from .checkpoint import write_file_atomic

CHUNK = 1 << 20  # bytes per read when the total comes from the file itself


def label(f) -> str:
    """The file's name for messages ("<stream>" for anonymous streams)."""
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else "<stream>"


def read_exact(f, n: int, what: str, where: str) -> bytes:
    """Exactly n bytes; a short stream raises InvalidDataLength. Reads in bounded chunks so a
    huge n from a corrupt header fails at end of file instead of allocating n bytes first."""
    parts, got = [], 0
    while got < n:
        part = f.read(min(CHUNK, n - got))
        if not part:
            raise InvalidDataLength(f"{where}: the stream ended inside {what}: expected {n} bytes, "
                                    f"got {got}")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def readinto_exact(f, dest: memoryview, what: str, where: str) -> None:
    """Fill dest (a writable byte view) from f; a short stream raises InvalidDataLength."""
    n, got = len(dest), 0
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(dest[got:])
        else:
            part = f.read(n - got)
            k = len(part)
            dest[got:got + k] = part
        if not k:
            raise InvalidDataLength(f"{where}: the stream ended inside {what}: expected {n} bytes, "
                                    f"got {got}")
        got += k


def skip_exact(f, n: int, what: str, where: str) -> None:
    """Consume n bytes without keeping them (bounded chunks)."""
    while n > 0:
        part = f.read(min(CHUNK, n))
        if not part:
            raise InvalidDataLength(f"{where}: the stream ended inside {what}: {n} bytes missing")
        n -= len(part)


def storage(t, dtypes: tuple, where: str, what: str) -> np.ndarray:
    """The contiguous storage of tensor t as a writable numpy array (bf16 as uint16 bits).

    Checked: t is live (UseAfterRelease / ContextClosed), its dtype is one of `dtypes`
    (DTypeError), its layout is contiguous (NonContiguousParam). Writing through the result is
    how loads fill variables: parameters are updated outside the graph, like an optimizer step.
    """
    if not isinstance(t, Tensor):
        raise InvalidArgumentType(f"{where}: {what}: expected a fucina Tensor, got "
                                  f"{type(t).__name__}")
    raw = t._live(where)
    if raw.dtype not in dtypes:
        raise DTypeError(f"{where}: {what}: expected dtype in {dtypes}, got {raw.dtype}")
    if not raw.is_contiguous():
        raise NonContiguousParam(f"{where}: {what}: expected a contiguous tensor, got shape "
                                 f"{raw.shape} strides {raw.strides}")
    return np.frombuffer(raw.buf, NUMPY[raw.dtype], raw.numel,
                         raw.offset * ITEMSIZE[raw.dtype]).reshape(raw.shape)


def byte_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (no copy; works for 0-d and empty arrays)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def write_all(out, data) -> None:
    """out.write(data) until every byte is taken: raw (unbuffered) files may write part of a
    large buffer per call (Linux caps one write near 2 GiB)."""
    mv = memoryview(data).cast("B")
    while len(mv):
        n = out.write(mv)
        if n is None or n >= len(mv):
            return
        mv = mv[n:]


@contextlib.contextmanager
def reading(source):
    """`source` is a path (opened here) or a binary file object (used as is, not closed)."""
    if isinstance(source, (str, bytes, os.PathLike)):
        with open(source, "rb") as f:
            yield f
    else:
        yield source


def write_to(target, write) -> None:
    """Run write(f) on a binary file object, or on a path through an atomic replace."""
    if isinstance(target, (str, bytes, os.PathLike)):
        write_file_atomic(target, write)
    else:
        write(target)
