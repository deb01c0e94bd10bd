"""The public Tensor: a RawTensor, its tags, and (when it takes part in a graph) a grad node.

Every op validates tags first (TagError), then sizes (ShapeMismatch), then runs one generated
kernel through the exec layer and ends in the engine's finish_op tail. Results are new tensors;
operands are borrowed. Inside an exec scope, op results are scope-owned borrows (SPEC R-5).
"""
from __future__ import annotations

import functools
import numbers

import numpy as np

from .. import axes
from ..errors import (ContextClosed, ContextMismatch, DTypeError, InvalidShape,
                      MutableDataRequiresNoGrad, UseAfterRelease)
from ..exec import elementwise as ew
from ..exec.dtypes import check as check_dtype
from ..exec.raw import RawTensor
from ..runtime import _rt
from . import custom as agcustom
from . import elementwise as agew
from . import loss as agloss
from . import matmul as agmm
from . import engine
from . import reduce as agred

# (op, layout, other layout | reflected, tags, other tags | scalar type) ->
# (out layout, out tags, kernel, chunks, cost, argument tail, aligned layout of each operand or None)
_PLANS: dict = {}


@functools.lru_cache(maxsize=1024)
def _bits(x) -> int:
    return ew.f32_bits(float(x))


UNARY = ("exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt")


