"""User scalar ops (SPEC §3.5): trace a Python scalar function into a canonical expression text,
and emit that text as IR for the elementwise generator.

Tracing calls the user's function once with symbolic values (`Sym`) in place of its float
arguments. Every arithmetic operator, comparison and `fucina.elemental` function applied to a
Sym appends one instruction to the trace (hash-consed: the same operation on the same operands
is one instruction). Nothing is simplified (no x*0 -> 0, no reassociation), so the kernel
performs exactly the float32 operations the function wrote, in its order.

The canonical text (the op name of the elementwise key is "elemental:" + text):

    v1 i<N> p<P>;%0=<op> <ref> ...;%1=...;ret <ref>

  N      tensor inputs the expression reads (kernel operands 0..N-1), N >= 1
  P      scalar parameters it reads (kernel operands N..N+P-1, passed by value: role "param")
  ref    iK (input K), pK (parameter K), %K (instruction K), #hhhhhhhh (a float32 constant as
         its 8 lowercase hex bit digits; -0.0 is #80000000)
  op     neg exp expm1 log log1p tanh sigmoid erf sin cos sqrt abs   (float -> float)
         add sub mul div max min pow                                  (float, float -> float)
         lt le gt ge eq ne                                            (float, float -> bool)
         and or (bool, bool -> bool), not (bool -> bool), f32 (bool -> 1.0 / 0.0)
         where (bool, float, float -> float)

Instructions appear in the order the function first performed them, after dropping the dead
ones; inputs and parameters the expression never reads are dropped and the rest renumbered in
their original order. Example: `lambda x, e: x * x + 3 * x` traces to
`v1 i1 p0;%0=mul i0 i0;%1=mul #40400000 i0;%2=add %0 %1;ret %2`.

Semantics of each op in the kernel: add/sub/mul/div/sqrt/abs/neg are IEEE float32 (exactly
rounded); max/min and pow are the built-in `maximum`/`minimum`/`pow` kernels (NaN-propagating;
the Zig/C99 pow domain); exp/log/tanh/sigmoid are the built-in unary kernels and expm1/log1p/
erf/sin/cos the vector-math library (codegen/vmath.py, within its documented ulp bounds);
comparisons are ordered except `ne` (NaN != anything is true, as in Python); `where` on a float
condition tests `!= 0` (numpy truthiness).
"""
from __future__ import annotations

import functools
import math
import numbers
import re
from dataclasses import dataclass

import numpy as np

from ..errors import FucinaError

FORMAT = "v1"
PREFIX = "elemental:"


class TraceError(FucinaError, TypeError):
    """A scalar function cannot be traced into a kernel: Python control flow on traced data,
    an unsupported operation, or a non-numeric `extra` that the function reads."""


class BadReturn(TypeError):
    """The function returned something that is not a number (no fallback can fix that)."""


class _NeedsStatic(TraceError):
    """Control flow (or float()) on a value computed from `extra` alone: retry with extra's
    numbers as constants (one kernel per extra value)."""


# op -> (argument kinds, result kind); "f" float, "b" bool
SIGNATURES = {
    **{op: ("f", "f") for op in ("neg", "exp", "expm1", "log", "log1p", "tanh", "sigmoid",
                                  "erf", "sin", "cos", "sqrt", "abs")},
    **{op: ("ff", "f") for op in ("add", "sub", "mul", "div", "max", "min", "pow")},
    **{op: ("ff", "b") for op in ("lt", "le", "gt", "ge", "eq", "ne")},
    "and": ("bb", "b"), "or": ("bb", "b"), "not": ("b", "b"),
    "f32": ("b", "f"),
    "where": ("bff", "f"),
}

_SWAP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


_HEX_CACHE: dict = {}


