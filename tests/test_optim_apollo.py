"""APOLLO and APOLLO-Mini (SPEC T-8, T-17 frames FZP3/FZP5).

The fused kernels (moments + channel factors, the scaled update) bitwise against numpy
transcriptions with the SPEC's f64 flat-order sums; whole steps bitwise against a numpy float32
transcription in the kernels' op order (projection regeneration schedule, per-slot seeds,
tall/wide/tensor scaling, front/back scale, the norm-growth limiter, decay after the step, the
legacy-HF AdamW fallback), with the compressed gradient taken from Fucina's GEMM; 30-step
trajectories against a float64 transcription of apollo_torch's AdamW.step; thread invariance;
exact frame bytes, every load error, transactional loads, forced projection regeneration and
bit-exact resume (f32 state; f32 and 16-bit params).

The projection matrices come from fu.rng.gaussian_fill (RNG-5, pinned by tests/test_rng.py): the
reference apollo_torch draws them from torch's generator and advances seeds with next_seed, which
the SPEC replaces by seed + chunk·0x9E3779B97F4A7C15 — the transcriptions here use that schedule.
"""
import io
import math
import struct

import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise, bf16_round as bf16, feed_grad as feed
from conftest import load_state_bytes as load, state_bytes as save
from fucina.exec import optim_lowrank as xl
from fucina.exec.matmul import gemm
from fucina.optim import AdamW, OptimizerSet
from fucina.optim.apollo import Apollo, ApolloConfig
from test_optim_sum_squares import ref_sum_squares

F = np.float32
GAMMA = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1


def f32(x) -> float:
    return float(F(x))


def projection(ctx, seed, chunk, shape, rank) -> np.ndarray:
    scale = F(F(1) / np.sqrt(F(rank)))
    out = ctx.zeros(shape, tags=("p", "q"))
    fu.rng.gaussian_fill((seed + chunk * GAMMA) & M64, out, float(scale))
    return out.numpy()


def seq_sums(o2: np.ndarray, r2: np.ndarray, axis: int):
    """Serial f64 sums in flat order along `axis` (np.cumsum is strictly sequential)."""
    return np.cumsum(o2, axis=axis).take(-1, axis=axis), np.cumsum(r2, axis=axis).take(-1, axis=axis)


def factors(m, v, r, eps, mode):
    """s from updated moments (f32 opt), f64 squares summed per channel in flat order."""
    opt = m / (np.sqrt(v) + F(eps))
    o2, r2 = opt.astype(np.float64) ** 2, r.astype(np.float64) ** 2
    if mode == "tensor":
        so, sr = seq_sums(o2.reshape(-1), r2.reshape(-1), 0)
        so, sr = np.array([so]), np.array([sr])
    else:
        so, sr = seq_sums(o2, r2, 1 if mode == "tall" else 0)
    return (np.sqrt(so) / (np.sqrt(sr) + 1e-8)).astype(F)


# ---------------------------------------------------------------------------------------------
# the kernels

@pytest.mark.parametrize("mode,shape", [("tall", (5000, 9)), ("tall", (3, 40)),
                                        ("wide", (12, 3000)), ("wide", (5, 17)),
                                        ("tensor", (300, 70)), ("tensor", (1, 1))])
def test_scale_kernel_bitwise(ctx1, ctx2, mode, shape):
    rng = np.random.default_rng(shape[0] + shape[1])
    r = rng.standard_normal(shape).astype(F)
    r[0, 0] = 0.0
    m0 = rng.standard_normal(shape).astype(F) * F(0.1)
    v0 = np.abs(rng.standard_normal(shape).astype(F)) * F(0.01)
    sc = (f32(0.9), f32(1 - 0.9), f32(0.999), f32(1 - 0.999), f32(1e-6))
    want_m = F(sc[0]) * m0 + F(sc[1]) * r
    want_v = F(sc[2]) * v0 + (F(sc[3]) * r) * r
    want_s = factors(want_m, want_v, r, sc[4], mode)
    outs = []
    for ctx in (ctx1, ctx2):
        rr, mm, vv = (ctx.from_numpy(a) for a in (r, m0, v0))
        s = ctx.empty(want_s.shape)
        xl.apollo_scale(ctx, rr, mm.addr, vv.addr, s, mode, sc)
        assert_bitwise(mm.to_numpy(), want_m)
        assert_bitwise(vv.to_numpy(), want_v)
        assert_bitwise(s.to_numpy(), want_s)
        outs.append(s.to_numpy())
    assert_bitwise(outs[0], outs[1])


