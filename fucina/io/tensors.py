"""FZT1 / FZT2 parameter files (SPEC T-15): positional, f32 only, the legacy inference format.

    b"FZT1" | u32 count | per tensor: u32 rank | rank x u64 dims | numel x f32   (little-endian)
    b"FZT2" | u32 count | per tensor: u32 rank | rank x u64 dims | numel x f32 | u32 crc

FZT2 (written by default; not in the SPEC) is FZT1 plus, after each tensor, the CRC32 of every
byte of the file before it (the magic through that tensor's data, earlier CRCs included), so a flipped or lost byte is reported as a
ChecksumMismatch naming the first tensor it reaches. FZT1 files still load (no check).

The loading program lists the same tensors in the same order; shapes are checked. Loading is
transactional: every tensor is read into staging and checked before any destination is written,
so a truncated, corrupt or mismatched file leaves all of them bit-identical.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from ..errors import (ChecksumMismatch, CheckpointMagicMismatch, CheckpointShapeMismatch,
                      CheckpointTooManyEntries)
from .stream import (byte_view, label, read_exact, readinto_exact, reading, storage, write_all,
                     write_to)

MAGIC = b"FZT1"
MAGIC_CHECKED = b"FZT2"
_MAX_COUNT = (1 << 32) - 1


def _storages(tensors, where: str) -> list:
    views = [storage(t, ("f32",), where, f"tensor {i}") for i, t in enumerate(tensors)]
    if len(views) > _MAX_COUNT:
        raise CheckpointTooManyEntries(f"{where}: expected at most {_MAX_COUNT} tensors (u32 count), "
                                       f"got {len(views)}")
    return views


def save_tensors(f, tensors, checksum: bool = True) -> None:
    """Write `tensors` (contiguous f32) to f: a binary file object, or a path (replaced
    atomically). FZT2 with per-tensor CRC32s, or the SPEC's FZT1 bytes with checksum=False.
    Everything is validated before the first byte is written."""
    views = _storages(tensors, "save_tensors")

    def write(out):
        crc = 0

        def put(data):
            nonlocal crc
            if checksum:
                crc = zlib.crc32(data, crc)
            write_all(out, data)
        put((MAGIC_CHECKED if checksum else MAGIC) + struct.pack("<I", len(views)))
        for a in views:
            put(struct.pack(f"<I{a.ndim}Q", a.ndim, *a.shape))
            put(byte_view(a))
            if checksum:
                put(struct.pack("<I", crc))
    write_to(f, write)


def load_tensors(f, tensors) -> None:
    """Fill `tensors` (contiguous f32, in the order they were saved) from f: a binary file
    object or a path, FZT1 or FZT2. Errors: CheckpointMagicMismatch, CheckpointShapeMismatch
    (count, rank or dims), InvalidDataLength (the stream ends early), ChecksumMismatch (FZT2: a
    tensor's bytes differ from its CRC32); on any of them nothing was written."""
    dests = _storages(tensors, "load_tensors")
    with reading(f) as src:
        where = f"load_tensors({label(src)})"
        magic = read_exact(src, 4, "the FZT1 magic", where)
        if magic not in (MAGIC, MAGIC_CHECKED):
            raise CheckpointMagicMismatch(f"{where}: expected magic {MAGIC!r} or "
                                          f"{MAGIC_CHECKED!r}, got {magic!r}")
        checked = magic == MAGIC_CHECKED
        head = read_exact(src, 4, "the tensor count", where)
        crc = zlib.crc32(head, zlib.crc32(magic))
        (count,) = struct.unpack("<I", head)
        if count != len(dests):
            raise CheckpointShapeMismatch(f"{where}: expected {len(dests)} tensors, the file holds {count}")
        staged = []
        for i, d in enumerate(dests):
            raw_rank = read_exact(src, 4, f"tensor {i}'s rank", where)
            (rank,) = struct.unpack("<I", raw_rank)
            if rank != d.ndim:
                raise CheckpointShapeMismatch(f"{where}: tensor {i}: expected rank {d.ndim} "
                                              f"(shape {d.shape}), the file has rank {rank}")
            raw_dims = read_exact(src, 8 * rank, f"tensor {i}'s dims", where)
            dims = struct.unpack(f"<{rank}Q", raw_dims)
            if dims != d.shape:
                raise CheckpointShapeMismatch(f"{where}: tensor {i}: expected shape {d.shape}, "
                                              f"the file has {dims}")
            buf = np.empty(d.shape, np.float32)
            readinto_exact(src, byte_view(buf), f"tensor {i}'s data", where)
            if checked:
                crc = zlib.crc32(byte_view(buf), zlib.crc32(raw_dims, zlib.crc32(raw_rank, crc)))
                raw_crc = read_exact(src, 4, f"tensor {i}'s CRC32", where)
                (want,) = struct.unpack("<I", raw_crc)
                if want != crc:
                    raise ChecksumMismatch(f"{where}: tensor {i}: expected CRC32 {want:08x}, "
                                           f"computed {crc:08x}; the file is corrupt")
                crc = zlib.crc32(raw_crc, crc)
            staged.append(buf)
    for d, s in zip(dests, staged):  # commit: nothing below can fail
        np.copyto(d, s)