class Tensor:
    """A tensor whose axes have names. Create one through an ExecContext."""

    __slots__ = ("_raw", "tags", "_node", "_scope", "__weakref__")

    def __init__(self, raw, tags, node=None):
        self._raw = raw
        self.tags = tags
        self._node = node
        self._scope = None

    @staticmethod
    def _result(raw, tags, node=None) -> "Tensor":
        """An op result: adopted by the innermost open exec scope when it is f32 or carries a
        graph node; typed constants (16-bit/int/bool no-grad results) stay caller-owned."""
        t = Tensor(raw, tags, node)
        ctx = raw.ctx
        if ctx.scopes and (node is not None or raw.dtype == "f32"):
            t._scope = ctx.scopes[-1]
            ctx.adopt(t)
        return t

    # ---- plumbing ----
    def _live(self, op: str):
        r = self._raw
        if r is None:
            if self._scope is not None:
                raise UseAfterRelease(f"{op}: tensor used after its exec scope closed; expected a "
                                      f"live tensor (keep it outside the scope or copy it)")
            raise UseAfterRelease(f"{op}: tensor {self.tags} was released; expected a live tensor")
        if r.ctx.closed:
            raise ContextClosed(f"{op}: the tensor's ExecContext was closed; expected an open context")
        return r

    def _scope_release(self) -> None:
        """Called by close_exec_scope: the borrow dies, and so does its graph node."""
        self._raw = None
        if self._node is not None:
            self._node.release()

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
        return self._node is not None

    @property
    def scope_owned(self) -> bool:
        return self._scope is not None

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
        if self._node is not None:
            raise MutableDataRequiresNoGrad(
                "data: expected a tensor without gradients, got one that requires grad; "
                "use data_const() to read it")
        return r.storage_view()

    def item(self):
        r = self._live("item")
        if r.numel != 1:
            raise InvalidShape(f"item: expected exactly 1 element, got shape {r.shape}")
        return r.to_numpy().reshape(()).item()

    def release(self) -> None:
        """The reference's deinit: return the storage to the pool now. A no-op on a scope
        borrow (its scope releases it). Releasing an op result before backward() makes that
        backward raise GraphNodeReleased instead of reading freed memory."""
        if self._scope is not None:
            return
        self._raw = None
        if self._node is not None:
            self._node.release()
            self._node = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        if self._raw is None:
            return "Tensor(<released>)"
        grad = ", requires_grad" if self._node is not None else ""
        return f"Tensor(tags={self.tags}, shape={self._raw.shape}, dtype={self._raw.dtype}{grad})"

    # ---- autograd ----
    def backward(self, grad: "Tensor | None" = None) -> None:
        """Back-propagate from this tensor (a scalar, or with grad= of the same tags/shape)."""
        self._live("backward")
        if self._node is None:
            raise engine.no_graph("backward")
        engine.backward(self._node, engine.seed_for(self, grad))

    def _leaf(self, op):
        self._live(op)
        n = self._node
        return n if isinstance(n, engine.Leaf) else None

    def grad(self) -> "Tensor | None":
        """A caller-owned copy of the accumulated gradient (f32), or None."""
        n = self._leaf("grad")
        if n is None or n.grad is None:
            return None
        g = n.grad
        return Tensor(ew.run(g.ctx, "copy", "f32", g.shape, (g,)), self.tags)

    def grad_view(self) -> "Tensor | None":
        """The accumulator as of now (a later backward does not update this view)."""
        n = self._leaf("grad_view")
        return None if n is None or n.grad is None else Tensor(n.grad, self.tags)

    def zero_grad(self) -> None:
        n = self._leaf("zero_grad")
        if n is not None:
            n.grad = None

    def detach(self) -> "Tensor":
        """A no-grad view sharing storage."""
        return Tensor._result(self._live("detach"), self.tags)

    # ---- pointwise binary (A-2 broadcasting by name) ----
    def _binary(self, op: str, other, reflected: bool = False):
        """The per-op fast path: a remembered plan for these interned layouts and tags, then
        alloc + launch (+ a node when an operand requires grad, + adoption under a scope).
        Everything that can fail was checked when the plan was made (in _binary_slow)."""
        a = self._raw
        if a is None:
            return self._binary_slow(op, other, reflected)
        ctx = a.ctx
        if type(other) is Tensor:
            b = other._raw
            p = _PLANS.get((op, a.lay, None if b is None else b.lay, self.tags, other.tags))
            if p is None or b.ctx is not ctx or ctx.closed:
                return self._binary_slow(op, other, reflected)
            lay, tags, addr, nch, cost, tail, la, lb = p
            out = RawTensor(ctx.pool.alloc(lay.nbytes, lay.dtype == "f32"), lay, 0, ctx)
            _rt.launch(ctx.team_for(nch, cost) if nch > 1 else None, addr, nch, cost,
                       out.addr, a.addr, b.addr, *tail)
            na, nb = self._node, other._node
            node = None
            if (na is not None or nb is not None) and engine.is_grad_enabled():
                if lay.dtype != "f32":
                    return self._binary_slow(op, other, reflected)
                va = a if la is None else RawTensor(a.buf, la, a.offset, ctx)
                vb = b if lb is None else RawTensor(b.buf, lb, b.offset, ctx)
                saved = (op, ctx, tags, lay.shape, va, vb, out, self.tags, a.lay.shape,
                         other.tags, b.lay.shape)
                node = engine.Node(op, (na, nb), functools.partial(
                    agew.binary_grads, saved, (na is not None, nb is not None)))
        elif type(other) is float or type(other) is int:
            p = _PLANS.get((op, a.lay, reflected, self.tags, type(other)))
            if p is None or ctx.closed or (self._node is not None and engine.is_grad_enabled()):
                return self._binary_slow(op, other, reflected)
            lay, tags, addr, nch, cost, tail, _, _ = p
            bits = _bits(other) if lay.dtype != "i64" else other & 0xFFFFFFFFFFFFFFFF
            out = RawTensor(ctx.pool.alloc(lay.nbytes, lay.dtype == "f32"), lay, 0, ctx)
            x, y = (bits, a.addr) if reflected else (a.addr, bits)
            _rt.launch(ctx.team_for(nch, cost) if nch > 1 else None, addr, nch, cost,
                       out.addr, x, y, *tail)
            node = None
        else:
            return self._binary_slow(op, other, reflected)
        t = Tensor(out, tags, node)
        if ctx.scopes and (node is not None or lay.dtype == "f32"):
            t._scope = ctx.scopes[-1]
            ctx.adopt(t)
        return t

    def _binary_slow(self, op: str, other, reflected: bool):
        """Validate, run (recording a node if needed), and remember the plan for the fast path."""
        a = self._live(op)
        if isinstance(other, Tensor):
            b = other._live(op)
            if b.ctx is not a.ctx:
                raise ContextMismatch(f"{op}: operands belong to two different ExecContexts")
            tags, shape, va, vb = agew.aligned(op, self, other)
            out, tags, node = agew.binary(op, self, other, tags, shape, va, vb)
            addr, nch, cost, tail = ew.plan_of(op, out.dtype, shape, (va, vb))
            _PLANS[(op, a.lay, b.lay, self.tags, other.tags)] = (
                out.lay, tags, addr, nch, cost, tail, None if va is a else va.lay,
                None if vb is b else vb.lay)
            return Tensor._result(out, tags, node)
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            if a.dtype == "i64" and not isinstance(other, numbers.Integral):
                raise DTypeError(f"{op}: expected an integer scalar for an i64 tensor, got {other!r}")
            out, tags, node = agew.with_scalar(op, self, other, reflected)
            if type(other) in (float, int):
                operands = (other, a) if reflected else (a, other)
                addr, nch, cost, tail = ew.plan_of(op, out.dtype, a.shape, operands)
                _PLANS[(op, a.lay, reflected, self.tags, type(other))] = (
                    out.lay, tags, addr, nch, cost, tail, None, None)
            return Tensor._result(out, tags, node)
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

    def __rpow__(self, other):
        return self._binary("pow", other, reflected=True)

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
        self._live(op)
        return Tensor._result(*agew.unary(op, self))

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
        self._live(name)
        ax, tags = axes.reduced(self.tags, tag, name)
        return Tensor._result(*agred.reduce_axis(op, self, ax, tags, mean))

    def sum(self, tag: str):
        return self._reduce("sum", tag)

    def mean(self, tag: str):
        return self._reduce("sum", tag, mean=True)

    def max(self, tag: str):
        return self._reduce("max", tag)

    def min(self, tag: str):
        return self._reduce("min", tag)

    def sum_all(self):
        self._live("sum_all")
        return Tensor._result(*agred.reduce_all("sum", self))

    def mean_all(self):
        self._live("mean_all")
        return Tensor._result(*agred.reduce_all("sum", self, mean=True))

    # ---- contractions (A-4…A-9) ----
    def _einsum(self, other, out_tags, op="einsum"):
        self._live(op)
        _same_ctx(op, self, other)
        return Tensor._result(*agmm.einsum(self, other, out_tags, op))

    def einsum(self, other: "Tensor", out_tags):
        """result[out_tags] = sum over every other tag of self * other (A-5)."""
        return self._einsum(other, out_tags)

    def dot(self, other: "Tensor", tag: str):
        """Contract `tag`; result tags: batch + left free + right free (A-4)."""
        self._live("dot")
        _same_ctx("dot", self, other)
        return Tensor._result(*agmm.dot(self, other, tag))

    def matmul(self, other: "Tensor", kind: str, out_tags):
        """A-7: plain / trans_a / trans_b on the storage order, bypassing the tag algebra."""
        self._live("matmul")
        _same_ctx("matmul", self, other)
        return Tensor._result(*agmm.matmul(self, other, kind, out_tags))

    def add_dot(self, a: "Tensor", b: "Tensor", tag: str):
        """A-9: self + a·b (addmm)."""
        self._live("add_dot")
        _same_ctx("add_dot", self, a)
        _same_ctx("add_dot", self, b)
        return Tensor._result(*agmm.add_dot(self, a, b, tag))

    # ---- losses (SPEC §3.14) ----
    def cross_entropy(self, class_tag: str, labels, *, ignore_index=None, reduction: str = "mean",
                      label_smoothing: float = 0.0):
        """Fused log-softmax + NLL over `class_tag`; labels one per remaining position."""
        return Tensor._result(*agloss.cross_entropy(self, class_tag, labels, ignore_index,
                                                    reduction, label_smoothing))

    cross_entropy_ext = cross_entropy

    # ---- user scalar ops (SPEC §3.5) ----
    def elemental_unary(self, op, extra=None):
        """op.forward(x, extra) and op.backward(x, y, gy, extra) -> dL/dx, traced into kernels."""
        from . import elemental

        self._live("elemental_unary")
        return Tensor._result(*elemental.elemental_unary(self, op, extra))

    def elemental_binary(self, other: "Tensor", op, extra=None):
        """op.forward(a, b, extra), op.backward_a / backward_b(a, b, y, gy, extra); A-2 broadcast."""
        from . import elemental

        self._live("elemental_binary")
        _same_ctx("elemental_binary", self, other)
        return Tensor._result(*elemental.elemental_binary(self, other, op, extra))

    # ---- casts and views ----
    def to(self, dtype: str):
        """A copy in `dtype` (f32 <-> f16/bf16 with R-9 rounding, differentiable; same dtype copies)."""
        self._live("to")
        return Tensor._result(*agew.cast(self, check_dtype(dtype, "to")))

    def narrow(self, tag: str, start: int, length: int):
        """A view of `length` entries of axis `tag` from `start` (shares storage)."""
        a = self._live("narrow")
        ax = axes.axis_of(self.tags, tag, "narrow")
        v = a.narrow(ax, start, length)

        def grad_of(g):  # zeros with g written into the narrowed window
            full = a.ctx.full_raw(a.shape, 0.0, "f32")
            ew.run(a.ctx, "copy", "f32", v.shape, (g,), out=full.narrow(ax, start, length))
            return full
        return Tensor._result(*agew.view("narrow", self, v, self.tags, grad_of))

    def permute(self, tags):
        """A view with the axes reordered to `tags` (shares storage)."""
        a = self._live("permute")
        tags = axes.check_tags(tags, a.rank, "permute")
        if set(tags) != set(self.tags):
            raise axes.TagError(f"permute: expected a reordering of {self.tags}, got {tags}")
        perm = [self.tags.index(t) for t in tags]
        inv = [tags.index(t) for t in self.tags]
        return Tensor._result(*agew.view("permute", self, a.permute(perm), tags,
                                         lambda g: g.permute(inv)))

    def contiguous(self):
        a = self._live("contiguous")
        return Tensor._result(*agew.view("contiguous", self, ew.materialize(a.ctx, a), self.tags,
                                         lambda g: g))


