"""Block-quantized formats (SPEC R-9): ggml wire-compatible decoders for q4_0, q4_1, q5_0, q5_1,
q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, tq2_0 and byte-exact encoders for q8_0, q4_k, q5_k,
q6_k, tq2_0 (the reference quantizers ggml uses when no importance matrix is given).

One kernel per format and direction: it walks the blocks [c0*per, min(c1*per, n)) of a
contiguous run of blocks (a tensor's rows laid end to end), so the chunk grid is fixed by the
number of blocks and every result is independent of the thread count.

Decoders work a whole block at a time in vectors of 16 or 32 lanes (the block layouts are built
from 16- and 32-byte groups; LLVM splits a vector wider than the target's registers). Every
decoded value is computed with the operations and operand order of ggml's `dequantize_row_*`.

The encoders reproduce ggml's float arithmetic step for step: each per-element quantity is a
vector op, and every sum that ggml accumulates in a loop is accumulated lane by lane in that
same order (`_osum`), so the searches over candidate scales make the same choices bit for bit.
Maxima and minima, which do not depend on order, fold as a lane tree.

Argument block (both directions): src, dst, number of blocks, blocks per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import irutil as u
from .emit import lane_tree, sqrt
from .kernels import KernelKey, register

# name: (elements per block, bytes per block)
FORMATS = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176),
    "q6_k": (256, 210), "q8_k": (256, 292), "tq2_0": (256, 66),
}
ENCODABLE = ("q8_0", "q4_k", "q5_k", "q6_k", "tq2_0")

F32, I8, I32 = u.F32, u.I8, u.I32
GROUP_MAX_EPS = 1e-15


@register
@dataclass(frozen=True)
class QuantKey(KernelKey):
    """fmt: a block format of FORMATS; op: decode (blocks -> f32) | encode (f32 -> blocks)."""

    family = "quant"
    fmt: str
    op: str

    def ir(self, symbol: str) -> str:
        mod, b, args, c0, c1 = u.kernel(symbol)
        src, dst = u.arg_ptr(b, args, 0), u.arg_ptr(b, args, 1)
        n, per = u.arg(b, args, 2), u.arg(b, args, 3)
        elems, nbytes = FORMATS[self.fmt]
        with u.Loop(b, b.mul(c0, per), u.smin(b, b.mul(c1, per), n), 1, "blk") as k:
            packed = b.gep(dst if self.op == "encode" else src, [b.mul(k, u.i64(nbytes))],
                           source_etype=I8)
            floats = b.gep(src if self.op == "encode" else dst, [b.mul(k, u.i64(elems))],
                           source_etype=F32)
            if self.op == "decode":
                DECODERS[self.fmt](b, packed, floats)
            else:
                _ENCODERS[self.fmt](b, floats, packed)
        b.ret_void()
        return str(mod)


# ---------------------------------------------------------------------------------------------
# small IR helpers

def _vt(elem, n):
    return ir.VectorType(elem, n)


def _cv(elem, values):
    """A constant vector of the given lane values."""
    return ir.Constant(_vt(elem, len(values)), [ir.Constant(elem, v) for v in values])


def _at(b, base, index, elem, ty):
    """Pointer to a `ty` at element `index` (of type `elem`) of base (a raw or stack pointer)."""
    p = b.gep(base, [index if isinstance(index, ir.Value) else u.i64(index)], source_etype=elem)
    return p if p.type.is_opaque else b.bitcast(p, ir.PointerType(ty))


def _load(b, p, off, ty, align=1):
    v = b.load(_at(b, p, off, I8, ty), typ=ty)
    v.align = align
    return v


def _bytes(b, p, off, n):
    """n bytes at p+off, zero-extended to i32 lanes."""
    return b.zext(_load(b, p, off, _vt(I8, n)), _vt(I32, n))


def _sbytes(b, p, off, n):
    """n signed bytes at p+off as i32 lanes."""
    return b.sext(_load(b, p, off, _vt(I8, n)), _vt(I32, n))


def _half(b, p, off):
    return b.fpext(_load(b, p, off, u.F16), F32)


def _store(b, v, p, off):
    s = b.store(v, _at(b, p, off, I8, v.type))
    s.align = 1


def _store_half(b, x, p, off):
    _store(b, b.fptrunc(x, u.F16), p, off)


def _storef(b, v, y, idx):
    s = b.store(v, b.gep(y, [u.i64(idx)], source_etype=F32))
    s.align = 4


def _loadf(b, x, idx, n):
    v = b.load(b.gep(x, [u.i64(idx)], source_etype=F32), typ=_vt(F32, n))
    v.align = 4
    return v


def _c(ty, value):
    return u.const(ty, value)


def _sp(b, scalar, n):
    return u.splat(b, scalar, n)


def _float(b, v):
    return b.sitofp(v, _vt(F32, v.type.count) if isinstance(v.type, ir.VectorType) else F32)


def _scaled(b, q, d, n, bias=None):
    """float(q) * d (- bias): d and bias scalars, q i32 lanes."""
    v = b.fmul(_float(b, q), _sp(b, d, n))
    return v if bias is None else b.fsub(v, _sp(b, bias, n))


def _fabs(b, x):
    return u.intrinsic(b, "llvm.fabs", x.type, [x])


def _vmax(b, v):
    return lane_tree(b, v, lambda b, x, y: b.select(b.fcmp_ordered(">", x, y), x, y))


def _vmin(b, v):
    return lane_tree(b, v, lambda b, x, y: b.select(b.fcmp_ordered("<", x, y), x, y))


def _osum(b, v, start=0.0):
    """Sum the lanes of v in lane order, as a C loop `s = start; s += v[i]` does. start=None
    starts from lane 0 (a loop that initialises its sum with the first term)."""
    n = v.type.count
    acc = b.extract_element(v, u.i64(0))
    if start is not None:
        acc = b.fadd(_c(F32, start), acc)
    for k in range(1, n):
        acc = b.fadd(acc, b.extract_element(v, u.i64(k)))
    return acc


def _nearest(b, x):
    """ggml's nearest_int: round to nearest even through the 1.5*2^23 trick (|x| < 2^22)."""
    t = b.bitcast(b.fadd(x, _c(x.type, 12582912.0)),
                  _vt(I32, x.type.count) if isinstance(x.type, ir.VectorType) else I32)
    return b.sub(b.and_(t, _c(t.type, 0x007FFFFF)), _c(t.type, 0x00400000))


