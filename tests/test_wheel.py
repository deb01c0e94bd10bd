"""The wheel (issue 16 item 1): built from this checkout, installed into a fresh venv outside
it, its `fucina` console script runs — the applications ship in the package, not in tools/."""
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(ROOT)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    (whl,) = out.glob("fucina-*.whl")
    return whl


def test_the_wheel_holds_the_applications_and_the_script(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("fucina/cli/__init__.py", "fucina/cli/finetune.py", "fucina/cli/export.py",
                 "fucina/cli/chat.py", "fucina/cli/info.py", "fucina/cli/prewarm.py",
                 "fucina/cli/es_finetune.py", "fucina/cli/manifests/tests.jsonl",
                 "fucina/__main__.py", "fucina/runtime/_rt.c",
                 "fucina/kernel_templates/activations.py", "fucina/codegen/lowering.py"):
        assert must in names, must
    assert any(n.startswith("fucina/runtime/_rt") and n.endswith(".so") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fucina = fucina.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith(("tools/", "examples/", "tests/")) for n in names)


def test_installed_outside_the_checkout_it_runs(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # without PYTHONPATH (a checkout on it, as under `prewarm --record`, would make pip think
    # fucina is already installed and skip the wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    # the dependencies (numpy, llvmlite, ...) come from this environment through a path entry
    # (appended after the venv's own site-packages, and no .pth of this environment runs, so
    # the editable checkout stays invisible): the installed wheel is what runs
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cwd = tmp_path
    where = subprocess.run([str(py), "-c", "import fucina; print(fucina.__file__)"], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    fucina = venv / "bin" / "fucina"
    p = subprocess.run([str(fucina), "--help"], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "es-finetune" in p.stdout, p.stderr
    p = subprocess.run([str(fucina), "prewarm", "--check"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode in (0, 1), p.stderr       # 1 = some shipped keys are not warm here
    assert "total" in p.stdout and "warm" in p.stdout, p.stdout
