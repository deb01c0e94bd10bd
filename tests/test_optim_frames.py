"""Optimizer state frames (SPEC T-17): exact bytes of SGD / Adam / AdamW frames in v3, v4 and v5
and of the FZO3 OptimizerSet container (built here by hand with struct), every validation error,
transactional loads (truncated or mismatched streams change nothing), and bit-exact resume for
every optimizer × state dtype × param dtype and for a set."""
import io
import struct

import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise, feed_grad as feed
from conftest import load_state_bytes as load, state_bytes as save
from fucina.exec.dtypes import f32_to_bf16_bits
from test_optim_update import narrow, ref_adam, ref_sgd

F = np.float32


def fbits(x) -> int:
    return int(np.array([x], F).view(np.uint32)[0])


def name(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def dims(r, c) -> bytes:
    return struct.pack("<QQ", r, c)


def u64(v) -> bytes:
    return struct.pack("<Q", v)


def state_bytes(a, dtype="f32") -> bytes:
    a = np.ascontiguousarray(a, F).reshape(-1)
    return (f32_to_bf16_bits(a) if dtype == "bf16" else a).tobytes()


def buf(a, dtype, version) -> bytes:
    """A state-buffer record: v3 raw f32; v4/v5 u8 tag + raw storage."""
    tag = b"" if version == 3 else bytes((0 if dtype == "f32" else 1,))
    return tag + state_bytes(a, dtype)


G1 = np.array([[0.5, -1.25, 2.0], [0.125, 3.0, -0.75]], F)
G2 = np.array([1.5, -0.5, 0.25, 4.0, -2.0], F)
P1 = np.array([[1.0, 2.0, -3.0], [0.5, -0.25, 4.0]], F)
P2 = np.array([0.1, 0.2, 0.3, 0.4, 0.5], F)


def two_params(ctx, dtype="f32", names=(None, None)):
    w = ctx.variable(P1, ("r", "c"), dtype=dtype)
    b = ctx.variable(P2, ("k",))
    return w, b


# ---------------------------------------------------------------------------------------------
# exact bytes

@pytest.mark.parametrize("state", ["f32", "bf16"])
def test_sgd_frame_bytes(ctx, state):
    w, b = two_params(ctx)
    hp = dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.0, nesterov=False)
    opt = fu.optim.SGD(**hp, state_dtype=state)
    opt.add_param(w)
    opt.add_param_named(b, "bias")
    feed(ctx, w, G1)
    opt.step()  # only w has a gradient: b's step stays 0, its buffer zeros
    version = 3 if state == "f32" else 4
    m1 = ref_sgd(P1, [G1], hp, state)[0][1]
    want = (b"FZS3" if version == 3 else b"FZS4") + struct.pack("<IIB", fbits(0.9), fbits(0.25), 0) \
        + struct.pack("<I", 2) \
        + name("param0") + dims(2, 3) + u64(1) + buf(m1, state, version) \
        + name("bias") + dims(5, 1) + u64(0) + buf(np.zeros(5), state, version)
    assert save(opt) == want


def test_sgd_without_momentum_is_v3_with_empty_buffers(ctx):
    w, b = two_params(ctx)
    opt = fu.optim.SGD(lr=0.1, state_dtype="bf16")  # momentum 0: no buffer, frame stays v3
    opt.add_param(w)
    feed(ctx, w, G1)
    opt.step()
    want = b"FZS3" + struct.pack("<IIB", 0, 0, 0) + struct.pack("<I", 1) + name("param0") \
        + dims(2, 3) + u64(1)
    assert save(opt) == want


