"""The shared optimizer surface (SPEC T-2) every optimizer builds on: registration checks, slot
geometry, 16-bit params with f32 masters, gradient lookup (params without a gradient are
skipped), global-norm clipping and gradient scaling, and the checkpoint frame walk (T-17).

A subclass supplies only what differs: its `Config` dataclass, its frame `MAGICS`, the
structural `_header()` fields a checkpoint pins, the per-slot `RECORD` (the state written per
slot, in wire order), `_init_state(slot)` and `_update(slot, grad, prep)` (usually one fused
kernel launch). Composite optimizers (an embedded fallback) extend `all_slots`, `frame_version`,
`write_frame`, `stage_frame` and `commit_frame`.

Gradients are read where the autograd engine accumulates them, the variable's leaf node
(`Leaf.grad`, an f32 RawTensor), and scaled in place there; no copies are made.
"""
from __future__ import annotations

import abc
import math
import struct
from typing import ClassVar

import numpy as np

from ..ag.engine import Leaf
from ..ag.tensor import Tensor
from ..errors import (CheckpointConfigMismatch, ContextClosed, DTypeError, DuplicateParam,
                      GradShapeMismatch, InvalidArgumentType, NonContiguousParam, NotAVariable,
                      ParamNotRegistered, UseAfterRelease)
from ..exec import elementwise as ew
from ..exec import optim as xo
from ..exec.raw import RawTensor, contiguous_layout
from . import frames
from .clip import clip, grad_squared_norm, scale_grads
from .frames import V3, V4, V5, Reader, StateDType, f32

PARAM_DTYPES = ("f32", "f16", "bf16")


class StateBuf:
    """One optimizer-owned, zero-initialised state buffer of `n` elements stored as `dtype`
    (StateDType); `raw` is None when it is empty (SGD without momentum: an f32-tagged record
    of no bytes)."""

    __slots__ = ("dtype", "raw")

    def __init__(self, ctx, dtype, n: int):
        self.dtype = StateDType.of(dtype)
        self.raw = None
        if n:
            lay = contiguous_layout(self.dtype.name, (n,))
            self.raw = RawTensor(ctx.pool.alloc(max(lay.nbytes, 64), self.dtype == StateDType.f32, True),
                                 lay, 0, ctx)

    @property
    def addr(self) -> int:
        return 0 if self.raw is None else self.raw.addr

    @property
    def nbytes(self) -> int:
        return 0 if self.raw is None else self.raw.lay.nbytes

    def view(self) -> memoryview:
        """The storage bytes (for writing a frame)."""
        return storage_bytes(self.raw) if self.raw is not None else memoryview(b"")

    def fill(self, data) -> None:
        """Overwrite the storage with `data` (exactly nbytes bytes)."""
        if self.raw is not None:
            storage_bytes(self.raw)[:] = data

    def numpy(self) -> np.ndarray:
        """A copy as float32 (bf16 widened)."""
        return np.zeros(0, np.float32) if self.raw is None else self.raw.to_numpy()


def storage_bytes(raw: RawTensor) -> memoryview:
    """A writable byte view of a contiguous RawTensor's storage."""
    start = raw.offset * raw.lay.itemsize
    return memoryview(raw.buf)[start:start + raw.lay.nbytes]


class Slot:
    """One registered parameter: its storage (kept alive here), its leaf (where its gradient
    accumulates), its geometry, the f32 master of a 16-bit param, and the optimizer's state.

    rows = shape[0] and cols = prod(shape[1:]) (a conv filter flattens to [d0, rest]; a 0-d
    param is [1, 1]); raw_rank = len(shape)."""

    __slots__ = ("raw", "leaf", "name", "rows", "cols", "raw_rank", "numel", "master", "state",
                 "cache")

    def __init__(self, raw: RawTensor, leaf: Leaf, name: str | None):
        self.raw, self.leaf, self.name = raw, leaf, name
        shape = raw.shape
        self.raw_rank = len(shape)
        self.rows = shape[0] if shape else 1
        self.cols = math.prod(shape[1:])
        self.numel = raw.numel
        self.master = None
        if raw.dtype != "f32":  # T-2: the f32 master every update steps; narrowed back after each
            self.master = ew.cast(raw.ctx, raw, "f32")
        self.state: dict = {}
        self.cache: dict = {}

    @property
    def ctx(self):
        return self.raw.ctx

    @property
    def dtype(self) -> str:
        return self.raw.dtype

    @property
    def values(self) -> RawTensor:
        """The f32 values updates step: the param itself, or its master."""
        return self.raw if self.master is None else self.master

    def publish(self) -> None:
        """Narrow the master into the 16-bit param storage (f16 RNE / SPEC R-9 bf16)."""
        if self.master is not None:
            ew.run(self.ctx, "copy", self.raw.dtype, self.raw.shape, (self.master,), out=self.raw)

    def refresh_master(self) -> None:
        """Re-widen the master from the param's current (16-bit) values."""
        if self.master is not None:
            ew.run(self.ctx, "copy", "f32", self.raw.shape, (self.raw,), out=self.master)

    def label(self, index: int) -> str:
        return repr(self.name) if self.name is not None else f"param{index}"


