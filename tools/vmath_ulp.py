"""Measure the error of the vector math functions (fucina/codegen/vmath.py) in float32 ulps.

    python -m tools.vmath_ulp [--points N] [--only exp,log] [--exhaustive] [--write]

For each function one kernel `void k(const float* in, float* out, int64 n)` is built (host
vector width plus a scalar tail) and run over: uniformly random float32 bit patterns restricted
to finite values of the function's domain, a dense linear sweep of its core range and every
special value. The error of each result is |y - f(x)| / ulp(f(x)), f evaluated in float64 with
numpy (erf with the series below), ulp(v) = 2^(floor(log2|v|) - 23) (2^-149 for denormals).
A result equal to the float32 rounding of f(x) (including +-inf, +-0) or a NaN where f(x) is NaN
counts as 0; a NaN where f(x) is not (or the reverse) counts as inf.

--exhaustive replaces the random and sweep sets by every float32 of the domain (minutes per
function). --write puts the rows into docs/vmath.md (the sampled or the exhaustive table,
between its markers; rows of functions not measured in this run are kept).
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from pathlib import Path

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
FLT_MIN = float(np.finfo(np.float32).tiny)
DENORM_MIN = 2.0 ** -149
SIN_COS_LIMIT = 2.0 ** 20   # |x| below which sin/cos stay within the bound (docs/vmath.md)

# ---------------------------------------------------------------------------------------------
# float64 references


def erf64(x) -> np.ndarray:
    """erf in float64 to ~1e-15 relative: erf x = 2/sqrt(pi) e^(-x^2) sum_n x (2x^2)^n/(2n+1)!!
    (all terms positive, no cancellation) for |x| < 6; +-1 beyond (erfc 6 = 2e-17)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    out = np.ones_like(a)
    for lo, hi, terms in ((0.0, 1.0, 40), (1.0, 2.5, 90), (2.5, 6.0, 160)):
        m = (a >= lo) & (a < hi)
        if not m.any():
            continue
        v = a[m]
        t2 = 2.0 * v * v
        term = v.copy()
        s = v.copy()
        for n in range(1, terms):
            term *= t2 / (2 * n + 1)
            s += term
        out[m] = (2.0 / math.sqrt(math.pi)) * np.exp(-v * v) * s
    out = np.copysign(out, x)
    out[np.isnan(x)] = np.nan
    return out


def sigmoid64(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


REFERENCE = {
    "exp": np.exp, "expm1": np.expm1, "log": np.log, "log1p": np.log1p, "tanh": np.tanh,
    "sigmoid": sigmoid64, "erf": erf64, "sin": np.sin, "cos": np.cos,
}

# random bit patterns are drawn from [lo, hi] (the whole range where the function is not a
# constant or trivially x); the sweep covers the core range densely
DOMAIN = {
    "exp": (-110.0, 95.0), "expm1": (-20.0, 95.0), "log": (0.0, FLT_MAX),
    "log1p": (-1.0, FLT_MAX), "tanh": (-12.0, 12.0), "sigmoid": (-110.0, 110.0),
    "erf": (-6.0, 6.0), "sin": (-SIN_COS_LIMIT, SIN_COS_LIMIT),
    "cos": (-SIN_COS_LIMIT, SIN_COS_LIMIT),
}
SWEEP = {
    "exp": (-20.0, 20.0), "expm1": (-3.0, 3.0), "log": (0.25, 4.0), "log1p": (-0.9, 3.0),
    "tanh": (-5.0, 5.0), "sigmoid": (-20.0, 20.0), "erf": (-4.5, 4.5), "sin": (-100.0, 100.0),
    "cos": (-100.0, 100.0),
}
DOMAIN_TEXT = {
    "exp": "all x (denormal results rounded, not flushed)",
    "expm1": "all x",
    "log": "all x > 0, denormals included",
    "log1p": "all x > -1",
    "tanh": "all x",
    "sigmoid": "all x (denormal results for x < -87.3)",
    "erf": "all x",
    "sin": "abs(x) <= 2^20; beyond: finite, in [-1, 1], not accurate",
    "cos": "abs(x) <= 2^20; beyond: finite, in [-1, 1], not accurate",
}


def _f32s(values) -> np.ndarray:
    return np.array(values, dtype=np.float64).astype(np.float32)


def special_values(name: str) -> np.ndarray:
    """Signed zeros, infinities, NaNs, extremes, and each function's thresholds +- 1 ulp."""
    base = [0.0, -0.0, np.inf, -np.inf, np.nan, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN,
            DENORM_MIN, -DENORM_MIN, 2.0 ** -126 - 2.0 ** -149, 1e-30, -1e-30, 2.0 ** -25,
            -2.0 ** -25, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1e10, -1e10, 3e38, -3e38]
    edges = {
        "exp": [88.72283935546875, 88.72284, 88.7229, 89.0, 100.0, -87.33654, -87.3366,
                -103.27893, -103.972, -103.9721, -104.0, -110.0, 1e-8, -1e-8],
        "expm1": [88.72283935546875, 88.7229, -17.0, -17.33, -17.34, -18.0, -20.0, 1e-8, -1e-8,
                  -0.34657359, 0.34657359],
        "log": [np.nextafter(np.float32(1), np.float32(0)),
                np.nextafter(np.float32(1), np.float32(2)),
                0.70710677, 1.4142135, 1e-40, 1e-45, 2.0 ** -127, 2.0 ** -140],
        "log1p": [-1.0, np.nextafter(np.float32(-1), np.float32(0)),
                  np.nextafter(np.float32(-1), np.float32(-2)), -2.0, -0.29289323, 0.41421354,
                  1e-8, -1e-8, 2.0 ** 24, 2.0 ** 24 + 2, 2.0 ** 126, 2.0 ** 127],
        "tanh": [0.625, np.nextafter(np.float32(0.625), np.float32(0)), 9.0, 9.5, 10.0, 1e-8, -1e-8,
                 -9.5, -20.0],
        "sigmoid": [-87.0, -88.0, -88.8, -100.0, -103.9, -104.0, -110.0, 20.0, 100.0, 17.0],
        "erf": [0.875, np.nextafter(np.float32(0.875), np.float32(0)), 3.9, 3.92, 4.0, -4.0, 10.0,
                -10.0, 1e-8, -1e-8],
        "sin": [np.pi, -np.pi, np.pi / 2, np.pi / 4, 505.79642, 1e5, -1e5, SIN_COS_LIMIT * 0.999,
                1e-8, -1e-8],
        "cos": [np.pi, -np.pi, np.pi / 2, np.pi / 4, 505.79642, 1e5, -1e5, SIN_COS_LIMIT * 0.999],
    }[name]
    v = _f32s(base + edges)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC12345], dtype=np.uint32)
    nans = nans.view(np.float32)
    return np.concatenate([v, nans])