def _clamp(b, v, lo, hi):
    v = b.select(b.icmp_signed("<", v, _c(v.type, lo)), _c(v.type, lo), v)
    return b.select(b.icmp_signed(">", v, _c(v.type, hi)), _c(v.type, hi), v)


def _round_away(b, x):
    """C roundf/lroundf: halfway cases away from zero, as an i32."""
    r = u.intrinsic(b, "llvm.round", x.type, [x])
    return b.fptosi(r, _vt(I32, x.type.count) if isinstance(x.type, ir.VectorType) else I32)


def _slot(b, ty, init=None):
    p = u.entry_alloca(b, ty)
    if init is not None:
        b.store(init, p)
    return p


def _array(b, elem, n):
    """A stack array of n elements (indexed through _at, _load and _store)."""
    return u.entry_alloca(b, ir.ArrayType(elem, n))


def _select_slot(b, cond, slot, value):
    b.store(b.select(cond, value, b.load(slot)), slot)


# ---------------------------------------------------------------------------------------------
# decoders: `src` the block's bytes, `y` its output floats

def _dec_q4_0(b, s, y):
    d = _half(b, s, 0)
    qs = _bytes(b, s, 2, 16)
    for half, q in ((0, b.and_(qs, _c(qs.type, 15))), (16, b.lshr(qs, _c(qs.type, 4)))):
        _storef(b, _scaled(b, b.sub(q, _c(q.type, 8)), d, 16), y, half)


def _dec_q4_1(b, s, y):
    d, m = _half(b, s, 0), _half(b, s, 2)
    qs = _bytes(b, s, 4, 16)
    for half, q in ((0, b.and_(qs, _c(qs.type, 15))), (16, b.lshr(qs, _c(qs.type, 4)))):
        _storef(b, b.fadd(_scaled(b, q, d, 16), _sp(b, m, 16)), y, half)


def _q5_values(b, s, qh_off, qs_off):
    """The two 16-lane halves of 5-bit values (low nibble + bit j / j+16 of qh)."""
    qh = _sp(b, _load(b, s, qh_off, I32), 16)
    qs = _bytes(b, s, qs_off, 16)
    t = qs.type
    h0 = b.and_(b.shl(b.lshr(qh, _cv(I32, list(range(16)))), _c(t, 4)), _c(t, 0x10))
    h1 = b.and_(b.lshr(qh, _cv(I32, list(range(12, 28)))), _c(t, 0x10))
    return b.or_(b.and_(qs, _c(t, 15)), h0), b.or_(b.lshr(qs, _c(t, 4)), h1)


