"""Mask and conditional emitters (SPEC §3.7). A bool operand is stored as one byte (0 or 1)
and read by truthiness; comparisons produce i1 values that the store widens to a byte."""
from __future__ import annotations

from . import irutil as u


def _truthy(b, c):
    """A condition operand as i1: nonzero bytes, or floats != 0 (NaN is truthy)."""
    if c.type == u.I8 or (hasattr(c.type, "element") and c.type.element == u.I8):
        return b.icmp_unsigned("!=", c, u.const(c.type, 0))
    return b.fcmp_unordered("!=", c, u.const(c.type, 0.0))


OPS = {
    # where(cond, x, y) = cond ? x : y
    "where": (3, lambda b, c, x, y: b.select(_truthy(b, c), x, y)),
}
