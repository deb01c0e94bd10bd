"""The on-disk kernel cache (DESIGN §4) and tools/prewarm.

Every scenario runs the library in fresh subprocesses, each with its own temporary cache
directory and an explicit environment (FUCINA_ASSERT_WARM and FUCINA_CACHE removed unless the
test sets them): cold vs warm runs, damaged entries, an unwritable cache, two racing processes,
FUCINA_ASSERT_WARM, FUCINA_CACHE=0, and prewarming from a recorded manifest.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fucina.codegen import cache

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 180

# Several kernel families and layouts: binary with broadcast, binary with a scalar param, unary
# exp and relu, sums over the outer and the inner axis, sum_all, conversion to bf16. Sizes are
# not multiples of the vector width, so the masked tails run too.
OPS = r"""
import json, sys, time
import numpy as np
import fucina as fu
from fucina.codegen import kernels

out = sys.argv[1]
start = float(sys.argv[2]) if len(sys.argv) > 2 else None
rng = np.random.default_rng(7)
a_np = rng.standard_normal((5, 37)).astype(np.float32)
b_np = rng.standard_normal(37).astype(np.float32)
ctx = fu.ExecContext(threads=1)
a = ctx.tensor(a_np, tags=("a", "b"))
b = ctx.tensor(b_np, tags=("b",))
if start is not None:  # line up with the other process, then both ask for the same kernels
    time.sleep(max(0.0, start - time.time()))
