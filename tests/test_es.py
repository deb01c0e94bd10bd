"""fu.es (SPEC T-25, T-26, T-28) against a numpy transcription of the spec.

The oracle below is written from SPEC T-25/T-26 and RNG-2/RNG-7 alone: seeds with Python ints,
the RNG-7 noise in numpy float32 in the spec's operation order, reward statistics and shaping in
float64, element updates in float32 with the dtype roundings (f16 by numpy, bf16 by the bit
rule). Element results are compared bitwise (SPEC §0.5: elementwise maps and RNG are bitwise).
"""
import gc
import math
import threading

import numpy as np
import pytest

import fucina as fu
import fucina.es as es
from conftest import assert_bitwise
from fucina.exec import es as xes
from fucina.io import ParamRegistry
from test_rng import gaussian_fast, mix

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
SEED_DOMAIN = 0x65735F7365656473
NOISE_DOMAIN = 0x65735F6E6F697365
f32 = np.float32

# ---------------------------------------------------------------------------------------------
# oracle


def at(seed, i):
    return mix((seed + ((i + 1) * GAMMA & MASK)) & MASK)


def noise(seed, n):
    """RNG-7 gaussian_fill_at_fast(seed, 0, n values, scale 1): test_rng's transcription."""
    return gaussian_fast(seed, 0, n, 1.0)


def bf16_round(x):
    bits = np.ascontiguousarray(x, f32).view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rne = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    hi = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rne)
    return (hi << np.uint32(16)).view(f32)


def rnd(x, dtype):
    """to_dtype of SPEC T-25 on f32 values, widened back to f32."""
    x = np.asarray(x, f32)
    if dtype == "f16":
        return x.astype(np.float16).astype(f32)
    if dtype == "bf16":
        return bf16_round(x)
    return x


def member_seed(cfg, iteration, n):
    return at(cfg.seed ^ SEED_DOMAIN, (iteration * cfg.population + n) & MASK)


def stream_seed(cfg, ms, k):
    return at(ms ^ NOISE_DOMAIN, k) if cfg.noise == "iid" else ms


def ref_perturb(cfg, iteration, thetas, dtypes, member, sign=1.0):
    """The perturbed values (f32 arrays) of every slot."""
    anti = cfg.antithetic
    ms = member_seed(cfg, iteration, member & ~1 if anti else member)
    nsign = -1.0 if anti and member % 2 else 1.0
    scaled = f32(sign * nsign) * f32(cfg.sigma)
    out = []
    for k, (p, dt) in enumerate(zip(thetas, dtypes)):
        eps = noise(stream_seed(cfg, ms, k), p.size)
        out.append(rnd(rnd(p, dt) + rnd(scaled * eps, dt), dt))
    return out


def ref_coeffs(cfg, rewards):
    r = np.asarray(rewards, f32)
    n = len(r)
    mean = 0.0
    for v in r:
        mean += float(v)
    mean /= n
    var = 0.0
    for v in r:
        var += (float(v) - mean) ** 2
    std = math.sqrt(var / n)
    if cfg.reward_norm == "z_score":
        c = np.array([(float(v) - mean) / (std + 1e-8) for v in r], f32)
    elif cfg.reward_norm == "centered_ranks":
        order = sorted(range(n), key=lambda m: (float(r[m]), m))
        c = np.empty(n, f32)
        for rank, m in enumerate(order):
            c[m] = f32(rank) / f32(n - 1) - f32(0.5)
    else:
        c = r.copy()
    return c, (mean, std, float(r.min()), float(r.max()))


def ref_update(cfg, iteration, thetas, dtypes, rewards, anchors=None):
    c, stats = ref_coeffs(cfg, rewards)
    if cfg.antithetic:
        c = c[0::2] - c[1::2]
        members = range(0, cfg.population, 2)
    else:
        members = range(cfg.population)
    seeds = [member_seed(cfg, iteration, m) for m in members]
    alpha = f32(cfg.alpha) if cfg.alpha is not None else f32(cfg.sigma) / f32(2)
    scale = alpha / f32(cfg.population)
    out = []
    for k, (p, dt) in enumerate(zip(thetas, dtypes)):
        acc = np.zeros(p.size, f32)
        for s, ms in enumerate(seeds):
            acc = acc + c[s] * noise(stream_seed(cfg, ms, k), p.size)
        delta = rnd(scale * acc, dt)
        q = rnd(rnd(p, dt) + delta, dt)
        if cfg.anchor_decay != "none":
            a = rnd(anchors[k], dt)
            step = alpha * f32(cfg.anchor_lambda)
            d = rnd(q - a, dt)
            if cfg.anchor_decay == "l2":
                kept = rnd(d * (f32(1) - step), dt)
                q = rnd(kept + a, dt)
            else:
                th = rnd(np.abs(d) - step, dt)
                cl = np.where(th > 0, th, f32(0))
                q = rnd(np.where(d < 0, -cl, cl) + a, dt)
        out.append(q)
    return out, stats


