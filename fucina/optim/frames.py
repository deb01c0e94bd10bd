"""Optimizer state frames (SPEC T-17): magics and versions, the wire form of header scalars and
per-slot records (name, dims, counters, state buffers, f32 masters), exact reads, and the
name matching that fills every slot exactly once.

All integers are little-endian. A frame's version is the lowest its slots need: v5 when any slot
carries an f32 master, else v4 when any state buffer is not f32, else v3 (untagged f32 buffers,
byte-identical to the pre-bf16 format). Reads take their sizes from the live slots, never from
the stream (except names: at most 65535 bytes), so a corrupt file costs an error, not memory.

save_state wraps a frame in a checksummed envelope (not in SPEC T-17, which it contains intact):

    b"FZC1" | u64 frame length | the frame (its own magic, any version) | u32 CRC32 of the frame

Loaders accept an envelope or a bare frame (files from before checksums). zlib's CRC32 runs at
~4 GB/s (blake2b ~0.9, sha256 ~1.9 on the same core): 256 MB of state cost ~60 ms per save.
"""
from __future__ import annotations

import enum
import struct
import zlib
from typing import NamedTuple

from ..exec.elementwise import f32_bits
from ..errors import (CheckpointDtypeMismatch, CheckpointDuplicateName, CheckpointInvalidName,
                      CheckpointMagicMismatch, CheckpointMissingEntry, CheckpointShapeMismatch,
                      CheckpointUnknownName, CheckpointUnsupportedDtype, ChecksumMismatch,
                      FucinaError, InvalidArgument, InvalidDataLength)

V3, V4, V5 = 3, 4, 5
MAX_NAME = 0xFFFF
_FMT = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "bool": "<B", "f32": "<I"}


class StateDType(enum.IntEnum):
    """Storage dtype of optimizer state (SPEC T-3); the values are the v4 wire tags."""

    f32 = 0
    bf16 = 1

    @classmethod
    def of(cls, value) -> "StateDType":
        """A StateDType from itself, its name ("f32", "bf16") or its tag (0, 1)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in cls.__members__:
            return cls[value]
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        raise InvalidArgument(f"state dtype: expected StateDType.f32 / StateDType.bf16 (or 'f32' / "
                              f"'bf16'), got {value!r}")


class Magics(NamedTuple):
    """The 4-byte magics of one optimizer's frame per version (v4 None: state always f32)."""

    v3: bytes
    v4: bytes | None
    v5: bytes

    def of(self, version: int) -> bytes:
        return {V3: self.v3, V4: self.v4, V5: self.v5}[version]

    def expect(self, r: "Reader") -> int:
        got = r.take(4, "the magic")
        for version, magic in ((V3, self.v3), (V4, self.v4), (V5, self.v5)):
            if magic is not None and got == magic:
                return version
        want = " / ".join(m.decode() for m in self if m is not None)
        raise CheckpointMagicMismatch(f"{r.op}: expected magic {want}, got {got!r}")


def f32(x: float) -> float:
    """x rounded once to float32 (the scalar prep rule: compute in f64, round once); beyond
    the float32 range, ±inf. Sums, products and quotients of two f32 values computed in f64
    and rounded here equal the f32 operation (53 >= 2·24 + 2 bits)."""
    return _F32.unpack(_U32.pack(f32_bits(x)))[0]


_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")


def wire(kind: str, value) -> int:
    """A header/record scalar as the integer it is written as: f32 as its bits, bool 0/1."""
    if kind == "f32":
        return f32_bits(value)
    return int(bool(value)) if kind == "bool" else int(value)


def write_scalar(f, kind: str, value) -> None:
    f.write(struct.pack(_FMT[kind], wire(kind, value)))


class Reader:
    """Exact reads from a binary file object: a short stream raises InvalidDataLength naming
    the op and the field."""

    def __init__(self, f, op: str):
        self.f, self.op = f, op

    def take(self, n: int, what: str) -> bytes:
        out = bytearray(n)
        self.into(memoryview(out), what)
        return bytes(out)

    def into(self, dest: memoryview, what: str) -> None:
        n, got = len(dest), 0
        readinto = getattr(self.f, "readinto", None)
        while got < n:
            if readinto is not None:
                k = readinto(dest[got:]) or 0
            else:
                part = self.f.read(n - got)
                k = len(part)
                dest[got:got + k] = part
            if not k:
                raise InvalidDataLength(f"{self.op}: the stream ended inside {what}: expected "
                                        f"{n} bytes, got {got}")
            got += k

    def scalar(self, kind: str, what: str) -> int:
        fmt = _FMT[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]


# ---- names -----------------------------------------------------------------------------------

