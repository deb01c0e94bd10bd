"""fucina/codegen/vmath.py: error bound, special values, scalar tail == vector lane, no calls.

One kernel per function `void k(const float* in, float* out, int64 n)` (host lanes + scalar
tail), compiled once per module. The full 10^7-point / exhaustive measurement is
`python -m tools.vmath_ulp` (docs/vmath.md); here ~10^6 points per function.
"""
from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir

from conftest import assert_bitwise
from fucina.codegen import jit, vmath
from fucina.codegen.target import host

try:
    from tools import vmath_ulp as U
except ImportError:  # pytest started without the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools import vmath_ulp as U

NAMES = list(vmath.FUNCTIONS)
BOUND = 2.0          # ulp, every function (docs/vmath.md; sin/cos for |x| < 2^20)
W = host().f32_lanes
INF, NAN = float("inf"), float("nan")
FLT_MAX = U.FLT_MAX
DEN = U.DENORM_MIN


class Kernel:
    def __init__(self, name: str, lanes: int, prefix: str):
        symbol = f"{prefix}_{name}_w{lanes}"
        text = vmath.unary_kernel_ir(vmath.FUNCTIONS[name], symbol, lanes)
        self.ir = text
        addr = jit.loader().load_object(jit.compile_object(text), [symbol])[symbol]
        self.cfn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(addr)

    def __call__(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.full_like(x, np.nan)
        self.cfn(x.ctypes.data, y.ctypes.data, x.size)
        return y

    def in_pieces(self, x, piece: int):
        """The kernel called on consecutive pieces of x (n = piece < W: scalar tail only)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.full_like(x, np.nan)
        xp, yp = x.ctypes.data, y.ctypes.data
        for i in range(0, x.size, piece):
            self.cfn(xp + 4 * i, yp + 4 * i, min(piece, x.size - i))
        return y


@pytest.fixture(scope="module")
def kernels():
    return {name: Kernel(name, W, "test_vmath") for name in NAMES}


def _inputs(name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n_rand = n * 6 // 10
    return np.concatenate([U.random_in(rng, *U.DOMAIN[name], n_rand),
                           np.linspace(*U.SWEEP[name], n - n_rand).astype(np.float32)])


@pytest.mark.parametrize("name", NAMES)
def test_error_bound(kernels, name):
    x = np.concatenate([_inputs(name, 10 ** 6, 1234 + NAMES.index(name)), U.special_values(name)])
    if name in ("sin", "cos"):
        x = x[~(np.abs(x) >= U.SIN_COS_LIMIT)]          # keeps NaN and is checked below
    y = kernels[name](x)
    with np.errstate(all="ignore"):
        err = U.ulp_error(y, U.REFERENCE[name](x.astype(np.float64)))
    i = int(np.argmax(err))
    assert err[i] <= BOUND, f"{name}({x[i]!r}) = {y[i]!r}: {err[i]:.3f} ulp"


def _f(v) -> np.float32:
    return np.float32(v)


DEN_X = [DEN, -DEN, 3 * DEN, -7 * DEN, 2.0 ** -130, -(2.0 ** -127)]

# (input, exact expected float32 result); signed zeros are compared by bits
SPECIAL = {
    "exp": [(-INF, 0.0), (INF, INF), (0.0, 1.0), (-0.0, 1.0), (89.0, INF), (88.7229, INF),
            (FLT_MAX, INF), (-FLT_MAX, 0.0), (-104.0, 0.0), (-110.0, 0.0), (DEN, 1.0),
            (-DEN, 1.0), (1e-30, 1.0), (1.0, float(_f(np.e))),
            (-103.97, DEN), (-87.33655, float(_f(np.exp(np.float64(_f(-87.33655))))))],
    "expm1": [(-INF, -1.0), (INF, INF), (0.0, 0.0), (-0.0, -0.0), (89.0, INF), (FLT_MAX, INF),
              (-20.0, -1.0), (-FLT_MAX, -1.0), (1e-30, 1e-30), (-1e-30, -1e-30)]
             + [(v, v) for v in DEN_X],
    "log": [(0.0, -INF), (-0.0, -INF), (-DEN, NAN), (-1.0, NAN), (-INF, NAN), (INF, INF),
            (1.0, 0.0), (2.0 ** -149, float(_f(-149 * np.log(2.0)))),
            (2.0 ** -140, float(_f(-140 * np.log(2.0)))),
            (2.0 ** 127, float(_f(127 * np.log(2.0)))),
            (FLT_MAX, float(_f(np.log(FLT_MAX))))],
    "log1p": [(-1.0, -INF), (-1.0000001, NAN), (-2.0, NAN), (-INF, NAN), (INF, INF),
              (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (-1e-30, -1e-30),
              (FLT_MAX, float(_f(np.log(FLT_MAX))))] + [(v, v) for v in DEN_X],
    "tanh": [(INF, 1.0), (-INF, -1.0), (0.0, 0.0), (-0.0, -0.0), (9.5, 1.0), (-9.5, -1.0),
             (20.0, 1.0), (-20.0, -1.0), (FLT_MAX, 1.0), (-FLT_MAX, -1.0), (1e-30, 1e-30),
             (-1e-30, -1e-30)] + [(v, v) for v in DEN_X],
    "sigmoid": [(-INF, 0.0), (INF, 1.0), (0.0, 0.5), (-0.0, 0.5), (100.0, 1.0), (FLT_MAX, 1.0),
                (-FLT_MAX, 0.0), (-110.0, 0.0), (DEN, 0.5), (-DEN, 0.5),
                (-100.0, float(_f(U.sigmoid64(-100.0))))],
    "erf": [(INF, 1.0), (-INF, -1.0), (0.0, 0.0), (-0.0, -0.0), (4.0, 1.0), (-4.0, -1.0),
            (10.0, 1.0), (-10.0, -1.0), (FLT_MAX, 1.0), (-FLT_MAX, -1.0)],
    "sin": [(INF, NAN), (-INF, NAN), (0.0, 0.0), (-0.0, -0.0), (1e-30, 1e-30), (-1e-30, -1e-30)]
           + [(v, v) for v in DEN_X],
    "cos": [(INF, NAN), (-INF, NAN), (0.0, 1.0), (-0.0, 1.0), (1e-30, 1.0), (DEN, 1.0),
            (-DEN, 1.0)],
}
NANS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FC12345],
                dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_special_values(kernels, name):
    xs, want = zip(*SPECIAL[name])
    x = np.array(xs, dtype=np.float32)
    want = np.array(want, dtype=np.float32)
    # each value in every lane position of a vector and in the scalar tail
    reps = np.repeat(x, W + 3)
    got = kernels[name](reps).reshape(len(x), W + 3)
    for j in range(W + 3):
        assert_bitwise(got[:, j], want)
    assert np.isnan(kernels[name](np.repeat(NANS, W + 1))).all()


def test_sigmoid_tiny_is_denormal_not_zero(kernels):
    y = kernels["sigmoid"](np.array([-90.0, -95.0, -100.0, -103.0], dtype=np.float32))
    assert np.all((y > 0) & (y < U.FLT_MIN))


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_sin_cos_beyond_accurate_range(kernels, name):
    rng = np.random.default_rng(7)
    big = U.random_in(rng, U.SIN_COS_LIMIT, FLT_MAX, 20000)
    x = np.concatenate([big, -big, np.array([1e10, 3e38, FLT_MAX, -FLT_MAX], np.float32)])
    y = kernels[name](x)
    assert np.all(np.isfinite(y) & (np.abs(y) <= 1.0))


def test_odd_and_even_symmetry(kernels):
    x = _inputs("sin", 100_000, 5)
    for name, sign in (("sin", -1), ("cos", 1), ("tanh", -1), ("erf", -1)):
        k = kernels[name]
        assert_bitwise(k(-x), (sign * k(x)).astype(np.float32))


@pytest.mark.parametrize("name", NAMES)
def test_tail_matches_vector(kernels, name):
    """The scalar tail gives the bits a vector lane gives for the same input."""
    rng = np.random.default_rng(99)
    x = np.concatenate([U.random_in(rng, *U.DOMAIN[name], 20 * W * (W - 1)),
                        np.linspace(*U.SWEEP[name], 4 * W * (W - 1)).astype(np.float32),
                        U.special_values(name)])
    x = x[: x.size - x.size % W]
    k = kernels[name]
    vec = k(x)                                            # n % W == 0: vector path only
    assert_bitwise(k.in_pieces(x, W - 1), vec)            # n < W: scalar path only
    for n in (1, W - 1, W + 1, 3 * W + 5):               # n not a multiple of W: both paths
        assert_bitwise(k(x[:n]), vec[:n])
    k.cfn(x.ctypes.data, x.ctypes.data, 0)                # n == 0 does nothing


@pytest.mark.parametrize("lanes", [4, 8])
def test_any_width_gives_same_bits(kernels, lanes):
    for name in ("exp", "log1p", "sin", "erf"):
        k = Kernel(name, lanes, "test_vmath_width")
        x = _inputs(name, 50_000, 3)
        assert_bitwise(k(x), kernels[name](x))


def _asm(text: str) -> str:
    from fucina.codegen.jit import assembly

    return assembly(text)


@pytest.mark.parametrize("name", NAMES)
def test_no_calls_in_assembly(kernels, name):
    asm = _asm(kernels[name].ir)
    code = [ln.split("#")[0].strip() for ln in asm.splitlines() if ln.startswith("\t")]
    code = [ln for ln in code if ln and not ln.startswith(".")]
    calls = [ln for ln in code if re.match(r"(call|jmp)\w*\s+[^.\s]", ln)]   # jmp to .LBB is local
    assert not calls, calls
    assert "vfmadd" in asm or "vfnmadd" in asm or "vfmsub" in asm


def test_ir_constants_are_float32(kernels):
    """Every float literal in the emitted IR is exactly a float32 (hex double form)."""
    for k in kernels.values():
        for h in re.findall(r"0x[0-9A-F]{16}", k.ir):
            d = np.array(int(h, 16), dtype=np.uint64).view(np.float64)
            assert np.isnan(d) or float(np.float32(d)) == float(d), h


def test_splat_and_helpers():
    v4 = ir.VectorType(vmath.F32, 4)
    c = vmath.splat(None, v4, 0.1)
    assert str(c).count(ir.Constant(vmath.F32, float(np.float32(0.1))).get_reference()) == 4
    assert vmath.splat(None, vmath.F32, 1 / 3).constant == float(np.float32(1 / 3))
    assert str(vmath.splat(None, ir.VectorType(ir.IntType(32), 2), 7)) == "<2 x i32> <i32 7, i32 7>"
    # the coefficient tables hold float32 values only
    for tab in (vmath._EXP_P, vmath._LOG_Q, vmath._ERF_P, vmath._ERF_L, vmath._SIN_S,
                vmath._COS_C, vmath._TANH_T):
        assert all(float(np.float32(v)) == v for v in tab)


def _kernel_from(fn, lanes: int, tag: str) -> Kernel:
    k = Kernel.__new__(Kernel)
    symbol = f"test_vmath_helper_{tag}_w{lanes}"
    k.ir = vmath.unary_kernel_ir(fn, symbol, lanes)
    addr = jit.loader().load_object(jit.compile_object(k.ir), [symbol])[symbol]
    k.cfn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(addr)
    return k


def test_rounding_helpers_lower_without_calls():
    c = vmath._c

    def mix(b, x):   # floor(x) + roundeven(x) + copysign(|min(x,2)|, max(x,-3))
        m = vmath.fabs(b, vmath.fmin(b, c(x, 2.0), x))
        s = vmath.copysign(b, m, vmath.fmax(b, c(x, -3.0), x))
        return b.fadd(b.fadd(vmath.floor(b, x), vmath.roundeven(b, x)), s)

    k = _kernel_from(mix, W, "mix")
    x = np.array([-4.5, -2.5, -0.5, -0.0, 0.0, 0.5, 1.5, 2.5, 3.7, 1e9] * 5, dtype=np.float32)
    want = (np.floor(x) + np.round(x)
            + np.copysign(np.abs(np.minimum(x, 2.0)), np.maximum(x, -3.0))).astype(np.float32)
    assert_bitwise(k(x), want)
    asm = _asm(k.ir)
    assert not re.search(r"^\s*(call|jmp)\w*\s+[^.\s]", asm, re.M)


def test_sincos_matches_sin_and_cos(kernels):
    x = _inputs("sin", 50_000, 11)
    ks = _kernel_from(lambda b, v: vmath.sincos(b, v)[0], W, "sincos_s")
    kc = _kernel_from(lambda b, v: vmath.sincos(b, v)[1], W, "sincos_c")
    assert_bitwise(ks(x), kernels["sin"](x))
    assert_bitwise(kc(x), kernels["cos"](x))


def test_expm1_poly_estrin_as_accurate_as_horner():
    """The Estrin-order e^r - 1 (silu and sigmoid use it: a shorter dependency chain) stays
    within 1 ulp of expm1 on the reduced range |r| <= ln2/2, like the Horner form, and its
    scalar tail gives a vector lane's bits."""
    r = np.linspace(-0.3466, 0.3466, 400_001).astype(np.float32)
    want = np.expm1(r.astype(np.float64))
    for fn in (vmath._expm1_poly, vmath._expm1_poly_estrin):
        k = _kernel_from(fn, W, fn.__name__)
        assert U.ulp_error(k(r), want).max() <= 1.0, fn.__name__
    x = r[: W * 200]
    assert_bitwise(k.in_pieces(x, W - 1), k(x))
