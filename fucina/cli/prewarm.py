"""Compile ahead of time the kernels a workload needs, so later runs only load them (DESIGN §4).

    fucina prewarm                       # every manifest shipped in fucina/cli/manifests/
    fucina prewarm --workload tests      # fucina/cli/manifests/tests.jsonl
    fucina prewarm --manifest my.jsonl   # an explicit manifest (repeatable)
    fucina prewarm --check               # is every key warm? compiles nothing
    fucina prewarm --record tests        # re-record tests.jsonl (also tour, demo, finetune; needs
                                         # a source checkout: the workloads live there)

`python -m tools.prewarm` is the same command in a checkout.

A manifest holds one kernel key per line, as `KernelKey.to_json()` writes it; a run records one
with FUCINA_RECORD_MANIFEST=path. Keys not yet in the cache are compiled in parallel worker
processes (each one imports fucina and calls `kernels.get(key)`, which compiles the kernel and
writes the disk cache). After a full prewarm a fresh process loads every key from the cache
and the time it takes is reported.

Exit status: 0 when every key is warm (or was compiled), 1 when a key failed or is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the source checkout (for --record)
MANIFESTS = Path(__file__).resolve().parent / "manifests"   # shipped in the wheel
SHOW = 10  # how many missing / failed keys to print
WORKLOADS = {
    "tests": ["-m", "pytest", "-q", "tests"],
    "tour": ["-m", "examples.tour"],
    "demo": ["-m", "examples.spirals"],
    "finetune": ["-m", "fucina", "finetune", "--tiny"],
}


# ---------------------------------------------------------------------------- manifests

def canonical(line: str) -> str:
    """One key's JSON text in the form `KernelKey.to_json()` gives it (sorted keys)."""
    return json.dumps(json.loads(line), sort_keys=True)


def read_manifests(paths) -> list[str]:
    """Every distinct key line of the given manifests, sorted. Blank and '#' lines are skipped."""
    keys = set()
    for p in paths:
        for n, raw in enumerate(Path(p).read_text(encoding="utf-8").splitlines(), 1):
            raw = raw.strip()
            if not raw or raw.startswith("#"):
                continue
            try:
                keys.add(canonical(raw))
            except json.JSONDecodeError as e:
                raise SystemExit(f"prewarm: {p}:{n}: not a JSON key line ({e})")
    return sorted(keys)


def manifest_paths(workload: str | None, manifests: list[str] | None) -> list[Path]:
    paths = [Path(m) for m in manifests or []]
    if workload is None and paths:
        return paths
    if workload in (None, "all"):
        found = sorted(MANIFESTS.glob("*.jsonl"))
        if not found:
            raise SystemExit(f"prewarm: no manifests in {MANIFESTS} (record one with --record tests)")
        return paths + found
    p = MANIFESTS / f"{workload}.jsonl"
    if not p.is_file():
        have = ", ".join(sorted(q.stem for q in MANIFESTS.glob("*.jsonl"))) or "none"
        raise SystemExit(f"prewarm: no manifest for workload {workload!r}: {p} is missing "
                         f"(recorded workloads: {have})")
    return paths + [p]


def import_families() -> dict[str, str]:
    """Import fucina and every codegen module, so every kernel family is registered.

    Returns {module: error} for modules that failed to import (their keys will then fail)."""
    import importlib
    import pkgutil

    import fucina  # noqa: F401  (registers the families the library itself uses)
    from fucina import codegen

    errors = {}
    for m in pkgutil.iter_modules(codegen.__path__):
        name = f"{codegen.__name__}.{m.name}"
        try:
            importlib.import_module(name)
        except Exception as e:  # a half-written module must not stop the other families
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def parse_keys(lines):
    """[(line, key or None, error or None)]"""
    from fucina.codegen import kernels

    out = []
    for line in lines:
        try:
            out.append((line, kernels.key_from_json(line), None))
        except KeyError as e:
            out.append((line, None, f"unknown kernel family {e}"))
        except Exception as e:
            out.append((line, None, f"bad key: {type(e).__name__}: {e}"))
    return out


def is_warm(root, key) -> bool:
    from fucina.codegen import cache, kernels

    return root is not None and cache.read(root, kernels.digest(key)) is not None


def short(line: str, width: int = 150) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def compact(line: str) -> str:
    """A key for people: `elementwise op=add in_dtypes=f32,f32 rank=2 ...`."""
    d = json.loads(line)

    def fmt(v):
        return ",".join(fmt(x) for x in v) if isinstance(v, list) else str(v)

    return " ".join([d.get("family", "?")] + [f"{k}={fmt(v)}" for k, v in d.get("fields", {}).items()])


def shown(paths) -> str:
    out = []
    for p in paths:
        p = Path(p).resolve()
        out.append(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p))
    return ", ".join(out)


