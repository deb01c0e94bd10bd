"""Micro-benchmarks of the C runtime (fucina.runtime._rt); prints small tables.

    python benchmarks/bench_runtime.py [--quick] [--only=overhead|forkjoin|crossover ...]

1. launch overhead of an inline tiny job, against calling the same C function through ctypes;
   plus a pool alloc/release cycle and reading a buffer's address;
2. 2-thread fork-join latency with a spinning worker and with a parked one;
3. the crossover: from which cost (bytes touched) a 2-thread launch of scale_f32 beats the inline
   call (sizes 4 KiB ... 4 MiB, medians of many interleaved runs). The smallest cost from which
   the team wins at every larger size is the suggested default inline threshold
   (RT_DEFAULT_INLINE_THRESHOLD in fucina/runtime/_rt.c).

Numbers depend on the machine and on its load: the script prints the load average next to them.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time

import numpy as np

from fucina.runtime import _rt

HUGE = 1 << 40  # a cost that always passes the inline threshold (it is set to 0 anyway below)


def kaddr(name: str) -> int:
    return _rt.test_kernel_addr(name)


def per_call_ns(fn, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time per call of fn(calls) (fn loops itself)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(calls)
        out.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(out)


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


# ---------------------------------------------------------------------------------------------
# 1. inline launch overhead
# ---------------------------------------------------------------------------------------------

def bench_overhead(quick: bool) -> dict:
    calls, reps = (50_000, 5) if quick else (200_000, 9)
    noop = kaddr("noop")
    launch = _rt.launch
    argv = (ctypes.c_int64 * 8)(*range(8))
    argp = ctypes.addressof(argv)
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
    cfn = proto(noop)

    def rt0(n):
        for _ in range(n):
            launch(None, noop, 1, 0)

    def rt6(n):
        for _ in range(n):
            launch(None, noop, 1, 0, 140000000000, 140000001000, 4096, 1024, 7, 0x3E99999A)

    def ct(n):
        for _ in range(n):
            cfn(argp, 0, 1)

    def loop(n):
        for _ in range(n):
            pass

    pool = _rt.Pool()
    alloc = pool.alloc

    def pool_cycle(n):
        for _ in range(n):
            alloc(4096, True)  # dies at once: back to the free list

    buf = pool.alloc(4096, True)
    arr = np.frombuffer(buf, np.float32)

    def addr_int(n):
        for _ in range(n):
            buf.addr

    def addr_np(n):
        for _ in range(n):
            arr.ctypes.data

    base = per_call_ns(loop, calls, reps)
    res = {
        "launch inline, 0 args": per_call_ns(rt0, calls, reps) - base,
        "launch inline, 6 args": per_call_ns(rt6, calls, reps) - base,
        "ctypes CFUNCTYPE call (args ptr, c0, c1)": per_call_ns(ct, calls, reps) - base,
        "Pool.alloc(4096, f32) + release": per_call_ns(pool_cycle, calls, reps) - base,
        "Buffer.addr": per_call_ns(addr_int, calls, reps) - base,
        "ndarray.ctypes.data": per_call_ns(addr_np, calls, reps) - base,
    }
    table("1. per-call overhead (ns, median, empty-loop cost subtracted)", ["call", "ns"],
          [[k, f"{v:.0f}"] for k, v in res.items()])
    return res


# ---------------------------------------------------------------------------------------------
# 2. fork-join latency
# ---------------------------------------------------------------------------------------------

def bench_fork_join(quick: bool) -> dict:
    reps = 300 if quick else 2000
    team = _rt.Team(2, spin_us=50)
    noop, stamp = kaddr("noop"), kaddr("stamp")
    launch = _rt.launch
    out = np.zeros(4, np.int64)
    outp = out.ctypes.data
    busy = 20  # us per chunk: long enough for a woken worker to take the second chunk

    def run(parked: bool, kernel: int, extra: tuple):
        lat, wake, took = [], [], 0
        for _ in range(reps):
            if parked:
                deadline = time.perf_counter() + 1.0
                time.sleep(0.0003)
                while team.parked_workers() < 1 and time.perf_counter() < deadline:
                    time.sleep(0.0002)
            out[:] = -1
            t0 = time.perf_counter_ns()
            launch(team, kernel, 2, HUGE, *extra)
            t1 = time.perf_counter_ns()
            lat.append(t1 - t0)
            if kernel == stamp:
                for c in range(2):
                    if out[2 * c] == 1:
                        took += 1
                        wake.append(out[2 * c + 1] - t0)
        med = statistics.median(lat) / 1e3
        w = statistics.median(wake) / 1e3 if wake else float("nan")
        return med, w, took / reps

    old = _rt.set_inline_threshold(0)
    try:
        for _ in range(200):  # warm up
            launch(team, noop, 2, HUGE)
        rows, res = [], {}
        for parked in (False, True):
            state = "parked" if parked else "spinning"
            med, _, _ = run(parked, noop, ())
            rows.append([f"noop x2 chunks, worker {state}", f"{med:.2f}", "", ""])
            res[f"noop_{state}_us"] = med
            med, w, frac = run(parked, stamp, (outp, busy))
            rows.append([f"{busy} us x2 chunks, worker {state}", f"{med:.2f}",
                         f"{w:.2f}", f"{frac:.0%}"])
            res[f"busy_{state}_us"] = med
            res[f"wake_{state}_us"] = w
    finally:
        _rt.set_inline_threshold(old)
        team.close()
    table(f"2. 2-thread fork-join (median over {reps}; ideal for {busy} us x2 = {busy} us)",
          ["job", "launch us", "worker starts after us", "worker took a chunk"], rows)
    return res


# ---------------------------------------------------------------------------------------------
# 3. crossover
# ---------------------------------------------------------------------------------------------

def _wait_parked(team, want: bool, timeout: float = 1.0) -> None:
    """Bring the worker to a known state: parked (sleep until it parks) or awake and spinning
    (a no-op job wakes it; wait until it has left the futex)."""
    deadline = time.perf_counter() + timeout
    if want:
        while team.parked_workers() < 1 and time.perf_counter() < deadline:
            time.sleep(0.0002)
    else:
        if team.parked_workers() > 0:
            _rt.launch(team, kaddr("noop"), 2, HUGE)
        while team.parked_workers() > 0 and time.perf_counter() < deadline:
            pass


def bench_crossover(quick: bool) -> dict:
    team = _rt.Team(2, spin_us=50)
    scale = kaddr("scale_f32")
    launch = _rt.launch
    bits = int(np.array([0.5], np.float32).view(np.uint32)[0])
    sizes = [4096 << i for i in range(11)]  # 4 KiB ... 4 MiB of f32 input
    rng = np.random.default_rng(0)
    jobs = {}
    for nbytes in sizes:
        n = nbytes // 4
        src = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(src)
        args = (src.ctypes.data, dst.ctypes.data, n)
        jobs[nbytes] = (src, dst, {
            "inline": (None, 1, 2 * nbytes) + args + (n, bits),
            "2 chunks": (team, 2, 2 * nbytes) + args + (-(-n // 2), bits),
            "8 chunks": (team, 8, 2 * nbytes) + args + (-(-n // 8), bits),
        })  # cost = bytes read + written
    variants = ["inline", "2 chunks", "8 chunks"]
    passes, parked_passes = (400, 30) if quick else (2000, 150)
    times = {(s, v): [] for s in sizes for v in variants + ["8 chunks, parked"]}
    old = _rt.set_inline_threshold(0)
    try:
        for s in sizes:  # warm caches and pages
            for v in variants:
                a = jobs[s][2][v]
                launch(a[0], scale, *a[1:])
        # Round-robin over sizes and variants: a burst of load from elsewhere hits every size
        # alike instead of skewing one. Team runs start with the worker awake and spinning.
        for p in range(passes):
            for s in sizes:
                order = variants[p % 3:] + variants[:p % 3]
                for v in order:
                    a = jobs[s][2][v]
                    if a[0] is not None:
                        _wait_parked(team, False)
                    t0 = time.perf_counter_ns()
                    launch(a[0], scale, *a[1:])
                    times[(s, v)].append(time.perf_counter_ns() - t0)
        # The first op after a pause: the worker is asleep when the launch begins.
        for p in range(parked_passes):
            for s in sizes:
                a = jobs[s][2]["8 chunks"]
                _wait_parked(team, True)
                t0 = time.perf_counter_ns()
                launch(a[0], scale, *a[1:])
                times[(s, "8 chunks, parked")].append(time.perf_counter_ns() - t0)
    finally:
        _rt.set_inline_threshold(old)
        team.close()

    res, rows = {}, []
    for s in sizes:
        med = {v: statistics.median(times[(s, v)]) / 1e3 for v in variants + ["8 chunks, parked"]}
        res[s] = med
        rows.append([f"{s // 1024} KiB", f"{2 * s // 1024} KiB", f"{med['inline']:.2f}",
                     f"{med['2 chunks']:.2f}", f"{med['8 chunks']:.2f}",
                     f"{med['8 chunks, parked']:.2f}",
                     f"{med['inline'] / med['2 chunks']:.2f}x",
                     f"{med['inline'] / med['8 chunks']:.2f}x",
                     f"{med['inline'] / med['8 chunks, parked']:.2f}x"])
    table(f"3. scale_f32: inline vs 2-thread team (median us of {passes} interleaved runs, "
          f"{parked_passes} parked;\n   cost = bytes read + written; 'parked' = the worker was "
          f"asleep when the launch began)",
          ["input", "cost", "inline", "team/2ch", "team/8ch", "team/8ch parked",
           "speedup 2ch", "speedup 8ch", "speedup 8ch parked"], rows)

    def crossover(variant):
        wins = [res[s]["inline"] > res[s][variant] for s in sizes]
        for i in range(len(sizes)):
            if all(wins[i:]):
                return 2 * sizes[i]
        return None

    cx = {v: crossover(v) for v in ("2 chunks", "8 chunks", "8 chunks, parked")}
    for v, c in cx.items():
        print(f"  team wins from cost >= {c // 1024 if c else '-'} KiB on ({v})")
    return {"sizes": res, "crossover": cx}


def _cpu_ticks():
    """(busy ticks of the whole machine, ticks used by this process) from /proc, or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            w = f.read().rsplit(")", 1)[1].split()
        return sum(v) - v[3] - v[4], int(w[11]) + int(w[12])
    except (OSError, ValueError, IndexError):
        return None


