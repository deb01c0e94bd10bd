"""The on-disk kernel cache (DESIGN §4): object code keyed by everything that shapes it.

An entry is one file `<digest>.o` holding a small header, the symbol name and the object code,
with a SHA-256 of the body. Anything that does not verify — truncated, corrupted, written by
another key — is a miss: the caller recompiles and rewrites it. Writes go through
fucina.files.write_file_atomic (an unnamed temp file, published with `os.replace`; a killed
writer's leftovers are swept by the next write into the shard), so readers never see half a
file and two processes compiling one key both succeed (the last rename wins, both bodies are
equal).
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from ..files import write_file_atomic

MAGIC = b"FUCINAK1"
_HEADER = struct.Struct("<8s32s32sII")  # magic, key digest, body sha256, symbol len, object len


def cache_dir() -> Path | None:
    """The cache directory, or None when FUCINA_CACHE=0 disables the cache."""
    if os.environ.get("FUCINA_CACHE", "1") == "0":
        return None
    env = os.environ.get("FUCINA_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("fucina"))


def _entry_path(root: Path, digest: bytes) -> Path:
    h = digest.hex()
    return root / h[:2] / f"{h}.o"


def read(root: Path, digest: bytes) -> tuple[str, bytes] | None:
    """The (symbol, object code) stored for `digest`, or None if absent or not intact."""
    try:
        data = _entry_path(root, digest).read_bytes()
    except OSError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, key, body_hash, sym_len, obj_len = _HEADER.unpack_from(data)
    body = data[_HEADER.size:]
    if (magic != MAGIC or key != digest or len(body) != sym_len + obj_len
            or hashlib.sha256(body).digest() != body_hash):
        return None
    try:
        symbol = body[:sym_len].decode("ascii")
    except UnicodeDecodeError:
        return None
    return symbol, body[sym_len:]


def write(root: Path, digest: bytes, symbol: str, obj: bytes) -> None:
    """Publish an entry atomically; a failure to write (read-only disk, full disk) is not fatal."""
    sym = symbol.encode("ascii")
    body = sym + obj
    blob = _HEADER.pack(MAGIC, digest, hashlib.sha256(body).digest(), len(sym), len(obj)) + body
    path = _entry_path(root, digest)
    try:
        write_file_atomic(path, lambda f: f.write(blob), durable=False)
    except OSError:
        pass
