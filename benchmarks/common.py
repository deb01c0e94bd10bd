"""Timing helpers shared by the bench modules: interleaved medians, bandwidth, rows, tables.

How every speed here is measured (the machine is shared and noisy):

* The competitors run in one process, interleaved: one block of Fucina calls, one block of
  PyTorch calls, then PyTorch first and Fucina second (A B B A ...), so slow drifts of the machine
  hit both sides alike. A block repeats the statement enough times to last `block_s`; the figure
  reported is the median over blocks of (block time / calls). Ratios compare medians.
* Statements given as strings are timed with `timeit` (the loop is compiled, no wrapper call per
  iteration, gc off during a block), so a tiny op's figure is the op's own cost.
* Memory bandwidth is measured, not looked up: the runtime's built-in C kernel `scale_f32`
  (dst = src * s, compiled with the runtime, no JIT) over 64 MiB -> 64 MiB through the runtime's
  launch, on a 1-thread and a 2-thread team; bytes moved = bytes read + bytes written (the STREAM
  convention, write-allocate traffic not counted); best of several runs.
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
import timeit
from dataclasses import dataclass, field

MiB = 1 << 20
BIG_ELEMS = 16 << 20  # 16 Mi f32 elements = 64 MiB


# ---------------------------------------------------------------------------------------------
# optional competitor

_torch = None


def torch():
    """The torch module, or None when it is not installed (rows then show no PyTorch column)."""
    global _torch
    if _torch is None:
        try:
            import torch as t
        except ImportError:
            t = False
        _torch = t
    return _torch or None


def thread_counts() -> tuple[int, ...]:
    n = os.cpu_count() or 1
    return (1, 2) if n >= 2 else (1,)


@contextlib.contextmanager
def torch_threads(k: int):
    t = torch()
    if t is None:
        yield
        return
    old = t.get_num_threads()
    t.set_num_threads(k)
    try:
        yield
    finally:
        t.set_num_threads(old)


# ---------------------------------------------------------------------------------------------
# timing

@dataclass
class Timing:
    samples: list = field(default_factory=list)  # seconds per call, one per block

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(p75 - p25) / median over blocks: how noisy this figure was."""
        if len(self.samples) < 4:
            return 0.0
        q = statistics.quantiles(self.samples, n=4)
        return (q[2] - q[0]) / self.median


def _timer(stmt, env):
    if callable(stmt):
        return timeit.Timer(stmt)
    return timeit.Timer(stmt, globals=env)


