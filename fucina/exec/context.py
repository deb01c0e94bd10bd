"""The exec-layer context: one buffer pool, one thread team started by the first launch, and
launching.

Two contexts share nothing. A context that never launches a kernel never starts a thread; small
ops run inline on the caller, never waking the team's workers (parked after a short spin).
"""
from __future__ import annotations

import functools
import numbers
import os
import struct
import warnings

import numpy as np

from ..errors import (ContextClosed, InvalidArgument, InvalidArgumentType, InvalidDataLength,
                      InvalidShape)
from ..runtime import _rt
from .dtypes import check, checked_storage, host_array
from .raw import MAX_RANK, RawTensor, contiguous_layout, numel


def _debug() -> bool:
    return os.environ.get("FUCINA_DEBUG") == "1"


class Context:
    """Pool + team + launch. The public ExecContext (fucina.ag) adds Tensor constructors."""

    def __init__(self, threads: int | None = None, *, cache_bytes: int = 1 << 30):
        if threads is None:
            threads = os.cpu_count() or 1
        if not isinstance(threads, int) or threads < 1:
            raise InvalidArgument(f"ExecContext: expected threads >= 1 or None, got {threads!r}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise InvalidArgument(f"ExecContext: expected cache_bytes an int >= 0, got "
                                  f"{cache_bytes!r}")
        self.threads = threads
        self.pool = _rt.Pool(max_cached_bytes=cache_bytes)
        self._team = None
        self.closed = False
        self.scopes: list[ExecScope] = []  # open exec scopes, innermost last
        self.adopting = False              # the innermost open scope adopts op results
        self._adopted: list = []           # release callbacks of values the open scopes own
        self._constants: dict = {}         # (dtype, value) -> 1-element source of full_raw

    # ---- lifetime ----
    def close(self) -> None:
        """Stop the team, drop the cache, report buffers still alive (a leak in the reference)."""
        if self.closed:
            return
        while self.scopes:  # defensive: still-open scopes are released newest first
            self.close_exec_scope(self.scopes[-1])
        self.closed = True
        self.__dict__.pop("launch", None)   # the bound runtime launch holds the team
        if self._team is not None:
            self._team.close()
            self._team = None
        self._constants.clear()
        leaked = self.pool.close()
        if leaked:
            msg = f"ExecContext.close: {leaked} pooled buffers still referenced (leaked {leaked} pooled buffers)"
            if _debug():
                raise AssertionError(msg)
            warnings.warn(msg, ResourceWarning, stacklevel=2)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def check_open(self, op: str = "op") -> None:
        if self.closed:
            raise ContextClosed(f"{op}: the ExecContext was closed; expected an open context")

    # ---- exec scopes (SPEC R-5) ----
    def open_exec_scope(self) -> "ExecScope":
        """From now until the matching close, op results are borrows owned by this scope."""
        return self._push_scope(ExecScope(self, len(self._adopted)), "open_exec_scope")

    def open_graph_scope(self) -> "ExecScope":
        """A scope that adopts nothing, for a library composite whose intermediates its caller
        never sees (the LoRA trainer's forward). Inside it an op result lives while something
        refers to it — a variable, a view, or a graph node that saved it for backward — so what
        backward does not read goes back to the pool at once (deinit-ASAP, as without a scope),
        while composed ops still find a scope open. The composite hands the one result it
        returns to the enclosing exec scope (Tensor._to_scope); releasing that result releases
        its graph, and with it every saved buffer. Closed like any scope (close_exec_scope)."""
        return self._push_scope(GraphScope(self, len(self._adopted)), "open_graph_scope")

    def _push_scope(self, scope: "ExecScope", op: str) -> "ExecScope":
        self.check_open(op)
        self.scopes.append(scope)
        self.adopting = scope.adopts
        return scope

    def close_exec_scope(self, scope: "ExecScope") -> None:
        """Release everything adopted since `scope` opened, newest first. Innermost first only."""
        if not self.scopes or self.scopes[-1] is not scope:
            raise AssertionError("close_exec_scope: expected the innermost open scope; scopes close "
                                 "in reverse order of opening")
        self.scopes.pop()
        self.adopting = bool(self.scopes) and self.scopes[-1].adopts
        owned = self._adopted[scope.mark:]
        del self._adopted[scope.mark:]
        for release in reversed(owned):
            release()

    def exec_scope(self):
        """`with ctx.exec_scope(): ...` — open on enter, close on exit (also on error)."""
        return _ScopeGuard(self, self.open_exec_scope)

    def graph_scope(self):
        """`with ctx.graph_scope(): ...` — open_graph_scope on enter, closed on exit."""
        return _ScopeGuard(self, self.open_graph_scope)

    def exec_scope_active(self) -> bool:
        return bool(self.scopes)

    def adopt(self, value) -> None:
        """Hand `value` (anything with _scope_release()) to the innermost open scope."""
        self._adopted.append(value._scope_release)

    def adopt_scope_value(self, release) -> None:
        """Low-level: the innermost scope calls `release()` when it closes (type-erased)."""
        if not self.scopes:
            raise AssertionError("adopt_scope_value: no exec scope is open")
        self._adopted.append(release)

    # ---- memory ----
    def empty(self, shape, dtype: str = "f32") -> RawTensor:
        """An uninitialised contiguous tensor from the pool. Internal: shapes reaching here were
        validated by the op (public constructors call validate_shape first)."""
        if self.closed:
            self.check_open("empty")
        lay = contiguous_layout(dtype, shape)
        # an empty tensor still owns a small buffer (a whole number of any element): kernels
        # and views take its address
        return RawTensor(self.pool.alloc(max(lay.nbytes, 64), dtype == "f32"), lay, 0, self)

    def full_raw(self, shape, value, dtype: str = "f32", out: RawTensor | None = None) -> RawTensor:
        """A new tensor (or `out`) filled with `value` by the generated copy kernel (a broadcast
        scalar)."""
        from . import elementwise as ew

        shape = tuple(shape)
        # exact: -0.0 is not 0.0, a NaN finds itself, a big int is not its nearest float
        key = (dtype, value if isinstance(value, int) else struct.pack("<d", float(value)))
        one = self._constants.get(key)
        if one is None:  # a 1-element source per value, read through zero strides
            one = self._constants[key] = self.from_numpy([value], (1,), dtype, "full")
        return ew.run(self, "copy", dtype, shape, (one.view(shape, (0,) * len(shape)),), out)

    def from_numpy(self, data, shape=None, dtype: str = "f32", op: str = "from_slice") -> RawTensor:
        """Copy array-like data into a new pooled tensor (the numpy I/O bridge)."""
        check(dtype, op)
        src = host_array(data, op)
        shape = validate_shape(src.shape if shape is None else shape, op)
        arr = checked_storage(src, dtype, op)
        if arr.size != numel(shape):
            raise InvalidDataLength(
                f"{op}: expected {numel(shape)} values for shape {shape}, got {arr.size}")
        t = self.empty(shape, dtype)
        np.frombuffer(t.buf, dtype=arr.dtype, count=arr.size)[:] = arr.reshape(-1)
        return t

    # ---- launching ----
    def team(self):
        """The worker team, started on first need (caller + threads-1 workers)."""
        if self._team is None:
            self._team = _rt.Team(self.threads)
        return self._team

    def launch(self, addr: int, n_chunks: int, cost: int, *args) -> None:
        """Run a kernel over its chunks; the runtime picks inline or split by the same rule
        as team_for (one Python call less per launch). The first launch starts the team
        (with more than one thread) and makes the context's `launch` the runtime's own with
        the team bound: no Python frame per launch after it (a 1 x 1 x 1 matmul 1061 ->
        673 ns). Wrappers that set ctx.launch and `del` it again (exec.plan.record,
        profilers) get this method back; close() drops the binding."""
        team = self._team
        if not self.closed:
            if team is None and self.threads > 1:
                team = self.team()
            if "launch" not in self.__dict__:   # not while a wrapper is set (it calls us)
                self.launch = functools.partial(_rt.launch, team)
        if n_chunks:  # no chunk, no work: not even the runtime's call
            _rt.launch(team, addr, n_chunks, cost, *args)

    def team_for(self, n_chunks: int, cost: int):
        """The team when a job is worth splitting, else None (run inline on the caller)."""
        if n_chunks > 1 and cost >= INLINE_THRESHOLD and self.threads > 1:
            return self._team or self.team()
        return None