# ---------------------------------------------------------------------------------------------
# helpers


def _context(threads):
    c = fu.ExecContext(threads=threads)
    yield c
    gc.collect()  # a caught error's traceback keeps the test frame, hence its tensors, alive
    c.close()


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def ctx(request):
    yield from _context(request.param)


@pytest.fixture
def ctx1():
    yield from _context(1)


@pytest.fixture
def ctx2():
    yield from _context(2)


SIZES = (3000, 1, 37, 64)


def make_params(ctx, dtypes, sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    ts, vals = [], []
    for i, (n, dt) in enumerate(zip(sizes, dtypes)):
        v = rnd(rng.standard_normal(n).astype(f32), dt)
        ts.append(ctx.tensor(v, (f"a{i}",), dt))
        vals.append(v)
    return ts, vals


def values(ts):
    return [t.numpy().astype(f32) for t in ts]


def trainer(ts, **kw):
    tr = es.Trainer(**kw)
    for i, t in enumerate(ts):
        tr.add_param(t, f"p{i}")
    return tr


DTYPE_SETS = [("f32",) * 4, ("f16",) * 4, ("bf16",) * 4, ("f32", "bf16", "f16", "f32")]

# ---------------------------------------------------------------------------------------------
# noise and perturb / restore


def test_noise_oracle_is_rng7(ctx1):
    """The oracle's noise is the library's RNG-7 fill (tested against the spec in test_rng)."""
    t = ctx1.zeros((1001,), ("n",))
    fu.rng.gaussian_fill_at_fast(1234567, 0, t)
    assert_bitwise(t.numpy(), noise(1234567, 1001))


@pytest.mark.parametrize("dtypes", DTYPE_SETS)
@pytest.mark.parametrize("noise_scheme", ["iid", "correlated"])
@pytest.mark.parametrize("antithetic", [False, True])
def test_perturb_restore_regenerate(ctx, dtypes, noise_scheme, antithetic):
    ts, vals = make_params(ctx, dtypes)
    cfg = es.EsConfig(sigma=0.05, population=6, antithetic=antithetic, noise=noise_scheme, seed=99)
    tr = es.Trainer(cfg)
    for i, t in enumerate(ts):
        tr.add_param(t, f"p{i}")
    tr.iteration = 3
    for member in (0, 1, 5):
        before = values(ts)
        tr.perturb(member)
        want = ref_perturb(cfg, 3, before, dtypes, member)
        for got, w in zip(values(ts), want):
            assert_bitwise(got, w)
        tr.restore(member)
        back = ref_perturb(cfg, 3, want, dtypes, member, sign=-1.0)
        for got, w in zip(values(ts), back):
            assert_bitwise(got, w)
        for got, w in zip(values(ts), before):  # (x + t) − t drift: a few ulps at most
            assert np.allclose(got, w, rtol=0, atol=np.abs(w).max() * 1e-2 + 1e-6)


@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_restore_snapshot_is_bitwise(ctx, dtypes):
    ts, vals = make_params(ctx, dtypes)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-40], f32)
    ts.append(ctx.tensor(specials, ("s",), dtypes[0]))
    tr = trainer(ts, sigma=0.3, population=4, restore_mode="snapshot", seed=5)
    raw_before = [t.data_const().copy() for t in ts]
    for member in range(4):
        tr.perturb(member)
        assert any(not np.array_equal(t.data_const(), r) for t, r in zip(ts, raw_before))
        tr.restore(member)
        for t, r in zip(ts, raw_before):
            assert np.array_equal(t.data_const().view(np.uint8), r.view(np.uint8))


def test_materialize_member_equals_perturb(ctx):
    dtypes = ("f32", "bf16", "f16", "f32")
    ts, vals = make_params(ctx, dtypes)
    tr = trainer(ts, sigma=0.02, population=8, antithetic=True, seed=11)
    with fu.ExecContext(threads=1) as other:
        replicas = [other.zeros(t.shape, ("r",), t.dtype) for t in ts]
        for member in (2, 3, 7):
            tr.materialize_member(member, replicas)
            for got, v in zip(values(ts), vals):
                assert_bitwise(got, v)  # θ untouched
            want = ref_perturb(tr.config, 0, vals, dtypes, member)
            for got, w in zip(values(replicas), want):
                assert_bitwise(got, w)
        del replicas


# ---------------------------------------------------------------------------------------------
# the update