def test_sgd_v5_with_master(ctx):
    w = ctx.variable(P1, ("r", "c"), dtype="bf16")
    b = ctx.variable(P2, ("k",))
    opt = fu.optim.SGD(lr=0.1, nesterov=True, momentum=0.5)
    opt.add_param(w, name="w")
    opt.add_param(b)
    feed(ctx, w, G1)
    feed(ctx, b, G2)
    opt.step()
    hp = dict(lr=0.1, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=True)
    (mw, bw), = ref_sgd(narrow(P1, "bf16"), [G1], hp)
    (mb, bb), = ref_sgd(P2, [G2], hp)
    want = b"FZS5" + struct.pack("<IIB", fbits(0.5), 0, 1) + struct.pack("<I", 2) \
        + name("w") + dims(2, 3) + u64(1) + buf(bw, "f32", 5) + b"\x01" + state_bytes(mw) \
        + name("param1") + dims(5, 1) + u64(1) + buf(bb, "f32", 5) + b"\x00"
    assert save(opt) == want


@pytest.mark.parametrize("kind,magics", [("Adam", (b"FZAD", b"FZD4", b"FZD5")),
                                         ("AdamW", (b"FZA3", b"FZA4", b"FZA5"))])
@pytest.mark.parametrize("m_dtype,v_dtype,pdtype,version", [
    ("f32", "f32", "f32", 3), ("bf16", "f32", "f32", 4), ("f32", "bf16", "f32", 4),
    ("bf16", "bf16", "f16", 5), ("f32", "f32", "bf16", 5)])
def test_adam_frame_bytes(ctx, kind, magics, m_dtype, v_dtype, pdtype, version):
    w = ctx.variable(P1, ("r", "c"), dtype=pdtype)
    opt = getattr(fu.optim, kind)(lr=0.01, weight_decay=0.1, state_dtype=m_dtype,
                                  second_moment_dtype=v_dtype)
    opt.add_param(w)
    for _ in range(2):
        feed(ctx, w, G1)
        opt.step()
    hp = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    master, m, v = ref_adam(narrow(P1, pdtype), [G1, G1], hp, kind == "AdamW", m_dtype, v_dtype)[-1]
    want = magics[version - 3] + struct.pack("<I", 1) + name("param0") + dims(2, 3) + u64(2) \
        + buf(m, m_dtype, version) + buf(v, v_dtype, version)
    if version == 5:
        want += b"\x01" + state_bytes(master)
    assert save(opt) == want


def test_set_container_bytes(ctx):
    w, b = two_params(ctx)
    a, s = fu.optim.AdamW(), fu.optim.SGD(momentum=0.9)
    a.add_param(w)
    s.add_param(b)
    group = fu.optim.OptimizerSet([a, s])
    assert save(group) == b"FZO3" + struct.pack("<I", 2) + save(a) + save(s)
    assert save(fu.optim.OptimizerSet()) == b"FZO3" + struct.pack("<I", 0)


# ---------------------------------------------------------------------------------------------
# validation on load

def _trained(ctx, kind="SGD", dtype="f32", **hp):
    w, b = two_params(ctx, dtype)
    opt = getattr(fu.optim, kind)(**hp)
    opt.add_param(w)
    opt.add_param(b, name="bias")
    feed(ctx, w, G1)
    feed(ctx, b, G2)
    opt.step()
    return opt, w, b


def _fresh(ctx, kind="SGD", dtype="f32", names=(None, "bias"), **hp):
    w, b = two_params(ctx, dtype)
    opt = getattr(fu.optim, kind)(**hp)
    opt.add_param(w, name=names[0])
    opt.add_param(b, name=names[1])
    return opt, w, b


def _snapshot(opt, *params):
    return [{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in opt.state_of(p).items()}
            for p in params] + [p._raw.storage_view().copy() for p in params]


def _assert_same(before, after):
    assert len(before) == len(after)
    for x, y in zip(before, after):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                if isinstance(x[k], np.ndarray):
                    assert_bitwise(x[k], y[k])
                else:
                    assert x[k] == y[k]
        else:
            assert_bitwise(x, y)


def _rejects(ctx, opt, params, data, err, match=None):
    before = _snapshot(opt, *params)
    with pytest.raises(err, match=match):
        load(opt, data)
    _assert_same(before, _snapshot(opt, *params))


