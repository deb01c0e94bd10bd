"""Elemental (user scalar) ops, SPEC §3.5: `x.elemental_unary(op, extra)` and
`x.elemental_binary(y, op, extra)`.

The op's scalar methods are traced (codegen/elemental.py) into expressions that become
elementwise kernels named "elemental:<expression>": the forward when the op runs, each needed
backward when the graph node is made (so the node holds the expressions and extra's numbers by
value). A method that cannot be traced is evaluated with numpy instead — its `*_vec` twin if
the op has one, else numpy.vectorize of the scalar method, in float32 — with an
ElementalFallbackWarning once per op and method per process; the numpy result is copied into a
pooled tensor (the one documented place where numpy computes op values).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import functools
import os
import sys
import types
import warnings

import numpy as np

from ..codegen import elemental as tr
from ..elemental import ElementalFallbackWarning
from ..errors import DTypeError, InvalidArgumentType, ShapeMismatch
from ..exec import elementwise as ew
from .elementwise import aligned, unbroadcast
from .checks import same_ctx
from .engine import finish_op


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fucina/
_warned: set = set()



if TYPE_CHECKING:
    from .tensor import Tensor

def op_name(op) -> str:
    """The op's name for messages and the once-per-op warning: its class (or module) name."""
    if isinstance(op, type):
        return f"{op.__module__}.{op.__qualname__}"
    if isinstance(op, types.ModuleType):
        return op.__name__
    return f"{type(op).__module__}.{type(op).__qualname__}"


def _require(op, entry: str, methods) -> None:
    for m in methods:
        if not callable(getattr(op, m, None)):
            raise InvalidArgumentType(f"{entry}: op {op_name(op)} must define {m}(); it does not")