@pytest.mark.parametrize("norm", ["z_score", "centered_ranks", "none"])
@pytest.mark.parametrize("antithetic", [False, True])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_update_matches_reference(ctx, norm, antithetic, dtypes):
    ts, vals = make_params(ctx, dtypes, seed=3)
    cfg = es.EsConfig(sigma=0.01, alpha=0.2, population=6, antithetic=antithetic, reward_norm=norm,
                      seed=2024)
    tr = es.Trainer(cfg)
    for t in ts:
        tr.add_param(t)
    rewards = [0.5, -1.25, 3.0, 0.5, 2.0, -0.75]
    for it in range(2):
        before = values(ts)
        stats = tr.update(rewards)
        want, ref_stats = ref_update(cfg, it, before, dtypes, rewards)
        for got, w in zip(values(ts), want):
            assert_bitwise(got, w)
        assert tuple(stats) == ref_stats
        assert tr.iteration == it + 1
        rewards = rewards[::-1]


@pytest.mark.parametrize("noise_scheme", ["iid", "correlated"])
def test_update_alpha_default_and_correlated_slots(ctx, noise_scheme):
    """alpha None -> sigma/2; correlated noise gives same-length slots identical deltas."""
    a = ctx.tensor(np.zeros(50, f32), ("a",))
    b = ctx.tensor(np.zeros(50, f32), ("b",))
    cfg = es.EsConfig(sigma=0.2, population=3, noise=noise_scheme, reward_norm="none", seed=1)
    tr = es.Trainer(cfg)
    tr.add_param(a)
    tr.add_param(b)
    tr.update([1.0, -2.0, 0.5])
    want, _ = ref_update(cfg, 0, [np.zeros(50, f32)] * 2, ("f32", "f32"), [1.0, -2.0, 0.5])
    assert_bitwise(a.numpy(), want[0])
    assert_bitwise(b.numpy(), want[1])
    assert (noise_scheme == "correlated") == np.array_equal(a.numpy(), b.numpy())
    assert tr.alpha_value() == float(f32(0.2) / f32(2))


@pytest.mark.parametrize("decay,lam", [("l2", 10.0), ("l1", 0.01), ("l1", 50.0)])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_anchored_weight_decay(ctx, decay, lam, dtypes):
    ts, vals = make_params(ctx, dtypes, seed=8)
    cfg = es.EsConfig(sigma=0.05, alpha=5e-3, population=4, anchor_decay=decay, anchor_lambda=lam,
                      seed=3)
    tr = es.Trainer(cfg)
    for t in ts:
        tr.add_param(t)
    tr.capture_anchor()
    rewards = [1.0, 0.0, -1.0, 2.0]
    for it in range(3):
        before = values(ts)
        tr.update(rewards)
        want, _ = ref_update(cfg, it, before, dtypes, rewards, anchors=vals)
        for got, w in zip(values(ts), want):
            assert_bitwise(got, w)
    if decay == "l1" and lam == 50.0:  # the soft threshold exceeds every step: exact zeroing of θ − θ₀
        for got, v in zip(values(ts), vals):
            assert_bitwise(got, v)


def test_anchor_is_the_capture_not_the_current_values(ctx1):
    t = ctx1.tensor(np.ones(10, f32), ("a",))
    tr = es.Trainer(sigma=0.1, alpha=0.01, population=2, anchor_decay="l2", anchor_lambda=1.0, seed=4)
    tr.add_param(t)
    tr.capture_anchor()
    t.data()[:] = 3.0  # e.g. a resumed checkpoint's values
    tr.update([1.0, 0.0])
    got = t.numpy()
    want, _ = ref_update(tr.config, 0, [np.full(10, 3.0, f32)], ("f32",), [1.0, 0.0],
                         anchors=[np.ones(10, f32)])
    assert_bitwise(got, want[0])
    assert (got < 3.0).all()


def test_z_score_self_stops_centered_ranks_step(ctx1):
    t = ctx1.tensor(np.linspace(-1, 1, 40).astype(f32), ("a",))
    v0 = t.numpy()
    tr = es.Trainer(sigma=0.1, population=4, seed=6)
    tr.add_param(t)
    tr.update([2.0] * 4)
    assert_bitwise(t.numpy(), v0)
    tr2 = es.Trainer(sigma=0.1, population=4, reward_norm="centered_ranks", seed=6)
    tr2.add_param(t)
    tr2.update([2.0] * 4)
    assert not np.array_equal(t.numpy(), v0)


