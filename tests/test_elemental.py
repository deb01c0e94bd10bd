"""Elemental (user scalar) ops, SPEC §3.5: tracing into kernels, gradients, the numpy fallback."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fucina as fu
import fucina.elemental as E
from fucina.codegen import elemental as tr
from fucina.codegen import kernels
from fucina.exec.elementwise import CHUNK

from conftest import assert_bitwise, ulp_diff


def rand(rng, n, scale=3.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3e38, -3e38,
                     0.5, 2.0], np.float32)


# ---- ops used throughout -------------------------------------------------------------------

class Square:
    def forward(self, x, extra):
        return x * x

    def backward(self, x, y, gy, extra):
        return 2 * x * gy


class Softplus:
    """Softplus with where; backward reads x only."""

    def forward(self, x, extra):
        return E.where(x > 0, x + E.log1p(E.exp(-x)), E.log1p(E.exp(x)))

    def backward(self, x, y, gy, extra):
        return gy * E.sigmoid(x)


class Poly:
    """extra = (a, b): a*x + b*x^2."""

    def forward(self, x, extra):
        a, b = extra
        return a * x + b * x * x

    def backward(self, x, y, gy, extra):
        a, b = extra
        return gy * (a + 2 * b * x)


class MulAdd:
    """a*b + a (binary, broadcasting in the tests)."""

    def forward(self, a, b, extra):
        return a * b + a

    def backward_a(self, a, b, y, gy, extra):
        return gy * (b + 1)

    def backward_b(self, a, b, y, gy, extra):
        return gy * a


class SmoothMax:
    """A binary op with transcendental parts: log(e^a + e^b) stabilised, scaled by extra."""

    def forward(self, a, b, extra):
        m = E.maximum(a, b)
        return extra * (m + E.log(E.exp(a - m) + E.exp(b - m)))

    def backward_a(self, a, b, y, gy, extra):
        return gy * E.sigmoid(a - b) * extra

    def backward_b(self, a, b, y, gy, extra):
        return gy * E.sigmoid(b - a) * extra


# ---- acceptance ----------------------------------------------------------------------------

def test_square_acceptance(ctx):
    x = ctx.variable([1.0, -2.0, 3.0], ("n",))
    y = x.elemental_unary(Square())
    assert y.numpy().tolist() == [1.0, 4.0, 9.0] and y.tags == ("n",) and y.requires_grad
    y.sum_all().backward()
    assert x.grad().numpy().tolist() == [2.0, -4.0, 6.0]


def test_square_on_python_numbers():
    assert Square().forward(3.0, None) == 9.0
    assert type(E.exp(1.0)) is np.float32 and E.exp(1.0) == np.exp(np.float32(1.0))
    assert Softplus().forward(np.float32(0.0), None) == np.float32(np.log(2.0))
    assert E.where(True, 1, 2) == 1 and type(E.where(False, 1, 2.5)) is np.float32
    assert E.maximum(np.nan, 1.0) != E.maximum(np.nan, 1.0)  # NaN propagates
    assert E.pow(-8.0, 1.0 / 3.0) != E.pow(-8.0, 1.0 / 3.0) and E.pow(0.0, 0.0) == 1.0
    assert E.sigmoid(np.float32(-100.0)) > 0 and E.erf(0.5) == np.float32(0.5204998778)


# ---- gradients -----------------------------------------------------------------------------

def test_gradcheck_softplus_with_where(ctx):
    rng = np.random.default_rng(1)
    x = ctx.variable(rand(rng, 12), ("n",))
    w = ctx.tensor(rand(rng, 12, 1.0), ("n",))
    r = fu.gradcheck(lambda v: (v.elemental_unary(Softplus()) * w).sum_all(), [x])
    assert r.checked == 12


def test_gradcheck_extra_tuple(ctx):
    rng = np.random.default_rng(2)
    x = ctx.variable(rand(rng, 10, 1.0), ("n",))
    r = fu.gradcheck(lambda v: v.elemental_unary(Poly(), (0.5, -1.25)).sum_all(), [x])
    assert r.checked == 10
    y = x.elemental_unary(Poly(), [0.5, -1.25])  # a list works like a tuple
    a = x.numpy()
    np.testing.assert_array_equal(y.numpy(), np.float32(0.5) * a + np.float32(-1.25) * a * a)


@pytest.mark.parametrize("op,extra", [(MulAdd(), None), (SmoothMax(), 0.75)])
def test_gradcheck_binary_with_broadcasting(ctx, op, extra):
    rng = np.random.default_rng(3)
    a = ctx.variable(rand(rng, 6, 1.0).reshape(2, 3), ("r", "c"))
    b = ctx.variable(rand(rng, 3, 1.0), ("c",))
    w = ctx.tensor(rand(rng, 6, 1.0).reshape(2, 3), ("r", "c"))
    y = a.elemental_binary(b, op, extra)
    assert y.tags == ("r", "c") and y.shape == (2, 3)
    r = fu.gradcheck(lambda p, q: (p.elemental_binary(q, op, extra) * w).sum_all(), [a, b])
    assert r.checked == 9
    # the broadcast operand's gradient is the sum over the broadcast axis
    a.zero_grad(), b.zero_grad()
    a.elemental_binary(b, MulAdd()).sum_all().backward()
    np.testing.assert_allclose(b.grad().numpy(), a.numpy().sum(0), rtol=1e-6)
    np.testing.assert_array_equal(a.grad().numpy(), np.broadcast_to(b.numpy() + 1, (2, 3)))


def test_needs_grad_pruning_traces_only_needed_gradients(ctx):
    calls = []

    class Counting(MulAdd):
        def backward_a(self, a, b, y, gy, extra):
            calls.append("a")
            return super().backward_a(a, b, y, gy, extra)

        def backward_b(self, a, b, y, gy, extra):
            calls.append("b")
            return super().backward_b(a, b, y, gy, extra)

    a = ctx.tensor([1.0, 2.0], ("n",))
    b = ctx.variable([3.0, 4.0], ("n",))
    a.elemental_binary(b, Counting()).sum_all().backward()
    assert calls == ["b"] and b.grad().numpy().tolist() == [1.0, 2.0]
    calls.clear()
    with fu.no_grad():
        a.elemental_binary(b, Counting())
    a.elemental_binary(ctx.tensor([1.0, 1.0], ("n",)), Counting())
    assert calls == []


# ---- values: bitwise against the built-in ops, ulp against float64 -------------------------

class Formula:
    def __init__(self, f):
        self.f = f

    def forward(self, x, extra):
        return self.f(x)

    def backward(self, x, y, gy, extra):
        return gy


BUILTIN_TWINS = [
    ("x*x + 3*x", lambda x: x * x + 3 * x, lambda t: (t * t) + t.scale(3.0)),
    ("relu", lambda x: E.where(x > 0, x, 0.0), lambda t: t.relu()),
    ("exp", E.exp, lambda t: t.exp()),
    ("log", E.log, lambda t: t.log()),
    ("tanh", E.tanh, lambda t: t.tanh()),
    ("sigmoid", E.sigmoid, lambda t: t.sigmoid()),
    ("sqrt", E.sqrt, lambda t: t.sqrt()),
    ("neg/div", lambda x: -x / 7.0 - 1.5, lambda t: (-t) / 7.0 - 1.5),
    ("maximum", lambda x: E.maximum(x, 0.25), lambda t: t.maximum(0.25)),
    ("minimum", lambda x: E.minimum(x * 2, 1.0), lambda t: t.scale(2.0).minimum(1.0)),
    ("pow", lambda x: E.pow(E.abs(x), 1.7), lambda t: t.maximum(-t).pow_scalar(1.7)),
    ("x**2.5", lambda x: x ** 2.5, lambda t: t.pow_scalar(2.5)),
    ("gelu-ish", lambda x: 0.5 * x * (1 + E.tanh(0.7978846 * (x + 0.044715 * x * x * x))),
     lambda t: t.scale(0.5) * (((t + t.scale(0.044715) * t * t).scale(0.7978846)).tanh() + 1.0)),
]


@pytest.mark.parametrize("name,f,twin", BUILTIN_TWINS, ids=[b[0] for b in BUILTIN_TWINS])
def test_bitwise_equal_to_builtin_composition(ctx, name, f, twin):
    rng = np.random.default_rng(4)
    a = np.concatenate([rand(rng, 997), SPECIALS])
    if name == "log":
        a = np.abs(a)
    x = ctx.tensor(a, ("n",))
    with np.errstate(all="ignore"):
        assert_bitwise(x.elemental_unary(Formula(f)).numpy(), twin(x).numpy())


def test_binary_bitwise_equal_to_builtin_composition(ctx):
    rng = np.random.default_rng(5)
    a = ctx.tensor(rand(rng, 40).reshape(5, 8), ("r", "c"))
    b = ctx.tensor(rand(rng, 8), ("c",))
    assert_bitwise(a.elemental_binary(b, MulAdd()).numpy(), ((a * b) + a).numpy())
    assert_bitwise(b.elemental_binary(a, MulAdd()).numpy(), ((b * a) + b).numpy())


class ExactMix:
    """Only exactly rounded operations: the number path (numpy float32) is a bitwise oracle."""

    def forward(self, x, extra):
        lo, hi = extra
        t = x * x - 3 * x / (x + 2)
        u = E.sqrt(E.abs(x)) + E.maximum(x, lo) - E.minimum(x, hi)
        return E.where((x > hi) | ~(x >= lo), t, u) + (x < 0) * np.float32(0.5)

    def backward(self, x, y, gy, extra):
        return gy


def test_traced_kernel_equals_number_path_for_exact_ops(ctx):
    rng = np.random.default_rng(6)
    a = np.concatenate([rand(rng, 3000), SPECIALS])
    got = ctx.tensor(a, ("n",)).elemental_unary(ExactMix(), (-1.0, 2.0)).numpy()
    with np.errstate(all="ignore"):
        want = ExactMix().forward(a, (np.float32(-1.0), np.float32(2.0)))
    assert_bitwise(got, want)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(2, 70), elements=st.floats(width=32)),
       st.floats(-4, 4, width=32), st.floats(-4, 4, width=32))
def test_traced_kernel_equals_number_path_property(a, lo, hi):
    # length >= 2: every example runs the same kernel (a 1-element input is a "zero" role),
    # so the CI's warm pass never meets a kernel the cold pass did not compile
    with fu.ExecContext(threads=1) as ctx:
        got = ctx.tensor(a, ("n",)).elemental_unary(ExactMix(), (lo, hi)).numpy()
    with np.errstate(all="ignore"):
        want = ExactMix().forward(a, (np.float32(lo), np.float32(hi)))
    assert_bitwise(got, want)


@pytest.mark.parametrize("name,ref,lo,hi", [
    ("expm1", np.expm1, -20, 20), ("log1p", np.log1p, -0.999, 1e6), ("erf", None, -5, 5),
    ("sin", np.sin, -100, 100), ("cos", np.cos, -100, 100)])
def test_vmath_functions_within_2_ulp(ctx, name, ref, lo, hi):
    import math

    rng = np.random.default_rng(7)
    a = rng.uniform(lo, hi, 20000).astype(np.float32)
    if name == "log1p":
        a = np.concatenate([a, np.float32(10.0) ** rng.uniform(-30, 0, 5000).astype(np.float32)])
    got = ctx.tensor(a, ("n",)).elemental_unary(Formula(getattr(E, name))).numpy()
    a64 = a.astype(np.float64)
    want = np.vectorize(math.erf)(a64) if ref is None else ref(a64)
    assert ulp_diff(got, want).max() <= 2.0


def test_strided_inputs_and_contiguous_results(ctx):
    rng = np.random.default_rng(8)
    base = rand(rng, 24).reshape(4, 6)
    x = ctx.tensor(base, ("r", "c")).permute(("c", "r"))
    assert not x._raw.is_contiguous()
    y = x.elemental_unary(Square())
    assert y._raw.is_contiguous() and y.tags == ("c", "r")
    np.testing.assert_array_equal(y.numpy(), base.T * base.T)


def test_threads_do_not_change_bits(ctx1, ctx2):
    rng = np.random.default_rng(9)
    n = 3 * CHUNK + 17
    a, b, w = rand(rng, n), rand(rng, n), rand(rng, n, 1.0)
    outs = []
    for c in (ctx1, ctx2):
        x = c.variable(a, ("n",))
        y = c.variable(b, ("n",))
        s = x.elemental_unary(Softplus())
        p = x.elemental_binary(y, SmoothMax(), 0.5)
        ((s + p) * c.tensor(w, ("n",))).sum_all().backward()
        outs.append([s.numpy(), p.numpy(), x.grad().numpy(), y.grad().numpy()])
    for p, q in zip(*outs):
        assert_bitwise(p, q)


# ---- kernel keys ---------------------------------------------------------------------------

def test_canonical_text():
    traced, params = tr.trace(Square().forward, 1, None)
    assert traced.text == "v1 i1 p0;%0=mul i0 i0;ret %0" and params == ()
    traced, params = tr.trace(lambda x, e: x * x + 3 * x, 1, None)
    assert traced.text == "v1 i1 p0;%0=mul i0 i0;%1=mul #40400000 i0;%2=add %0 %1;ret %2"
    # unread inputs and extra numbers are dropped; the rest renumbered in order
    traced, params = tr.trace(Poly().backward, 3, (0.5, -1.25))
    assert traced.inputs == (0, 2) and traced.params == (0, 1) and params == (0.5, -1.25)
    assert traced.text == ("v1 i2 p2;%0=mul #40000000 p1;%1=mul %0 i0;%2=add p0 %1;"
                           "%3=mul i1 %2;ret %3")
    traced, params = tr.trace(lambda x, e: x * e[1], 1, (1.0, 2.0))
    assert traced.text == "v1 i1 p1;%0=mul i0 p0;ret %0" and params == (2.0,)
    assert tr.parse(traced.text)[:2] == (1, 1)
    assert tr.trace(lambda x, e: x * -0.0 + 0.0, 1, None)[0].text == \
        "v1 i1 p0;%0=mul i0 #80000000;%1=add %0 #00000000;ret %1"
    assert tr.trace(lambda x, e: x > 1, 1, None)[0].text == \
        "v1 i1 p0;%0=gt i0 #3f800000;%1=f32 %0;ret %1"
    # the same operation on the same operands is one instruction; nothing else is simplified
    assert tr.trace(lambda x, e: E.exp(x) + E.exp(x) * 1.0, 1, None)[0].text == \
        "v1 i1 p0;%0=exp i0;%1=mul %0 #3f800000;%2=add %0 %1;ret %2"
    with pytest.raises(ValueError):
        tr.parse("v1 i1 p0;%0=mul i0 i1;ret %0")


def test_bool_on_traced_value_raises_trace_error():
    with pytest.raises(tr.TraceError, match="control flow"):
        tr.trace(lambda x, e: x if x > 0 else -x, 1, None)
    with pytest.raises(tr.TraceError, match="control flow"):
        tr.trace(lambda x, e: max(x, 0.0), 1, None)
    with pytest.raises(tr.TraceError, match="not numeric"):
        tr.trace(lambda x, e: x * e["k"], 1, {"k": 1.0})
    unread = tr.trace(lambda x, e: x * 2, 1, {"k": 1.0})[0]
    assert unread.text == "v1 i1 p0;%0=mul i0 #40000000;ret %0"


KEY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import fucina as fu
    import fucina.elemental as E
    from fucina.codegen import kernels

    class Op:
        def forward(self, x, extra):
            return E.where(x > extra[0], x * x + extra[1], E.tanh(x) * 0.1)
        def backward(self, x, y, gy, extra):
            return gy * E.where(x > extra[0], 2 * x, 0.1 * (1 - E.tanh(x) * E.tanh(x)))

    with fu.ExecContext(threads=1) as ctx:
        x = ctx.variable(np.linspace(-2, 2, 9), ("n",))
        x.elemental_unary(Op(), (float(sys.argv[1]), 3.0)).sum_all().backward()
    lines = open(os.environ["FUCINA_RECORD_MANIFEST"]).read().splitlines()
    keys = [k for k in lines if "elemental:" in k]
    print(json.dumps([(k, kernels.digest(kernels.key_from_json(k)).hex()) for k in keys]))
""")