def encode_name(name: str, op: str) -> bytes:
    """A slot name's wire bytes: non-empty UTF-8, no NUL, at most 65535 bytes."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckpointInvalidName(f"{op}: expected a name encodable as UTF-8, got {name!r} ({e.reason})") from None
    if not raw or len(raw) > MAX_NAME or b"\0" in raw:
        raise CheckpointInvalidName(f"{op}: expected a non-empty name of at most {MAX_NAME} UTF-8 "
                                    f"bytes without NUL, got {name!r}")
    return raw


def slot_names(slots, op: str) -> list[bytes]:
    """Every slot's effective name (its own, else "param<i>" from its index), validated and
    collision-free (an explicit name equal to another slot's auto-name included)."""
    out, seen = [], {}
    for i, s in enumerate(slots):
        raw = encode_name(s.name if s.name is not None else f"param{i}", op)
        if raw in seen:
            raise CheckpointDuplicateName(f"{op}: slots {seen[raw]} and {i} are both named "
                                          f"{raw.decode()!r}; expected unique names")
        seen[raw] = i
        out.append(raw)
    return out


def write_name(f, raw: bytes) -> None:
    f.write(struct.pack("<H", len(raw)))
    f.write(raw)


class SlotMatcher:
    """Resolves record names to slots, each slot exactly once."""

    def __init__(self, slots, op: str):
        self.op = op
        self.index = {raw: i for i, raw in enumerate(slot_names(slots, op))}
        self.filled = [False] * len(slots)

    def match(self, r: Reader) -> int:
        n = r.scalar("u16", "a slot name's length")
        if n == 0:
            raise CheckpointInvalidName(f"{self.op}: expected a non-empty slot name, got length 0")
        raw = r.take(n, "a slot name")
        i = self.index.get(raw)
        if i is None:
            raise CheckpointUnknownName(f"{self.op}: the frame has a slot {_show(raw)} that no "
                                        f"registered param is named; expected one of "
                                        f"{[_show(k) for k in self.index]}")
        if self.filled[i]:
            raise CheckpointDuplicateName(f"{self.op}: slot {_show(raw)} appears twice in the "
                                          f"frame; expected each name once")
        self.filled[i] = True
        return i

    def require_all(self) -> None:
        missing = [_show(k) for k, i in self.index.items() if not self.filled[i]]
        if missing:
            raise CheckpointMissingEntry(f"{self.op}: the frame has no record for {missing}; "
                                         f"expected one per registered param")


def _show(raw: bytes) -> str:
    return repr(raw.decode("utf-8", "replace"))


# ---- dims, state buffers, masters -------------------------------------------------------------

def write_dims(f, rows: int, cols: int) -> None:
    f.write(struct.pack("<QQ", rows, cols))


def expect_dims(r: Reader, rows: int, cols: int, name: str) -> None:
    got = struct.unpack("<QQ", r.take(16, f"the dims of slot {name}"))
    if got != (rows, cols):
        raise CheckpointShapeMismatch(f"{r.op}: slot {name}: expected dims [{rows}, {cols}], "
                                      f"got [{got[0]}, {got[1]}]")


def write_buffer(f, version: int, dtype: StateDType, data, tagged: bool = True) -> None:
    """A state buffer: v4/v5 tagged buffers lead with their StateDType tag; then the raw bytes
    (data: a bytes-like view of the storage, possibly empty)."""
    if tagged and version >= V4:
        f.write(bytes((int(dtype),)))
    if len(data):
        f.write(data)


def read_buffer(r: Reader, version: int, dtype: StateDType, nbytes: int, what: str,
                tagged: bool = True) -> bytearray:
    """Read one buffer record into new scratch; the stored dtype (v3 and untagged: f32) must
    equal the live one exactly — no conversion, or resume would not be bit-exact."""
    stored = StateDType.f32
    if tagged and version >= V4:
        tag = r.scalar("u8", f"the dtype tag of {what}")
        if tag not in (0, 1):
            raise CheckpointUnsupportedDtype(f"{r.op}: {what}: expected a state dtype tag 0 (f32) "
                                             f"or 1 (bf16), got {tag}")
        stored = StateDType(tag)
    if stored != dtype:
        raise CheckpointDtypeMismatch(f"{r.op}: {what}: expected {dtype.name} state, the frame "
                                      f"holds {stored.name}")
    out = bytearray(nbytes)
    r.into(memoryview(out), what)
    return out


def write_master(f, version: int, master_bytes) -> None:
    """v5 only: u8 present | numel × f32 (master_bytes None for an f32 param)."""
    if version != V5:
        return
    f.write(b"\x00" if master_bytes is None else b"\x01")
    if master_bytes is not None:
        f.write(master_bytes)


def read_master(r: Reader, version: int, nbytes: int | None, name: str) -> bytearray | None:
    """The staged master of a v5 record (None when absent); nbytes None: the slot is f32."""
    if version != V5 or r.scalar("u8", f"the master flag of slot {name}") == 0:
        return None
    if nbytes is None:
        raise CheckpointDtypeMismatch(f"{r.op}: slot {name}: the frame carries an f32 master, "
                                      f"expected none for an f32 param")
    out = bytearray(nbytes)
    r.into(memoryview(out), f"the master of slot {name}")
    return out


# ---- the checksummed envelope ------------------------------------------------------------------

CHECKED_MAGIC = b"FZC1"
_CHUNK = 1 << 20


def _bytes_of(data) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class _Counter:
    """A write sink that only counts bytes (the first pass: the frame's length)."""

    def __init__(self):
        self.n = 0

    def write(self, data):
        k = _bytes_of(data).nbytes
        self.n += k
        return k


class _WriteTap:
    """Passes writes through, counting them and folding them into a CRC32."""

    def __init__(self, f):
        self.f, self.n, self.crc = f, 0, 0

    def write(self, data):
        mv = _bytes_of(data)
        self.crc = zlib.crc32(mv, self.crc)
        self.n += mv.nbytes
        while len(mv):  # raw files may take part of a large buffer per call
            k = self.f.write(mv)
            if k is None or k >= len(mv):
                break
            mv = mv[k:]
        return self.n


class _ReadTap:
    """A readable that first replays `prefix`, then reads f; counts and CRC32s what it hands out
    and ends at `limit` bytes (an enveloped frame cannot read past its declared length)."""

    def __init__(self, f, prefix: bytes = b"", limit: int | None = None):
        self.f, self.prefix, self.n, self.crc, self.limit = f, prefix, 0, 0, limit

    def readinto(self, dest) -> int:
        dest = _bytes_of(dest)
        if self.limit is not None:
            dest = dest[:max(self.limit - self.n, 0)]
            if not len(dest):
                return 0
        if self.prefix:
            k = min(len(dest), len(self.prefix))
            dest[:k] = self.prefix[:k]
            self.prefix = self.prefix[k:]
        else:
            readinto = getattr(self.f, "readinto", None)
            if readinto is not None:
                k = readinto(dest) or 0
            else:
                part = self.f.read(len(dest))
                k = len(part)
                dest[:k] = part
        self.crc = zlib.crc32(dest[:k], self.crc)
        self.n += k
        return k


def _where(f, op: str) -> str:
    name = getattr(f, "name", None)
    return f"{op}({name})" if isinstance(name, str) else op


def write_checked(f, write_frame) -> None:
    """The envelope around write_frame(sink): a counting pass for the length, then the frame
    through a CRC32 tap, then the CRC."""
    counter = _Counter()
    write_frame(counter)
    f.write(CHECKED_MAGIC + struct.pack("<Q", counter.n))
    tap = _WriteTap(f)
    write_frame(tap)
    f.write(struct.pack("<I", tap.crc))


def read_checked(f, op: str, stage):
    """stage(Reader) over an enveloped frame (CRC32 verified before the staged result is
    returned: ChecksumMismatch naming the file) or over a bare frame (no checksum to verify).
    A structural error inside an envelope whose CRC32 then fails is reported as the
    ChecksumMismatch it is (a corrupt file, not a changed model), chained to the first error."""
    head = Reader(f, op).take(4, "the magic")
    if head != CHECKED_MAGIC:
        return stage(Reader(_ReadTap(f, head), op))
    where = _where(f, op)
    (length,) = struct.unpack("<Q", Reader(f, op).take(8, "the checksummed frame's length"))
    tap = _ReadTap(f, limit=length)
    try:
        staged = stage(Reader(tap, op))
    except FucinaError as e:
        if _corrupt(f, tap, length, op):
            raise ChecksumMismatch(f"{where}: the frame does not match its CRC32 (it failed "
                                   f"with: {e}); the file is corrupt") from e
        raise
    if tap.n != length:
        raise ChecksumMismatch(f"{where}: the frame is {tap.n} bytes, its envelope says "
                               f"{length}; the file is corrupt")
    (want,) = struct.unpack("<I", Reader(f, op).take(4, "the frame's CRC32"))
    if want != tap.crc:
        raise ChecksumMismatch(f"{where}: expected the frame's CRC32 {want:08x}, computed "
                               f"{tap.crc:08x}; the file is corrupt")
    return staged


def _corrupt(f, tap: _ReadTap, length: int, op: str) -> bool:
    """After a failed stage: read the rest of the enveloped frame and its CRC32. True when they
    disagree; False when they agree or the stream ends first (then the first error stands)."""
    buf = bytearray(min(_CHUNK, max(length - tap.n, 1)))
    try:
        while tap.n < length:
            k = tap.readinto(memoryview(buf)[:min(len(buf), length - tap.n)])
            if not k:
                return False
        (want,) = struct.unpack("<I", Reader(f, op).take(4, "the frame's CRC32"))
    except InvalidDataLength:
        return False
    return want != tap.crc