# ---------------------------------------------------------------------------------------------
# error measure


def ulp_error(y32, ref64) -> np.ndarray:
    """Error of float32 results y32 against float64 references, in ulps of the result."""
    y = np.asarray(y32, dtype=np.float32).astype(np.float64)
    ref = np.asarray(ref64, dtype=np.float64)
    with np.errstate(all="ignore"):
        r32 = ref.astype(np.float32).astype(np.float64)
        _, e = np.frexp(ref)
        ulp = np.ldexp(1.0, np.maximum(e - 24, -149))
        err = np.abs(y - ref) / ulp
    exact = (y == r32) | (np.isnan(y) & np.isnan(ref))
    err = np.where(exact, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


# ---------------------------------------------------------------------------------------------
# kernels


def build(name: str, prefix: str = "vmath_ulp"):
    """Compile and load the kernel for vmath function `name`; returns f(x32) -> y32."""
    from fucina.codegen import jit, vmath
    from fucina.codegen.target import host

    symbol = f"{prefix}_{name}"
    text = vmath.unary_kernel_ir(vmath.FUNCTIONS[name], symbol, host().f32_lanes)
    addr = jit.loader().load_object(jit.compile_object(text), [symbol])[symbol]
    cfn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(addr)

    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty_like(x)
        cfn(x.ctypes.data, y.ctypes.data, x.size)
        return y

    run.keepalive = cfn
    return run


def random_in(rng, lo: float, hi: float, n: int) -> np.ndarray:
    """n uniformly random float32 bit patterns that are finite and within [lo, hi]."""
    out, have = [], 0
    while have < n:
        x = rng.integers(0, 2 ** 32, size=2 * (n - have) + 1024, dtype=np.uint64)
        x = x.astype(np.uint32).view(np.float32)
        x = x[np.isfinite(x) & (x >= lo) & (x <= hi)]
        out.append(x)
        have += x.size
    return np.concatenate(out)[:n]


def _bit_ranges(lo: float, hi: float):
    """The [start, stop) uint32 bit ranges covering every float32 in [lo, hi]."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    ranges = []
    if hi32 >= 0:   # non-negative part, bits increase with value
        a = np.float32(max(lo32, 0.0)).view(np.uint32)
        ranges.append((int(a), int(hi32.view(np.uint32)) + 1))
    if lo32 < 0:    # negative part (-0 upward in magnitude)
        a = np.float32(-0.0).view(np.uint32) if hi32 >= 0 else (-hi32).view(np.uint32) | 0x80000000
        ranges.append((int(a), int(lo32.view(np.uint32)) + 1))
    return ranges


class Worst:
    """Running maximum of the error and where it happens."""

    def __init__(self):
        self.err, self.x, self.n, self.over2 = -1.0, None, 0, 0

    def update(self, x, err):
        self.n += x.size
        self.over2 += int((err > 2.0).sum())
        i = int(np.argmax(err))
        if err[i] > self.err:
            self.err, self.x = float(err[i]), x[i]


def measure(name: str, points: int, rng, exhaustive: bool = False, run=None) -> dict:
    run = run or build(name)
    ref = REFERENCE[name]
    w = Worst()

    def check(x):
        with np.errstate(all="ignore"):
            w.update(x, ulp_error(run(x), ref(x.astype(np.float64))))

    if exhaustive:
        for start, stop in _bit_ranges(*DOMAIN[name]):
            for s in range(start, stop, 1 << 24):
                check(np.arange(s, min(s + (1 << 24), stop), dtype=np.uint32).view(np.float32))
    else:
        n_rand = points * 6 // 10
        check(random_in(rng, *DOMAIN[name], n_rand))
        check(np.linspace(*SWEEP[name], points - n_rand, dtype=np.float64).astype(np.float32))
    sp = special_values(name)
    if name in ("sin", "cos"):
        sp = sp[~(np.abs(sp) >= SIN_COS_LIMIT) | ~np.isfinite(sp)]   # beyond: checked below
    check(sp)
    result = {"name": name, "max_ulp": w.err, "at": w.x, "points": w.n, "over2": w.over2,
              "domain": DOMAIN_TEXT[name]}
    if name in ("sin", "cos"):   # beyond the accurate range: finite and within [-1, 1]
        big = np.concatenate([random_in(rng, SIN_COS_LIMIT, FLT_MAX, 10 ** 5),
                              -random_in(rng, SIN_COS_LIMIT, FLT_MAX, 10 ** 5),
                              _f32s([SIN_COS_LIMIT, 1e10, -1e10, 3e38, FLT_MAX, -FLT_MAX])])
        y = run(big)
        result["beyond_ok"] = bool(np.all(np.isfinite(y) & (np.abs(y) <= 1.0)))
    return result


# ---------------------------------------------------------------------------------------------
# report

def _markers(exhaustive: bool):
    kind = "exhaustive" if exhaustive else "sampled"
    return f"<!-- vmath_ulp {kind} table: start -->", f"<!-- vmath_ulp {kind} table: end -->"


def table_rows(results) -> list[str]:
    rows = []
    for r in results:
        at = "" if r["at"] is None else f"{float(r['at']):.9g}"
        dom = r["domain"]
        if "beyond_ok" in r and not r["beyond_ok"]:
            dom += " (**beyond-range check failed**)"
        rows.append(f"| {r['name']} | {r['max_ulp']:.3f} | {at} | {r['points']:,} | "
                    f"{r['over2']} | {dom} |")
    return rows


def table(rows: list[str], exhaustive: bool) -> str:
    how = "every float32 of the domain + specials" if exhaustive else \
        "random bit patterns (60 %) + linear sweep (40 %) + specials"
    order = {n: i for i, n in enumerate(REFERENCE)}
    rows = sorted(rows, key=lambda r: order.get(r.split("|")[1].strip(), 99))
    return "\n".join([f"Points: {how}. Host: {_host_text()}.", "",
                      "| function | max ulp | at x | points | > 2 ulp | domain |",
                      "|---|---|---|---|---|---|", *rows]) + "\n"


def _host_text() -> str:
    from fucina.codegen.target import host

    h = host()
    return f"{h.cpu}, {h.f32_lanes} float32 lanes"


def write_docs(results, exhaustive: bool, path: Path) -> None:
    """Put the rows into the doc's table for this mode, replacing rows of the same functions
    and keeping the others (so functions can be measured in separate runs)."""
    start, end = _markers(exhaustive)
    doc = path.read_text() if path.exists() else "# Vector math error table\n"
    new = table_rows(results)
    names = {r["name"] for r in results}
    if start in doc and end in doc:
        old = doc[doc.index(start) + len(start):doc.index(end)]
        kept = [ln for ln in old.splitlines()
                if ln.startswith("| ") and not ln.startswith("| function")
                and ln.split("|")[1].strip() not in names]
        block = f"{start}\n{table(kept + new, exhaustive)}{end}"
        doc = doc[:doc.index(start)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + f"\n\n{start}\n{table(new, exhaustive)}{end}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=10 ** 7, help="points per function (default 1e7)")
    ap.add_argument("--only", default="", help="comma-separated function names")
    ap.add_argument("--exhaustive", action="store_true", help="every float32 of each domain")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--write", action="store_true", help="write the table into docs/vmath.md")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(REFERENCE)
    rng = np.random.default_rng(args.seed)
    results = []
    for name in names:
        t0 = time.perf_counter()
        r = measure(name, args.points, rng, args.exhaustive)
        results.append(r)
        print(f"{name:8s} max {r['max_ulp']:.3f} ulp at x={float(r['at']):.9g}  "
              f"points {r['points']:,}  >2ulp {r['over2']}  ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    print(table(table_rows(results), args.exhaustive))
    if args.write:
        doc = Path(__file__).resolve().parent.parent / "docs" / "vmath.md"
        write_docs(results, args.exhaustive, doc)
    return 0 if all(r["max_ulp"] <= 2.0 and r.get("beyond_ok", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
