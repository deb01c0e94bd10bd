"""The safetensors container, written and read here (the `safetensors` package is only the
parity oracle of the tests).

    u64 LE N | N bytes of JSON header, space-padded to a multiple of 8 | data

The header maps each name to {"dtype", "shape", "data_offsets"} (offsets relative to the data
section, contiguous from 0, no holes); an optional "__metadata__" maps strings to strings.
Writers order entries by descending dtype declaration order, then by name (bytewise), exactly as
the upstream serializer does, so the bytes of a save are reproducible and equal upstream's.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..errors import (CheckpointDuplicateName, CheckpointInvalidName, CheckpointMagicMismatch,
                     CheckpointShapeMismatch, CheckpointUnsupportedDtype)
from .stream import read_exact

# The upstream dtype enum, in declaration order (the order is part of the header ordering rule).
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
               "C64", "F64", "I64", "U64")
_RANK = {d: i for i, d in enumerate(DTYPE_ORDER)}
BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
        "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
        "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
        "U64": 64}
# The Fucina dtypes a state dict holds, and their safetensors names (bf16 travels as raw bits).
TO_SAFETENSORS = {"f32": "F32", "f16": "F16", "bf16": "BF16", "i64": "I64"}
FROM_SAFETENSORS = {v: k for k, v in TO_SAFETENSORS.items()}
MAX_HEADER = 100_000_000  # upstream's limit: a larger N is not a safetensors file
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: safetensors dtype name, shape, byte range in the data section."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int


def byte_length(dtype: str, shape) -> int | None:
    """Bytes of `shape` elements of `dtype`, or None when they do not fill whole bytes."""
    n = BITS[dtype]
    for d in shape:
        n *= d
    return None if n % 8 else n // 8


def check_name(name, where: str) -> bytes:
    """A tensor name usable in a header: a non-empty str, NUL-free, valid UTF-8 (no lone
    surrogates), not the metadata key. Returns its UTF-8 bytes."""
    if not isinstance(name, str):
        raise CheckpointInvalidName(f"{where}: expected a str name, got {type(name).__name__} {name!r}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointInvalidName(f"{where}: name {name!r}: expected valid UTF-8, got a lone "
                                    f"surrogate") from None
    if not raw or b"\0" in raw or name == METADATA_KEY:
        raise CheckpointInvalidName(f"{where}: expected a non-empty, NUL-free name other than "
                                    f"{METADATA_KEY!r}, got {name!r}")
    return raw


def header(items) -> tuple[bytes, list]:
    """The `u64 N | header` prefix for items [(name, fucina dtype, shape, nbytes, payload)] and
    the items in file order. Names must already be checked and unique."""
    ordered = sorted(items, key=lambda it: (-_RANK[TO_SAFETENSORS[it[1]]], it[0].encode("utf-8")))
    parts, offset = [], 0
    for name, dtype, shape, nbytes, _ in ordered:
        parts.append(f'{json.dumps(name, ensure_ascii=False)}:{{"dtype":"{TO_SAFETENSORS[dtype]}",'
                     f'"shape":[{",".join(str(d) for d in shape)}],'
                     f'"data_offsets":[{offset},{offset + nbytes}]}}')
        offset += nbytes
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _unique_pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointDuplicateName(f"the header names {k!r} twice")
        out[k] = v
    return out


def _reject_constant(name):
    raise ValueError(f"non-JSON number {name}")


def _index(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(name: str, info, where: str) -> Entry:
    def bad(why):
        return CheckpointMagicMismatch(f"{where}: entry {name!r}: expected a safetensors tensor "
                                       f"record, {why}")
    if not isinstance(info, dict):
        raise bad(f"got {type(info).__name__}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"got dtype {dtype!r}")
    if dtype not in _RANK:
        raise CheckpointUnsupportedDtype(f"{where}: entry {name!r}: expected a safetensors dtype "
                                         f"({', '.join(DTYPE_ORDER)}), got {dtype!r}")
    if not isinstance(shape, list) or not all(_index(d) for d in shape):
        raise bad(f"got shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_index(o) for o in offsets)):
        raise bad(f"got data_offsets {offsets!r}")
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def read_header(f, where: str) -> list:
    """Read `u64 N | header` from f and return its tensor entries in data order, checked:
    offsets contiguous from 0 and each range exactly the entry's byte length. Metadata is
    validated and dropped. Errors: InvalidDataLength (truncated), CheckpointMagicMismatch (not a
    safetensors header), CheckpointUnsupportedDtype, CheckpointInvalidName,
    CheckpointDuplicateName, CheckpointShapeMismatch (offsets disagree with dtype x shape)."""
    (n,) = struct.unpack("<Q", read_exact(f, 8, "the safetensors header length", where))
    if n > MAX_HEADER:
        raise CheckpointMagicMismatch(f"{where}: expected a safetensors header of at most "
                                      f"{MAX_HEADER} bytes, got a length field of {n}")
    raw = read_exact(f, n, "the safetensors header", where)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs,
                         parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointMagicMismatch(f"{where}: expected a JSON safetensors header, got "
                                      f"unparseable bytes ({e})") from None
    except CheckpointDuplicateName as e:
        raise CheckpointDuplicateName(f"{where}: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointMagicMismatch(f"{where}: expected a JSON object header, got "
                                      f"{type(obj).__name__}")
    entries = []
    for name, info in obj.items():
        if name == METADATA_KEY:
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise CheckpointMagicMismatch(f"{where}: expected {METADATA_KEY} to map strings "
                                              f"to strings, got {info!r}"[:300])
            continue
        check_name(name, where)
        entries.append(_entry(name, info, where))
    entries.sort(key=lambda e: (e.begin, e.name.encode("utf-8")))
    at = 0
    for e in entries:
        want = byte_length(e.dtype, e.shape)
        if want is None:
            raise CheckpointShapeMismatch(f"{where}: entry {e.name!r}: expected {e.dtype} "
                                          f"{list(e.shape)} to fill whole bytes")
        if e.begin != at or e.end != at + want:
            raise CheckpointShapeMismatch(
                f"{where}: entry {e.name!r}: expected data_offsets [{at}, {at + want}] "
                f"for {e.dtype} {list(e.shape)}, got [{e.begin}, {e.end}]")
        at = e.end
    return entries