def test_magic_mismatch(ctx):
    src, *_ = _trained(ctx, momentum=0.9)
    data = save(src)
    opt, w, b = _fresh(ctx, "Adam")
    _rejects(ctx, opt, (w, b), data, fu.optim.CheckpointMagicMismatch, "FZAD / FZD4 / FZD5")
    opt2, w2, b2 = _fresh(ctx, momentum=0.9)
    _rejects(ctx, opt2, (w2, b2), b"XXXX" + data[4:], fu.optim.CheckpointMagicMismatch)


@pytest.mark.parametrize("change", [dict(momentum=0.8), dict(dampening=0.1),
                                    dict(nesterov=True, dampening=0.0)])
def test_structural_config_mismatch(ctx, change):
    src, *_ = _trained(ctx, momentum=0.9, dampening=0.0)
    opt, w, b = _fresh(ctx, **(dict(momentum=0.9, dampening=0.0) | change))
    _rejects(ctx, opt, (w, b), save(src), fu.optim.CheckpointConfigMismatch)


def test_lr_and_decay_are_not_validated(ctx):
    src, *_ = _trained(ctx, momentum=0.9, lr=0.1, weight_decay=0.1)
    opt, w, b = _fresh(ctx, momentum=0.9, lr=0.5)
    load(opt, save(src))
    assert opt.state_of(w)["step"] == 1 and opt.config.lr == 0.5


def test_dims_mismatch(ctx):
    src, *_ = _trained(ctx, "Adam")
    w = ctx.variable(np.zeros((3, 2), F), ("r", "c"))  # same numel, other dims
    b = ctx.variable(P2, ("k",))
    opt = fu.optim.Adam()
    opt.add_param(w)
    opt.add_param(b, name="bias")
    _rejects(ctx, opt, (w, b), save(src), fu.optim.CheckpointShapeMismatch, r"expected dims \[3, 2\]")


def test_state_dtype_mismatch_both_ways(ctx):
    src, *_ = _trained(ctx, "AdamW")                   # v3: implies f32
    opt, w, b = _fresh(ctx, "AdamW", state_dtype="bf16")
    _rejects(ctx, opt, (w, b), save(src), fu.optim.CheckpointDtypeMismatch, "expected bf16")
    src2, *_ = _trained(ctx, "AdamW", second_moment_dtype="bf16")  # v4 with a bf16 v
    opt2, w2, b2 = _fresh(ctx, "AdamW")
    _rejects(ctx, opt2, (w2, b2), save(src2), fu.optim.CheckpointDtypeMismatch, "expected f32")


def test_unknown_dtype_tag(ctx):
    src, *_ = _trained(ctx, "Adam", state_dtype="bf16")
    data = bytearray(save(src))
    head = 4 + 4 + len(name("param0")) + 16 + 8
    assert data[head] == 1  # m's tag
    data[head] = 7
    opt, w, b = _fresh(ctx, "Adam", state_dtype="bf16")
    _rejects(ctx, opt, (w, b), bytes(data), fu.optim.CheckpointUnsupportedDtype, "got 7")


def test_master_for_an_f32_slot(ctx):
    src, *_ = _trained(ctx, "SGD", dtype="bf16")  # v5: param0 carries a master
    opt, w, b = _fresh(ctx, "SGD")                # but here param0 is f32
    _rejects(ctx, opt, (w, b), save(src), fu.optim.CheckpointDtypeMismatch, "master")


def _sgd_frame(records, count=None):
    """A v3 SGD frame (momentum 0) from (name bytes record, rows, cols, step) tuples."""
    out = b"FZS3" + struct.pack("<IIB", 0, 0, 0) + struct.pack("<I", len(records) if count is None else count)
    for rec, r, c, step in records:
        out += rec + dims(r, c) + u64(step)
    return out


