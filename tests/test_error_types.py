"""Every error a user can meet is a FucinaError subclass: argument errors are InvalidArgument /
InvalidArgumentType (still ValueError / TypeError), so `except fu.FucinaError` catches them and
`except ValueError` keeps working. A scan of the library's source pins it; a few calls show
the classes and that the message names the op."""
import ast
import pathlib

import numpy as np
import pytest

import fucina as fu
from fucina.errors import InvalidArgument, InvalidArgumentType, ParamNotRegistered

ROOT = pathlib.Path(fu.__file__).parent
BUILTIN = {"ValueError", "TypeError", "KeyError", "IndexError", "RuntimeError", "OSError"}
# raised and caught inside the library, never seen by a caller: json's parse_constant hooks
# (the caller turns the ValueError into a checkpoint / safetensors error)
INTERNAL = {("io/checkpoint.py", "_reject_constant"), ("io/safetensors.py", "_reject_constant")}


def _builtin_raises(root=ROOT):
    """(file, function, line, exception) of every `raise <builtin>(...)` under root outside
    codegen, whose kernel-key checks guard the library's own calls, not a user's; each raise
    is charged to its innermost function."""
    out = []

    def visit(node, rel, fn):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, rel, child.name)
                continue
            if (isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call)
                    and isinstance(child.exc.func, ast.Name) and child.exc.func.id in BUILTIN
                    and (rel, fn) not in INTERNAL):
                out.append((rel, fn, child.lineno, child.exc.func.id))
            visit(child, rel, fn)

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith("codegen/"):
            visit(ast.parse(path.read_text(), rel), rel, None)
    return out


def test_the_library_raises_no_bare_builtin_errors():
    assert _builtin_raises() == []


def test_the_scan_finds_a_bare_raise(tmp_path):
    """The scan is not vacuous: a module with a bare ValueError is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "codegen").mkdir(parents=True)
    (pkg / "mod.py").write_text("def f(x):\n    raise ValueError('f: bad x')\n")
    (pkg / "codegen" / "k.py").write_text("def g():\n    raise ValueError('internal')\n")
    assert _builtin_raises(pkg) == [("mod.py", "f", 2, "ValueError")]


def test_argument_errors_are_fucina_errors():
    from fucina.llm.decoder.train import Targets

    with pytest.raises(InvalidArgument, match=r"^decoder\.Targets: unknown target 'zz'"):
        Targets.of(["q", "zz"])
    with pytest.raises(ValueError):                       # still a ValueError
        Targets.of(["zz"])
    with pytest.raises(InvalidArgumentType, match=r"^encode_pair: pair: expected a Pair"):
        fu.llm.data.encode_pair(None, None, "not a pair")
    assert issubclass(InvalidArgument, fu.FucinaError)
    assert issubclass(InvalidArgumentType, fu.FucinaError)


def test_state_of_an_unregistered_tensor():
    ctx = fu.ExecContext(threads=1)
    try:
        opt = fu.optim.AdamW(lr=1e-3)
        w = ctx.variable(np.ones((2, 2), np.float32), ("a", "b"))
        other = ctx.variable(np.ones((2, 2), np.float32), ("a", "b"))
        opt.add_param(w, name="w")
        with pytest.raises(ParamNotRegistered, match="AdamW.state_of: the tensor is not "
                                                     "registered"):
            opt.state_of(other)
        with pytest.raises(KeyError):                     # still a KeyError
            opt.state_of(other)
    finally:
        ctx.close()
