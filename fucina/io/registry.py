"""ParamRegistry (SPEC T-18): a model's tensors by name, for checkpoints and optimizers.

    reg = ParamRegistry()
    reg.collect(model)                 # "encoder.weight", "layers.0.bias", ... by attribute path
    reg.add_params_to(opt)             # opt.add_param_named(t, name) for each variable
    reg.save_state_dict(f); reg.load_state_dict(f, strict=True, aliases=[Alias("enc.w", "encoder.w")])

Variables are trainable entries; constants (and grad-free f16/bf16/i64 tensors) are frozen entries:
saved and loaded, but skipped by add_params_to and zero_grad. The registry borrows the tensors.

Names are the on-disk schema: renaming an attribute breaks strict loads of older checkpoints
(CheckpointUnknownName for the old stream name, CheckpointMissingEntry for the new one). Keep
strict loads and pass `aliases` instead of loading non-strictly.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

from ..ag.tensor import Tensor
from ..errors import (CheckpointDuplicateName, CheckpointInvalidName, IndexOutOfBounds,
                      InvalidArgumentType)
from ..exec.context import Context
from . import state_dict as sd
from .safetensors import check_name
from .stream import byte_view, storage

MAX_NAME_BYTES = (1 << 16) - 1  # optimizer frames store names with a u16 length
COLLECTED = ("f32", "f16", "bf16")  # collect() never picks up i64: that would grow every schema
# Leaves that collect() never descends into.
_OPAQUE = (str, bytes, bytearray, memoryview, int, float, complex, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, Context, set, frozenset)


@dataclass(frozen=True)
class ParamView:
    """One entry: `bytes_view` is a writable byte view of the tensor's storage."""

    name: str
    dtype: str
    shape: tuple
    bytes_view: memoryview
    trainable: bool


@dataclass(frozen=True)
class _Entry:
    name: str
    tensor: Tensor
    trainable: bool


def _children(obj):
    """(name, value) pairs to visit under obj, in a deterministic order: sequence indices,
    mapping keys (str or int), or public attributes in definition order."""
    if isinstance(obj, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        return [(str(k), v) for k, v in obj.items()
                if isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))]
    if isinstance(obj, _OPAQUE):
        return []
    attrs = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in attrs and hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
    return [(k, v) for k, v in attrs.items() if not k.startswith("_")]


class ParamRegistry:
    """Named tensors in registration order (the order of saves' inputs and of add_params_to)."""

    def __init__(self):
        self._entries: list[_Entry] = []
        self._names: set[str] = set()

    def add_param(self, name: str, t) -> None:
        """Register t under name: a variable is trainable, anything else frozen. Errors:
        CheckpointInvalidName (empty, NUL, invalid UTF-8, "__metadata__", over 65535 bytes),
        CheckpointDuplicateName, NonContiguousParam, DTypeError (not f32/f16/bf16/i64)."""
        where = "ParamRegistry.add_param"
        if len(check_name(name, where)) > MAX_NAME_BYTES:
            raise CheckpointInvalidName(f"{where}: expected a name of at most {MAX_NAME_BYTES} "
                                        f"UTF-8 bytes, got {len(name.encode())}")
        if name in self._names:
            raise CheckpointDuplicateName(f"{where}: {name!r} is already registered")
        storage(t, sd.DTYPES, where, f"param {name!r}")
        self._entries.append(_Entry(name, t, t.requires_grad))
        self._names.add(name)

    def collect(self, model) -> None:
        """Register every f32/f16/bf16 tensor reachable from model by attribute path: nested
        objects "encoder.weight", lists/tuples "layers.0.weight", dicts by key. Skipped:
        non-tensors, i64/bool tensors (add those with add_param), attributes starting with "_",
        sets, and anything already seen (a tensor shared by two paths is registered once, under
        the first; cycles end). All or nothing: on an error no entry is added."""
        self.collect_prefixed("", model)

    def collect_prefixed(self, prefix: str, model) -> None:
        """collect() with names under `prefix` ("model" -> "model.weight")."""
        found, seen = [], set()
        stack = [(prefix, model)]
        while stack:
            name, obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, Tensor):
                if obj.dtype in COLLECTED:
                    found.append((name, obj))
                continue
            kids = _children(obj)
            stack.extend((f"{name}.{k}" if name else k, v) for k, v in reversed(kids))
        mark = len(self._entries)
        try:
            for name, t in found:
                self.add_param(name, t)
        except BaseException:
            for e in self._entries[mark:]:
                self._names.discard(e.name)
            del self._entries[mark:]
            raise

    def parameter_count(self) -> int:
        return len(self._entries)

    def names(self) -> list:
        return [e.name for e in self._entries]

    def _entry(self, op: str, i: int):
        if not (isinstance(i, int) and 0 <= i < len(self._entries)):
            raise IndexOutOfBounds(f"ParamRegistry.{op}: expected an index in [0, "
                                   f"{len(self._entries)}), got {i!r}")
        return self._entries[i]

    def tensor(self, i: int):
        """The Tensor of entry i (its context runs the kernels of gradient-free consumers)."""
        return self._entry("tensor", i).tensor

    def view(self, i: int) -> ParamView:
        """Entry i in registration order (the seam gradient-free consumers such as ES use)."""
        e = self._entry("view", i)
        a = storage(e.tensor, sd.DTYPES, "ParamRegistry.view", f"param {e.name!r}")
        return ParamView(e.name, e.tensor.dtype, a.shape, byte_view(a), e.trainable)

    def add_params_to(self, opt) -> None:
        """Register the trainable entries in opt by name, in registration order, through
        opt.add_param_named(t, name) (or opt.add_param(t, name=name)). Frozen entries are
        checkpoint-only and skipped."""
        add = getattr(opt, "add_param_named", None)
        if add is None:
            plain = getattr(opt, "add_param", None)
            if plain is None:
                raise InvalidArgumentType("ParamRegistry.add_params_to: expected an optimizer "
                                          "with add_param_named(t, name) or add_param(t, "
                                          f"name=...), got {type(opt).__name__}")

            def add(t, name):
                plain(t, name=name)
        for e in self._entries:
            if e.trainable:
                add(e.tensor, e.name)

    def zero_grad(self) -> None:
        for e in self._entries:
            if e.trainable:
                e.tensor.zero_grad()

    def _named(self) -> list:
        return [sd.NamedTensor(e.name, e.tensor) for e in self._entries]

    def save_state_dict(self, f) -> None:
        """Every entry, frozen ones included, as a safetensors file (see save_state_dict)."""
        sd.save_state_dict(f, self._named())

    def load_state_dict(self, f, strict: bool = True, aliases=()) -> None:
        """Fill the entries from a safetensors stream (see load_state_dict): transactional,
        strict by default; use aliases for renamed entries."""
        sd.load_state_dict(f, self._named(), strict=strict, aliases=aliases)