def test_name_errors(ctx):
    opt, w, b = _fresh(ctx)
    ok = [(name("param0"), 2, 3, 4), (name("bias"), 5, 1, 5)]
    load(opt, _sgd_frame(ok[::-1]))  # records in any order
    assert opt.state_of(w)["step"] == 4 and opt.state_of(b)["step"] == 5
    _rejects(ctx, opt, (w, b), _sgd_frame([(struct.pack("<H", 0), 2, 3, 1)] + ok),
             fu.optim.CheckpointInvalidName, "length 0")
    _rejects(ctx, opt, (w, b), _sgd_frame(ok + [ok[0]]), fu.optim.CheckpointDuplicateName, "twice")
    _rejects(ctx, opt, (w, b), _sgd_frame([(name("param1"), 5, 1, 1)] + ok),
             fu.optim.CheckpointUnknownName, "'param1'")
    _rejects(ctx, opt, (w, b), _sgd_frame(ok[:1]), fu.optim.CheckpointMissingEntry, "'bias'")


def test_named_params_reregister_in_any_order(ctx):
    src, w0, b0 = _trained(ctx, "AdamW")
    w, b = two_params(ctx)
    opt = fu.optim.AdamW()
    opt.add_param(b, name="bias")  # named slots match by name in any order, but an unnamed
    opt.add_param(w)               # param keeps its index: here w became "param1"
    with pytest.raises(fu.optim.CheckpointUnknownName, match="'param0'"):
        load(opt, save(src))
    opt2 = fu.optim.AdamW()
    opt2.add_param(b, name="bias")
    opt2.add_param(w, name="param0")  # an explicit name equal to the record's auto-name
    load(opt2, save(src))
    assert_bitwise(opt2.state_of(w)["m"], src.state_of(w0)["m"])


def test_save_validates_names_before_writing(ctx):
    for bad in ["", "a\0b", "x" * 65536, "\ud800"]:
        w = ctx.variable(P2, ("k",))
        opt = fu.optim.SGD()
        opt.add_param(w, name=bad)
        f = io.BytesIO()
        with pytest.raises(fu.optim.CheckpointInvalidName):
            opt.save_state(f)
        assert f.getvalue() == b""
    w, b = two_params(ctx)
    opt = fu.optim.SGD()
    opt.add_param(w)            # auto-named "param0"
    opt.add_param(b, "param0")  # collides with it
    f = io.BytesIO()
    with pytest.raises(fu.optim.CheckpointDuplicateName, match="'param0'"):
        opt.save_state(f)
    assert f.getvalue() == b""
    opt = fu.optim.SGD()
    opt.add_param(w, name="é" * 10)  # UTF-8, 20 bytes
    assert name("é" * 10) in save(opt)


def test_truncated_at_every_byte_changes_nothing(ctx):
    src, sw, sb = _trained(ctx, "AdamW", dtype="bf16", state_dtype="bf16")
    data = save(src)
    opt, w, b = _fresh(ctx, "AdamW", "bf16", state_dtype="bf16")
    feed(ctx, w, G1)
    opt.step()
    opt.step()
    before = _snapshot(opt, w, b)
    for cut in range(len(data)):
        with pytest.raises((fu.InvalidDataLength, fu.optim.CheckpointMagicMismatch)):
            load(opt, data[:cut])
    _assert_same(before, _snapshot(opt, w, b))
    load(opt, data + b"trailing bytes belong to the next frame")
    _assert_same([src.state_of(sw), src.state_of(sb), sw._raw.storage_view()],
                 _snapshot(opt, w, b)[:3])


def test_a_bad_last_record_changes_nothing(ctx):
    src, *_ = _trained(ctx, "SGD", momentum=0.9)
    data = bytearray(save(src))
    opt, w, b = _fresh(ctx, momentum=0.9)
    feed(ctx, w, G1)
    opt.step()
    data[-(5 * 4 + 8 + 16) - 1] ^= 0xFF  # corrupt the last slot's name: unknown name
    _rejects(ctx, opt, (w, b), bytes(data), fu.optim.CheckpointUnknownName)


