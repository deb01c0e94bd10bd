"""GGUF files (read and write) and block-quantized tensors (SPEC R-9, issue 9).

    f = fu.gguf.read(path, ctx)       # memory-mapped; nothing is copied
    f.metadata                        # key -> value (int, float, bool, str, or lists of them)
    f.infos                           # name -> TensorInfo (ggml type, dims, offset, bytes)
    f.tensors                         # name -> Tensor (f32/f16/bf16/i64/block dtypes), read-only
    fu.gguf.write(path, f.tensors, f.metadata)   # a verbatim re-emit: byte-identical

Format: GGUF v3 (v2 has the same layout), little-endian: magic, version, tensor and key counts,
the key/value pairs, the tensor descriptors (name, dims innermost first, ggml type, offset),
padding to the alignment (`general.alignment`, default 32), then each tensor's bytes padded to
the alignment. A tensor's shape is its ggml dims reversed (the innermost dim last) and its tags
are `("ne1", "ne0")`-style names of those dims. Tensors of ggml types Fucina has no dtype for
(i8..i32, f64, the iq formats, ...) come back as `RawTensorData` (type + dims + bytes), which
`write` re-emits verbatim.

Metadata values keep their GGUF type on the side (`f.metadata.types`), so a re-emit writes each
value with the type it was read with; new plain values get bool/i32 (i64 when it does not fit)/
f32/str, as the `gguf` package's writer infers them. Every malformed file, truncated or
corrupted, raises GGUFError (a FucinaError) naming the file, what was being read and where.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from .ag.tensor import Tensor
from .errors import DTypeError, FucinaError
from .exec import quant as xq
from .exec.raw import RawTensor, contiguous_layout
from .io.checkpoint import write_file_atomic
from .runtime import _rt

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NESTING = 8

# ggml type id -> (name, elements per block, bytes per block); the layouts of ggml.h
GGML_TYPES = {
    0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 9: ("q8_1", 32, 36),
    10: ("q2_k", 256, 84), 11: ("q3_k", 256, 110), 12: ("q4_k", 256, 144), 13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210), 15: ("q8_k", 256, 292), 16: ("iq2_xxs", 256, 66),
    17: ("iq2_xs", 256, 74), 18: ("iq3_xxs", 256, 98), 19: ("iq1_s", 256, 50),
    20: ("iq4_nl", 32, 18), 21: ("iq3_s", 256, 110), 22: ("iq2_s", 256, 82),
    23: ("iq4_xs", 256, 136), 24: ("i8", 1, 1), 25: ("i16", 1, 2), 26: ("i32", 1, 4),
    27: ("i64", 1, 8), 28: ("f64", 1, 8), 29: ("iq1_m", 256, 56), 30: ("bf16", 1, 2),
    34: ("tq1_0", 256, 54), 35: ("tq2_0", 256, 66), 39: ("mxfp4", 32, 17),
}
TYPE_ID = {v[0]: k for k, v in GGML_TYPES.items()}
FUCINA_DTYPES = ("f32", "f16", "bf16", "i64", *xq.BLOCKS)

# GGUF metadata value types: id -> (name, struct code); arrays are "[item]"
VALUE_TYPES = {0: ("u8", "B"), 1: ("i8", "b"), 2: ("u16", "H"), 3: ("i16", "h"), 4: ("u32", "I"),
               5: ("i32", "i"), 6: ("f32", "f"), 7: ("bool", "?"), 8: ("str", None),
               9: ("array", None), 10: ("u64", "Q"), 11: ("i64", "q"), 12: ("f64", "d")}
VALUE_ID = {v[0]: k for k, v in VALUE_TYPES.items()}
NUMPY_OF = {"u8": "<u1", "i8": "<i1", "u16": "<u2", "i16": "<i2", "u32": "<u4", "i32": "<i4",
            "f32": "<f4", "bool": "<u1", "u64": "<u8", "i64": "<i8", "f64": "<f8"}


class GGUFError(FucinaError):
    """A GGUF file is malformed (truncated, corrupted, inconsistent) or cannot be written."""


class Metadata(dict):
    """The key/value pairs of a GGUF file, in file order; `types[key]` is the GGUF type each
    value was read with ("u32", "str", "[i32]", ...), which `write` reuses."""

    def __init__(self, *args, types=None, **kw):
        super().__init__(*args, **kw)
        self.types = dict(types or {})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor descriptor: ggml type id, dims (innermost first), offset into the data
    section, and where its bytes are in the file."""

    name: str
    ggml_type: int
    ne: tuple
    offset: int
    nbytes: int
    file_offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]

    @property
    def shape(self) -> tuple:
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class RawTensorData:
    """A tensor of a ggml type Fucina has no dtype for: its type, dims and bytes, verbatim."""

    type_name: str
    ne: tuple
    data: memoryview

    @property
    def shape(self) -> tuple:
        return tuple(reversed(self.ne))


