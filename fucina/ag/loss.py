"""Losses with their backward rules. Cross-entropy (SPEC L-1): fused log-softmax + NLL with one
backward record; the gradient goes to the logits only."""
from __future__ import annotations

import functools

import numpy as np

from .. import axes
from ..errors import IndexOutOfBounds, InvalidDataLength, InvalidShape
from ..exec import elementwise as ew
from ..exec import loss as exl
from ..exec import reduce as red
from .engine import finish_op

REDUCTIONS = ("mean", "sum", "none")


def _labels(ctx, labels, R: int, K: int, ignore_index):
    """Host labels (list, numpy, or an i64 Tensor) -> i64 raw with -1 for ignored rows."""
    if hasattr(labels, "_live"):
        arr = labels._live("cross_entropy").to_numpy()
    else:
        arr = np.asarray(labels)
    arr = arr.reshape(-1)
    if arr.size != R:
        raise InvalidDataLength(f"cross_entropy: expected {R} labels (one per position), got {arr.size}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: expected integer labels, got dtype {arr.dtype}")
    ignored = np.zeros(R, bool) if ignore_index is None else (arr == ignore_index)
    if arr.dtype.kind == "u":
        bad = (arr >= K) & ~ignored
    else:
        bad = ((arr < 0) | (arr >= K)) & ~ignored
    if bad.any():
        i = int(np.argmax(bad))
        raise IndexOutOfBounds(f"cross_entropy: label {arr[i]} at position {i} is outside [0, {K}) "
                               f"and is not ignore_index={ignore_index}")
    enc = np.where(ignored, -1, arr.astype(np.int64) if arr.dtype.kind == "i" else
                   np.minimum(arr, K).astype(np.int64)).astype(np.int64)
    return ctx.from_numpy(enc, (R,), "i64", "cross_entropy"), int(R - ignored.sum())


def cross_entropy(x, class_tag: str, labels, ignore_index=None, reduction: str = "mean",
                  label_smoothing: float = 0.0):
    r = x._live("cross_entropy")
    ctx = r.ctx
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: expected reduction in {REDUCTIONS}, got {reduction!r}")
    eps = float(label_smoothing)
    if not 0.0 <= eps < 1.0:
        raise InvalidShape(f"cross_entropy: expected label_smoothing in [0, 1), got {label_smoothing}")
    if r.dtype != "f32":
        from ..errors import DTypeError

        raise DTypeError(f"cross_entropy: expected f32 logits, got {r.dtype}")
    ax, rest = axes.reduced(x.tags, class_tag, "cross_entropy")
    K = r.shape[ax]
    rest_shape = r.shape[:ax] + r.shape[ax + 1:]
    R = int(np.prod(rest_shape)) if rest_shape else 1
    lab, valid = _labels(ctx, labels, R, K, ignore_index)
    # rows: the class axis last and contiguous, other axes row-major in their own order
    perm = [i for i in range(r.rank) if i != ax] + [ax]
    rows = ew.materialize(ctx, r.permute(perm))
    rows = rows.view((R, K), (K, 1))
    per_row, m, s = exl.ce_forward(ctx, rows, lab, eps)
    if reduction == "none":
        out, tags = per_row.view(rest_shape, _contig(rest_shape)), rest
        scale = 1.0
    else:
        total = red.reduce_all(ctx, "sum", per_row)
        if reduction == "mean":
            scale = 1.0 / valid if valid else 0.0
            total = ew.run(ctx, "div", "f32", (), (total, float(valid))) if valid else ctx.full_raw((), 0.0)
        else:
            scale = 1.0
        out, tags = total, ()
    saved = (ctx, rows, lab, m, s, eps, scale, perm, r.shape, rest_shape)
    return finish_op("cross_entropy", out, tags, (x,), lambda needs: functools.partial(_ce_grads, saved))


def _ce_grads(saved, g):
    ctx, rows, lab, m, s, eps, scale, perm, shape, rest_shape = saved
    gr = ew.materialize(ctx, g) if g.numel > 1 else g
    dx = exl.ce_backward(ctx, rows, lab, m, s, gr, eps, scale)
    permuted = tuple(shape[i] for i in perm)
    dxv = dx.view(permuted, _contig(permuted))
    inv = [perm.index(i) for i in range(len(shape))]
    return (ew.materialize(ctx, dxv.permute(inv)),)


def _contig(shape):
    from ..exec.raw import contiguous_strides

    return contiguous_strides(tuple(shape))


class LossMethods:
    """Tensor methods of the loss family (SPEC §3.14)."""

    __slots__ = ()

    # ---- losses (SPEC §3.14) ----
    def cross_entropy(self, class_tag: str, labels, *, ignore_index=None, reduction: str = "mean",
                      label_smoothing: float = 0.0):
        """Fused log-softmax + NLL over `class_tag`; labels one per remaining position."""
        return self._result(*cross_entropy(self, class_tag, labels, ignore_index,
                                                    reduction, label_smoothing))

    cross_entropy_ext = cross_entropy
