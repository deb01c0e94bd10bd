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

A region whose launches do not move at all (a training step on samples of one length: the
data changes, not the shapes) is captured once instead (`capture`, `Fixed`): it runs from a
pool of its own that reuses memory as the context's would, so the replay's working set is the
step's peak, not the sum of everything it allocated; what the host writes (uploads, zeroed
flags, pointer tables) stays where it was put, and `Fixed.feed` swaps an upload's bytes
(the next sample's tokens).
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager

import numpy as np

from ..errors import InvalidArgument
from ..runtime import _rt

__all__ = ["Recording", "record", "Plan", "Capture", "capture", "Fixed"]

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


def _words(f, fitted) -> list:
    """One launch of run_plan's array: kernel, argument count, then (a, b) of the chunk count,
    of the cost, and of every argument as value = a + b·x (fitted: those pairs in that order)."""
    (na, nb), (ca, cb), args = fitted[0], fitted[1], fitted[2:]
    return [f, len(args), na, nb, ca, cb, *(a for a, _ in args), *(b for _, b in args)]


def _array(words) -> np.ndarray:
    return np.array([w & _MASK for w in words], dtype=np.uint64).view(np.int64)


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
            words += _words(f1, fitted)
        return cls(_array(words), list(r1.buffers), len(r1.launches))

    def run(self, ctx, x: int) -> None:
        """Every launch of the region at position x, in one call."""
        ctx.check_open("Plan.run")
        team = ctx.team() if ctx.threads > 1 else None
        _rt.run_plan(team, self.array, int(x))


# ---- fixed replays: a region whose launches do not change between runs -----------------------

FIXED_HOLD_BYTES = 1 << 16   # byte-arm buffers up to this size are held by a capture (below)


class Capture:
    """One run of a region, kept for replay with its memory (see `capture`).

    launches: (addr, n_chunks, cost, args) in order. uploads: (buffer, host bytes) of every
    from_numpy in the region, in order. held: buffers the region's memory reuse must never hand
    out again (uploads, zero-filled ones, small byte buffers). zeroed: the zero-filled ones.
    pool: the region's own pool; its memory (held, outstanding and cached) is every address
    the launches use besides memory that outlives the region anyway (weights, parameters)."""

    __slots__ = ("launches", "uploads", "held", "zeroed", "pool")

    def __init__(self, pool):
        self.launches: list = []
        self.uploads: list = []
        self.held: list = []
        self.zeroed: list = []
        self.pool = pool


class _CapturePool:
    """ctx.pool during a capture: the capture's own pool, reusing memory inside the region as
    the context's pool would, except for buffers the host may write besides the kernels: a
    zero-filled buffer (a flag, an accumulator) and a small byte buffer (an index, a pointer
    table) are held for the capture's lifetime, so what the host put there is still there when
    a replay's launches read it (zero-filled ones are zeroed again before each replay)."""

    def __init__(self, cap: Capture):
        self._cap = cap

    def alloc(self, nbytes, f32_arm, zero=False):
        buf = self._cap.pool.alloc(nbytes, f32_arm, zero)
        if zero:
            self._cap.held.append(buf)
            self._cap.zeroed.append(buf)
        elif not f32_arm and nbytes <= FIXED_HOLD_BYTES:
            self._cap.held.append(buf)
        return buf

    def __getattr__(self, name):
        return getattr(self._cap.pool, name)


@contextmanager
def capture(ctx):
    """Run the body's ops as usual, from a pool of their own, noting every launch and every
    upload: `Fixed(cap)` then replays the region in one call. The pool caches what the region
    frees (no limit), so its memory is the region's working set and stays valid for replays;
    nothing but the region allocates from it (a caller may run the region eagerly in it again
    when that leaves no buffer behind, as llm.decoder.replay's check does)."""
    cap = Capture(_rt.Pool(max_cached_bytes=1 << 62))
    run, upload = ctx.launch, ctx.from_numpy

    def launch(addr, n_chunks, cost, *args):
        cap.launches.append((addr, n_chunks, cost, args))
        run(addr, n_chunks, cost, *args)

    def from_numpy(*args, **kw):
        t = upload(*args, **kw)
        cap.held.append(t.buf)
        cap.uploads.append((t.buf, np.frombuffer(t.buf, np.uint8, t.lay.nbytes).copy()))
        return t

    pool = ctx.pool
    ctx.launch, ctx.from_numpy, ctx.pool = launch, from_numpy, _CapturePool(cap)
    try:
        yield cap
    finally:
        del ctx.launch, ctx.from_numpy
        ctx.pool = pool


class Fixed:
    """A captured region replayed as it ran: the same launches with the same arguments, the
    uploads written again (`feed` replaces one's bytes), zero-filled buffers zeroed again.
    Valid while no launch value depends on data the region read back (the caller checks one
    replay against an eager run) and the memory outside the capture's pool that the launches
    use is alive and unmoved (weights and parameters written in place)."""

    def __init__(self, cap: Capture):
        words = []
        for f, n, c, a in cap.launches:     # every value constant: slope 0
            words += _words(f, [(v, 0) for v in (n, c, *a)])
        self.array = _array(words)
        self.cap = cap
        self.bytes = [data for _, data in cap.uploads]

    def upload_index(self, data: np.ndarray) -> int | None:
        """The one upload whose bytes are those of `data`, or None (none, or several)."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        hits = [i for i, (_, d) in enumerate(self.cap.uploads)
                if d.size == raw.size and np.array_equal(d, raw)]
        return hits[0] if len(hits) == 1 else None

    def feed(self, index: int, data: np.ndarray) -> None:
        """Upload `index` writes these bytes (the same size) from the next run on."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
        if raw.size != self.bytes[index].size:
            raise InvalidArgument(f"plan.Fixed.feed: expected {self.bytes[index].size} bytes for "
                                  f"upload {index}, got {raw.size}")
        self.bytes[index] = raw

    def run(self, ctx) -> None:
        ctx.check_open("plan.Fixed.run")
        for (buf, _), data in zip(self.cap.uploads, self.bytes):
            np.frombuffer(buf, np.uint8, data.size)[:] = data
        for buf in self.cap.zeroed:
            np.frombuffer(buf, np.uint8)[:] = 0
        team = ctx.team() if ctx.threads > 1 else None
        _rt.run_plan(team, self.array, 0)

    def release(self) -> None:
        """Give the capture's cached memory back (buffers still referenced stay valid)."""
        self.cap.pool.trim()
