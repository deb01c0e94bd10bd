"""grouped_attention (SPEC §3.12): multi-head attention with grouped KV heads, causal (aligned to
the end of the keys, optionally windowed) or bidirectional, f32 with the full q/k/v backward or
f16 keys/values (widened once; gradient to q only). The forward saves q, k, v, the output and
the per-row log-sum-exp; the backward recomputes the scores from them (exec/attention.py)."""
from __future__ import annotations

import functools
import numbers

from ..errors import (DTypeError, IndexOutOfBounds, InvalidArgument, InvalidArgumentType,
                      InvalidDataLength, InvalidShape, ShapeMismatch, TagError, UnsupportedGradient)
from ..exec import attention as exa
from ..exec import elementwise as ew
from ..exec.raw import contiguous_strides
from .checks import real, same_ctx
from .engine import finish_op, needs_graph

__all__: list[str] = []

Q_TAGS = ("seq", "head", "d")
KV_TAGS = ("seq", "kv_head", "d")
MASKS = ("causal", "bidirectional")


def _check_kv(op, what, q, t, D):
    same_ctx(op, q, t)
    r = t._live(op)
    lead = q.tags[:-3]
    if t.tags != lead + KV_TAGS:
        raise TagError(f"{op}: expected {what} tagged {lead + KV_TAGS} (q's leading axes, then "
                       f"{KV_TAGS}), got {t.tags}")
    if r.shape[:-3] != q._raw.shape[:-3]:
        raise ShapeMismatch(f"{op}: expected {what} with q's leading axes {q._raw.shape[:-3]}, "
                            f"got {r.shape[:-3]}")
    if r.dtype not in ("f32", "f16"):
        raise DTypeError(f"{op}: expected {what} of dtype f32 or f16, got {r.dtype}")
    if r.shape[-1] != D:
        raise ShapeMismatch(f"{op}: expected {what} with head dim {D} (q's), got {r.shape[-1]}")
    return r


