"""Row walkers shared by the row-kernel families (softmax, norm, loss, rope): every sum or max
over a contiguous row folds the same way — 4 vector accumulators striding 4 vectors, single
vectors into slot 0, a masked tail into slot 1, then the fixed fold of emit.fold — so each
family's order is fixed by the row length alone. map_pass walks element passes (elementwise,
attention's numerators): a long lane formula there goes several vectors a step (wide_step)."""
from __future__ import annotations

from llvmlite import ir

from . import irutil as u
from . import vmath
from .emit import fold

UNROLL = 4
WIDE_STEP = 4       # vectors per step of a long lane formula on an 8-lane host (wide_step)
LONG_FORMULA = 16   # instructions in one lane formula from which it is long


def wide_step(size: int, lanes: int) -> int:
    """Vectors per step of map_pass for a lane formula of `size` instructions: WIDE_STEP for a
    long formula on an 8-lane (AVX2) host, else 1. A long formula (exp, tanh, erf, a sigmoid:
    one dependency chain of 16-45 instructions) run one vector a step leaves Zen 3's
    out-of-order window holding about one chain, waiting on its latencies. A step of four
    vectors is one 32-lane vector, which LLVM splits into four 8-lane chains emitted side by
    side; each lane runs the same operations, so the bits are the same. Zen 3, [256, 3072],
    one thread: silu 1.23x, swiglu and its two grads 1.22-1.23x, gelu 1.29x, gelu_grad 1.40x,
    sigmoid 1.20x, tanh / log / exp 1.13-1.14x, gelu_erf 1.07x; the attention backward's
    p = e^(z − lse) pass four vectors a step: forward + backward 1.7 % faster at seq 1024
    (in-process A/B). Not measured with 16 lanes."""
    return long_step(lanes) if size >= LONG_FORMULA else 1


def long_step(lanes: int) -> int:
    """wide_step of a formula known to be long (an exp)."""
    return WIDE_STEP if lanes == 8 else 1


def fold_pass(b, start, stop, W, accs, value, step, fill):
    """Fold value(c, mask) over [start, stop) into the accumulator slots `accs` (4 of them):
    4 vectors per step into the 4 slots, then single vectors into slot 0, then a masked tail
    (lanes past `stop` replaced by `fill`) into slot 1. value(c, None) is a full vector at c;
    value(c, mask) may read (and write) only the lanes of `mask`."""
    fold_passes(b, start, stop, W, [accs], lambda c, m: [value(c, m)], [step], [fill])