def _warn(op, method: str, reason: str) -> None:
    key = (op_name(op), method)
    if key in _warned:
        return
    warnings.warn(f"elemental op {key[0]}.{method} could not be traced into a kernel ({reason}); "
                  f"evaluating it with numpy instead (slow)", ElementalFallbackWarning,
                  stacklevel=_caller_level())
    _warned.add(key)   # only once it was shown (a warnings filter "error" raises every time)


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first frame outside the fucina package (the user's
    line that ran the op; skip_file_prefixes needs Python 3.12)."""
    f, level = sys._getframe(2), 2
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f, level = f.f_back, level + 1
    return level


class _Kernel:
    """One traced method: the elementwise op name, which tensor arguments it reads, and the
    parameter values (extra's numbers, by value)."""

    __slots__ = ("op", "inputs", "params")

    def __init__(self, traced: tr.Traced, params):
        self.op, self.inputs, self.params = traced.op, traced.inputs, params

    def run(self, ctx, shape, operands):
        return ew.run(ctx, self.op, "f32", shape,
                      [operands[i] for i in self.inputs] + list(self.params))


class _Numpy:
    """The fallback for one method: numpy on float32 arrays."""

    __slots__ = ("fn", "vec", "extra", "label")

    def __init__(self, op, method, extra):
        self.fn = getattr(op, method)
        self.vec = getattr(op, method + "_vec", None)
        if not callable(self.vec):
            self.vec = None
        self.extra = tr.float32_extra(extra)   # floats as float32 (the kernels' view of them)
        self.label = f"{op_name(op)}.{method}"

    def run(self, ctx, shape, operands):
        arrays = [r.to_numpy() for r in operands]
        extra = self.extra
        with np.errstate(all="ignore"):
            if self.vec is not None:
                y = self.vec(*arrays, extra)
                where = self.label + "_vec"
            else:
                fn = self.fn
                y = np.vectorize(lambda *v: fn(*map(np.float32, v), extra),
                                 otypes=[np.float32])(*arrays)
                where = self.label
        try:
            y = np.broadcast_to(np.asarray(y, dtype=np.float32), shape)
        except ValueError:
            raise ShapeMismatch(f"{where}: expected a result of shape {tuple(shape)}, got "
                                f"{np.shape(y)}") from None
        return ctx.from_numpy(np.ascontiguousarray(y), shape, "f32", where)


def _compile(op, method: str, n_args: int, extra):
    """A _Kernel for op.method traced with n_args tensor arguments, or the numpy fallback."""
    fn = getattr(op, method)
    label = f"{op_name(op)}.{method}"
    try:
        traced, params = tr.trace(fn, n_args, extra, label)
    except tr.BadReturn:
        raise
    except Exception as e:   # TraceError, or an operation traced values do not support
        reason = str(e) if isinstance(e, tr.TraceError) else f"{type(e).__name__}: {e}"
        _warn(op, method, reason)
        return _Numpy(op, method, extra)
    return _Kernel(traced, params)


def _check_f32(entry, name, t):
    r = t._live(entry)
    if r.dtype != "f32":
        raise DTypeError(f"{entry}: expected an f32 tensor for {name}, got {r.dtype}")
    return r


def elemental_unary(x, op, extra=None):
    """y = op.forward(x, extra) elementwise; dL/dx = op.backward(x, y, gy, extra)."""
    entry = "elemental_unary"
    _require(op, entry, ("forward", "backward"))
    r = _check_f32(entry, "x", x)
    ctx = r.ctx
    out = _compile(op, "forward", 1, extra).run(ctx, r.shape, (r,))

    def make_vjp(needs):
        k = _compile(op, "backward", 3, extra)
        return functools.partial(_unary_grad, k, ctx, r, out)

    return finish_op(f"{entry}({op_name(op)})", out, x.tags, (x,), make_vjp)


def _unary_grad(k, ctx, r, out, g):
    return (k.run(ctx, r.shape, (r, out, g)),)


def elemental_binary(x, y, op, extra=None):
    """out = op.forward(a, b, extra) at the A-2 broadcast shape; dL/da = op.backward_a(a, b,
    out, gy, extra), dL/db = op.backward_b(...), each sum-reduced to its operand's shape."""
    entry = "elemental_binary"
    _require(op, entry, ("forward", "backward_a", "backward_b"))
    _check_f32(entry, "self", x)
    _check_f32(entry, "other", y)
    tags, shape, va, vb = aligned(entry, x, y)
    ctx = va.ctx
    out = _compile(op, "forward", 2, extra).run(ctx, shape, (va, vb))

    def make_vjp(needs):
        ka = _compile(op, "backward_a", 4, extra) if needs[0] else None
        kb = _compile(op, "backward_b", 4, extra) if needs[1] else None
        saved = (ctx, tags, shape, va, vb, out, x.tags, x._raw.shape, y.tags, y._raw.shape)
        return functools.partial(_binary_grads, ka, kb, saved)

    return finish_op(f"{entry}({op_name(op)})", out, tags, (x, y), make_vjp)


def _binary_grads(ka, kb, saved, g):
    ctx, tags, shape, va, vb, out, xt, xs, yt, ys = saved
    operands = (va, vb, out, g)
    ga = None if ka is None else unbroadcast(ctx, ka.run(ctx, shape, operands), tags, xt, xs)
    gb = None if kb is None else unbroadcast(ctx, kb.run(ctx, shape, operands), tags, yt, ys)
    return ga, gb


class ElementalMethods:
    """Tensor methods for user scalar ops (SPEC §3.5)."""

    __slots__ = ()

    # ---- user scalar ops (SPEC §3.5) ----
    def elemental_unary(self, op, extra=None):
        """op.forward(x, extra) and op.backward(x, y, gy, extra) -> dL/dx, traced into kernels."""
        self._live("elemental_unary")
        return self._result(*elemental_unary(self, op, extra))

    def elemental_binary(self, other: "Tensor", op, extra=None):
        """op.forward(a, b, extra), op.backward_a / backward_b(a, b, y, gy, extra); A-2 broadcast."""
        self._live("elemental_binary")
        same_ctx("elemental_binary", self, other)
        return self._result(*elemental_binary(self, other, op, extra))