@pytest.mark.parametrize("mode,shape", [("tall", (700, 50)), ("wide", (50, 700)),
                                        ("tensor", (13, 11))])
@pytest.mark.parametrize("front", [None, 3.0])
def test_build_kernel_bitwise(ctx, mode, shape, front):
    rng = np.random.default_rng(7)
    g = rng.standard_normal(shape).astype(F)
    n = {"tall": shape[0], "wide": shape[1], "tensor": 1}[mode]
    s = rng.random(n).astype(F)
    sv = s[:, None] if mode == "tall" else s[None, :]
    want = g * sv if front is None else (g * sv) * F(front)
    out = ctx.empty(shape)
    xl.apollo_build(ctx, out, ctx.from_numpy(g), ctx.from_numpy(s), mode, front)
    assert_bitwise(out.to_numpy(), want)


# ---------------------------------------------------------------------------------------------
# whole steps, bitwise against a float32 transcription in the kernels' order

class Exact:
    """numpy float32 in the kernels' op order; R by Fucina's GEMM on the same layouts."""

    def __init__(self, ctx, c: ApolloConfig, params: dict, lowrank: list, fallback: list):
        self.ctx, self.c = ctx, c
        self.p = {k: v.copy() for k, v in params.items()}
        self.low, self.fb = lowrank, fallback
        self.st = {}
        for i, k in enumerate(lowrank):
            rows, cols = params[k].shape
            n = (rows if rows >= cols else cols) * c.rank
            self.st[k] = dict(step=0, seed=(c.seed + i + 1) & M64, prev=F(-1), P=None, pc=None,
                              m=np.zeros(n, F), v=np.zeros(n, F))
        for k in fallback:
            self.st[k] = dict(step=0, m=np.zeros(params[k].size, F), v=np.zeros(params[k].size, F))

    def step_size(self, t):
        c = self.c
        if not c.correct_bias:
            return F(c.lr)
        return F(c.lr * math.sqrt(1.0 - c.beta2 ** t) / (1.0 - c.beta1 ** t))

    def decay(self):
        c = self.c
        return F(-(c.lr * c.weight_decay)) if c.weight_decay > 0 else F(0)

    def moments(self, st, x):
        c = self.c
        st["m"] = F(c.beta1) * st["m"] + F(1.0 - c.beta1) * x
        st["v"] = F(c.beta2) * st["v"] + (F(1.0 - c.beta2) * x) * x

    def step(self, grads: dict):
        for k in self.low:
            if k in grads:
                self.lowrank(k, grads[k])
        for k in self.fb:
            if k in grads:
                self.fallback(k, grads[k].reshape(-1))

    def lowrank(self, k, g):
        c, st, ctx = self.c, self.st[k], self.ctx
        rows, cols = g.shape
        tall = rows >= cols
        chunk = st["step"] // c.update_proj_gap
        if st["P"] is None or st["pc"] != chunk:
            shape = (c.rank, cols) if tall else (rows, c.rank)
            st["P"], st["pc"] = projection(ctx, st["seed"], chunk, shape, c.rank), chunk
        rg, rp = ctx.from_numpy(g), ctx.from_numpy(st["P"]).permute((1, 0))
        R = (gemm(ctx, rg, rp) if tall else gemm(ctx, rp, rg)).to_numpy()
        st["step"] += 1
        self.moments(st, R.reshape(-1))
        mode = "tensor" if c.scale_type == "tensor" else ("tall" if tall else "wide")
        s = factors(st["m"].reshape(R.shape), st["v"].reshape(R.shape), R, c.eps, mode)
        sv = s[:, None] if mode == "tall" else s[None, :]
        sq = F(np.sqrt(F(c.scale)))
        U = g * sv
        if c.scale_front and F(c.scale) != 1:
            U = U * sq
        lim = F(1)
        if not c.disable_norm_growth_limiter:
            cur = F(math.sqrt(ref_sum_squares(U)))
            if st["prev"] >= 0:
                lim = F(max(F(cur / F(st["prev"] + F(1e-8))), F(1.01)) / F(1.01))
                st["prev"] = F(cur / lim)
            else:
                st["prev"] = cur
        back = sq if not c.scale_front and F(c.scale) != 1 else F(1)
        stepped = self.p[k] - self.step_size(st["step"]) * ((U / lim) * back)
        self.p[k] = stepped + self.decay() * stepped

    def fallback(self, k, g):
        c, st = self.c, self.st[k]
        st["step"] += 1
        self.moments(st, g)
        p = self.p[k].reshape(-1)
        stepped = p - self.step_size(st["step"]) * (st["m"] / (np.sqrt(st["v"]) + F(c.eps)))
        self.p[k] = (stepped + self.decay() * stepped).reshape(self.p[k].shape)