class GGUFFile:
    """A parsed, memory-mapped GGUF file (see the module docstring)."""

    def __init__(self, path, version, alignment, metadata, infos, tensors, data_offset):
        self.path, self.version, self.alignment = path, version, alignment
        self.metadata, self.infos, self.tensors = metadata, infos, tensors
        self.data_offset = data_offset
        self._map = None   # the mmap behind the tensors (read() sets it)

    def release_pages(self, names) -> int:
        """Drop this process's resident copies of the pages that lie wholly inside the named
        tensors' data (madvise MADV_DONTNEED), for a reader done with them — a model that
        decoded its matrices to f32 copies. The tensors stay valid: a later read brings their
        pages back from the page cache. Returns the bytes released."""
        if self._map is None or not hasattr(self._map, "madvise"):
            return 0
        page, done = mmap.PAGESIZE, 0
        for name in names:
            info = self.infos[name]
            lo = -(-info.file_offset // page) * page
            hi = (info.file_offset + info.nbytes) // page * page
            if hi > lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                done += hi - lo
        return done

    def __repr__(self):
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.infos)} tensors)")


def tags_for(ndim: int) -> tuple:
    return tuple(f"ne{k}" for k in reversed(range(ndim)))


# ---------------------------------------------------------------------------------------------
# reading

