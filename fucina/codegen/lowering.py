"""Lowering of kernel templates (fucina/kernel_templates/) to IR values.

A template is a lane formula written once: its inputs' names and a body in a small expression
language (a subset of Python's expression syntax, parsed with `ast` and checked when the table
is lowered, never evaluated by Python):

    name = expr          a local (a name may be rebound; later lines see the new value)
    expr                 the last line: the result

    x + y  x - y  x * y  x / y  -x       float lanes: IEEE fadd fsub fmul fdiv fneg, as
                                         written: left to right, no reassociation, no
                                         contraction; integer lanes: wrapping add sub mul and
                                         0 − x (no `/`: the sdiv/srem primitives)
    x < y  x <= y  x > y  x >= y  x == y float: ordered compares (false on NaN), x != y
                                         unordered; integer: signed compares
    c & d  c | d  c ^ d  ~c              on compare results and integer lanes
    a if c else b                        select (both sides computed: branch-free)
    f(a, ...)                            a primitive (PRIMITIVES below; a kernel may share a
                                         primitive's name and call it) or another template
                                         of the same table, inlined
    2.5  NAME                            a constant: a literal, or a name from the table's
                                         CONSTANTS; constant subexpressions fold in Python
                                         (float64, or exact integers) and are rounded to the
                                         lane type once (so 1 / 30 is fl32(1/30))

Inputs, locals, constants and callees are resolved when a table is lowered, so a misspelt
name fails at import with the template's name. Values are scalar or vector IR values alike: a
template is lowered once per lane shape, and the scalar tail runs the same operations as a
vector lane, so both give the same bits. A literal takes the type of the operand it meets
(the other side of an operator or a compare, the other branch of a select), else that of the
template's first input (a call's argument, a select of two literals). The emitted operations
are exactly the ones written, so moving a formula from Python builder calls into a template
changes no output bit (tools/kernel_outputs.py proves it).
"""
from __future__ import annotations

import ast
import functools
import textwrap

from ..errors import FucinaError
from . import irutil as u
from .emit import nan_max, nan_min, sqrt


def _vmath():
    """vmath, imported when a kernel is built (not when keys are made)."""
    from . import vmath

    return vmath


def _vpow(b, x, y):
    from .vpow import pow

    return pow(b, x, y)


def _sig():
    from . import vsigmoid

    return vsigmoid


def _f16_round(b, x):
    """x rounded to f16 and widened back (fptrunc, fpext)."""
    from llvmlite import ir

    half = u.vec(u.F16, x.type.count if isinstance(x.type, ir.VectorType) else None)
    return b.fpext(b.fptrunc(x, half), x.type)


def _intrinsic(name):
    return lambda b, x: u.intrinsic(b, name, x.type, [x])


# name -> emit(builder, *values): the operations a template may call besides other templates
PRIMITIVES = {
    "exp": lambda b, x: _vmath().exp(b, x),
    "expm1": lambda b, x: _vmath().expm1(b, x),
    "log": lambda b, x: _vmath().log(b, x),
    "log1p": lambda b, x: _vmath().log1p(b, x),
    "tanh": lambda b, x: _vmath().tanh(b, x),
    "erf": lambda b, x: _vmath().erf(b, x),
    "sin": lambda b, x: _vmath().sin(b, x),
    "cos": lambda b, x: _vmath().cos(b, x),
    "abs": lambda b, x: _vmath().fabs(b, x),           # llvm.fabs
    "fma": lambda b, a, x, c: _vmath().fma(b, a, x, c),  # a·x + c, one rounding
    "roundeven": lambda b, x: _vmath().roundeven(b, x),
    "sqrt": sqrt,                                      # llvm.sqrt (exact)
    "floor": _intrinsic("llvm.floor"),
    "ceil": _intrinsic("llvm.ceil"),
    "maximum": nan_max,                                # NaN-propagating
    "minimum": nan_min,
    "f16_round": _f16_round,
    "pow": lambda b, x, y: _vpow(b, x, y),             # C99/Zig domain (codegen/vpow.py)
    # integer lanes: LLVM's sdiv/srem (undefined for a 0 divisor and minInt / -1: guard them)
    "sdiv": lambda b, x, y: b.sdiv(x, y),
    "srem": lambda b, x, y: b.srem(x, y),
    "zext": lambda b, c, like: b.zext(c, like.type),  # an i1 as 0/1 of like's type
    # the compensated sigmoid family (codegen/vsigmoid.py)
    "sigmoid": lambda b, x: _sig().sigmoid(b, x),
    "silu": lambda b, x: _sig().silu(b, x),
    "mul_sigmoid": lambda b, m, v, outer=None: _sig().mul_sigmoid(b, m, v, outer),
}

