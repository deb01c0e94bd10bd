"""Integer and bool emitters (SPEC R-11): i64 arithmetic wraps (two's complement), there is
no plain division, and bool bytes are 0 or 1."""
from __future__ import annotations

OPS = {
    "copy": (1, lambda b, x: x),
    "neg": (1, lambda b, x: b.neg(x)),
    "add": (2, lambda b, x, y: b.add(x, y)),
    "sub": (2, lambda b, x, y: b.sub(x, y)),
    "mul": (2, lambda b, x, y: b.mul(x, y)),
    "maximum": (2, lambda b, x, y: b.select(b.icmp_signed(">", x, y), x, y)),
    "minimum": (2, lambda b, x, y: b.select(b.icmp_signed("<", x, y), x, y)),
}