def others_load(fn, *args):
    """Run fn; report how much of the machine other processes used meanwhile (they skew the
    team numbers: a worker without a CPU of its own cannot help)."""
    t0, c0 = time.perf_counter(), _cpu_ticks()
    out = fn(*args)
    t1, c1 = time.perf_counter(), _cpu_ticks()
    if c0 and c1:
        hz = os.sysconf("SC_CLK_TCK")
        other = ((c1[0] - c0[0]) - (c1[1] - c0[1])) / hz / ((t1 - t0) * (os.cpu_count() or 1))
        print(f"  (other processes used {max(other, 0.0):.0%} of the machine meanwhile)")
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quick = "--quick" in argv
    only = {a.split("=", 1)[1] for a in argv if a.startswith("--only=")}
    load = os.getloadavg()
    print(f"fucina runtime benchmark: {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, inline threshold now "
          f"{_rt.get_inline_threshold()} B")
    if not only or "overhead" in only:
        others_load(bench_overhead, quick)
    if not only or "forkjoin" in only:
        others_load(bench_fork_join, quick)
    if only and "crossover" not in only:
        return
    res = others_load(bench_crossover, quick)
    cx = res["crossover"]
    c = [cx[v] for v in ("2 chunks", "8 chunks") if cx[v]]
    if c:
        print(f"\ncrossover with a spinning worker (the common case inside a chain of ops): "
              f"{max(c) // 1024} KiB; compiled-in default inline threshold: "
              f"{_rt.DEFAULT_INLINE_THRESHOLD // 1024} KiB")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