def test_update_climbs_a_quadratic(ctx1):
    """Sign and scale: ES on reward −|θ − target|² gets closer to the target."""
    target = np.linspace(-0.5, 0.5, 20).astype(f32)
    t = ctx1.tensor(np.zeros(20, f32), ("a",))
    tr = es.Trainer(sigma=0.05, alpha=0.02, population=16, antithetic=True, seed=12)
    tr.add_param(t)
    start = float(((t.numpy() - target) ** 2).sum())
    for _ in range(60):
        tr.step(lambda m: -float(((t.numpy() - target) ** 2).sum()))
    assert float(((t.numpy() - target) ** 2).sum()) < 0.5 * start


# ---------------------------------------------------------------------------------------------
# determinism: threads, chunk grids, workers, the stream cache


def run_training(ctx, dtypes, iterations=3, workers=None, **kw):
    sizes = (40000, 5000, 33)
    ts, _ = make_params(ctx, dtypes, sizes=sizes, seed=21)
    tr = trainer(ts, sigma=0.02, population=6, seed=77, **kw)
    for _ in range(iterations):
        if workers is None:
            tr.step(lambda m: float(ts[0].numpy()[m]) + m * 0.1)
        else:
            rewards = [0.0] * 6
            ev = ReplicaEval(tr, ts, workers)
            tr.evaluate_members(ev, rewards, workers)
            ev.close()
            tr.update(rewards)
    return [t.data_const().copy() for t in ts]


class ReplicaEval:
    """Each worker owns a replica in its own ExecContext; reward = a function of the replica."""

    def __init__(self, tr, ts, workers):
        self.tr = tr
        self.ctxs = [fu.ExecContext(threads=1) for _ in range(workers)]
        self.replicas = [[c.zeros(t.shape, ("r",), t.dtype) for t in ts] for c in self.ctxs]
        self.seen = set()
        self.lock = threading.Lock()

    def eval_member(self, worker, member):
        with self.lock:
            self.seen.add(member)
        rep = self.replicas[worker]
        self.tr.materialize_member(member, rep)
        return float(rep[0].numpy()[:100].astype(np.float64).sum())

    def close(self):
        self.replicas = None
        for c in self.ctxs:
            c.close()


@pytest.mark.parametrize("dtypes", [("f32", "f32", "f32"), ("bf16", "f16", "f32")])
def test_same_bits_at_any_thread_count(dtypes):
    results = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            results.append(run_training(c, dtypes))
            results.append(run_training(c, dtypes, restore_mode="snapshot", cache_streams=True))
    for a, b in zip(results[0], results[2]):
        assert np.array_equal(a, b)
    for a, b in zip(results[1], results[3]):
        assert np.array_equal(a, b)


def test_chunk_grid_does_not_change_bits(monkeypatch, ctx2):
    dtypes = ("f32", "bf16", "f16")
    base = run_training(ctx2, dtypes)
    monkeypatch.setattr(xes, "PERTURB_CHUNK", 64 * 3)
    monkeypatch.setattr(xes, "UPDATE_CHUNK", 64)
    for a, b in zip(base, run_training(ctx2, dtypes)):
        assert np.array_equal(a, b)


def test_materialize_grid_and_threads_do_not_change_bits(monkeypatch):
    def fill(threads):
        with fu.ExecContext(threads=threads) as c:
            ts, _ = make_params(c, ("f32", "bf16"), sizes=(40000, 3000), seed=2)
            tr = trainer(ts, sigma=0.1, population=8, seed=5)
            stacks = [c.zeros((3, t.numel), ("g", "e"), t.dtype) for t in ts]
            single = [c.zeros((t.numel,), ("e",), t.dtype) for t in ts]
            tr.materialize_members([1, 6, 2], stacks)
            tr.materialize_member(6, single)
            out = [x.data_const().copy() for x in stacks + single]
            tr.close()
            del ts, stacks, single
        return out

    base = fill(1)
    assert np.array_equal(base[0][1], base[2]) and np.array_equal(base[1][1], base[3])
    monkeypatch.setattr(xes, "PERTURB_CHUNK", 64 * 5)
    for got in (fill(1), fill(2)):
        for a, b in zip(base, got):
            assert np.array_equal(a, b)


def test_cache_streams_is_bitwise_neutral(ctx2):
    dtypes = ("f32", "f16", "bf16")
    plain = run_training(ctx2, dtypes, antithetic=True)
    cached = run_training(ctx2, dtypes, antithetic=True, cache_streams=True)
    for a, b in zip(plain, cached):
        assert np.array_equal(a, b)


def test_evaluate_members_same_bits_for_any_worker_count(ctx2):
    dtypes = ("f32", "bf16", "f32")
    out = [run_training(ctx2, dtypes, iterations=2, workers=w) for w in (1, 3)]
    for a, b in zip(*out):
        assert np.array_equal(a, b)