class ExecScope:
    """A mark in the context's adoption list (SPEC R-5)."""

    __slots__ = ("ctx", "mark")
    adopts = True

    def __init__(self, ctx, mark):
        self.ctx, self.mark = ctx, mark


class GraphScope(ExecScope):
    """open_graph_scope's scope: op results inside are not adopted."""

    __slots__ = ()
    adopts = False


class _ScopeGuard:
    def __init__(self, ctx, opener):
        self.ctx, self.opener = ctx, opener

    def __enter__(self):
        self.scope = self.opener()
        return self.scope

    def __exit__(self, *exc):
        self.ctx.close_exec_scope(self.scope)
        return False


INLINE_THRESHOLD = _rt.get_inline_threshold()


def validate_shape(shape, op: str) -> tuple:
    """A shape as a tuple of ints: integer sizes >= 0, rank <= MAX_RANK."""
    try:
        shape = tuple(shape)
    except TypeError:
        raise InvalidArgumentType(f"{op}: expected a shape (a sequence of ints), got "
                                  f"{type(shape).__name__}") from None
    if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in shape):
        raise InvalidArgumentType(f"{op}: expected integer axis sizes, got shape {shape}")
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_RANK:
        raise InvalidShape(f"{op}: expected rank <= {MAX_RANK}, got shape {shape}")
    if any(d < 0 for d in shape):
        raise InvalidShape(f"{op}: expected every axis size >= 0, got shape {shape}")
    return shape
