"""The bf16 GEMM (fucina.exec.matmul_bf16.gemm_bf16): against float64 numpy on the bf16-rounded
operands, against an exact model of vdpbf16ps (the probe the codegen docstring reports), the
instruction against its FMA emulation bit for bit, and bitwise across threads and cold/cached
kernels.

Tolerance: the classic bound of an f32 sum of K exact products,
|Δ| <= K · 2^-24 · sum_k |a_k| |b_k|, a and b the bf16-rounded operands (their products are
exact; only the f32 sums round).
"""
from fractions import Fraction

import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise, assert_cold_equals_warm, feed_grad
from fucina.codegen import gemm_bf16 as cg
from fucina.codegen import kernels
from fucina.exec import elementwise as ew
from fucina.exec import matmul_bf16 as mb
from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from fucina.exec.matmul_bf16 import gemm_bf16

NATIVE = cg.native()
needs_native = pytest.mark.skipif(not NATIVE, reason="the host has no AVX-512 BF16 (vdpbf16ps)")
DOT = "dot" if NATIVE else "emulated"     # this host's vdpbf16ps family (the same bits)
# every engine this host runs: the tests of the semantics all engines share take each
HERE = (["amx"] if mb.amx_granted() else []) + [DOT]


def bf16(x) -> np.ndarray:
    """x rounded to bf16 as the packing does (R-9 nearest even, then denormals -> signed 0)."""
    r = bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, np.float32)))
    return np.where(np.abs(r) < 2.0 ** -126, np.copysign(np.float32(0), r), r).astype(np.float32)


def operand(ctx, arr, transposed, dtype="f32"):
    """arr [r, c] as a RawTensor, stored transposed (swapped strides) when asked."""
    if not transposed:
        return ctx.from_numpy(np.ascontiguousarray(arr), dtype=dtype)
    return ctx.from_numpy(np.ascontiguousarray(arr.T), dtype=dtype).permute((1, 0))


def check_close(c, A, B):
    a, b = bf16(A).astype(np.float64), bf16(B).astype(np.float64)
    ref = a @ b
    bound = A.shape[1] * 2.0 ** -24 * (np.abs(a) @ np.abs(b))
    err = np.abs(c.astype(np.float64) - ref)
    assert (err <= bound).all(), f"max excess {(err - bound).max()} at {np.argmax(err - bound)}"


SHAPES = [(1, 1, 1), (5, 7, 3), (14, 32, 32), (37, 131, 45), (3, 1025, 70), (64, 576, 192),
          (100, 1100, 33), (29, 2, 61), (400, 130, 70)]   # the last: several M blocks


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("bdt", ["bf16", "f32"])
@pytest.mark.parametrize("engine", HERE)
def test_against_numpy(ctx, M, K, N, ta, tb, bdt, engine):
    """Every packing mode (A k-contiguous or not, B n- or k-contiguous; bf16 or f32 B), odd K,
    ragged tile edges, several KC blocks (K > 512)."""
    rng = np.random.default_rng(M * 7 + K + N)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    c = gemm_bf16(ctx, operand(ctx, A, ta), operand(ctx, B, tb, bdt), engine).to_numpy()
    check_close(c, A, B)


@pytest.mark.parametrize("engine", HERE)
def test_strided_any_mode(ctx1, engine):
    """Neither operand unit-stride along either axis: the scalar packing."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((23, 2 * 77)).astype(np.float32)
    B = rng.standard_normal((77, 2 * 19)).astype(np.float32)
    a = ctx1.from_numpy(A).view((23, 77), (2 * 77, 2))
    b = ctx1.from_numpy(B, dtype="bf16").view((77, 19), (2 * 19, 2))
    c = gemm_bf16(ctx1, a, b, engine).to_numpy()
    check_close(c, A[:, ::2], B[:, ::2])


@pytest.mark.parametrize("engine", HERE)
def test_rounds_like_torch(ctx1, engine):
    """The activation is rounded to nearest even exactly as torch's bf16 cast (normal values)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    A = (rng.standard_normal((16, 64)) * 3).astype(np.float32)
    B = bf16(rng.standard_normal((64, 16)))
    ta = torch.from_numpy(A).to(torch.bfloat16).double()
    ref = (ta @ torch.from_numpy(B).double()).numpy()
    c = gemm_bf16(ctx1, ctx1.from_numpy(A), ctx1.from_numpy(B, dtype="bf16"), engine).to_numpy()
    bound = 64 * 2.0 ** -24 * (np.abs(ta.numpy()) @ np.abs(B.astype(np.float64)))
    assert (np.abs(c - ref) <= bound).all()
    # and ties go to even: 1 + 2^-8 (a tie between bf16 1 and 1 + 2^-7) rounds down to 1
    one = gemm_bf16(ctx1, ctx1.from_numpy(np.array([[1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8]],
                                                    np.float32)),
                    ctx1.from_numpy(np.array([[1.0], [0.0]], np.float32)), engine).to_numpy()
    assert one[0, 0] == 1.0