SHAPES = {"tall": (40, 24), "wide": (9, 70), "square": (16, 16), "conv": (3, 4, 5),
          "bias": (24,), "head": (11, 6)}
LOWRANK, FALLBACK = ["tall", "wide", "square"], ["conv", "bias", "head"]


def build(ctx, cfg, values, order=None, dtype="f32"):
    ts = {k: ctx.variable(values[k], tuple("abc"[:values[k].ndim]), dtype=dtype)
          for k in (order or values)}
    opt = Apollo(cfg)
    for k in order or values:
        (opt.add_fallback_param if k == "head" else opt.add_param)(ts[k], k)
    return opt, ts


CONFIGS = [
    ApolloConfig(lr=0.05, rank=4, update_proj_gap=2, weight_decay=0.05),
    ApolloConfig(lr=0.02, rank=3, update_proj_gap=3, scale=4.0, scale_front=True,
                 correct_bias=False, seed=12345),
    ApolloConfig(lr=0.02, rank=5, update_proj_gap=4, scale=2.0, eps=1e-8,
                 disable_norm_growth_limiter=True, weight_decay=0.1, beta1=0.8, beta2=0.95),
    ApolloConfig.mini(lr=0.005, update_proj_gap=3, seed=2**64 - 2),
]
IDS = ["channel-decay", "front-scale-nobias", "nolimiter", "mini"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_steps_bitwise_against_float32_transcription(ctx, cfg):
    rng = np.random.default_rng(1)
    values = {k: rng.standard_normal(s).astype(F) for k, s in SHAPES.items()}
    opt, ts = build(ctx, cfg, values)
    ref = Exact(ctx, cfg, {k: values[k] for k in SHAPES}, LOWRANK, FALLBACK)
    for step in range(7):
        grads = {k: rng.standard_normal(s).astype(F) * F(1 + step) for k, s in SHAPES.items()}
        if step == 4:
            del grads["wide"], grads["bias"]       # no gradient: skipped, counters stay
        for k, g in grads.items():
            feed(ctx, ts[k], g)
        opt.step()
        ref.step(grads)
        for k in SHAPES:
            assert_bitwise(ts[k].numpy(), ref.p[k])
            st = opt.state_of(ts[k])
            assert st["step"] == ref.st[k]["step"]
            assert_bitwise(st["m"], ref.st[k]["m"])
            assert_bitwise(st["v"], ref.st[k]["v"])
            if k in LOWRANK:
                assert st["prev_norm"] == float(ref.st[k]["prev"])
                assert st["seed"] == ref.st[k]["seed"]
        opt.zero_grad()


def test_seeds_routing_and_mini(ctx):
    assert ApolloConfig.mini() == ApolloConfig(rank=1, scale_type="tensor", scale=128.0)
    assert ApolloConfig.mini(lr=0.005).lr == 0.005 and ApolloConfig.mini().rank == 1
    opt = Apollo(seed=2**64 - 1)
    ws = [ctx.variable(np.ones(s, F), tuple("abc"[:len(s)])) for s in
          [(4, 3), (5,), (2, 3, 4), (3, 4), ()]]
    for w in ws:
        opt.add_param(w)
    e = ctx.variable(np.ones((6, 2), F), ("v", "d"))
    opt.add_fallback_param_named(e, "embed")
    assert [s.raw.shape for s in opt.slots] == [(4, 3), (3, 4)]
    assert [s.raw.shape for s in opt.fallback.slots] == [(5,), (2, 3, 4), (), (6, 2)]
    assert opt.state_of(ws[0])["seed"] == 0 and opt.state_of(ws[3])["seed"] == 1  # wraps
    assert opt.state_of(ws[0])["m"].shape == (4 * 128,)           # tall: rows · rank
    assert opt.state_of(ws[3])["m"].shape == (128 * 4,)           # wide: rank · cols
    assert set(opt.state_of(e)) == {"step", "m", "v"}
    for add, t in ((opt.add_param, ws[0]), (opt.add_fallback_param, ws[0]),
                   (opt.add_param, ws[1]), (opt.add_fallback_param, e)):
        with pytest.raises(fu.DuplicateParam):
            add(t)
    other = AdamW()
    other.add_param(e)
    with pytest.raises(fu.DuplicateParam):
        OptimizerSet([opt, other])


def test_config_errors(ctx):
    for bad in (dict(rank=0), dict(update_proj_gap=0), dict(rank=2.5), dict(scale_type="row"),
                dict(lr=-1.0), dict(beta1=1.0), dict(beta2=-0.1), dict(eps=-1.0),
                dict(seed=1.5)):
        with pytest.raises(ValueError):
            Apollo(**bad)
    with pytest.raises(TypeError):
        Apollo(rank=4, bogus=True)
    with pytest.raises(TypeError):
        Apollo(ApolloConfig(), lr=0.1)
    opt = Apollo(rank=2)
    w = ctx.variable(np.ones((4, 3), F), ("a", "b"))
    opt.add_param(w)
    feed(ctx, w, np.ones((4, 3), F))
    opt.config.rank = 3
    with pytest.raises(ValueError, match="rank changed"):
        opt.step()
    with pytest.raises(fu.NotAVariable):
        opt.add_param(ctx.tensor(np.ones((2, 2), F), ("a", "b")))


# ---------------------------------------------------------------------------------------------
# trajectories against a float64 transcription of apollo_torch

class RefApollo:
    """apollo_torch's AdamW.step in float64 (plus its non-rank path for the fallback)."""

    def __init__(self, ctx, c, params, lowrank, fallback):
        self.ctx, self.c, self.low, self.fb = ctx, c, lowrank, fallback
        self.p = {k: v.astype(np.float64) for k, v in params.items()}
        self.st = {k: dict(step=0, m=0.0, v=0.0) for k in params}
        for i, k in enumerate(lowrank):
            self.st[k].update(seed=(c.seed + i + 1) & M64, proj=None, scaled=None)

    def step(self, grads):
        c = self.c
        for k in self.low + self.fb:
            g = grads[k].astype(np.float64)
            st = self.st[k]
            if k in self.low:
                rows, cols = g.shape
                if st["proj"] is None or st["step"] % c.update_proj_gap == 0:
                    chunk = st["step"] // c.update_proj_gap
                    shape = (c.rank, cols) if rows >= cols else (rows, c.rank)
                    st["proj"] = projection(self.ctx, st["seed"], chunk, shape, c.rank)
                P = st["proj"].astype(np.float64)
                r = g @ P.T if rows >= cols else P.T @ g
            else:
                r = g
            st["step"] += 1
            st["m"] = st["m"] * c.beta1 + (1 - c.beta1) * r
            st["v"] = st["v"] * c.beta2 + (1 - c.beta2) * r * r
            denom = np.sqrt(st["v"]) + c.eps
            step_size = c.lr
            if c.correct_bias:
                step_size = c.lr * math.sqrt(1 - c.beta2 ** st["step"]) / (1 - c.beta1 ** st["step"])
            norm_grad = st["m"] / denom
            if k in self.low:
                if c.scale_type == "channel":
                    dim = 0 if rows < cols else 1
                    f = np.linalg.norm(norm_grad, axis=dim) / (np.linalg.norm(r, axis=dim) + 1e-8)
                    f = f[:, None] if dim == 1 else f
                else:
                    f = np.linalg.norm(norm_grad) / (np.linalg.norm(r) + 1e-8)
                scaled = g * f
                if c.scale_front:
                    scaled = scaled * math.sqrt(c.scale)
                if not c.disable_norm_growth_limiter:
                    if st["scaled"] is not None:
                        n = np.linalg.norm(scaled)
                        lim = max(n / (st["scaled"] + 1e-8), 1.01) / 1.01
                        scaled = scaled / lim
                        st["scaled"] = n / lim
                    else:
                        st["scaled"] = np.linalg.norm(scaled)
                norm_grad = scaled if c.scale_front else scaled * math.sqrt(c.scale)
            self.p[k] = self.p[k] + (-step_size) * norm_grad.reshape(self.p[k].shape)
            if c.weight_decay > 0:
                self.p[k] = self.p[k] + (-c.lr * c.weight_decay) * self.p[k]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_trajectory_against_apollo_torch_float64(ctx, cfg):
    """30 steps. Tolerance: |Δp| <= 1e-5 (params O(1) moving up to ~1.8 over the run: f32
    arithmetic, f32-rounded hyperparameters, f32 GEMMs and norms against float64; measured
    <= 1.7e-6; a wrong projection schedule is off by ~0.2)."""
    rng = np.random.default_rng(3)
    values = {k: rng.standard_normal(s).astype(F) for k, s in SHAPES.items()}
    opt, ts = build(ctx, cfg, values)
    ref = RefApollo(ctx, cfg, values, LOWRANK, FALLBACK)
    worst = 0.0
    for _ in range(30):
        grads = {k: rng.standard_normal(s).astype(F) for k, s in SHAPES.items()}
        for k, g in grads.items():
            feed(ctx, ts[k], g)
        opt.step()
        ref.step(grads)
        worst = max(worst, max(float(np.abs(ts[k].numpy() - ref.p[k]).max()) for k in SHAPES))
    assert worst <= 1e-5, worst


def test_thread_invariance(ctx1, ctx2):
    shapes = {"tall": (600, 100), "wide": (100, 600), "bias": (70_000,)}
    for cfg in (ApolloConfig(lr=0.01, rank=64, update_proj_gap=2, weight_decay=0.01),
                ApolloConfig.mini(lr=0.005)):
        runs = []
        for ctx in (ctx1, ctx2):
            rng = np.random.default_rng(5)
            opt, ts = build(ctx, cfg, {k: rng.standard_normal(s).astype(F)
                                       for k, s in shapes.items()})
            for _ in range(3):
                for k, s in shapes.items():
                    feed(ctx, ts[k], rng.standard_normal(s).astype(F))
                opt.step()
            runs.append((save(opt), {k: t.numpy() for k, t in ts.items()}))
        assert runs[0][0] == runs[1][0]
        for k in shapes:
            assert_bitwise(runs[0][1][k], runs[1][1][k])


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_16bit_params_step_the_master(ctx, dtype):
    rng = np.random.default_rng(6)
    cfg = ApolloConfig(lr=0.02, rank=3, update_proj_gap=2, weight_decay=0.01)
    raw = {k: rng.standard_normal(SHAPES[k]).astype(F) for k in ("tall", "bias")}
    widen = {k: (v.astype(np.float16).astype(F) if dtype == "f16" else bf16(v))
             for k, v in raw.items()}
    o16, t16 = build(ctx, cfg, raw, dtype=dtype)
    o32, t32 = build(ctx, cfg, widen)
    for _ in range(4):
        for k in raw:
            g = rng.standard_normal(SHAPES[k]).astype(F)
            feed(ctx, t16[k], g)
            feed(ctx, t32[k], g)
        o16.step()
        o32.step()
        for k in raw:
            master = o16.state_of(t16[k])["master"]
            assert_bitwise(master, t32[k].numpy())
            narrow = master.astype(np.float16).astype(F) if dtype == "f16" else bf16(master)
            assert_bitwise(t16[k].numpy().astype(F), narrow)


# ---------------------------------------------------------------------------------------------
# frames (T-17)

def fbits(x) -> int:
    return int(np.array([x], F).view(np.uint32)[0])


def rec_name(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def small(ctx, cfg=None, wdtype="f32", bdtype="f32", steps=3, seed=4, names=("w", None)):
    """One low-rank slot (w [3, 5], wide) and one fallback slot (b [5]), trained."""
    cfg = cfg or ApolloConfig(lr=0.02, rank=2, update_proj_gap=2, scale=2.0)
    rng = np.random.default_rng(seed)
    w = ctx.variable(rng.standard_normal((3, 5)).astype(F), ("a", "b"), dtype=wdtype)
    b = ctx.variable(rng.standard_normal(5).astype(F), ("b",), dtype=bdtype)
    opt = Apollo(cfg)
    opt.add_param(w, names[0])
    opt.add_param(b, names[1])
    for _ in range(steps):
        feed(ctx, w, rng.standard_normal((3, 5)).astype(F))
        feed(ctx, b, rng.standard_normal(5).astype(F))
        opt.step()
    return opt, w, b


@pytest.mark.parametrize("wdtype,bdtype", [("f32", "f32"), ("bf16", "f32"), ("f32", "f16")])
def test_frame_bytes(ctx, wdtype, bdtype):
    cfg = ApolloConfig(lr=0.02, rank=2, update_proj_gap=2, scale=2.0, scale_type="tensor",
                       correct_bias=False, scale_front=True, disable_norm_growth_limiter=False)
    opt, w, b = small(ctx, cfg, wdtype, bdtype)
    v5 = "f32" != wdtype or "f32" != bdtype
    sw, sb = opt.state_of(w), opt.state_of(b)
    want = (b"FZP5" if v5 else b"FZP3") + struct.pack("<QQIBBBB", 2, 2, fbits(2.0), 1, 0, 1, 0)
    want += struct.pack("<I", 1) + rec_name("w") + struct.pack("<QQ", 3, 5)
    want += struct.pack("<QQI", 3, 1, fbits(sw["prev_norm"]))
    want += sw["m"].tobytes() + sw["v"].tobytes()
    assert sw["m"].size == 2 * 5
    if v5:
        want += b"\x00" if "master" not in sw else b"\x01" + sw["master"].tobytes()
    want += struct.pack("<I", 1) + rec_name("param0") + struct.pack("<QQ", 5, 1)
    want += struct.pack("<Q", 3) + sb["m"].tobytes() + sb["v"].tobytes()
    if v5:
        want += b"\x00" if "master" not in sb else b"\x01" + sb["master"].tobytes()
    assert save(opt) == want


def corrupt(blob: bytes, at: int, value: bytes) -> bytes:
    return blob[:at] + value + blob[at + len(value):]


def test_load_errors_and_transactions(ctx):
    opt, w, b = small(ctx)
    blob = save(opt)
    head = 4 + 8 + 8 + 4 + 4 + 4                     # magic, rank, gap, scale, 4 flags, n_main
    rec = head + 2 + 1                               # after the name "w"
    fb_at = rec + 16 + 8 + 8 + 4 + 2 * 4 * 10        # dims, step, seed, prev, m, v

    def fresh(c=None, **kw):
        o, *_ = small(ctx, c, steps=1, seed=11, **kw)
        return o

    cases = [
        (b"FZP4" + blob[4:], fu.CheckpointMagicMismatch, "FZP3 / FZP5"),
        (corrupt(blob, 4, struct.pack("<Q", 3)), fu.CheckpointConfigMismatch, "rank"),
        (corrupt(blob, 12, struct.pack("<Q", 5)), fu.CheckpointConfigMismatch, "update_proj_gap"),
        (corrupt(blob, 20, struct.pack("<I", fbits(2.5))), fu.CheckpointConfigMismatch, "scale"),
        (corrupt(blob, 24, b"\x01"), fu.CheckpointConfigMismatch, "scale_type"),
        (corrupt(blob, 25, b"\x00"), fu.CheckpointConfigMismatch, "correct_bias"),
        (corrupt(blob, 26, b"\x01"), fu.CheckpointConfigMismatch, "scale_front"),
        (corrupt(blob, 27, b"\x01"), fu.CheckpointConfigMismatch, "limiter"),
        (corrupt(blob, rec, struct.pack("<Q", 4)), fu.CheckpointShapeMismatch, "dims"),
        (corrupt(blob, head + 2, b"x"), fu.CheckpointUnknownName, "'x'"),
        (corrupt(blob, head, struct.pack("<H", 0)), fu.CheckpointInvalidName, "length 0"),
        (corrupt(blob, head - 4, struct.pack("<I", 0)), fu.CheckpointMissingEntry, "'w'"),
        (corrupt(blob, fb_at, struct.pack("<I", 0)), fu.CheckpointMissingEntry, "param0"),
        (corrupt(blob, fb_at + 4 + 2, b"q"), fu.CheckpointUnknownName, "'qaram0'"),
        (blob[:-1], fu.InvalidDataLength, "ended"),
        (blob[:fb_at - 3], fu.InvalidDataLength, "ended"),
    ]
    for data, err, msg in cases:
        target = fresh()
        before = save(target)
        with pytest.raises(err, match=msg):
            load(target, data)
        assert save(target) == before, err        # nothing committed (main nor fallback)
    one = blob[head:fb_at]
    dup = blob[:head - 4] + struct.pack("<I", 2) + one + one + blob[fb_at:]
    with pytest.raises(fu.CheckpointDuplicateName, match="twice"):
        load(fresh(), dup)
    o16, *_ = small(ctx, wdtype="bf16")
    with pytest.raises(fu.CheckpointDtypeMismatch, match="master"):
        load(fresh(), save(o16))                  # a master for an f32 slot
    target = fresh(ApolloConfig(lr=0.9, rank=2, update_proj_gap=2, scale=2.0, seed=77))
    load(target, blob)                            # lr (and the base seed) are not pinned
    assert save(target) == blob
    assert target.slots[0].state["seed"] == 1   # the slot seed comes from the frame


@pytest.mark.parametrize("wdtype", ["f32", "bf16", "f16"])
def test_bit_exact_resume_regenerates_projections(ctx, wdtype):
    """Save mid-chunk (step 5, gap 4): the resumed run regenerates P from (seed, step) and
    reproduces the uninterrupted run bitwise; named params may come back in another order."""
    cfg = ApolloConfig(lr=0.02, rank=4, update_proj_gap=4, weight_decay=0.01, seed=99)
    rng = np.random.default_rng(8)
    values = {k: rng.standard_normal(s).astype(F) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s).astype(F) for k, s in SHAPES.items()} for _ in range(9)]

    def run(opt, ts, gs):
        for g in gs:
            for k, t in ts.items():
                feed(ctx, t, g[k])
            opt.step()

    opt, ts = build(ctx, cfg, values, dtype=wdtype)
    run(opt, ts, grads[:5])
    blob = save(opt)
    snap = {k: t.numpy() for k, t in ts.items()}
    run(opt, ts, grads[5:])
    opt2, ts2 = build(ctx, cfg, snap, order=list(reversed(SHAPES)), dtype=wdtype)
    load(opt2, blob)
    assert all(s.cache["proj_chunk"] is None for s in opt2.slots)
    run(opt2, ts2, grads[5:])
    for k in SHAPES:
        assert_bitwise(ts2[k].numpy(), ts[k].numpy())
        a, b = opt.state_of(ts[k]), opt2.state_of(ts2[k])
        assert a.keys() == b.keys()
        for field in a:
            assert_bitwise(np.asarray(b[field]), np.asarray(a[field]))


def test_optimizer_set_roundtrip(ctx):
    opt, w, b = small(ctx)
    s = OptimizerSet([opt])
    f = io.BytesIO()
    s.save_state(f, checksum=False)
    assert f.getvalue()[8:] == save(opt)
    target, *_ = small(ctx, steps=1, seed=3)
    OptimizerSet([target]).load_state(io.BytesIO(f.getvalue()))
    assert save(target) == save(opt)