def test_same_kernel_key_in_two_processes(tmp_path):
    outs = []
    for i, extra0 in enumerate(["0.5", "-0.25"]):  # another extra value: the same kernels
        env = dict(os.environ, FUCINA_RECORD_MANIFEST=str(tmp_path / f"m{i}.jsonl"))
        p = subprocess.run([sys.executable, "-c", KEY_SCRIPT, extra0], env=env, capture_output=True,
                           text=True, timeout=300, cwd=os.path.dirname(__file__))
        assert p.returncode == 0, p.stderr
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert len(outs[0]) == 2 and outs[0] == outs[1]
    for line, _ in outs[0]:
        key = kernels.key_from_json(line)
        assert key.to_json() == line and key.op.startswith("elemental:v1 ")


def test_new_extra_value_does_not_compile(ctx):
    rng = np.random.default_rng(10)
    a = rand(rng, 50, 1.0)
    x = ctx.variable(a, ("n",))
    x.elemental_unary(Poly(), (0.5, 2.0)).sum_all().backward()
    before = (kernels.stats.compiled, kernels.stats.loaded)
    x.zero_grad()
    y = x.elemental_unary(Poly(), (-3.0, 0.125))
    y.sum_all().backward()
    assert (kernels.stats.compiled, kernels.stats.loaded) == before
    np.testing.assert_array_equal(y.numpy(), np.float32(-3.0) * a + np.float32(0.125) * a * a)
    np.testing.assert_array_equal(x.grad().numpy(), np.float32(-3.0) + 2 * np.float32(0.125) * a)


