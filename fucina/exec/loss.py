"""Cross-entropy at the exec layer: rows of logits [R, K] (class axis contiguous), labels as
i64 with -1 for ignored rows; per-row losses and the saved {max, sum exp} statistics."""
from __future__ import annotations

from ..codegen import kernels
from ..codegen.loss import CeBackwardKey, CeForwardKey, SerialSumKey
from .elementwise import f32_bits

WORK_PER_CHUNK = 1 << 15


def _per(K: int) -> int:
    return max(1, WORK_PER_CHUNK // max(K, 1))


def ce_forward(ctx, x, labels, eps: float):
    """(loss[R], m[R], s[R]) for contiguous x [R, K] and i64 labels [R]."""
    R, K = x.shape
    loss, m, s = ctx.empty((R,), "f32"), ctx.empty((R,), "f32"), ctx.empty((R,), "f32")
    per = _per(K)
    ctx.launch(kernels.get(CeForwardKey()), -(-R // per), R * K * 4 * 3,
               x.addr, labels.addr, loss.addr, m.addr, s.addr, R, K, f32_bits(eps), per)
    return loss, m, s


def serial_sum(ctx, v):
    """The f32 sum of contiguous v [R] added one value at a time in index order (a 0-d raw)."""
    out = ctx.empty((), "f32")
    ctx.launch(kernels.get(SerialSumKey()), 1, v.numel * 4, v.addr, out.addr, v.numel)
    return out


def ce_backward(ctx, x, labels, m, s, g, eps: float, scale: float, out=None):
    """dx [R, K]; g is a scalar (the same coefficient for every row) or one value per row.
    out=x writes the gradient over the logits (each element is read before it is written)."""
    R, K = x.shape
    dx = ctx.empty((R, K), "f32") if out is None else out
    per = _per(K)
    ctx.launch(kernels.get(CeBackwardKey()), -(-R // per), R * K * 4 * 2,
               x.addr, labels.addr, m.addr, s.addr, g.addr, 0 if g.numel == 1 else 1, dx.addr,
               R, K, f32_bits(eps), f32_bits(scale), per)
    return dx


# ---------------------------------------------------------------------------------------------
# linear cross-entropy (SPEC L-2): the projections, in blocks of classes so that no GEMM packs
# a whole [rows, classes] (or [classes, shared]) operand into scratch

BLOCK_FLOATS = 1 << 22   # at most this many floats of [rows, classes] per GEMM call ...
BLOCKS_MIN = 8           # ... and at most 1/8 of the classes


def class_block(R: int, K: int) -> int:
    """Classes per block: a function of the shape alone (so are the bits)."""
    return min(K, max(256, min(BLOCK_FLOATS // max(R, 1), K // BLOCKS_MIN) // 64 * 64))


def linear_logits(ctx, x, w):
    """logits [R, K] = x [R, D] · w [K, D]ᵀ, one block of classes at a time."""
    from . import elementwise as ew
    from .matmul import gemm

    R, K = x.shape[0], w.shape[0]
    logits = ctx.empty((R, K), "f32")
    kb = class_block(R, K)
    if kb == K:
        return gemm(ctx, x, w.permute((1, 0)), out=logits)
    for k0 in range(0, K, kb):
        n = min(kb, K - k0)
        part = gemm(ctx, x, w.narrow(0, k0, n).permute((1, 0)))
        ew.run(ctx, "copy", "f32", (R, n), [part], out=logits.view((R, n), (K, 1), k0))
    return logits


def linear_grads(ctx, G, x, w, want_dx: bool, want_dw: bool):
    """(dx = G·w, dw = Gᵀ·x) from the logits' gradient G [R, K], blocks of classes: dw block by
    block, dx accumulated over the blocks in order."""
    from .matmul import gemm

    R, K = G.shape
    D = x.shape[1]
    kb = class_block(R, K)
    dx = ctx.empty((R, D), "f32") if want_dx else None
    dw = ctx.empty((K, D), "f32") if want_dw else None
    for k0 in range(0, K, kb):
        n = min(kb, K - k0)
        g = G.narrow(1, k0, n)
        if want_dw:
            gemm(ctx, g.permute((1, 0)), x, out=dw.view((n, D), (D, 1), k0 * D))
        if want_dx:
            gemm(ctx, g, w.narrow(0, k0, n), out=dx, accumulate=k0 > 0)
    return dx, dw
