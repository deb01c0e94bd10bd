"""Activation checkpointing (SPEC T-14): trade compute for memory by recomputing a block.

The forward runs the block grad-free inside an inner exec scope, so every intermediate goes
back to the pool as soon as the block returns; the node keeps refcounted views of the inputs
and one deep copy of the output. When the gradient arrives, the block runs again on those
views with grad recording (under its own inner scope), the incoming gradient seeds a serial
backward over the rebuilt subgraph, and the input gradients go to the outer engine. Same
kernels in the same order, so the gradients are bitwise those of the plain forward. One
caveat, float addition order: an input's gradient leaves the block as one sum, so an input
used more than once inside the block that also has consumers outside it gets its parts added
in another order than the plain graph adds them (equal up to rounding).

Recomputes are serialized by one process-wide mutex; a checkpoint node met inside a recompute
on the same thread (a nested checkpoint) is refused instead of deadlocking on it.
"""
from __future__ import annotations

import functools
import threading

from ..errors import (CheckpointMissingInputGradient, CheckpointOutputNotDifferentiable,
                      ContextMismatch, DTypeError, InvalidArgumentType, NestedCheckpointRecompute,
                      ShapeMismatch, UnsupportedGradient)
from ..exec import elementwise as ew
from . import engine
from .checks import same_ctx
from .tensor import Tensor

__all__ = ["checkpoint", "checkpoint_with_context"]

_mutex = threading.Lock()  # one recompute at a time, process-wide


class _Recompute(threading.local):
    active = False  # this thread is inside a recompute (the mutex is held)


_recompute = _Recompute()
_NO_EXTRA = object()


def checkpoint(block, *inputs) -> Tensor:
    """`fu.checkpoint(block, x, w)` -> block(x, w), or `fu.checkpoint(block, (x, w))` ->
    block((x, w)) (one tuple parameter); inputs are f32 tensors, the result one f32 tensor.
    Retains O(inputs + output); the block must be deterministic in its inputs (dropout: a
    fixed seed) and take trainable tensors only through `inputs`."""
    return _checkpoint(block, _NO_EXTRA, inputs)


def checkpoint_with_context(block, extra, *inputs) -> Tensor:
    """`fu.checkpoint_with_context(block, extra, x, w)` -> block(extra, x, w). `extra` (frozen
    weights, RoPE tables, config, layer objects) is kept by reference, must stay valid until
    backward and never receives gradients."""
    return _checkpoint(block, extra, inputs)


def _checkpoint(block, extra, inputs) -> Tensor:
    op = "checkpoint" if extra is _NO_EXTRA else "checkpoint_with_context"
    if not callable(block):
        raise InvalidArgumentType(f"{op}: expected a callable block, got {type(block).__name__}")
    packed = len(inputs) == 1 and isinstance(inputs[0], (tuple, list))
    inputs = tuple(inputs[0]) if packed else tuple(inputs)
    if not inputs:
        raise InvalidArgumentType(f"{op}: expected at least one input tensor, got none")
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise InvalidArgumentType(f"{op}: input {i}: expected a Tensor, got {type(t).__name__}")
        same_ctx(op, inputs[0], t)
        if t._raw.dtype != "f32":
            raise DTypeError(f"{op}: input {i}: expected an f32 tensor, got {t._raw.dtype}")
    ctx = inputs[0]._raw.ctx
    views = tuple(t._raw for t in inputs)  # refcounted: the storage outlives the input handles
    tags = tuple(t.tags for t in inputs)
    call = _Call(block, extra, packed, tags, op)
    scope = ctx.open_exec_scope()
    try:
        with engine.no_grad():
            y = call(tuple(Tensor(v, tg) for v, tg in zip(views, tags)))
        raw = _output(op, y, ctx)
        out = ew.run(ctx, "copy", "f32", raw.shape, (raw,))  # the one value the node retains
    finally:
        _close(ctx, scope)
    # a node iff an input requires grad: no_grad does not affect it (SPEC §3.19)
    owner, out_tags = _owners(inputs), y.tags
    return Tensor._result(*engine.finish_op(
        op, out, out_tags, inputs, ignore_mode=True,
        make_vjp=lambda needs: functools.partial(_grads, call, views, owner, out_tags, needs)))


