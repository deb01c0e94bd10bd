"""The public Tensor: a RawTensor, its tags, and (when it takes part in a graph) a grad node.

Every op validates tags first (TagError), then sizes (ShapeMismatch), then runs one generated
kernel through the exec layer and ends in the engine's finish_op tail. Results are new tensors;
operands are borrowed. Inside an exec scope, op results are scope-owned borrows (SPEC R-5).
"""
from __future__ import annotations

import numpy as np

from ..errors import ContextClosed, InvalidShape, MutableDataRequiresNoGrad, UseAfterRelease
from ..exec import elementwise as ew
from . import custom as agcustom
from . import engine
from . import matmul as agmm
from .activations import ActivationMethods
from .attention import AttentionMethods
from .conv import ConvMethods
from .checks import same_ctx
from .elemental import ElementalMethods
from .elementwise import ElementwiseMethods
from .gather_scatter import GatherScatterMethods
from .inplace import InplaceMethods
from .loss import LossMethods
from .masks import MaskMethods
from .matmul import MatmulMethods
from .norm import NormMethods
from .quant import QuantMethods
from .reduce import ReduceMethods
from .rng import RngMethods
from .rope import RopeMethods
from .selection import SelectionMethods
from .shape import ShapeMethods
from .softmax import SoftmaxMethods
from .typed import TypedMethods


class Tensor(ElementwiseMethods, ActivationMethods, ReduceMethods, MatmulMethods, LossMethods,
             ShapeMethods, MaskMethods, ElementalMethods, InplaceMethods, TypedMethods, RngMethods,
             SoftmaxMethods, NormMethods, RopeMethods, AttentionMethods, ConvMethods,
             SelectionMethods, QuantMethods, GatherScatterMethods):
    """A tensor whose axes have names. Create one through an ExecContext.

    The core (data access, ownership, autograd) is here; each op family's methods live in
    that family's module (ag/elementwise.py, ag/reduce.py, ...) as a mixin."""

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
        if ctx.adopting and (node is not None or raw.dtype == "f32"):
            t._scope = ctx.scopes[-1]
            ctx.adopt(t)
        return t

    def _to_scope(self) -> "Tensor":
        """Hand a result made inside a graph scope (ExecContext.open_graph_scope) to the exec
        scope now innermost, as if the op had run there; self."""
        raw = self._raw
        ctx = raw.ctx
        if self._scope is None and ctx.adopting and (self._node is not None or raw.dtype == "f32"):
            self._scope = ctx.scopes[-1]
            ctx.adopt(self)
        return self

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


def einsum_many(out_tags, *operands) -> "Tensor":
    """A-6: `fu.einsum_many(("s", "o"), x, a, b)` — a left fold of binary einsums."""
    for t in operands:
        same_ctx("einsum_many", operands[0], t)
    return agmm.einsum_many(out_tags, operands)


def custom_vjp(spec, extra, inputs) -> "Tensor":
    """SPEC §3.21: a differentiable op from spec.forward / spec.backward."""
    for t in inputs:
        same_ctx("custom_vjp", inputs[0], t)
    return Tensor._result(*agcustom.custom_vjp(spec, extra, inputs))