def test_evaluate_members_fills_by_member_and_stops_on_error(ctx1):
    t = ctx1.tensor(np.zeros(8, f32), ("a",))
    tr = es.Trainer(sigma=0.1, population=20, seed=1)
    tr.add_param(t)
    rewards = [None] * 20
    assert tr.evaluate_members(lambda w, m: float(m) * 2, rewards, 4) is rewards
    assert rewards == [2.0 * m for m in range(20)]
    calls = []

    def bad(worker, member):
        calls.append(member)
        if member == 3:
            raise KeyError("member 3 failed")
        return 0.0

    with pytest.raises(KeyError, match="member 3"):
        tr.evaluate_members(bad, [0.0] * 20, 3)
    assert len(calls) < 20 + 3
    workers_seen = set()
    tr.evaluate_members(lambda w, m: workers_seen.add(w) or 0.0, [0.0] * 20, 200)
    assert workers_seen <= set(range(20))
    tr.close()


# ---------------------------------------------------------------------------------------------
# drivers, registration, tasks


def test_step_restores_on_evaluator_error(ctx1):
    t = ctx1.tensor(np.linspace(0, 1, 100).astype(f32), ("a",))
    before = t.data_const().copy()
    tr = es.Trainer(sigma=0.5, population=4, restore_mode="snapshot", seed=2)
    tr.add_param(t)

    def ev(member):
        if member == 2:
            raise RuntimeError("rollout crashed")
        return 1.0

    with pytest.raises(RuntimeError, match="rollout crashed"):
        tr.step(ev)
    assert tr.active_member is None and tr.iteration == 0
    assert np.array_equal(t.data_const(), before)


def test_step_equals_manual_loop(ctx1):
    def run(manual):
        t = ctx1.tensor(np.linspace(-1, 1, 300).astype(f32), ("a",))
        tr = es.Trainer(sigma=0.1, population=5, seed=8)
        tr.add_param(t)
        ev = lambda m: float(t.numpy()[m * 7])  # noqa: E731
        for _ in range(3):
            if manual:
                rewards = []
                for m in range(5):
                    tr.perturb(m)
                    rewards.append(ev(m))
                    tr.restore(m)
                tr.update(rewards)
            else:
                tr.step(ev)
        return t.numpy()
    assert_bitwise(run(True), run(False))


def test_add_registry_registers_every_entry_once(ctx1):
    w = ctx1.variable(np.ones((3, 4), f32), ("o", "i"))
    frozen = ctx1.tensor(np.ones(5, f32), ("f",), "bf16")
    reg = ParamRegistry()
    reg.add_param("w", w)
    reg.add_param("frozen", frozen)
    reg.add_param("tied", w)  # a second name for the same storage
    tr = es.Trainer(sigma=0.1, population=2)
    assert tr.add_registry(reg) == 2
    assert tr.names() == ["w", "frozen"]
    assert tr.element_count() == 17
    assert tr.add_registry(reg) == 0
    with pytest.raises(fu.DuplicateParam):
        tr.add_param(w)


def test_member_seed_and_task(ctx1):
    t = ctx1.tensor(np.zeros(4, f32), ("a",))
    tr = es.Trainer(sigma=0.1, population=10, seed=123)
    tr.add_param(t)
    tr.iteration = 7
    assert tr.member_seed(3) == at(123 ^ SEED_DOMAIN, 73)
    task = tr.member_task(3)
    assert task == es.MemberTask(123, 7, 3)
    rep = ctx1.zeros((4,), ("a",))
    tr.materialize_task(task, [rep])
    want = ref_perturb(tr.config, 7, [np.zeros(4, f32)], ("f32",), 3)
    assert_bitwise(rep.numpy(), want[0])
    with pytest.raises(fu.InvalidConfig, match="iteration"):
        tr.materialize_task(es.MemberTask(123, 6, 3), [rep])


# ---------------------------------------------------------------------------------------------
# errors (SPEC T-25)


@pytest.mark.parametrize("kw", [
    dict(sigma=0.0), dict(sigma=-1.0), dict(sigma=float("nan")), dict(sigma=float("inf")),
    dict(sigma=1e-50), dict(alpha=0.0), dict(alpha=float("inf")), dict(population=1),
    dict(population=5, antithetic=True), dict(ternary_flip_rate=0.0), dict(ternary_flip_rate=1.5),
    dict(ternary_update_fraction=0.0), dict(ternary_update_fraction=2.0),
    dict(ternary_update_decay=-1.0), dict(ternary_update_decay=float("inf")),
    dict(anchor_decay="l2", anchor_lambda=0.0), dict(anchor_decay="l1", anchor_lambda=float("nan")),
    dict(anchor_decay="l2", anchor_lambda=10.0, alpha=0.1), dict(noise="gaussian"),
    dict(restore_mode="memcpy"), dict(anchor_decay="l3"), dict(reward_norm="rank"),
    dict(seed=-1), dict(seed=1 << 64), dict(population=4.0), dict(antithetic=1)])