res = {
    "add_bcast": (a + b).numpy(),
    "scale": (a * 2.0).numpy(),
    "exp": a.exp().numpy(),
    "relu_sub": (a - b).relu().numpy(),
    "sum_a": a.sum("a").numpy(),
    "sum_b": a.sum("b").numpy(),
    "sum_all": a.sum_all().numpy(),
    "bf16": a.to("bf16").numpy(),
}
ctx.close()
np.savez(out, **res)
print(json.dumps({"compiled": kernels.stats.compiled, "loaded": kernels.stats.loaded}))
"""


# ---------------------------------------------------------------------------- helpers

def make_env(cache_dir, **over) -> dict:
    """os.environ for a child: its own cache dir, no inherited ASSERT_WARM / CACHE switches, and
    no manifest recording (its kernels land in its private cache, not the suite's).

    Keyword values override variables; None removes one."""
    env = dict(os.environ)
    for k in ("FUCINA_ASSERT_WARM", "FUCINA_CACHE", "FUCINA_RECORD_MANIFEST"):
        env.pop(k, None)
    env["FUCINA_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for k, v in over.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_py(args, env, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=TIMEOUT)
    if check:
        assert p.returncode == 0, f"{args[:2]} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture
def ops_script(tmp_path) -> Path:
    p = tmp_path / "ops.py"
    p.write_text(OPS)
    return p


def run_ops(script, cache_dir, out, *extra, **env_over):
    """Run the ops script; returns (stats dict, outputs dict)."""
    p = run_py([str(script), str(out), *extra], make_env(cache_dir, **env_over))
    return json.loads(p.stdout.strip().splitlines()[-1]), load(out)


def load(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_bits(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), f"{k}: results differ bitwise"


def assert_correct(res: dict):
    """The outputs against numpy (the same inputs as OPS)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((5, 37)).astype(np.float32)
    b = rng.standard_normal(37).astype(np.float32)
    np.testing.assert_array_equal(res["add_bcast"], a + b)
    np.testing.assert_array_equal(res["scale"], a * np.float32(2.0))
    np.testing.assert_allclose(res["exp"], np.exp(a.astype(np.float64)), rtol=1e-6)
    np.testing.assert_array_equal(res["relu_sub"], np.maximum(a - b, 0))
    np.testing.assert_allclose(res["sum_a"], a.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res["sum_b"], a.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res["sum_all"], a.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res["bf16"], a, rtol=2 ** -8)


def entries(root: Path) -> list[Path]:
    return sorted(Path(root).rglob("*.o"))


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def verifies(root: Path, entry: Path) -> bool:
    return cache.read(Path(root), bytes.fromhex(entry.stem)) is not None


def assert_clean(root: Path):
    """Only verified entries: no temp file left behind, nothing that does not verify."""
    files = all_files(root)
    strays = [p.name for p in files if p.suffix != ".o"]
    assert not strays, f"temp files left in the cache: {strays}"
    bad = [p.name for p in files if not verifies(root, p)]
    assert not bad, f"entries that do not verify: {bad}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The OPS outputs from a cold run in a cache of their own, checked against numpy."""
    d = tmp_path_factory.mktemp("reference")
    stats, res = run_ops(_write(d / "ops.py", OPS), d / "cache", d / "out.npz")
    assert stats["compiled"] > 0
    assert_correct(res)
    return res


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------- 1. cold vs warm

def test_cold_then_warm_is_bitwise_identical(tmp_path, ops_script, reference):
    root = tmp_path / "cache"
    cold, res_cold = run_ops(ops_script, root, tmp_path / "cold.npz")
    assert cold["compiled"] >= 7 and cold["loaded"] == 0, cold
    assert len(entries(root)) == cold["compiled"]
    assert_clean(root)

    warm, res_warm = run_ops(ops_script, root, tmp_path / "warm.npz", FUCINA_ASSERT_WARM="1")
    assert warm == {"compiled": 0, "loaded": cold["compiled"]}, warm
    assert_same_bits(res_warm, res_cold)
    assert_same_bits(res_cold, reference)


# ---------------------------------------------------------------------------- 2. damaged cache

def _damage(mode: str, data: bytes, foreign: bytes) -> bytes:
    if mode == "truncate":
        return data[:len(data) // 2]
    if mode == "flip_body":  # a byte in the object code
        i = len(data) * 3 // 4
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
    if mode == "flip_header":  # a byte of the key digest stored in the header
        return data[:20] + bytes([data[20] ^ 0x80]) + data[21:]
    if mode == "empty":
        return b""
    if mode == "zeros":
        return bytes(len(data))
    if mode == "foreign":  # another key's (intact) entry under this key's name
        return foreign
    raise AssertionError(mode)


DAMAGE = ["truncate", "flip_body", "flip_header", "empty", "zeros", "foreign"]


def test_damaged_entries_are_misses_and_get_rewritten(tmp_path, ops_script, reference):
    root = tmp_path / "cache"
    cold, _ = run_ops(ops_script, root, tmp_path / "cold.npz")
    ents = entries(root)
    assert len(ents) == cold["compiled"] >= len(DAMAGE) + 1
    original = {p: p.read_bytes() for p in ents}
    # damage every entry but one (the control, which must be loaded untouched), each of the
    # damage modes at least once
    intact, damaged = ents[-1], ents[:-1]
    for i, p in enumerate(damaged):
        mode = DAMAGE[i % len(DAMAGE)]
        foreign = original[ents[(i + 1) % len(ents)]]
        p.write_bytes(_damage(mode, original[p], foreign))
        assert not verifies(root, p), mode
    before = {p: os.stat(p) for p in ents}

    stats, res = run_ops(ops_script, root, tmp_path / "again.npz")
    assert_same_bits(res, reference)
    assert stats == {"compiled": len(damaged), "loaded": 1}, stats
    after = {p: os.stat(p) for p in ents}
    assert after[intact].st_ino == before[intact].st_ino
    assert after[intact].st_mtime_ns == before[intact].st_mtime_ns
    for p in damaged:  # republished through a temp file and os.replace
        assert after[p].st_ino != before[p].st_ino, p.name
    assert entries(root) == ents
    assert_clean(root)
    for p in ents:  # recompiling gives the very same object code
        assert p.read_bytes() == original[p], p.name


def test_unwritable_cache_dir_still_computes(tmp_path, ops_script, reference):
    """A cache root that cannot be created (it sits under a regular file): results stay right.
    (A chmod-0500 directory proves nothing here: CI runs as root, which ignores mode bits.)"""
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    root = f / "cache"  # mkdir under a regular file fails with NotADirectoryError
    for run in ("first", "second"):
        stats, res = run_ops(ops_script, root, tmp_path / f"{run}.npz")
        assert stats["compiled"] > 0 and stats["loaded"] == 0, stats
        assert_same_bits(res, reference)
    assert f.read_text() == "not a directory"



# ---------------------------------------------------------------------------- 3. racing processes

def test_two_processes_racing_on_one_empty_cache(tmp_path, ops_script, reference):
    root = tmp_path / "cache"
    start = time.time() + 1.5  # both have imported fucina (~0.3 s) well before this
    procs = [subprocess.Popen([sys.executable, str(ops_script), str(tmp_path / f"r{i}.npz"),
                               repr(start)], env=make_env(root), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    n = stats[0]["compiled"] + stats[0]["loaded"]
    assert n >= 7 and all(s["compiled"] + s["loaded"] == n for s in stats), stats
    r0, r1 = load(tmp_path / "r0.npz"), load(tmp_path / "r1.npz")
    assert_same_bits(r0, r1)
    assert_same_bits(r0, reference)
    assert len(entries(root)) == n
    assert_clean(root)
    # and a third process finds every kernel warm
    warm, res = run_ops(ops_script, root, tmp_path / "warm.npz", FUCINA_ASSERT_WARM="1")
    assert warm == {"compiled": 0, "loaded": n}
    assert_same_bits(res, reference)


# ---------------------------------------------------------------------------- 4. ASSERT_WARM

def test_assert_warm_on_empty_cache_raises(tmp_path, ops_script):
    root = tmp_path / "cache"
    p = run_py([str(ops_script), str(tmp_path / "out.npz")],
               make_env(root, FUCINA_ASSERT_WARM="1"), check=False)
    assert p.returncode != 0
    m = re.search(r"^fucina\.errors\.KernelCacheError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    msg = m.group(1)
    assert re.search(r"\b(elementwise|reduce)\b", msg), msg  # names the family
    assert "expected a warm cache" in msg, msg
    assert not (tmp_path / "out.npz").exists()
    assert not root.exists() or all_files(root) == []


# ---------------------------------------------------------------------------- 5. FUCINA_CACHE=0

def test_cache_disabled_writes_nothing(tmp_path, ops_script, reference):
    root = tmp_path / "cache"
    root.mkdir()
    for run in ("first", "second"):
        stats, res = run_ops(ops_script, root, tmp_path / f"{run}.npz", FUCINA_CACHE="0")
        assert stats["compiled"] >= 7 and stats["loaded"] == 0, stats
        assert_same_bits(res, reference)
    assert list(root.rglob("*")) == []


# ---------------------------------------------------------------------------- 6. read / write

OBJ = bytes(range(256)) * 9


def _digest(s: str) -> bytes:
    import hashlib

    return hashlib.sha256(s.encode()).digest()


def test_write_read_round_trip(tmp_path):
    d = _digest("k1")
    assert cache.read(tmp_path, d) is None
    cache.write(tmp_path, d, "fk_one", OBJ)
    assert cache.read(tmp_path, d) == ("fk_one", OBJ)
    cache.write(tmp_path, d, "fk_one", OBJ[::-1])  # rewriting an entry replaces it
    assert cache.read(tmp_path, d) == ("fk_one", OBJ[::-1])
    cache.write(tmp_path, _digest("k2"), "fk_two", b"")
    assert cache.read(tmp_path, _digest("k2")) == ("fk_two", b"")
    files = all_files(tmp_path)
    assert len(files) == 2 and all(p.suffix == ".o" for p in files), files  # no temp files
    assert {p.stem for p in files} == {_digest("k1").hex(), _digest("k2").hex()}


def test_wrong_digest_in_header_is_a_miss(tmp_path):
    d1, d2 = _digest("k1"), _digest("k2")
    cache.write(tmp_path, d1, "fk_one", OBJ)
    cache.write(tmp_path, d2, "fk_two", OBJ)
    (p1,) = [p for p in entries(tmp_path) if p.stem == d1.hex()]
    (p2,) = [p for p in entries(tmp_path) if p.stem == d2.hex()]
    p2.write_bytes(p1.read_bytes())  # a self-consistent entry, but for another key
    assert cache.read(tmp_path, d2) is None
    assert cache.read(tmp_path, d1) == ("fk_one", OBJ)


@pytest.mark.parametrize("mode", DAMAGE[:-1])
def test_damaged_entry_is_a_miss(tmp_path, mode):
    d = _digest("k")
    cache.write(tmp_path, d, "fk_k", OBJ)
    (p,) = entries(tmp_path)
    p.write_bytes(_damage(mode, p.read_bytes(), b""))
    assert cache.read(tmp_path, d) is None


def test_write_to_unwritable_root_is_not_fatal(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    cache.write(f / "cache", _digest("k"), "fk_k", OBJ)  # must not raise
    assert cache.read(f / "cache", _digest("k")) is None
    assert all_files(tmp_path) == [f]


# ---------------------------------------------------------------------------- 7. prewarm

RECORD = r"""
import json
import numpy as np
import fucina as fu
from fucina.codegen import kernels

ctx = fu.ExecContext(threads=1)
a = ctx.tensor(np.arange(40, dtype=np.float32).reshape(2, 20), tags=("a", "b"))
b = ctx.tensor(np.arange(20, dtype=np.float32), tags=("b",))
for _ in range(2):  # each distinct key is recorded once
    (a + b).sum("a").numpy(); a.exp().sum_all().numpy(); (a * 0.5).to("bf16").numpy()
ctx.close()
print(json.dumps({"compiled": kernels.stats.compiled, "loaded": kernels.stats.loaded}))
"""


def _count(label: str, text: str) -> int:
    m = re.search(rf"\b{label} (\d+)", text)
    assert m, f"no '{label} N' in:\n{text}"
    return int(m.group(1))


def test_prewarm_compiles_a_recorded_manifest_and_checks_it(tmp_path):
    manifest = tmp_path / "m.jsonl"
    p = run_py(["-c", RECORD], make_env(tmp_path / "rec_cache", FUCINA_RECORD_MANIFEST=str(manifest)))
    n = json.loads(p.stdout.strip().splitlines()[-1])["compiled"]
    lines = manifest.read_text().splitlines()
    assert n >= 5 and len(lines) == len(set(lines)) == n

    warm = tmp_path / "warm"
    p = run_py(["-m", "tools.prewarm", "--manifest", str(manifest), "--jobs", "2"], make_env(warm))
    out = p.stdout
    assert (_count("total", out), _count("already warm", out), _count("compiled", out),
            _count("failed", out)) == (n, 0, n, 0), out
    assert re.search(rf"warm load: {n} kernels in [\d.]+ ms", out), out
    assert len(entries(warm)) == n
    assert_clean(warm)

    p = run_py(["-m", "tools.prewarm", "--manifest", str(manifest), "--check"], make_env(warm))
    assert (_count("warm", p.stdout), _count("missing", p.stdout)) == (n, 0), p.stdout

    # a second prewarm finds everything warm and compiles nothing
    p = run_py(["-m", "tools.prewarm", "--manifest", str(manifest), "--jobs", "2", "--no-bench"],
               make_env(warm))
    assert (_count("already warm", p.stdout), _count("compiled", p.stdout)) == (n, 0), p.stdout

    # what prewarm wrote is exactly what the library looks up: a warm run compiles nothing
    p = run_py(["-c", RECORD], make_env(warm, FUCINA_ASSERT_WARM="1"))
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"compiled": 0, "loaded": n}

    empty = tmp_path / "empty"
    p = run_py(["-m", "tools.prewarm", "--manifest", str(manifest), "--check"], make_env(empty),
               check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert _count("missing", p.stdout) == n
    assert any(line in p.stdout for line in lines), p.stdout  # names a missing key
    assert not empty.exists() or all_files(empty) == []  # --check compiles nothing


def test_prewarm_unknown_workload_is_a_clear_error(tmp_path):
    p = run_py(["-m", "tools.prewarm", "--workload", "no_such_workload", "--check"],
               make_env(tmp_path / "c"), check=False)
    assert p.returncode != 0
    assert "no manifest for workload 'no_such_workload'" in p.stderr, p.stderr


# ---------------------------------------------------------------------------- loader robustness

EXTCALL = r"""
import ctypes, dataclasses
import numpy as np
import fucina as fu
from fucina.codegen import kernels

@kernels.register
@dataclasses.dataclass(frozen=True)
class ExtCallKey(kernels.KernelKey):
    family = "test_extcall"
    fn: str

    def ir(self, symbol):
        return (f"declare float @{self.fn}(float)\n"
                f"define float @{symbol}(float %x) {{\n"
                f"  %y = call float @{self.fn}(float %x)\n  ret float %y\n}}\n")

f = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_float)(kernels.get(ExtCallKey("expf")))
assert abs(f(1.0) - 2.7182817) < 1e-6, f(1.0)
ctx = fu.ExecContext(threads=1)
a_np = np.linspace(-3, 3, 37, dtype=np.float32)
a = ctx.tensor(a_np, tags=("i",))
np.testing.assert_array_equal((a + a).numpy(), a_np + a_np)
np.testing.assert_array_equal((a * 3.0).numpy(), a_np * np.float32(3))
ctx.close()
"""


@pytest.mark.parametrize("cached", [False, True], ids=["no_cache", "cold_then_warm"])
def test_kernel_calling_an_external_symbol_does_not_break_later_kernels(tmp_path, cached):
    """Any kernel may reference libm / memset / compiler-rt (LLVM inserts such calls itself);
    the kernels loaded after it must still compute correctly."""
    over = {"FUCINA_RECORD_MANIFEST": None}  # a test-only family must not reach a manifest
    if not cached:
        over["FUCINA_CACHE"] = "0"
    for _ in range(2 if cached else 1):
        run_py(["-c", EXTCALL], make_env(tmp_path / "cache", **over))


THREADS = r"""
import threading
import fucina
from fucina.codegen import kernels
from fucina.codegen.elementwise import ElementwiseKey

keys = [ElementwiseKey(op, ("f32", "f32"), "f32", r, ("unit", role))
        for op in ("add", "sub", "mul", "maximum") for r in (1, 2, 3)
        for role in ("unit", "zero", "strided")]
keys += [ElementwiseKey(op, (dt,), dt, 1, ("unit",))
         for op in ("neg", "relu", "copy") for dt in ("f32", "f16", "bf16")]
got = {}

def work(ks):
    for k in ks:
        got[k] = kernels.get(k)

ts = [threading.Thread(target=work, args=(keys[i::4] + keys,)) for i in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
assert len(got) == len(keys) and all(got.values())
print(kernels.stats.compiled, kernels.stats.loaded)
"""


def test_threads_resolving_kernels_at_once(tmp_path):
    for run in ("cold", "warm", "warm again", "no cache"):
        over = {"FUCINA_CACHE": "0"} if run == "no cache" else {}
        run_py(["-c", THREADS], make_env(tmp_path / "cache", **over))


def test_a_killed_writer_leaves_the_shard_clean(tmp_path):
    """Entries are written through fucina.files: an unnamed temp file (nothing to leave when a
    writer dies), and a named temp that a dead writer left in a shard is swept by the next
    write into it."""
    from fucina import files
    from fucina.codegen import cache
    digest = bytes(range(32))
    shard = tmp_path / digest.hex()[:2]
    shard.mkdir()
    dead = shard / f"x.o.tmp.999999999.{files._HOST_TAG}00000000"
    dead.write_bytes(b"half an entry")
    cache.write(tmp_path, digest, "k", b"\x7fELF object")
    assert sorted(p.name for p in shard.iterdir()) == [f"{digest.hex()}.o"]
    assert cache.read(tmp_path, digest) == ("k", b"\x7fELF object")
