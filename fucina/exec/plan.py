"""Recorded launch plans: run a region of ops once per position, keep what it launched, and
replay it from C in one call (runtime `run_plan`).

A decode step of a language model is ~300 small launches whose Python dispatch costs as much as
the kernels. Between two steps only a few launch values change, and they change linearly with
the position: the KV-cache row written, the RoPE rows read, the number of keys attended. So:

    with plan.record(ctx) as r1: step(x1)       # three consecutive positions, run for real
    with plan.record(ctx) as r2: step(x1 + 1)
    with plan.record(ctx) as r3: step(x1 + 2)
    p = plan.Plan.fit([r1, r2, r3], x1)         # None when the region is not replayable
    p.run(ctx, x)                               # the region's launches at position x

A recording holds every buffer the region allocated (so its memory is never reused) and the
launches as (kernel, chunks, cost, args). `fit` maps each address inside the second and third
recordings' buffers to the same offset in the first's, then asks every value for the form
a + b·x: equal values are constants, a difference is the slope, and the third recording must
match the prediction exactly. Anything else — a different kernel, launch count, buffer size or
a value that is not affine — and there is no plan (the caller stays on the eager path). Data
written into the region's buffers from Python (not by a launch) is not seen by `fit`; a caller
checks the replay against an eager result once before trusting it (fucina/llm/generation.py).

Replays run each launch exactly as `launch` would (same chunks, same inline-or-team rule), so
they give the eager step's bits.
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager

import numpy as np

from ..runtime import _rt

__all__ = ["Recording", "record", "Plan"]

_MASK = (1 << 64) - 1


class Recording:
    """The launches and the allocations of one run of a region."""

    __slots__ = ("launches", "buffers")

    def __init__(self):
        self.launches: list = []    # (addr, n_chunks, cost, args)
        self.buffers: list = []     # every Buffer allocated, in order (kept alive)

    def locate(self):
        """value -> (buffer index, offset) for values inside one of this recording's buffers."""
        spans = sorted((b.addr, b.addr + b.nbytes, i) for i, b in enumerate(self.buffers))
        starts = [s[0] for s in spans]

        def find(v):
            j = bisect.bisect_right(starts, v) - 1
            if j >= 0 and v < spans[j][1]:
                return spans[j][2], v - spans[j][0]
            return None
        return find


class _Pool:
    """The context's pool, noting every buffer it hands out into a recording."""

    def __init__(self, pool, rec: Recording):
        self._pool, self._rec = pool, rec

    def alloc(self, *args, **kw):
        buf = self._pool.alloc(*args, **kw)
        self._rec.buffers.append(buf)
        return buf

    def __getattr__(self, name):
        return getattr(self._pool, name)


@contextmanager
def record(ctx):
    """Run the body's ops as usual while noting their launches and allocations."""
    rec = Recording()
    run = ctx.launch

    def launch(addr, n_chunks, cost, *args):
        rec.launches.append((addr, n_chunks, cost, args))
        run(addr, n_chunks, cost, *args)

    pool = ctx.pool
    ctx.launch, ctx.pool = launch, _Pool(pool, rec)
    try:
        yield rec
    finally:
        del ctx.launch
        ctx.pool = pool


class Plan:
    """A region's launches as affine functions of a position x (see the module docstring).
    `buffers`: the first recording's, which every replay reuses."""

    def __init__(self, array: np.ndarray, buffers: list, launches: int):
        self.array, self.buffers, self.launches = array, buffers, launches

    @classmethod
    def fit(cls, recs: list, x0: int) -> "Plan | None":
        """The plan of three recordings made at positions x0, x0 + 1, x0 + 2, or None."""
        r1, r2, r3 = recs
        if not (len(r1.launches) == len(r2.launches) == len(r3.launches)
                and len(r1.buffers) == len(r2.buffers) == len(r3.buffers)):
            return None
        if any(b1.nbytes != b2.nbytes or b1.nbytes != b3.nbytes
               for b1, b2, b3 in zip(r1.buffers, r2.buffers, r3.buffers)):
            return None
        base = [b.addr for b in r1.buffers]
        find2, find3 = r2.locate(), r3.locate()

        def into_first(v, find):
            at = find(v)
            return v if at is None else base[at[0]] + at[1]

        words = []
        for (f1, n1, c1, a1), (f2, n2, c2, a2), (f3, n3, c3, a3) in zip(
                r1.launches, r2.launches, r3.launches):
            if not f1 == f2 == f3 or not len(a1) == len(a2) == len(a3):
                return None
            fitted = []
            for v1, v2, v3 in zip((n1, c1, *a1), (n2, c2, *a2), (n3, c3, *a3)):
                v2, v3 = into_first(v2, find2), into_first(v3, find3)
                slope = v2 - v1
                if v3 - v2 != slope:
                    return None
                fitted.append(((v1 - slope * x0) & _MASK, slope & _MASK))
            (na, nb), (ca, cb), args = fitted[0], fitted[1], fitted[2:]
            words += [f1, len(args), na, nb, ca, cb, *(a for a, _ in args), *(b for _, b in args)]
        array = np.array([w & _MASK for w in words], dtype=np.uint64).view(np.int64)
        return cls(array, list(r1.buffers), len(r1.launches))

    def run(self, ctx, x: int) -> None:
        """Every launch of the region at position x, in one call."""
        ctx.check_open("Plan.run")
        team = ctx.team() if ctx.threads > 1 else None
        _rt.run_plan(team, self.array, int(x))