_CMP = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_FLOAT_OP = {ast.Add: "fadd", ast.Sub: "fsub", ast.Mult: "fmul", ast.Div: "fdiv"}
_INT_OP = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.BitAnd: "and_", ast.BitOr: "or_",
           ast.BitXor: "xor"}
_BIN = {**_FLOAT_OP, **_INT_OP}
_FOLD = {ast.Add: lambda a, c: a + c, ast.Sub: lambda a, c: a - c,
         ast.Mult: lambda a, c: a * c, ast.Div: lambda a, c: a / c}


def _num(v) -> bool:
    """A folded constant (a Python number), not an IR value."""
    return isinstance(v, (int, float))


def _is_int(v) -> bool:
    """An integer lane (i64, a bool byte, a compare's i1), scalar or vector."""
    from llvmlite import ir

    t = v.type.element if isinstance(v.type, ir.VectorType) else v.type
    return isinstance(t, ir.IntType)


class TemplateError(FucinaError, ValueError):
    """A template that cannot be lowered: a syntax outside the language, an unknown name, a
    call with the wrong number of arguments, a template that calls itself (raised when its
    table is lowered, at import); an operator its lane type lacks (when a kernel is built)."""


@functools.lru_cache(maxsize=None)
def _parse(body: str):
    """(statements, result expression | None) of a body."""
    tree = ast.parse(textwrap.dedent(body).strip(), mode="exec")
    stmts = list(tree.body)
    result = None
    if stmts and isinstance(stmts[-1], ast.Expr):
        result = stmts.pop().value
    for s in stmts:
        if not (isinstance(s, ast.Assign) and len(s.targets) == 1
                and isinstance(s.targets[0], ast.Name)):
            raise TemplateError(f"expected `name = expr` lines, got {ast.unparse(s)!r}")
    return tuple((s.targets[0].id, s.value) for s in stmts), result