def fold_passes(b, start, stop, W, groups, value, steps, fills):
    """fold_pass for several sums at once: value(c, mask) -> one vector per group of slots."""
    n = b.sub(stop, start)
    big = b.add(start, b.sub(n, b.srem(n, u.i64(UNROLL * W))))

    def update(slot, c, mask=None):
        vs = value(c, mask)
        for accs, v, step, fill in zip(groups, vs, steps, fills):
            if mask is not None:
                v = b.select(mask, v, u.const(v.type, fill))
            b.store(step(b, b.load(accs[slot]), v), accs[slot])

    with u.Loop(b, start, big, UNROLL * W, "f4") as c:
        for t in range(UNROLL):
            update(t, b.add(c, u.i64(t * W)))
    full = b.add(start, b.sub(n, b.srem(n, u.i64(W))))
    with u.Loop(b, big, full, W, "f1") as c:
        update(0, c)
    rest = b.sub(stop, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        update(1, full, u.tail_mask(b, rest, W))


def map_pass(b, start, stop, W, body, wide=1):
    """body(c, mask) over [start, stop): full vectors (mask None), then one masked tail. With
    wide > 1 (wide_step) the full vectors go `wide` at a time first, each step one vector of
    wide·W lanes: body(c, None, lanes=wide·W), so such a body takes `lanes` (default W)."""
    n = b.sub(stop, start)
    first = start
    if wide > 1:
        first = b.add(start, b.sub(n, b.srem(n, u.i64(wide * W))))
        with u.Loop(b, start, first, wide * W, "w") as c:
            body(c, None, lanes=wide * W)
    full = b.add(start, b.sub(n, b.srem(n, u.i64(W))))
    with u.Loop(b, first, full, W, "m") as c:
        body(c, None)
    rest = b.sub(stop, full)
    with b.if_then(b.icmp_signed(">", rest, u.i64(0))):
        body(full, u.tail_mask(b, rest, W))


def chunk_pass(b, c0, c1, n, chunk, W, body):
    """map_pass over the elements of chunks [c0, c1) of an n-element grid: [c0·chunk,
    min(c1·chunk, n)). With chunk a multiple of W every full step starts on a multiple of W."""
    map_pass(b, b.mul(c0, chunk), u.smin(b, b.mul(c1, chunk), n), W, body)


def accs_of(b, ty, value):
    """UNROLL accumulator slots of vector type `ty`, each set to `value`."""
    slots = [u.entry_alloca(b, ty) for _ in range(UNROLL)]
    for p in slots:
        b.store(u.const(ty, value), p)
    return slots


def fadd(b, x, y):
    return b.fadd(x, y)


def fmax(b, x, y):
    """x > y ? x : y (one vmaxps). NaN need not propagate through a row max here: a NaN logit
    makes its exp, hence the row sum, NaN, so the row's result is NaN either way."""
    return vmath.fmax(b, x, y)


def finite(b, m):
    return b.fcmp_ordered("<", vmath.fabs(b, m), u.const(m.type, float("inf")))


def max_of(b, start, stop, W, mx, value):
    """The max of value(c, mask) over [start, stop), through the slots mx (reset here)."""
    for p in mx:
        b.store(u.const(ir.VectorType(u.F32, W), float("-inf")), p)
    fold_pass(b, start, stop, W, mx, value, fmax, float("-inf"))
    return fold(b, mx, fmax)


def exp_sum(b, start, stop, W, sx, value, shift, dst=None):
    """Σ e^(value(c, mask) − shift) over [start, stop) (shift a vector), through the slots sx
    (reset here); with `dst`, each e^(value − shift) is stored at dst[c] on the way: a
    softmax's numerators and their sum."""
    def e(c, msk):
        x = vmath.exp(b, b.fsub(value(c, msk), shift))
        if dst is not None:
            u.store(b, x, dst, c, "f32", msk)
        return x

    for p in sx:
        b.store(u.const(ir.VectorType(u.F32, W), 0.0), p)
    fold_pass(b, start, stop, W, sx, e, fadd, 0.0)
    return fold(b, sx, fadd)


def row_max_sum(b, xb, K, W, mx, sx, sx2=None):
    """(m shifted to 0 when not finite, S = sum exp(x - m)[, sum x]) of the row at xb.
    With `sx2` slots, sum x is folded in the max pass (cross-entropy's label smoothing)."""
    vt = ir.VectorType(u.F32, W)
    load = lambda c, m: u.load(b, xb, c, "f32", W, m)  # noqa: E731
    if sx2 is None:
        m = max_of(b, u.i64(0), K, W, mx, load)
        sumx = None
    else:
        for p in mx:
            b.store(u.const(vt, float("-inf")), p)
        for p in sx2:
            b.store(u.const(vt, 0.0), p)
        fold_passes(b, u.i64(0), K, W, [mx, sx2], lambda c, m: [load(c, m)] * 2, [fmax, fadd],
                    [float("-inf"), 0.0])
        sumx = fold(b, sx2, fadd)
        m = fold(b, mx, fmax)
    m = b.select(finite(b, m), m, u.const(u.F32, 0.0))
    S = exp_sum(b, u.i64(0), K, W, sx, load, u.splat(b, m, W))
    return (m, S) if sx2 is None else (m, S, sumx)