def f32_hex(value) -> str:
    """The constant ref of a number: '#' + its float32 bits in 8 hex digits (round to nearest
    even; beyond the float32 range, +-inf)."""
    try:   # the sign is part of the key: -0.0 == 0.0
        key = (type(value), value, math.copysign(1.0, value))
    except (TypeError, ValueError, OverflowError):
        key = None
    ref = _HEX_CACHE.get(key)
    if ref is None:
        try:
            with np.errstate(over="ignore"):
                v = np.float32(value)
        except (OverflowError, ValueError, TypeError) as e:
            raise TraceError(f"constant {value!r} is not a float32 number ({e})") from None
        ref = "#%08x" % int(v.view(np.uint32))
        if key is not None and value == value and len(_HEX_CACHE) < 4096:  # NaN keys never hit
            _HEX_CACHE[key] = ref
    return ref


def hex_f32(ref: str) -> float:
    """The float value of a '#hhhhhhhh' constant ref (exact as a Python float)."""
    return float(np.uint32(int(ref[1:], 16)).view(np.float32))


# ---------------------------------------------------------------------------------------------
# the trace


class _Trace:
    """Instructions of one trace, hash-consed. Refs are strings (see the module doc)."""

    __slots__ = ("instrs", "memo", "kinds", "data", "closed")

    def __init__(self):
        self.instrs: list[tuple] = []     # (op, (ref, ...))
        self.memo: dict[tuple, str] = {}
        self.kinds: list[str] = []        # result kind per instruction
        self.data: list[bool] = []        # depends on a tensor input (else on params/constants)
        self.closed = False

    def kind(self, ref: str) -> str:
        return self.kinds[int(ref[1:])] if ref[0] == "%" else "f"

    def is_data(self, ref: str) -> bool:
        if ref[0] == "%":
            return self.data[int(ref[1:])]
        return ref[0] == "i"

    def emit(self, op: str, args: tuple) -> "Sym":
        if self.closed:
            raise TraceError("a traced value was used after its trace ended "
                             "(traced values must not be stored between calls)")
        want, kind = SIGNATURES[op]
        for j, (a, k) in enumerate(zip(args, want)):
            if self.kind(a) != k:
                args = args[:j] + (self.coerce(a, k),) + args[j + 1:]
        key = (op, args)
        ref = self.memo.get(key)
        if ref is None:
            ref = "%" + str(len(self.instrs))
            self.instrs.append(key)
            self.kinds.append(kind)
            self.data.append(any(self.is_data(a) for a in args))
            self.memo[key] = ref
        return Sym(self, ref)

    def coerce(self, ref: str, want: str) -> str:
        have = self.kind(ref)
        if have == want:
            return ref
        if want == "f":   # a boolean used as a number: 1.0 / 0.0 (numpy's bool -> float32)
            return self.emit("f32", (ref,))._r
        return self.emit("ne", (ref, "#00000000"))._r   # a number used as a condition

    def finish(self, ret: str) -> "Traced":
        """Dead-code elimination, renumbering, the canonical text."""
        if self.kind(ret) == "b":   # a comparison returned as the value: 1.0 / 0.0
            ret = self.coerce(ret, "f")
        self.closed = True
        live = set()
        stack = [ret]
        while stack:
            r = stack.pop()
            if r[0] == "%" and r not in live:
                live.add(r)
                stack.extend(self.instrs[int(r[1:])][1])
        order = [k for k in range(len(self.instrs)) if "%" + str(k) in live]
        used_i, used_p = set(), set()
        refs = [a for k in order for a in self.instrs[k][1]] + [ret]
        for a in refs:
            if a[0] == "i":
                used_i.add(int(a[1:]))
            elif a[0] == "p":
                used_p.add(int(a[1:]))
        if not used_i:
            used_i.add(0)  # a kernel needs one tensor operand (its values are then unused)
        inputs, params = tuple(sorted(used_i)), tuple(sorted(used_p))
        ren = {f"i{k}": f"i{j}" for j, k in enumerate(inputs)}
        ren.update({f"p{k}": f"p{j}" for j, k in enumerate(params)})
        ren.update({f"%{k}": f"%{j}" for j, k in enumerate(order)})

        def r(a):
            return ren.get(a, a)

        parts = [f"{FORMAT} i{len(inputs)} p{len(params)}"]
        for j, k in enumerate(order):
            op, args = self.instrs[k]
            parts.append(f"%{j}={op} " + " ".join(r(a) for a in args))
        parts.append("ret " + r(ret))
        return Traced(";".join(parts), inputs, params)