def _dec_q5_0(b, s, y):
    d = _half(b, s, 0)
    for half, q in zip((0, 16), _q5_values(b, s, 2, 6)):
        _storef(b, _scaled(b, b.sub(q, _c(q.type, 16)), d, 16), y, half)


def _dec_q5_1(b, s, y):
    d, m = _half(b, s, 0), _half(b, s, 2)
    for half, q in zip((0, 16), _q5_values(b, s, 4, 8)):
        _storef(b, b.fadd(_scaled(b, q, d, 16), _sp(b, m, 16)), y, half)


def _dec_q8_0(b, s, y):
    _storef(b, _scaled(b, _sbytes(b, s, 2, 32), _half(b, s, 0), 32), y, 0)


def _dec_q8_k(b, s, y):
    d = _load(b, s, 0, F32)
    for g in range(8):
        _storef(b, _scaled(b, _sbytes(b, s, 4 + 32 * g, 32), d, 32), y, 32 * g)


def _dec_q2_k(b, s, y):
    d, dmin = _half(b, s, 80), _half(b, s, 82)
    sc = _bytes(b, s, 0, 16)     # the 16 group scales and mins at once (lane = group)
    dls = b.fmul(_sp(b, d, 16), _float(b, b.and_(sc, _c(sc.type, 15))))
    mls = b.fmul(_sp(b, dmin, 16), _float(b, b.lshr(sc, _c(sc.type, 4))))
    for h in range(2):
        for j in range(4):
            for p in range(2):
                dl, ml = (b.extract_element(v, u.i64(h * 8 + j * 2 + p)) for v in (dls, mls))
                q = _bytes(b, s, 16 + h * 32 + p * 16, 16)
                q = b.and_(b.lshr(q, _c(q.type, 2 * j)), _c(q.type, 3))
                _storef(b, _scaled(b, q, dl, 16, ml), y, h * 128 + j * 32 + p * 16)