# ---------------------------------------------------------------------------- workers

def _worker_init():
    os.environ.pop("FUCINA_ASSERT_WARM", None)
    os.environ.pop("FUCINA_RECORD_MANIFEST", None)
    import_families()


def _worker_build(line: str):
    """Compile (or, if another process got there first, load) one key: (status, seconds, error)."""
    try:
        from fucina.codegen import kernels

        key = kernels.key_from_json(line)
        before, seconds = kernels.stats.compiled, kernels.stats.compile_seconds
        kernels.get(key)
        if kernels.stats.compiled > before:
            return "compiled", kernels.stats.compile_seconds - seconds, None
        return "warm", 0.0, None
    except Exception as e:
        return "failed", 0.0, f"{type(e).__name__}: {e}"


def _compile_all(todo: list[str], jobs: int):
    """{line: (status, seconds, error)} for every line, compiled over `jobs` worker processes."""
    import multiprocessing

    results = {}
    if not todo:
        return results
    # spawn, not fork: the parent has LLVM initialised and a fork would inherit its state
    mp = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp, initializer=_worker_init) as ex:
        futures = {ex.submit(_worker_build, line): line for line in todo}
        for fut in as_completed(futures):
            line = futures[fut]
            try:
                results[line] = fut.result()
            except BrokenProcessPool:
                results[line] = ("failed", 0.0, "a worker process died (crash in the compiler?)")
            except Exception as e:
                results[line] = ("failed", 0.0, f"{type(e).__name__}: {e}")
    return results


# ---------------------------------------------------------------------------- warm load

_LOAD_SNIPPET = r"""
import json, sys, time
t0 = time.perf_counter()
import fucina
from fucina.cli.prewarm import import_families
import_families()
from fucina.codegen import kernels
t1 = time.perf_counter()
keys = [kernels.key_from_json(l) for l in open(sys.argv[1], encoding="utf-8").read().splitlines() if l]
from fucina.codegen import jit
kernels.fingerprint()  # one-time setup: llvmlite.binding, host target, the MCJIT engine
jit.loader()
t2 = time.perf_counter()
for k in keys:
    kernels.get(k)
t3 = time.perf_counter()
print(json.dumps({"keys": len(keys), "loaded": kernels.stats.loaded,
                  "compiled": kernels.stats.compiled, "import_s": t1 - t0,
                  "setup_s": t2 - t1, "load_s": t3 - t2}))
"""


def warm_load(lines: list[str]) -> dict:
    """Time a fresh process loading every key from the cache (FUCINA_ASSERT_WARM=1: no compile)."""
    with tempfile.TemporaryDirectory(prefix="fucina-prewarm-") as d:
        keys = Path(d) / "keys.jsonl"
        keys.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        env = dict(os.environ, FUCINA_ASSERT_WARM="1")
        env.pop("FUCINA_RECORD_MANIFEST", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        p = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET, str(keys)], env=env, cwd=ROOT,
                           capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": tail}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- commands

def cmd_prewarm(lines, sources, jobs: int, bench: bool) -> int:
    from fucina.codegen import cache

    os.environ.pop("FUCINA_ASSERT_WARM", None)  # we are here to compile
    os.environ.pop("FUCINA_RECORD_MANIFEST", None)  # and not to record our own keys
    root = cache.cache_dir()
    if root is None:
        print("prewarm: FUCINA_CACHE=0 disables the kernel cache; nothing to prewarm", file=sys.stderr)
        return 1
    print(f"prewarm: {len(lines)} keys from {sources}; cache {root}")
    parsed = parse_keys(lines)
    failed = {line: err for line, key, err in parsed if err}
    warm = [line for line, key, err in parsed if key is not None and is_warm(root, key)]
    warm_set = set(warm)
    todo = [line for line, key, err in parsed if key is not None and line not in warm_set]

    jobs = max(1, min(jobs, len(todo))) if todo else 0
    t0 = time.perf_counter()
    results = _compile_all(todo, jobs)
    wall = time.perf_counter() - t0
    times = {}
    n_warm = len(warm)
    for line, (status, seconds, err) in results.items():
        if status == "compiled":
            times[line] = seconds
        elif status == "warm":
            n_warm += 1
        else:
            failed[line] = err

    print(f"  total {len(lines)}, already warm {n_warm}, compiled {len(times)}, failed {len(failed)}")
    if todo:
        print(f"  compile wall time {wall:.2f} s with {jobs} job{'s' * (jobs != 1)}")
    if times:
        per = sorted(times.values())
        slow = max(times, key=times.get)
        print(f"  per-kernel compile time: mean {1e3 * statistics.fmean(per):.0f} ms, "
              f"median {1e3 * statistics.median(per):.0f} ms, max {1e3 * per[-1]:.0f} ms, "
              f"sum {sum(per):.2f} s; slowest: {compact(slow)}")
    for line in sorted(failed)[:SHOW]:
        print(f"  FAILED {short(line)}\n         {failed[line]}")
    if len(failed) > SHOW:
        print(f"  ... and {len(failed) - SHOW} more failed")
    if failed:
        return 1
    if bench and lines:
        r = warm_load(lines)
        if "error" in r:
            print(f"  warm load: FAILED in a fresh process: {r['error']}")
            return 1
        rate = r["loaded"] / r["load_s"] if r["load_s"] > 0 else float("inf")
        print(f"  warm load: {r['loaded']} kernels in {r['load_s'] * 1e3:.1f} ms in a fresh process "
              f"({rate:.0f} kernels/s, {r['load_s'] * 1e3 / max(r['loaded'], 1):.2f} ms each; "
              f"before that: import fucina {r['import_s']:.2f} s, "
              f"LLVM + engine setup {r['setup_s'] * 1e3:.0f} ms)")
    return 0


