"""GEMM (fucina.exec.matmul.gemm) against float64 numpy, and bitwise across thread counts.

Tolerance (SPEC §0.5, GEMMs |Δ| <= 1e-5·k) scaled by the operands' magnitudes:
|Δ| <= 1e-5 · K · max|a| · max|b| (+ the same for the added tensor when accumulating).
"""
import numpy as np
import pytest

import fucina as fu
from fucina.codegen import kernels
from fucina.exec import matmul as mm
from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from fucina.exec.matmul import gemm
from conftest import asm_loops, assert_bitwise, assert_cold_equals_warm

SHAPES = [(1, 1, 1), (37, 129, 65), (3, 4096, 17), (2, 300, 50), (1, 1000, 37), (5, 7, 3),
          (64, 64, 64), (256, 1024, 8), (40, 20, 200), (300, 9, 130), (37, 600, 500),
          (45, 530, 700), (3, 700, 500), (1, 300, 1000), (300, 600, 500)]
ORIENT = [(False, False), (True, False), (False, True), (True, True)]


def _operand(ctx, arr, transposed, dtype="f32"):
    """A RawTensor holding `arr` (shape [..., r, c]); stored transposed when asked, so the view
    has swapped strides."""
    if not transposed:
        return ctx.from_numpy(arr, dtype=dtype)
    r = arr.ndim
    perm = tuple(range(r - 2)) + (r - 1, r - 2)
    t = ctx.from_numpy(np.ascontiguousarray(arr.transpose(perm)), dtype=dtype)
    return t.permute(perm)


def _product(ctx, A, B, ta, tb):
    return gemm(ctx, _operand(ctx, A, ta), _operand(ctx, B, tb)).to_numpy()


def _ref(A, B):
    return np.matmul(A.astype(np.float64), B.astype(np.float64))


def _tol(A, B, extra=0.0):
    K = A.shape[-1]
    return 1e-5 * K * max(np.abs(A).max(), 1e-30) * max(np.abs(B).max(), 1e-30) + extra


