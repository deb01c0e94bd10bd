"""The autograd engine (SPEC §3.19): grad nodes, grad mode, one finish_op tail, backward.

A node holds its parents (one slot per differentiable operand; None for constants) and a
closure computing the operands' gradients from the output's. backward() counts, for every node
reachable from the loss, how many consumers will send it a gradient, and runs a node's VJP only
when all of them have arrived — in a FIFO order fixed by the graph's shape, so gradient sums
are accumulated in the same order every run.
"""
from __future__ import annotations

import sys
import threading
from collections import deque

from ..errors import (BackwardAlreadyRun, GraphNodeReleased, MissingOutputGradient, NoGradientGraph,
                      ShapeMismatch, UnsupportedGradient)
from ..exec import elementwise as ew

class _Mode(threading.local):
    disabled = 0  # no_grad nesting depth of this thread


_mode = _Mode()


def is_grad_enabled() -> bool:
    return not _mode.disabled


class no_grad:
    """`with fu.no_grad():` — ops inside record no graph. Nests; thread-local."""

    def __enter__(self):
        _mode.disabled += 1
        return self

    def __exit__(self, *exc):
        _mode.disabled -= 1
        return False


class enable_grad:
    """Grad mode on inside, whatever the caller's no_grad depth; the depth is restored on exit.
    A checkpoint recompute records its graph even when backward() runs under no_grad."""

    def __enter__(self):
        self._depth = _mode.disabled
        _mode.disabled = 0
        return self

    def __exit__(self, *exc):
        _mode.disabled = self._depth
        return False


class Node:
    """An op's record: parents, the VJP closure, and the bookkeeping of one backward pass.

    into: the VJP is called as vjp(g, acc), acc holding, per parent, the gradient accumulated
    for it so far when the VJP may add its own into that buffer in place (else None); a VJP
    that did so returns that very tensor for the parent (the GEMM adds its sums as it stores
    them: the same bits as the separate add, without its pass)."""

    __slots__ = ("parents", "vjp", "name", "pending", "consumed", "released", "into")

    def __init__(self, name, parents, vjp, into=False):
        self.name, self.parents, self.vjp = name, parents, vjp
        self.into = into
        self.pending = 0
        self.consumed = False
        self.released = False

    def release(self):
        """The output tensor was released: drop what the VJP saved, and the links to the
        parents, so a graph whose intermediates nothing else holds (a graph scope's) goes back
        to the pool with it. A backward reaching this node raises GraphNodeReleased."""
        self.released = True
        self.vjp = None
        self.parents = ()


class Leaf(Node):
    """A variable's node: gradients accumulate here across backward calls (always f32)."""

    __slots__ = ("grad", "shape")

    def __init__(self, shape):
        super().__init__("leaf", (), None)
        self.grad = None
        self.shape = shape

    def release(self):  # a parameter's accumulator outlives its tensor handle
        pass


def needs_graph(*operands) -> bool:
    """A record is attached iff grad mode is on and at least one operand requires grad."""
    if _mode.disabled:
        return False
    for t in operands:
        if getattr(t, "_node", None) is not None:
            return True
    return False


def add_into(ctx, acc, g):
    """acc + g as a new f32 tensor (gradient accumulation)."""
    return ew.run(ctx, "add", "f32", acc.shape, (acc, g))


def leaves(root) -> list:
    """The variables (Leaf nodes) a backward from `root` reaches, in a fixed order."""
    return [n for n in _collect(root) if isinstance(n, Leaf)]


def backward(root, seed) -> None:
    """Run every VJP reachable from `root` (a Node) with gradient `seed` (a RawTensor)."""
    order = _collect(root)
    for n in order:
        if n.released:
            raise GraphNodeReleased(
                f"backward: the output of {n.name!r} was released before backward; "
                f"expected every tensor between parameters and loss to stay alive (or an exec scope)")
        if n.consumed:
            raise BackwardAlreadyRun(
                f"backward: the graph through {n.name!r} was already back-propagated; "
                f"expected a fresh forward pass")
    ctx = seed.ctx
    grads = {root: seed}
    ready = deque([root])
    shared = {id(seed.buf)}  # buffers a leaf may not adopt: the caller's seed, other leaves' grads
    while ready:
        node = ready.popleft()
        g = grads.pop(node)
        if isinstance(node, Leaf):
            if node.grad is None:
                node.grad = _own(ctx, g, shared)
            elif sys.getrefcount(node.grad) == 2 and sys.getrefcount(node.grad.buf) == 2:
                # nothing else sees the accumulator (no grad_view, no other view): add in place
                ew.run(ctx, "add", "f32", g.shape, (node.grad, g), out=node.grad)
            else:
                node.grad = add_into(ctx, node.grad, g)
            shared.add(id(node.grad.buf))
            continue
        if node.into:
            outs = node.vjp(g, tuple(_reusable(grads, p) for p in node.parents))
        else:
            outs = node.vjp(g)
        node.consumed = True
        node.vjp = None  # saved tensors go back to the pool now
        for parent, gp in zip(node.parents, outs):
            if parent is None:
                continue
            if gp is not None:
                prev = grads.get(parent)
                grads[parent] = gp if prev is None or prev is gp else add_into(ctx, prev, gp)
            parent.pending -= 1
            if parent.pending == 0:
                if parent in grads:
                    ready.append(parent)
                elif not isinstance(parent, Leaf):  # nothing flowed in: its subtree gets nothing
                    _drain(parent, ready, grads)
        outs = gp = prev = None  # held on, they would keep the next VJP from adding in place