@dataclass(frozen=True)
class Traced:
    """A finished trace: `text` (canonical), which of the function's tensor arguments the
    kernel reads (`inputs`, original positions) and which flattened extra numbers (`params`)."""

    text: str
    inputs: tuple
    params: tuple

    @property
    def op(self) -> str:
        return PREFIX + self.text

    @property
    def arity(self) -> int:
        return len(self.inputs) + len(self.params)


def _lift(t: _Trace, v):
    """A ref for an operand: a Sym of this trace, or a number as a constant; else None."""
    if isinstance(v, Sym):
        if v._t is not t:
            raise TraceError("a traced value from another trace was mixed into this one")
        return v._r
    if isinstance(v, (bool, np.bool_)):
        return "#3f800000" if v else "#00000000"
    if isinstance(v, numbers.Real):
        return f32_hex(v)
    return None


def _trace_of(args):
    for a in args:
        if isinstance(a, Sym):
            return a._t
    return None


_ARITH = ("add", "sub", "mul", "div", "pow", "max", "min")


def apply(op: str, *args) -> "Sym":
    """op(*args) with at least one Sym among args; numbers become float32 constants."""
    t = _trace_of(args)
    refs = []
    for a in args:
        r = _lift(t, a)
        if r is None:
            raise TraceError(f"{_PUBLIC.get(op, op)}: cannot trace an operand of type "
                             f"{type(a).__name__} (expected a traced value or a number)")
        refs.append(r)
    if op in _ARITH and all(t.kind(r) == "b" for r in refs):
        raise TraceError(f"{_PUBLIC.get(op, op)} between two booleans cannot be traced "
                         f"(numpy's bool arithmetic differs); convert with where(c, 1.0, 0.0)")
    return t.emit(op, tuple(refs))


def where(cond, a, b):
    """cond ? a : b. With a plain (untraced) condition this is a Python choice."""
    if not isinstance(cond, Sym):  # (an opaque extra raises TraceError on isinstance)
        pick = a if cond else b
        return pick if isinstance(pick, Sym) else np.float32(pick)
    return apply("where", cond, a, b)


