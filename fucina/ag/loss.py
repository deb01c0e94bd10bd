"""Losses with their backward rules. Cross-entropy (SPEC L-1): fused log-softmax + NLL with one
backward record; the gradient goes to the logits only."""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import axes
from ..errors import (DTypeError, IndexOutOfBounds, InvalidArgument, InvalidArgumentType,
                      InvalidDataLength, InvalidShape, LinearCrossEntropyBackwardConsumed,
                      ShapeMismatch, TagError)
from ..exec import elementwise as ew
from ..exec import loss as exl
from ..exec import reduce as red
from .checks import require_scope, same_ctx
from .engine import finish_op, sole_view

REDUCTIONS = ("mean", "sum", "none")


def host_labels(op: str, labels, R: int, K: int, ignore_index=None, positions=None):
    """Labels (list, numpy, or an i64 Tensor), one per position, validated against K classes
    (a caller that reads the labels before the loss, e.g. to drop unsupervised rows, checks
    them the loss's way first). A tagged label tensor must carry the position tags in the
    logits' order (row-major labels in another axis order would silently pair the wrong rows).
    Returns (int array, ignored)."""
    if ignore_index is not None and (isinstance(ignore_index, bool)
                                     or not isinstance(ignore_index, numbers.Integral)):
        raise InvalidArgumentType(f"{op}: expected an integer ignore_index, got {ignore_index!r}")
    if hasattr(labels, "_live"):
        if positions is not None and labels.tags != tuple(positions):
            raise TagError(f"{op}: expected labels tagged {tuple(positions)} (the positions, in the "
                           f"logits' axis order), got {labels.tags}")
        arr = labels._live(op).to_numpy()
    elif isinstance(labels, (list, tuple)) and labels and all(
            type(v) is int and 0 <= v < 1 << 64 for v in labels):
        arr = np.array(labels, dtype=np.uint64)  # ids mixed with 2^64 - 1 (IGNORE_INDEX): numpy
        # would otherwise pick float64
    else:
        arr = np.asarray(labels)
    arr = arr.reshape(-1)
    if arr.size != R:
        raise InvalidDataLength(f"{op}: expected {R} labels (one per position), got {arr.size}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{op}: expected integer labels, got dtype {arr.dtype}")
    ignored = np.zeros(R, bool) if ignore_index is None else (arr == ignore_index)
    low = np.zeros(R, bool) if arr.dtype.kind == "u" else arr < 0
    bad = (low | (arr >= K)) & ~ignored
    if bad.any():
        i = int(np.argmax(bad))
        tail = "" if ignore_index is None else f" and is not ignore_index={ignore_index}"
        raise IndexOutOfBounds(f"{op}: label {arr[i]} at position {i} is outside [0, {K}){tail}")
    return arr, ignored


