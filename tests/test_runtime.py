"""The C runtime (fucina.runtime._rt): pool size classes and reuse order (SPEC R-2), buffers and
the buffer protocol, borrow(), the worker team and launch() (SPEC R-3, DESIGN §5)."""

import ctypes
import faulthandler
import gc
import os
import random
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from fucina import runtime as rt

KiB = 1024
MiB = 1024 * 1024
HUGE_COST = 1 << 40  # always above the inline threshold


def kaddr(name):
    return rt.test_kernel_addr(name)


@contextmanager
def inline_threshold(n):
    old = rt.set_inline_threshold(n)
    try:
        yield
    finally:
        rt.set_inline_threshold(old)


@contextmanager
def hang_guard(seconds=60):
    """A lost wake-up would hang forever: dump the stacks and exit instead."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def team2():
    t = rt.Team(2)
    yield t
    t.close()


# --------------------------------------------------------------------------------------------
# Pool: size classes
# --------------------------------------------------------------------------------------------

def f32_class(nbytes):
    n = -(-nbytes // 4)
    if n <= 1024:
        c = 1
        while c < n:
            c *= 2
    else:
        c = -(-n // 1024) * 1024
    return 4 * c


F32_CASES = [
    # bytes -> capacity in bytes
    (1, 4), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (12, 16), (16, 16), (17, 32),
    (1023, 1024), (1024, 1024), (1025, 2048), (2047, 2048), (2048, 2048), (2049, 4096),
    (4 * 1023, 4096), (4 * 1024 - 1, 4096), (4 * 1024, 4096),  # 1023, 1024 elements
    (4 * 1024 + 1, 8192), (4 * 1025, 8192), (4 * 2047, 8192), (4 * 2048, 8192),
    (4 * 2049, 4 * 3072), (4 * 3072, 4 * 3072), (4 * 3073, 4 * 4096),
    (MiB, MiB), (MiB + 4, MiB + 4096),
]

SLAB_CASES = [
    (1, 4096), (2, 4096), (1023, 4096), (1024, 4096), (1025, 4096), (2047, 4096),
    (4095, 4096), (4096, 4096), (4097, 8192), (8191, 8192), (8192, 8192), (8193, 12288),
    (MiB, MiB), (MiB + 1, MiB + 4096),
]


@pytest.mark.parametrize("nbytes,cap", F32_CASES)
def test_f32_size_classes(nbytes, cap):
    assert f32_class(nbytes) == cap  # the table agrees with the spec's rule
    p = rt.Pool()
    b = p.alloc(nbytes, True)
    assert (b.nbytes, b.capacity, b.pooled, b.f32_arm, b.readonly) == (nbytes, cap, True, True, False)
    assert b.addr % 64 == 0
    del b
    assert p.cached_buffers() == 1 and p.cached_slabs() == 0 and p.cached_bytes() == cap


@pytest.mark.parametrize("nbytes,cap", SLAB_CASES)
def test_slab_size_classes(nbytes, cap):
    p = rt.Pool()
    b = p.alloc(nbytes, False)
    assert (b.nbytes, b.capacity, b.pooled, b.f32_arm) == (nbytes, cap, True, False)
    assert b.addr % 64 == 0
    del b
    assert p.cached_slabs() == 1 and p.cached_buffers() == 0 and p.cached_bytes() == cap


def test_same_class_reuses_and_next_class_does_not():
    p = rt.Pool()
    for f32, nbytes, same, bigger in [
        (True, 4 * 1023, 4 * 1024, 4 * 1025),
        (True, 4 * 1025, 4 * 2048, 4 * 2049),
        (True, 5, 7, 9),
        (False, 1, 4096, 4097),
        (False, 4097, 8192, 8193),
    ]:
        b = p.alloc(nbytes, f32)
        a = b.addr
        del b
        b = p.alloc(same, f32)
        assert b.addr == a, (f32, nbytes, same)
        c = p.alloc(bigger, f32)  # the cached one is taken; and it would not fit anyway
        assert c.addr != a
        del b, c
        p.trim()


def test_alloc_rejects_bad_sizes():
    p = rt.Pool()
    with pytest.raises(ValueError):
        p.alloc(0, True)
    with pytest.raises(ValueError):
        p.alloc(0, False)
    with pytest.raises(ValueError):
        p.alloc(-8, True)
    with pytest.raises(TypeError):
        p.alloc(8.0, True)
    with pytest.raises(TypeError):
        p.alloc("8", True)
    with pytest.raises(TypeError):
        p.alloc(8)
    with pytest.raises(TypeError):
        p.alloc(8, True, False, 1)
    with pytest.raises(TypeError):
        p.alloc(8, True, bogus=1)
    with pytest.raises(TypeError):
        p.alloc(8, True, nbytes=8)
    with pytest.raises(MemoryError):
        p.alloc(1 << 62, False)
    assert p.outstanding_buffers() == 0 and p.stats()["allocs"] == 0
    b = p.alloc(nbytes=8, f32_arm=True, zero=True)
    assert b.nbytes == 8
    b = p.alloc(np.int64(8), np.bool_(False))  # __index__ / truthiness are enough
    assert b.capacity == 4096
    with pytest.raises(ValueError):
        rt.Pool(-1)


def test_zero_clears_reused_memory():
    p = rt.Pool()
    b = p.alloc(4096, True)
    np.frombuffer(b, np.uint8)[:] = 0xAB
    a = b.addr
    del b
    b = p.alloc(4000, True, zero=True)
    assert b.addr == a
    assert not np.frombuffer(b, np.uint8).any()
    b2 = p.alloc(4096, False, zero=True)
    assert not np.frombuffer(b2, np.uint8).any()


# --------------------------------------------------------------------------------------------
# Pool: reuse order, arms
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("f32", [True, False])
def test_first_fit_ascending_lifo_within_class(f32):
    p = rt.Pool()
    unit = 4096 if f32 else 4096  # both arms: 4096 is a class boundary
    a = p.alloc(unit, f32)
    b = p.alloc(unit, f32)
    c = p.alloc(4 * unit, f32)
    d = p.alloc(2 * unit, f32)
    A, B, C, D = a.addr, b.addr, c.addr, d.addr
    del a, c, d, b  # release order a, c, d, b
    assert p._free_list(f32) == [(unit, B), (unit, A), (2 * unit, D), (4 * unit, C)]
    # LIFO within a class: the newest release of the class comes back first
    x = p.alloc(unit, f32)
    assert x.addr == B
    y = p.alloc(unit - 3, f32)
    assert y.addr == A
    # first fit: the smallest entry whose capacity holds the request
    z = p.alloc(unit + 1, f32)
    assert z.addr == D and z.capacity == 2 * unit
    w = p.alloc(3, f32)  # nothing small is left: the smallest that fits is the big one
    assert w.addr == C and w.capacity == 4 * unit and w.nbytes == 3
    assert p._free_list(f32) == []
    assert p.stats()["reuses"] == 4 and p.stats()["allocs"] == 4


@pytest.mark.parametrize("f32", [True, False])
def test_first_fit_is_bounded(f32):
    """A small request does not take a cached buffer more than twice its size and 64 KiB
    bigger (it would pin memory the next big request then has to fault in anew)."""
    p = rt.Pool()
    big = p.alloc(1 << 24, f32)
    B = big.addr
    del big
    small = p.alloc(1 << 12, f32)
    assert small.addr != B and p._free_list(f32) == [(1 << 24, B)]
    half = p.alloc((1 << 23) + 4096, f32)   # within 2x: reused
    assert half.addr == B and half.capacity == 1 << 24
    del half
    near = p.alloc(1 << 20, f32)   # 1 MiB from a 16 MiB entry: a fresh buffer
    assert near.addr != B


def test_peak_bytes():
    p = rt.Pool()
    a = p.alloc(1 << 20, True)
    b = p.alloc(1 << 21, True)
    del a
    st = p.stats()
    assert st["outstanding_bytes"] == 1 << 21 and st["peak_bytes"] == 3 << 20
    assert p.reset_peak() == 3 << 20 and p.stats()["peak_bytes"] == 1 << 21
    del b
    assert p.stats()["outstanding_bytes"] == 0


def test_free_list_stays_sorted_under_random_traffic():
    rng = random.Random(1234)
    p = rt.Pool()
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(p.alloc(rng.choice([1, 3, 64, 1000, 4096, 5000, 70000]), rng.random() < 0.5))
        for f32 in (True, False):
            caps = [c for c, _ in p._free_list(f32)]
            assert caps == sorted(caps)
        assert p.cached_bytes() == sum(c for f in (True, False) for c, _ in p._free_list(f))
        assert p.outstanding_buffers() == len(live)
    live.clear()
    assert p.outstanding_buffers() == 0


def test_arms_are_separate_and_slabs_cross_dtypes():
    p = rt.Pool()
    f = p.alloc(8192, True)
    fa = f.addr
    del f
    s = p.alloc(8192, False)  # the cached f32 buffer is not handed to the byte arm
    assert s.addr != fa
    sa = s.addr
    del s
    # a slab released by one dtype (say int8) serves another (say f16)
    s2 = p.alloc(1000 * 2, False)
    assert s2.addr == sa and s2.capacity == 8192
    assert p.cached_buffers() == 1 and p.cached_slabs() == 0


def test_spec_r2_acceptance_chain_of_32():
    """Deinit-ASAP chain of 32 same-shaped 1 MiB ops touches 2 buffers; holding all, 32."""
    p = rt.Pool()
    touched = set()
    x = p.alloc(MiB, True)  # op 1's output
    touched.add(x.addr)
    for _ in range(31):
        y = p.alloc(MiB, True)  # next op's output while its input is alive
        touched.add(y.addr)
        x = y  # the input dies here
    del x, y
    assert len(touched) == 2
    assert p.stats()["allocs"] == 2 and p.stats()["reuses"] == 30

    p = rt.Pool()
    held = [p.alloc(MiB, True) for _ in range(32)]
    assert len({b.addr for b in held}) == 32
    del held
    assert p.cached_buffers() == 32 and p.outstanding_buffers() == 0


# --------------------------------------------------------------------------------------------
# Pool: cap, counters, trim, close
# --------------------------------------------------------------------------------------------

def test_cap_drops_oversized_and_overflowing_releases():
    p = rt.Pool(max_cached_bytes=10000)
    assert p.max_cached_bytes == 10000
    big = p.alloc(16384, False)
    del big  # alone exceeds the cap
    assert p.cached_bytes() == 0 and p.stats()["dropped"] == 1
    bs = [p.alloc(4096, False) for _ in range(3)]
    del bs  # 4096 + 4096 fit, the third would push past 10000
    assert p.cached_slabs() == 2 and p.cached_bytes() == 8192
    st = p.stats()
    assert (st["dropped"], st["releases"], st["allocs"]) == (2, 4, 4)
    exact = rt.Pool(max_cached_bytes=8192)
    b = exact.alloc(8192, True)
    del b  # equal to the cap is allowed
    assert exact.cached_bytes() == 8192
    none = rt.Pool(max_cached_bytes=0)
    b = none.alloc(4, True)
    del b
    assert none.cached_bytes() == 0 and none.stats()["dropped"] == 1


def test_exec_context_cache_bytes():
    """ExecContext(cache_bytes=) is its pool's cap (default the SPEC's 1 GiB); a buffer past
    it is dropped on release, one under it comes back; bad caps are refused by name."""
    import fucina as fu
    from fucina.errors import InvalidArgument
    with fu.ExecContext(threads=1) as ctx:
        assert ctx.pool.max_cached_bytes == 1 << 30
    with fu.ExecContext(threads=1, cache_bytes=1 << 20) as ctx:
        assert ctx.pool.max_cached_bytes == 1 << 20
        big = ctx.empty((1 << 19,))            # 2 MiB: past the cap
        del big
        small = ctx.empty((1 << 16,))          # 256 KiB: kept
        addr = small.addr
        del small
        assert ctx.pool.stats()["dropped"] == 1 and ctx.empty((1 << 16,)).addr == addr
    for bad in (-1, 1.5, True, "4G"):
        with pytest.raises(InvalidArgument, match="ExecContext: expected cache_bytes"):
            fu.ExecContext(threads=1, cache_bytes=bad)


def test_cached_bytes_never_exceeds_cap():
    rng = random.Random(7)
    cap = 300_000
    p = rt.Pool(cap)
    live = []
    for _ in range(4000):
        if live and rng.random() < 0.55:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(p.alloc(rng.randrange(1, 120_000), rng.random() < 0.5))
        assert p.cached_bytes() <= cap
    st = p.stats()
    assert st["dropped"] > 0
    assert st["allocs"] + st["reuses"] == st["releases"] + len(live)


def test_counters_and_stats():
    p = rt.Pool()
    st = p.stats()
    for k in ("allocs", "reuses", "releases", "dropped"):
        assert st[k] == 0
    a = p.alloc(100, True)
    b = p.alloc(100, False)
    assert p.outstanding_buffers() == 2 and p.cached_bytes() == 0
    del a
    assert (p.cached_buffers(), p.cached_slabs(), p.cached_bytes()) == (1, 0, 128)
    del b
    assert (p.cached_buffers(), p.cached_slabs(), p.cached_bytes()) == (1, 1, 128 + 4096)
    c = p.alloc(128, True)
    assert p.outstanding_buffers() == 1
    st = p.stats()
    assert (st["allocs"], st["reuses"], st["releases"], st["dropped"]) == (2, 1, 2, 0)
    assert st["outstanding"] == 1 and st["cached_bytes"] == 4096
    del c
    assert p.trim() == 2
    assert (p.cached_buffers(), p.cached_slabs(), p.cached_bytes()) == (0, 0, 0)
    assert p.trim() == 0


def test_close_reports_leaks_and_refuses_allocs():
    p = rt.Pool()
    keep = [p.alloc(64, True), p.alloc(64, False)]
    tmp = p.alloc(64, True)
    del tmp
    assert p.cached_buffers() == 1
    assert not p.closed
    assert p.close() == 2  # the leak report
    assert p.closed and p.cached_bytes() == 0 and p.cached_buffers() == 0
    with pytest.raises(RuntimeError, match="pool closed"):
        p.alloc(64, True)
    releases = p.stats()["releases"]
    del keep  # outliving buffers are simply freed
    assert p.outstanding_buffers() == 0 and p.cached_bytes() == 0
    assert p.stats()["releases"] == releases
    assert p.close() == 0  # closing twice is fine


def test_buffers_outlive_their_pool_object():
    p = rt.Pool()
    bufs = [p.alloc(4096, True) for _ in range(4)]
    np.frombuffer(bufs[0], np.float32)[:] = 1.0
    p.close()
    del p
    gc.collect()
    assert np.frombuffer(bufs[0], np.float32).sum() == 1024.0
    del bufs  # frees each block; the pool object goes with the last one

    p = rt.Pool()
    b = p.alloc(4096, False)
    del p  # not even closed: the buffer keeps the pool alive and still returns to it
    del b
    gc.collect()


def test_refcounts_are_balanced():
    p = rt.Pool()
    base = sys.getrefcount(p)
    bufs = [p.alloc(100, True) for _ in range(10)]
    assert sys.getrefcount(p) == base + 10
    addr_obj = bufs[0].addr
    assert bufs[0].addr is addr_obj  # created once
    del bufs
    assert sys.getrefcount(p) == base
    p.trim()
    one = p.alloc(100, True)
    addr_obj = one.addr
    del one
    again = p.alloc(100, True)
    assert again.addr is addr_obj  # the cached int travels with the memory
    del again
    p.trim()
    assert sys.getrefcount(addr_obj) == 2  # ours + getrefcount's argument: nothing leaked
    assert sys.getrefcount(p) == base

    arr = np.zeros(16, np.float32)
    base_arr = sys.getrefcount(arr)
    bufs = [rt.borrow(arr) for _ in range(5)]
    assert sys.getrefcount(arr) > base_arr
    del bufs
    assert sys.getrefcount(arr) == base_arr


# --------------------------------------------------------------------------------------------
# Buffer objects and the buffer protocol
# --------------------------------------------------------------------------------------------

def test_buffer_protocol_round_trip_zero_copy():
    p = rt.Pool()
    b = p.alloc(4 * 1000, True)
    m = memoryview(b)
    assert (m.format, m.itemsize, m.ndim, m.nbytes, m.readonly) == ("B", 1, 1, 4000, False)
    m.release()
    v = np.frombuffer(b, dtype=np.float32)
    assert v.shape == (1000,) and v.flags.writeable and v.ctypes.data == b.addr
    v[:] = np.arange(1000, dtype=np.float32)
    raw = (ctypes.c_float * 1000).from_address(b.addr)
    assert raw[0] == 0.0 and raw[999] == 999.0
    raw[5] = -2.5  # and the other way round
    assert v[5] == -2.5
    w = np.asarray(memoryview(b)).view(np.float32)  # the other writable route
    assert w.flags.writeable and w.ctypes.data == b.addr and w[5] == -2.5


def test_exported_view_keeps_buffer_alive():
    p = rt.Pool()
    v = np.frombuffer(p.alloc(4096, True), dtype=np.float32)
    gc.collect()
    assert p.outstanding_buffers() == 1
    v[:] = 3.0
    assert v.sum() == 3.0 * 1024
    del v
    assert p.outstanding_buffers() == 0 and p.cached_buffers() == 1


def test_buffer_is_not_constructible_and_read_only():
    p = rt.Pool()
    b = p.alloc(8, True)
    with pytest.raises(TypeError):
        rt.Buffer()
    with pytest.raises(TypeError):
        type(b)()
    for attr in ("addr", "nbytes", "capacity", "pooled", "readonly"):
        with pytest.raises(AttributeError):
            setattr(b, attr, 1)
    assert "Buffer" in repr(b)
    import weakref
    r = weakref.ref(b)
    del b
    assert r() is None


def test_borrow_numpy_array():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = rt.borrow(arr)
    assert (b.addr, b.nbytes, b.capacity) == (arr.ctypes.data, 48, 48)
    assert not b.pooled and not b.readonly
    v = np.frombuffer(b, np.float32)
    assert v.flags.writeable
    v[0] = 42.0
    assert arr[0, 0] == 42.0
    del arr
    gc.collect()
    assert v[1] == 1.0  # the source stays alive while the Buffer does

    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    rb = rt.borrow(ro)
    assert rb.readonly and not np.frombuffer(rb, np.int32).flags.writeable


def test_borrow_read_only_bytes():
    src = b"\x01\x02\x03\x04" * 4
    b = rt.borrow(src)
    assert b.readonly and not b.pooled and b.nbytes == 16
    assert ctypes.string_at(b.addr, 16) == src
    v = np.frombuffer(b, np.uint8)
    assert not v.flags.writeable
    assert memoryview(b).readonly
    with pytest.raises((BufferError, TypeError)):
        (ctypes.c_char * 16).from_buffer(b)  # asks for a writable buffer
    with pytest.raises(ValueError):
        v[0] = 9
    assert bytes(memoryview(b)) == src


def test_borrow_errors_and_other_exporters():
    with pytest.raises(TypeError):
        rt.borrow(12)
    with pytest.raises((BufferError, ValueError)):
        rt.borrow(np.zeros((4, 4), np.float32)[:, ::2])  # not contiguous
    ba = bytearray(b"abcd")
    b = rt.borrow(ba)
    assert not b.readonly
    np.frombuffer(b, np.uint8)[0] = ord("z")
    assert ba == bytearray(b"zbcd")
    empty = rt.borrow(b"")
    assert empty.nbytes == 0 and len(memoryview(empty)) == 0


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------

def fill_index(team, n, chunk, cost):
    out = np.full(n, -1, np.int64)
    rt.launch(team, kaddr("fill_index"), -(-n // chunk), cost, out.ctypes.data, chunk, n)
    return out


@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 7), (4096, 256), (100_003, 4096)])
def test_fill_index_same_inline_and_parallel(team2, n, chunk):
    ref = np.arange(n, dtype=np.int64)
    assert np.array_equal(fill_index(None, n, chunk, 0), ref)
    assert np.array_equal(fill_index(None, n, chunk, HUGE_COST), ref)
    assert np.array_equal(fill_index(team2, n, chunk, HUGE_COST), ref)
    assert np.array_equal(fill_index(team2, n, chunk, 0), ref)


def test_zero_chunks_is_a_no_op(team2):
    out = np.full(4, -1, np.int64)
    rt.launch(team2, kaddr("fill_index"), 0, HUGE_COST, out.ctypes.data, 1, 4)
    rt.launch(None, kaddr("fill_index"), 0, 0, out.ctypes.data, 1, 4)
    assert (out == -1).all()


def test_thread_id_both_participants_on_a_large_job(team2):
    n = 64
    for _attempt in range(10):  # a loaded machine may starve the worker once in a while
        ids = np.full(n, -1, np.int64)
        rt.launch(team2, kaddr("thread_id"), n, HUGE_COST, ids.ctypes.data, 200)  # 200 us/chunk
        assert set(ids.tolist()) <= {0, 1}
        if set(ids.tolist()) == {0, 1}:
            break
    else:
        pytest.fail("the worker never took a chunk")


def test_each_participant_streams_its_own_range_first():
    """A job is cut into one contiguous range per participant (caller 0, worker i); each drains
    its own range in ascending order before it helps with another's, so in the common case a
    thread walks one contiguous stretch of memory."""
    for threads in (2, 3):
        team = rt.Team(threads)
        n = 60
        for _attempt in range(20):
            out = np.full(2 * n, -1, np.int64)
            rt.launch(team, kaddr("stamp"), n, HUGE_COST, out.ctypes.data, 200)  # 200 us/chunk
            who, start = out[0::2], out[1::2]
            assert set(who.tolist()) <= set(range(threads))
            owner = np.arange(n) * threads // n  # chunk c lies in range floor(c*T/n)
            for p in set(who.tolist()):
                mine = start[(who == p) & (owner == p)]
                theirs = start[(who == p) & (owner != p)]
                if len(mine) and len(theirs):
                    assert mine.max() < theirs.min()
            for p in set(who.tolist()):  # a participant claims lowest first within a range
                for r in range(threads):
                    assert (np.diff(start[(who == p) & (owner == r)]) > 0).all()
            if len(set(who.tolist())) > 1:  # a loaded machine may starve a worker for a while
                break
        else:
            pytest.fail("no worker ever took a chunk")
        team.close()


def test_thread_id_small_job_runs_on_caller_only(team2):
    ids = np.full(64, -1, np.int64)
    for _ in range(50):
        rt.launch(team2, kaddr("thread_id"), 64, rt.get_inline_threshold() - 1, ids.ctypes.data)
        assert (ids == 0).all()
    t1 = rt.Team(1)  # no workers at all
    rt.launch(t1, kaddr("thread_id"), 64, HUGE_COST, ids.ctypes.data)
    assert (ids == 0).all()
    t1.close()


def test_thresholds_get_set():
    assert rt.get_inline_threshold() == rt.DEFAULT_INLINE_THRESHOLD
    assert rt.get_gil_threshold() == rt.DEFAULT_GIL_THRESHOLD
    with inline_threshold(123):
        assert rt.get_inline_threshold() == 123
    assert rt.get_inline_threshold() == rt.DEFAULT_INLINE_THRESHOLD
    old = rt.set_gil_threshold(5)
    assert old == rt.DEFAULT_GIL_THRESHOLD and rt.set_gil_threshold(old) == 5
    with pytest.raises(ValueError):
        rt.set_inline_threshold(-1)
    with pytest.raises(TypeError):
        rt.set_gil_threshold("x")
    assert rt.MAX_ARGS == 32 and rt.ALIGNMENT == 64


@pytest.mark.parametrize("n,chunk", [(1, 16), (1000, 64), (65_537, 4096)])
def test_scale_f32_bitwise_vs_numpy(team2, n, chunk):
    rng = np.random.default_rng(n)
    src = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)).astype(np.float32)
    src[::97] = np.float32(np.inf)
    src[1::89] = np.float32(1e-42)  # subnormal
    for s in (np.float32(0.3), np.float32(-7.25e-3), np.float32(3e38)):
        bits = int(np.array([s], np.float32).view(np.uint32)[0])
        with np.errstate(all="ignore"):
            ref = src * s
        for team, cost in ((None, 0), (team2, HUGE_COST)):
            dst = np.empty_like(src)
            rt.launch(team, kaddr("scale_f32"), -(-n // chunk), cost,
                      src.ctypes.data, dst.ctypes.data, n, chunk, bits)
            assert np.array_equal(dst.view(np.uint32), ref.view(np.uint32))


def test_kernel_args_conversion_and_zero_fill():
    out = np.full(31, 7, np.int64)
    rt.launch(None, kaddr("copy_args"), 1, 0, out.ctypes.data, -1, 2**64 - 1, 2**63 - 1, -2**63,
              2**63, np.int64(-5), True)
    assert out[:7].tolist() == [-1, -1, 2**63 - 1, -2**63, -2**63, -5, 1]
    assert (out[7:] == 0).all()  # unused slots read as 0
    args = list(range(1, 32))
    rt.launch(None, kaddr("copy_args"), 1, 0, out.ctypes.data, *args)
    assert out.tolist() == args


def test_launch_bad_arguments_raise(team2):
    fill = kaddr("fill_index")
    out = np.zeros(4, np.int64)
    good = (out.ctypes.data, 1, 4)
    cases = [
        (TypeError, ()),
        (TypeError, (None, fill, 1)),
        (TypeError, ("team", fill, 1, 0) + good),
        (TypeError, (None, float(fill), 1, 0) + good),
        (TypeError, (None, str(fill), 1, 0) + good),
        (ValueError, (None, 0, 1, 0) + good),
        (ValueError, (team2, 0, 4, HUGE_COST) + good),
        (ValueError, (None, fill, -1, 0) + good),
        (ValueError, (None, fill, 2**32, 0) + good),
        (ValueError, (None, fill, 2**70, 0) + good),
        (ValueError, (None, fill, 1, -1) + good),
        (TypeError, (None, fill, 1.0, 0) + good),
        (TypeError, (None, fill, 1, None) + good),
        (TypeError, (None, fill, 1, 0) + tuple(range(33))),
        (TypeError, (None, fill, 1, 0, out.ctypes.data, "1", 4)),
        (TypeError, (None, fill, 1, 0, out.ctypes.data, 1.5, 4)),
        (TypeError, (None, fill, 1, 0, out.ctypes.data, None, 4)),
        (OverflowError, (None, fill, 1, 0, out.ctypes.data, 2**64, 4)),
        (OverflowError, (None, fill, 1, 0, out.ctypes.data, -2**63 - 1, 4)),
    ]
    for exc, args in cases:
        with pytest.raises(exc):
            rt.launch(*args)
    assert (out == 0).all()  # nothing ran
    with pytest.raises(KeyError):
        kaddr("no_such_kernel")
    with pytest.raises(TypeError):
        rt.test_kernel_addr(3)
    rt.launch(None, kaddr("noop"), 1, 0, *range(32))  # exactly 32 is fine


def test_team_lifecycle_close_reopen_many_times():
    for i in range(200):
        t = rt.Team(2 + i % 3)
        assert t.nthreads == 2 + i % 3 and not t.closed
        if i % 2:
            out = fill_index(t, 1000, 10, HUGE_COST)
            assert out[-1] == 999
        t.close()
        assert t.closed
        t.close()  # idempotent
        with pytest.raises(RuntimeError, match="team closed"):
            rt.launch(t, kaddr("noop"), 4, HUGE_COST)
    for i in range(50):
        rt.Team(3)  # dealloc closes and joins
    with pytest.raises(ValueError):
        rt.Team(0)
    with pytest.raises(ValueError):
        rt.Team(2, spin_us=-1)
    with pytest.raises(TypeError):
        rt.Team("2")


def test_idle_workers_park():
    t = rt.Team(3, spin_us=50)
    assert t.spin_us == 50.0
    fill_index(t, 100, 1, HUGE_COST)
    deadline = time.monotonic() + 5
    while t.parked_workers() != 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert t.parked_workers() == 2  # nobody keeps spinning once idle
    assert np.array_equal(fill_index(t, 1000, 10, HUGE_COST), np.arange(1000))  # and they wake
    t.close()
    assert t.parked_workers() == 0


def test_many_tiny_parallel_launches_do_not_hang():
    fill = kaddr("fill_index")
    with hang_guard(120):
        for spin_us in (50.0, 0.0):  # 0: workers park at once, the wake-up race every time
            t = rt.Team(2, spin_us=spin_us)
            out = np.zeros(8, np.int64)
            addr = out.ctypes.data
            launch = rt.launch
            reps = 100_000 if spin_us else 10_000
            for i in range(reps):
                launch(t, fill, 2, HUGE_COST, addr, 4, 8)
                if i % 1000 == 0:
                    assert out.tolist() == list(range(8))
                    out[:] = 0
            t.close()
        for _ in range(100_000):  # and the inline path
            launch(None, fill, 1, 0, addr, 4, 8)


def test_gil_released_during_long_parallel_job():
    t = rt.Team(2)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    th = threading.Thread(target=ticker)
    th.start()
    try:
        while not ticks:
            time.sleep(0.001)
        t0 = time.perf_counter()
        rt.launch(t, kaddr("sleep_us"), 16, HUGE_COST, 10_000)  # ~80 ms on two threads
        t1 = time.perf_counter()
        # inline with a cost above the GIL threshold releases the GIL too
        t2 = time.perf_counter()
        rt.launch(None, kaddr("sleep_us"), 4, rt.get_gil_threshold(), 10_000)
        t3 = time.perf_counter()
    finally:
        stop.set()
        th.join()
        t.close()
    assert t1 - t0 >= 0.075 and t3 - t2 >= 0.04
    assert sum(t0 < x < t1 for x in ticks) > 10
    assert sum(t2 < x < t3 for x in ticks) > 10


def test_concurrent_launches_on_one_team_stay_correct():
    # The API is single-threaded, but a second thread must not corrupt a running job: it runs
    # inline instead.
    t = rt.Team(2)
    errors = []

    def work():
        for _ in range(300):
            if not np.array_equal(fill_index(t, 5000, 100, HUGE_COST), np.arange(5000)):
                errors.append(1)

    with hang_guard(60):
        ths = [threading.Thread(target=work) for _ in range(3)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    t.close()
    assert not errors


def test_team_in_forked_child_runs_inline():  # the runtime is Linux-only: fork always exists
    t = rt.Team(2)
    fill_index(t, 100, 1, HUGE_COST)
    pid = os.fork()
    if pid == 0:  # child: the workers do not exist here
        code = 1
        try:
            ids = np.full(16, -1, np.int64)
            rt.launch(t, kaddr("thread_id"), 16, HUGE_COST, ids.ctypes.data)
            t.close()
            code = 0 if (ids == 0).all() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert np.array_equal(fill_index(t, 100, 1, HUGE_COST), np.arange(100))
    t.close()