def test_control_flow_on_extra_alone_bakes_the_value_in(ctx):
    class Signed:
        def forward(self, x, extra):
            return x * extra if extra > 0 else -x

        def backward(self, x, y, gy, extra):
            return gy * extra if extra > 0 else -gy

    x = ctx.variable([1.0, -2.0], ("n",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", E.ElementalFallbackWarning)
        assert x.elemental_unary(Signed(), 2.0).numpy().tolist() == [2.0, -4.0]
        y = x.elemental_unary(Signed(), -1.0)
    assert y.numpy().tolist() == [-1.0, 2.0]
    y.sum_all().backward()
    assert x.grad().numpy().tolist() == [-1.0, -1.0]


# ---- fallback ------------------------------------------------------------------------------

class BranchyAbs:
    """Python control flow on data: not traceable."""

    def forward(self, x, extra):
        return x if x > 0 else -x

    def backward(self, x, y, gy, extra):
        return gy if x > 0 else -gy


# the warning comes once per op and method per process: these tests run at one thread count

def test_fallback_warns_once_and_is_correct(ctx1):
    ctx = ctx1
    x = ctx.variable([1.5, -2.0, 3.0, -0.0], ("n",))
    with pytest.warns(E.ElementalFallbackWarning) as record:
        y = x.elemental_unary(BranchyAbs())   # the backward is traced when the node is made
    msgs = [str(w.message) for w in record]
    assert len(msgs) == 2 and all(w.filename == __file__ for w in record)
    assert any("BranchyAbs.forward" in m and "control flow" in m for m in msgs)
    assert any("BranchyAbs.backward" in m for m in msgs)
    assert y.numpy().tolist() == [1.5, 2.0, 3.0, 0.0] and y._raw.is_contiguous()
    y.sum_all().backward()
    assert x.grad().numpy().tolist() == [1.0, -1.0, 1.0, -1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", E.ElementalFallbackWarning)  # once per op and method
        x.elemental_unary(BranchyAbs()).sum_all().backward()


def test_fallback_uses_vectorised_twins(ctx1):
    ctx = ctx1
    calls = []

    class Twins:
        def forward(self, a, b, extra):
            return a if a > b else b * extra["s"]

        def forward_vec(self, a, b, extra):
            calls.append("forward_vec")
            assert a.dtype == np.float32 and a.shape == (2, 3)
            return np.where(a > b, a, b * np.float32(extra["s"]))

        def backward_a(self, a, b, y, gy, extra):
            return gy if a > b else 0.0

        def backward_a_vec(self, a, b, y, gy, extra):
            calls.append("backward_a_vec")
            return np.where(a > b, gy, np.float32(0))

        def backward_b(self, a, b, y, gy, extra):   # no twin: numpy.vectorize of this one
            calls.append("backward_b")
            return 0.0 if a > b else gy * extra["s"]

    a = ctx.variable([[1.0, 5.0, -1.0], [0.0, 2.0, 9.0]], ("r", "c"))
    b = ctx.variable([2.0, 2.0, 2.0], ("c",))
    extra = {"s": 0.5}
    with pytest.warns(E.ElementalFallbackWarning) as record:
        y = a.elemental_binary(b, Twins(), extra)
        y.sum_all().backward()
    assert sorted(str(w.message).split(" could")[0].rsplit(".", 1)[1] for w in record) == [
        "backward_a", "backward_b", "forward"]
    assert all(w.filename == __file__ for w in record)  # attributed to the caller's line
    assert y.numpy().tolist() == [[1.0, 5.0, 1.0], [1.0, 1.0, 9.0]]
    assert a.grad().numpy().tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert b.grad().numpy().tolist() == [1.0, 0.5, 0.5]
    # the twins ran once each; backward_b (no twin) once per element (+ the failed trace)
    assert calls.count("forward_vec") == 1 and calls.count("backward_a_vec") == 1
    assert calls.count("backward_b") == 7


def test_fallback_for_unsupported_operation(ctx1):
    ctx = ctx1
    class ModOp:
        def forward(self, x, extra):
            return x % 2.0

        def backward(self, x, y, gy, extra):
            return gy

    x = ctx.tensor([3.5, -1.0, 4.0], ("n",))
    with pytest.warns(E.ElementalFallbackWarning, match="ModOp.forward"):
        assert x.elemental_unary(ModOp()).numpy().tolist() == [1.5, 1.0, 0.0]


def test_fallback_when_extra_is_read_but_not_numeric(ctx1):
    class Keyed:
        def forward(self, x, extra):
            return x * extra["scale"]

        def backward(self, x, y, gy, extra):
            return gy * extra["scale"]

    class Unread(Keyed):
        def forward(self, x, extra):
            return x * 3

        def backward(self, x, y, gy, extra):
            return gy * 3

    x = ctx1.variable([1.0, -2.0], ("n",))
    with pytest.warns(E.ElementalFallbackWarning, match="not numeric"):
        y = x.elemental_unary(Keyed(), {"scale": 0.5})
    assert y.numpy().tolist() == [0.5, -1.0]
    y.sum_all().backward()
    assert x.grad().numpy().tolist() == [0.5, 0.5]
    with warnings.catch_warnings():
        warnings.simplefilter("error", E.ElementalFallbackWarning)  # never read: traced
        assert x.elemental_unary(Unread(), {"scale": 0.5}).numpy().tolist() == [3.0, -6.0]


# ---- errors --------------------------------------------------------------------------------

def test_missing_methods_raise_type_error(ctx):
    x = ctx.tensor([1.0], ("n",))

    class NoBackward:
        def forward(self, x, extra):
            return x

    class NoBackwardB:
        def forward(self, a, b, extra):
            return a

        def backward_a(self, a, b, y, gy, extra):
            return gy

    with pytest.raises(TypeError, match="backward"):
        x.elemental_unary(NoBackward())
    with pytest.raises(TypeError, match="forward"):
        x.elemental_unary(object())
    with pytest.raises(TypeError, match="backward_b"):
        x.elemental_binary(x, NoBackwardB())
    with pytest.raises(TypeError, match="backward_a"):
        x.elemental_binary(x, Square())

    class ReturnsNone(Square):
        def forward(self, x, extra):
            return None

    with pytest.raises(TypeError, match="returned NoneType"):
        x.elemental_unary(ReturnsNone())


def test_non_f32_input_raises_dtype_error(ctx):
    i = ctx.tensor([1, 2, 3], ("n",), dtype="i64")
    f = ctx.tensor([1.0, 2.0, 3.0], ("n",))
    with pytest.raises(fu.DTypeError):
        i.elemental_unary(Square())
    with pytest.raises(fu.DTypeError):
        f.elemental_binary(i, MulAdd())
    with pytest.raises(fu.DTypeError):
        ctx.tensor([1.0], ("n",), dtype="bf16").elemental_unary(Square())
