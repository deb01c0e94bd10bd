"""The math namespace of user scalar ops (SPEC §3.5): write `forward`/`backward` with these.

    import fucina.elemental as E

    class Softplus:
        def forward(self, x, extra):
            return E.where(x > 0, x + E.log1p(E.exp(-x)), E.log1p(E.exp(x)))
        def backward(self, x, y, gy, extra):
            return gy * E.sigmoid(x)

    y = t.elemental_unary(Softplus())

Called by `elemental_unary` / `elemental_binary`, the functions receive traced values: each
operation is recorded and the whole function becomes one generated kernel (forward) and one
per gradient (backward). Called with numbers (Python floats, numpy float32 scalars or float32
arrays), they compute in float32 with numpy, so the same function can be called by hand.
The traced kernel and the number path agree exactly for + - * / sqrt abs where maximum
minimum and comparisons; exp/log/tanh/sigmoid/expm1/log1p/erf/sin/cos use the kernels'
vector-math library, within its documented ulp bound of numpy's float32 result.

Rules of tracing:
  * no Python control flow on data (`if x > 0`, `and`/`or`, `min(x, y)`, `math.exp(x)`): use
    `where`, `maximum`, `minimum` and the functions here (a TraceError is raised while
    tracing, and the op falls back to numpy with an ElementalFallbackWarning);
  * comparisons give booleans usable in `where`, `&`, `|`, `~` and as 1.0/0.0 in arithmetic;
  * `extra`: a number or a (nested) tuple/list of numbers is passed to the kernel by value, so
    a new value runs the same kernel; float values are rounded to float32. Control flow on
    extra alone (`if extra > 0`) works but bakes the values in (one kernel per value).
    Anything else in extra that the function reads makes the trace fail (numpy fallback).
"""
from __future__ import annotations

import math

import numpy as np

from .codegen import elemental as _tr
from .codegen.elemental import Sym, TraceError

__all__ = ["exp", "log", "log1p", "expm1", "tanh", "sigmoid", "erf", "sin", "cos", "sqrt", "abs",
           "where", "maximum", "minimum", "pow", "TraceError", "ElementalFallbackWarning"]


class ElementalFallbackWarning(UserWarning):
    """An elemental op could not be traced into a kernel and is evaluated with numpy instead
    (its `*_vec` twin if defined, else numpy.vectorize of the scalar function). Emitted once
    per op and method per process."""


def _f32(x):
    """x as float32: an ndarray becomes a float32 array, anything else a numpy.float32."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32, copy=False)
    return np.float32(x)


def _unary(op: str, np_fn):
    def fn(x):
        if isinstance(x, Sym):
            return _tr.apply(op, x)
        with np.errstate(all="ignore"):
            return np_fn(_f32(x))
    return fn


def _binary(op: str, np_fn):
    def fn(a, b):
        if isinstance(a, Sym) or isinstance(b, Sym):
            return _tr.apply(op, a, b)
        with np.errstate(all="ignore"):
            return np_fn(_f32(a), _f32(b))
    return fn


def _sigmoid(x):
    """The stable form the kernels use: z = e^-|x|; x >= 0: 1/(1+z), else z/(1+z)."""
    one = np.float32(1)
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, one / (one + z), z / (one + z)).astype(np.float32)[()]


def _erf(x):
    v = np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, np.float64))
    return v.astype(np.float32)[()]


def _pow(a, b):
    """float32 pow (C99 / Zig domain), computed in float64 and rounded once."""
    return np.power(np.asarray(a, np.float64), np.asarray(b, np.float64)).astype(np.float32)[()]


exp = _unary("exp", np.exp)
log = _unary("log", np.log)
log1p = _unary("log1p", np.log1p)
expm1 = _unary("expm1", np.expm1)
tanh = _unary("tanh", np.tanh)
sigmoid = _unary("sigmoid", _sigmoid)
erf = _unary("erf", _erf)
sin = _unary("sin", np.sin)
cos = _unary("cos", np.cos)
sqrt = _unary("sqrt", np.sqrt)
abs = _unary("abs", np.abs)  # noqa: A001  (the namespace mirrors math/numpy names)
maximum = _binary("max", np.maximum)   # NaN-propagating (a NaN in either operand wins)
minimum = _binary("min", np.minimum)
pow = _binary("pow", _pow)  # noqa: A001

for _name, _doc in [("exp", "e^x"), ("log", "ln x"), ("log1p", "ln(1 + x), accurate near 0"),
                    ("expm1", "e^x - 1, accurate near 0"), ("tanh", "tanh x"),
                    ("sigmoid", "1 / (1 + e^-x), in the stable form"), ("erf", "erf x"),
                    ("sin", "sin x"), ("cos", "cos x"), ("sqrt", "the square root (exact)"),
                    ("abs", "|x|"), ("maximum", "NaN-propagating max(a, b)"),
                    ("minimum", "NaN-propagating min(a, b)"),
                    ("pow", "a^b (negative base with a non-integer exponent -> NaN; 0^0 = 1)")]:
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name
    globals()[_name].__doc__ = _doc + " (float32; traced inside elemental ops)."


def where(cond, a, b):
    """cond ? a : b, elementwise. cond is a comparison of traced values (or a bool, or a
    number tested != 0); a and b numbers or traced values."""
    if isinstance(cond, Sym) or isinstance(a, Sym) or isinstance(b, Sym):
        return _tr.where(cond, a, b)
    if isinstance(cond, np.ndarray) or isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.where(cond, _f32(a), _f32(b)).astype(np.float32)
    return _f32(a) if cond else _f32(b)
