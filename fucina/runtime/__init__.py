"""Fucina's C runtime (DESIGN.md §5): buffer pool, storage buffers, worker team, kernel launch.

Everything lives in the extension module ``fucina.runtime._rt``; this package only re-exports it.

* ``Pool(max_cached_bytes=1 << 30)`` — per-context transient pool (SPEC R-2). ``alloc(nbytes,
  f32_arm, zero=False) -> Buffer``; ``trim()``; ``close() -> outstanding count`` (leak report);
  counters ``cached_buffers() cached_slabs() cached_bytes() outstanding_buffers() stats()``.
* ``Buffer`` — storage: ``addr`` (int, cached), ``nbytes``, ``capacity``, ``pooled``, ``readonly``,
  ``f32_arm``; exports a writable 1-D byte buffer, so ``np.frombuffer(buf, np.float32)`` is a
  zero-copy writable view that keeps the buffer alive. Dropping the last reference returns the
  memory to the pool at once.
* ``borrow(obj) -> Buffer`` — zero-copy wrap of any C-contiguous buffer exporter; never pooled;
  read-only iff the source is.
* ``Team(nthreads, spin_us=50.0)`` — caller + ``nthreads - 1`` persistent workers (SPEC R-3);
  ``close()``, ``nthreads``, ``parked_workers()``.
* ``launch(team_or_None, addr, n_chunks, cost, *args)`` — run a kernel
  ``void k(const int64_t *args, int64_t c0, int64_t c1)`` over chunks ``[0, n_chunks)``; inline
  when ``cost`` (bytes touched) is below ``get_inline_threshold()``, else spread over the team.
  Unused argument slots read as 0.
* ``run_plan(team_or_None, plan, x)`` — run a recorded plan: an int64 buffer of entries
  ``[fn, nargs, chunks_a, chunks_b, cost_a, cost_b, args_a[nargs], args_b[nargs]]`` with every
  value ``a + b*x``, each entry exactly as ``launch`` would run it, in one call without the GIL
  (a decode step: fucina/llm/replay.py).
"""

from ._rt import (  # noqa: F401
    ALIGNMENT,
    DEFAULT_GIL_THRESHOLD,
    DEFAULT_INLINE_THRESHOLD,
    MAX_ARGS,
    Buffer,
    Pool,
    Team,
    borrow,
    get_gil_threshold,
    get_inline_threshold,
    launch,
    run_plan,
    set_gil_threshold,
    set_inline_threshold,
    test_kernel_addr,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_GIL_THRESHOLD",
    "DEFAULT_INLINE_THRESHOLD",
    "MAX_ARGS",
    "Buffer",
    "Pool",
    "Team",
    "borrow",
    "get_gil_threshold",
    "get_inline_threshold",
    "launch",
    "run_plan",
    "set_gil_threshold",
    "set_inline_threshold",
    "test_kernel_addr",
]