_PUBLIC = {"max": "maximum", "min": "minimum", "add": "+", "sub": "-", "mul": "*", "div": "/",
           "pow": "**", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


class Sym:
    """A traced float32 (or boolean, from a comparison) value."""

    __slots__ = ("_t", "_r")
    __hash__ = None  # == is traced, so a Sym is no dictionary key

    def __init__(self, t: _Trace, ref: str):
        self._t, self._r = t, ref

    def __repr__(self):
        kind = "bool" if self._t.kind(self._r) == "b" else "f32"
        return f"<traced {kind} {self._r}>"

    def _bin(self, op, other, reflected=False):
        if _lift(self._t, other) is None:
            return NotImplemented
        return apply(op, other, self) if reflected else apply(op, self, other)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)

    def __pow__(self, o, mod=None):
        if mod is not None:
            raise TraceError("pow with a modulus cannot be traced")
        return self._bin("pow", o)

    def __rpow__(self, o): return self._bin("pow", o, True)
    def __neg__(self): return apply("neg", self)
    def __pos__(self): return self
    def __abs__(self): return apply("abs", self)

    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)
    def __ne__(self, o): return self._bin("ne", o)

    def _logic(self, op, other):
        t = self._t
        r = _lift(t, other)
        if r is None:
            return NotImplemented
        if t.kind(self._r) != "b" or t.kind(r) != "b":
            raise TraceError(f"'{'&' if op == 'and' else '|'}' is traced only between booleans "
                             f"(comparisons); got a float operand")
        return t.emit(op, (self._r, r))

    def __and__(self, o): return self._logic("and", o)
    def __rand__(self, o): return self._logic("and", o)
    def __or__(self, o): return self._logic("or", o)
    def __ror__(self, o): return self._logic("or", o)

    def __invert__(self):
        if self._t.kind(self._r) != "b":
            raise TraceError("'~' is traced only on booleans (comparisons)")
        return self._t.emit("not", (self._r,))

    # Concretizing a traced value is impossible: its value is not known while tracing.
    def _concrete(self, what):
        if not self._t.is_data(self._r):
            raise _NeedsStatic(f"{what} on a value computed from extra alone")
        raise TraceError(
            f"{what} on a traced value: Python control flow (if/while/and/or/not, min/max "
            f"builtins, math.* functions) cannot be traced; use fucina.elemental.where / "
            f"maximum / minimum and the fucina.elemental functions")

    def __bool__(self): self._concrete("bool()")
    def __float__(self): self._concrete("float()")
    def __int__(self): self._concrete("int()")
    def __index__(self): self._concrete("an integer index")
    def __complex__(self): self._concrete("complex()")
    def __round__(self, n=None): self._concrete("round()")
    def __trunc__(self): self._concrete("math.trunc()")
    def __floor__(self): self._concrete("math.floor()")
    def __ceil__(self): self._concrete("math.ceil()")

    def _unsupported(self, *a):
        raise TraceError("%, // and divmod are not traced (no kernel op); "
                         "write the function without them")

    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __divmod__ = __rdivmod__ = _unsupported

    # numpy ufuncs on a Sym (np.exp(x), np.float32(2) * x) trace like the namespace functions
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        op = _UFUNCS.get(ufunc.__name__)
        if method != "__call__" or kwargs or op is None:
            raise TraceError(f"numpy.{ufunc.__name__} ({method}) cannot be traced; use the "
                             f"fucina.elemental functions")
        if op in _SWAP and not isinstance(inputs[0], Sym):  # keep the Sym first, as Python does
            return apply(_SWAP[op], inputs[1], inputs[0])
        return apply(op, *inputs)


_UFUNCS = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div",
           "true_divide": "div", "power": "pow", "float_power": "pow", "negative": "neg",
           "absolute": "abs", "fabs": "abs", "maximum": "max", "minimum": "min", "exp": "exp",
           "expm1": "expm1", "log": "log", "log1p": "log1p", "tanh": "tanh", "sin": "sin",
           "cos": "cos", "sqrt": "sqrt", "less": "lt", "less_equal": "le", "greater": "gt",
           "greater_equal": "ge", "equal": "eq", "not_equal": "ne"}


class _Opaque:
    """Stands for a non-numeric `extra` (or part of it) while tracing: any use fails the
    trace (-> the numpy fallback), so its content never silently shapes a kernel."""

    __slots__ = ("_what",)

    def __init__(self, what: str):
        object.__setattr__(self, "_what", what)

    def _fail(self, *a, **k):
        raise TraceError(f"extra{object.__getattribute__(self, '_what')} is not numeric; a "
                         f"function that reads it cannot be traced (only numbers and tuples/"
                         f"lists of numbers become kernel parameters)")

    @property
    def __class__(self):  # isinstance(extra, ...) reads it too
        self._fail()

    def __getattr__(self, name):
        self._fail()

    __setattr__ = __getitem__ = __setitem__ = __iter__ = __len__ = __contains__ = _fail
    __bool__ = __float__ = __int__ = __index__ = __call__ = _fail
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __abs__ = _fail
    __array_ufunc__ = None
    __hash__ = None


# ---------------------------------------------------------------------------------------------
# extra: numbers become parameters (or constants), everything else opaque


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real)


def flatten_extra(extra) -> tuple:
    """The numbers of extra, depth-first through tuples and lists, as Python floats."""
    out = []

    def walk(v):
        if _is_number(v):
            out.append(float(v))
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)
    walk(extra)
    return tuple(out)


def _rebuild(v, items):
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return type(v)(*items)
    try:
        return type(v)(items)
    except Exception:
        return tuple(items) if isinstance(v, tuple) else list(items)