def _mapping(op, heads, H, KVH):
    """The head map as a tuple, and G when it is the standard grouping h -> h // G."""
    try:
        m = tuple(int(x) for x in heads)
    except TypeError:
        raise InvalidArgumentType(f"{op}: kv_head_for_head: expected a sequence of ints, got "
                        f"{type(heads).__name__}") from None
    if len(m) != H:
        raise InvalidDataLength(f"{op}: kv_head_for_head: expected {H} entries (one per query "
                                f"head), got {len(m)}")
    for h, x in enumerate(m):
        if not 0 <= x < KVH:
            raise IndexOutOfBounds(f"{op}: kv_head_for_head[{h}]: expected a KV head in "
                                   f"[0, {KVH}), got {x}")
    G = H // KVH
    standard = H % KVH == 0 and all(x == h // G for h, x in enumerate(m))
    return m, standard


def _expand(ctx, x, m):
    """[T, KVH, D] -> [T, H, D] with head h a copy of KV head m[h]."""
    T, _, D = x.shape
    H = len(m)
    out = ctx.empty((T, H, D), "f32")
    for h, src in enumerate(m):
        ew.run(ctx, "copy", "f32", (T, D), [x.view((T, D), (x.strides[0], 1), x.offset + src * D)],
               out=out.view((T, D), (H * D, 1), h * D))
    return out


def _fold(ctx, dx, m, KVH):
    """The gradient of _expand: [T, H, D] -> [T, KVH, D], heads added in head order."""
    T, H, D = dx.shape
    out = ctx.empty((T, KVH, D), "f32")
    ew.run(ctx, "copy", "f32", out.shape, [0.0], out=out)
    for h, dst in enumerate(m):
        o = out.view((T, D), (KVH * D, 1), dst * D)
        ew.run(ctx, "add", "f32", (T, D), [o, dx.view((T, D), (H * D, 1), h * D)], out=o)
    return out


def attention(op, q, k, v, heads, out_tag, scale, mask, window, bias):
    ctx = q.ctx
    qr = q._live(op)
    if q.tags[-3:] != Q_TAGS or len(set(q.tags)) != len(q.tags):
        raise TagError(f"{op}: expected q tagged {Q_TAGS}, after any leading batch axes, got "
                       f"{q.tags}")
    if qr.dtype != "f32":
        raise DTypeError(f"{op}: expected q of dtype f32, got {qr.dtype}")
    if not isinstance(out_tag, str) or out_tag == "seq":
        raise TagError(f"{op}: expected out_tag a string other than 'seq', got {out_tag!r}")
    S, H, D = qr.shape[-3:]
    kr = _check_kv(op, "k", q, k, D)
    vr = _check_kv(op, "v", q, v, D)
    if kr.shape != vr.shape or kr.dtype != vr.dtype:
        raise ShapeMismatch(f"{op}: expected v of k's shape and dtype {kr.shape} {kr.dtype}, "
                            f"got {vr.shape} {vr.dtype}")
    T, KVH, _ = kr.shape[-3:]
    lead = qr.shape[:-3]
    m, standard = _mapping(op, heads, H, KVH)
    scale = real(op, scale)
    if mask not in MASKS:
        raise InvalidArgument(f"{op}: mask: expected one of {MASKS}, got {mask!r}")
    causal = mask == "causal"
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise InvalidShape(f"{op}: window: expected an int >= 0, got {window!r}")
    if window and not causal:
        raise InvalidShape(f"{op}: window={window} needs mask='causal', got mask={mask!r}")
    if causal and T < S:
        raise ShapeMismatch(f"{op}: causal attention aligns queries to the end of the keys: "
                            f"expected kv seq >= q seq ({S}), got {T}")
    br = None
    if bias is not None:
        same_ctx(op, q, bias)
        br = bias._live(op)
        if causal:
            raise InvalidShape(f"{op}: bias needs mask='bidirectional', got mask={mask!r}")
        if lead:
            raise InvalidShape(f"{op}: a bias takes no batch axes; expected q tagged {Q_TAGS}, "
                               f"got {q.tags}")
        if br.dtype != "f32":
            raise DTypeError(f"{op}: expected bias of dtype f32, got {br.dtype}")
        if br.shape != (S, T):
            raise ShapeMismatch(f"{op}: expected bias of shape {(S, T)} ([q seq, kv seq]), got "
                                f"{br.shape}")
        if needs_graph(q, k, v, bias):
            raise UnsupportedGradient(f"{op}: an attention bias is inference-only; expected no "
                                      f"operand requiring grad (use fu.no_grad())")
        br = ew.materialize(ctx, br)
    if S == 1 and not lead and causal and br is None and standard and not needs_graph(q, k, v):
        out, _ = exa.decode(ctx, ew.materialize(ctx, qr), ew.materialize(ctx, kr),
                            ew.materialize(ctx, vr), KVH, int(window), scale)
        return finish_op(op, out, ("seq", out_tag), (q, k, v), None)
    half = kr.dtype == "f16"
    if half and needs_graph(k, v):
        raise UnsupportedGradient(f"{op}: f16 k/v get no gradient (gradient flows to q only); "
                                  f"pass f32 k/v to train them")
    qr = ew.materialize(ctx, qr)
    kr = ew.cast(ctx, kr, "f32") if half else ew.materialize(ctx, kr)
    vr = ew.cast(ctx, vr, "f32") if half else ew.materialize(ctx, vr)
    geo = exa.Geometry(S, H, D, T, H if not standard else KVH, causal, int(window))
    nb = 1
    for n in lead:
        nb *= n
    out = ctx.empty(lead + (S, H * D), "f32")
    lse = ctx.empty((nb, H, S) if lead else (H, S), "f32")
    items = []      # per batch item: (q, k, v (expanded), out, lse) views
    for i in range(nb):
        qi, ki, vi = (_item(x, i, 3) for x in (qr, kr, vr))
        oi, li = _item(out, i, 2), _item(lse, i, 2)
        ke, ve = (ki, vi) if standard else (_expand(ctx, ki, m), _expand(ctx, vi, m))
        exa.forward(ctx, qi, ke, ve, geo, scale, br, out=oi, lse=li)
        items.append((qi, ke, ve, oi, li))
    saved = (ctx, items, qr.shape, kr.shape, geo, scale, None if standard else (m, KVH))
    return finish_op(op, out, q.tags[:-3] + ("seq", out_tag), (q, k, v),
                     lambda needs: functools.partial(_grads, saved, needs))


def _item(x, i, r):
    """Batch item i of a contiguous tensor: its last r axes, the leading ones flattened."""
    if x.rank == r:
        return x
    tail = x.shape[-r:]
    n = 1
    for d in tail:
        n *= d
    return x.view(tail, x.strides[-r:], x.offset + i * n)


def _grads(saved, needs, g):
    ctx, items, qshape, kshape, geo, scale, expanded = saved
    g = ew.materialize(ctx, g)
    kv = needs[1] or needs[2]
    if len(items) == 1:
        qi, ke, ve, oi, li = items[0]
        dq, dk, dv = exa.backward(ctx, qi, ke, ve, oi, li, g, geo, scale, kv)
        if expanded is not None and dk is not None:
            dk, dv = _fold(ctx, dk, *expanded), _fold(ctx, dv, *expanded)
        dq, dk, dv = (None if d is None else d.view(shape, contiguous_strides(shape))
                      for d, shape in ((dq, qshape), (dk, kshape), (dv, kshape)))
    else:           # a batch: each item's gradients written into its slice
        dq = ctx.empty(qshape, "f32")
        dk, dv = (ctx.empty(kshape, "f32"), ctx.empty(kshape, "f32")) if kv else (None, None)
        for i, (qi, ke, ve, oi, li) in enumerate(items):
            gi = g.view(oi.shape, oi.strides, g.offset + i * oi.numel)
            parts = exa.backward(ctx, qi, ke, ve, oi, li, gi, geo, scale, kv)
            if expanded is not None and parts[1] is not None:
                parts = (parts[0], _fold(ctx, parts[1], *expanded), _fold(ctx, parts[2], *expanded))
            for full, part in zip((dq, dk, dv), parts):
                if full is not None:
                    ew.run(ctx, "copy", "f32", part.shape, [part], out=_item(full, i, 3))
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None)



class AttentionMethods:
    """Tensor methods of attention (SPEC §3.12)."""

    __slots__ = ()

    def grouped_attention(self, k, v, kv_head_for_head, out_tag: str, scale: float, *,
                          mask: str = "causal", window: int = 0, bias=None):
        """softmax(scale·q·kᵀ (+ bias)) · v per query head, KV head kv_head_for_head[h].

        q ("seq", "head", "d"); k, v ("seq", "kv_head", "d"), f32 (gradients to q, k, v) or f16
        (gradient to q only). mask "causal" aligns query i of S to key T − S + i (window w > 0
        keeps only the last w keys) or "bidirectional" (then an f32 [S, T] `bias` may be added,
        inference-only). Result ("seq", out_tag) of shape [S, H·D], head-major."""
        return self._result(*attention("grouped_attention", self, k, v, kv_head_for_head,
                                       out_tag, scale, mask, window, bias))
