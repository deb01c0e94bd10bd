"""RoPE (SPEC §3.11): the f32 table against a numpy transcription, the rotation against float32
and float64 numpy transcriptions and a torch rotate_half / interleaved reference (values and
gradients), partial spans, negative positions, finite differences, bad input and bitwise thread
invariance.

The Tensor method is called through the mixin (`RopeMethods.rope(x, ...)`) so the test runs
before the mixin is wired into Tensor's bases."""
import math

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise, ulp_diff
from fucina.ag.rope import (RopeMethods, RopeTable, RopeTheta, prepare_rope_table,
                            prepare_rope_table_range)
from fucina.errors import ContextMismatch, InvalidShape, ShapeMismatch, TagError

RNG = np.random.default_rng(5)
MODES = ("half", "interleaved", "interleaved_tail")
POS = [-3, 0, 2, 7, -100]
f32 = np.float32


def rand(shape, s=1.0):
    return (RNG.standard_normal(shape) * s).astype(np.float32)


def rope(x, *a):
    return RopeMethods.rope(x, *a)


def np_table(positions, D, base, inverse=False, ff=None):
    """SPEC §3.11 table, step by step in float32 (powf correctly rounded via float64); the
    float64 sin/cos of the float32 angle, for an ulp comparison."""
    pairs = D // 2
    e = np.array([f32(2 * i) / f32(D) for i in range(pairs)], np.float32)
    pw = np.array([f32(float(f32(base)) ** float(ei)) for ei in e], np.float32)
    th = np.array(positions, np.int32).astype(np.float32)[:, None] / pw[None, :]
    if ff is not None:
        th = th / np.asarray(ff, np.float32)[None, :]
    th64 = th.astype(np.float64)
    return np.cos(th64), (-1 if inverse else 1) * np.sin(th64)


def pair_index(mode, F, D):
    pairs = D // 2
    i = np.arange(pairs)
    if mode == "half":
        return i, i + pairs
    start = F - D if mode == "interleaved_tail" else 0
    return start + 2 * i, start + 2 * i + 1


def np_rope(a, cos, sin, mode, dtype):
    """a [P, ..., F] with the position axis first; cos/sin [P, pairs] -> SPEC rotation in dtype."""
    a = a.astype(dtype)
    cos, sin = cos.astype(dtype), sin.astype(dtype)
    F, D = a.shape[-1], 2 * cos.shape[1]
    ia, ib = pair_index(mode, F, D)
    shp = (cos.shape[0],) + (1,) * (a.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shp), sin.reshape(shp)
    x1, x2 = a[..., ia], a[..., ib]
    out = a.copy()
    out[..., ia] = x1 * c - x2 * s
    out[..., ib] = x1 * s + x2 * c
    return out


