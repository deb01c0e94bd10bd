"""Activation formulas (SPEC §3.3–§3.6): the UnaryOp family, leaky_relu and clamp, the gated
pairs, and the backward rule of each — one template per kernel (language: codegen/lowering.py).

Adding a UnaryOp is this file alone — its forward template, its `_grad` template and its
UNARY_RULES row (`x.unary(name)` and autograd then work) — plus its rows in
tests/test_activations.py (EXACT or ref64/BOUND, and TORCH) and, for a method spelling
(`x.name()`), one line in fucina/ag/activations.py's ActivationMethods.

Backward kernels take the upstream gradient g first, then what the rule reads: the forward
input x or the forward output y (gated rules: the up operand, then the gate). By-value
parameters (a slope, clamp bounds) come last. Everything is branch-free: `a if c else b`
computes both sides and selects. Entries whose name starts with `_` are building blocks
called by other templates, not kernels.

Formulas without a transcendental are evaluated literally, operation by operation as SPEC
writes them, so they are bitwise-equal to a float32 numpy transcription (relu, neg, abs, sqrt,
rsqrt, fast_tanh, floor, ceil, round, sign, reciprocal, leaky_relu, clamp, and their rules).
Transcendentals come from vmath. Algebraic prefixes that feed one (u of the tanh-gelu, 1.702x,
x/30, x·0.7071...) are formed in float32 exactly as SPEC writes them. Where the literal float32
form would cancel or underflow early, an algebraically equal form is used:

  gelu (tanh)   0.5·x·(1 + tanh u) = x·sigmoid(2u)      (no 1 + tanh u cancellation for x < 0)
  softplus      ln(1 + e^±x) = max(x, 0) + log1p(e^-|x|) (the literal form is 0 for x < -17)
  m·sigmoid(v)  sigmoid and silu: the short compensated form; mul_sigmoid, the precise one,
                for gelu, quick_gelu and the gated pairs (codegen/vsigmoid.py): accurate
                where sigmoid(v) < 2^-126 (x < -87), down to denormal results
  gated         up·act(gate) is folded into the activation's last rounding (mul_sigmoid's
                third operand)

gelu_erf keeps SPEC's literal 0.5·x·(1 + erf(x/√2)) (ggml's and torch's form too): for
x < -1, 1 + erf cancels and the error is absolute, below |x|·2^-25. erf is vmath's (within
1.14 ulp), not a bitwise port of musl's erff.

Measured max error in float32 ulps against float64 (every float32 with 2^-24 <= |x| < 2^8,
both signs, 5.6e8 points, plus 2e7 random bit patterns over the whole range; special values
exact; tests/test_activations.py checks each bound on its own sample):

  exp 1.01   sigmoid 1.50   silu 1.79   log 0.92   log1p 0.92 (of ln(fl(1 + x)))
  softplus 1.77   sin 1.57   cos 1.81 (|x| <= 2^20)   tanh 1.33   gelu 1.84
  quick_gelu 1.74   softcap_30 1.72   softcap_15 1.72   elu 0.94   erf 1.14
  gelu_erf 1.75 (x >= -1; below, absolute error < |x|·2^-25)
  gelu_quant: every f16 input in (-10, 10): 3 of 37376 differ from the correctly rounded
              f16 table by one f16 ulp (the f32 gelu inside is within 2 ulp)
  gated (6e7 random pairs): glu 1.87, swiglu 1.85, geglu 1.81, swiglu_clamp10 1.99,
              situ 3.91 (two tanh and a sigmoid in one product)
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS = {
    "GELU_C": 0.7978845608028654,     # sqrt(2/pi)
    "GELU_A": 0.044715,
    "GELU_3A": 3 * 0.044715,          # the derivative's 3·0.044715, one float32 constant
    "SQRT1_2": 0.7071067811865476,
    "INV_SQRT_2PI": 0.3989422804014327,
    "TWO_OVER_SQRT_PI": 1.1283791670955126,
    # NAM's rational tanh: x·(a + a|x| + (b + c|x|)x²) / (d + (d + x²)|x + e·x|x||)
    "FT_A": 2.45550750702956, "FT_B": 0.893229853513558, "FT_C": 0.821226666969744,
    "FT_D": 2.44506634652299, "FT_E": 0.814642734961073,
}

BUILDING_BLOCKS = {
    "_gelu_u": T("x", "GELU_C * (x + GELU_A * (x * x * x))"),   # in float32 as SPEC writes it
    "_two_u": T("x", """
        u = _gelu_u(x)
        u + u"""),
    "_gelu_deriv": T("x", """
        s = sigmoid(_two_u(x))                # s = sigmoid(2u) = (1 + tanh u)/2
        poly = 1 + GELU_3A * (x * x)
        k = (2 * (s * (1 - s))) * (GELU_C * poly)
        s + x * k"""),                        # 0.5(1+t) + 0.5·x·(1−t²)·c·(1 + 3a·x²)
    "_sgn": T("x", "1 if x > 0 else (-1 if x < 0 else 0)"),   # 0 also for NaN: sign(0) = 0
    "_fast_tanh_deriv": T("x", """
        ax = abs(x)
        x2 = x * x
        bc = FT_B + FT_C * ax
        n = (FT_A + FT_A * ax) + bc * x2
        dn = _sgn(x) * (FT_A + FT_C * x2) + (2 * x) * bc
        w = x + (FT_E * x) * ax
        aw = abs(w)
        dx2 = FT_D + x2
        den = FT_D + dx2 * aw
        dw = 1 + (2 * FT_E) * ax
        dden = (2 * x) * aw + (dx2 * _sgn(w)) * dw
        top = (n + x * dn) * den - (x * n) * dden
        top / (den * den)"""),                # quotient rule on y = x·N/D
    "_gelu_erf_deriv": T("x", """
        cdf = 0.5 * (1 + erf(x * SQRT1_2))
        pdf = exp(-(x * x) * 0.5)
        cdf + (x * pdf) * INV_SQRT_2PI"""),
    "_silu_deriv": T("x", """
        s = sigmoid(x)
        fma(x * s, 1 - s, s)"""),             # s + x·s·(1 − s), one fma
    "_sigmoid_deriv": T("x", """
        s = sigmoid(x)
        s * (1 - s)"""),
    "_quick_gelu_deriv": T("x", """
        s = sigmoid(1.702 * x)
        s + ((1.702 * x) * s) * (1 - s)"""),
    "_situ_src": T("up", "25 * tanh(up * 0.04)"),
    "_situ_act": T("x", "(4 * tanh(x * 0.25)) * sigmoid(x)"),
    "_situ_src_deriv": T("up", """
        t = tanh(up * 0.04)
        (25 * 0.04) * (1 - t * t)"""),
    "_situ_act_deriv": T("x", """
        t = tanh(x * 0.25)
        s = sigmoid(x)
        a = (0.25 * (1 - t * t)) * s
        c = t * (s * (1 - s))
        4 * (a + c)"""),                      # d/dx 4·tanh(x/4)·s
    "_gelu": T("x", "mul_sigmoid(x, _two_u(x))"),
}

KERNELS = {
    # UnaryOp forward (neg is the arithmetic table's)
    "relu": T("x", "x if x > 0 else 0"),                     # NaN -> 0
    "exp": T("x", "exp(x)"),
    "sqrt": T("x", "sqrt(x)"),
    "rsqrt": T("x", "1 / sqrt(x)"),
    "sigmoid": T("x", "sigmoid(x)"),
    "silu": T("x", "silu(x)"),
    "log": T("x", "log(x)"),
    "log1p": T("x", "log(1 + x)"),
    "softplus": T("x", "(x if x > 0 else 0) + log1p(exp(-abs(x)))"),
    "abs": T("x", "abs(x)"),
    "sin": T("x", "sin(x)"),
    "cos": T("x", "cos(x)"),
    "tanh": T("x", "tanh(x)"),
    "fast_tanh": T("x", """
        ax = abs(x)
        x2 = x * x
        num = (FT_A + FT_A * ax) + (FT_B + FT_C * ax) * x2
        w = x + (FT_E * x) * ax
        den = FT_D + (FT_D + x2) * abs(w)
        (x * num) / den"""),
    "gelu": T("x", "_gelu(x)"),
    "quick_gelu": T("x", "mul_sigmoid(x, 1.702 * x)"),
    "softcap_30": T("x", "30 * tanh(x * (1 / 30))"),
    "softcap_15": T("x", "15 * tanh(x * (1 / 15))"),
    "gelu_quant": T("x", """
        y = f16_round(_gelu(f16_round(x)))
        y = x if x >= 10 else y
        0 if x <= -10 else y"""),                            # ggml's GGML_GELU_FP16
    "elu": T("x", "x if x > 0 else expm1(x)"),
    "gelu_erf": T("x", "(0.5 * x) * (1 + erf(x * SQRT1_2))"),
    "erf": T("x", "erf(x)"),
    "floor": T("x", "floor(x)"),
    "ceil": T("x", "ceil(x)"),
    "round": T("x", "roundeven(x)"),  # SPEC's (|x| + 2^23) − 2^23 with copysign is exactly this
    "sign": T("x", "1 if x > 0 else (-1 if x < 0 else x)"),  # ±0 kept, NaN propagates
    "reciprocal": T("x", "1 / x"),
    "hardswish": T("x", "x * minimum(maximum(x + 3, 0), 6) / 6"),   # MobileNetV3; torch's order

    # UnaryOp backward: (g, x) or (g, y)
    "relu_grad": T("g x", "g if x > 0 else 0"),
    "sqrt_grad": T("g y", "g * (0.5 / y)"),
    "rsqrt_grad": T("g x", "g * (-0.5 / (x * sqrt(x)))"),
    "sigmoid_grad": T("g y", "g * (y * (1 - y))"),
    "silu_grad": T("g x", "g * _silu_deriv(x)"),
    "log1p_grad": T("g x", "g / (1 + x)"),
    "softplus_grad": T("g x", "g * sigmoid(x)"),
    "abs_grad": T("g x", "g * _sgn(x)"),
    "sin_grad": T("g x", "g * cos(x)"),
    "cos_grad": T("g x", "g * -sin(x)"),
    "tanh_grad": T("g y", "g * (1 - y * y)"),
    "fast_tanh_grad": T("g x", "g * _fast_tanh_deriv(x)"),
    "gelu_grad": T("g x", "g * _gelu_deriv(x)"),
    "quick_gelu_grad": T("g x", "g * _quick_gelu_deriv(x)"),
    "softcap_30_grad": T("g x", """
        t = tanh(x * (1 / 30))
        g * (1 - t * t)"""),
    "softcap_15_grad": T("g y", """
        t = y / 15
        g * (1 - t * t)"""),
    "elu_grad": T("g x", "g if x > 0 else g * exp(x)"),
    "gelu_erf_grad": T("g x", "g * _gelu_erf_deriv(x)"),
    "reciprocal_grad": T("g y", "g * -(y * y)"),
    "erf_grad": T("g x", "g * (TWO_OVER_SQRT_PI * exp(-(x * x)))"),
    "hardswish_grad": T("g x", "0 if x <= -3 else (g if x >= 3 else g * (x / 3 + 0.5))"),

    # parameterized (SPEC §3.4): the parameter is a by-value kernel argument
    "leaky_relu": T("x slope", "x if x > 0 else slope * x"),
    "leaky_relu_grad": T("g x slope", "g if x > 0 else g * slope"),
    "clamp": T("x lo hi", """
        t = lo if x < lo else x
        hi if t > hi else t"""),                             # NaN propagates (torch.clamp)
    "clamp_grad": T("g x lo hi", "g if (x >= lo) & (x <= hi) else 0"),

    # gated pairs (SPEC §3.6): src(up)·act(gate), the product in the last rounding
    "glu": T("up gate", "mul_sigmoid(1, gate, up)"),
    "swiglu": T("up gate", "mul_sigmoid(gate, gate, up)"),
    "geglu": T("up gate", "mul_sigmoid(gate, _two_u(gate), up)"),
    "situ": T("up gate", "mul_sigmoid(4 * tanh(gate * 0.25), gate, _situ_src(up))"),
    "swiglu_clamp10": T("up gate", """
        gc = 10 if gate > 10 else gate
        mul_sigmoid(gc, gc, clamp(up, -10, 10))"""),         # DeepSeek V4's clamped SwiGLU
    # g · d(src)/d(up) · act(gate): (g, gate) for the identity sources, (g, up, gate) for situ
    "glu_grad_up": T("g gate", "g * sigmoid(gate)"),
    "swiglu_grad_up": T("g gate", "g * silu(gate)"),
    "geglu_grad_up": T("g gate", "g * _gelu(gate)"),
    "situ_grad_up": T("g up gate", "g * (_situ_src_deriv(up) * _situ_act(gate))"),
    # g · src(up) · act'(gate)
    "glu_grad_gate": T("g up gate", "g * (up * _sigmoid_deriv(gate))"),
    "swiglu_grad_gate": T("g up gate", "g * (up * _silu_deriv(gate))"),
    "geglu_grad_gate": T("g up gate", "g * (up * _gelu_deriv(gate))"),
    "situ_grad_gate": T("g up gate", "g * (_situ_src(up) * _situ_act_deriv(gate))"),
}

TEMPLATES = {**BUILDING_BLOCKS, **KERNELS}

# The UnaryOp family (SPEC §3.3), in its documented order: op -> (backward kernel, what it
# reads: "x" the input, "y" the output, None only g), or None where the derivative is 0 almost
# everywhere (the gradient is zeros). neg, mul and div are the arithmetic table's kernels.
UNARY_RULES = {
    "relu": ("relu_grad", "x"), "exp": ("mul", "y"), "sqrt": ("sqrt_grad", "y"),
    "rsqrt": ("rsqrt_grad", "x"), "sigmoid": ("sigmoid_grad", "y"), "silu": ("silu_grad", "x"),
    "log": ("div", "x"), "log1p": ("log1p_grad", "x"), "softplus": ("softplus_grad", "x"),
    "neg": ("neg", None), "abs": ("abs_grad", "x"), "sin": ("sin_grad", "x"),
    "cos": ("cos_grad", "x"), "tanh": ("tanh_grad", "y"), "fast_tanh": ("fast_tanh_grad", "x"),
    "gelu": ("gelu_grad", "x"), "quick_gelu": ("quick_gelu_grad", "x"),
    "softcap_30": ("softcap_30_grad", "x"), "softcap_15": ("softcap_15_grad", "y"),
    "gelu_quant": ("gelu_grad", "x"), "elu": ("elu_grad", "x"),
    "gelu_erf": ("gelu_erf_grad", "x"), "floor": None, "ceil": None, "round": None, "sign": None,
    "reciprocal": ("reciprocal_grad", "y"), "erf": ("erf_grad", "x"),
    "hardswish": ("hardswish_grad", "x"),
}
