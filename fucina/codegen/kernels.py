"""Kernel keys and the one road from a key to a callable address: memo, disk cache, compile.

A key is a frozen dataclass holding only what changes the generated code (op, dtypes, rank,
the role of each operand's axes) — never sizes or tag names, which are runtime arguments.
Each family registers its key class, so a manifest of keys recorded from real runs can be
rebuilt and compiled ahead of time (`python -m tools.prewarm`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import ClassVar

from . import cache

CODEGEN_VERSION = 1
"""Bumped only when what a cache entry holds changes (its format, or a generator input that is
not a source file). Editing a generator or a formula needs no bump: the fingerprint hashes
every codegen/*.py and kernel_templates/*.py, so each edit gets fresh keys."""
FAMILIES: dict[str, type] = {}


class KernelKey:
    """Base of every key dataclass: `family` names it, `ir(symbol)` renders its module text."""

    family: ClassVar[str] = ""
    vectorize_loops: ClassVar[bool] = False  # True only for kernels written as scalar loops

    def ir(self, symbol: str) -> str:
        raise TypeError(f"{type(self).__name__} does not define ir()")

    def to_json(self) -> str:
        return json.dumps({"family": self.family, "fields": dataclasses.asdict(self)},
                          sort_keys=True)


def register(cls):
    if cls.family in FAMILIES:
        raise ValueError(f"kernel family {cls.family!r} registered twice")
    FAMILIES[cls.family] = cls
    return cls


def key_from_json(line: str) -> KernelKey:
    """Rebuild a key recorded in a manifest (lists become tuples again)."""
    d = json.loads(line)

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return FAMILIES[d["family"]](**{k: tup(v) for k, v in d["fields"].items()})


class Stats:
    """What this process did to get its kernels; the demo and prewarm report it."""

    def __init__(self):
        self.compiled = 0
        self.loaded = 0
        self.compile_seconds = 0.0
        self.load_seconds = 0.0

    def __repr__(self):
        return (f"compiled {self.compiled} ({self.compile_seconds:.2f} s), "
                f"loaded {self.loaded} from cache ({self.load_seconds:.3f} s)")


stats = Stats()
_memo: dict[KernelKey, int] = {}
_fingerprint: bytes | None = None
_recorded: set[str] = set()
_lock = threading.Lock()


def keys_by_address() -> dict[int, KernelKey]:
    """Every kernel loaded so far, by its entry address (profilers charge launches by key)."""
    with _lock:
        return {addr: key for key, addr in _memo.items()}


def fingerprint() -> bytes:
    """Everything outside the key that shapes object code: our generators, LLVM, the CPU."""
    global _fingerprint
    if _fingerprint is None:
        import llvmlite

        from .target import host

        h = hashlib.sha256()
        t = host()
        h.update(f"{CODEGEN_VERSION}|{llvmlite.__version__}|{t.triple}|{t.cpu}|{t.features}".encode())
        here = Path(__file__).parent
        sources = sorted(here.glob("*.py")) + sorted((here.parent / "kernel_templates").glob("*.py"))
        for p in sources:
            h.update(p.name.encode())
            h.update(p.read_bytes())
        _fingerprint = h.digest()
    return _fingerprint


def digest(key: KernelKey) -> bytes:
    return hashlib.sha256(fingerprint() + key.to_json().encode()).digest()


def get(key: KernelKey) -> int:
    """The address of the kernel for `key`, compiling it only if no cache has it.

    LLVM's engine is not thread-safe, so resolving is serialised; hits never take the lock."""
    addr = _memo.get(key)
    if addr is None:
        with _lock:
            addr = _memo.get(key)
            if addr is None:
                addr = _memo[key] = _resolve(key)
    return addr


def _resolve(key: KernelKey) -> int:
    from . import jit
    from ..errors import KernelCacheError

    _record(key)
    d = digest(key)
    root = cache.cache_dir()
    if root is not None:
        t0 = time.perf_counter()
        hit = cache.read(root, d)
        if hit is not None:
            symbol, obj = hit
            try:
                addr = jit.loader().load_object(obj, [symbol])[symbol]
            except Exception:  # an entry that verifies but does not load: treat as a miss
                addr = None
            if addr:
                stats.loaded += 1
                stats.load_seconds += time.perf_counter() - t0
                return addr
    if os.environ.get("FUCINA_ASSERT_WARM") == "1":
        raise KernelCacheError(
            f"FUCINA_ASSERT_WARM=1 but kernel {key.family} {key.to_json()} is not in the cache "
            f"{root}: expected a warm cache, got a miss")
    t0 = time.perf_counter()
    symbol = "fk_" + d.hex()[:32]
    obj = jit.compile_object(key.ir(symbol), vectorize_loops=key.vectorize_loops)
    addr = jit.loader().load_object(obj, [symbol])[symbol]
    stats.compiled += 1
    stats.compile_seconds += time.perf_counter() - t0
    if root is not None:
        cache.write(root, d, symbol, obj)
    return addr


def _record(key: KernelKey) -> None:
    """Append the key to $FUCINA_RECORD_MANIFEST (one JSON line per distinct key)."""
    path = os.environ.get("FUCINA_RECORD_MANIFEST")
    if not path:
        return
    line = key.to_json()
    if line in _recorded:
        return
    _recorded.add(line)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