def torch_rope(t, positions, D, base, mode):
    """Standard formulations: HF Llama rotate_half for half, even/odd pairs for interleaved.
    t [P, H, F] (torch); angles from float64 inv_freq, cast to f32."""
    pos = torch.tensor(positions, dtype=torch.float64)
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos[:, None] * inv[None, :]
    F = t.shape[-1]
    if mode == "half":
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]
        rot, rest = t[..., :D], t[..., D:]
        x1, x2 = rot[..., :D // 2], rot[..., D // 2:]
        rotate_half = torch.cat([-x2, x1], -1)
        return torch.cat([rot * cos + rotate_half * sin, rest], -1)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    lead, rot = (t[..., :F - D], t[..., F - D:]) if mode == "interleaved_tail" else (t[..., :0], t[..., :D])
    tail = t[..., D:] if mode == "interleaved" else t[..., :0]
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
    return torch.cat([lead, y, tail], -1)


# ---------------------------------------------------------------------------------------------
# acceptance and the table

def test_acceptance(ctx):
    x = ctx.tensor(np.array([[1, 0], [1, 0]], np.float32), ("seq", "d"))
    for src in (prepare_rope_table(ctx, [0, 1], 2, 10000.0), RopeTheta([0, 1], 10000.0)):
        y = rope(x, "seq", "d", src, "half").numpy()
        assert y[0].tolist() == [1.0, 0.0]
        np.testing.assert_allclose(y[1], [math.cos(1), math.sin(1)], rtol=1e-6)
        assert y.dtype == np.float32


@pytest.mark.parametrize("D,base,inverse,ff", [
    (2, 10000.0, False, None), (64, 10000.0, False, None), (128, 500000.0, True, None),
    (10, 10000.0, False, [1.0, 2.0, 4.0, 8.0, 0.5])])
def test_table_against_numpy(ctx, D, base, inverse, ff):
    positions = [-4096, -100, -3, 0, 1, 2, 7, 255, 4095, 100000]
    t = prepare_rope_table(ctx, positions, D, base, inverse=inverse, freq_factors=ff)
    assert isinstance(t, RopeTable) and t.pairs == D // 2
    cos, sin = t.cos(), t.sin()
    assert cos.shape == (len(positions), D // 2) and cos.dtype == np.float32
    wc, ws = np_table(positions, D, base, inverse, ff)
    # libm-style transcendental: <= 2 ulp (absolute 2^-24 floor near zero crossings)
    for got, want in ((cos, wc), (sin, ws)):
        bad = (ulp_diff(got, want) > 2) & (np.abs(got - want) > 2 ** -24)
        assert not bad.any(), (got[bad][:4], want[bad][:4])
    assert (cos[positions.index(0)] == 1).all() and (sin[positions.index(0)] == 0).all()


def test_range_form_bitwise_and_inverse_sign(ctx):
    class AR:  # the AxisRange fields the range form reads
        origin, len = -5, 12

    a = prepare_rope_table(ctx, list(range(-5, 7)), 16, 10000.0)
    b = prepare_rope_table_range(ctx, AR(), 16, 10000.0)
    assert_bitwise(a.cos(), b.cos())
    assert_bitwise(a.sin(), b.sin())
    inv = prepare_rope_table(ctx, list(range(-5, 7)), 16, 10000.0, inverse=True)
    assert_bitwise(inv.cos(), a.cos())
    assert_bitwise(inv.sin(), -a.sin())


# ---------------------------------------------------------------------------------------------
# the rotation

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("F,D", [(12, 12), (12, 8), (12, 2), (64, 64), (100, 80), (75, 34)])
def test_values_and_grads(ctx, mode, F, D):
    """Full span, partial span, one pair; then spans of whole vectors plus a tail, with odd
    numbers of pass-through features around them (the kernel goes W lanes at a time)."""
    P, H = len(POS), 3
    a = rand((P, H, F), 2.0)
    t = prepare_rope_table(ctx, POS, D, 10000.0)
    x = ctx.variable(a, ("seq", "head", "d"))
    y = rope(x, "seq", "d", t, mode)
    assert y.tags == ("seq", "head", "d") and y.shape == (P, H, F)
    # float32 transcription with the table's own cos/sin: bitwise
    assert_bitwise(y.numpy(), np_rope(a, t.cos(), t.sin(), mode, np.float32))
    # float64 transcription of the SPEC formula (f64 angles)
    c64, s64 = np_table(POS, D, 10000.0)
    np.testing.assert_allclose(y.numpy(), np_rope(a.astype(np.float64), c64, s64, mode, np.float64),
                               rtol=1e-5, atol=1e-5)
    # pass-through features are copied exactly
    ia, ib = pair_index(mode, F, D)
    rest = np.setdiff1d(np.arange(F), np.concatenate([ia, ib]))
    assert_bitwise(y.numpy()[..., rest], a[..., rest])
    # torch: values and the gradient of sum(y * w)
    w = rand((P, H, F))
    tx = torch.tensor(a, requires_grad=True)
    ty = torch_rope(tx, POS, D, 10000.0, mode)
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=2e-5)
    (y * ctx.tensor(w, y.tags)).sum_all().backward()
    (ty * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-5, atol=2e-5)
    # backward = the inverse rotation of g: bitwise the forward with an inverse table
    inv = prepare_rope_table(ctx, POS, D, 10000.0, inverse=True)
    g = rope(ctx.tensor(w, y.tags), "seq", "d", inv, mode).numpy()
    assert_bitwise(x.grad().numpy(), g)
    assert_bitwise(g, np_rope(w, t.cos(), -t.sin(), mode, np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_other_layout_and_rope_theta(ctx, mode):
    """Position and feature axes anywhere (the permute path); RopeTheta = a full-span table."""
    P, H, F = len(POS), 2, 10
    a = rand((H, F, P))  # tags (head, d, seq)
    tags = ("head", "d", "seq")
    x = ctx.tensor(a, tags)
    y = rope(x, "seq", "d", RopeTheta(POS, 10000.0), mode)
    assert y.tags == tags
    t = prepare_rope_table(ctx, POS, F, 10000.0)
    ref = np_rope(np.transpose(a, (2, 0, 1)), t.cos(), t.sin(), mode, np.float32)
    assert_bitwise(y.numpy(), np.transpose(ref, (1, 2, 0)))
    assert_bitwise(y.numpy(), rope(x, "seq", "d", t, mode).numpy())


@pytest.mark.parametrize("mode", MODES)
def test_inverse_table_undoes_and_negative_positions_reroute(ctx, mode):
    """Re-roping: rotating by +p then by -p (a negative position) returns the input."""
    P, F = 6, 16
    pos = [0, 3, 9, 17, 40, 99]
    a = rand((P, F))
    x = ctx.tensor(a, ("seq", "d"))
    fwd = rope(x, "seq", "d", prepare_rope_table(ctx, pos, F, 10000.0), mode)
    back = rope(fwd, "seq", "d", prepare_rope_table(ctx, [-p for p in pos], F, 10000.0), mode)
    np.testing.assert_allclose(back.numpy(), a, atol=1e-5)
    # shifting by +2 then -2 from offset positions: same as no shift
    s1 = rope(x, "seq", "d", prepare_rope_table(ctx, [2] * P, F, 10000.0), mode)
    s2 = rope(s1, "seq", "d", prepare_rope_table(ctx, [-2] * P, F, 10000.0), mode)
    np.testing.assert_allclose(s2.numpy(), a, atol=1e-6)


def test_gradcheck(ctx1):
    a = rand((4, 2, 10))
    for mode in MODES:
        for src in (prepare_rope_table(ctx1, [-2, 0, 1, 5], 6, 100.0), RopeTheta([-2, 0, 1, 5], 100.0)):
            x = ctx1.variable(a, ("s", "h", "d"))
            wy = ctx1.tensor(rand(a.shape), ("s", "h", "d"))
            res = fu.gradcheck(lambda v, src=src, mode=mode: (rope(v, "s", "d", src, mode) * wy).sum_all(), [x])
            assert res.checked == a.size


def test_no_grad_constant(ctx):
    x = ctx.tensor(rand((3, 4)), ("s", "d"))
    y = rope(x, "s", "d", RopeTheta([0, 1, 2], 10000.0), "half")
    assert not y.requires_grad


# ---------------------------------------------------------------------------------------------
# bad input

def test_bad_input(ctx):
    x = ctx.tensor(rand((3, 6)), ("s", "d"))
    t = prepare_rope_table(ctx, [0, 1, 2], 4, 10000.0)
    with pytest.raises(InvalidShape):
        prepare_rope_table(ctx, [0, 1, 2], 5, 10000.0)            # odd rotary dim
    with pytest.raises(InvalidShape):
        prepare_rope_table(ctx, [0, 1, 2], 0, 10000.0)
    with pytest.raises(InvalidShape):
        rope(ctx.tensor(rand((3, 5)), ("s", "d")), "s", "d", RopeTheta([0, 1, 2], 1e4), "half")
    with pytest.raises(ShapeMismatch):
        rope(x, "s", "d", prepare_rope_table(ctx, [0, 1], 4, 10000.0), "half")   # wrong length
    with pytest.raises(ShapeMismatch):
        rope(x, "s", "d", RopeTheta([0, 1, 2, 3], 1e4), "half")
    with pytest.raises(ShapeMismatch):
        rope(x, "s", "d", prepare_rope_table(ctx, [0, 1, 2], 8, 10000.0), "half")  # span > dim
    with pytest.raises(ShapeMismatch):
        prepare_rope_table(ctx, [0, 1, 2], 4, 10000.0, freq_factors=[1.0])
    with pytest.raises(ValueError):
        rope(x, "s", "d", t, "neox")                                 # unknown mode
    with pytest.raises(TagError):
        rope(x, "s", "q", t, "half")
    with pytest.raises(TagError):
        rope(x, "d", "d", t, "half")
    with pytest.raises(TypeError):
        rope(x, "s", "d", [0, 1, 2], "half")
    with pytest.raises(TypeError):
        prepare_rope_table(ctx, [0, 1.5, 2], 4, 10000.0)
    with pytest.raises(InvalidShape):
        prepare_rope_table(ctx, [0, 1 << 31], 4, 10000.0)
    with pytest.raises(InvalidShape):
        prepare_rope_table(ctx, [], 4, 10000.0)
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(ContextMismatch):
            rope(x, "s", "d", prepare_rope_table(other, [0, 1, 2], 4, 10000.0), "half")
    finally:
        other.close()


# ---------------------------------------------------------------------------------------------
# determinism

@pytest.mark.parametrize("mode", MODES)
def test_thread_invariance(ctx1, ctx2, mode):
    P, H, F, D = 64, 8, 128, 96
    pos = list(range(-20, P - 20))
    a = rand((P, H, F))
    w = rand((P, H, F))
    out = []
    for c in (ctx1, ctx2):
        t = prepare_rope_table(c, pos, D, 10000.0)
        x = c.variable(a, ("s", "h", "d"))
        y = rope(x, "s", "d", t, mode)
        (y * c.tensor(w, y.tags)).sum_all().backward()
        out.append((t.cos(), t.sin(), y.numpy(), x.grad().numpy()))
    for u, v in zip(*out):
        assert_bitwise(u, v)


def test_dtype_and_scope(ctx):
    from fucina.errors import DTypeError
    a = rand((3, 4))
    with pytest.raises(DTypeError):
        rope(ctx.tensor(a, ("s", "d"), "f16"), "s", "d", RopeTheta([0, 1, 2], 1e4), "half")
    t = prepare_rope_table(ctx, [0, 1, 2], 4, 10000.0)
    want = rope(ctx.tensor(a, ("s", "d")), "s", "d", t, "interleaved").numpy()
    with ctx.exec_scope():
        x = ctx.variable(a, ("s", "d"))
        y = rope(x, "s", "d", t, "interleaved")
        assert y.scope_owned
        assert_bitwise(y.numpy(), want)
        y.sum_all().backward()
        assert_bitwise(x.grad().numpy(), np_rope(np.ones_like(a), t.cos(), -t.sin(), "interleaved", np.float32))


def test_inv_freqs_f64_table(ctx):
    """Angles and sin/cos in f64, each rounded once to f32; the plain schedule agrees with the
    f32 construction to f32 rounding; a YaRN blend keeps the fast pairs and divides the slow."""
    D, base = 16, 10000.0
    plain = fu.yarn_blend_inv_freqs_f64(D, base, 1.0, 0)
    np.testing.assert_allclose(plain, base ** -(np.arange(0, D, 2) / D), rtol=1e-15)
    t = ctx.prepare_rope_table_inv_freqs_f64(-3, 7, plain, inverse=True)
    assert t.positions == tuple(range(-3, 4)) and t.feature_dim == D
    ang = np.arange(-3, 4, dtype=np.float64)[:, None] * np.asarray(plain)[None, :]
    assert_bitwise(t.cos(), np.cos(ang).astype(np.float32))
    assert_bitwise(t.sin(), (-np.sin(ang)).astype(np.float32))
    f32 = ctx.prepare_rope_table(list(range(-3, 4)), D, base, inverse=True)
    np.testing.assert_allclose(t.cos(), f32.cos(), atol=2e-6)
    y = rope(ctx.tensor(np.ones((7, D), np.float32), ("seq", "d")), "seq", "d", t, "half")
    np.testing.assert_allclose(y.numpy(), np_rope(np.ones((7, D)), t.cos(), t.sin(), "half", np.float32), atol=1e-6)
    blend = np.asarray(fu.yarn_blend_inv_freqs_f64(64, base, 4.0, 4096))
    ref = base ** -(np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(blend[:2], ref[:2], rtol=1e-15)       # fast pairs: original
    np.testing.assert_allclose(blend[-2:], ref[-2:] / 4.0, rtol=1e-15)  # slow pairs: / factor
    ratio = blend / ref
    assert np.all(ratio <= 1 + 1e-12) and np.all(ratio >= 0.25 - 1e-12) and np.all(np.diff(ratio) <= 1e-12)
    with pytest.raises(fu.InvalidShape):
        ctx.prepare_rope_table_inv_freqs_f64(0, 0, plain)
    with pytest.raises(fu.InvalidShape):
        fu.yarn_blend_inv_freqs_f64(15, base, 2.0, 100)