def test_set_load_errors_and_transaction(ctx):
    w, b = two_params(ctx)
    a, s = fu.optim.AdamW(), fu.optim.SGD(momentum=0.9)
    a.add_param(w)
    s.add_param(b)
    group = fu.optim.OptimizerSet([a, s])
    feed(ctx, w, G1)
    feed(ctx, b, G2)
    group.step()
    data = save(group)
    w2, b2 = two_params(ctx)
    a2, s2 = fu.optim.AdamW(), fu.optim.SGD(momentum=0.9)
    a2.add_param(w2)
    s2.add_param(b2)
    g2 = fu.optim.OptimizerSet([a2, s2])
    with pytest.raises(fu.optim.CheckpointMagicMismatch, match="FZO3"):
        load(g2, b"FZO4" + data[4:])
    with pytest.raises(fu.optim.CheckpointShapeMismatch, match="expected 1 member frames, the file has 2"):
        load(fu.optim.OptimizerSet([a2]), data)
    before = _snapshot(a2, w2) + _snapshot(s2, b2)
    bad = bytearray(data)
    bad[len(data) - (5 * 4 + 8 + 16) - 1] ^= 0xFF  # the second member's slot name (last byte):
    # the first member's frame is valid, but it must not be committed either
    with pytest.raises(fu.optim.CheckpointUnknownName):
        load(g2, bytes(bad))
    for cut in range(0, len(data), 7):
        with pytest.raises((fu.InvalidDataLength, fu.optim.CheckpointMagicMismatch)):
            load(g2, data[:cut])
    _assert_same(before, _snapshot(a2, w2) + _snapshot(s2, b2))
    load(g2, data)
    assert_bitwise(a2.state_of(w2)["m"], a.state_of(w)["m"])
    assert_bitwise(s2.state_of(b2)["momentum_buffer"], s.state_of(b)["momentum_buffer"])


def test_master_commit_paths(ctx):
    """A v5 master is installed and narrowed into the param; without one (an f32-param frame)
    the master is re-widened from the param's current values."""
    src, w0, _ = _trained(ctx, "SGD", dtype="bf16", momentum=0.9)
    opt, w, b = _fresh(ctx, "SGD", "bf16", momentum=0.9)
    load(opt, save(src))
    assert_bitwise(opt.state_of(w)["master"], src.state_of(w0)["master"])
    assert_bitwise(w._raw.storage_view(), w0._raw.storage_view())
    f32src, *_ = _trained(ctx, "SGD", momentum=0.9)  # v3: no masters
    opt3, w3, b3 = _fresh(ctx, "SGD", "bf16", momentum=0.9)
    w3._raw.storage_view()[:] = f32_to_bf16_bits(np.full((2, 3), 7.0, F))  # values loaded late
    load(opt3, save(f32src))
    assert_bitwise(opt3.state_of(w3)["master"], np.full((2, 3), 7.0, F))


# ---------------------------------------------------------------------------------------------
# bit-exact resume

