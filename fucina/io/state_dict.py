"""Named state dicts as standalone safetensors files (SPEC T-16).

    fu.io.save_state_dict(f, {"w1": w1, "b1": b1})
    fu.io.load_state_dict(f, {"w1": w1, "b1": b1}, strict=True, aliases=[Alias("enc.w", "w1")])

Entries are a mapping name -> Tensor or a list of NamedTensor; f32, f16, bf16 (raw bits) and
i64 tensors, contiguous. Saving validates everything before the first byte and streams each
payload straight from tensor storage. Loading reads exactly one safetensors prefix of the stream,
matches entries by name (any order; aliases rename stream entries), checks every matched entry
against its destination and reads the data into staging before it writes any destination.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from . import safetensors as st
from ..errors import (CheckpointDtypeMismatch, CheckpointDuplicateName, CheckpointMissingEntry,
                      CheckpointShapeMismatch, CheckpointUnknownName, CheckpointUnsupportedDtype,
                      InvalidArgumentType)
from .stream import (byte_view, label, readinto_exact, reading, skip_exact, storage, write_all,
                     write_to)

DTYPES = tuple(st.TO_SAFETENSORS)  # f32, f16, bf16, i64


@dataclass(frozen=True)
class NamedTensor:
    """A state-dict entry: a name and a tensor (borrowed, not copied)."""

    name: str
    tensor: object

    @classmethod
    def of(cls, name: str, t) -> "NamedTensor":
        """Checked now: a contiguous f32/f16/bf16/i64 tensor (NonContiguousParam / DTypeError)."""
        storage(t, DTYPES, "NamedTensor.of", f"entry {name!r}")
        return cls(name, t)


NamedTensorMut = NamedTensor  # the reference's load-side spelling; Python needs one type


@dataclass(frozen=True)
class Alias:
    """A rename rule for loads: a stream entry named `old` fills the destination named `new`."""

    old: str
    new: str


def _pairs(entries, where: str) -> list:
    if isinstance(entries, Mapping):
        return list(entries.items())
    out = []
    for e in entries:
        if not isinstance(e, NamedTensor):
            raise InvalidArgumentType(f"{where}: expected a mapping name -> Tensor or NamedTensor "
                                      f"entries, got {type(e).__name__}")
        out.append((e.name, e.tensor))
    return out


def _checked(entries, where: str) -> list:
    """[(name, dtype, storage array)] with names valid and unique, dtypes and layouts supported."""
    out, seen = [], set()
    for name, t in _pairs(entries, where):
        st.check_name(name, where)
        if name in seen:
            raise CheckpointDuplicateName(f"{where}: expected unique names, got {name!r} twice")
        seen.add(name)
        dtype = getattr(t, "dtype", None)
        if isinstance(dtype, str) and dtype not in DTYPES:
            raise CheckpointUnsupportedDtype(f"{where}: entry {name!r}: expected dtype in {DTYPES}, "
                                             f"got {dtype}")
        out.append((name, dtype, storage(t, DTYPES, where, f"entry {name!r}")))
    return out


def save_state_dict(f, entries) -> None:
    """Write entries as a safetensors file (no metadata) to f: a binary file object, or a path
    (replaced atomically). Errors, all before any byte is written: CheckpointInvalidName,
    CheckpointDuplicateName, CheckpointUnsupportedDtype, NonContiguousParam."""
    checked = _checked(entries, "save_state_dict")
    prefix, ordered = st.header([(name, dtype, a.shape, a.nbytes, a) for name, dtype, a in checked])

    def write(out):
        write_all(out, prefix)
        for *_, a in ordered:
            write_all(out, byte_view(a))
    write_to(f, write)


def _alias_map(aliases, where: str) -> dict:
    out = {}
    for rule in aliases:
        if isinstance(rule, Alias):
            old, new = rule.old, rule.new
        elif isinstance(rule, tuple) and len(rule) == 2:
            old, new = rule
        else:
            raise InvalidArgumentType(f"{where}: expected Alias(old, new) rules, got {rule!r}")
        out.setdefault(old, new)  # the first matching rule wins
    return out


def load_state_dict(f, entries, strict: bool = True, aliases=()) -> None:
    """Fill entries (a mapping name -> Tensor or NamedTensor list) from one safetensors prefix
    of f (a binary file object or a path). Stream names pass through `aliases` first.

    Every matched entry needs the same dtype (CheckpointDtypeMismatch; never converted) and
    shape (CheckpointShapeMismatch). strict: a stream entry without destination raises
    CheckpointUnknownName, a destination the stream lacks CheckpointMissingEntry; non-strict
    skips the first and leaves the second unchanged. A malformed or truncated file raises
    CheckpointMagicMismatch / InvalidDataLength. On any error no destination was written."""
    where = "load_state_dict"
    dests = _checked(entries, where)
    index = {name: i for i, (name, *_) in enumerate(dests)}
    rename = _alias_map(aliases, where)
    with reading(f) as src:
        where = f"load_state_dict({label(src)})"
        plan = [None] * len(dests)  # pass 1: the header alone decides which entry fills what
        walk = []                   # (entry, destination index or None to skip), in file order
        for e in st.read_header(src, where):
            i = index.get(rename.get(e.name, e.name))
            walk.append((e, i))
            if i is None:
                if strict:
                    raise CheckpointUnknownName(f"{where}: stream entry {e.name!r} matches no "
                                                f"destination (strict load; pass aliases to rename)")
                continue
            name, dtype, d = dests[i]
            if plan[i] is not None:
                raise CheckpointDuplicateName(f"{where}: destination {name!r} is filled by both "
                                              f"{plan[i].name!r} and {e.name!r}")
            if st.FROM_SAFETENSORS.get(e.dtype) != dtype:
                raise CheckpointDtypeMismatch(f"{where}: entry {e.name!r} -> {name!r}: expected "
                                              f"{st.TO_SAFETENSORS[dtype]}, got {e.dtype}")
            if e.shape != d.shape:
                raise CheckpointShapeMismatch(f"{where}: entry {e.name!r} -> {name!r}: expected "
                                              f"shape {list(d.shape)}, got {list(e.shape)}")
            plan[i] = e
        if strict:
            missing = [name for (name, *_), e in zip(dests, plan) if e is None]
            if missing:
                raise CheckpointMissingEntry(f"{where}: expected entries {missing} in the stream "
                                             f"(strict load), found none")
        staged = []  # pass 2: the data section into staging (skipped entries are consumed)
        for e, i in walk:
            if i is None:
                skip_exact(src, e.end - e.begin, f"the data of {e.name!r}", where)
            else:
                d = dests[i][2]
                buf = np.empty_like(d)
                readinto_exact(src, byte_view(buf), f"the data of {e.name!r}", where)
                staged.append((d, buf))
    for d, buf in staged:  # commit: nothing below can fail
        np.copyto(d, buf)