def interleaved(cases: dict, *, env: dict | None = None, repeats: int = 7,
                block_s: float = 0.05, warmup: int = 2, max_calls: int = 1 << 22) -> dict:
    """Time several statements against each other, interleaved A B B A ...

    `cases` maps a name to a statement string (evaluated in `env`) or a zero-argument callable.
    Returns name -> Timing (seconds per call). Each case is warmed up (`warmup` calls: first
    use compiles or loads kernels, faults pages in) and calibrated to about `block_s` per block.
    """
    env = dict(env or {})
    timers = {name: _timer(stmt, env) for name, stmt in cases.items()}
    calls = {}
    for name, t in timers.items():
        t.timeit(max(warmup, 1))
        n, el = 1, t.timeit(1)
        while el < block_s / 10 and n < max_calls:  # grow until a block is measurable
            n *= 10
            el = t.timeit(n)
        calls[name] = max(1, min(max_calls, int(n * block_s / max(el, 1e-9))))
    out = {name: Timing() for name in timers}
    order = list(timers)
    for r in range(repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            n = calls[name]
            out[name].samples.append(timers[name].timeit(n) / n)
    return out


def best_of(fn, runs: int) -> float:
    """Best wall time of `runs` calls of fn()."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------------------------------------
# memory bandwidth (STREAM-style scale through the runtime's C kernel)

_bandwidth: dict = {}
BW_BYTES = 64 * MiB


def bandwidth(threads: int, runs: int = 15) -> float:
    """Bytes/s of dst = src * 2 over 64 MiB -> 64 MiB on a `threads` team (read + write counted).

    Measured once per process and thread count, the best of `runs` launches after a warm-up.
    """
    if threads in _bandwidth:
        return _bandwidth[threads]
    import numpy as np

    from fucina.exec.elementwise import f32_bits
    from fucina.runtime import _rt

    n = BW_BYTES // 4
    chunk = 1 << 15
    pool = _rt.Pool()
    src, dst = pool.alloc(n * 4, True), pool.alloc(n * 4, True)
    np.frombuffer(src, np.float32)[:] = 1.0  # fault the pages in before timing
    np.frombuffer(dst, np.float32)[:] = 0.0
    team = _rt.Team(threads)
    addr = _rt.test_kernel_addr("scale_f32")
    args = (team, addr, -(-n // chunk), 2 * n * 4, src.addr, dst.addr, n, chunk, f32_bits(2.0))
    try:
        _rt.launch(*args)
        t = best_of(lambda: _rt.launch(*args), runs)
    finally:
        team.close()
        del src, dst
        pool.close()
    _bandwidth[threads] = 2 * n * 4 / t
    return _bandwidth[threads]


# ---------------------------------------------------------------------------------------------
# rows and tables

def row(group: str, what: str, threads, fucina: float | None, torch_s: float | None = None, *,
        target: str = "", met: bool | None = None, note: str = "", unit: str = "time",
        ratio: float | None = None) -> dict:
    """One table row. fucina/torch_s are seconds (unit="time"); ratio = torch / fucina,
    so > 1 means Fucina is faster. met: True / False / None (no target)."""
    if ratio is None and fucina and torch_s:
        ratio = torch_s / fucina
    return {"group": group, "what": what, "threads": threads, "fucina": fucina, "torch": torch_s,
            "ratio": ratio, "target": target, "met": met, "note": note, "unit": unit}


def guarded(group: str, what: str, fn) -> list[dict]:
    """fn() -> rows; an exception becomes one row saying what failed instead of ending the run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a benchmark run reports, it does not crash
        return [row(group, what, "", None, met=False, note=f"error: {type(e).__name__}: {e}")]


def faults_per_call(stmt, env: dict, calls: int = 5) -> float:
    """Minor page faults per execution of `stmt` (after one warm-up execution)."""
    import resource

    code = compile(stmt, "<faults>", "exec") if isinstance(stmt, str) else None
    run = (lambda: exec(code, env)) if code else stmt
    run()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        run()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1e-6:
        return f"{s * 1e9:.0f} ns"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs" if s < 1e-5 else f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_gbs(bps: float) -> str:
    return f"{bps / 1e9:.1f} GB/s"


def _status(met):
    return {True: "met", False: "**missed**", None: "—"}[met]


HEADER = ("| group | what | threads | Fucina | PyTorch | torch/fucina | target | status | note |\n"
          "|---|---|---|---|---|---|---|---|---|")


def table(rows: list[dict]) -> str:
    lines = [HEADER]
    for r in rows:
        fu, to = r.get("fucina"), r.get("torch")
        if r.get("unit", "time") == "time":
            fu_s, to_s = fmt_time(fu), fmt_time(to)
        else:
            fu_s = "—" if fu is None else f"{fu:g} {r['unit']}"
            to_s = "—" if to is None else f"{to:g} {r['unit']}"
        ratio = r.get("ratio")
        lines.append("| " + " | ".join([
            str(r.get("group", "")), str(r.get("what", r)), str(r.get("threads", "")), fu_s, to_s,
            "—" if ratio is None else f"{ratio:.2f}", str(r.get("target", "")),
            _status(r.get("met")), str(r.get("note", "")).replace("|", "/")]) + " |")
    return "\n".join(lines)


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f"{kb / (1 << 20):.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    vers = {}
    for mod in ("numpy", "llvmlite", "torch"):
        try:
            vers[mod] = __import__(mod).__version__
        except ImportError:
            vers[mod] = "absent"
    try:
        from fucina.codegen.target import host

        h = host()
        isa = f"{h.cpu}, {h.vector_bits}-bit vectors"
    except Exception:  # noqa: BLE001 - informative only
        isa = "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "mem": mem, "llvm_cpu": isa,
            "os": f"{platform.system()} {platform.release()}",
            "python": sys.version.split()[0], **vers}


def main(rows_fn, argv=None) -> None:
    """Entry point of a bench module run alone: `python -m benchmarks.bench_x [--quick]`."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = ap.parse_args(argv)
    print(table(rows_fn(args.quick)))