CONFIGS = [("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
           ("Adam", dict(lr=0.01, weight_decay=0.05)),
           ("AdamW", dict(lr=0.01))]


def _train(ctx, opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            feed(ctx, p, g)
        opt.step()


@pytest.mark.parametrize("kind,hp", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("state", ["f32", "bf16"])
@pytest.mark.parametrize("pdtype", ["f32", "f16", "bf16"])
def test_bit_exact_resume(ctx, kind, hp, state, pdtype):
    rng = np.random.default_rng(9)
    shapes = [(4, 9), (5,)]
    init = [rng.standard_normal(s).astype(F) for s in shapes]
    grads = [[rng.standard_normal(s).astype(F) for s in shapes] for _ in range(8)]
    extra = {"state_dtype": state} | ({} if kind == "SGD" else {"second_moment_dtype": state})

    def build(values):
        ps = [ctx.variable(values[0], ("r", "c"), dtype=pdtype), ctx.variable(values[1], ("k",))]
        opt = getattr(fu.optim, kind)(**hp, **extra)
        opt.add_param(ps[0])
        opt.add_param(ps[1], name="b")
        return opt, ps

    ref_opt, ref_ps = build(init)
    _train(ctx, ref_opt, ref_ps, grads)
    first, ps = build(init)
    _train(ctx, first, ps, grads[:3])
    data = save(first)
    assert data[:4] == getattr(fu.optim, kind).MAGICS[0 if pdtype == "f32" and state == "f32"
                                                      else 1 if pdtype == "f32" else 2]
    resumed, ps2 = build([p.numpy() for p in ps])  # params restored separately (as stored)
    load(resumed, data)
    _train(ctx, resumed, ps2, grads[3:])
    for a, b in zip(ref_ps, ps2):
        assert_bitwise(a._raw.storage_view(), b._raw.storage_view())
        _assert_same([ref_opt.state_of(a)], [resumed.state_of(b)])


def test_bit_exact_resume_of_a_set(ctx1, ctx2):
    rng = np.random.default_rng(10)
    init = [rng.standard_normal((6, 6)).astype(F), rng.standard_normal(6).astype(F)]
    grads = [[rng.standard_normal(a.shape).astype(F) for a in init] for _ in range(6)]

    def build(c, values):
        w = c.variable(values[0], ("r", "c"), dtype="bf16")
        b = c.variable(values[1], ("k",))
        decay = fu.optim.AdamW(lr=0.02, state_dtype="bf16")
        plain = fu.optim.SGD(lr=0.1, momentum=0.9)
        decay.add_param(w, name="w")
        plain.add_param(b, name="b")
        return fu.optim.OptimizerSet([decay, plain]), [w, b]

    def run(group, ps, c, gs):
        for step in gs:
            for p, g in zip(ps, step):
                feed(c, p, g)
            group.clip_grad_norm(1.0)
            group.step()
            group.zero_grad()

    ref, ref_ps = build(ctx1, init)
    run(ref, ref_ps, ctx1, grads)
    g1, ps1 = build(ctx1, init)
    run(g1, ps1, ctx1, grads[:2])
    data = save(g1)
    g2, ps2 = build(ctx2, [p.numpy() for p in ps1])  # resumed at another thread count
    load(g2, data)
    run(g2, ps2, ctx2, grads[2:])
    for a, b in zip(ref_ps, ps2):
        assert_bitwise(a._raw.storage_view(), b._raw.storage_view())
    assert save(ref) == save(g2)


# ---- the CRC32 envelope (issue 20 item 2) ----------------------------------------------------

def _ck_trained(ctx, kind="AdamW", seed=0, **options):
    rng = np.random.default_rng(seed)
    w = ctx.variable(rng.standard_normal((3, 5)).astype(F), ("o", "i"))
    b = ctx.variable(rng.standard_normal(5).astype(F), ("i",))
    opt = getattr(fu.optim, kind)(lr=0.01, **options)
    opt.add_param_named(w, "w")
    opt.add_param_named(b, "b")
    for _ in range(2):
        feed(ctx, w, rng.standard_normal((3, 5)))
        feed(ctx, b, rng.standard_normal(5))
        opt.step()
        opt.zero_grad()
    return opt, w, b


def _enveloped(opt) -> bytes:
    f = io.BytesIO()
    opt.save_state(f)
    return f.getvalue()


@pytest.mark.parametrize("kind,options", [("AdamW", {}), ("Adam", {}), ("SGD", {"momentum": 0.9}),
                                          ("Muon", {}), ("Apollo", {"rank": 2})])
def test_envelope_bytes_and_round_trip(ctx, kind, options):
    import zlib
    opt, *_ = _ck_trained(ctx, kind, **options)
    bare, data = save(opt), _enveloped(opt)
    assert data == b"FZC1" + u64(len(bare)) + bare + struct.pack("<I", zlib.crc32(bare))
    fresh, *_ = _ck_trained(ctx, kind, seed=1, **options)
    load(fresh, data)
    assert save(fresh) == bare
    fresh2, *_ = _ck_trained(ctx, kind, seed=2, **options)
    load(fresh2, bare)  # frames from before the envelope still load
    assert save(fresh2) == bare


def test_set_envelope(ctx):
    import zlib
    a, *_ = _ck_trained(ctx, "AdamW")
    s, *_ = _ck_trained(ctx, "SGD", seed=3, momentum=0.5)
    group = fu.optim.OptimizerSet([a, s])
    f = io.BytesIO()
    group.save_state(f)
    bare = io.BytesIO()
    group.save_state(bare, checksum=False)
    bare = bare.getvalue()
    assert f.getvalue() == b"FZC1" + u64(len(bare)) + bare + struct.pack("<I", zlib.crc32(bare))
    a2, *_ = _ck_trained(ctx, "AdamW", seed=4)
    s2, *_ = _ck_trained(ctx, "SGD", seed=5, momentum=0.5)
    g2 = fu.optim.OptimizerSet([a2, s2])
    g2.load_state(io.BytesIO(f.getvalue()))
    assert save(a2) == save(a) and save(s2) == save(s)
    bad = bytearray(f.getvalue())
    bad[-10] ^= 4
    a3, *_ = _ck_trained(ctx, "AdamW", seed=6)
    s3, *_ = _ck_trained(ctx, "SGD", seed=7, momentum=0.5)
    before = (save(a3), save(s3))
    with pytest.raises(fu.ChecksumMismatch, match="OptimizerSet.load_state"):
        fu.optim.OptimizerSet([a3, s3]).load_state(io.BytesIO(bytes(bad)))
    assert (save(a3), save(s3)) == before


def test_every_flipped_byte_is_caught(ctx1):
    """Each single-bit flip anywhere in an enveloped AdamW frame: a FucinaError, the optimizer
    unchanged; flips in the state data (which no structural check can see) are ChecksumMismatch,
    and so are flips in names / dims (a corrupt file, not a changed model)."""
    opt, *_ = _ck_trained(ctx1)
    data = _enveloped(opt)
    target, *_ = _ck_trained(ctx1, seed=9)
    before = save(target)
    kinds = {}
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(fu.FucinaError) as e:
            load(target, bytes(bad))
        kinds[e.type.__name__] = kinds.get(e.type.__name__, 0) + 1
        assert save(target) == before
    # only the envelope magic (bare-frame path) and its length field can fail another way
    assert kinds["ChecksumMismatch"] >= len(data) - 4 - 8, kinds


def test_envelope_errors(ctx1, tmp_path):
    opt, *_ = _ck_trained(ctx1)
    data = _enveloped(opt)
    target, *_ = _ck_trained(ctx1, seed=9)
    before = save(target)
    for cut in range(len(data)):  # truncation anywhere: InvalidDataLength
        with pytest.raises(fu.InvalidDataLength):
            load(target, data[:cut])
    n = len(data) - 16
    longer = data[:4] + u64(n + 3) + data[12:]
    with pytest.raises(fu.ChecksumMismatch, match=f"the frame is {n} bytes, its envelope says {n + 3}"):
        load(target, longer)
    shorter = data[:4] + u64(n - 3) + data[12:]
    with pytest.raises(fu.ChecksumMismatch, match="the stream ended inside .* does not match|"
                                                  "does not match its CRC32 .*the stream ended"):
        load(target, shorter)
    # a structural mismatch in an intact envelope is reported as itself (the model changed)
    other = fu.optim.AdamW(lr=0.01)
    w = ctx1.variable(np.zeros((3, 5), F), ("o", "i"))
    other.add_param_named(w, "renamed")
    b = ctx1.variable(np.zeros(5, F), ("i",))
    other.add_param_named(b, "b")
    with pytest.raises(fu.CheckpointUnknownName):
        load(other, data)
    path = tmp_path / "optimizer.fucina"
    bad = bytearray(data)
    bad[-20] ^= 1
    path.write_bytes(bytes(bad))
    with open(path, "rb") as f, pytest.raises(fu.ChecksumMismatch, match="optimizer.fucina"):
        target.load_state(f)
    assert save(target) == before