class _Call:
    """How to call the block: extra first (checkpoint_with_context), inputs spread or as one tuple."""

    __slots__ = ("block", "extra", "packed", "tags", "op")

    def __init__(self, block, extra, packed, tags, op):
        self.block, self.extra, self.packed, self.tags, self.op = block, extra, packed, tags, op

    def __call__(self, args):
        lead = () if self.extra is _NO_EXTRA else (self.extra,)
        return self.block(*lead, args) if self.packed else self.block(*lead, *args)


def _output(op, y, ctx):
    if not isinstance(y, Tensor):
        raise InvalidArgumentType(f"{op}: the block must return a Tensor, got {type(y).__name__}")
    r = y._live(f"{op} block output")
    if r.ctx is not ctx:
        raise ContextMismatch(f"{op}: the block returned a tensor of another ExecContext")
    if r.dtype != "f32":
        raise DTypeError(f"{op}: the block must return an f32 tensor, got {r.dtype}")
    return r


def _owners(inputs) -> tuple:
    """owner[i] = the first position holding input i's grad node (None for constants): an input
    passed twice is one variable in the recompute, its gradient handed out once."""
    first = {}
    out = []
    for i, t in enumerate(inputs):
        n = t._node
        out.append(None if n is None else first.setdefault(id(n), i))
    return tuple(out)


def _close(ctx, scope) -> None:
    """Close `scope`, first closing any scope a failing block left open above it."""
    while ctx.scopes and ctx.scopes[-1] is not scope:
        ctx.close_exec_scope(ctx.scopes[-1])
    ctx.close_exec_scope(scope)


def _grads(call, views, owner, out_tags, needs, g):
    """The checkpoint node's VJP: recompute with grad, back-propagate g, return input grads."""
    op = call.op
    if _recompute.active:
        raise NestedCheckpointRecompute(
            f"{op}: a checkpoint node was reached inside another checkpoint's recompute; expected "
            f"no checkpoint call inside a checkpointed block")
    with _mutex:
        _recompute.active = True
        try:
            return _replay(call, views, owner, out_tags, needs, g)
        finally:
            _recompute.active = False


def _replay(call, views, owner, out_tags, needs, g):
    op = call.op
    ctx = g.ctx
    scope = ctx.open_exec_scope()
    try:
        args, fresh = [], {}
        for i, (v, tags) in enumerate(zip(views, call.tags)):
            k = owner[i]
            if k is None:
                args.append(Tensor(v, tags))
            elif k == i:  # a fresh leaf local to this recompute
                fresh[i] = Tensor(v, tags, engine.Leaf(v.shape))
                args.append(fresh[i])
            else:
                args.append(fresh[k])
        with engine.enable_grad():
            y = call(tuple(args))
        r = _output(op, y, ctx)
        if y.tags != out_tags or r.shape != g.shape:
            raise ShapeMismatch(f"{op}: the recomputed output has tags {y.tags} shape {r.shape}, the "
                                f"forward's {out_tags} {g.shape}; expected a deterministic block")
        if y._node is None:
            raise CheckpointOutputNotDifferentiable(
                f"{op}: the recomputed block output has no gradient graph; expected a result of ops "
                f"on the grad-requiring inputs")
        _check_leaves(op, y._node, {id(t._node) for t in fresh.values()})
        engine.backward(y._node, g)  # g installed as the output's gradient as is; one serial pass
        out = []
        for i, need in enumerate(needs):
            if not need or owner[i] != i:
                out.append(None)
                continue
            gi = fresh[i]._node.grad
            if gi is None:
                raise CheckpointMissingInputGradient(
                    f"{op}: input {i} {call.tags[i]} requires grad but the block's output does not "
                    f"depend on it; expected every grad-requiring input to receive a gradient")
            out.append(gi)
        return tuple(out)
    finally:
        _close(ctx, scope)


def _check_leaves(op, root, allowed) -> None:
    """Every variable the recomputed graph reaches must be one of the block's inputs: a tensor
    reached through `extra` or a closure would otherwise get gradients (and an outer graph
    would be back-propagated twice)."""
    seen, stack = {id(root)}, [root]
    while stack:
        n = stack.pop()
        if isinstance(n, engine.Leaf):
            if id(n) not in allowed:
                raise UnsupportedGradient(
                    f"{op}: the block reached a tensor that requires grad but is not one of its "
                    f"inputs (through extra or a closure); expected trainable tensors to be passed "
                    f"as inputs (extra never receives gradients)")
            continue
        for p in n.parents:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                stack.append(p)
