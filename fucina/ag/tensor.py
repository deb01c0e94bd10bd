"""The public Tensor: a RawTensor plus tags (and, from the autograd layer, a grad node).

Every op validates tags first (TagError), then sizes (ShapeMismatch), then runs one generated
kernel through the exec layer. Results are new caller-owned tensors; operands are borrowed.
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from .. import axes
from ..errors import (ContextClosed, ContextMismatch, DTypeError, InvalidShape,
                      MutableDataRequiresNoGrad, UseAfterRelease)
from ..exec import elementwise as ew
from ..exec import reduce as red
from ..exec.dtypes import check as check_dtype
from ..exec.raw import RawTensor
from ..runtime import _rt

_PLANS: dict = {}  # (op, layout, other layout | reflected, tags, other tags | scalar type) -> plan


@functools.lru_cache(maxsize=1024)
def _bits(x) -> int:
    return ew.f32_bits(float(x))


UNARY = ("exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt")


class Tensor:
    """A tensor whose axes have names. Create one through an ExecContext."""

    __slots__ = ("_raw", "tags", "__weakref__")

    def __init__(self, raw, tags):
        self._raw = raw
        self.tags = tags

    # ---- plumbing ----
    def _live(self, op: str):
        r = self._raw
        if r is None:
            raise UseAfterRelease(f"{op}: tensor {self.tags} was released; expected a live tensor")
        if r.ctx.closed:
            raise ContextClosed(f"{op}: the tensor's ExecContext was closed; expected an open context")
        return r

    # ---- attributes ----
    @property
    def shape(self) -> tuple:
        return self._live("shape").shape

    @property
    def dtype(self) -> str:
        return self._live("dtype").dtype

    @property
    def ctx(self):
        return self._live("ctx").ctx

    @property
    def numel(self) -> int:
        return self._live("numel").numel

    @property
    def requires_grad(self) -> bool:
        return False

    @property
    def scope_owned(self) -> bool:
        return False

    # ---- data access ----
    def numpy(self) -> np.ndarray:
        """A copy as numpy (bf16 widens to float32)."""
        return self._live("numpy").to_numpy()

    def data_const(self) -> np.ndarray:
        """A read-only numpy view of the storage (bf16 as its raw uint16 bits)."""
        v = self._live("data_const").storage_view()
        v.flags.writeable = False
        return v

    def data(self) -> np.ndarray:
        """A writable numpy view of the storage; refused on a tensor that carries gradients."""
        r = self._live("data")
        if self.requires_grad:
            raise MutableDataRequiresNoGrad(
                "data: expected a tensor without gradients, got a variable; use data_const() to read")
        return r.storage_view()

    def item(self):
        r = self._live("item")
        if r.numel != 1:
            raise InvalidShape(f"item: expected exactly 1 element, got shape {r.shape}")
        v = r.to_numpy().reshape(())
        return v.item()

    def release(self) -> None:
        """Return the storage to the pool now (when no other view holds it)."""
        self._raw = None

    def __repr__(self):
        if self._raw is None:
            return "Tensor(<released>)"
        return f"Tensor(tags={self.tags}, shape={self._raw.shape}, dtype={self._raw.dtype})"

    # ---- pointwise binary (A-2 broadcasting by name) ----
    def _binary(self, op: str, other, reflected: bool = False):
        """The per-op fast path: one plan lookup on interned layouts and tags, then alloc+launch.
        Everything that can fail is checked when the plan is made (in _plan_binary)."""
        a = self._raw
        if a is not None:
            ctx = a.ctx
            if type(other) is Tensor:
                b = other._raw
                p = _PLANS.get((op, a.lay, None if b is None else b.lay, self.tags, other.tags))
                if p is not None and b.ctx is ctx and not ctx.closed:
                    lay, tags, addr, nch, cost, tail = p
                    out = RawTensor(ctx.pool.alloc(lay.nbytes, lay.dtype == "f32"), lay, 0, ctx)
                    _rt.launch(ctx.team_for(nch, cost) if nch > 1 else None, addr, nch, cost,
                               out.addr, a.addr, b.addr, *tail)
                    return Tensor(out, tags)
            elif type(other) is float or type(other) is int:
                p = _PLANS.get((op, a.lay, reflected, self.tags, type(other)))
                if p is not None and not ctx.closed:
                    lay, tags, addr, nch, cost, tail = p
                    bits = _bits(other) if lay.dtype != "i64" else other & 0xFFFFFFFFFFFFFFFF
                    out = RawTensor(ctx.pool.alloc(lay.nbytes, lay.dtype == "f32"), lay, 0, ctx)
                    x, y = (bits, a.addr) if reflected else (a.addr, bits)
                    _rt.launch(ctx.team_for(nch, cost) if nch > 1 else None, addr, nch, cost,
                               out.addr, x, y, *tail)
                    return Tensor(out, tags)
        return self._binary_slow(op, other, reflected)

    def _binary_slow(self, op: str, other, reflected: bool):
        """Validate, run, and remember the plan so the next identical call takes the fast path."""
        a = self._live(op)
        if isinstance(other, Tensor):
            b = other._live(op)
            if b.ctx is not a.ctx:
                raise ContextMismatch(f"{op}: operands belong to two different ExecContexts")
            dtype = ew.compute_dtype_of(op, (a.dtype, b.dtype))
            if self.tags == other.tags and a.shape == b.shape:
                tags, shape, va, vb = self.tags, a.shape, a, b
            else:
                tags, shape, lmap, rmap = axes.pointwise(op, self.tags, a.shape, other.tags, b.shape)
                va = a.view(shape, axes.aligned_strides(lmap, shape, a.shape, a.strides))
                vb = b.view(shape, axes.aligned_strides(rmap, shape, b.shape, b.strides))
            out = ew.run(a.ctx, op, dtype, shape, (va, vb))
            addr, nch, cost, tail = ew.plan_of(op, dtype, shape, (va, vb))
            _PLANS[(op, a.lay, b.lay, self.tags, other.tags)] = (out.lay, tags, addr, nch, cost, tail)
            return Tensor(out, tags)
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            dtype = ew.compute_dtype_of(op, (a.dtype,))
            if dtype == "i64" and not isinstance(other, numbers.Integral):
                raise DTypeError(f"{op}: expected an integer scalar for an i64 tensor, got {other!r}")
            operands = (other, a) if reflected else (a, other)
            out = ew.run(a.ctx, op, dtype, a.shape, operands)
            if type(other) in (float, int):
                addr, nch, cost, tail = ew.plan_of(op, dtype, a.shape, operands)
                _PLANS[(op, a.lay, reflected, self.tags, type(other))] = (out.lay, self.tags, addr, nch, cost, tail)
            return Tensor(out, self.tags)
        raise TypeError(f"{op}: expected a Tensor or a real number as the other operand, "
                        f"got {type(other).__name__}")

    def add(self, other):
        return self._binary("add", other)

    def sub(self, other):
        return self._binary("sub", other)

    def mul(self, other):
        return self._binary("mul", other)

    def div(self, other):
        return self._binary("div", other)

    def maximum(self, other):
        return self._binary("maximum", other)

    def minimum(self, other):
        return self._binary("minimum", other)

    def pow(self, other):
        return self._binary("pow", other)

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = div
    __pow__ = pow

    def __radd__(self, other):
        return self._binary("add", other, reflected=True)

    def __rsub__(self, other):
        return self._binary("sub", other, reflected=True)

    def __rmul__(self, other):
        return self._binary("mul", other, reflected=True)

    def __rtruediv__(self, other):
        return self._binary("div", other, reflected=True)

    def __neg__(self):
        return self.neg()

    # ---- scalar variants (SPEC §3.2) ----
    def scale(self, s: float):
        return self._binary("mul", _real("scale", s))

    def add_scalar(self, s: float):
        return self._binary("add", _real("add_scalar", s))

    def sub_scalar(self, s: float):
        return self._binary("add", -_real("sub_scalar", s))

    def div_scalar(self, s: float):
        """scale(1/s) with 1/s computed in float32, as the reference does."""
        return self._binary("mul", float(np.float32(1.0) / np.float32(_real("div_scalar", s))))

    def pow_scalar(self, e: float):
        return self._binary("pow", _real("pow_scalar", e))

    # ---- unary ----
    def unary(self, op: str):
        if op not in UNARY:
            raise ValueError(f"unary: expected one of {UNARY}, got {op!r}")
        a = self._live(op)
        dtype = ew.compute_dtype_of(op, (a.dtype,))
        return Tensor(ew.run(a.ctx, op, dtype, a.shape, (a,)), self.tags)

    def exp(self):
        return self.unary("exp")

    def log(self):
        return self.unary("log")

    def tanh(self):
        return self.unary("tanh")

    def sigmoid(self):
        return self.unary("sigmoid")

    def relu(self):
        return self.unary("relu")

    def neg(self):
        return self.unary("neg")

    def sqrt(self):
        return self.unary("sqrt")

    # ---- reductions (A-3) ----
    def _reduce(self, op: str, tag: str, mean: bool = False):
        name = "mean" if mean else op
        a = self._live(name)
        ax, tags = axes.reduced(self.tags, tag, name)
        return Tensor(red.reduce_axis(a.ctx, op, a, ax, mean), tags)

    def sum(self, tag: str):
        return self._reduce("sum", tag)

    def mean(self, tag: str):
        return self._reduce("sum", tag, mean=True)

    def max(self, tag: str):
        return self._reduce("max", tag)

    def min(self, tag: str):
        return self._reduce("min", tag)

    def sum_all(self):
        a = self._live("sum_all")
        return Tensor(red.reduce_all(a.ctx, "sum", a), ())

    def mean_all(self):
        a = self._live("mean_all")
        return Tensor(red.reduce_all(a.ctx, "sum", a, mean=True), ())

    # ---- casts and views ----
    def to(self, dtype: str):
        """A copy in `dtype` (f32 <-> f16/bf16 with R-9 rounding; same dtype copies)."""
        a = self._live("to")
        return Tensor(ew.cast(a.ctx, a, check_dtype(dtype, "to")), self.tags)

    def narrow(self, tag: str, start: int, length: int):
        """A view of `length` entries of axis `tag` from `start` (shares storage)."""
        a = self._live("narrow")
        return Tensor(a.narrow(axes.axis_of(self.tags, tag, "narrow"), start, length), self.tags)

    def permute(self, tags):
        """A view with the axes reordered to `tags` (shares storage)."""
        a = self._live("permute")
        tags = axes.check_tags(tags, a.rank, "permute")
        if set(tags) != set(self.tags):
            raise axes.TagError(f"permute: expected a reordering of {self.tags}, got {tags}")
        return Tensor(a.permute([self.tags.index(t) for t in tags]), tags)

    def contiguous(self):
        a = self._live("contiguous")
        return Tensor(ew.materialize(a.ctx, a), self.tags)


def _real(op: str, s) -> float:
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"{op}: expected a real number, got {type(s).__name__}")
    return float(s)


__all__ = ["Tensor", "DTypeError"]