def _data(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _rowvec_anywhere(monkeypatch):
    """rowvec for every small-b shape whatever the host (with 16 registers or on Intel
    _rowvec_pays keeps it only for some)."""
    monkeypatch.setattr(mm, "AVX2_ROWS", 1 << 30)
    monkeypatch.setattr(mm, "INTEL_ROWS", 1 << 30)


def _route(monkeypatch, direct):
    """Every shape through the tile kernels: pack + tiles, or (direct) b read in place where
    it applies."""
    monkeypatch.setattr(mm, "SMALL_M", 0)
    monkeypatch.setattr(mm, "DOT_N", 0)
    monkeypatch.setattr(mm, "RV_MAX_B", 0)
    monkeypatch.setattr(mm, "RV_ROWS", 0)
    monkeypatch.setattr(mm, "DIRECT_B", direct)
    mm._plans.clear()


@pytest.fixture
def force_packed(monkeypatch):
    """Route every shape through the packed path (pack + tiles), edges and all."""
    _route(monkeypatch, False)
    yield
    mm._plans.clear()


@pytest.fixture
def force_direct(monkeypatch):
    """Route every shape through the tile kernels, b read in place wherever that applies."""
    _route(monkeypatch, True)
    yield
    mm._plans.clear()


def _direct_applies(M, K):
    from fucina.codegen import gemm as g
    Mp = -(-M // g.mr()) * g.mr()
    return Mp <= max(1, mm.DIRECT_MC_ROWS // g.mr()) * g.mr()


def _both_threads(fn):
    """fn(ctx) -> numpy result, at 1 and 2 threads; asserts the bits agree, returns the result."""
    outs = []
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            outs.append(fn(ctx))
    assert_bitwise(outs[0], outs[1])
    return outs[0]


def _shape_case(shape, ta, tb):
    M, K, N = shape
    rng = np.random.default_rng(M * 1000 + K + N)
    A, B = _data(rng, M, K), _data(rng, K, N)

    def run(ctx):
        a, b = _operand(ctx, A, ta), _operand(ctx, B, tb)
        c = gemm(ctx, a, b)
        assert c.shape == (M, N) and c.dtype == "f32" and c.is_contiguous()
        return c.to_numpy(), mm.path_of(a, b)

    outs = []
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            outs.append(run(ctx))
    assert_bitwise(outs[0][0], outs[1][0])
    got, path = outs[0]
    assert np.abs(got - _ref(A, B)).max() <= _tol(A, B)
    return got, path


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb", ORIENT, ids=["nn", "tn", "nt", "tt"])
def test_shapes_and_orientations(shape, ta, tb):
    _shape_case(shape, ta, tb)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb", ORIENT, ids=["nn", "tn", "nt", "tt"])
def test_packed_path_everywhere(shape, ta, tb, force_packed):
    """The packed path at every shape (edges in M, N and K; K over several KC blocks)."""
    assert _shape_case(shape, ta, tb)[1] == "packed"


@pytest.mark.parametrize("shape", SHAPES + [(8, 256, 32), (288, 513, 33), (289, 40, 70)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb", ORIENT, ids=["nn", "tn", "nt", "tt"])
def test_direct_b_path_everywhere(shape, ta, tb, force_direct, monkeypatch):
    """The tile kernel reading b in place (gemm_tile_direct: wvec for b as given, kvec for
    b = Wᵀ) at every shape with one M block, edges in N and K over several KC blocks: against
    numpy, bitwise at 1 and 2 threads, and bitwise the pack + tiles path (one micro-kernel)."""
    got, path = _shape_case(shape, ta, tb)
    M, K, N = shape
    assert path == ("packed direct-b" if _direct_applies(M, K) else "packed")
    monkeypatch.setattr(mm, "DIRECT_B", False)
    mm._plans.clear()
    packed, path = _shape_case(shape, ta, tb)
    assert path == "packed"
    assert_bitwise(got, packed)


@pytest.mark.parametrize("ta,tb", ORIENT, ids=["nn", "tn", "nt", "tt"])
def test_direct_b_two_column_blocks(ta, tb, force_direct, monkeypatch):
    """An A too big to re-read from cache gets two N blocks (the grid for a deep K): the same
    bits as pack + tiles, at 1 and 2 threads."""
    monkeypatch.setattr(mm, "DIRECT_MAX_A", 0)
    got, path = _shape_case((45, 1100, 230), ta, tb)
    assert path == "packed direct-b"
    assert mm._plans and all(p.steps[-1][1] == 2 for p in mm._plans.values())
    monkeypatch.setattr(mm, "DIRECT_B", False)
    mm._plans.clear()
    assert_bitwise(got, _shape_case((45, 1100, 230), ta, tb)[0])


def test_two_threads_get_equal_halves():
    """The runtime hands each of two threads a contiguous half of a launch's chunks, so the
    direct-b plans of the LoRA step's M = 256 products launch an even number of pack and tile
    chunks (18 column panels: 18 blocks of one, not 9 of two run as 5 + 4; 28 panels: 14 blocks
    of two, not 10 of three run as 15 + 13 panels), bits unchanged."""
    assert [mm.even_blocks(n, m) for n, m in ((18, 2), (48, 6), (20, 2), (7, 1), (1, 8),
                                               (28, 3), (152, 8), (18, 8))] == \
        [1, 6, 2, 1, 1, 2, 4, 3]
    rng = np.random.default_rng(3)
    for M, K, N in ((256, 576, 576), (256, 1536, 576), (200, 576, 576)):
        A, W = _data(rng, M, K), _data(rng, N, K)
        with fu.ExecContext(threads=2) as ctx:
            a, w = ctx.from_numpy(A), ctx.from_numpy(W).permute((1, 0))
            mm._plans.clear()
            got = gemm(ctx, a, w).to_numpy()
            assert mm.path_of(a, w) == "packed direct-b"
            (plan,) = mm._plans.values()
            assert all(n % 2 == 0 for _, n, *_ in plan.steps), [s[1] for s in plan.steps]
        np.testing.assert_allclose(got, _ref(A, W.T), rtol=0, atol=_tol(A, W))
    mm._plans.clear()


@pytest.mark.parametrize("route", ["direct-b", "packed", "rowvec"])
@pytest.mark.parametrize("r", [1, 8])
def test_rank_add_is_the_separate_pass(route, r, monkeypatch):
    """gemm(a, b, rank_add=(x, y, s)) adds s·(x·y) in its kernels' stores (the tiles' or
    rowvec's, codegen.gemm.add_rank): the bits of gemm(x, y, out=c, accumulate=True, scale=s)
    run after it — plain, accumulating, scaled, in k slices, A packed or read in place, edges
    of every size, at 1 and 2 threads; a plan without such kernels (dot here) runs that pass
    itself."""
    from fucina.codegen import gemm as g
    rng = np.random.default_rng(r)
    cases = [(37, 2 * g.KC + 9, 70, False), (300, 70, 45, True), (9, 600, 33, True),
             (1, 5, 3, False)]

    def run(ctx, M, K, N, acc, ta, tb=False, ranked=True):
        data = np.random.default_rng(M + K + N)
        A, B = _data(data, M, K), _data(data, K, N)
        X, Y, C0 = _data(data, M, r), _data(data, r, N), _data(data, M, N)
        outs = []
        for fused in (True, False):
            a, b = _operand(ctx, A, ta), _operand(ctx, B, tb)
            x, y, c = ctx.from_numpy(X), ctx.from_numpy(Y), ctx.from_numpy(C0)
            kw = {"out": c, "accumulate": True} if acc else {}
            if fused:
                c = gemm(ctx, a, b, scale=0.75, rank_add=(x, y, 1.5), **kw)
                key = (a.lay, b.lay, c.lay if acc else None, acc, 0.75, True)
                assert mm._plans[key].ranked == ranked
                want = {"direct-b": "packed", "packed": "packed", "rowvec": "rowvec"}[route]
                assert not ranked or mm.path_of(a, b).startswith(want), mm.path_of(a, b)
            else:
                c = gemm(ctx, a, b, scale=0.75, **kw)
                gemm(ctx, x, y, out=c, accumulate=True, scale=1.5)
            outs.append(c.to_numpy())
        assert_bitwise(outs[0], outs[1])
        return outs[0]

    if route != "rowvec":
        _route(monkeypatch, route == "direct-b")
    else:
        _rowvec_anywhere(monkeypatch)
    monkeypatch.setattr(mm, "K_SLICE", 2 * g.KC)
    for M, K, N, acc in cases:
        for ta in (False, True):
            _both_threads(lambda ctx: run(ctx, M, K, N, acc, ta))
    if route == "rowvec":   # b = Wᵀ: rowvec packs b first, its rowvec launch adds the term
        _both_threads(lambda ctx: run(ctx, 37, 2 * g.KC + 9, 70, True, False, tb=True))
    mm._plans.clear()
    monkeypatch.undo()
    mm._plans.clear()
    with fu.ExecContext(threads=1) as ctx:
        run(ctx, 9, 40, 6, True, False, tb=True, ranked=False)   # dot: the pass after it
        with pytest.raises(fu.InvalidArgument, match="rank_add"):
            gemm(ctx, ctx.from_numpy(_data(rng, 2, 3, 4)), ctx.from_numpy(_data(rng, 2, 4, 5)),
                 rank_add=(ctx.from_numpy(_data(rng, 3, 1)), ctx.from_numpy(_data(rng, 1, 5)),
                           1.0))
    mm._plans.clear()


def _direct_and_packed(run, monkeypatch):
    """run(ctx) at 1 and 2 threads through the direct-b tiles (asserting that path), then
    through pack + tiles: all four bitwise equal; returns the result."""
    outs = []
    for direct in (True, False):
        _route(monkeypatch, direct)
        outs.append(_both_threads(lambda ctx: run(ctx, "packed direct-b" if direct else "packed")))
    mm._plans.clear()
    assert_bitwise(outs[0], outs[1])
    return outs[0]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_direct_b_half(dtype, tb, monkeypatch):
    """f16/bf16 b read in place widens exactly: the bits of the f32 product with b widened."""
    M, K, N = 37, 300, 65
    rng = np.random.default_rng(K + N)
    A, B = _data(rng, M, K), _data(rng, K, N)
    Bw = (B.astype(np.float16).astype(np.float32) if dtype == "f16"
          else bf16_bits_to_f32(f32_to_bf16_bits(B)))

    def run(ctx, path):
        a, bh = ctx.from_numpy(A), _operand(ctx, B, tb, dtype)
        assert mm.path_of(a, bh) == path
        half = gemm(ctx, a, bh).to_numpy()
        assert_bitwise(half, gemm(ctx, a, _operand(ctx, Bw, tb)).to_numpy())
        return half

    got = _direct_and_packed(run, monkeypatch)
    assert np.abs(got - _ref(A, Bw)).max() <= _tol(A, Bw)


@pytest.mark.parametrize("bcast", [False, True], ids=["batched-b", "broadcast-b"])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_direct_b_batched(bcast, tb, monkeypatch):
    """A batch of products with b read in place at its batch stride (0 when broadcast)."""
    nb, M, K, N = 3, 37, 300, 70
    rng = np.random.default_rng(nb * M)
    A, B = _data(rng, nb, M, K), _data(rng, 1 if bcast else nb, K, N)

    def run(ctx, path):
        a, b = ctx.from_numpy(A), _operand(ctx, B, tb)
        if bcast:
            b = b.broadcast_to((nb, K, N))
        assert mm.path_of(a, b) == path
        return gemm(ctx, a, b).to_numpy()

    got = _direct_and_packed(run, monkeypatch)
    assert np.abs(got - _ref(A, np.broadcast_to(B, (nb, K, N)))).max() <= _tol(A, B)


@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_direct_b_accumulate_and_views(tb, monkeypatch):
    """Accumulating over several KC blocks (partial sums in scratch), b a padded view and b
    with stride 0 along n, all through the direct-b tiles."""
    M, K, N = 40, 530, 100
    rng = np.random.default_rng(M + K)
    A, C0 = _data(rng, M, K), _data(rng, M, N)
    Bbig = _data(rng, K + 4, N + 9)
    bcol = _data(rng, K, 1)

    def run(ctx, path):
        a = ctx.from_numpy(A)
        base = _operand(ctx, Bbig, tb)
        b = base.narrow(0, 3, K).narrow(1, 4, N)            # rows (or columns) padded
        bz = ctx.from_numpy(bcol).broadcast_to((K, N))      # stride 0 along n: kvec
        assert mm.path_of(a, b) == path and mm.path_of(a, bz) == path
        acc = ctx.from_numpy(C0)
        gemm(ctx, a, b, out=acc, accumulate=True)
        return np.stack([acc.to_numpy(), gemm(ctx, a, bz).to_numpy()])

    got = _direct_and_packed(run, monkeypatch)
    Bv = Bbig[3:3 + K, 4:4 + N]
    assert np.abs(got[0] - (C0 + _ref(A, Bv))).max() <= _tol(A, Bv, 1e-6 * np.abs(C0).max())
    assert np.abs(got[1] - _ref(A, np.broadcast_to(bcol, (K, N)))).max() <= _tol(A, bcol)


def test_rowvec_takes_rows_up_to_its_bounds(monkeypatch):
    """b unit-stride along n (x · W, dx = g · W): rowvec up to rowvec_rows() rows of C (RV_ROWS;
    AVX2_BIG_ROWS with 16 registers, INTEL_ROWS on Intel) and a k of RV_ROWS_K, the tile path
    past either bound;
    both run each element's FMA chain, so rowvec is bitwise the packed path there (1 and 2
    threads)."""
    rng = np.random.default_rng(11)
    R, Kmax = mm.rowvec_rows(), mm.RV_ROWS_K
    rows = min(40, R)
    assert 300 * 1000 > mm.RV_MAX_B and Kmax * 200 > mm.RV_MAX_B   # b too big for L2 alone
    past = "packed" if R + 1 > mm.DIRECT_MC_ROWS else "packed direct-b"
    for (M, K, N), want in (((R, 300, 1000), "rowvec"), ((R + 1, 300, 1000), past),
                            ((rows, Kmax, 200), "rowvec"), ((rows, Kmax + 1, 200), "packed direct-b")):
        A, B = _data(rng, M, K), _data(rng, K, N)

        def run(ctx):
            a, b = ctx.from_numpy(A), ctx.from_numpy(B)
            return gemm(ctx, a, b).to_numpy(), mm.path_of(a, b)

        with fu.ExecContext(threads=1) as c1, fu.ExecContext(threads=2) as c2:
            (got, path), (got2, _) = run(c1), run(c2)
            assert path == want, (M, K, N, path)
            assert_bitwise(got, got2)
            with monkeypatch.context() as m:
                _route(m, False)
                packed, path = run(c1)
                assert path == "packed"
            mm._plans.clear()
        assert_bitwise(got, packed)
        assert np.abs(got - _ref(A, B)).max() <= _tol(A, B)


def test_paths_are_covered_and_rowvec_matches_packed():
    """The shape list reaches every path; rowvec runs the same FMA chain per element as the
    packed path, so the two agree bit for bit (the dot path sums in another fixed order)."""
    seen = set()
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        M, K, N = shape
        A, B = _data(rng, M, K), _data(rng, K, N)
        for ta, tb in ORIENT:
            with fu.ExecContext(threads=2) as ctx:
                a, b = _operand(ctx, A, ta), _operand(ctx, B, tb)
                path = mm.path_of(a, b)
                seen.add(path)
                got = gemm(ctx, a, b).to_numpy()
                if path.startswith("rowvec") or path == "packed direct-b":
                    saved = mm.SMALL_M, mm.DOT_N, mm.RV_MAX_B, mm.RV_ROWS, mm.DIRECT_B
                    mm.SMALL_M = mm.DOT_N = mm.RV_MAX_B = mm.RV_ROWS = 0
                    mm.DIRECT_B = False
                    mm._plans.clear()
                    try:
                        assert mm.path_of(a, b) == "packed"
                        assert_bitwise(got, gemm(ctx, a, b).to_numpy())
                    finally:
                        mm.SMALL_M, mm.DOT_N, mm.RV_MAX_B, mm.RV_ROWS, mm.DIRECT_B = saved
                        mm._plans.clear()
    assert seen == {"rowvec", "rowvec packed-b", "dot", "dot copied-b", "packed",
                    "packed direct-b"}


@pytest.mark.parametrize("tb", [False, True], ids=["nn", "nt"])
def test_big(tb):
    """256 x 1024 x 1024: x·W and x·Wᵀ (one big shape per common orientation keeps it fast)."""
    ta = False
    M, K, N = 256, 1024, 1024
    rng = np.random.default_rng(7)
    A, B = _data(rng, M, K), _data(rng, K, N)
    got = _both_threads(lambda ctx: _product(ctx, A, B, ta, tb))
    assert np.abs(got - _ref(A, B)).max() <= _tol(A, B)


def test_orientation_does_not_change_packed_bits():
    """Packing reads every orientation into the same panels: same bits for all four."""
    rng = np.random.default_rng(3)
    A, B = _data(rng, 70, 300), _data(rng, 300, 90)
    with fu.ExecContext(threads=2) as ctx:
        res = [_product(ctx, A, B, ta, tb) for ta, tb in ORIENT]
    for r in res[1:]:
        assert_bitwise(r, res[0])


def test_batched():
    rng = np.random.default_rng(11)
    A, B = _data(rng, 3, 37, 65), _data(rng, 3, 65, 29)
    for ta, tb in ORIENT:
        got = _both_threads(lambda ctx: _product(ctx, A, B, ta, tb))
        assert got.shape == (3, 37, 29)
        assert np.abs(got - _ref(A, B)).max() <= _tol(A, B)


@pytest.mark.parametrize("shape", [(3, 37, 65, 29), (4, 2, 300, 40), (2, 64, 64, 64),
                                   (5, 200, 256, 8)])
def test_batch_broadcast(shape):
    nb, M, K, N = shape
    rng = np.random.default_rng(nb + M)
    A, B = _data(rng, nb, M, K), _data(rng, 1, K, N)
    A1, B1 = _data(rng, 1, M, K), _data(rng, nb, K, N)

    def run(ctx):
        b = ctx.from_numpy(B).broadcast_to((nb, K, N))
        a1 = ctx.from_numpy(A1).broadcast_to((nb, M, K))
        assert b.strides[0] == 0 and a1.strides[0] == 0
        return np.stack([gemm(ctx, ctx.from_numpy(A), b).to_numpy(),
                         gemm(ctx, a1, ctx.from_numpy(B1)).to_numpy()])

    got = _both_threads(run)
    assert np.abs(got[0] - _ref(A, np.broadcast_to(B, (nb, K, N)))).max() <= _tol(A, B)
    assert np.abs(got[1] - _ref(np.broadcast_to(A1, (nb, M, K)), B1)).max() <= _tol(A1, B1)


@pytest.mark.parametrize("MKN", [(9, 12, 7), (30, 40, 50)], ids=["rowvec", "packed"])
def test_many_batch_axes(MKN):
    """Five batch axes that cannot be merged (a's are permuted): the leading ones loop outside."""
    M, K, N = MKN
    rng = np.random.default_rng(5)
    A = _data(rng, 2, 3, 2, 3, 2, M, K)
    B = _data(rng, 2, 3, 2, 3, 2, K, N)
    perm = (4, 3, 2, 1, 0, 5, 6)

    def run(ctx):
        a = ctx.from_numpy(A).permute(perm)
        b = ctx.from_numpy(B)
        assert mm.path_of(a, b).endswith("outer")
        return gemm(ctx, a, b).to_numpy()

    got = _both_threads(run)
    want = _ref(A.transpose(perm), B)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= _tol(A, B)


@pytest.mark.parametrize("shape", [(37, 129, 65), (2, 300, 50), (300, 400, 10)])
def test_non_contiguous_views(shape):
    M, K, N = shape
    rng = np.random.default_rng(M + N)
    A, B = _data(rng, M + 5, 2 * K + 3), _data(rng, K + 4, N + 9)

    def run(ctx):
        a = ctx.from_numpy(A).narrow(0, 2, M).narrow(1, 1, 2 * K)
        a = a.view((M, K), (a.strides[0], 2), a.offset)            # every other column
        b = ctx.from_numpy(B).narrow(0, 3, K).narrow(1, 4, N)      # rows padded by 9
        return gemm(ctx, a, b).to_numpy()

    got = _both_threads(run)
    Av, Bv = A[2:2 + M, 1:1 + 2 * K:2], B[3:3 + K, 4:4 + N]
    assert np.abs(got - _ref(Av, Bv)).max() <= _tol(Av, Bv)


@pytest.mark.parametrize("shape", [(37, 129, 65), (2, 300, 50), (300, 40, 6), (40, 700, 600)])
def test_zero_strides_inside_the_matrices(shape):
    """Broadcast rows of a (stride 0 along M) and broadcast columns of b (stride 0 along N)."""
    M, K, N = shape
    rng = np.random.default_rng(M + 2 * K)
    arow, bcol = _data(rng, 1, K), _data(rng, K, 1)
    A, B = np.broadcast_to(arow, (M, K)), np.broadcast_to(bcol, (K, N))

    def run(ctx):
        a = ctx.from_numpy(arow).broadcast_to((M, K))
        b = ctx.from_numpy(bcol).broadcast_to((K, N))
        assert a.strides[0] == 0 and b.strides[1] == 0
        return gemm(ctx, a, b).to_numpy()

    got = _both_threads(run)
    assert np.abs(got - _ref(A, B)).max() <= _tol(A, B)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("shape", [(37, 129, 65), (2, 300, 50), (1, 1000, 37), (256, 512, 8),
                                   (3, 17, 40)])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_half_b_widens_exactly(dtype, shape, tb):
    """f16/bf16 b gives the bits of the f32 product with b widened (widening is exact)."""
    M, K, N = shape
    rng = np.random.default_rng(K)
    A, B = _data(rng, M, K), _data(rng, K, N)
    Bw = (B.astype(np.float16).astype(np.float32) if dtype == "f16"
          else bf16_bits_to_f32(f32_to_bf16_bits(B)))

    def run(ctx):
        a = ctx.from_numpy(A)
        half = gemm(ctx, a, _operand(ctx, B, tb, dtype)).to_numpy()
        wide = gemm(ctx, a, _operand(ctx, Bw, tb)).to_numpy()
        assert_bitwise(half, wide)
        return half

    got = _both_threads(run)
    assert np.abs(got - _ref(A, Bw)).max() <= _tol(A, Bw)


@pytest.mark.parametrize("shape", [(37, 129, 65), (20, 700, 90), (2, 300, 50), (1, 1000, 37),
                                   (256, 512, 8), (3, 5, 4), (3, 700, 500), (40, 530, 700)])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_accumulate_and_out(shape, tb):
    """out += a·b is out + (the plain product), rounded once: bitwise."""
    M, K, N = shape
    rng = np.random.default_rng(M * K)
    A, B, C0 = _data(rng, M, K), _data(rng, K, N), _data(rng, M, N)

    def run(ctx):
        a, b = ctx.from_numpy(A), _operand(ctx, B, tb)
        plain = gemm(ctx, a, b).to_numpy()
        out = ctx.empty((M, N))
        r = gemm(ctx, a, b, out=out)
        assert r is out
        assert_bitwise(out.to_numpy(), plain)
        acc = ctx.from_numpy(C0)
        r = gemm(ctx, a, b, out=acc, accumulate=True)
        assert r is acc
        assert_bitwise(acc.to_numpy(), C0 + plain)
        return acc.to_numpy()

    got = _both_threads(run)
    assert np.abs(got - (C0 + _ref(A, B))).max() <= _tol(A, B, 1e-6 * np.abs(C0).max())


@pytest.mark.parametrize("direct", [False, True], ids=["packed", "direct-b"])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_c_prefetch_keeps_the_bits(direct, tb, monkeypatch):
    """The tile kernels that prefetch the next micro-tile's C lines (pf_c, chosen for a big C)
    give the bits of those that do not: plain, into `out`, and accumulating (partial sums in
    the scratch buffer), at 1 and 2 threads."""
    rng = np.random.default_rng(11)
    M, K, N = 45, 600, 230
    A, B, C0 = _data(rng, M, K), _data(rng, K, N), _data(rng, M, N)

    run = _plain_and_accumulated(A, B, C0, tb)
    outs = []
    for pf_min in (1 << 62, 0):
        _route(monkeypatch, direct)
        monkeypatch.setattr(mm, "PF_C_MIN", pf_min)
        mm._plans.clear()
        outs.append(_both_threads(run))
        assert {key.pf_c for key in _tile_keys()} == {pf_min == 0}
    mm._plans.clear()
    assert_bitwise(outs[0], outs[1])


def _plain_and_accumulated(A, B, C0, tb):
    """run(ctx) -> [a·b, C0 + a·b] (b stored transposed when tb), for _both_threads."""
    def run(ctx):
        a, b = ctx.from_numpy(A), _operand(ctx, B, tb)
        acc = ctx.from_numpy(C0)
        gemm(ctx, a, b, out=acc, accumulate=True)
        return np.stack([gemm(ctx, a, b).to_numpy(), acc.to_numpy()])
    return run


def _tile_keys():
    """The tile kernel keys the current plans launch."""
    from fucina.codegen import gemm as g
    from fucina.codegen import kernels
    addrs = {step[0] for p in mm._plans.values() for step in p.steps}
    return [k for k, a in kernels._memo.items() if a in addrs
            and isinstance(k, (g.GemmTileKey, g.GemmTileDirectKey))]


def test_accumulate_batched_broadcast():
    rng = np.random.default_rng(2)
    A, B, C0 = _data(rng, 3, 20, 600), _data(rng, 1, 600, 40), _data(rng, 3, 20, 40)

    def run(ctx):
        acc = ctx.from_numpy(C0)
        gemm(ctx, ctx.from_numpy(A), ctx.from_numpy(B).broadcast_to((3, 600, 40)), out=acc,
             accumulate=True)
        return acc.to_numpy()

    got = _both_threads(run)
    assert np.abs(got - (C0 + _ref(A, B))).max() <= _tol(A, B, 1e-6)


def test_special_values_stay_in_their_element():
    """inf/nan in one row of a reach only that row of c (zero padding never leaks)."""
    A = np.ones((20, 40), np.float32)
    A[3, 5] = np.inf
    A[17, 0] = np.nan
    B = np.ones((40, 50), np.float32)
    with fu.ExecContext(threads=2) as ctx:
        c = gemm(ctx, ctx.from_numpy(A), ctx.from_numpy(B)).to_numpy()
    assert np.isinf(c[3]).all() and np.isnan(c[17]).all()
    rest = np.delete(c, [3, 17], axis=0)
    assert (rest == 40).all()


def test_cold_compile_equals_warm_load(tmp_path, monkeypatch):
    monkeypatch.setenv("FUCINA_CACHE_DIR", str(tmp_path))  # a private cache: this test compiles
    for var in ("FUCINA_CACHE", "FUCINA_ASSERT_WARM", "FUCINA_RECORD_MANIFEST"):
        monkeypatch.delenv(var, raising=False)
    rng = np.random.default_rng(9)
    cases = [(_data(rng, 37, 300), _data(rng, 300, 65), False),   # packed
             (_data(rng, 2, 300), _data(rng, 300, 50), False),     # rowvec
             (_data(rng, 1, 300), _data(rng, 300, 50), True)]      # dot

    def forget():
        for k in [k for k in kernels._memo if k.family.startswith("gemm")]:
            del kernels._memo[k]
        mm._plans.clear()

    def run():
        with fu.ExecContext(threads=2) as ctx:
            return [gemm(ctx, ctx.from_numpy(A), _operand(ctx, B, tb)).to_numpy()
                    for A, B, tb in cases]

    assert_cold_equals_warm(forget, run)


def test_bad_inputs(ctx):
    a = ctx.from_numpy(np.ones((3, 4), np.float32))
    b = ctx.from_numpy(np.ones((4, 5), np.float32))
    with pytest.raises(fu.DTypeError, match="operand a"):
        gemm(ctx, ctx.from_numpy(np.ones((3, 4)), dtype="f16"), b)
    with pytest.raises(fu.DTypeError, match="operand b"):
        gemm(ctx, a, ctx.from_numpy(np.ones((4, 5)), dtype="i64"))
    with pytest.raises(fu.ShapeMismatch, match="contraction"):
        gemm(ctx, a, ctx.from_numpy(np.ones((5, 5), np.float32)))
    with pytest.raises(fu.ShapeMismatch, match="rank"):
        gemm(ctx, a, ctx.from_numpy(np.ones((2, 4, 5), np.float32)))
    with pytest.raises(fu.ShapeMismatch, match="rank"):
        v = ctx.from_numpy(np.ones((4,), np.float32))
        gemm(ctx, v, v)
    with pytest.raises(fu.ShapeMismatch, match="batch"):
        gemm(ctx, ctx.from_numpy(np.ones((2, 3, 4), np.float32)),
             ctx.from_numpy(np.ones((3, 4, 5), np.float32)))
    with pytest.raises(fu.ShapeMismatch, match="operand out"):
        gemm(ctx, a, b, out=ctx.empty((3, 4)))
    with pytest.raises(fu.DTypeError, match="operand out"):
        gemm(ctx, a, b, out=ctx.empty((3, 5), "f16"))
    with pytest.raises(fu.ShapeMismatch, match="operand out"):
        gemm(ctx, a, b, out=ctx.empty((5, 3)).permute((1, 0)))
    with pytest.raises(fu.FucinaError):
        gemm(ctx, a, b, out=ctx.empty((3, 5)).permute((1, 0)).permute((1, 0)).view((3, 5), (1, 3)))


def _hot_loop(asm: str) -> list[str]:
    """The innermost loop (label ... backward jump to it) with the most FMAs: among loops, the
    one whose body has the most FMAs and, for equal counts, the shortest body."""
    loops = asm_loops(asm)
    # innermost: drop loops that contain another loop's label and back-jump
    inner = [b for b in loops if not any(o is not b and len(o) < len(b) and o[0] in b and o[-1] in b
                                         for o in loops)]
    return max(inner, key=lambda b: sum("vfmadd" in x for x in b), default=[])


@pytest.mark.parametrize("kind", ["packed", "packed-rows", "direct-wvec", "direct-kvec"])
def test_micro_kernel_inner_loop_is_tight(kind):
    """The tile kernel's hot loop: MR x NR/16 x UNROLL zmm FMAs, no stack traffic (no spills;
    the direct-b kernels' panel buffer is addressed through a register like packed B)."""
    from fucina.codegen import gemm as g
    from fucina.codegen.jit import assembly
    from fucina.codegen.target import host

    key = (g.GemmTileKey(g.mr(), g.NR_VECS, g.UNROLL, a_rows=kind == "packed-rows")
           if kind.startswith("packed") else
           g.GemmTileDirectKey("f32", kind.split("-")[1], g.mr(), g.NR_VECS, g.UNROLL))
    body = _hot_loop(assembly(key.ir("k")))
    fmas = [x for x in body if "vfmadd" in x]
    reg = {512: "zmm", 256: "ymm"}.get(host().vector_bits, "xmm")
    assert len(fmas) == g.mr() * g.NR_VECS * g.UNROLL
    assert all(reg in x for x in fmas)
    # no spills: a spill or its reload addresses the frame at a fixed offset, N(%rsp) or
    # N(%rbp); indexed reads (base,index) are a panel (the direct kernels' B buffer lives on
    # the stack; rbp may be a general register)
    import re
    spill = re.compile(r"-?\d*\(%r[sb]p\)")
    assert not [x for x in body if spill.search(x)], "stack traffic in the hot loop"
    stores = [x for x in body if x.rstrip().endswith(")") and "%rsp" in x[x.rfind("("):]]
    assert not stores, "stores to the stack in the hot loop"
    if kind.startswith("packed"):
        assert not [x for x in body if "%rsp" in x], "stack traffic in the hot loop"


@pytest.mark.parametrize("route", ["default", "packed", "direct"])
def test_scale_is_the_rounded_product_times_scale(route, monkeypatch):
    """gemm(scale=s) rounds each sum as s·sum before storing it (or adding it to out): bitwise
    (a·b).scale(s), and out.add((a·b).scale(s)) with accumulate — on every path (rowvec with
    b packed or not, dot, the tiles with K past one k block), at 1 and 2 threads; a scale that
    is no f32 value is refused."""
    from fucina.errors import InvalidArgument
    from fucina.exec import elementwise as ew
    if route != "default":
        _route(monkeypatch, route == "direct")
    s = float(np.float32(5 / 3))
    rng = np.random.default_rng(12)
    cases = [(300, 8, 200, True), (300, 8, 70, False), (3, 600, 40, False),
             (300, 700, 8, False), (300, 600, 8, True), (70, 600, 90, False),
             (120, 300, 50, True)]
    for M, K, N, tb in cases:
        A, B, C0 = _data(rng, M, K), _data(rng, K, N), _data(rng, M, N)

        def run(ctx):
            a, b = ctx.from_numpy(A), _operand(ctx, B, tb)
            c0 = ctx.from_numpy(C0)
            p = gemm(ctx, a, b)
            want = [ew.run(ctx, "mul", "f32", (M, N), (p, s)).to_numpy(),
                    ew.run(ctx, "add_scaled", "f32", (M, N), (c0, p, s)).to_numpy()]
            gemm(ctx, a, b, out=c0, accumulate=True, scale=s)
            got = [gemm(ctx, a, b, scale=s).to_numpy(), c0.to_numpy()]
            return np.stack(want + got)

        out = _both_threads(run)
        assert_bitwise(out[2], out[0])
        assert_bitwise(out[3], out[1])
    mm._plans.clear()
    with fu.ExecContext(threads=1) as ctx:
        a, b = ctx.from_numpy(A), ctx.from_numpy(B)
        for bad in (0.1, float("inf"), 2):
            with pytest.raises(InvalidArgument, match="scale"):
                gemm(ctx, a, b, scale=bad)


def test_rowvec_order_keeps_the_bits(monkeypatch):
    """A short-k rowvec writes C row by row (column blocks fastest, C lines prefetched): the
    bits of the row-groups-first order, plain and accumulating, at 1 and 2 threads."""
    rng = np.random.default_rng(13)
    A, B, C0 = _data(rng, 301, 8), _data(rng, 8, 333), _data(rng, 301, 333)
    _rowvec_anywhere(monkeypatch)

    run = _plain_and_accumulated(A, B, C0, True)
    outs = []
    for cols_k in (0, 16):
        monkeypatch.setattr(mm, "RV_COLS_K", cols_k)
        mm._plans.clear()
        outs.append(_both_threads(run))
        assert all(p.kind.startswith("rowvec") and p.steps[-1][-1][-1] == int(cols_k > 0)
                   for p in mm._plans.values())
    mm._plans.clear()
    assert_bitwise(outs[0], outs[1])
    np.testing.assert_allclose(outs[0][0], _ref(A, B), rtol=0, atol=_tol(A, B))


@pytest.mark.parametrize("direct", [False, True], ids=["packed", "direct-b"])
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
@pytest.mark.parametrize("scale", [1.0, float(np.float32(5 / 3))])
def test_k_slices_keep_the_bits(direct, tb, scale, monkeypatch):
    """A long k in slices of whole KC blocks (the last one shorter), each continuing the sums
    the previous left behind: the bits of one pass over k — plain, into `out` and
    accumulating (the partial sums then in the scratch buffer), scaled, at 1 and 2 threads."""
    from fucina.codegen import gemm as g
    rng = np.random.default_rng(12)
    M, K, N = 45, 5 * g.KC + 37, 70
    A, B, C0 = _data(rng, M, K), _data(rng, K, N), _data(rng, M, N)

    def run(ctx):
        a, b = ctx.from_numpy(A), _operand(ctx, B, tb)
        acc = ctx.from_numpy(C0)
        gemm(ctx, a, b, out=acc, accumulate=True, scale=scale)
        return np.stack([gemm(ctx, a, b, scale=scale).to_numpy(), acc.to_numpy()])

    outs = []
    for ks in (1 << 30, 2 * g.KC):
        _route(monkeypatch, direct)
        monkeypatch.setattr(mm, "K_SLICE", ks)
        mm._plans.clear()
        outs.append(_both_threads(run))
        from fucina.codegen import kernels
        tile_addrs = {kernels._memo[k] for k in _tile_keys()}
        launches = sum(s[0] in tile_addrs for p in mm._plans.values() for s in p.steps)
        assert launches == 2 * (1 if ks > K else 3)   # two plans; 3 slices: 512, 512, 293
    mm._plans.clear()
    assert_bitwise(outs[0], outs[1])
    np.testing.assert_allclose(outs[0][0], scale * _ref(A, B), rtol=0, atol=_tol(A, B))


@pytest.mark.parametrize("shape", [(300, 40, 70), (1000, 2 * 256 + 37, 33), (617, 576, 192)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tb", [False, True], ids=["n", "t"])
def test_a_read_in_place_keeps_the_bits(shape, tb, monkeypatch):
    """Beside packed b, a row-major A (also a view with a longer row stride) is read in place
    by the tile kernel — no pack pass over it, a partial last micro-tile re-reading A's last
    row into accumulators it never stores — with the bits of packed A panels: plain, scaled,
    accumulating into out, in k slices, at 1 and 2 threads; a transposed A is still packed."""
    from fucina.codegen import gemm as g
    M, K, N = shape
    rng = np.random.default_rng(M + K)
    A, B, C0 = _data(rng, M, K + 5), _data(rng, K, N), _data(rng, M, N)

    def run(ctx):
        a = ctx.from_numpy(A)
        a = a.view((M, K), a.strides)               # row stride K + 5
        b, acc = _operand(ctx, B, tb), ctx.from_numpy(C0)
        gemm(ctx, a, b, out=acc, accumulate=True, scale=0.75)
        at = _operand(ctx, np.ascontiguousarray(A[:, :K]), True)
        return np.stack([gemm(ctx, a, b).to_numpy(), acc.to_numpy(), gemm(ctx, at, b).to_numpy()])

    outs = []
    for rows in (False, True):
        _route(monkeypatch, False)
        monkeypatch.setattr(mm, "DIRECT_A", rows)
        monkeypatch.setattr(mm, "K_SLICE", 2 * g.KC)
        mm._plans.clear()
        outs.append(_both_threads(run))
        in_place = sorted({k.a_rows for k in _tile_keys()})
        assert in_place == ([False, True] if rows else [False])
    mm._plans.clear()
    assert_bitwise(outs[0], outs[1])
    np.testing.assert_allclose(outs[1][0], _ref(A[:, :K], B), rtol=0, atol=_tol(A, B))


@pytest.mark.parametrize("direct", [False, True], ids=["packed", "direct-b"])
@pytest.mark.parametrize("ta,tb", ORIENT, ids=["nn", "tn", "nt", "tt"])
def test_edge_rows_keep_their_chains(direct, ta, tb, monkeypatch):
    """The last panel of rows runs a micro-tile of EDGE_ROWS rows (M = 50: 6 x 8 + 2): every
    element is still the FMA chain of the rowvec kernel (an independent emitter), for each
    edge size, over several KC blocks, with scale and accumulate, at 1 and 2 threads."""
    from fucina.codegen import gemm as g
    rng = np.random.default_rng(5)
    K, N = 600, 70
    for M in range(1, 2 * g.mr() + 2):
        A, B, C0 = _data(rng, M, K), _data(rng, K, N), _data(rng, M, N)
        outs = {}
        for route in ("rowvec", "tile"):
            mm._plans.clear()
            if route == "tile":
                _route(monkeypatch, direct)
            else:
                monkeypatch.setattr(mm, "RV_MAX_B", 1 << 40)
            for th in (1, 2):
                with fu.ExecContext(threads=th) as ctx:
                    a, b = _operand(ctx, A, ta), _operand(ctx, B, tb)
                    if route == "rowvec" and not mm.path_of(a, b).startswith("rowvec"):
                        b = _operand(ctx, B, False)    # rowvec reads b along n
                    c = ctx.from_numpy(C0)
                    gemm(ctx, a, b, out=c, accumulate=True, scale=0.75)
                    outs.setdefault(route, []).append((gemm(ctx, a, b).to_numpy(), c.to_numpy()))
                    want = "packed" + (" direct-b" if direct and _direct_applies(M, K) else "")
                    assert mm.path_of(a, b).startswith("rowvec" if route == "rowvec" else want)
            monkeypatch.undo()
        for got in outs["tile"] + outs["rowvec"][1:]:
            for x, y in zip(got, outs["rowvec"][0]):
                assert_bitwise(x, y)
    mm._plans.clear()


def test_edge_rows_have_their_micro_tiles():
    """The tile kernel holds one inner loop per micro-tile height: MR and each EDGE_ROWS size
    below it, NR_VECS x UNROLL vector FMAs per row (whatever the vector width)."""
    from fucina.codegen import gemm as g
    from fucina.codegen.jit import assembly
    asm = assembly(g.GemmTileKey(g.mr(), g.NR_VECS, g.UNROLL).ir("k"))
    counts = {sum("vfmadd" in x for x in body) for body in asm_loops(asm)}
    per_row = g.NR_VECS * g.UNROLL
    assert {r * per_row for r in (g.mr(), *g.EDGE_ROWS) if r <= g.mr()} <= counts


@pytest.mark.parametrize("mode", ["kvec", "wvec"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k_tail", [37, 0], ids=["k-tail", "whole-blocks"])
@pytest.mark.parametrize("panels,width,dtype", [(5, "mr", "f32"), (13, "mr", "f32"),
                                                (7, "nr", "bf16")],
                         ids=["a-5", "a-13", "b-7-bf16"])
def test_pack_writes_its_panels_and_nothing_past_them(mode, threads, k_tail, panels, width,
                                                      dtype):
    """gemm_pack's panels, `width` rows each (A: MR, B: NR), in gemm_pack's layout
    P[kb][panel][k][w] (zeros past the rows; a bf16 source widened exactly): element for
    element, and not a float past the packed size — AVX2's 6-row rows are narrower than a
    vector: kvec stores whole vectors into the next row's start (row_spill), all but each
    panel's last row; wvec copies a group of whole panels in pieces (6 = 4 + 2 floats) and an
    edge group with masks. 13 panels make whole wvec groups and an edge one."""
    from fucina.codegen import gemm as g
    Wp, KC = (g.mr() if width == "mr" else g.nr()), g.KC
    M, K = (panels * Wp + 3, KC + k_tail) if k_tail else (panels * Wp, 2 * KC)
    A = _data(np.random.default_rng(M), M, K)
    if dtype == "bf16":
        A = bf16_bits_to_f32(f32_to_bf16_bits(A))
    with fu.ExecContext(threads=threads) as ctx:
        src = ctx.from_numpy(A if mode == "kvec" else np.ascontiguousarray(A.T), dtype=dtype)
        s_w, s_k = (K, 1) if mode == "kvec" else (1, M)
        step, _, size = mm.pack_step(mm.A, dtype, Wp, M, K, s_w, s_k, (1, 1, 1), (0, 0, 0), 1, 0)
        addr, n, cost, _, tail = step
        assert tail[:4] == (M, K, s_w, s_k)
        out = ctx.from_numpy(np.full(size + 64, 7.0, np.float32))
        ctx.launch(addr, n, cost, src.addr, out.addr, *tail)
        got = out.to_numpy()
    npan = -(-M // Wp)
    Ap = np.zeros((npan * Wp, K), np.float32)
    Ap[:M] = A
    want = np.concatenate([Ap[p * Wp:(p + 1) * Wp, k0:k0 + KC].T.reshape(-1)
                           for k0 in range(0, K, KC) for p in range(npan)])
    assert size == want.size
    assert_bitwise(got[:size], want)
    assert (got[size:] == 7.0).all()
