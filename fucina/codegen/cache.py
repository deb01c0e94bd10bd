"""The on-disk kernel cache (DESIGN §4): object code keyed by everything that shapes it.

An entry is one file `<digest>.o` holding a small header, the symbol name and the object code,
with a SHA-256 of the body. Anything that does not verify — truncated, corrupted, written by
another key — is a miss: the caller recompiles and rewrites it. Writes go to a temporary file
in the same directory and are published with `os.replace`, so readers never see half a file
and two processes compiling one key both succeed (the last rename wins, both bodies are equal).
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

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
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared or prewarmed cache from other users
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
