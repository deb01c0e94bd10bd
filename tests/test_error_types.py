"""Every error a user can meet is a FucinaError subclass: argument errors are InvalidArgument /
InvalidArgumentType (still ValueError / TypeError), so `except fu.FucinaError` catches them and
`except ValueError` keeps working. A scan of the library's source pins it; a few calls show
the classes and that the message names the op."""
import ast
import pathlib
import sys

import numpy as np
import pytest

import fucina as fu
from fucina.errors import InvalidArgument, InvalidArgumentType, ParamNotRegistered

ROOT = pathlib.Path(fu.__file__).parent
BUILTIN = {"ValueError", "TypeError", "KeyError", "IndexError", "RuntimeError", "OSError"}
# raised and caught inside the library, never seen by a caller: json's parse_constant hooks
# (the caller turns the ValueError into a checkpoint / safetensors error)
INTERNAL = {("io/checkpoint.py", "_reject_constant"), ("io/safetensors.py", "_reject_constant")}


def _builtin_raises():
    """(file, function, line, exception) of every `raise <builtin>(...)` outside codegen, whose
    kernel-key checks guard the library's own calls, not a user's."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("codegen/"):
            continue
        tree = ast.parse(path.read_text(), rel)
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and isinstance(node.exc.func, ast.Name)
                        and node.exc.func.id in BUILTIN and (rel, fn.name) not in INTERNAL):
                    out.append((rel, fn.name, node.lineno, node.exc.func.id))
    return sorted(set(out))


def test_the_library_raises_no_bare_builtin_errors():
    assert _builtin_raises() == []


def test_the_scan_finds_a_bare_raise(tmp_path, monkeypatch):
    """The scan is not vacuous: a module with a bare ValueError is reported."""
    pkg = tmp_path / "pkg"
    (pkg / "codegen").mkdir(parents=True)
    (pkg / "mod.py").write_text("def f(x):\n    raise ValueError('f: bad x')\n")
    (pkg / "codegen" / "k.py").write_text("def g():\n    raise ValueError('internal')\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert _builtin_raises() == [("mod.py", "f", 2, "ValueError")]


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
