"""DESIGN §2: a layer imports only layers below it. Checked on the source, statically."""
import ast
from pathlib import Path

import fucina

ROOT = Path(fucina.__file__).parent
# lower number = lower layer; errors.py and files.py are shared by all
LAYERS = {"errors": -1, "files": -1, "runtime": 0, "codegen": 1, "kernel_templates": 1,
          "exec": 2, "axes": 3, "ag": 4, "optim": 5, "io": 5, "gguf": 5, "es": 5,
          "es_ternary": 5, "lora": 5, "rng": 5,
          "llm": 6, "dist": 6, "cli": 7, "__main__": 7}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "fucina" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def imports(path: Path, module: str):
    tree = ast.parse(path.read_text())
    pkg = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for a in node.names:  # "from . import vmath" names a module too
                yield f"{target}.{a.name}", node.lineno


def test_imports_point_down():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)
        own = layer_of(module)
        if own is None:
            continue
        for target, line in imports(path, module):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({module}) imports {target}")
    assert not bad, "imports pointing up a layer:\n" + "\n".join(bad)
