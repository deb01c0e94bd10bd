"""FZT1 parameter files (SPEC T-15): positional, f32 only, the legacy inference format.

    b"FZT1" | u32 count | per tensor: u32 rank | rank x u64 dims | numel x f32   (little-endian)

The loading program lists the same tensors in the same order; shapes are checked. Loading is
transactional: every tensor is read into staging and checked before any destination is written,
so a truncated or mismatched file leaves all of them bit-identical.
"""
from __future__ import annotations

import struct

import numpy as np

from ..errors import CheckpointMagicMismatch, CheckpointShapeMismatch, CheckpointTooManyEntries
from .stream import (byte_view, label, read_exact, readinto_exact, reading, storage, write_all,
                     write_to)

MAGIC = b"FZT1"
_MAX_COUNT = (1 << 32) - 1


def _storages(tensors, where: str) -> list:
    views = [storage(t, ("f32",), where, f"tensor {i}") for i, t in enumerate(tensors)]
    if len(views) > _MAX_COUNT:
        raise CheckpointTooManyEntries(f"{where}: expected at most {_MAX_COUNT} tensors (u32 count), "
                                       f"got {len(views)}")
    return views


def save_tensors(f, tensors) -> None:
    """Write `tensors` (contiguous f32) to f: a binary file object, or a path (replaced
    atomically). Everything is validated before the first byte is written."""
    views = _storages(tensors, "save_tensors")

    def write(out):
        write_all(out, MAGIC + struct.pack("<I", len(views)))
        for a in views:
            write_all(out, struct.pack(f"<I{a.ndim}Q", a.ndim, *a.shape))
            write_all(out, byte_view(a))
    write_to(f, write)


def load_tensors(f, tensors) -> None:
    """Fill `tensors` (contiguous f32, in the order they were saved) from f: a binary file
    object or a path. Errors: CheckpointMagicMismatch, CheckpointShapeMismatch (count, rank or
    dims), InvalidDataLength (the stream ends early); on any of them nothing was written."""
    dests = _storages(tensors, "load_tensors")
    with reading(f) as src:
        where = f"load_tensors({label(src)})"
        magic = read_exact(src, 4, "the FZT1 magic", where)
        if magic != MAGIC:
            raise CheckpointMagicMismatch(f"{where}: expected magic {MAGIC!r}, got {magic!r}")
        (count,) = struct.unpack("<I", read_exact(src, 4, "the tensor count", where))
        if count != len(dests):
            raise CheckpointShapeMismatch(f"{where}: expected {len(dests)} tensors, the file holds {count}")
        staged = []
        for i, d in enumerate(dests):
            (rank,) = struct.unpack("<I", read_exact(src, 4, f"tensor {i}'s rank", where))
            if rank != d.ndim:
                raise CheckpointShapeMismatch(f"{where}: tensor {i}: expected rank {d.ndim} "
                                              f"(shape {d.shape}), the file has rank {rank}")
            dims = struct.unpack(f"<{rank}Q", read_exact(src, 8 * rank, f"tensor {i}'s dims", where))
            if dims != d.shape:
                raise CheckpointShapeMismatch(f"{where}: tensor {i}: expected shape {d.shape}, "
                                              f"the file has {dims}")
            buf = np.empty(d.shape, np.float32)
            readinto_exact(src, byte_view(buf), f"tensor {i}'s data", where)
            staged.append(buf)
    for d, s in zip(dests, staged):  # commit: nothing below can fail
        np.copyto(d, s)