def _reusable(grads, parent):
    """The gradient accumulated for `parent` so far, when a VJP may add into it in place: a
    contiguous f32 that only the engine holds (not handed to two parents, not a caller's seed,
    no other view of its buffer); else None."""
    prev = grads.get(parent) if parent is not None else None
    if prev is None or sys.getrefcount(prev) != 3:    # grads' slot, prev, the argument
        return None
    if prev.dtype != "f32" or not prev.is_contiguous() or not sole_view(prev):
        return None
    return prev


def sole_view(raw) -> bool:
    """raw is the only view of a pooled buffer (nothing else — no tensor, view, numpy array or
    borrowed source — can see it), so a VJP consuming it may overwrite it in place."""
    return raw.buf.pooled and sys.getrefcount(raw.buf) == 2   # raw's slot + the argument


def _own(ctx, g, shared):
    """g as a leaf's own f32 accumulator. A VJP may pass one buffer to several operands (add
    gives both the same g) or hand back the seed itself; a leaf adopts a buffer only when no
    other leaf holds it and the caller did not give it, otherwise it gets a copy, so clipping or
    accumulating into one gradient never changes another, or the caller's seed."""
    if g.dtype != "f32":
        return ew.cast(ctx, g, "f32")
    if id(g.buf) in shared:
        return ew.run(ctx, "copy", "f32", g.shape, [g])
    return ew.materialize(ctx, g)


def _drain(node, ready, grads):
    """A node that received no gradient (all contributions were None) still releases its
    parents' pending counts, so nodes further up that do get gradients still run."""
    node.consumed = True
    node.vjp = None
    stack = [node]
    while stack:
        n = stack.pop()
        for p in n.parents:
            if p is None:
                continue
            p.pending -= 1
            if p.pending == 0:
                if p in grads:
                    ready.append(p)
                elif not isinstance(p, Leaf):
                    p.consumed = True
                    p.vjp = None
                    stack.append(p)


def _collect(root) -> list:
    """Every node reachable from root, with `pending` = number of reachable consumers."""
    seen = {root}
    order = [root]
    stack = [root]
    root.pending = 0
    while stack:
        n = stack.pop()
        for p in n.parents:
            if p is None:
                continue
            if p not in seen:
                seen.add(p)
                p.pending = 0
                order.append(p)
                stack.append(p)
            p.pending += 1
    return order


def seed_for(t, grad) -> object:
    """The seed gradient for t.backward(grad=...): ones for a scalar, else the given tensor."""
    raw = t._raw
    if grad is None:
        if raw.numel != 1:
            raise MissingOutputGradient(
                f"backward: expected a scalar loss (1 element) or grad=..., got shape {raw.shape}")
        return raw.ctx.full_raw(raw.shape, 1.0, "f32")
    g = grad._live("backward")
    if grad.tags != t.tags or g.shape != raw.shape:
        raise ShapeMismatch(f"backward: expected grad with tags {t.tags} shape {raw.shape}, "
                            f"got tags {grad.tags} shape {g.shape}")
    if g.dtype != "f32":
        return ew.cast(raw.ctx, g, "f32")
    return g


def no_graph(op: str):
    return NoGradientGraph(f"{op}: the tensor has no gradient graph; expected a result of ops on variables")


def finish_op(name: str, out, tags, operands, make_vjp, dtypes_ok: bool = False,
              ignore_mode: bool = False, into: bool = False):
    """The tail every differentiable op ends in: (result raw, tags, node or None).

    make_vjp(needs) builds the closure g -> per-operand gradients, computing only those in
    `needs` (needs_grad pruning). Gradients flow only through f32 ops (casts excepted).
    ignore_mode: record whenever an operand requires grad, even under no_grad (the checkpoint
    node, SPEC §3.19). into: the closure takes the engine's accumulators (Node)."""
    if ignore_mode:
        wanted = any(getattr(t, "_node", None) is not None for t in operands)
    else:
        wanted = needs_graph(*operands)
    if make_vjp is None or not wanted:
        return out, tags, None
    parents = tuple(getattr(t, "_node", None) for t in operands)
    if not dtypes_ok:
        for t, p in zip(operands, parents):
            if p is not None and t._raw.dtype != "f32":
                raise UnsupportedGradient(
                    f"{name}: gradients flow only through f32 ops; operand is a {t._raw.dtype} "
                    f"variable (cast it with .to('f32') first)")
    needs = tuple(p is not None for p in parents)
    return out, tags, Node(name, parents, make_vjp(needs), into)