# ---- the instruction, exactly -------------------------------------------------------------

def _step(acc: float, p: float) -> float:
    """One sum of vdpbf16ps: acc + p (p an exact product) rounded once to nearest even with an
    unbounded exponent, then a result below 2^-126 in magnitude flushed to a zero of its
    sign."""
    if (acc == 0 and p == 0) or not np.isfinite(acc + p):
        return acc + p                      # signed zeros and infinities as IEEE adds them
    exact = Fraction(acc) + Fraction(p)
    if exact == 0:
        return 0.0
    sign = -1.0 if exact < 0 else 1.0
    q = abs(exact)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    ulp = Fraction(2) ** (e - 23)
    n = q / ulp
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2):
        fl += 1
    r = fl * ulp
    if r < Fraction(2) ** -126:
        return sign * 0.0
    return sign * (float(r) if r < Fraction(2) ** 128 else float("inf"))


def each_sum(A, B, chain):
    """c[i, j] = chain(products) for the exact products of row i of a and column j of b, both
    rounded / flushed as packed: the element-by-element models of the bf16 GEMM's engines."""
    a, b = bf16(A).astype(np.float64), bf16(B).astype(np.float64)
    c = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for i in range(c.shape[0]):
        for j in range(c.shape[1]):
            c[i, j] = chain(a[i] * b[:, j])
    return c


def _pairs_chain(p):
    """vdpbf16ps's chain: for each k pair in order, the odd product, then the even one."""
    acc = 0.0
    for k in range(0, len(p), 2):
        if k + 1 < len(p):
            acc = _step(acc, p[k + 1])
        acc = _step(acc, p[k])
    return acc


def model(A, B):
    """c = the dot instruction's sums (_pairs_chain); inputs rounded/flushed as packed."""
    return each_sum(A, B, _pairs_chain)


def _edge_cases():
    """Rows of a and columns of b (K = 4) whose sums sit where orders, double roundings, flushes
    and the 2^-126 band tell the candidate semantics apart."""
    t = 2.0 ** -126
    cases = [
        # order inside a pair: 1 + 1.5·2^-24 + 2^-24 (odd first: 1 + 2^-22; even first or one
        # rounding: 1 + 2^-23)
        ([2.0 ** -24, 1.5 * 2.0 ** -24, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]),
        ([1.0, 0.0, 2.0 ** -24, 1.5 * 2.0 ** -24], [1.0, 0.0, 1.0, 1.0]),
        # a sum flushed between the two steps: 1.5·2^-126 - 2^-126 + 2^-126
        ([1.5 * t * 2 ** 63, 0.0, 2.0 ** -63, -(2.0 ** -63)], [2.0 ** -63, 0.0, 2.0 ** -63, 2.0 ** -63]),
        # the band under 2^-126: 2^-126 - 2^-151 stays, 2^-126 - 0.898·2^-150 flushes
        ([t * 2 ** 63, 0.0, 0.0, -(2.0 ** -75)], [2.0 ** -63, 0.0, 0.0, 2.0 ** -76]),
        ([t * 2 ** 63, 0.0, 0.0, -1.796875 * 2.0 ** -75], [2.0 ** -63, 0.0, 0.0, 2.0 ** -76]),
        ([-t * 2 ** 63, 0.0, 0.0, 1.796875 * 2.0 ** -75], [2.0 ** -63, 0.0, 0.0, 2.0 ** -76]),
        ([t * 2 ** 63, 0.0, 0.0, -1.5 * 2.0 ** -75], [2.0 ** -63, 0.0, 0.0, 2.0 ** -75]),
        # a product below the f32 range still counts: 2^-110 + 2^-130
        ([2.0 ** -55, 0.0, 0.0, 2.0 ** -65], [2.0 ** -55, 0.0, 0.0, 2.0 ** -65]),
        # a tiny result keeps its sign; exact cancellation gives +0
        ([0.0, 0.0, 0.0, -(2.0 ** -70)], [0.0, 0.0, 0.0, 2.0 ** -70]),
        ([2.0 ** -55, 0.0, -(2.0 ** -55), 0.0], [2.0 ** -55, 0.0, 2.0 ** -55, 0.0]),
        # bf16 denormal inputs read as zero
        ([float(np.float32(2.0 ** -130)), 1.0, 0.0, 0.0], [2.0 ** 100, 0.0, 0.0, 0.0]),
        # overflow
        ([2.0 ** 127, 2.0 ** 127, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]),
    ]
    A = np.array([a for a, _ in cases], np.float32)
    B = np.array([b for _, b in cases], np.float32).T.copy()
    return A, B


