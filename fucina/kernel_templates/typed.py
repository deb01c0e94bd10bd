"""Integer and bool arithmetic (SPEC R-10, R-11): the i64 formulas of the elementwise
generator's integer table, one template per op (language: codegen/lowering.py, integer lanes).

i64 arithmetic wraps (two's complement). LLVM's sdiv/srem are undefined for a zero divisor and
for minInt / -1, so the divisions divide by a guarded divisor and never trap on any data
(reporting a zero divisor is the host's job: codegen/typed.py's zero_scan kernel). A zero
divisor gives 0 here. The bit operations serve bool bytes (0/1) as well.
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS: dict = {}

BUILDING_BLOCKS = {
    # y with 0 and -1 replaced by 1: sdiv/srem by it is defined for every dividend
    "_safe_divisor": T("y", "1 if (y == 0) | (y == -1) else y"),
    # x / y rounded toward 0; x / -1 is the wrapping negation (minInt / -1 == minInt)
    "_trunc_quotient": T("x y", "-x if y == -1 else sdiv(x, _safe_divisor(y))"),
    # x − y·trunc(x / y), the sign of x; x % -1 == 0 (srem by the safe divisor 1)
    "_trunc_rem": T("x y", "srem(x, _safe_divisor(y))"),
    # r != 0 and sign(r) != sign(y): where a truncated result needs the floor correction
    "_signs_differ": T("r y", "(r != 0) & ((r ^ y) < 0)"),
}

KERNELS = {
    "copy": T("x", "x"),
    "neg": T("x", "-x"),                                   # 0 − x: −minInt == minInt
    "add": T("x y", "x + y"),
    "sub": T("x y", "x - y"),
    "mul": T("x y", "x * y"),
    "maximum": T("x y", "x if x > y else y"),
    "minimum": T("x y", "x if x < y else y"),
    # quotient rounded toward zero (C `/`, Zig @divTrunc)
    "div_trunc": T("x y", "0 if y == 0 else _trunc_quotient(x, y)"),
    # quotient rounded toward −inf (Python `//`, Zig @divFloor)
    "div_floor": T("x y", """
        q = _trunc_quotient(x, y)
        0 if y == 0 else q - zext(_signs_differ(_trunc_rem(x, y), y), q)"""),
    # remainder with the sign of the dividend (C `%`, torch.fmod); 0 where y == 0
    "rem": T("x y", "_trunc_rem(x, y)"),
    # remainder with the sign of the divisor (Python `%`, torch.remainder); 0 where y == 0
    "mod": T("x y", """
        r = _trunc_rem(x, y)
        r + y if _signs_differ(r, y) else r"""),
    "bit_and": T("x y", "x & y"),
    "bit_or": T("x y", "x | y"),
    "bit_xor": T("x y", "x ^ y"),
}

TEMPLATES = {**BUILDING_BLOCKS, **KERNELS}
