"""kernel_templates (the declarative layer of the codegen): moving a formula there changed no
output bit. tools/kernel_outputs.py runs every templated kernel over fixed inputs (vector
tails, 16-bit storage, NaN, ±inf, ±0, subnormals) and hashes each output; the committed table
was recorded before the formulas moved."""
import json
import re

import numpy as np
import pytest

from tools import kernel_outputs


def test_every_templated_kernel_output_is_bitwise_the_recorded_one():
    path = kernel_outputs.golden()
    assert path.exists(), (f"no recorded table for this host's vector width ({path.name}); "
                           f"AVX2 (256) and AVX-512 (512) have one")
    want = json.loads(path.read_text())
    got = kernel_outputs.compute()
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} of {len(want)} cases changed: {changed[:10]}"


def test_templates_are_plain_data():
    """kernel_templates/ imports nothing but itself (and dataclasses): what the kernel-cache
    fingerprint hashes (its *.py files) is all a formula depends on besides codegen/."""
    import ast
    from pathlib import Path

    import fucina.kernel_templates as kt

    for path in Path(kt.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module not in ("__future__",
                                                                        "dataclasses"):
                assert node.level == 1, f"{path.name}: imports {node.module}"
            assert not isinstance(node, ast.Import), f"{path.name}: imports {node.names[0].name}"


def _lower(table, constants=None):
    from fucina.codegen.lowering import lower_table

    return lower_table(table, constants or {})


@pytest.mark.parametrize("body, words", [
    ("x + y", "unknown name 'y'"),
    ("nosuch(x)", "unknown function 'nosuch'"),
    ("_two(x, x)", "_two expects 1 arguments, got 2"),
    ("x ** 2", "Pow is not in the template language"),
    ("0 < x < 1", "chained comparison"),
    ("x and x", "BoolOp is not in the template language"),
    ("y = x +", "invalid syntax"),
    ("y = x", "expected a result line last"),
    ("_back(x)", "calls itself via bad -> _back -> bad"),
])
def test_a_bad_template_is_refused_at_lowering_naming_it(body, words):
    from fucina.codegen.lowering import TemplateError
    from fucina.kernel_templates.template import Template as T


    table = {"bad": T("x", body), "_two": T("x", "2 * x"), "_back": T("x", "bad(x)")}
    with pytest.raises(TemplateError, match="template bad: .*" + re.escape(words)):
        _lower(table)


def test_constant_subexpressions_fold_in_float64_and_round_once():
    """`x * (1 / 30)` multiplies by fl32(1/30), not by fl32(fl32(1)/fl32(30)): the constant
    a formula names is the value its Python spelling has, rounded to float32 once."""
    from llvmlite import ir

    from fucina.kernel_templates.template import Template as T

    (arity, emit), = _lower({"k": T("x", "x * (1 / 30 + C)")}, {"C": 2.0 ** -30}).values()
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.FloatType(), [ir.FloatType()]), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    y = emit(b, fn.args[0])
    want = float(np.float32(1 / 30 + 2.0 ** -30))
    assert arity == 1 and y.opname == "fmul" and float(y.operands[1].constant) == want