def map_extra(extra, number, other, path=""):
    """extra with every number replaced by number(value, flat_index) and every other leaf
    (not None, not a tuple/list) by other(value, path)."""
    counter = [0]

    def walk(v, path):
        if v is None:
            return None
        if _is_number(v):
            k = counter[0]
            counter[0] += 1
            return number(v, k)
        if isinstance(v, (tuple, list)):
            return _rebuild(v, [walk(x, f"{path}[{i}]") for i, x in enumerate(v)])
        return other(v, path)
    return walk(extra, path)


def float32_extra(extra):
    """extra as the numpy fallback and a static trace see it: floats become numpy.float32
    (so arithmetic on them stays float32); ints, bools and non-numbers are left as they are."""
    def number(v, k):
        if isinstance(v, (bool, np.bool_, numbers.Integral)):
            return v
        return np.float32(v)
    return map_extra(extra, number, lambda v, p: v)


# ---------------------------------------------------------------------------------------------
# tracing a function


def trace(fn, n_inputs: int, extra, what: str = "function") -> tuple[Traced, tuple]:
    """Trace fn(*inputs, extra) with n_inputs symbolic float32 arguments.

    Returns (Traced, parameter values): the values (Python floats, rounded to float32 in the
    kernel) of the flattened extra numbers the expression reads, in kernel-operand order.
    Raises TraceError when the function cannot be traced (other exceptions the function
    raises on traced values propagate too); BadReturn when it returns something that is not
    a number."""
    try:
        return _trace_once(fn, n_inputs, extra, False, what)
    except _NeedsStatic:
        return _trace_once(fn, n_inputs, extra, True, what)


def _trace_once(fn, n_inputs, extra, static, what):
    t = _Trace()
    args = [Sym(t, f"i{k}") for k in range(n_inputs)]
    if static:   # extra's numbers baked in as constants: one kernel per value of extra
        traced_extra = map_extra(extra, lambda v, k: _static_leaf(v), lambda v, p: _Opaque(p))
    else:
        traced_extra = map_extra(extra, lambda v, k: Sym(t, f"p{k}"), lambda v, p: _Opaque(p))
    try:
        result = fn(*args, traced_extra)
        if isinstance(result, Sym):
            if result._t is not t:
                raise TraceError(f"{what} returned a traced value from another trace")
            ret = result._r
        elif isinstance(result, (numbers.Real, np.bool_)):
            ret = _lift(t, result)
        else:
            raise BadReturn(f"{what} returned {type(result).__name__}; expected a number")
    except BaseException:
        t.closed = True
        raise
    traced = t.finish(ret)
    values = flatten_extra(extra)
    return traced, tuple(values[k] for k in traced.params)


def _static_leaf(v):
    if isinstance(v, (bool, np.bool_, numbers.Integral)):
        return v
    return np.float32(v)


# ---------------------------------------------------------------------------------------------
# the kernel side: parse a text, emit IR

_HEADER = re.compile(r"v1 i([1-9][0-9]*) p(0|[1-9][0-9]*)\Z")
_REF = re.compile(r"(?:[ip%](?:0|[1-9][0-9]*)|#[0-9a-f]{8})\Z")


def parse(text: str):
    """(n_inputs, n_params, [(op, refs)], ret) of a canonical text; ValueError if malformed."""
    parts = text.split(";")
    m = _HEADER.match(parts[0]) if parts else None
    if m is None or len(parts) < 2 or not parts[-1].startswith("ret "):
        raise ValueError(f"elemental: malformed expression {text!r}")
    n_in, n_par = int(m.group(1)), int(m.group(2))
    kinds: list[str] = []

    def check(ref, want):
        if not _REF.match(ref):
            raise ValueError(f"elemental: bad operand {ref!r} in {text!r}")
        k = int(ref[1:], 16 if ref[0] == "#" else 10)
        kind = "f"
        if ref[0] == "i" and k >= n_in or ref[0] == "p" and k >= n_par:
            raise ValueError(f"elemental: operand {ref!r} out of range in {text!r}")
        if ref[0] == "%":
            if k >= len(kinds):
                raise ValueError(f"elemental: {ref!r} used before it is defined in {text!r}")
            kind = kinds[k]
        if kind != want:
            raise ValueError(f"elemental: {ref!r} has the wrong kind in {text!r}")
        return ref

    instrs = []
    for j, part in enumerate(parts[1:-1]):
        head, _, rest = part.partition("=")
        words = rest.split(" ")
        if head != f"%{j}" or words[0] not in SIGNATURES:
            raise ValueError(f"elemental: malformed instruction {part!r} in {text!r}")
        want, kind = SIGNATURES[words[0]]
        if len(words) - 1 != len(want):
            raise ValueError(f"elemental: {words[0]} takes {len(want)} operands in {text!r}")
        instrs.append((words[0], tuple(check(a, w) for a, w in zip(words[1:], want))))
        kinds.append(kind)
    ret = check(parts[-1][4:], "f")
    return n_in, n_par, instrs, ret


