"""Masks and conditionals (SPEC §3.7): where, the logical ops and the compares, one template
per kernel (language: codegen/lowering.py). The one table serves every domain of the
elementwise generator — f32 (16-bit floats arrive widened), i64 and bool bytes — because the
lowering picks the instruction by the lane type:

  truthiness   `x != 0`: an integer or bool byte is true iff nonzero; a float iff != 0, NaN
               included (an unordered compare); falsiness `x == 0` (ordered: NaN is not)
  compare      floats: IEEE ordered predicates (NaN compares false), `!=` unordered (NaN
               compares true); integers and bool bytes: signed, exact

isinf and isfinite are codegen/masks.py's (a float test, constant on integer lanes).
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS: dict = {}

BUILDING_BLOCKS = {
    "_truthy": T("x", "x != 0"),                   # also any/all's (codegen/masks.py)
}

KERNELS = {
    # where(cond, x, y) = cond ? x : y   (masked_fill(mask, v) is where(mask, v, self))
    "where": T("c x y", "x if _truthy(c) else y"),
    "logical_not": T("x", "x == 0"),
    "logical_and": T("x y", "_truthy(x) & _truthy(y)"),
    "logical_or": T("x y", "_truthy(x) | _truthy(y)"),
    "logical_xor": T("x y", "_truthy(x) ^ _truthy(y)"),
    "isnan": T("x", "x != x"),                    # false on integer lanes
    "cmp_eq": T("x y", "x == y"),
    "cmp_ne": T("x y", "x != y"),
    "cmp_lt": T("x y", "x < y"),
    "cmp_le": T("x y", "x <= y"),
    "cmp_gt": T("x y", "x > y"),
    "cmp_ge": T("x y", "x >= y"),
}

TEMPLATES = {**BUILDING_BLOCKS, **KERNELS}