def cmd_check(lines, sources) -> int:
    from fucina.codegen import cache

    os.environ["FUCINA_ASSERT_WARM"] = "1"  # belt and braces: this command never compiles
    root = cache.cache_dir()
    print(f"check: {len(lines)} keys from {sources}; cache {root or '(disabled by FUCINA_CACHE=0)'}")
    missing = []
    for line, key, err in parse_keys(lines):
        if err is not None:
            missing.append((line, err))
        elif not is_warm(root, key):
            missing.append((line, "not in the cache"))
    print(f"  total {len(lines)}, warm {len(lines) - len(missing)}, missing {len(missing)}")
    for line, why in missing[:SHOW]:
        print(f"  missing ({why}): {short(line)}")
    if len(missing) > SHOW:
        print(f"  ... and {len(missing) - SHOW} more missing")
    return 1 if missing else 0


def cmd_record(name: str) -> int:
    if name not in WORKLOADS:
        raise SystemExit(f"prewarm: unknown workload {name!r} to record (known: {', '.join(WORKLOADS)})")
    if name == "tour" and not (ROOT / "examples" / "tour.py").is_file() \
            and not (ROOT / "examples" / "tour" / "__main__.py").is_file():
        print("prewarm: skipping --record tour: examples/tour.py does not exist yet")
        return 0
    out = MANIFESTS / f"{name}.jsonl"
    with tempfile.TemporaryDirectory(prefix="fucina-record-") as d:
        rec = Path(d) / "keys.jsonl"
        rec.touch()
        env = dict(os.environ, FUCINA_RECORD_MANIFEST=str(rec))
        env.pop("FUCINA_ASSERT_WARM", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = [sys.executable, *WORKLOADS[name]]
        print(f"record: running {' '.join(WORKLOADS[name])} with FUCINA_RECORD_MANIFEST", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        keys = read_manifests([rec])
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(k + "\n" for k in keys), encoding="utf-8")
    os.replace(tmp, out)
    print(f"record: {len(keys)} distinct keys -> {out} "
          f"({time.perf_counter() - t0:.1f} s)")
    if rc != 0:
        print(f"record: warning: the workload exited with status {rc}; the manifest holds the keys "
              f"it reached")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fucina prewarm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", metavar="NAME",
                    help="the shipped manifest NAME.jsonl, or 'all' (the default: every manifest there)")
    ap.add_argument("--manifest", metavar="PATH", action="append",
                    help="an explicit manifest file (repeatable)")
    ap.add_argument("--check", action="store_true",
                    help="only verify that every key is warm; compile nothing; exit 1 if one is missing")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                    help="worker processes (default: the CPU count)")
    ap.add_argument("--record", metavar="NAME",
                    help=f"run a workload ({', '.join(WORKLOADS)}) and write its shipped manifest NAME.jsonl")
    ap.add_argument("--no-bench", action="store_true",
                    help="skip timing the warm load in a fresh process after prewarming")
    a = ap.parse_args(argv)
    if a.record:
        return cmd_record(a.record)
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    paths = manifest_paths(a.workload, a.manifest)
    try:
        lines = read_manifests(paths)
    except OSError as e:
        print(f"prewarm: cannot read a manifest: {e}", file=sys.stderr)
        return 1
    sources = shown(paths)
    errors = import_families()
    for mod, err in errors.items():
        print(f"prewarm: warning: {mod} does not import ({err}); its keys will fail", file=sys.stderr)
    if a.check:
        return cmd_check(lines, sources)
    return cmd_prewarm(lines, sources, a.jobs, bench=not a.no_bench)


if __name__ == "__main__":
    sys.exit(main())