def _same_ctx(op: str, x: "Tensor", y) -> None:
    if not isinstance(y, Tensor):
        raise TypeError(f"{op}: expected a Tensor operand, got {type(y).__name__}")
    if y._live(op).ctx is not x._raw.ctx:
        raise ContextMismatch(f"{op}: operands belong to two different ExecContexts")


def einsum_many(out_tags, *operands) -> "Tensor":
    """A-6: `fu.einsum_many(("s", "o"), x, a, b)` — a left fold of binary einsums."""
    for t in operands:
        if not isinstance(t, Tensor):
            raise TypeError(f"einsum_many: expected Tensor operands, got {type(t).__name__}")
        _same_ctx("einsum_many", operands[0], t)
    return agmm.einsum_many(out_tags, operands)


def custom_vjp(spec, extra, inputs) -> "Tensor":
    """SPEC §3.21: a differentiable op from spec.forward / spec.backward."""
    for t in inputs:
        if not isinstance(t, Tensor):
            raise TypeError(f"custom_vjp: expected Tensor inputs, got {type(t).__name__}")
        _same_ctx("custom_vjp", inputs[0], t)
    return Tensor._result(*agcustom.custom_vjp(spec, extra, inputs))


def _real(op: str, s) -> float:
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"{op}: expected a real number, got {type(s).__name__}")
    return float(s)
