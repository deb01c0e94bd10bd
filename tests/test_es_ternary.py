"""Ternary-native ES (SPEC T-27, T-28) against a numpy/float64 transcription of the spec.

The oracle below is written from SPEC T-27 alone (and T-25's reward shaping, RNG-2's `at`):
crumb addresses by the spec's formula, flips with Python ints, votes as float32 sums in
stream-then-flip order, the (|vote| desc, index asc) order by Python's sort, the counts with
exact rational rounding. Genome codes are integers: every comparison is exact.
"""
import gc
import math
from fractions import Fraction

import numpy as np
import pytest

import fucina as fu
import fucina.es as es
import fucina.es_ternary as et
from fucina.exec import es_ternary as xt
from fucina.io import ParamRegistry

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
TRITS = 0x65735F7472697473
f32 = np.float32

# ---------------------------------------------------------------------------------------------
# oracle


def at(seed, i):
    z = (seed + ((i + 1) * GAMMA & MASK)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def addr(e):
    """SPEC T-27's crumb address: (block, byte, shift)."""
    block, r = e // 256, e % 256
    return block, (r // 128) * 32 + (r % 128) % 32, 2 * ((r % 128) // 32)


def read_codes(blocks: np.ndarray) -> np.ndarray:
    """blocks: uint8 [n_blocks, 66] -> codes [n_blocks·256]."""
    e = np.arange(blocks.shape[0] * 256)
    block, byte, shift = addr(e)
    return (blocks[block, byte] >> shift) & 3


def write_codes(codes: np.ndarray, scales) -> np.ndarray:
    """uint8 [n_blocks, 66]: the codes at their crumbs, scale d (f16) per block."""
    n = len(codes) // 256
    out = np.zeros((n, 66), np.uint8)
    e = np.arange(len(codes))
    block, byte, shift = addr(e)
    np.bitwise_or.at(out, (block, byte), (np.asarray(codes, np.uint8) << shift).astype(np.uint8))
    out[:, 64:66] = np.asarray(scales, np.float16).reshape(n, 1).view(np.uint8)
    return out


def rnd(x: Fraction) -> int:
    """Round half away from zero (x >= 0), exactly."""
    f = math.floor(x)
    return f + (1 if x - f >= Fraction(1, 2) else 0)


def flips_per_member(cfg, length):
    return max(1, rnd(Fraction(float(f32(cfg.ternary_flip_rate))) * length))


def move_cap(cfg, iteration, length):
    decay = float(f32(cfg.ternary_update_decay))
    eff = float(f32(cfg.ternary_update_fraction)) / (1.0 + decay * iteration)
    return max(1, rnd(Fraction(eff) * length))


def move(code, delta):
    return min(max(code - 1 + delta, -1), 1) + 1


def t_member_seed(cfg, iteration, n):
    return at(cfg.seed ^ TRITS, (iteration * cfg.population + n) & MASK)


def flip_list(stream, count, length, mirror=False):
    out = []
    for i in range(count):
        delta = 1 if at(stream, 2 * i + 1) & 1 else -1
        out.append((at(stream, 2 * i) % length, -delta if mirror else delta))
    return out


def ref_perturb(cfg, iteration, genomes, member):
    """Each genome's codes after member's flips (SPEC T-27 perturb)."""
    anti = cfg.antithetic
    ms = t_member_seed(cfg, iteration, member & ~1 if anti else member)
    out = []
    for k, codes in enumerate(genomes):
        codes = codes.copy()
        n = len(codes)
        mirror = anti and member % 2 == 1
        for e, d in flip_list(at(ms ^ TRITS, k), flips_per_member(cfg, n), n, mirror):
            codes[e] = move(codes[e], d)
        out.append(codes)
    return out


def shaped(cfg, rewards):
    """SPEC T-25 step 2-3: f32 coefficients, folded under antithetic sampling."""
    r = np.asarray(rewards, f32)
    n = len(r)
    mean = sum(float(v) for v in r) / n
    std = math.sqrt(sum((float(v) - mean) ** 2 for v in r) / n)
    if cfg.reward_norm == "z_score":
        c = np.array([(float(v) - mean) / (std + 1e-8) for v in r], f32)
    elif cfg.reward_norm == "centered_ranks":
        c = np.empty(n, f32)
        for rank, m in enumerate(sorted(range(n), key=lambda m: (float(r[m]), m))):
            c[m] = f32(rank) / f32(n - 1) - f32(0.5)
    else:
        c = r.copy()
    return c[0::2] - c[1::2] if cfg.antithetic else c


def ref_votes(cfg, iteration, k, length, coeffs):
    """[(index, vote)] nonzero, in (|vote| desc, index asc) order."""
    votes = {}
    count = flips_per_member(cfg, length)
    for s, c in enumerate(coeffs):
        ms = t_member_seed(cfg, iteration, 2 * s if cfg.antithetic else s)
        for e, d in flip_list(at(ms ^ TRITS, k), count, length):
            votes[e] = f32(votes.get(e, f32(0)) + f32(c * f32(d)))
    entries = [(e, v) for e, v in votes.items() if v != 0]
    return sorted(entries, key=lambda ev: (-abs(float(ev[1])), ev[0]))


def ref_update(cfg, iteration, genomes, rewards):
    """(codes after the vote-and-threshold update, [(nonzero votes, moves)]) per genome."""
    coeffs = shaped(cfg, rewards)
    out, counts = [], []
    for k, codes in enumerate(genomes):
        codes = codes.copy()
        entries = ref_votes(cfg, iteration, k, len(codes), coeffs)
        K = min(len(entries), move_cap(cfg, iteration, len(codes)))
        for e, v in entries[:K]:
            codes[e] = move(codes[e], 1 if v > 0 else -1)
        out.append(codes)
        counts.append((len(entries), K))
    return out, counts


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def ctx(request):
    c = fu.ExecContext(threads=request.param)
    yield c
    gc.collect()  # a caught error's traceback keeps the test frame, hence its tensors, alive
    c.close()


@pytest.fixture
def ctx1():
    c = fu.ExecContext(threads=1)
    yield c
    gc.collect()
    c.close()


def genome(ctx, codes, shape=None, seed=0):
    """A tq2_0 tensor holding `codes` (random f16 scales)."""
    codes = np.asarray(codes)
    shape = shape or (len(codes) // 256, 256)
    scales = np.random.default_rng(seed).uniform(0.5, 2.0, len(codes) // 256)
    t = ctx.zeros(shape, tuple(f"a{i}" for i in range(len(shape)))).to("tq2_0")
    t.data()[...] = write_codes(codes, scales).reshape(t.data().shape)
    return t


def codes_of(t):
    return read_codes(np.ascontiguousarray(t.data_const()).reshape(-1, 66))


def random_codes(n, seed):
    return np.random.default_rng(seed).integers(0, 3, n)


def trainer(genomes, **kw):
    tr = es.Trainer(**{"sigma": 0.1, "population": 6, "seed": 11, **kw})
    for k, g in enumerate(genomes):
        tr.add_ternary_param(g, f"g{k}")
    return tr


CONFIGS = [dict(), dict(antithetic=True), dict(ternary_flip_rate=0.2),
           dict(antithetic=True, ternary_flip_rate=1.0, population=4)]


# ---------------------------------------------------------------------------------------------
# layout, counts


def test_oracle_layout_is_the_tq2_0_decoder(ctx1):
    """SPEC T-27's crumb address agrees with the ggml tq2_0 decoder: weight = (code − 1)·d."""
    codes = random_codes(3 * 256, 1)
    t = genome(ctx1, codes, seed=4)
    d = np.ascontiguousarray(t.data_const()).reshape(-1, 66)[:, 64:66].copy().view(np.float16)
    want = (codes.reshape(3, 256) - 1).astype(f32) * d.astype(f32)
    np.testing.assert_array_equal(t.to("f32").numpy().reshape(3, 256), want)
    np.testing.assert_array_equal(codes_of(t), codes)


def test_counts_round_half_away_and_decay():
    assert et.round_half_away(2.5) == 3 and et.round_half_away(3.5) == 4
    assert et.round_half_away(2.4999999999999996) == 2 and et.round_half_away(0.0) == 0
    assert et.flip_count(0.001, 256) == 1          # max(1, round(0.256))
    assert et.flip_count(2.5 / 1024, 1024) == 3    # exactly 2.5 -> 3 (round() would give 2)
    for rate, n in [(0.001, 1 << 20), (0.3, 768), (1.0, 256), (1e-9, 256), (0.0123, 4096)]:
        cfg = es.EsConfig(ternary_flip_rate=rate)
        assert et.flip_count(rate, n) == flips_per_member(cfg, n)
    for frac, decay, it in [(0.005, 0.0, 0), (0.005, 0.5, 7), (1.0, 0.0, 3), (0.01, 0.01, 1000)]:
        cfg = es.EsConfig(ternary_update_fraction=frac, ternary_update_decay=decay)
        assert et.update_count(frac, decay, it, 65536) == move_cap(cfg, it, 65536)
    assert et.update_count(0.005, 1.0, 10**9, 256) == 1      # decayed to nothing: still one move


def test_seeds_are_the_contract(ctx1):
    tr = trainer([genome(ctx1, random_codes(256, 0))], population=5, seed=2**64 - 3)
    tr.iteration = 2**62
    cfg = tr.config
    for n in range(5):
        ms = tr.ternary_member_seed(n)
        assert ms == t_member_seed(cfg, 2**62, n)
        assert tr.ternary_slot_stream_seed(ms, 3) == at(ms ^ TRITS, 3)
    assert es.TRITS_DOMAIN == TRITS == et.TRITS_DOMAIN
    assert tr.ternary_flip_count(256) == 1 and tr.ternary_update_count(256) == 1
    tr.close()


# ---------------------------------------------------------------------------------------------
# perturb / restore / materialize


@pytest.mark.parametrize("kw", CONFIGS)
def test_perturb_and_restore(ctx, kw):
    codes = [random_codes(n, 10 + n) for n in (256, 2048)]
    gs = [genome(ctx, c, seed=i) for i, c in enumerate(codes)]
    tr = trainer(gs, **kw)
    tr.iteration = 3
    cfg = tr.config
    blocks = [g.data_const().copy() for g in gs]
    for member in range(cfg.population):
        tr.perturb(member)
        for g, want in zip(gs, ref_perturb(cfg, 3, codes, member)):
            np.testing.assert_array_equal(codes_of(g), want)
        tr.restore(member)
        for g, b in zip(gs, blocks):  # bitwise: scales, collisions and clamped moves included
            np.testing.assert_array_equal(g.data_const(), b)
    tr.close()


def test_collisions_and_clamps_unwind_in_reverse(ctx1):
    """Every element on a rail and 4 flips per element: many no-op and colliding moves."""
    codes = np.where(np.arange(512) % 2, 2, 0)
    g = genome(ctx1, codes)
    tr = trainer([g], ternary_flip_rate=1.0, population=2)
    before = g.data_const().copy()
    cfg = tr.config
    for member in (0, 1):
        tr.perturb(member)
        np.testing.assert_array_equal(codes_of(g), ref_perturb(cfg, 0, [codes], member)[0])
        assert not np.array_equal(codes_of(g), codes)
        tr.restore(member)
        np.testing.assert_array_equal(g.data_const(), before)


@pytest.mark.parametrize("antithetic", [False, True])
def test_materialize_equals_perturb(ctx, antithetic):
    codes = [random_codes(n, n) for n in (512, 256)]
    gs = [genome(ctx, c) for c in codes]
    tr = trainer(gs, antithetic=antithetic, ternary_flip_rate=0.05)
    with fu.ExecContext(threads=1) as wctx:
        single = [wctx.zeros(g.shape, g.tags).to("tq2_0") for g in gs]
        stacks = [wctx.zeros((3,) + g.shape, ("m",) + g.tags).to("tq2_0") for g in gs]
        members = [5, 0, 3]
        tr.materialize_ternary_members(members, stacks)
        for member in range(tr.config.population):
            tr.materialize_ternary_member(member, single)
            tr.perturb(member)
            for g, r in zip(gs, single):
                np.testing.assert_array_equal(r.data_const(), g.data_const())
            for g, st in zip(gs, stacks):
                if member in members:
                    rep = st.data_const().reshape(3, -1)[members.index(member)]
                    np.testing.assert_array_equal(rep, g.data_const().reshape(-1))
            tr.restore(member)
        del single, stacks
    tr.close()


# ---------------------------------------------------------------------------------------------
# the update


@pytest.mark.parametrize("norm", ["z_score", "centered_ranks", "none"])
@pytest.mark.parametrize("kw", CONFIGS + [dict(ternary_update_fraction=0.3,
                                               ternary_update_decay=0.25)])
def test_update_matches_reference(ctx, norm, kw):
    codes = [random_codes(n, 3 * n) for n in (768, 256)]
    gs = [genome(ctx, c) for c in codes]
    tr = trainer(gs, reward_norm=norm, **{"ternary_update_fraction": 0.05, **kw})
    cfg = tr.config
    rng = np.random.default_rng(5)
    for it in range(3):
        rewards = rng.standard_normal(cfg.population).astype(f32)
        rewards[1] = rewards[-1]  # a tie for the rank shaping
        codes, counts = ref_update(cfg, it, codes, rewards)
        tr.update(rewards)
        assert tr.last_ternary_update == counts
        for g, want in zip(gs, codes):
            np.testing.assert_array_equal(codes_of(g), want)
    assert tr.iteration == 3
    tr.close()


def test_update_ranks_ties_by_index_and_drops_cancelled_votes(ctx1):
    """Two members with opposite z-scores (±1): votes are ±1 sums, so ties are everywhere and
    colliding opposite flips cancel to zero; a cap of 1..len moves picks by index among ties."""
    codes = random_codes(256, 9)
    for frac in (1 / 256, 0.05, 1.0):
        g = genome(ctx1, codes)
        tr = trainer([g], population=2, ternary_flip_rate=1.0, ternary_update_fraction=frac)
        entries = ref_votes(tr.config, 0, 0, 256, shaped(tr.config, [1.0, 0.0]))
        raw_flips = flips_per_member(tr.config, 256) * 2
        assert len(entries) < raw_flips  # collisions and cancellations happened
        want, counts = ref_update(tr.config, 0, [codes], [1.0, 0.0])
        tr.update([1.0, 0.0])
        assert tr.last_ternary_update == counts
        np.testing.assert_array_equal(codes_of(g), want[0])
        tr.close()


def test_vote_kernel_selects_the_top_k(ctx1):
    """The radix select straight on crafted flip lists: heavy ties, duplicates, cancellations,
    every cap, index widths up to 40 bits (the key is an i128)."""
    rng = np.random.default_rng(17)
    n_el = 1024
    for trial in range(40):
        n = int(rng.integers(1, 600))
        idx = rng.integers(0, n_el if trial % 2 else 40, n).astype(np.int64)
        val = rng.choice(np.array([0.5, -0.5, 1.0, -1.0, 0.25, 3e-39, -3e-39], f32), n)
        codes = random_codes(n_el, trial)
        votes = {}
        for e, v in zip(idx, val):
            votes[int(e)] = f32(votes.get(int(e), f32(0)) + v)
        entries = sorted([(e, v) for e, v in votes.items() if v != 0],
                         key=lambda ev: (-abs(float(ev[1])), ev[0]))
        kcap = int(rng.integers(1, len(entries) + 3)) if entries else 1
        want = codes.copy()
        for e, v in entries[:kcap]:
            want[e] = move(want[e], 1 if v > 0 else -1)
        g = genome(ctx1, codes)
        raw = g._live("test")
        bi, bv = ctx1.from_numpy(idx, (n,), "i64"), ctx1.from_numpy(val, (n,), "f32")
        length = n_el if trial % 3 else 1 << int(rng.integers(11, 41))  # only widens the key
        got = xt.vote(ctx1, raw.addr, bi, bv, n, kcap, length, xt.vote_scratch(ctx1, n))
        assert got == (len(entries), min(len(entries), kcap))
        np.testing.assert_array_equal(codes_of(g), want)


def test_clamped_flips_still_vote(ctx1):
    """A genome at +1 everywhere: every +1 flip is a no-op at perturb, yet votes and moves
    follow the votes (negative votes move elements down)."""
    codes = np.full(512, 2)
    g = genome(ctx1, codes)
    tr = trainer([g], population=4, ternary_update_fraction=1.0, ternary_flip_rate=0.05)
    rewards = [3.0, -1.0, 0.5, 2.0]
    want, counts = ref_update(tr.config, 0, [codes], rewards)
    tr.update(rewards)
    assert counts[0][1] > 0 and tr.last_ternary_update == counts
    np.testing.assert_array_equal(codes_of(g), want[0])
    assert (want[0] == 1).any()


def test_float_slots_unaffected_by_ternary_slots(ctx):
    """The same float run with and without genomes: identical bits; and AWD skips genomes."""
    def run(with_genome, decay):
        p = ctx.tensor(np.linspace(-1, 1, 3000).astype(f32), ("a",))
        q = ctx.tensor(np.linspace(0, 2, 700).astype(f32), ("b",), "bf16")
        tr = es.Trainer(sigma=0.05, population=6, antithetic=True, seed=3,
                        anchor_decay=decay, anchor_lambda=0.5 if decay != "none" else 0.0)
        codes = random_codes(512, 1)
        g = genome(ctx, codes)
        if with_genome:
            tr.add_ternary_param(g)
        tr.add_param(p)
        tr.add_param(q)
        if decay != "none":
            tr.capture_anchor()
        gcodes = [codes]
        for it in range(3):
            rewards = np.cos(np.arange(6) + it).astype(f32)
            tr.perturb(it)
            tr.restore(it)
            if with_genome:
                gcodes, _ = ref_update(tr.config, it, gcodes, rewards)
            tr.update(rewards)
        if with_genome:
            np.testing.assert_array_equal(codes_of(g), gcodes[0])
        out = (p.data_const().copy(), q.data_const().copy())
        tr.close()
        return out

    for decay in ("none", "l2"):
        a, b = run(False, decay), run(True, decay)
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


def test_ternary_es_climbs(ctx1):
    """Reward = −(Hamming distance to a target genome): one flip per member, five moves per
    update, and ternary ES closes most of the gap its 150 moves could close."""
    target = random_codes(256, 99)
    g = genome(ctx1, random_codes(256, 7))
    tr = trainer([g], population=32, antithetic=True, ternary_flip_rate=0.001,
                 ternary_update_fraction=0.02)
    start = int((codes_of(g) != target).sum())
    for _ in range(30):
        tr.step(lambda m: -float((codes_of(g) != target).sum()))
    assert int((codes_of(g) != target).sum()) < 0.65 * start


# ---------------------------------------------------------------------------------------------
# determinism


def run_mixed(ctx, iterations=3):
    """A mixed float + ternary run with enough flips for several flip-generator chunks."""
    g1 = genome(ctx, random_codes(64 * 256, 1))
    g2 = genome(ctx, random_codes(256, 2))
    p = ctx.tensor(np.linspace(-1, 1, 5000).astype(f32), ("a",))
    tr = es.Trainer(sigma=0.05, population=8, antithetic=True, seed=9, ternary_flip_rate=0.3,
                    ternary_update_fraction=0.02)
    tr.add_param(p)
    tr.add_ternary_param(g1)
    tr.add_ternary_param(g2)
    for it in range(iterations):
        tr.step(lambda m: float(codes_of(g1)[:300].sum()) - 0.1 * m + float(p.numpy()[m]))
    out = [x.data_const().copy() for x in (g1, g2, p)]
    tr.close()
    return out


def test_same_bits_at_any_thread_count_and_chunk_grid(monkeypatch):
    results = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            results.append(run_mixed(c))
    monkeypatch.setattr(xt, "FLIP_CHUNK", 40)
    monkeypatch.setattr(xt, "CHECK_CHUNK", 3)
    with fu.ExecContext(threads=2) as c:
        results.append(run_mixed(c))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# errors


def test_registration_errors(ctx1):
    tr = es.Trainer(population=4)
    g = genome(ctx1, random_codes(512, 0))
    with pytest.raises(TypeError, match="expected a fucina Tensor"):
        tr.add_ternary_param(np.zeros(66, np.uint8))
    with pytest.raises(fu.DTypeError, match="expected a tq2_0 tensor"):
        tr.add_ternary_param(ctx1.zeros((256,), ("a",)))
    with pytest.raises(fu.DTypeError, match="got q8_0"):
        tr.add_ternary_param(ctx1.zeros((256,), ("a",)).to("q8_0"))
    with pytest.raises(TypeError, match="str name"):
        tr.add_ternary_param(g, 3)
    for bad in (0, -256, 300, 256.0, True):
        with pytest.raises(fu.InvalidConfig, match="positive multiple of 256"):
            tr.add_ternary_param(g, "g", length=bad)
    with pytest.raises(fu.InvalidConfig, match="length 256 needs 1 blocks, the tensor holds 2"):
        tr.add_ternary_param(g, "g", length=256)
    raw = g.data()
    raw[1, 40] |= 0b11 << 4  # block 1, byte 40: group 1, lane 2 -> element 256 + 128 + 64 + 8
    with pytest.raises(fu.InvalidConfig, match="element 456 holds crumb code 3"):
        tr.add_ternary_param(g, "g")
    raw[1, 40] &= ~np.uint8(0b11 << 4)
    raw[1, 64:66] = 255  # the scale is not a code: any bytes are fine
    tr.add_ternary_param(g, "g", length=512)
    with pytest.raises(fu.DuplicateParam):
        tr.add_ternary_param(g, "again")
    assert tr.param_count() == 1 and tr.element_count() == 512 and tr.ternary_names() == ["g"]
    tr.perturb(0)
    with pytest.raises(fu.MemberActive):
        tr.add_ternary_param(genome(ctx1, random_codes(256, 1)))
    tr.restore(0)
    tr.close()


def test_read_only_storage_is_refused(ctx1, tmp_path):
    g = genome(ctx1, random_codes(256, 3))
    fu.gguf.write(tmp_path / "g.gguf", {"g": g}, {})
    f = fu.gguf.read(tmp_path / "g.gguf", ctx1)
    tr = es.Trainer(population=4)
    with pytest.raises(fu.InvalidConfig, match="read-only"):
        tr.add_ternary_param(f.tensors["g"])
    # float slots too: perturbing a read-only mapping in place would crash the process
    fu.gguf.write(tmp_path / "w.gguf", {"w": ctx1.tensor(np.zeros(64, f32), ("a",))}, {})
    fw = fu.gguf.read(tmp_path / "w.gguf", ctx1)
    reg = ParamRegistry()
    reg.add_param("w", fw.tensors["w"])
    with pytest.raises(fu.InvalidConfig, match="read-only"):
        tr.add_param(fw.tensors["w"])
    with pytest.raises(fu.InvalidConfig, match="read-only"):
        tr.add_registry(reg)
    assert tr.param_count() == 0
    del f, fw, reg


def test_member_and_update_errors_change_nothing(ctx1):
    tr = es.Trainer(population=4)
    with pytest.raises(fu.NoParams):
        tr.perturb(0)
    with pytest.raises(fu.NoParams):
        tr.update([0.0] * 4)
    with pytest.raises(fu.NoParams):
        tr.capture_anchor()
    g = genome(ctx1, random_codes(256, 5))
    tr.add_ternary_param(g)
    tr.capture_anchor()  # a genome-only trainer: an empty anchor, fine
    before = g.data_const().copy()
    with pytest.raises(fu.RewardCountMismatch):
        tr.update([0.0] * 3)
    tr.perturb(1)
    with pytest.raises(fu.MemberActive):
        tr.update([0.0, 1.0, 2.0, 3.0])
    with pytest.raises(fu.MemberActive):
        tr.materialize_ternary_member(0, [g])
    with pytest.raises(fu.MemberNotActive):
        tr.restore(2)
    tr.restore(1)
    with pytest.raises(fu.MemberNotActive):
        tr.restore(1)
    assert tr.iteration == 0 and np.array_equal(g.data_const(), before)
    tr2 = es.Trainer(population=4, anchor_decay="l1", anchor_lambda=0.1)
    tr2.add_ternary_param(genome(ctx1, random_codes(256, 6)))
    with pytest.raises(fu.AnchorMissing):
        tr2.update([0.0] * 4)
    tr.close()
    tr2.close()


def test_step_restores_genomes_on_evaluator_error(ctx1):
    g = genome(ctx1, random_codes(1024, 8))
    before = g.data_const().copy()
    tr = trainer([g], population=4, ternary_flip_rate=0.1)

    def ev(member):
        if member == 2:
            raise RuntimeError("rollout crashed")
        return 1.0

    with pytest.raises(RuntimeError, match="rollout crashed"):
        tr.step(ev)
    assert tr.active_member is None and tr.iteration == 0
    np.testing.assert_array_equal(g.data_const(), before)


def test_replica_errors(ctx1):
    g = genome(ctx1, random_codes(512, 2))
    tr = trainer([g], population=4)
    ok = ctx1.zeros((2, 256), ("a", "b")).to("tq2_0")
    with pytest.raises(fu.ReplicaShapeMismatch, match="one per genome"):
        tr.materialize_ternary_member(0, [ok, ok])
    with pytest.raises(fu.ReplicaShapeMismatch, match="expected 132 bytes"):
        tr.materialize_ternary_member(0, [ctx1.zeros((256,), ("a",)).to("tq2_0")])
    with pytest.raises(fu.ReplicaShapeMismatch, match="expected 264 bytes"):
        tr.materialize_ternary_members([0, 1], [ok])
    with pytest.raises(fu.DTypeError, match="expected a tq2_0"):
        tr.materialize_ternary_member(0, [ctx1.zeros((2, 256), ("a", "b"))])
    with pytest.raises(fu.IndexOutOfBounds):
        tr.materialize_ternary_member(4, [ok])
    with pytest.raises(fu.IndexOutOfBounds):
        tr.materialize_ternary_members([], [ok])
    tr.materialize_ternary_member(3, [ok])
    tr.close()


def test_closed_context(ctx1):
    c = fu.ExecContext(threads=1)
    g = genome(c, random_codes(256, 1))
    tr = trainer([g], population=2)
    c.close()
    with pytest.raises(fu.ContextClosed):
        tr.perturb(0)
    with pytest.raises(fu.ContextClosed):
        tr.update([0.0, 1.0])


# ---------------------------------------------------------------------------------------------
# checkpoints (T-28)


def mixed_model(ctx, seed):
    rng = np.random.default_rng(seed)
    p = ctx.tensor(rng.standard_normal(300).astype(f32), ("a",))
    g1 = genome(ctx, random_codes(768, seed), (3, 256), seed)
    g2 = genome(ctx, random_codes(256, seed + 1), seed=seed + 1)
    reg = ParamRegistry()
    reg.add_param("p", p)
    return p, g1, g2, reg


def mixed_trainer(p, g1, g2, **kw):
    tr = es.Trainer(**{"sigma": 0.05, "population": 6, "antithetic": True, "seed": 21,
                       "ternary_flip_rate": 0.05, "ternary_update_fraction": 0.02,
                       "ternary_update_decay": 0.1, **kw})
    tr.add_param(p, "p")
    tr.add_ternary_param(g1, "g1")
    tr.add_ternary_param(g2)  # unnamed: "ternary.1" in the file
    return tr


def train(tr, p, g1, iterations):
    for _ in range(iterations):
        tr.step(lambda m: float(codes_of(g1)[:200].sum()) + float(p.numpy()[:5].sum()) - m)


def test_resume_is_bit_exact(ctx1, tmp_path):
    p, g1, g2, reg = mixed_model(ctx1, 1)
    tr = mixed_trainer(p, g1, g2)
    train(tr, p, g1, 6)
    straight = [x.data_const().copy() for x in (p, g1, g2)]

    p, g1, g2, reg = mixed_model(ctx1, 1)
    tr = mixed_trainer(p, g1, g2)
    train(tr, p, g1, 2)
    tr.save_checkpoint(tmp_path / "ck", reg)
    assert sorted(x.name for x in (tmp_path / "ck").iterdir()) == \
        ["checksums.json", "model.safetensors", "ternary.gguf", "trainer_state.json"]
    f = fu.gguf.read(tmp_path / "ck" / "ternary.gguf", ctx1)
    assert list(f.tensors) == ["g1", "ternary.1"] and f.tensors["g1"].dtype == "tq2_0"
    assert np.array_equal(f.tensors["g1"].data_const(), g1.data_const())
    del f
    # a fresh model with other values (scales included) and other contract settings
    p2, g12, g22, reg2 = mixed_model(ctx1, 50)
    tr2 = mixed_trainer(p2, g12, g22, seed=5, population=4, ternary_flip_rate=0.5,
                        ternary_update_fraction=0.5, ternary_update_decay=0.0)
    state = tr2.load_checkpoint(tmp_path / "ck", reg2)
    assert tr2.iteration == 2 and state.es_ternary_update_decay == float(f32(0.1))
    assert tr2.config.ternary_flip_rate == float(f32(0.05))
    train(tr2, p2, g12, 4)
    for a, b in zip(straight, (p2, g12, g22)):
        np.testing.assert_array_equal(b.data_const(), a)


def test_checkpoint_load_errors_change_nothing(ctx1, tmp_path):
    p, g1, g2, reg = mixed_model(ctx1, 2)
    tr = mixed_trainer(p, g1, g2)
    train(tr, p, g1, 1)
    tr.save_checkpoint(tmp_path / "ck", reg)

    p2, g12, g22, reg2 = mixed_model(ctx1, 3)
    before = [x.data_const().copy() for x in (p2, g12, g22)]

    def unchanged(trainer_):
        assert trainer_.iteration == 0
        for a, x in zip(before, (p2, g12, g22)):
            np.testing.assert_array_equal(x.data_const(), a)

    # a trainer without genomes refuses a checkpoint that has them, and vice versa
    bare = es.Trainer(population=6)
    bare.add_param(p2, "p")
    with pytest.raises(fu.CheckpointUnknownName, match="holds ternary genomes"):
        bare.load_checkpoint(tmp_path / "ck", reg2)
    unchanged(bare)
    bare.save_checkpoint(tmp_path / "floats", reg2)
    tr2 = mixed_trainer(p2, g12, g22)
    with pytest.raises(fu.CheckpointMissingEntry, match="ternary.gguf"):
        tr2.load_checkpoint(tmp_path / "floats", reg2)
    unchanged(tr2)
    # genome names, shapes, codes
    renamed = es.Trainer(population=6)
    renamed.add_param(p2, "p")
    renamed.add_ternary_param(g12, "other")
    renamed.add_ternary_param(g22)
    with pytest.raises(fu.CheckpointUnknownName, match="g1"):
        renamed.load_checkpoint(tmp_path / "ck", reg2)
    unchanged(renamed)
    three = mixed_trainer(p2, g12, g22)
    three.add_ternary_param(genome(ctx1, random_codes(256, 4)), "g3")
    with pytest.raises(fu.CheckpointMissingEntry, match="'g3' is missing"):
        three.load_checkpoint(tmp_path / "ck", reg2)
    unchanged(three)
    swapped = es.Trainer(population=6)
    swapped.add_param(p2, "p")
    swapped.add_ternary_param(g22, "g1")  # 256 elements where the file has 768
    swapped.add_ternary_param(g12)
    with pytest.raises(fu.CheckpointShapeMismatch, match="expected shape"):
        swapped.load_checkpoint(tmp_path / "ck", reg2)
    unchanged(swapped)
    f = fu.gguf.read(tmp_path / "ck" / "ternary.gguf", ctx1)
    corrupt = {name: t for name, t in f.tensors.items()}
    bad = corrupt["ternary.1"].to("f32").to("tq2_0")
    bad.data()[0, 0] = 0xFF
    corrupt["ternary.1"] = bad
    fu.gguf.write(tmp_path / "ck" / "ternary.gguf", corrupt, {})
    fu.io.write_manifest(tmp_path / "ck")  # a deliberate rewrite: re-seal checksums.json
    del f, corrupt, bad
    with pytest.raises(fu.InvalidConfig, match="crumb code 3"):
        tr2.load_checkpoint(tmp_path / "ck", reg2)
    unchanged(tr2)
    # a duplicate genome name is refused before anything is written
    dup = es.Trainer(population=6)
    dup.add_ternary_param(g12, "same")
    dup.add_ternary_param(g22, "same")
    with pytest.raises(fu.CheckpointDuplicateName):
        dup.save_checkpoint(tmp_path / "dup", ParamRegistry())
    assert not (tmp_path / "dup").exists()
    for t in (tr, bare, tr2, renamed, three, swapped, dup):
        t.close()


def test_resave_without_genomes_drops_the_stale_file(ctx1, tmp_path):
    p, g1, g2, reg = mixed_model(ctx1, 4)
    tr = mixed_trainer(p, g1, g2)
    tr.save_checkpoint(tmp_path, reg)
    bare = es.Trainer(population=6)
    bare.add_param(p, "p")
    bare.save_checkpoint(tmp_path, reg)
    assert not (tmp_path / "ternary.gguf").exists()
    bare.load_checkpoint(tmp_path, reg)
    tr.close()
    bare.close()


# ---------------------------------------------------------------------------------------------
# examples/es_ternary_spirals


def test_demo_reaches_its_target():
    from examples import es_ternary_spirals as demo

    lines = []
    out = demo.run(log=lines.append)
    assert out["accuracy"] >= demo.DEFAULTS["target"]
    assert out["iterations"] == demo.DEFAULTS["iterations"]
    assert any(line.startswith("iter   1000  accuracy") for line in lines)  # progress lines
    assert lines[-1].startswith("PASS")


def test_demo_threads_and_resume_give_the_same_bits(tmp_path):
    from examples import es_ternary_spirals as demo

    quiet = [].append
    straight = demo.run(iterations=60, target=0.0, threads=2, save=tmp_path / "a", log=quiet)
    one = demo.run(iterations=60, target=0.0, threads=1, log=quiet)
    np.testing.assert_array_equal(straight["genome"], one["genome"])
    demo.run(iterations=25, target=0.0, save=tmp_path / "first", log=quiet)
    lines = []
    resumed = demo.run(iterations=35, target=0.0, load=tmp_path / "first", save=tmp_path / "b",
                       log=lines.append)
    assert "resumed" in lines[0] and "iteration 25" in lines[0]
    np.testing.assert_array_equal(straight["genome"], resumed["genome"])
    for name in ("ternary.gguf", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_demo_target_decides_the_exit_status(capsys):
    from examples import es_ternary_spirals as demo

    assert demo.main(["--iterations", "3", "--target", "0.99"]) == 1
    assert "FAIL: es-ternary-spirals" in capsys.readouterr().out
    assert demo.main(["--iterations", "3", "--target", "0.0", "--population", "5"]) == 0
    with pytest.raises(demo.TernaryTrainingFailed):
        demo.run(iterations=2, target=1.01, log=[].append)