def _q3_scales(b, s):
    """The 16 6-bit scales of a q3_k block, minus 32, as 16 lanes: scale j's low 4 bits are
    byte 96 + j's low nibble (j < 8) or byte 96 + j − 8's high nibble, its top 2 bits bits
    2·(j // 4) of byte 104 + j % 4."""
    v = _bytes(b, s, 96, 12)
    t = _vt(I32, 16)
    pick = lambda lanes: b.shuffle_vector(v, v, _cv(I32, lanes))  # noqa: E731
    src = pick([j % 8 for j in range(16)])
    low = b.select(ir.Constant(_vt(ir.IntType(1), 16), [j < 8 for j in range(16)]),
                   b.and_(src, _c(t, 15)), b.lshr(src, _c(t, 4)))
    high = b.and_(b.lshr(pick([8 + j % 4 for j in range(16)]),
                         _cv(I32, [2 * (j // 4) for j in range(16)])), _c(t, 3))
    return b.sub(b.or_(low, b.shl(high, _c(t, 4))), _c(t, 32))


def _dec_q3_k(b, s, y):
    d = _half(b, s, 108)
    dls = b.fmul(_sp(b, d, 16), _float(b, _q3_scales(b, s)))   # lane = group
    for h in range(2):
        for j in range(4):
            for p in range(2):
                dl = b.extract_element(dls, u.i64(h * 8 + j * 2 + p))
                q = _bytes(b, s, 32 + h * 32 + p * 16, 16)
                q = b.and_(b.lshr(q, _c(q.type, 2 * j)), _c(q.type, 3))
                hm = b.and_(_bytes(b, s, p * 16, 16), _c(q.type, 1 << (h * 4 + j)))
                q = b.sub(q, b.select(b.icmp_unsigned("!=", hm, _c(q.type, 0)), _c(q.type, 0), _c(q.type, 4)))
                _storef(b, _scaled(b, q, dl, 16), y, h * 128 + j * 32 + p * 16)


def scales_mins_k4(b, s, off, d, dmin):
    """The 8 sub-block scales d·float(sc_j) and mins dmin·float(m_j) of a q4_k / q5_k
    super-block as two 8-lane vectors, each lane the scalar product the reference computes.
    ggml's get_scale_min_k4 unpacks the 6-bit pairs from the 12 bytes q at s+off: for j < 4
    sc = q[j] & 63, m = q[j+4] & 63; else sc = (q[j+4] & 15) | (q[j-4] >> 6) << 4,
    m = (q[j+4] >> 4) | (q[j] >> 6) << 4 — here for all j at once (lanes 0-3 and 4-7).
    Reads 16 bytes at s+off (the 12 scale bytes, then 4 of the block's quants)."""
    v = _bytes(b, s, off, 16)
    t = _vt(I32, 8)

    def pick(lanes):
        return b.shuffle_vector(v, v, _cv(I32, lanes))
    low = ir.Constant(_vt(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    a, mb = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])
    top = lambda x: b.shl(b.lshr(x, _c(t, 6)), _c(t, 4))  # noqa: E731
    sc = b.select(low, b.and_(a, _c(t, 63)),
                  b.or_(b.and_(a, _c(t, 15)), top(pick([0, 0, 0, 0, 0, 1, 2, 3]))))
    m = b.select(low, b.and_(mb, _c(t, 63)),
                 b.or_(b.lshr(mb, _c(t, 4)), top(pick([0, 0, 0, 0, 4, 5, 6, 7]))))
    return b.fmul(_sp(b, d, 8), _float(b, sc)), b.fmul(_sp(b, dmin, 8), _float(b, m))


def _dec_q45_k(b, s, y, five):
    d, dmin = _half(b, s, 0), _half(b, s, 2)
    dls, mls = scales_mins_k4(b, s, 4, d, dmin)
    qh = _bytes(b, s, 16, 32) if five else None
    for c in range(4):
        ql = _bytes(b, s, 48 + 32 * c if five else 16 + 32 * c, 32)
        t = ql.type
        for p in range(2):
            dl, ml = (b.extract_element(v, u.i64(2 * c + p)) for v in (dls, mls))
            q = b.and_(ql, _c(t, 15)) if p == 0 else b.lshr(ql, _c(t, 4))
            if five:
                bit = b.and_(qh, _c(t, 1 << (2 * c + p)))
                q = b.add(q, b.select(b.icmp_unsigned("!=", bit, _c(t, 0)), _c(t, 16), _c(t, 0)))
            _storef(b, _scaled(b, q, dl, 32, ml), y, 64 * c + 32 * p)


def _dec_q6_k(b, s, y):
    d = _half(b, s, 208)
    # the 16 group scales d·float(sc) in one vector (each lane the scalar product the
    # reference computes), then one lane per group: fewer instructions than 16 scalar chains
    dls = b.fmul(_sp(b, d, 16), _float(b, b.sext(_load(b, s, 192, _vt(I8, 16)), _vt(I32, 16))))
    for n in range(2):
        for g in range(2):
            qa = _bytes(b, s, 64 * n + 16 * g, 16)
            qb = _bytes(b, s, 64 * n + 32 + 16 * g, 16)
            qh = _bytes(b, s, 128 + 32 * n + 16 * g, 16)
            t = qa.type
            parts = ((b.and_(qa, _c(t, 15)), 0), (b.and_(qb, _c(t, 15)), 2),
                     (b.lshr(qa, _c(t, 4)), 4), (b.lshr(qb, _c(t, 4)), 6))
            for k, (low, shift) in enumerate(parts):
                high = b.and_(b.lshr(qh, _c(t, shift)), _c(t, 3))
                q = b.sub(b.or_(low, b.shl(high, _c(t, 4))), _c(t, 32))
                dl = b.extract_element(dls, u.i64(8 * n + g + 2 * k))
                _storef(b, _scaled(b, q, dl, 16), y, 128 * n + 16 * g + 32 * k)


def _dec_tq2_0(b, s, y):
    d = _half(b, s, 64)
    for jc in range(2):
        q = _bytes(b, s, 32 * jc, 32)
        for lvl in range(4):
            c = b.and_(b.lshr(q, _c(q.type, 2 * lvl)), _c(q.type, 3))
            _storef(b, _scaled(b, b.sub(c, _c(c.type, 1)), d, 32), y, 128 * jc + 32 * lvl)


DECODERS = {
    "q4_0": _dec_q4_0, "q4_1": _dec_q4_1, "q5_0": _dec_q5_0, "q5_1": _dec_q5_1, "q8_0": _dec_q8_0,
    "q2_k": _dec_q2_k, "q3_k": _dec_q3_k, "q4_k": lambda b, s, y: _dec_q45_k(b, s, y, False),
    "q5_k": lambda b, s, y: _dec_q45_k(b, s, y, True), "q6_k": _dec_q6_k, "q8_k": _dec_q8_k,
    "tq2_0": _dec_tq2_0,
}


# ---------------------------------------------------------------------------------------------
# encoders: `x` the block's 32 or 256 floats, `dst` its bytes

def _enc_q8_0(b, x, dst):
    v = _loadf(b, x, 0, 32)
    d = b.fdiv(_vmax(b, _fabs(b, v)), _c(F32, 127.0))
    nz = b.fcmp_unordered("une", d, _c(F32, 0.0))
    inv = b.select(nz, b.fdiv(_c(F32, 1.0), d), _c(F32, 0.0))
    _store_half(b, d, dst, 0)
    _store(b, b.trunc(_round_away(b, b.fmul(v, _sp(b, inv, 32))), _vt(I8, 32)), dst, 2)


def _enc_tq2_0(b, x, dst):
    vs = [_loadf(b, x, 32 * g, 32) for g in range(8)]
    amax = _vmax(b, _fabs(b, vs[0]))
    for v in vs[1:]:
        m = _vmax(b, _fabs(b, v))
        amax = b.select(b.fcmp_ordered(">", amax, m), amax, m)
    inv = b.select(b.fcmp_unordered("une", amax, _c(F32, 0.0)), b.fdiv(_c(F32, 1.0), amax), _c(F32, 0.0))
    _store_half(b, amax, dst, 64)
    t = _vt(I32, 32)
    for jc in range(2):
        q = _c(t, 0)
        for n in range(4):
            c = b.add(_round_away(b, b.fmul(vs[4 * jc + n], _sp(b, inv, 32))), _c(t, 1))
            q = b.add(q, b.shl(b.and_(c, _c(t, 3)), _c(t, 2 * n)))
        _store(b, b.trunc(q, _vt(I8, 32)), dst, 32 * jc)


def _qkx2(b, x, w, nmax, rmin, rdelta, nstep):
    """ggml's make_qkx2_quants (squared error, no MAD) on the lanes of x with weights w:
    (scale, the_min, L as i32 lanes). As in ggml, each candidate scale is measured from the
    best min found so far (the loop reads `min` after earlier candidates updated it)."""
    n = x.type.count
    vi = _vt(I32, n)
    mn, mx = _vmin(b, x), _vmax(b, x)
    sum_w = _osum(b, w, None)
    sum_x = _osum(b, b.fmul(w, x), None)
    mn = b.select(b.fcmp_ordered(">", mn, _c(F32, 0.0)), _c(F32, 0.0), mn)
    flat = b.fcmp_ordered("==", mx, mn)

    def levels(iscale, m):
        xm = b.fsub(x, _sp(b, m, n))
        return _clamp(b, _nearest(b, b.fmul(_sp(b, iscale, n), xm)), 0, nmax)

    def error(scale, lf, m):
        diff = b.fsub(b.fadd(b.fmul(_sp(b, scale, n), lf), _sp(b, m, n)), x)
        return _osum(b, b.fmul(w, b.fmul(diff, diff)))

    iscale = b.fdiv(_c(F32, float(nmax)), b.fsub(mx, mn))
    scale0 = b.fdiv(_c(F32, 1.0), iscale)
    L0 = levels(iscale, mn)
    Ls = _slot(b, vi, L0)
    best = _slot(b, F32, error(scale0, _float(b, L0), mn))
    scale = _slot(b, F32, scale0)
    mins = _slot(b, F32, mn)
    with u.Loop(b, u.i64(0), u.i64(nstep + 1), 1, "is") as step:
        m = b.load(mins)
        isf = b.sitofp(step, F32)
        num = b.fadd(b.fadd(_c(F32, rmin), b.fmul(_c(F32, rdelta), isf)), _c(F32, float(nmax)))
        la = levels(b.fdiv(num, b.fsub(mx, m)), m)
        lf = _float(b, la)
        wl = b.fmul(w, lf)
        sl, sl2, sxl = _osum(b, wl), _osum(b, b.fmul(wl, lf)), _osum(b, b.fmul(wl, x))
        D = b.fsub(b.fmul(sum_w, sl2), b.fmul(sl, sl))
        ts = b.fdiv(b.fsub(b.fmul(sum_w, sxl), b.fmul(sum_x, sl)), D)
        tm = b.fdiv(b.fsub(b.fmul(sl2, sum_x), b.fmul(sl, sxl)), D)
        pos = b.fcmp_ordered(">", tm, _c(F32, 0.0))
        tm = b.select(pos, _c(F32, 0.0), tm)
        ts = b.select(pos, b.fdiv(sxl, sl2), ts)
        cur = error(ts, lf, tm)
        take = b.and_(b.fcmp_ordered(">", D, _c(F32, 0.0)), b.fcmp_ordered("<", cur, b.load(best)))
        _select_slot(b, take, Ls, la)
        _select_slot(b, take, best, cur)
        _select_slot(b, take, scale, ts)
        _select_slot(b, take, mins, tm)
    L = b.select(flat, _c(vi, 0), b.load(Ls))
    sc = b.select(flat, _c(F32, 0.0), b.load(scale))
    m = b.select(flat, mn, b.load(mins))
    return sc, b.fneg(m), L


def _enc_q45_k(b, x, dst, five):
    """quantize_row_q4_K_ref / quantize_row_q5_K_ref for one block."""
    nmax, rmin, rdelta, nstep = (31, -0.5, 0.1, 15) if five else (15, -1.0, 0.1, 20)
    Lbuf, scales, mins = _array(b, I8, 256), _array(b, F32, 8), _array(b, F32, 8)
    max_scale, max_min = _slot(b, F32, _c(F32, 0.0)), _slot(b, F32, _c(F32, 0.0))
    with u.Loop(b, u.i64(0), u.i64(8), 1, "sub") as j:
        xv = b.load(b.gep(x, [b.mul(j, u.i64(32))], source_etype=F32), typ=_vt(F32, 32))
        xv.align = 4
        av = sqrt(b, b.fdiv(_osum(b, b.fmul(xv, xv)), _c(F32, 32.0)))
        w = b.fadd(_sp(b, av, 32), _fabs(b, xv))
        sc, mn, L = _qkx2(b, xv, w, nmax, rmin, rdelta, nstep)
        L8 = b.trunc(L, _vt(I8, 32))
        b.store(L8, _at(b, Lbuf, b.mul(j, u.i64(32)), I8, L8.type)).align = 1
        b.store(sc, _at(b, scales, j, F32, F32))
        b.store(mn, _at(b, mins, j, F32, F32))
        _select_slot(b, b.fcmp_ordered(">", sc, b.load(max_scale)), max_scale, sc)
        _select_slot(b, b.fcmp_ordered(">", mn, b.load(max_min)), max_min, mn)
    ms, mm = b.load(max_scale), b.load(max_min)

    def inv63(v):
        return b.select(b.fcmp_ordered(">", v, _c(F32, 0.0)), b.fdiv(_c(F32, 63.0), v), _c(F32, 0.0))

    def six_bits(inv, arr):
        v = b.load(_at(b, arr, 0, F32, _vt(F32, 8)), typ=_vt(F32, 8))
        v.align = 4
        q = b.and_(_nearest(b, b.fmul(_sp(b, inv, 8), v)), _c(_vt(I32, 8), 0xFF))  # uint8_t
        return b.select(b.icmp_unsigned("<", q, _c(q.type, 63)), q, _c(q.type, 63))

    ls, lm = six_bits(inv63(ms), scales), six_bits(inv63(mm), mins)
    lsj = [b.extract_element(ls, u.i64(j)) for j in range(8)]
    lmj = [b.extract_element(lm, u.i64(j)) for j in range(8)]
    packed = [None] * 12
    for j in range(4):
        packed[j], packed[j + 4] = lsj[j], lmj[j]
    for j in range(4, 8):
        packed[j + 4] = b.or_(b.and_(lsj[j], _c(I32, 15)), b.shl(b.and_(lmj[j], _c(I32, 15)), _c(I32, 4)))
        packed[j - 4] = b.or_(packed[j - 4], b.shl(b.lshr(lsj[j], _c(I32, 4)), _c(I32, 6)))
        packed[j] = b.or_(packed[j], b.shl(b.lshr(lmj[j], _c(I32, 4)), _c(I32, 6)))
    for i, v in enumerate(packed):
        _store(b, b.trunc(v, I8), dst, 4 + i)
    dh = b.fptrunc(b.fdiv(ms, _c(F32, 63.0)), u.F16)
    mh = b.fptrunc(b.fdiv(mm, _c(F32, 63.0)), u.F16)
    _store(b, dh, dst, 0)
    _store(b, mh, dst, 2)
    df, mf = b.fpext(dh, F32), b.fpext(mh, F32)
    Ls = []
    for j in range(8):
        xv = _loadf(b, x, 32 * j, 32)
        old = b.zext(_load(b, Lbuf, 32 * j, _vt(I8, 32)), _vt(I32, 32))
        dj = b.fmul(df, _float(b, lsj[j]))
        dm = b.fmul(mf, _float(b, lmj[j]))
        new = _clamp(b, _nearest(b, b.fdiv(b.fadd(xv, _sp(b, dm, 32)), _sp(b, dj, 32))), 0, nmax)
        Ls.append(b.select(b.fcmp_ordered("==", dj, _c(F32, 0.0)), old, new))
    t = _vt(I32, 32)
    if five:
        qh = _c(t, 0)
        for c in range(4):
            lo, hi = Ls[2 * c], Ls[2 * c + 1]
            blo = b.icmp_signed(">", lo, _c(t, 15))
            bhi = b.icmp_signed(">", hi, _c(t, 15))
            qh = b.or_(qh, b.select(blo, _c(t, 1 << (2 * c)), _c(t, 0)))
            qh = b.or_(qh, b.select(bhi, _c(t, 2 << (2 * c)), _c(t, 0)))
            lo, hi = b.and_(lo, _c(t, 15)), b.and_(hi, _c(t, 15))
            _store(b, b.trunc(b.or_(lo, b.shl(hi, _c(t, 4))), _vt(I8, 32)), dst, 48 + 32 * c)
        _store(b, b.trunc(qh, _vt(I8, 32)), dst, 16)
    else:
        for c in range(4):
            q = b.or_(Ls[2 * c], b.shl(Ls[2 * c + 1], _c(t, 4)))
            _store(b, b.trunc(q, _vt(I8, 32)), dst, 16 + 32 * c)


def _qx(b, x, nmax):
    """ggml's make_qx_quants with rmse_type 1 and no importance weights: (scale, L) with
    L = level + nmax as i32 lanes (all 0 for an all-zero group)."""
    n = x.type.count
    vi = _vt(I32, n)
    ax = _fabs(b, x)
    amax = _vmax(b, ax)
    hit = b.bitcast(b.fcmp_ordered("==", ax, _sp(b, amax, n)), ir.IntType(n))
    idx = u.intrinsic(b, "llvm.cttz", ir.IntType(n), [hit, ir.Constant(u.I1, 0)])
    mx = b.extract_element(x, idx)  # the first lane of largest magnitude, as ggml's strict '>' scan
    zero = b.fcmp_ordered("<", amax, _c(F32, GROUP_MAX_EPS))
    w = b.fmul(x, x)
    wx = b.fmul(w, x)

    def attempt(iscale):
        lv = _clamp(b, _nearest(b, b.fmul(_sp(b, iscale, n), x)), -nmax, nmax - 1)
        lf = _float(b, lv)
        return lv, _osum(b, b.fmul(wx, lf)), _osum(b, b.fmul(b.fmul(w, lf), lf))

    lv, sumlx, suml2 = attempt(b.fdiv(_c(F32, float(-nmax)), mx))
    s0 = b.select(b.fcmp_unordered("une", suml2, _c(F32, 0.0)), b.fdiv(sumlx, suml2), _c(F32, 0.0))
    Ls = _slot(b, vi, lv)
    scale = _slot(b, F32, s0)
    best = _slot(b, F32, b.fmul(s0, sumlx))
    with u.Loop(b, u.i64(0), u.i64(18), 1, "is") as k:
        is_ = b.select(b.icmp_signed("<", k, u.i64(9)), b.sub(k, u.i64(9)), b.sub(k, u.i64(8)))
        num = b.fadd(_c(F32, float(nmax)), b.fmul(_c(F32, 0.1), b.sitofp(is_, F32)))
        lv, sumlx, suml2 = attempt(b.fdiv(b.fneg(num), mx))
        take = b.and_(b.fcmp_ordered(">", suml2, _c(F32, 0.0)),
                      b.fcmp_ordered(">", b.fmul(sumlx, sumlx), b.fmul(b.load(best), suml2)))
        s = b.fdiv(sumlx, suml2)
        _select_slot(b, take, Ls, lv)
        _select_slot(b, take, scale, s)
        _select_slot(b, take, best, b.fmul(s, sumlx))
    L = b.select(zero, _c(vi, 0), b.add(b.load(Ls), _c(vi, nmax)))
    return b.select(zero, _c(F32, 0.0), b.load(scale)), L


def _enc_q6_k(b, x, dst):
    """quantize_row_q6_K_ref for one block."""
    Lbuf, scales = _array(b, I8, 256), _array(b, F32, 16)
    max_scale, max_abs = _slot(b, F32, _c(F32, 0.0)), _slot(b, F32, _c(F32, 0.0))
    with u.Loop(b, u.i64(0), u.i64(16), 1, "sub") as ib:
        xv = b.load(b.gep(x, [b.mul(ib, u.i64(16))], source_etype=F32), typ=_vt(F32, 16))
        xv.align = 4
        sc, L = _qx(b, xv, 32)
        L8 = b.trunc(L, _vt(I8, 16))
        b.store(L8, _at(b, Lbuf, b.mul(ib, u.i64(16)), I8, L8.type)).align = 1
        b.store(sc, _at(b, scales, ib, F32, F32))
        a = _fabs(b, sc)
        bigger = b.fcmp_ordered(">", a, b.load(max_abs))
        _select_slot(b, bigger, max_abs, a)
        _select_slot(b, bigger, max_scale, sc)
    with b.if_else(b.fcmp_ordered("<", b.load(max_abs), _c(F32, GROUP_MAX_EPS))) as (zero, rest):
        with zero:
            for off in range(0, 208, 16):
                _store(b, _c(_vt(I8, 16), 0), dst, off)
            _store(b, _c(ir.IntType(16), 0), dst, 208)
        with rest:
            _q6_rest(b, x, dst, Lbuf, scales, b.load(max_scale))


def _q6_rest(b, x, dst, Lbuf, scales, max_scale):
    iscale = b.fdiv(_c(F32, -128.0), max_scale)
    dh = b.fptrunc(b.fdiv(_c(F32, 1.0), iscale), u.F16)
    _store(b, dh, dst, 208)
    v = b.load(_at(b, scales, 0, F32, _vt(F32, 16)), typ=_vt(F32, 16))
    v.align = 4
    q = _nearest(b, b.fmul(_sp(b, iscale, 16), v))
    q = b.select(b.icmp_signed("<", q, _c(q.type, 127)), q, _c(q.type, 127))
    q8 = b.trunc(q, _vt(I8, 16))
    _store(b, q8, dst, 192)
    df = b.fpext(dh, F32)
    Ls = []
    for j in range(16):
        dj = b.fmul(df, b.sitofp(b.extract_element(q8, u.i64(j)), F32))
        xv = _loadf(b, x, 16 * j, 16)
        old = b.zext(_load(b, Lbuf, 16 * j, _vt(I8, 16)), _vt(I32, 16))
        new = b.add(_clamp(b, _nearest(b, b.fdiv(xv, _sp(b, dj, 16))), -32, 31), _c(old.type, 32))
        Ls.append(b.select(b.fcmp_ordered("==", dj, _c(F32, 0.0)), old, new))
    t = _vt(I32, 32)

    def group(k):  # L[k*32 : k*32+32] as one 32-lane vector
        return b.shuffle_vector(Ls[2 * k], Ls[2 * k + 1], _cv(I32, list(range(32))))

    for h in range(2):
        A, B, C, D = (group(4 * h + k) for k in range(4))
        m15 = _c(t, 15)
        ql0 = b.or_(b.and_(A, m15), b.shl(b.and_(C, m15), _c(t, 4)))
        ql1 = b.or_(b.and_(B, m15), b.shl(b.and_(D, m15), _c(t, 4)))
        qh = b.lshr(A, _c(t, 4))
        for k, V in ((1, B), (2, C), (3, D)):
            qh = b.or_(qh, b.shl(b.lshr(V, _c(t, 4)), _c(t, 2 * k)))
        _store(b, b.trunc(ql0, _vt(I8, 32)), dst, 64 * h)
        _store(b, b.trunc(ql1, _vt(I8, 32)), dst, 64 * h + 32)
        _store(b, b.trunc(qh, _vt(I8, 32)), dst, 128 + 32 * h)


_ENCODERS = {
    "q8_0": _enc_q8_0, "tq2_0": _enc_tq2_0, "q6_k": _enc_q6_k,
    "q4_k": lambda b, x, d: _enc_q45_k(b, x, d, False),
    "q5_k": lambda b, x, d: _enc_q45_k(b, x, d, True),
}