def _near_tiny(rng, M, K, N):
    """Random bf16 operands whose products and sums cluster around 2^-126."""
    def part(*shape):
        m = bf16(1 + rng.random(shape)).astype(np.float64)
        s = rng.choice([-1.0, 1.0], shape)
        e = rng.integers(-70, -56, shape)
        return (s * m * np.exp2(e)).astype(np.float32)
    return part(M, K), part(K, N)


@pytest.mark.parametrize("engine", [pytest.param("dot", marks=needs_native), "emulated"])
def test_exact_model_edges(ctx1, engine):
    """Both the instruction and its emulation compute the model exactly (the probe behind the
    codegen docstring: each rejected candidate — even product first, one rounding per pair,
    no flush between the steps, tininess before rounding, FMA denormal rounding — fails one
    of these rows)."""
    A, B = _edge_cases()
    c = gemm_bf16(ctx1, ctx1.from_numpy(A), ctx1.from_numpy(B), engine=engine).to_numpy()
    assert_bitwise(c, model(A, B))


@pytest.mark.parametrize("engine", [pytest.param("dot", marks=needs_native), "emulated"])
def test_exact_model_random(ctx1, engine):
    rng = np.random.default_rng(5)
    A, B = _near_tiny(rng, 12, 24, 17)
    c = gemm_bf16(ctx1, ctx1.from_numpy(A), ctx1.from_numpy(B), engine=engine).to_numpy()
    assert_bitwise(c, model(A, B))
    A = rng.standard_normal((9, 30)).astype(np.float32) * np.float32(3)
    B = rng.standard_normal((30, 20)).astype(np.float32)
    c = gemm_bf16(ctx1, ctx1.from_numpy(A), ctx1.from_numpy(B), engine=engine).to_numpy()
    assert_bitwise(c, model(A, B))


@pytest.mark.parametrize("engine", [pytest.param("dot", marks=needs_native), "emulated"])
def test_edge_rows_are_the_model(engine):
    """The last panel of rows runs a micro-tile of its own height (EDGE_ROWS): for M across
    every height (MR = 14 on AVX-512), each element is still the model's chain, at 1 and 2
    threads."""
    rng = np.random.default_rng(8)
    for M in [*range(1, cg.mr() + 1), cg.mr() + 4, 2 * cg.mr() + 1]:
        A = rng.standard_normal((M, 30)).astype(np.float32)
        B = rng.standard_normal((30, 20)).astype(np.float32)
        want = model(A, B)
        for th in (1, 2):
            with fu.ExecContext(threads=th) as ctx:
                c = gemm_bf16(ctx, ctx.from_numpy(A), ctx.from_numpy(B), engine=engine)
                assert_bitwise(c.to_numpy(), want)


@needs_native
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -63])
def test_emulation_matches_instruction(ctx, scale):
    """The FMA emulation (what hosts without AVX-512 BF16 run) against vdpbf16ps, bit for bit,
    at ordinary magnitudes and around 2^-126."""
    rng = np.random.default_rng(6)
    if scale == 1.0:
        A = rng.standard_normal((70, 600)).astype(np.float32)
        B = rng.standard_normal((600, 90)).astype(np.float32)
    else:
        A, B = _near_tiny(rng, 70, 600, 90)
    a, b = ctx.from_numpy(A), ctx.from_numpy(B, dtype="bf16")
    assert_bitwise(gemm_bf16(ctx, a, b, "emulated").to_numpy(),
                   gemm_bf16(ctx, a, b, "dot").to_numpy())


# ---- determinism ----------------------------------------------------------------------------