def check_loss_scale(op: str, loss_scale) -> None:
    """A loss multiplier must be a real number (not a bool): the trainer's losses scale by it."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
        raise InvalidArgumentType(f"{op}: expected a real loss_scale, got {loss_scale!r}")


def encode_labels(arr, ignored, K: int) -> np.ndarray:
    """host_labels' result as the kernels read it: i64, -1 for an ignored row (the upload a
    replayed training step feeds anew, fucina.llm.decoder.replay)."""
    safe = arr.astype(np.int64) if arr.dtype.kind == "i" else np.minimum(arr, K).astype(np.int64)
    return np.where(ignored, -1, safe).astype(np.int64)


def _labels(ctx, op, labels, R: int, K: int, ignore_index, positions):
    """Labels as an i64 raw with -1 for ignored rows, and the count of rows that are not ignored."""
    arr, ignored = host_labels(op, labels, R, K, ignore_index, positions)
    enc = encode_labels(arr, ignored, K)
    return ctx.from_numpy(enc, (R,), "i64", "cross_entropy"), int(R - ignored.sum())


def _smoothing(op: str, label_smoothing) -> float:
    eps = float(label_smoothing)
    if not 0.0 <= eps < 1.0:
        raise InvalidShape(f"{op}: expected label_smoothing in [0, 1), got {label_smoothing}")
    return eps


def _reduce(ctx, op: str, per_row, valid: int, reduction: str, rest_shape, rest_tags):
    """(loss, tags, backward coefficient scale) from the per-row losses: `none` keeps them,
    `sum` adds them serially in row order, `mean` divides that by the non-ignored rows (0 when
    there are none)."""
    if reduction == "none":
        return per_row.view(rest_shape, _contig(rest_shape)), rest_tags, 1.0
    total = exl.serial_sum(ctx, per_row)
    if reduction == "sum":
        return total, (), 1.0
    if not valid:
        return ctx.full_raw((), 0.0), (), 0.0
    return ew.run(ctx, "div", "f32", (), (total, float(valid))), (), 1.0 / valid


def cross_entropy(x, class_tag: str, labels, ignore_index=None, reduction: str = "mean",
                  label_smoothing: float = 0.0):
    r = x._live("cross_entropy")
    ctx = r.ctx
    _reduction("cross_entropy", reduction)
    eps = _smoothing("cross_entropy", label_smoothing)
    if r.dtype != "f32":
        raise DTypeError(f"cross_entropy: expected f32 logits, got {r.dtype}")
    ax, rest = axes.reduced(x.tags, class_tag, "cross_entropy")
    K = r.shape[ax]
    rest_shape = r.shape[:ax] + r.shape[ax + 1:]
    R = int(np.prod(rest_shape)) if rest_shape else 1
    lab, valid = _labels(ctx, "cross_entropy", labels, R, K, ignore_index, rest)
    # rows: the class axis last and contiguous, other axes row-major in their own order
    perm = [i for i in range(r.rank) if i != ax] + [ax]
    rows = ew.materialize(ctx, r.permute(perm))
    rows = rows.view((R, K), (K, 1))
    per_row, m, s = exl.ce_forward(ctx, rows, lab, eps)
    out, tags, scale = _reduce(ctx, "cross_entropy", per_row, valid, reduction, rest_shape, rest)
    saved = (ctx, rows, lab, m, s, eps, scale, perm, r.shape, rest_shape)
    return finish_op("cross_entropy", out, tags, (x,), lambda needs: functools.partial(_ce_grads, saved))


def linear_cross_entropy(x, weight, labels, ignore_index=None, reduction: str = "mean",
                         label_smoothing: float = 0.0):
    """cross_entropy(x · weightᵀ) as one op (SPEC L-2). The logits live only in the saved
    record; the backward overwrites them with their gradient G, then dx = G·W and dW = Gᵀ·X, so
    no second [rows, classes] buffer is ever allocated. The record is single-use."""
    op = "linear_cross_entropy"
    same_ctx(op, x, weight)
    xr, wr = x._live(op), weight._live(op)
    ctx = xr.ctx
    for what, t, r, ok in (("self", x, xr, xr.rank >= 2), ("weight", weight, wr, wr.rank == 2)):
        if not ok:
            raise InvalidShape(f"{op}: expected {what} of rank {'>= 2' if t is x else '2'}, got "
                               f"shape {r.shape}")
        if r.dtype != "f32":
            raise DTypeError(f"{op}: expected {what} of dtype f32, got {r.dtype}")
    shared = x.tags[-1]
    if weight.tags[1] != shared:
        raise TagError(f"{op}: expected weight tagged (class, {shared!r}) (the shared axis last "
                       f"on both), got {weight.tags}")
    class_tag = weight.tags[0]
    if class_tag in x.tags:
        raise TagError(f"{op}: the class axis {class_tag!r} of weight must not be an axis of "
                       f"self {x.tags}")
    F = xr.shape[-1]
    if F != wr.shape[1]:
        raise ShapeMismatch(f"{op}: expected weight with {F} {shared!r} features "
                            f"(self's), got {wr.shape[1]}")
    _reduction(op, reduction)
    eps = _smoothing(op, label_smoothing)
    lead, lead_shape = x.tags[:-1], xr.shape[:-1]   # rows: every axis but the shared one
    R, K = int(np.prod(lead_shape)), wr.shape[0]
    lab, valid = _labels(ctx, op, labels, R, K, ignore_index, lead)
    xr, wr = ew.materialize(ctx, xr).view((R, F), (F, 1)), ew.materialize(ctx, wr)
    logits = exl.linear_logits(ctx, xr, wr)
    per_row, m, s = exl.ce_forward(ctx, logits, lab, eps)
    out, tags, scale = _reduce(ctx, op, per_row, valid, reduction, lead_shape, lead)
    state = [logits]
    saved = (ctx, state, xr, wr, lab, m, s, eps, scale, lead_shape + (F,))
    del logits
    return finish_op(op, out, tags, (x, weight),
                     lambda needs: functools.partial(_linear_ce_grads, saved, needs))


def _linear_ce_grads(saved, needs, g):
    ctx, state, xr, wr, lab, m, s, eps, scale, xshape = saved
    if not state:
        raise LinearCrossEntropyBackwardConsumed(
            "linear_cross_entropy: its backward already ran (the saved logits became their "
            "gradient); expected a fresh forward")
    G = state.pop()
    exl.ce_backward(ctx, G, lab, m, s, ew.materialize(ctx, g) if g.numel > 1 else g, eps, scale,
                    out=G)
    dx, dw = exl.linear_grads(ctx, G, xr, wr, needs[0], needs[1])
    return (None if dx is None else dx.view(xshape, _contig(xshape))), dw


def _ce_grads(saved, g):
    ctx, rows, lab, m, s, eps, scale, perm, shape, rest_shape = saved
    gr = ew.materialize(ctx, g) if g.numel > 1 else g
    # the logits die with this record: when no other view sees their buffer (the caller let go
    # of the logits tensor, e.g. the LoRA trainer's graph scope), the gradient overwrites them
    # instead of taking a second [rows, classes] buffer (the kernel reads each element first)
    out = rows if sole_view(rows) else None
    dx = exl.ce_backward(ctx, rows, lab, m, s, gr, eps, scale, out=out)
    permuted = tuple(shape[i] for i in perm)
    dxv = dx.view(permuted, _contig(permuted))
    inv = [perm.index(i) for i in range(len(shape))]
    return (ew.materialize(ctx, dxv.permute(inv)),)


def _contig(shape):
    from ..exec.raw import contiguous_strides

    return contiguous_strides(tuple(shape))


BCE_EPS = 1e-7


# L-4 kernels by name: forward, input derivative, target derivative (the formulas are in
# fucina/kernel_templates/losses.py)
MSE_FWD, MSE_DX, MSE_DT = "mse_loss", "mse_loss_dx", "mse_loss_dt"
HUBER_FWD, HUBER_DX, HUBER_DT = "huber_loss", "huber_loss_dx", "huber_loss_dt"
BCEL_FWD, BCEL_DX, BCEL_DT = "bce_logits_loss", "bce_logits_loss_dx", "bce_logits_loss_dt"
BCEP_FWD, BCEP_DX, BCEP_DT = "bce_probs_loss", "bce_probs_loss_dx", "bce_probs_loss_dt"
KL_FWD, KL_DX, KL_DT = "kl_div_loss", "kl_div_loss_dx", "kl_div_loss_dt"
KLL_FWD, KLL_DX, KLL_DT = ("kl_div_log_target_loss", "kl_div_log_target_loss_dx",
                           "kl_div_log_target_loss_dt")


def _reduction(name: str, reduction) -> str:
    if reduction not in REDUCTIONS:
        raise InvalidArgument(f"{name}: expected reduction in {REDUCTIONS}, got {reduction!r}")
    return reduction


def pointwise_loss(name: str, x, t, reduction: str, fwd: str, dx: str, dt: str, params=()):
    """The L-4 skeleton: per-element losses, optional sum/mean, grads to both operands."""
    from .elementwise import aligned

    reduction = _reduction(name, reduction)
    same_ctx(name, x, t)
    a0 = x._live(name)
    t._live(name)
    if a0.dtype != "f32" or t._raw.dtype != "f32":
        raise DTypeError(f"{name}: expected f32 input and target, got {a0.dtype} and {t._raw.dtype}")
    if set(x.tags) != set(t.tags) or len(x.tags) != len(t.tags):
        raise TagError(f"{name}: expected a target with the input's tags {x.tags}, got {t.tags}")
    tags, shape, a, b = aligned(name, x, t)
    if tags != x.tags or shape != a0.shape or t._raw.numel != a0.numel:
        raise ShapeMismatch(f"{name}: expected a target of the input's shape {a0.shape} "
                            f"(tags {x.tags}), got {t._raw.shape} (tags {t.tags})")
    ctx = a0.ctx
    params = tuple(float(p) for p in params)
    per = ew.run(ctx, fwd, "f32", shape, [a, b, *params])
    n = a0.numel
    if reduction == "none":
        out, out_tags, scale = per, x.tags, 1.0
    else:
        out = red.reduce_all(ctx, "sum", per, mean=(reduction == "mean"))
        out_tags, scale = (), (1.0 / n if reduction == "mean" and n else 1.0)
    saved = (ctx, shape, tags, a, b, scale, params, dx, dt, t.tags, t._raw.shape)
    return finish_op(name, out, out_tags, (x, t),
                     lambda needs: functools.partial(_pointwise_grads, saved, needs))


def _pointwise_grads(saved, needs, g):
    from .elementwise import unbroadcast

    ctx, shape, tags, a, b, scale, params, dx, dt, ttags, tshape = saved
    gv = g if g.shape == shape else g.view(shape, (0,) * len(shape))
    gx = ew.run(ctx, dx, "f32", shape, [gv, a, b, scale, *params]) if needs[0] else None
    gt = ew.run(ctx, dt, "f32", shape, [gv, a, b, scale, *params]) if needs[1] else None
    return gx, (unbroadcast(ctx, gt, tags, ttags, tshape) if needs[1] else None)


class InvalidHuberDelta(InvalidShape, ValueError):
    """huber_loss delta not finite and > 0: an InvalidShape (like cross_entropy's
    label_smoothing) that is also a ValueError."""


def _delta(delta) -> float:
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise InvalidHuberDelta(f"huber_loss: expected a finite delta > 0, got {delta!r}") from None
    if not (math.isfinite(d) and d > 0.0):
        raise InvalidHuberDelta(f"huber_loss: expected a finite delta > 0, got {delta!r}")
    return d


# ---------------------------------------------------------------------------------------------
# L-5 composed losses (need an exec scope under gradients, SPEC §3.0)

def _onehot(x, class_tag: str, labels):
    """f32 one-hot in x's own tag order; labels one per position (x minus class_tag, row-major)."""
    r = x._raw
    ax, rest = axes.reduced(x.tags, class_tag, "nll_loss")
    K = r.shape[ax]
    rest_shape = r.shape[:ax] + r.shape[ax + 1:]
    R = int(np.prod(rest_shape)) if rest_shape else 1
    arr, _ = host_labels("nll_loss", labels, R, K, positions=rest)
    oh = np.zeros((R, K), np.float32)
    oh[np.arange(R), arr.astype(np.int64)] = 1.0
    oh = np.moveaxis(oh.reshape(tuple(rest_shape) + (K,)), -1, ax)
    return np.ascontiguousarray(oh), R


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

    def linear_cross_entropy(self, weight, labels, *, ignore_index=None, reduction: str = "mean",
                             label_smoothing: float = 0.0):
        """cross_entropy(self · weightᵀ) fused: self [..rows, shared] (every axis before the
        shared one is a row axis: a batch of sequences is [batch, seq, shared] with labels
        tagged (batch, seq)), weight [class, shared]; gradients to both; the backward record is
        single-use (SPEC L-2)."""
        return self._result(*linear_cross_entropy(self, weight, labels, ignore_index, reduction,
                                                  label_smoothing))

    linear_cross_entropy_ext = linear_cross_entropy

    # L-4 elementwise losses: one fused forward kernel per loss and one fused derivative kernel
    # per operand (templates in fucina/kernel_templates/losses.py); the derivative kernels read
    # (g, x, t) and a scale parameter (1/n for mean, else 1).
    def mse_loss(self, target, reduction: str = "mean"):
        """(x − t)² per element; grads to both operands."""
        return self._result(*pointwise_loss("mse_loss", self, target, reduction,
                                            MSE_FWD, MSE_DX, MSE_DT))

    def huber_loss(self, target, delta: float = 1.0, reduction: str = "mean"):
        """|d| ≤ δ ? d²/2 : δ(|d| − δ/2), d = x − t; δ finite and > 0 (else InvalidShape)."""
        d = _delta(delta)
        return self._result(*pointwise_loss("huber_loss", self, target, reduction,
                                            HUBER_FWD, HUBER_DX, HUBER_DT, (d,)))

    def bce_loss(self, target, reduction: str = "mean", from_logits: bool = False):
        """Binary cross-entropy. from_logits: max(x,0) − x·y + log1p(e^−|x|). Else x is a
        probability clamped to [1e-7, 1 − 1e-7] with input gradient 0 outside the open interval
        (SPEC §7.1 item 5: torch clamps the log at −100 instead)."""
        if from_logits:
            return self._result(*pointwise_loss("bce_loss", self, target, reduction,
                                                BCEL_FWD, BCEL_DX, BCEL_DT))
        return self._result(*pointwise_loss("bce_loss", self, target, reduction, BCEP_FWD,
                                            BCEP_DX, BCEP_DT, (BCE_EPS, 1.0 - BCE_EPS)))

    def kl_div_loss(self, target, reduction: str = "mean", log_target: bool = False):
        """self = log-probs: t·(ln t − x) (0 where t ≤ 0), or e^t·(t − x) with log_target.
        `mean` is the total-element mean; there is no batchmean (SPEC §7.1 item 6)."""
        if log_target:
            return self._result(*pointwise_loss("kl_div_loss", self, target, reduction,
                                                KLL_FWD, KLL_DX, KLL_DT))
        return self._result(*pointwise_loss("kl_div_loss", self, target, reduction,
                                            KL_FWD, KL_DX, KL_DT))

    def nll_loss(self, class_tag: str, labels, reduction: str = "mean"):
        """−x[y] per position (x = log-probs) via one-hot · mul · sum · neg; composed (an exec
        scope is required under gradients)."""
        reduction = _reduction("nll_loss", reduction)
        self._live("nll_loss")
        oh, R = _onehot(self, class_tag, labels)
        require_scope("nll_loss", self)
        ctx = self._raw.ctx
        picked = (self * ctx.tensor(oh, self.tags)).sum(class_tag)
        per = -picked
        if reduction == "none":
            return per
        return per.mean_all() if reduction == "mean" else per.sum_all()

    def cosine_similarity(self, other, tag: str, eps: float = 1e-8):
        """Σxy / max(‖x‖·‖y‖, eps) over `tag` (removed); grads to both; composed."""
        self._live("cosine_similarity")
        other._live("cosine_similarity")
        require_scope("cosine_similarity", self, other)
        num = (self * other).sum(tag)
        den = (self.norm(tag, "l2") * other.norm(tag, "l2")).clamp_min(float(eps))
        return num / den