class _Lowering:
    """One table's lowering: its templates (callable from each other) and constants."""

    def __init__(self, table: dict, constants: dict):
        self.table, self.constants = table, constants

    def check(self, name: str) -> None:
        """Resolve every name and callee of `name` without emitting anything."""
        t = self.table[name]
        try:
            stmts, result = _parse(t.body)
        except SyntaxError as e:
            raise TemplateError(f"template {name}: {e.msg} in {t.body.strip()!r}") from None
        except TemplateError as e:
            raise TemplateError(f"template {name}: {e}") from None
        if result is None:
            raise TemplateError(f"template {name}: expected a result line last")
        scope = set(t.names)
        for target, expr in stmts:
            self._check_expr(name, expr, scope)
            scope.add(target)
        self._check_expr(name, result, scope)

    def check_acyclic(self, name: str, path=(), done=None) -> None:
        """No template reaches itself through its callees (inlining would not end)."""
        done = set() if done is None else done
        if name in path:
            via = " -> ".join(path + (name,))
            raise TemplateError(f"template {path[0]}: calls itself via {via}")
        if name in done:
            return
        stmts, result = _parse(self.table[name].body)
        for e in [e for _, e in stmts] + [result]:
            for n in ast.walk(e):
                if isinstance(n, ast.Call) and n.func.id not in PRIMITIVES:
                    self.check_acyclic(n.func.id, path + (name,), done)
        done.add(name)

    def _check_expr(self, name, node, scope):
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                fn = n.func.id if isinstance(n.func, ast.Name) else None
                if fn not in PRIMITIVES and fn not in self.table:
                    raise TemplateError(f"template {name}: unknown function "
                                        f"{ast.unparse(n.func)!r}")
                if fn not in PRIMITIVES and len(n.args) != self.table[fn].arity:
                    raise TemplateError(f"template {name}: {fn} expects {self.table[fn].arity} "
                                        f"arguments, got {len(n.args)}")
            elif isinstance(n, ast.Name) and not isinstance(getattr(n, "ctx", None), ast.Store):
                if n.id not in scope and n.id not in self.constants and not _is_callee(node, n):
                    raise TemplateError(f"template {name}: unknown name {n.id!r}")
            elif not (isinstance(n, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Load))
                      or isinstance(n, ast.Constant) and type(n.value) in (int, float)
                      or type(n) in _BIN or type(n) in _CMP or type(n) in (ast.USub, ast.Invert)):
                raise TemplateError(f"template {name}: {type(n).__name__} is not in the "
                                    f"template language ({ast.unparse(node)!r})")
            if isinstance(n, ast.Compare) and len(n.ops) != 1:
                raise TemplateError(f"template {name}: chained comparison {ast.unparse(n)!r}")

    def emit(self, name: str, b, values):
        t = self.table[name]
        stmts, result = _parse(t.body)
        env = dict(zip(t.names, values))
        ty = values[0].type
        for target, expr in stmts:
            env[target] = self._value(b, expr, env, ty)
        return self._value(b, result, env, ty)

    def _value(self, b, node, env, ty):
        v = self._expr(b, node, env, ty)
        return u.const(ty, v) if _num(v) else v

    def _expr(self, b, node, env, ty):
        """An IR value, or a Python number while the subexpression is constant (folded)."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            return self.constants[node.id]
        if isinstance(node, ast.UnaryOp):
            x = self._expr(b, node.operand, env, ty)
            if isinstance(node.op, ast.USub):
                if _num(x):
                    return -x
                return b.sub(u.const(x.type, 0), x) if _is_int(x) else b.fneg(x)  # int: wraps
            return b.not_(x)  # ~
        if isinstance(node, ast.BinOp):
            x = self._expr(b, node.left, env, ty)
            y = self._expr(b, node.right, env, ty)
            op = type(node.op)
            if _num(x) and _num(y) and op in _FOLD:
                return _FOLD[op](x, y)
            x, y = _pair(x, y, ty)
            table = _INT_OP if _is_int(x) else _FLOAT_OP
            if op not in table:
                raise TemplateError(f"{ast.unparse(node)!r}: no {op.__name__} on "
                                    f"{'integer' if _is_int(x) else 'float'} lanes")
            return getattr(b, table[op])(x, y)
        if isinstance(node, ast.Compare):
            x, y = _pair(self._expr(b, node.left, env, ty),
                         self._expr(b, node.comparators[0], env, ty), ty)
            pred = _CMP[type(node.ops[0])]
            if _is_int(x):
                return b.icmp_signed(pred, x, y)
            return b.fcmp_unordered(pred, x, y) if pred == "!=" else b.fcmp_ordered(pred, x, y)
        if isinstance(node, ast.IfExp):
            c = self._value(b, node.test, env, ty)
            x, y = _pair(self._expr(b, node.body, env, ty), self._expr(b, node.orelse, env, ty),
                         ty)
            return b.select(c, x, y)
        if isinstance(node, ast.Call):
            args = [self._value(b, a, env, ty) for a in node.args]
            fn = node.func.id
            if fn in PRIMITIVES:
                return PRIMITIVES[fn](b, *args)
            return self.emit(fn, b, args)
        raise TemplateError(f"{ast.unparse(node)!r} is not in the template language")


def _pair(x, y, ty):
    """Two operands as IR values: a number takes the other operand's type (a compare of a
    bool byte with 0, a select of a float and 0), or the lane type `ty` when both are."""
    if _num(x):
        x = u.const(ty if _num(y) else y.type, x)
    if _num(y):
        y = u.const(x.type, y)
    return x, y


def _is_callee(root, name_node) -> bool:
    return any(isinstance(n, ast.Call) and n.func is name_node for n in ast.walk(root))


def lower_table(table: dict, constants: dict, names=None) -> dict:
    """{name: (arity, emit)} for the elementwise generator, every template checked now;
    `names` picks the entries that are kernels (the rest are building blocks)."""
    low = _Lowering(table, constants)
    for name in table:
        low.check(name)
    done: set = set()
    for name in table:
        low.check_acyclic(name, (), done)
    out = {}
    for name in (table if names is None else names):
        out[name] = (table[name].arity, functools.partial(_emit_entry, low, name))
    return out


def _emit_entry(low, name, b, *values):
    return low.emit(name, b, list(values))