@pytest.mark.parametrize("ta", [False, True], ids=["rows", "transposed"])
def test_packing_rounds_every_edge_as_the_spec(ctx1, ta):
    """A's pair panels hold exactly the spec's bf16 bits, word by word, through whole groups of
    2W k and masked tails (the convert instruction where the host has it): nearest even with
    ties, overflow to inf, quiet NaN with its payload, and the f32 denormals — flushed to a
    zero of their sign, except those that round up to 2^-126 (0x7F8000..0x7FFFFF), which the
    instruction alone would flush."""
    bits = np.array([0x007F8000, 0x007FFFFF, 0x807FC000, 0x007F7FFF, 0x00000001, 0x80000000,
                     0x7F7FFFFF, 0xFF7F7FFF, 0x7F800000, 0xFF800000, 0x3F808000, 0x3F818000,
                     0x00800000, 0x80800001, 0x7FC00001, 0x7F800001, 0xFFA00000], np.uint32)
    rng = np.random.default_rng(11)
    M, K = 29, 1101                       # panels of MR rows and a short one; k blocks, tails
    A = rng.standard_normal((M, K)).astype(np.float32)
    A.flat[rng.choice(M * K, 3000, replace=False)] = np.resize(bits, 3000).view(np.float32)
    a = operand(ctx1, A, ta)
    w = ctx1.from_numpy(np.ones((K, 3), np.float32), dtype="bf16")
    gemm_bf16(ctx1, a, w, DOT)
    plan = mb._plans[(a.lay, w.lay, DOT, False, False)]
    scratch = ctx1.empty((plan.words,), "f32")
    for k0, (addr, n, cost, tail), _ in plan.slices:
        ctx1.launch(addr, n, cost, a.addr + k0 * a.strides[1] * 4, scratch.addr, *tail)
    got = scratch.to_numpy().view(np.uint32)
    h = f32_to_bf16_bits(A).astype(np.uint32)
    h = np.where(h & 0x7F80, h, h & 0x8000)                    # bf16 denormals -> signed 0
    MR, kc = cg.mr(), mb._kc(K, NATIVE)
    npan = -(-M // MR)
    want = np.zeros(plan.words, np.uint32)
    for k0 in range(0, K, kc):
        kpl = -(-min(kc, K - k0) // 2)
        for p in range(npan):
            for w_ in range(min(MR, M - p * MR)):
                row = h[p * MR + w_, k0:k0 + 2 * kpl]
                row = np.pad(row, (0, 2 * kpl - len(row)))
                if NATIVE:      # one word per pair: the even element in the low half
                    base = (k0 // 2) * npan * MR + p * kpl * MR + w_
                    want[base:base + kpl * MR:MR] = row[0::2] | (row[1::2] << 16)
                else:           # the emulation's f32 slots: odd element, then even, per pair
                    base = k0 * npan * MR + 2 * p * kpl * MR + w_
                    want[base:base + 2 * kpl * MR:MR] = \
                        np.stack([row[1::2], row[0::2]], 1).reshape(-1) << 16
    assert_bitwise(got, want)
    band = np.isin(A.view(np.uint32) & 0x7FFFFFFF, [0x7F8000, 0x7FFFFF, 0x7FC000])
    assert band.sum() > 300


@pytest.mark.parametrize("engine", HERE)
def test_one_and_two_threads_bitwise(engine):
    rng = np.random.default_rng(7)
    A = rng.standard_normal((350, 1100)).astype(np.float32)   # two M blocks, three K blocks
    B = rng.standard_normal((700, 1100)).astype(np.float32)
    out = []
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            out.append(gemm_bf16(ctx, ctx.from_numpy(A), operand(ctx, B.T, True, "bf16"),
                                 engine).to_numpy())
    assert_bitwise(out[0], out[1])


@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_k_slices_and_c_prefetch_keep_the_bits(tb, monkeypatch):
    """A long K in slices (the head's dx: each slice continues the sums the previous one left
    in C; here 600, 600 and an odd 301) and the tiles that prefetch C lines give the bits of
    the default plan, at 1 and 2 threads; all near numpy."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((60, 1501)).astype(np.float32)
    B = rng.standard_normal((1501, 100)).astype(np.float32)
    outs = []
    for k_slice, pf_min in ((1 << 62, 1 << 62), (600, 0)):
        monkeypatch.setattr(mb, "K_SLICE", k_slice)
        monkeypatch.setattr(mb, "PF_C_MIN", pf_min)
        mb._plans.clear()
        for th in (1, 2):
            with fu.ExecContext(threads=th) as ctx:
                outs.append(gemm_bf16(ctx, ctx.from_numpy(A), operand(ctx, B, tb, "bf16"), DOT)
                            .to_numpy())
                plan = next(iter(mb._plans.values()))
                tile = plan.slices[0][2]
                key = next(k for k, a in kernels._memo.items() if a == tile[0])
                assert key.pf_c == (pf_min == 0)
                assert [s[0] for s in plan.slices] == ([0] if pf_min else [0, 600, 1200])
    mb._plans.clear()
    for o in outs[1:]:
        assert_bitwise(outs[0], o)
    check_close(outs[0], A, B)


@pytest.mark.parametrize("M,K,N", [(40, 300, 70), (60, 1100, 100), (30, 2400, 50)],
                         ids=["one-kc", "kc-blocks", "k-slices"])
@pytest.mark.parametrize("engine", HERE)
def test_accumulate_and_rank_add_are_the_separate_passes(M, K, N, engine):
    """out += bf16(a)·bf16(b) adds each final sum once (partial sums of earlier KC blocks wait
    in a place of their own), and rank_add (x, y, s) adds s·(x·y) in the tile stores: the bits
    of the product, then out + it, then gemm(x, y, out, accumulate=True, scale=s) — one KC
    block, several, and a k in slices (there the separate passes themselves); 1 and 2
    threads."""
    from fucina.exec.matmul import gemm
    rng = np.random.default_rng(M)
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    X = rng.standard_normal((M, 8)).astype(np.float32)
    Y = rng.standard_normal((8, N)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            a, b = ctx.from_numpy(A), operand(ctx, B, True, "bf16")
            x, y = ctx.from_numpy(X), ctx.from_numpy(Y)
            rank = (x, y, 0.375)
            for acc in (False, True):
                want = gemm_bf16(ctx, a, b, engine)
                if acc:
                    s = ctx.from_numpy(C0 + want.to_numpy())       # numpy's f32 add
                    want = s
                gemm(ctx, x, y, out=want, accumulate=True, scale=0.375)
                for ranked in (False, True):
                    out = ctx.from_numpy(C0.copy()) if acc else None
                    got = gemm_bf16(ctx, a, b, engine, out=out, accumulate=acc,
                                    rank_add=rank if ranked else None)
                    if ranked:
                        assert_bitwise(got.to_numpy(), want.to_numpy())
                    else:
                        plain = gemm_bf16(ctx, a, b, engine).to_numpy()
                        assert_bitwise(got.to_numpy(), C0 + plain if acc else plain)
            plan = mb._plans[(a.lay, b.lay, engine, True, True)]
            if engine == "amx":      # one pass, its rank term in the stores, whatever K
                continue
            assert plan.ranked == (K <= 2 * mb.K_SLICE)
            assert bool(plan.partial) == (K <= 2 * mb.K_SLICE and K > mb._kc(K, NATIVE))


@pytest.mark.parametrize("engine", HERE)
def test_accumulate_and_rank_add_errors(ctx1, engine):
    a = ctx1.from_numpy(np.ones((3, 4), np.float32))
    b = ctx1.from_numpy(np.ones((4, 5), np.float32), dtype="bf16")
    with pytest.raises(fu.InvalidArgument, match="accumulate=True needs out"):
        gemm_bf16(ctx1, a, b, engine, accumulate=True)
    with pytest.raises(fu.ShapeMismatch, match=r"operand out: expected a contiguous f32 tensor "
                                               r"of shape \(3, 5\), got f32 \(3, 4\)"):
        gemm_bf16(ctx1, a, b, engine, out=ctx1.from_numpy(np.ones((3, 4), np.float32)))
    with pytest.raises(ValueError, match="operand out: expected a buffer distinct"):
        sq = ctx1.from_numpy(np.ones((4, 4), np.float32))
        gemm_bf16(ctx1, sq, sq, engine, out=sq)
    x, y = ctx1.from_numpy(np.ones((3, 2), np.float32)), ctx1.from_numpy(np.ones((3, 5), np.float32))
    with pytest.raises(fu.ShapeMismatch, match=r"rank_add: expected x \[3, r\] and y \[r, 5\]"):
        gemm_bf16(ctx1, a, b, engine, rank_add=(x, y, 1.0))
    # a k in slices checks the rank term before its passes: out is left as it was
    K = 2 * mb.K_SLICE + 2
    long_a = ctx1.from_numpy(np.ones((3, K), np.float32))
    long_b = ctx1.from_numpy(np.ones((K, 5), np.float32), dtype="bf16")
    out = ctx1.from_numpy(np.full((3, 5), 7.0, np.float32))
    with pytest.raises(fu.ShapeMismatch, match=r"rank_add: expected x \[3, r\]"):
        gemm_bf16(ctx1, long_a, long_b, engine, out=out, accumulate=True, rank_add=(x, y, 1.0))
    assert (out.to_numpy() == 7.0).all()


@pytest.mark.parametrize("engine", HERE)
def test_cold_compile_equals_warm_load(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("FUCINA_CACHE_DIR", str(tmp_path))  # a private cache: this test compiles
    for var in ("FUCINA_CACHE", "FUCINA_ASSERT_WARM", "FUCINA_RECORD_MANIFEST"):
        monkeypatch.delenv(var, raising=False)
    rng = np.random.default_rng(8)
    A = rng.standard_normal((37, 300)).astype(np.float32)
    B = rng.standard_normal((300, 65)).astype(np.float32)

    def forget():
        for k in [k for k in kernels._memo if k.family.startswith("gemm_bf16")]:
            del kernels._memo[k]
        mb._plans.clear()

    def run():
        with fu.ExecContext(threads=2) as ctx:
            return [gemm_bf16(ctx, ctx.from_numpy(A), operand(ctx, B, tb, "bf16"), engine)
                    .to_numpy() for tb in (False, True)]

    assert_cold_equals_warm(forget, run)


def test_bad_inputs(ctx1):
    a = ctx1.from_numpy(np.ones((3, 4), np.float32))
    b = ctx1.from_numpy(np.ones((4, 5), np.float32), dtype="bf16")
    with pytest.raises(fu.DTypeError, match="matmul_bf16: operand a: expected dtype f32"):
        gemm_bf16(ctx1, ctx1.from_numpy(np.ones((3, 4), np.float32), dtype="bf16"), b)
    with pytest.raises(fu.DTypeError, match="operand b: expected dtype f32 or bf16, got f16"):
        gemm_bf16(ctx1, a, ctx1.from_numpy(np.ones((4, 5), np.float32), dtype="f16"))
    with pytest.raises(fu.ShapeMismatch, match="expected contraction length 4"):
        gemm_bf16(ctx1, a, ctx1.from_numpy(np.ones((3, 5), np.float32), dtype="bf16"))
    with pytest.raises(fu.ShapeMismatch, match=r"expected a \[M, K\]"):
        gemm_bf16(ctx1, ctx1.from_numpy(np.ones((2, 3, 4), np.float32)), b)
    with pytest.raises(fu.InvalidArgument, match="engine: expected one of amx, dot, emulated "
                                                 "or None, got 'tiles'"):
        gemm_bf16(ctx1, a, b, "tiles")
    for engine in ("amx", "dot"):
        if engine not in HERE:
            with pytest.raises(fu.InvalidArgument, match=f"this host cannot run '{engine}'"):
                gemm_bf16(ctx1, a, b, engine)


# ---- Tensor.dot_bf16: forward and the gradient to x ------------------------------------------

@pytest.mark.parametrize("xshape,xtags", [((7, 40), ("s", "i")), ((40, 2, 3), ("i", "b", "s"))])
@pytest.mark.parametrize("wtags", [("o", "i"), ("i", "o")])
def test_dot_bf16_forward_backward_against_torch(ctx, xshape, xtags, wtags):
    """y = bf16(x)·bf16(w) and dx = bf16(g)·bf16(w), against torch in float64 on the rounded
    operands (the trainer's frozen linear, both orientations of the weight, x of any rank)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    xa = rng.standard_normal(xshape).astype(np.float32)
    wa = rng.standard_normal((24, 40)).astype(np.float32)
    wstore = wa if wtags == ("o", "i") else wa.T.copy()
    w = ctx.tensor(wstore, wtags).to("bf16")
    x = ctx.variable(xa, xtags)
    with ctx.exec_scope():
        y = x.dot_bf16(w, "i")
        assert y.tags == tuple(t for t in xtags if t != "i") + ("o",)
        c = rng.standard_normal(y.shape).astype(np.float32)
        (y * ctx.tensor(c, y.tags)).sum_all().backward()
        yv = y.numpy()
    perm = [xtags.index(t) for t in y.tags[:-1]] + [xtags.index("i")]
    tw = torch.from_numpy(bf16(wa)).double()
    tx = torch.from_numpy(bf16(xa.transpose(perm))).double()
    ty = tx @ tw.T
    bound = 40 * 2.0 ** -24 * (tx.abs() @ tw.abs().T)
    assert ((torch.from_numpy(yv).double() - ty).abs() <= bound).all()
    tg = torch.from_numpy(bf16(c)).double()
    tdx = tg @ tw                                       # [.., i] in y's lead order
    gb = 24 * 2.0 ** -24 * (tg.abs() @ tw.abs())
    got = torch.from_numpy(x.grad().numpy().transpose(perm).copy()).double()
    assert x.grad().tags == xtags
    assert ((got - tdx).abs() <= gb).all()


def test_dot_bf16_gradient_is_the_bf16_product(ctx1):
    """The backward is the same kernel on dy: bitwise gemm_bf16(g, w)."""
    rng = np.random.default_rng(11)
    xa = rng.standard_normal((9, 64)).astype(np.float32)
    wa = rng.standard_normal((30, 64)).astype(np.float32)
    ga = rng.standard_normal((9, 30)).astype(np.float32)
    w = ctx1.tensor(wa, ("o", "i")).to("bf16")
    x = ctx1.variable(xa, ("s", "i"))
    with ctx1.exec_scope():
        (x.dot_bf16(w, "i") * ctx1.tensor(ga, ("s", "o"))).sum_all().backward()
    want = gemm_bf16(ctx1, ctx1.from_numpy(ga), w._raw).to_numpy()
    assert_bitwise(x.grad().numpy(), want)


def test_dot_bf16_errors(ctx1):
    x = ctx1.tensor(np.ones((2, 8), np.float32), ("s", "i"))
    w = ctx1.tensor(np.ones((4, 8), np.float32), ("o", "i")).to("bf16")
    with pytest.raises(fu.UnsupportedGradient, match="dot_bf16: the right operand requires grad"):
        x.dot_bf16(ctx1.variable(np.ones((4, 8), np.float32), ("o", "i")), "i")
    with pytest.raises(fu.DTypeError, match="dot_bf16: right operand: expected bf16 or f32, got f16"):
        x.dot_bf16(w.to("f16"), "i")
    with pytest.raises(fu.DTypeError, match="dot_bf16: left operand: expected f32, got bf16"):
        x.to("bf16").dot_bf16(w, "i")
    with pytest.raises(fu.TagError, match="free tag 'o'"):
        ctx1.tensor(np.ones((4, 8), np.float32), ("o", "i")).dot_bf16(w, "i")
    with pytest.raises(fu.TagError, match="expected a matrix"):
        x.dot_bf16(ctx1.tensor(np.ones((2, 4, 8), np.float32), ("e", "o", "i")), "i")
    with pytest.raises(fu.FucinaError):
        x.dot_bf16(w, "nope")


# ---- the decoder with compute="bf16": its frozen linears, forward and backward -----------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from fucina.cli.tiny_model import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=3)


def test_model_holds_bf16_and_its_linear_is_the_bf16_product(ctx1, tiny_path):
    """Model.from_gguf(compute="bf16"): matrices bf16 (half the bytes), norms f32; a frozen
    projection forward and its gradient to the input against torch in float64 on the rounded
    operands (W the f32 file's matrix rounded to bf16)."""
    torch = pytest.importorskip("torch")
    from fucina.llm.decoder import Model
    m32 = Model.from_gguf(ctx1, tiny_path)
    m16 = Model.from_gguf(ctx1, tiny_path, compute="bf16")
    lay32, lay16 = m32.layers[1], m16.layers[1]
    for name, w in lay16.linear.items():
        assert w.dtype == "bf16" and lay32.linear[name].dtype == "f32"
    assert m16.token_embd.dtype == "bf16" and m16.output.dtype == "bf16"
    assert lay16.attn_norm.dtype == "f32" and m16.output_norm.dtype == "f32"
    w = lay32.linear["down"].numpy()                       # [embed, ffn]
    assert_bitwise(lay16.linear["down"].to("f32").numpy(), bf16(w))
    rng = np.random.default_rng(12)
    xa = rng.standard_normal((9, w.shape[1])).astype(np.float32)
    ga = rng.standard_normal((9, w.shape[0])).astype(np.float32)
    x = ctx1.variable(xa, ("seq", "ffn"))
    with ctx1.exec_scope():
        y = m16.linear(1, "down", x)
        (y * ctx1.tensor(ga, ("seq", "embed"))).sum_all().backward()
        yv = y.numpy()
    tx, tw, tg = (torch.from_numpy(bf16(v)).double() for v in (xa, w, ga))
    assert ((torch.from_numpy(yv).double() - tx @ tw.T).abs()
            <= w.shape[1] * 2.0 ** -24 * (tx.abs() @ tw.abs().T)).all()
    assert ((torch.from_numpy(x.grad().numpy()).double() - tg @ tw).abs()
            <= w.shape[0] * 2.0 ** -24 * (tg.abs() @ tw.abs())).all()


def test_trainer_gradients_close_to_f32(ctx1, tiny_path):
    """The LoRA step over a bf16-compute model: the loss and every adapter gradient near the
    f32 model's (same init), and not equal to them (the bf16 kernel ran). B starts at zero, so
    A's gradients are zero in both and B's carry the comparison."""
    from fucina.llm.decoder import Model, Targets, Trainer
    tokens = np.arange(3, 40) % 500
    labels = np.roll(tokens, -1)
    out = {}
    for c in ("f32", "bf16"):
        model = Model.from_gguf(ctx1, tiny_path, compute=c)
        tr = Trainer(model, Targets(q=True, v=True, down=True), fu.lora.LoraConfig(4, 8), seed=1)
        with ctx1.exec_scope():
            loss = tr.loss(tokens, labels)
            loss.backward()
            out[c] = (loss.item(), [e.tensor.grad().numpy() for e in tr.named_tensors()])
    (l32, g32), (l16, g16) = out["f32"], out["bf16"]
    assert 0 < abs(l16 - l32) < 1e-2 * l32
    for a, b in zip(g32, g16):
        n = np.linalg.norm(a)
        if n == 0:
            assert np.linalg.norm(b) == 0
            continue
        assert 0 < np.linalg.norm(a - b) < 0.05 * n


def test_model_compute_errors(ctx1, tiny_path):
    from fucina.llm.decoder import Model
    with pytest.raises(fu.InvalidArgument, match=r"compute: expected one of f32, bf16, got 'fp8'"):
        Model.from_gguf(ctx1, tiny_path, compute="fp8")
    with pytest.raises(fu.InvalidArgument, match="expected widen_frozen=False with it"):
        Model.from_gguf(ctx1, tiny_path, compute="bf16", widen_frozen=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_emulation_leaves_the_float_mode_as_it_found_it(threads):
    """The emulation flushes tiny sums by switching MXCSR to FTZ / DAZ for its k loops: after
    it (an accumulate into C and a rank term included, whose adds run in the caller's mode),
    every thread that ran a tile — numpy on this one, the next kernels on the team — makes and
    reads denormals again."""
    rng = np.random.default_rng(3)
    tiny = np.full((1024, 1024), 2.0 ** -70, np.float32)     # split over the team's threads
    scale = np.full((1024, 1024), 2.0 ** -63, np.float32)
    want = np.full((1024, 1024), 2.0 ** -133, np.float32)
    assert want[0, 0] != 0 and (tiny * scale == want).all()
    An = rng.standard_normal((200, 300)).astype(np.float32)
    Xn = rng.standard_normal((200, 4)).astype(np.float32)
    An[:10] = Xn[:10] = 0                     # rows whose product and rank term are zeros
    with fu.ExecContext(threads=threads) as ctx:
        A, X = ctx.from_numpy(An), ctx.from_numpy(Xn)
        B = ctx.from_numpy(rng.standard_normal((300, 90)).astype(np.float32), dtype="bf16")
        Y = ctx.from_numpy(rng.standard_normal((4, 90)).astype(np.float32))
        out = ctx.from_numpy(np.full((200, 90), 2.0 ** -140, np.float32))
        gemm_bf16(ctx, A, B, "emulated", out=out, accumulate=True, rank_add=(X, Y, 0.5))
        # a denormal C plus zeros stays itself (FTZ / DAZ would make it a zero)
        assert_bitwise(out.to_numpy()[:10], np.full((10, 90), 2.0 ** -140, np.float32))
        assert_bitwise(tiny * scale, want)
        c = ew.run(ctx, "mul", "f32", tiny.shape, (ctx.from_numpy(tiny), ctx.from_numpy(scale)))
        assert_bitwise(c.to_numpy(), want)


# ---- Muon's Newton–Schulz through the bf16 GEMM (ns_dtype="bf16", bf16 leaves only) ---------

def _ns_reference(u, steps, bf16_gemm):
    """Newton–Schulz in float64, each GEMM's operands rounded to bf16 when asked."""
    from fucina.exec.optim_lowrank import NS_A, NS_B, NS_C, NS_EPS
    r = (lambda v: bf16(v.astype(np.float32)).astype(np.float64)) if bf16_gemm else (lambda v: v)
    x = u.astype(np.float64)
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / (np.sqrt((x * x).sum()) + NS_EPS)
    for _ in range(steps):
        a = r(x) @ r(x).T
        q = NS_B * a + NS_C * (r(a) @ r(a))
        x = NS_A * x + r(q) @ r(x)
    return x.T if u.shape[0] > u.shape[1] else x


@pytest.mark.parametrize("shape", [(48, 80), (96, 40)])
def test_newton_schulz_bf16_against_float64(ctx1, shape):
    from fucina.exec.optim_lowrank import newton_schulz5
    rng = np.random.default_rng(13)
    u = rng.standard_normal(shape).astype(np.float32)
    got = newton_schulz5(ctx1, ctx1.from_numpy(u), 5, bf16=True).to_numpy()
    want = _ns_reference(u, 5, True)
    assert np.abs(got - want).max() < 2e-2                # bf16 rounding of every GEMM input
    f32 = newton_schulz5(ctx1, ctx1.from_numpy(u), 5).to_numpy()
    assert np.abs(got - f32).max() > 1e-4                 # it did run in bf16
    s = np.linalg.svd(got.astype(np.float64), compute_uv=False)
    assert 0.4 < s.min() and s.max() < 1.6                # still orthogonalised


def test_muon_ns_dtype_applies_to_bf16_leaves_only(ctx1):
    rng = np.random.default_rng(14)
    shape = (24, 40)
    w0 = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)

    def step(dtype, ns_dtype):
        w = ctx1.variable(w0, ("o", "i"), dtype=dtype)
        opt = fu.optim.Muon(lr=0.03, ns_dtype=ns_dtype)
        opt.add_param(w)
        feed_grad(ctx1, w, g)
        opt.step()
        return opt.state_of(w)["master"] if dtype == "bf16" else w.numpy()

    assert_bitwise(step("f32", "bf16"), step("f32", "f32"))      # f32 leaves: f32 NS
    m16, m32 = step("bf16", "bf16"), step("bf16", "f32")
    d = np.abs(m16 - m32).max()
    assert 0 < d < 0.03 * 0.05                                   # lr · a bf16-sized error
    with pytest.raises(fu.InvalidOptimizerConfig, match="ns_dtype: expected one of f32, bf16"):
        fu.optim.Muon(lr=0.03, ns_dtype="f16")