class Optimizer(abc.ABC):
    """Base of SGD, Adam, AdamW (and Muon, Apollo). See the module docstring."""

    Config: ClassVar[type]
    MAGICS: ClassVar[frames.Magics]
    RECORD: ClassVar[tuple] = ()  # ((field, kind), ...): kind u64 | f32 | buf (tagged) | raw (f32)

    def __init__(self, config=None, **options):
        if config is None:
            config = self.Config(**options)  # an unknown keyword is a TypeError
        elif options:
            raise InvalidArgumentType(f"{type(self).__name__}: pass a config or keyword options, "
                                      f"not both (got {sorted(options)})")
        elif not isinstance(config, self.Config):
            raise InvalidArgumentType(f"{type(self).__name__}: expected a {self.Config.__name__}, "
                                      f"got {type(config).__name__}")
        self.config = config
        self._check_config()
        self.slots: list[Slot] = []
        self._leaves: set = set()
        self._closed = False

    # ---- lifetime ----
    def close(self) -> None:
        """Drop every slot: state buffers and masters go back to their pools."""
        self.slots = []
        self._leaves = set()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _live(self, op: str) -> None:
        if self._closed:
            raise UseAfterRelease(f"{type(self).__name__}.{op}: the optimizer was closed; "
                                  f"expected an open optimizer")

    # ---- registration ----
    def add_param(self, t, name: str | None = None) -> None:
        """Register a variable (f32, f16 or bf16; a 16-bit one gets an f32 master holding its
        current values: load values BEFORE registering). name: its checkpoint identity."""
        self._live("add_param")
        slot = self._new_slot(t, name, "add_param")
        self._register(slot)

    def add_param_named(self, t, name: str) -> None:
        self.add_param(t, name)

    def add_fallback_param(self, t, name: str | None = None) -> None:
        """Optimizers without a fallback path register it like add_param (T-9)."""
        self.add_param(t, name)

    def add_fallback_param_named(self, t, name: str) -> None:
        self.add_fallback_param(t, name)

    def _new_slot(self, t, name, op: str) -> Slot:
        """Validate a candidate param (NotAVariable, NonContiguousParam, DuplicateParam) and
        build its slot (master included)."""
        where = f"{type(self).__name__}.{op}"
        if not isinstance(t, Tensor):
            raise InvalidArgumentType(f"{where}: expected a fucina Tensor, got {type(t).__name__}")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentType(f"{where}: expected a str name, got {type(name).__name__}")
        raw = t._live(where)
        leaf = t._node
        if not isinstance(leaf, Leaf):
            got = "a constant" if leaf is None else f"the result of {leaf.name!r}"
            raise NotAVariable(f"{where}: expected a variable (ctx.variable), got {got} with "
                               f"tags {t.tags}")
        if raw.dtype not in PARAM_DTYPES:
            raise DTypeError(f"{where}: expected an f32/f16/bf16 variable, got {raw.dtype}")
        if not raw.is_contiguous():
            raise NonContiguousParam(f"{where}: expected a contiguous variable, got shape "
                                     f"{raw.shape} with strides {raw.strides}")
        if self.owns(leaf):
            raise DuplicateParam(f"{where}: the variable with tags {t.tags} is already "
                                 f"registered; expected each param once")
        return Slot(raw, leaf, name)

    def _register(self, slot: Slot) -> None:
        slot.state = self._init_state(slot)
        self.slots.append(slot)
        self._leaves.add(slot.leaf)

    def owns(self, leaf) -> bool:
        """Is this leaf (a variable's gradient state) registered here, any path included?"""
        return leaf in self._leaves

    def all_slots(self) -> list[Slot]:
        """Every slot this optimizer steps, embedded fallbacks included."""
        return self.slots

    def collect_grad_states(self, seen: set) -> None:
        """Add this optimizer's leaves to `seen` (OptimizerSet's cross-member duplicate check);
        DuplicateParam, with `seen` unchanged, if any is already there."""
        leaves = [s.leaf for s in self.all_slots()]
        if any(leaf in seen for leaf in leaves):
            raise DuplicateParam(f"{type(self).__name__}: a param is already registered with "
                                 f"another optimizer of the set; expected each param in one "
                                 f"optimizer")
        seen.update(leaves)

    # ---- gradients ----
    def grad_of(self, slot: Slot, op: str) -> RawTensor | None:
        """The slot's accumulated gradient (contiguous f32), or None (the param is skipped)."""
        g = slot.leaf.grad
        if g is None:
            return None
        if slot.raw.ctx.closed:
            raise ContextClosed(f"{type(self).__name__}.{op}: the param's ExecContext was "
                                f"closed; expected an open context")
        if g.numel != slot.numel:
            raise GradShapeMismatch(f"{type(self).__name__}.{op}: param of shape "
                                    f"{slot.raw.shape}: expected a gradient of {slot.numel} "
                                    f"elements, got shape {g.shape}")
        if not g.is_contiguous():
            g = slot.leaf.grad = ew.materialize(g.ctx, g)
        return g

    def grads(self, op: str = "grads") -> list[RawTensor]:
        """The gradients present now, in slot order (fallbacks included)."""
        out = []
        for s in self.all_slots():
            g = self.grad_of(s, op)
            if g is not None:
                out.append(g)
        return out

    def zero_grad(self) -> None:
        """Clear every registered param's gradient (the only clear, T-13)."""
        for s in self.all_slots():
            s.leaf.grad = None

    def grad_squared_norm(self) -> float:
        """Σ over params of sum_squares(grad) (T-7, f64); params without a gradient add 0."""
        self._live("grad_squared_norm")
        return grad_squared_norm(self.grads("grad_squared_norm"))

    def scale_gradients(self, factor: float) -> None:
        """Multiply every accumulated gradient by f32(factor), in place."""
        self._live("scale_gradients")
        scale_grads(self.grads("scale_gradients"), factor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """T-11: scale the gradients when their global L2 norm exceeds max_norm; returns the
        pre-clip norm. Call after backward, before step."""
        self._live("clip_grad_norm")
        return clip(self.grads("clip_grad_norm"), self.grad_squared_norm(), max_norm)

    # ---- stepping ----
    def step(self) -> None:
        """One update of every param that has a gradient (the others are skipped and their
        step counters stay)."""
        self._live("step")
        self._check_config()  # a value assigned to config since construction is checked here
        prep = self._prepare()
        batch: dict = {}
        for slot in self.slots:
            g = self.grad_of(slot, "step")
            if g is None:
                continue
            item = self._update(slot, g, prep)
            if item is not None:   # (key, pointers, scalars): launched below with its likes
                key, ptrs, scalars = item
                batch.setdefault((slot.raw.ctx, key, scalars), []).append((slot.numel, ptrs))
        for (ctx, key, scalars), items in batch.items():
            xo.update(ctx, key, items, scalars)

    def _check_config(self) -> None:
        """Constructor-time validation of the config (override)."""

    def _prepare(self):
        """Per-step scalars shared by every slot (override)."""
        return None

    @abc.abstractmethod
    def _init_state(self, slot: Slot) -> dict:
        """The zero-initialised state buffers of a new slot, by record name."""

    @abc.abstractmethod
    def _update(self, slot: Slot, grad: RawTensor, prep):
        """One slot's update: its launches, or — for a fused update kernel of
        fucina.exec.optim — (key, pointers, scalars) for step to launch with every other slot
        of the same key and scalars (one launch for all of them)."""

    def _header(self) -> list:
        """The pinned structural config fields: [(wire kind, value, label)] (lr never is)."""
        return []

    def state_of(self, t) -> dict:
        """A copy of one param's state (buffers as float32 numpy arrays; the f32 master as
        "master"): for inspection and tests."""
        for s in self.all_slots():
            if s.leaf is t._node:
                out = {k: (v.numpy() if isinstance(v, StateBuf) else v) for k, v in s.state.items()}
                if s.master is not None:
                    out["master"] = s.master.to_numpy()
                return out
        raise ParamNotRegistered(f"{type(self).__name__}.state_of: the tensor is not registered "
                                 "here")

    # ---- checkpoint frames (T-17) ----
    def save_state(self, f, checksum: bool = True) -> None:
        """Write this optimizer's frame to the binary file object f, inside the CRC32 envelope
        (frames.write_checked) unless checksum=False (the bare SPEC T-17 bytes)."""
        self._live("save_state")
        if checksum:
            frames.write_checked(f, self.write_frame)
        else:
            self.write_frame(f)

    def load_state(self, f) -> None:
        """Read a frame written by save_state (enveloped or bare): everything, the CRC32
        included, is validated before anything is changed (a truncated, corrupt or mismatched
        stream leaves the optimizer as it was)."""
        self._live("load_state")
        self.commit_frame(frames.read_checked(f, f"{type(self).__name__}.load_state",
                                              self.stage_frame))

    def frame_version(self) -> int:
        return slots_version(self.slots, self.RECORD)

    def write_frame(self, f) -> None:
        op = f"{type(self).__name__}.save_state"
        names = frames.slot_names(self.slots, op)  # validated before the first byte
        version = self.frame_version()
        f.write(self.MAGICS.of(version))
        for kind, value, _ in self._header():
            frames.write_scalar(f, kind, value)
        self.write_slots(f, version, names)

    def stage_frame(self, r: Reader):
        """Read and validate a whole frame into scratch; nothing live changes."""
        version = self.MAGICS.expect(r)
        for kind, value, label in self._header():
            got = r.scalar(kind, f"the header field {label}")
            if got != frames.wire(kind, value):
                raise CheckpointConfigMismatch(
                    f"{r.op}: {label}: the optimizer has {value!r}, the frame holds "
                    f"{_from_wire(kind, got)!r}; expected the same structural config")
        return self.stage_slots(r, version)

    def commit_frame(self, staged) -> None:
        """Install a staged frame (no failure point remains)."""
        self.commit_slots(staged)

    def write_slots(self, f, version: int, names) -> None:
        """u32 count, then per slot: name, dims, the RECORD fields, the v5 master."""
        f.write(struct.pack("<I", len(self.slots)))
        for s, name in zip(self.slots, names):
            frames.write_name(f, name)
            frames.write_dims(f, s.rows, s.cols)
            for field, kind in self.RECORD:
                v = s.state[field]
                if kind in ("buf", "raw"):
                    frames.write_buffer(f, version, v.dtype, v.view(), tagged=kind == "buf")
                else:
                    frames.write_scalar(f, kind, v)
            frames.write_master(f, version, None if s.master is None else storage_bytes(s.master))

    def stage_slots(self, r: Reader, version: int) -> list:
        count = r.scalar("u32", "the slot count")
        matcher = frames.SlotMatcher(self.slots, r.op)
        staged = []
        for _ in range(count):
            i = matcher.match(r)
            s = self.slots[i]
            label = s.label(i)
            frames.expect_dims(r, s.rows, s.cols, label)
            values = {}
            for field, kind in self.RECORD:
                what = f"{field} of slot {label}"
                if kind in ("buf", "raw"):
                    buf = s.state[field]
                    values[field] = frames.read_buffer(r, version, buf.dtype, buf.nbytes, what,
                                                       tagged=kind == "buf")
                else:
                    values[field] = _from_wire(kind, r.scalar(kind, what))
            nbytes = None if s.master is None else 4 * s.numel
            staged.append((i, values, frames.read_master(r, version, nbytes, label)))
        matcher.require_all()
        return staged

    def commit_slots(self, staged) -> None:
        for i, values, master in staged:
            s = self.slots[i]
            for field, kind in self.RECORD:
                if kind in ("buf", "raw"):
                    s.state[field].fill(values[field])
                else:
                    s.state[field] = values[field]
            if master is not None:
                storage_bytes(s.master)[:] = master
                s.publish()
            else:
                s.refresh_master()
            self._after_load(s)

    def _after_load(self, slot: Slot) -> None:
        """Per-slot hook after a committed load (Apollo regenerates its projection)."""


class WithFallback(Optimizer):
    """An optimizer with an embedded fallback optimizer (`self.fallback`, Muon's and Apollo's
    AdamW): add_param routes a slot by `_main(slot)`, add_fallback_param forces the fallback
    (embeddings, output/classifier heads); duplicates, norms and clipping span both."""

    @abc.abstractmethod
    def _main(self, slot: Slot) -> bool:
        """Does add_param put this slot on the main path?"""

    def add_param(self, t, name: str | None = None) -> None:
        self._live("add_param")
        slot = self._new_slot(t, name, "add_param")
        (self._register if self._main(slot) else self.fallback._register)(slot)

    def add_fallback_param(self, t, name: str | None = None) -> None:
        self._live("add_fallback_param")
        self.fallback._register(self._new_slot(t, name, "add_fallback_param"))

    def owns(self, leaf) -> bool:
        return leaf in self._leaves or self.fallback.owns(leaf)

    def all_slots(self):
        return self.slots + self.fallback.slots


def _from_wire(kind: str, v: int):
    if kind == "f32":
        return struct.unpack("<f", struct.pack("<I", v))[0]
    return bool(v) if kind == "bool" else v


def slots_version(slots, record) -> int:
    """v5 if a slot carries an f32 master, else v4 if a tagged buffer is not f32, else v3."""
    if any(s.master is not None for s in slots):
        return V5
    for s in slots:
        for field, kind in record:
            if kind == "buf" and s.state[field].dtype != StateDType.f32:
                return V4
    return V3


__all__ = ["Optimizer", "Slot", "StateBuf", "PARAM_DTYPES", "storage_bytes", "slots_version", "f32"]