def _emitters():
    from llvmlite import ir

    from . import irutil as u
    from . import vmath
    from .elementwise import FLOAT_OPS

    def fabs(b, x):
        return u.intrinsic(b, "llvm.fabs", x.type, [x])

    def cmp(pred, ordered=True):
        if ordered:
            return lambda b, x, y: b.fcmp_ordered(pred, x, y)
        return lambda b, x, y: b.fcmp_unordered(pred, x, y)

    def f32(b, c):
        ty = ir.VectorType(u.F32, c.type.count) if isinstance(c.type, ir.VectorType) else u.F32
        return b.select(c, u.const(ty, 1.0), u.const(ty, 0.0))

    return {
        "neg": lambda b, x: b.fneg(x),
        "exp": FLOAT_OPS["exp"][1], "log": FLOAT_OPS["log"][1], "tanh": FLOAT_OPS["tanh"][1],
        "sigmoid": FLOAT_OPS["sigmoid"][1], "sqrt": FLOAT_OPS["sqrt"][1],
        "expm1": vmath.expm1, "log1p": vmath.log1p, "erf": vmath.erf, "sin": vmath.sin,
        "cos": vmath.cos, "abs": fabs,
        "add": FLOAT_OPS["add"][1], "sub": FLOAT_OPS["sub"][1], "mul": FLOAT_OPS["mul"][1],
        "div": FLOAT_OPS["div"][1], "max": FLOAT_OPS["maximum"][1],
        "min": FLOAT_OPS["minimum"][1], "pow": FLOAT_OPS["pow"][1],
        "lt": cmp("<"), "le": cmp("<="), "gt": cmp(">"), "ge": cmp(">="), "eq": cmp("=="),
        "ne": cmp("!=", ordered=False),
        "and": lambda b, x, y: b.and_(x, y), "or": lambda b, x, y: b.or_(x, y),
        "not": lambda b, x: b.not_(x),
        "f32": f32,
        "where": lambda b, c, x, y: b.select(c, x, y),
    }


@functools.lru_cache(maxsize=None)
def op_entry(op: str):
    """(arity, emitter) for an elementwise op named "elemental:<text>": what
    codegen.elementwise.op_table returns for such a name. emitter(b, *values) takes the
    inputs then the parameters, all of one type (float or <W x float>)."""
    if not op.startswith(PREFIX):
        raise KeyError(op)
    n_in, n_par, instrs, ret = parse(op[len(PREFIX):])
    table = _emitters()

    def emit(b, *vals):
        from . import irutil as u

        assert len(vals) == n_in + n_par, (op, len(vals))
        ty = vals[0].type
        env: list = []

        def get(ref):
            c = ref[0]
            if c == "i":
                return vals[int(ref[1:])]
            if c == "p":
                return vals[n_in + int(ref[1:])]
            if c == "%":
                return env[int(ref[1:])]
            return u.const(ty, hex_f32(ref))

        for name, args in instrs:
            env.append(table[name](b, *(get(a) for a in args)))
        return get(ret)

    return n_in + n_par, emit


__all__ = ["TraceError", "Sym", "Traced", "trace", "apply", "where", "op_entry", "parse",
           "flatten_extra", "float32_extra", "map_extra", "PREFIX"]