def test_invalid_config(kw):
    with pytest.raises(fu.InvalidConfig):
        es.Trainer(**kw)


def test_valid_edge_configs():
    es.Trainer(anchor_decay="l2", anchor_lambda=9.9, alpha=0.1)
    es.Trainer(ternary_flip_rate=1.0, ternary_update_fraction=1.0, population=2, antithetic=True)
    with pytest.raises(TypeError):
        es.Trainer(sigmaa=0.1)
    with pytest.raises(TypeError):
        es.Trainer(es.EsConfig(), sigma=0.1)


def test_registration_errors(ctx1):
    tr = es.Trainer(sigma=0.1, population=2)
    with pytest.raises(fu.DTypeError):
        tr.add_param(ctx1.tensor(np.arange(4), ("a",), "i64"))
    m = ctx1.tensor(np.zeros((3, 4), f32), ("r", "c"))
    with pytest.raises(fu.NonContiguousParam):
        tr.add_param(m.permute(("c", "r")))
    with pytest.raises(TypeError):
        tr.add_param(np.zeros(3, f32))
    t = ctx1.tensor(np.zeros(4, f32), ("a",))
    tr.add_param(t)
    with pytest.raises(fu.DuplicateParam):
        tr.add_param(t)
    reg = ParamRegistry()
    reg.add_param("ids", ctx1.tensor(np.arange(4), ("a",), "i64"))
    with pytest.raises(fu.UnsupportedDType):
        tr.add_registry(reg)
    assert tr.param_count() == 1


def test_member_errors(ctx1):
    t = ctx1.tensor(np.zeros(64, f32), ("a",))
    empty = es.Trainer(sigma=0.1, population=2)
    with pytest.raises(fu.NoParams):
        empty.perturb(0)
    with pytest.raises(fu.NoParams):
        empty.update([1.0, 2.0])
    with pytest.raises(fu.NoParams):
        empty.capture_anchor()
    tr = es.Trainer(sigma=0.1, population=4)
    tr.add_param(t)
    with pytest.raises(fu.MemberNotActive):
        tr.restore(0)
    with pytest.raises(fu.IndexOutOfBounds):
        tr.perturb(4)
    tr.perturb(1)
    for call in (lambda: tr.perturb(2), lambda: tr.update([0.0] * 4),
                 lambda: tr.add_param(ctx1.zeros((3,), ("b",))), tr.capture_anchor,
                 lambda: tr.materialize_member(0, [ctx1.zeros((64,), ("a",))]),
                 lambda: tr.evaluate_members(lambda w, m: 0.0, [0.0] * 4, 1)):
        with pytest.raises(fu.MemberActive):
            call()
    with pytest.raises(fu.MemberNotActive):
        tr.restore(2)
    tr.restore(1)
    assert tr.active_member is None


