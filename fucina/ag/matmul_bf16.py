"""x.dot_bf16(w, tag): the contraction with a frozen weight computed in bf16 (issue 18 item 3).

    y = x.dot_bf16(w, "in")      # w [out, in] (or [in, out]) bf16 or f32, a constant

x (f32, any rank) and w are rounded to bf16 (nearest even; bf16 denormals read as zero) and
their products summed in f32 by fucina.exec.matmul_bf16 (AMX tiles where the host has them;
else AVX-512 BF16's dot instruction, or its exact emulation: the same bits as the instruction).
Result tags: x's without `tag`, then w's free tag. w is frozen: the gradient reaches x only, dx = bf16(g) · bf16(w) through the
same kernel — the LoRA trainer's "compute bf16" (its frozen projections, forward and backward).
"""
from __future__ import annotations

import functools

from .. import axes
from ..errors import DTypeError, TagError, UnsupportedGradient
from ..exec import elementwise as ew
from ..exec.matmul_bf16 import gemm_bf16
from ..exec.raw import contiguous_strides
from .engine import finish_op, needs_graph
from .quant import _rows


def bf16_dot(x, w, tag: str):
    """(raw, tags, node) of x.dot_bf16(w, tag)."""
    op = "dot_bf16"
    xr, wr = x._raw, w._raw
    if needs_graph(w):
        raise UnsupportedGradient(f"{op}: the right operand requires grad; expected a frozen "
                                  f"constant (the gradient flows to the left operand only)")
    if xr.dtype != "f32":
        raise DTypeError(f"{op}: left operand: expected f32, got {xr.dtype}")
    if wr.dtype not in ("f32", "bf16"):
        raise DTypeError(f"{op}: right operand: expected bf16 or f32, got {wr.dtype}")
    if wr.rank != 2:
        raise TagError(f"{op}: right operand: expected a matrix [free, {tag!r}] or "
                       f"[{tag!r}, free], got tags {w.tags}")
    axes.dot_tags(op, x.tags, xr.shape, w.tags, wr.shape, tag)   # presence, then sizes
    wk = w.tags.index(tag)
    free = w.tags[1 - wk]
    if free in x.tags:
        raise TagError(f"{op}: right operand: its free tag {free!r} is also an axis of the left "
                       f"operand {x.tags}; expected no batch tags")
    ax = x.tags.index(tag)
    perm = [i for i in range(xr.rank) if i != ax] + [ax]
    rows = _rows(xr.ctx, xr.permute(perm))
    b = wr if wk == 0 else wr.permute((1, 0))          # [K, N]
    out = gemm_bf16(xr.ctx, rows, b)
    lead = tuple(xr.shape[i] for i in perm[:-1])
    N = b.shape[1]
    out = out.view(lead + (N,), contiguous_strides(lead + (N,)))
    tags = tuple(x.tags[i] for i in perm[:-1]) + (free,)
    saved = (xr.ctx, b.permute((1, 0)), perm, xr.shape)
    return finish_op(op, out, tags, (x,), lambda needs: functools.partial(_dx, saved))


def _dx(saved, g):
    """dx = bf16(g) · bf16(w), laid out as x."""
    ctx, wt, perm, xshape = saved
    N, K = wt.shape
    g2 = ew.materialize(ctx, g)
    M = g2.numel // N
    d = gemm_bf16(ctx, g2.view((M, N), (N, 1)), wt)
    inv = [perm.index(i) for i in range(len(perm))]
    shape = tuple(xshape[i] for i in perm)
    d = d.view(shape, contiguous_strides(shape)).permute(inv)
    return (ew.materialize(ctx, d),)
