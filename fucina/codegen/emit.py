"""Small IR emitters shared by the elementwise op families (scalar or vector values alike)."""
from __future__ import annotations

from llvmlite import ir

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


def lane_tree(b, v, combine):
    """Fold a vector to a scalar by halves (low half op high half): one fixed tree, so every
    reduction that ends in it sums its lanes in the same order on every call."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, h), list(range(h))))
        hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(u.I32, h), list(range(h, n))))
        v, n = combine(b, lo, hi), h
    return b.extract_element(v, u.i64(0))


def fold(b, accs, combine):
    """Four accumulator slots to a scalar: (0 op 1) op (2 op 3), then the lane tree."""
    v = combine(b, combine(b, b.load(accs[0]), b.load(accs[1])),
                combine(b, b.load(accs[2]), b.load(accs[3])))
    return lane_tree(b, v, combine)