def test_update_errors_change_nothing(ctx1):
    t = ctx1.tensor(np.linspace(0, 1, 64).astype(f32), ("a",))
    before = t.data_const().copy()
    tr = es.Trainer(sigma=0.1, alpha=0.01, population=4, anchor_decay="l1", anchor_lambda=0.1)
    tr.add_param(t)
    with pytest.raises(fu.RewardCountMismatch):
        tr.update([1.0, 2.0, 3.0])
    with pytest.raises(fu.AnchorMissing):
        tr.update([1.0, 2.0, 3.0, 4.0])
    assert tr.iteration == 0 and np.array_equal(t.data_const(), before)
    tr.capture_anchor()
    tr.add_param(ctx1.tensor(np.zeros(3, f32), ("b",)))  # a new slot drops the stale anchor
    with pytest.raises(fu.AnchorMissing):
        tr.update([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(fu.RewardCountMismatch):
        tr.evaluate_members(lambda w, m: 0.0, [0.0] * 3, 2)
    with pytest.raises(fu.InvalidConfig):
        tr.evaluate_members(lambda w, m: 0.0, [0.0] * 4, 0)


def test_replica_errors(ctx1):
    a = ctx1.tensor(np.zeros(10, f32), ("a",))
    b = ctx1.tensor(np.zeros(6, f32), ("b",), "f16")
    tr = es.Trainer(sigma=0.1, population=2)
    tr.add_param(a)
    tr.add_param(b)
    with pytest.raises(fu.ReplicaShapeMismatch):
        tr.materialize_member(0, [ctx1.zeros((10,), ("a",))])
    with pytest.raises(fu.ReplicaShapeMismatch):
        tr.materialize_member(0, [ctx1.zeros((10,), ("a",)), ctx1.zeros((7,), ("b",), "f16")])
    with pytest.raises(fu.DTypeError):
        tr.materialize_member(0, [ctx1.zeros((10,), ("a",)), ctx1.zeros((3,), ("b",))])
    with pytest.raises(fu.NonContiguousParam):
        m = ctx1.zeros((2, 5), ("r", "c"))
        tr.materialize_member(0, [m.permute(("c", "r")), ctx1.zeros((6,), ("b",), "f16")])


def test_closed_context():
    c = fu.ExecContext(threads=1)
    tr = es.Trainer(sigma=0.1, population=2)
    tr.add_param(c.tensor(np.zeros(8, f32), ("a",)))
    tr.close()  # drops the slot: the context closes clean
    c.close()
    c2 = fu.ExecContext(threads=1)
    tr2 = es.Trainer(sigma=0.1, population=2)
    tr2.add_param(c2.tensor(np.zeros(8, f32), ("a",)))
    with pytest.warns(ResourceWarning, match="leaked 1"):  # the trainer still holds its slot
        c2.close()
    for call in (lambda: tr2.perturb(0), lambda: tr2.update([1.0, 2.0]), tr2.capture_anchor):
        with pytest.raises(fu.ContextClosed):
            call()


# ---------------------------------------------------------------------------------------------
# blocks of replicas


@pytest.mark.parametrize("antithetic", [False, True])
def test_materialize_members_fills_stacked_replicas(ctx, antithetic):
    dtypes = ("f32", "bf16", "f16", "f32")
    ts, vals = make_params(ctx, dtypes, seed=4)
    tr = trainer(ts, sigma=0.03, population=10, antithetic=antithetic, seed=31)
    tr.iteration = 2
    members = [7, 0, 3, 3, 9]
    stacks = [ctx.zeros((len(members), t.numel), ("g", "e"), t.dtype) for t in ts]
    tr.materialize_members(members, stacks)
    for g, m in enumerate(members):
        want = ref_perturb(tr.config, 2, vals, dtypes, m)
        for got, w in zip(values(stacks), want):
            assert_bitwise(got[g], w)
    for got, v in zip(values(ts), vals):
        assert_bitwise(got, v)
    with pytest.raises(fu.ReplicaShapeMismatch):
        tr.materialize_members(members[:4], stacks)
    with pytest.raises(fu.IndexOutOfBounds):
        tr.materialize_members([], stacks)
    with pytest.raises(fu.IndexOutOfBounds):
        tr.materialize_members([10], [ctx.zeros((t.numel,), ("e",), t.dtype) for t in ts])
    tr.close()


class BlockEval:
    """One stack of `block` replicas shared by every worker (serialised by a lock)."""

    def __init__(self, ts, tr, block):
        self.tr, self.block = tr, block
        self.ctx = fu.ExecContext(threads=1)
        self.stacks = [self.ctx.zeros((block, t.numel), ("g", "e"), t.dtype) for t in ts]
        self.lock = threading.Lock()

    def eval_members(self, worker, members):
        with self.lock:
            dst = [s.narrow("g", 0, len(members)) for s in self.stacks]
            self.tr.materialize_members(members, dst)
            first = dst[0].numpy()[:, :50].astype(np.float64)
            return [float(first[g].sum()) for g in range(len(members))]

    def close(self):
        self.stacks = None
        self.ctx.close()


def test_evaluate_members_in_blocks(ctx1):
    ts, _ = make_params(ctx1, ("f32", "f16"), sizes=(300, 20), seed=9)
    tr = trainer(ts, sigma=0.1, population=11, seed=3)
    ev = BlockEval(ts, tr, 4)
    single = [0.0] * 11
    tr.evaluate_members(lambda w, m: ev.eval_members(w, [m])[0], single, 3)
    for workers in (1, 3):
        blocked = [0.0] * 11
        tr.evaluate_members(ev, blocked, workers, block=4)
        assert blocked == single
    with pytest.raises(fu.RewardCountMismatch):
        tr.evaluate_members(lambda w, ms: [0.0], [0.0] * 11, 2, block=4)
    with pytest.raises(fu.InvalidConfig):
        tr.evaluate_members(ev, [0.0] * 11, 2, block=0)
    ev.close()
    tr.close()


# ---------------------------------------------------------------------------------------------
# checkpoints (T-28)


def es_model(ctx, seed):
    rng = np.random.default_rng(seed)
    ts = [ctx.tensor(rng.standard_normal(n).astype(f32), (f"a{i}",), dt)
          for i, (n, dt) in enumerate(((500, "f32"), (40, "bf16"), (7, "f16")))]
    reg = ParamRegistry()
    for i, t in enumerate(ts):
        reg.add_param(f"p{i}", t)
    return ts, reg


def reward_of(ts):
    return lambda m: float(ts[0].numpy()[m * 3:m * 3 + 40].astype(np.float64).sum())


CKPT_CFG = dict(sigma=0.05, alpha=0.02, population=6, antithetic=True, noise="correlated",
                anchor_decay="l2", anchor_lambda=3.0, seed=2718)


def test_resume_is_bit_exact(ctx1, tmp_path):
    ts, reg = es_model(ctx1, 0)
    tr = es.Trainer(**CKPT_CFG)
    tr.add_registry(reg)
    tr.capture_anchor()
    for _ in range(3):
        tr.step(reward_of(ts))
    tr.save_checkpoint(tmp_path / "ck", reg, data_seed=5)
    for _ in range(4):
        tr.step(reward_of(ts))
    straight = [t.data_const().copy() for t in ts]

    # a fresh model (other init) and a trainer with other contract settings: the checkpoint wins
    ts2, reg2 = es_model(ctx1, 1)
    initial, _ = es_model(ctx1, 0)
    for t, a in zip(ts2, initial):  # the anchor is the run's initial model, captured first
        t.data()[:] = a.data_const()
    tr2 = es.Trainer(sigma=0.5, population=4, seed=1, anchor_decay="l2", anchor_lambda=3.0)
    tr2.add_registry(reg2)
    tr2.capture_anchor()
    state = tr2.load_checkpoint(tmp_path / "ck", reg2)
    assert state.es_iteration == 3 and state.step == 3 and state.data_seed == 5
    assert tr2.iteration == 3 and tr2.config.population == 6 and tr2.config.seed == 2718
    assert tr2.config.noise == "correlated" and tr2.config.antithetic
    for _ in range(4):
        tr2.step(reward_of(ts2))
    for a, t in zip(straight, ts2):
        assert np.array_equal(a, t.data_const())


def test_checkpoint_files_and_fields(ctx1, tmp_path):
    ts, reg = es_model(ctx1, 0)
    tr = es.Trainer(sigma=0.1, population=4, seed=77, ternary_flip_rate=0.25)
    tr.add_registry(reg)
    tr.update([1.0, 2.0, 3.0, 4.0])
    tr.save_checkpoint(tmp_path, reg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checksums.json", "model.safetensors",
                                                          "trainer_state.json"]
    state = fu.io.load_trainer_state(tmp_path)
    assert (state.seed, state.es_iteration, state.es_population, state.es_noise,
            state.es_antithetic, state.es_anchor_decay) == (77, 1, 4, 0, 0, 0)
    assert state.es_sigma == float(f32(0.1)) and state.es_alpha == float(f32(0.1) / f32(2))
    assert state.es_ternary_flip_rate == float(f32(0.25))
    tr.save_checkpoint(tmp_path / "lora", reg, adapters=True, step=9)
    assert (tmp_path / "lora" / "adapters.safetensors").exists()
    assert fu.io.load_trainer_state(tmp_path / "lora").step == 9


def test_checkpoint_load_errors_change_nothing(ctx1, tmp_path):
    ts, reg = es_model(ctx1, 0)
    tr = es.Trainer(sigma=0.1, population=4, seed=3)
    tr.add_registry(reg)
    with pytest.raises(fu.InvalidTrainerState):
        tr.load_checkpoint(tmp_path / "none", reg)
    fu.io.save_trainer_state(tmp_path / "plain", fu.io.TrainerState(step=5, seed=1))
    with pytest.raises(fu.CheckpointConfigMismatch):
        tr.load_checkpoint(tmp_path / "plain", reg)
    bad = tr.trainer_state()
    bad.es_noise = 7
    fu.io.save_trainer_state(tmp_path / "bad", bad)
    with pytest.raises(fu.CheckpointConfigMismatch):
        tr.load_checkpoint(tmp_path / "bad", reg)
    odd = tr.trainer_state()
    odd.es_population, odd.es_antithetic = 5, 1
    fu.io.save_trainer_state(tmp_path / "odd", odd)
    with pytest.raises(fu.InvalidConfig):
        tr.load_checkpoint(tmp_path / "odd", reg)
    tr.save_checkpoint(tmp_path / "good", reg)
    other, reg_other = es_model(ctx1, 1)
    reg_other.add_param("extra", ctx1.tensor(np.zeros(3, f32), ("x",)))
    before = [t.data_const().copy() for t in other]
    tr2 = es.Trainer(sigma=0.3, population=2)
    with pytest.raises(fu.CheckpointMissingEntry):
        tr2.load_checkpoint(tmp_path / "good", reg_other)
    assert tr2.iteration == 0 and tr2.config.population == 2
    for a, t in zip(before, other):
        assert np.array_equal(a, t.data_const())
    tr.close()
