"""Small IR emitters shared by the elementwise op families (scalar or vector values alike)."""
from __future__ import annotations

from . import irutil as u


def nan_max(b, x, y):
    """NaN-propagating maximum: a NaN in either operand wins (not IEEE maxNum)."""
    pick = b.select(b.fcmp_unordered("uno", x, x), x, b.select(b.fcmp_ordered(">=", x, y), x, y))
    return b.select(b.fcmp_unordered("uno", y, y), y, pick)


def nan_min(b, x, y):
    pick = b.select(b.fcmp_unordered("uno", x, x), x, b.select(b.fcmp_ordered("<=", x, y), x, y))
    return b.select(b.fcmp_unordered("uno", y, y), y, pick)


def relu(b, x):
    """x > 0 ? x : 0 — NaN maps to 0 (SPEC §3.3)."""
    return b.select(b.fcmp_ordered(">", x, u.const(x.type, 0.0)), x, u.const(x.type, 0.0))


def vm(name):
    """A vector-math function, imported when a kernel is built (not when keys are made)."""
    def emit(b, x):
        from . import vmath

        return getattr(vmath, name)(b, x)
    return emit


def sqrt(b, x):
    return u.intrinsic(b, "llvm.sqrt", x.type, [x])