class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; every overrun is a GGUFError."""

    def __init__(self, buf, path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.what = "header"

    def fail(self, msg):
        raise GGUFError(f"gguf.read: {self.path}: {msg} (while reading {self.what}, at byte {self.pos})")

    def need(self, n):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"truncated or corrupt file: expected {n} more bytes, the file has "
                      f"{self.size - self.pos} left")

    def scalar(self, code):
        n = struct.calcsize("<" + code)
        self.need(n)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self):
        n = self.scalar("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype, depth=0):
        """(value, type name) of one metadata value of GGUF type id `vtype`."""
        if vtype not in VALUE_TYPES:
            self.fail(f"unknown metadata value type {vtype}; expected one of {sorted(VALUE_TYPES)}")
        name, code = VALUE_TYPES[vtype]
        if name == "str":
            return self.string(), "str"
        if name != "array":
            v = self.scalar(code)
            return v, name
        if depth >= MAX_NESTING:
            self.fail(f"arrays nested deeper than {MAX_NESTING}")
        item = self.scalar("I")
        count = self.scalar("Q")
        if item not in VALUE_TYPES:
            self.fail(f"unknown array item type {item}")
        iname, icode = VALUE_TYPES[item]
        if icode is not None:  # a numeric array: one bounds check, one numpy read
            size = struct.calcsize("<" + icode)
            if count > (self.size - self.pos) // size:
                self.need(count * size)
            a = np.frombuffer(self.buf, NUMPY_OF[iname], count=count, offset=self.pos)
            self.pos += count * size
            vals = a.astype(bool).tolist() if iname == "bool" else a.tolist()
            return vals, f"[{iname}]"
        if count > (self.size - self.pos) // 8:  # every string or array item takes >= 8 bytes
            self.fail(f"array of {count} items cannot fit in the {self.size - self.pos} bytes left")
        vals, inner = [], None
        for _ in range(count):
            v, t = self.value(item, depth + 1)
            vals.append(v)
            inner = t
        return vals, f"[{inner or ('str' if iname == 'str' else '[u8]')}]"


def read(path, ctx) -> GGUFFile:
    """Parse the GGUF file at `path` and map its tensors into Tensors of `ctx` (no copy)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise GGUFError(f"gguf.read: {path}: empty file; expected a GGUF file")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"gguf.read: {path}: cannot open: {e}") from e
    buf = memoryview(mm)
    c = _Cursor(buf, path)
    c.need(4)
    if bytes(buf[:4]) != MAGIC:
        c.fail(f"bad magic {bytes(buf[:4])!r}; expected {MAGIC!r} (not a GGUF file)")
    c.pos = 4
    version = c.scalar("I")
    if version not in (2, 3):
        c.fail(f"unsupported GGUF version {version}; expected 3 (or 2)")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    if n_kv > size // 12 or n_tensors > size // 24:
        c.fail(f"{n_tensors} tensors / {n_kv} keys cannot fit in a file of {size} bytes")
    metadata = Metadata()
    for i in range(n_kv):
        c.what = f"metadata key {i}"
        key = c.string()
        c.what = f"metadata value {key!r}"
        if key in metadata:
            c.fail(f"duplicate metadata key {key!r}")
        metadata[key], metadata.types[key] = c.value(c.scalar("I"))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and (metadata.types["general.alignment"] != "u32"
                                            or alignment <= 0 or alignment & (alignment - 1)):
        c.fail(f"general.alignment must be a u32 power of two, got {alignment!r} "
               f"({metadata.types['general.alignment']})")
    descs = []
    for i in range(n_tensors):
        c.what = f"tensor descriptor {i}"
        name = c.string()
        c.what = f"tensor descriptor {name!r}"
        nd = c.scalar("I")
        if not 1 <= nd <= MAX_DIMS:
            c.fail(f"tensor {name!r} has {nd} dims; expected 1..{MAX_DIMS}")
        ne = tuple(c.scalar("Q") for _ in range(nd))
        gtype, offset = c.scalar("I"), c.scalar("Q")
        descs.append((name, ne, gtype, offset))
    data_offset = -(-c.pos // alignment) * alignment
    c.what, c.pos = "tensor data", data_offset
    infos: dict = {}
    for name, ne, gtype, offset in descs:
        infos[name] = _info(c, name, ne, gtype, offset, alignment, data_offset, infos)
    tensors = {name: _tensor(ctx, buf, info) for name, info in infos.items()}
    f = GGUFFile(path, version, alignment, metadata, infos, tensors, data_offset)
    f._map = mm
    return f


def _info(c, name, ne, gtype, offset, alignment, data_offset, infos) -> TensorInfo:
    if name in infos:
        c.fail(f"duplicate tensor name {name!r}")
    if gtype not in GGML_TYPES:
        c.fail(f"tensor {name!r} has unknown ggml type {gtype}")
    tname, bs, bb = GGML_TYPES[gtype]
    if any(d < 1 or d >= 1 << 40 for d in ne):
        c.fail(f"tensor {name!r} has dims {list(ne)}; expected each in 1..2^40")
    if ne[0] % bs:
        c.fail(f"tensor {name!r} of type {tname}: innermost dim {ne[0]} is not a multiple of "
               f"its block size {bs}")
    n = 1
    for d in ne:
        n *= d
    nbytes = n // bs * bb
    if offset % alignment:
        c.fail(f"tensor {name!r} offset {offset} is not a multiple of the alignment {alignment}")
    start = data_offset + offset
    if start + nbytes > c.size:
        c.fail(f"truncated file: tensor {name!r} ({tname} {list(ne)}) needs bytes "
               f"{start}..{start + nbytes}, the file has {c.size}")
    return TensorInfo(name, gtype, ne, offset, nbytes, start)


def _tensor(ctx, buf, info: TensorInfo):
    view = buf[info.file_offset:info.file_offset + info.nbytes]
    dtype = info.type_name
    if dtype not in FUCINA_DTYPES:
        return RawTensorData(dtype, info.ne, view)
    storage = _rt.borrow(view)
    if dtype in xq.BLOCKS:
        raw = xq.wrap(ctx, storage, info.shape, dtype)
    else:
        raw = RawTensor(storage, contiguous_layout(dtype, info.shape), 0, ctx)
    return Tensor(raw, tags_for(len(info.ne)))


# ---------------------------------------------------------------------------------------------
# writing

def write(path, tensors, metadata, *, alignment: int | None = None) -> None:
    """Write a GGUF v3 file: `tensors` name -> Tensor (any dtype but bool, block dtypes
    included) or RawTensorData, in order; `metadata` key -> value (types from its `.types` when
    it is a Metadata). The alignment is `general.alignment` when present, else `alignment`
    (recorded as `general.alignment` when it is not 32), else 32. Written to a temporary file
    in the same directory, then renamed over `path`: a failed write leaves `path` as it was."""
    path = os.fspath(path)
    types = dict(getattr(metadata, "types", {}))
    if "general.alignment" in metadata:
        align = metadata["general.alignment"]
    else:
        align = DEFAULT_ALIGNMENT if alignment is None else alignment
        if align != DEFAULT_ALIGNMENT:  # readers assume 32 unless the file says otherwise
            metadata = {**metadata, "general.alignment": align}
            types["general.alignment"] = "u32"
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise GGUFError(f"gguf.write: {path}: expected the alignment to be a power of two, got {align!r}")
    head = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(tensors), len(metadata)))
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise GGUFError(f"gguf.write: expected metadata keys to be str, got {key!r}")
        _put_str(head, key)
        _put_value(head, key, value, types.get(key) or _infer(key, value))
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise GGUFError(f"gguf.write: expected tensor names to be str, got {name!r}")
        gtype, ne, data = _tensor_bytes(name, t)
        _put_str(head, name)
        head += struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        head += struct.pack("<IQ", gtype, offset)
        blobs.append(data)
        offset += -(-len(data) // align) * align
    head += bytes(-len(head) % align)

    def emit(out):
        out.write(head)
        for data in blobs:
            out.write(data)
            out.write(bytes(-len(data) % align))

    write_file_atomic(path, emit)   # temp file, fsync, rename: readers see old or new, whole


def _tensor_bytes(name, t):
    if isinstance(t, RawTensorData):
        if t.type_name not in TYPE_ID:
            raise GGUFError(f"gguf.write: tensor {name!r}: unknown ggml type {t.type_name!r}")
        return TYPE_ID[t.type_name], tuple(t.ne), t.data
    if not isinstance(t, Tensor):
        raise GGUFError(f"gguf.write: tensor {name!r}: expected a Tensor or RawTensorData, "
                        f"got {type(t).__name__}")
    dtype = t.dtype
    if dtype not in FUCINA_DTYPES:
        raise DTypeError(f"gguf.write: tensor {name!r}: GGUF has no type for dtype {dtype}; "
                         f"expected one of {FUCINA_DTYPES}")
    if len(t.shape) == 0 or len(t.shape) > MAX_DIMS:
        raise GGUFError(f"gguf.write: tensor {name!r}: expected 1..{MAX_DIMS} dims, got shape {t.shape}")
    data = np.ascontiguousarray(t.data_const())
    return TYPE_ID[dtype], tuple(reversed(t.shape)), memoryview(data).cast("B")


def _infer(key, value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < 1 << 31 else "i64"
    if isinstance(value, float):
        return "f32"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        if not value:
            raise GGUFError(f"gguf.write: metadata {key!r}: an empty list needs a type in metadata.types")
        inner = {_infer(key, v) for v in value}
        if len(inner) == 2 and inner == {"i32", "i64"}:
            inner = {"i64"}
        if len(inner) != 1:
            raise GGUFError(f"gguf.write: metadata {key!r}: expected list items of one type, "
                            f"got {sorted(inner)}")
        return f"[{inner.pop()}]"
    raise GGUFError(f"gguf.write: metadata {key!r}: no GGUF type for {type(value).__name__}; "
                    f"expected bool, int, float, str or a list of them")


def _put_str(out, s: str):
    raw = s.encode("utf-8", errors="surrogateescape")
    out += struct.pack("<Q", len(raw)) + raw


def _put_value(out, key, value, vtype: str, header=True):
    try:
        if vtype.startswith("["):
            inner = vtype[1:-1]
            if header:
                out += struct.pack("<I", VALUE_ID["array"])
            item_id = VALUE_ID["array"] if inner.startswith("[") else VALUE_ID[inner]
            out += struct.pack("<IQ", item_id, len(value))
            code = VALUE_TYPES[item_id][1]
            if code is not None:
                out += np.asarray(value, NUMPY_OF[inner]).tobytes()
            else:
                for v in value:
                    _put_value(out, key, v, inner, header=False)
            return
        if header:
            out += struct.pack("<I", VALUE_ID[vtype])
        if vtype == "str":
            _put_str(out, value)
        else:
            out += struct.pack("<" + VALUE_TYPES[VALUE_ID[vtype]][1], value)
    except (KeyError, struct.error, TypeError, ValueError, OverflowError, AttributeError) as e:
        raise GGUFError(f"gguf.write: metadata {key!r}: cannot write {value!r} as {vtype}: {e}") from e


__all__ = ["read", "write", "GGUFFile", "GGUFError", "Metadata", "TensorInfo", "RawTensorData",
           "GGML_TYPES"]
