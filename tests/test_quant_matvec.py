"""One-token decode products x [1, K] · dequant(w [N, K])ᵀ (SPEC A-8) at the shapes a GGUF LLM
decodes with: every block format, the SmolLM2-135M shapes (576 -> 1536, 1536 -> 576 and the
576 -> 49152 tied head) and K-quant analogues (K a multiple of 256), an odd N; bitwise at 1 and
2 threads; one row through `dot` equal to the same row of a batch and to a vector LHS;
decode-step LHS layouts (extra unit axes, a strided view).

Tolerance (SPEC §0.5): the classic bound of an f32 sum of K products,
|Δ| <= K · 2^-24 · sum_k |x_k| |w_nk|, w the dequantized weight (`w.to('f32')`, exactly the
values the kernel multiplies: blocks are decoded by the same decoders, the activation is not
rounded), checked element by element against float64 numpy."""
import numpy as np
import pytest

import fucina as fu
from conftest import asm_loops, assert_bitwise
from fucina.codegen.quant import FORMATS
from fucina.ag import engine
from fucina.exec import quant as xq
from test_quant_matmul import blocks_for, check_close, qweight, rnd

GGUF_LLM = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
SMALL = [f for f in GGUF_LLM if FORMATS[f][0] == 32]
KQUANT = [f for f in GGUF_LLM if FORMATS[f][0] == 256]


def matvec(ctx, q, xa):
    y = ctx.tensor(xa, ("s", "i")).dot(q, "i")
    assert y.shape == (1, q.shape[0]) and y.tags == ("s", "o")
    assert xq.matmul_path(ctx.tensor(xa, ("s", "i"))._raw, q._raw) == "gemv"
    return y.numpy()


@pytest.mark.parametrize("fmt", SMALL)
@pytest.mark.parametrize("N,K", [(1536, 576), (576, 1536), (37, 192)])
def test_smollm2_shapes(ctx, fmt, N, K):
    q, wd = qweight(ctx, N, K, fmt)
    xa = rnd(1, K)
    check_close(matvec(ctx, q, xa), xa, wd)


@pytest.mark.parametrize("fmt", KQUANT)
@pytest.mark.parametrize("N,K", [(1536, 768), (768, 1536), (37, 512)])
def test_kquant_shapes(ctx, fmt, N, K):
    q, wd = qweight(ctx, N, K, fmt)
    xa = rnd(1, K)
    check_close(matvec(ctx, q, xa), xa, wd)


def test_tied_head(ctx1):
    """The SmolLM2 output head: q8_0 [49152, 576], one token."""
    q, wd = qweight(ctx1, 49152, 576, "q8_0")
    xa = rnd(1, 576)
    check_close(matvec(ctx1, q, xa), xa, wd)


@pytest.mark.parametrize("fmt", GGUF_LLM)
def test_one_and_two_threads_bitwise(fmt):
    """Work is split over output rows only; each output's sum order is fixed by K."""
    K = 768 if FORMATS[fmt][0] == 256 else 576
    raw = blocks_for(rnd(3001, K), fmt)
    xa = rnd(1, K)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            q = fu.Tensor(xq.from_bytes(c, raw.tobytes(), (3001, K), fmt), ("o", "i"))
            out.append(matvec(c, q, xa))
    assert_bitwise(out[0], out[1])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "q6_k"])
def test_one_row_equals_batch_row_and_vector(ctx1, fmt):
    K = 768 if FORMATS[fmt][0] == 256 else 576
    q, _ = qweight(ctx1, 300, K, fmt)
    xa = rnd(3, K)
    batch = ctx1.tensor(xa, ("s", "i")).dot(q, "i").numpy()
    for m in range(3):
        assert_bitwise(matvec(ctx1, q, xa[m:m + 1]), batch[m:m + 1])
        assert_bitwise(ctx1.tensor(xa[m], ("i",)).dot(q, "i").numpy(), batch[m])


def test_decode_step_layouts(ctx1):
    """[batch 1, seq 1, K] activations (extra unit axes) and a strided slice of a wider row."""
    q, wd = qweight(ctx1, 1536, 576, "q4_1")
    xa = rnd(1, 1, 576)
    y = ctx1.tensor(xa, ("b", "t", "i")).dot(q, "i")
    assert y.tags == ("b", "t", "o") and y.shape == (1, 1, 1536)
    check_close(y.numpy(), xa, wd)
    assert_bitwise(y.numpy()[0], matvec(ctx1, q, xa[0]))
    wide = ctx1.tensor(rnd(1, 1000), ("s", "i"))
    xs = wide.narrow("i", 200, 576)
    check_close(xs.dot(q, "i").numpy(), wide.numpy()[:, 200:776], wd)
    col = ctx1.tensor(np.ascontiguousarray(rnd(576, 1)), ("i", "s"))   # x stored [K, 1]
    check_close(col.dot(q, "i").numpy(), col.numpy().T, wd)


def gemv_kernel(ctx, x, w, cols, **flags):
    """y = x · wᵀ by one QuantGemvKey(w's format, x's rows, cols, **flags) launch, every item
    in one chunk (the kernel's paths compared directly, whatever exec would pick)."""
    from fucina.codegen import kernels
    from fucina.codegen.quant_gemm import QuantGemvKey
    (rows, K), N = x.shape, w.shape[0]
    y = ctx.tensor(np.zeros((rows, N), np.float32), ("s", "o"))._raw
    ctx.launch(kernels.get(QuantGemvKey(w.dtype, rows, cols, **flags)), 1, 0, x.addr, w.addr,
               y.addr, N, K, K, -(-N // cols))
    return fu.Tensor(y, ("s", "o")).numpy()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"] + KQUANT)
@pytest.mark.parametrize("rows", [1, 3])
def test_table_decode_gives_the_decoders_bits(ctx1, fmt, rows):
    """The gemv's 16-value table decode of q4_0 / q4_1, its 32-value tables of q5_0 / q5_1,
    its register decoders of the K-quants (codegen/quant_kgemv.py) and its staged scales
    (q4_0 / q4_1 / q5_0 / q5_1 / q8_0) multiply exactly the weights the block decoders give:
    with and without them the kernel agrees bit for bit, and so does the staged kernel that
    prefetches block by block (spread, long rows). K = 2400 spans several staging segments."""
    N, K = 70, 1280 if fmt in KQUANT else 2400
    q, _ = qweight(ctx1, N, K, fmt)
    x = ctx1.tensor(rnd(rows, K), ("s", "i"))._raw
    outs = [gemv_kernel(ctx1, x, q._raw, 2, table=table, staged=staged, spread=spread)
            for table, staged, spread in ((True, True, False), (True, False, False),
                                          (False, False, False), (True, True, True))]
    for other in outs[1:]:
        assert_bitwise(outs[0], other)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_k"])
def test_outputs_per_item_keep_the_bits(ctx1, fmt):
    """A gemv item's outputs (cols: 4, or 2 for one row of x against q8_0 and interleaved
    q5_0 on AVX-512, exec.quant.gemv_cols) only group outputs: 1, 2 and 4 an item give
    the same bits, and x.dot's plan takes gemv_cols' count."""
    N, K = 37, 1280 if fmt in KQUANT else 2400
    q, _ = qweight(ctx1, N, K, fmt)
    x = ctx1.tensor(rnd(1, K), ("s", "i"))
    outs = [gemv_kernel(ctx1, x._raw, q._raw, cols) for cols in (1, 2, 4)]
    for other in outs[1:]:
        assert_bitwise(outs[0], other)
    assert_bitwise(x.dot(q, "i").numpy(), outs[0])
    avx512 = bool(xq.ONE_ROW_COLS)
    cols = xq.gemv_cols(1, fmt, False)
    assert cols == (2 if fmt == "q8_0" or not avx512 else 4)
    from fucina.codegen import kernels
    plan = xq._mm_plan(x._raw, q._raw)
    assert kernels.keys_by_address()[plan.steps[0][0]].cols == cols
    if fmt == "q5_0":   # the interleaved copy's one-row gemv: 2 on AVX-512 too
        assert xq.gemv_cols(1, fmt, True) == 2
        assert_bitwise(x.dot(q.for_matvec(), "i").numpy(), outs[0])


# the f16 scale fields of each block (d, and m / dmin where there is one)
HALVES = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
          "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def any_blocks(ctx, fmt, N, K, seed, inf=False):
    """[N, K] of random block bytes (every code, sub-scale, min and high bit pattern) with
    f16 scales of magnitudes 1e-7 .. 1e3, subnormals included (inf: and a few infinite
    ones and a NaN)."""
    rng = np.random.default_rng(seed)
    bs, nbytes = FORMATS[fmt]
    nblk = N * K // bs
    raw = rng.integers(0, 256, (nblk, nbytes), dtype=np.uint8)
    for off in HALVES[fmt]:
        h = (rng.standard_normal(nblk) * 10.0 ** rng.integers(-7, 4, nblk)).astype(np.float16)
        if inf:
            h[rng.integers(0, nblk, 6)] = np.float16(np.inf) * rng.choice([-1, 1], 6)
            h[rng.integers(0, nblk)] = np.float16(np.nan)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(nblk, 2)
    return xq.from_bytes(ctx, raw.tobytes(), (N, K), fmt)


@pytest.mark.parametrize("fmt", sorted(HALVES))
def test_register_decode_on_any_bytes(ctx1, fmt):
    """The gemv's decoders (16-lane tables and the K-quant register decoders on AVX-512;
    per-vector conversions and quant_kgemv.Narrow on AVX2; staged scales) give the block
    decoders' bits on any_blocks (the 32-blocks with infinite scales too), for 1 to 4 rows
    of x, their item widths and odd N (an item past N's edge)."""
    inf = FORMATS[fmt][0] == 32
    q = any_blocks(ctx1, fmt, 13, 1024, 7, inf)
    for rows in (1, 2, 3, 4):
        x = ctx1.tensor(rnd(rows, 1024), ("s", "i"))._raw
        outs = [gemv_kernel(ctx1, x, q, xq.GEMV_COLS[rows], table=table)
                for table in (True, False)]
        assert np.isfinite(outs[1]).any() if inf else np.isfinite(outs[1]).all()
        assert_bitwise(outs[0], outs[1])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("N,K", [(1536, 576), (70, 2400), (33, 96), (5, 32), (24, 640),
                                 (9, 896)])
def test_for_matvec_gives_the_same_bits(ctx1, ctx2, fmt, N, K):
    """Tensor.for_matvec's interleaved copy (groups of 4 q4 or 3 q5 blocks, the row's last
    blocks as stored; K = 640 and 896 leave q5 a tail of 2 and 1): one to 8 rows give the
    plain gemv's bits at 1 and 2 threads; every other op (more rows, dequantize, get_rows)
    reads the blocks as stored."""
    from fucina.exec.quant import GemvBlockRaw, interleaves
    for c in (ctx1, ctx2):
        q, wd = qweight(c, N, K, fmt)
        qi = q.for_matvec()
        if interleaves(q._raw):
            assert isinstance(qi._raw, GemvBlockRaw) and qi.for_matvec() is qi
        else:   # a host without AVX2 has no interleaved gemv: the weight comes back as is
            assert qi is q
        assert qi.tags == q.tags and qi.shape == q.shape
        for M in (1, 3, 6, 20):
            xa = rnd(M, K)
            x = c.tensor(xa, ("s", "i"))
            assert_bitwise(x.dot(qi, "i").numpy(), x.dot(q, "i").numpy())
            if M == 6:
                check_close(x.dot(qi, "i").numpy(), xa, wd)
        assert_bitwise(qi.to("f32").numpy(), q.to("f32").numpy())
        assert_bitwise(qi.get_rows("o", [N - 1, 0], "r").numpy(),
                       q.get_rows("o", [N - 1, 0], "r").numpy())
    raw, xa = blocks_for(rnd(N, K), fmt).tobytes(), rnd(1, K)
    got = [c.tensor(xa, ("s", "i")).dot(fu.Tensor(xq.from_bytes(c, raw, (N, K), fmt),
                                                  ("o", "i")).for_matvec(), "i").numpy()
           for c in (ctx1, ctx2)]
    assert_bitwise(got[0], got[1])


def interleaved_reference(raw: np.ndarray, fmt: str, N: int, K: int) -> np.ndarray:
    """The interleaved layout's bytes (codegen/quant_gemm.py, _interleaved_blocks) by numpy:
    per group [G d's][G m's][16 dwords, lane j: the codes of weights j and 16 + j of block g
    at bits CODE_BITS·(2g + half)], then the row's last blocks as stored."""
    from fucina.codegen import quant_gemm as qg
    bs, nb = FORMATS[fmt]
    nblk = K // bs
    G, bits = qg.GROUPS[fmt], qg.CODE_BITS[fmt]
    groups = nblk // G
    src = raw.reshape(N, nblk, nb)
    grp = src[:, :groups * G].reshape(N, groups, G, nb).astype(np.uint32)
    heads = 4 if fmt in ("q4_1", "q5_1") else 2
    qs = grp[..., nb - 16:]
    if bits == 5:
        qh = grp[..., heads] | grp[..., heads + 1] << 8 | grp[..., heads + 2] << 16 | \
            grp[..., heads + 3] << 24
    j = np.arange(16, dtype=np.uint32)
    lanes = np.zeros((N, groups, 16), np.uint32)
    for blk in range(G):
        for half in range(2):
            code = (qs[:, :, blk] >> (4 * half)) & 15
            if bits == 5:
                code |= ((qh[:, :, blk, None] >> (16 * half + j)) & 1) << 4
            lanes |= code << (bits * (2 * blk + half))
    parts = [src[:, :groups * G].reshape(N, groups, G, nb)[..., 2 * h:2 * h + 2]
             .reshape(N, groups, 2 * G) for h in range(heads // 2)]
    parts.append(lanes.astype("<u4").view(np.uint8).reshape(N, groups, 64))
    body = np.concatenate(parts, axis=2).reshape(N, -1)
    return np.concatenate([body, src[:, groups * G:].reshape(N, -1)], axis=1)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_interleave_kernel_writes_the_layout(ctx1, ctx2, fmt):
    """QuantInterleaveKey's bytes are the layout's (a numpy transcription), at 1 and 2 threads,
    for rows with and without tail blocks and fewer blocks than a group. The kernel is
    launched directly: it needs no AVX-512 (only the gemv that reads the layout does)."""
    from fucina.codegen import kernels
    from fucina.codegen.quant_gemm import QuantInterleaveKey, interleaved_row_bytes
    rng = np.random.default_rng(5)
    bs, nbytes = FORMATS[fmt]
    for N, K in ((37, 896), (5, 2304), (3, 32), (300, 640)):
        raw = rng.integers(0, 256, (N * K // bs, nbytes), dtype=np.uint8)
        want = interleaved_reference(raw, fmt, N, K)
        rb = interleaved_row_bytes(fmt, K)
        for c in (ctx1, ctx2):
            w = xq.from_bytes(c, raw.tobytes(), (N, K), fmt)
            out = c.empty((N * rb,), "bool")
            c.launch(kernels.get(QuantInterleaveKey(fmt)), -(-N // 16), N * rb, w.addr,
                     out.addr, N, K, 16)
            np.testing.assert_array_equal(out.storage_view().view(np.uint8).reshape(N, rb),
                                          want)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1"])
def test_for_matvec_on_any_bytes(ctx1, fmt):
    """any_blocks through the interleaved copy: one to 8 rows of x give the stored layout's
    bits, for burst (K = 896) and spread prefetch (K = 2304) and odd N (an item past N's
    edge); with infinite scales too (the 16-lane tables and the 8-lane fields compute each
    weight with the block decoder's operations, so its NaNs and infinities)."""
    for N, K in ((13, 896), (7, 2304)):
        for inf in (False, True):
            q = fu.Tensor(any_blocks(ctx1, fmt, N, K, 11, inf), ("o", "i"))
            qi = q.for_matvec()
            for M in (1, 2, 5, 8):
                x = ctx1.tensor(rnd(M, K), ("s", "i"))
                want = x.dot(q, "i").numpy()
                assert np.isfinite(want).any() if inf else np.isfinite(want).all()
                assert_bitwise(x.dot(qi, "i").numpy(), want)


def q5_0_rows(rows, K):
    """q5_0 blocks [len(rows), K] of random codes and finite scales, with row r's block 1
    replaced by rows[r] = (d, code) when given: every weight of that block the code."""
    raw = blocks_for(rnd(len(rows), K), "q5_0").reshape(len(rows), K // 32, 22).copy()
    for r, special in enumerate(rows):
        if special is not None:
            d, code = special
            raw[r, 1, 0:2] = np.array([d], np.float16).view(np.uint8)
            raw[r, 1, 2:6] = 0xFF if code >= 16 else 0       # qh: every fifth bit
            raw[r, 1, 6:22] = (code & 15) * 0x11              # both nibbles of each qs byte
    return raw


def test_q5_0_tables_with_special_scales(ctx1):
    """The 16-lane q5_0 gemv builds a block's second table as the first plus 16·d (one
    multiply, codegen/quant_gemm._tables), for segments whose scales are all finite; an
    inf or NaN d sends its segment to the two multiplies. A block of d = +inf and code 20
    (every weight +inf), of d = -inf and code 3 (+inf too: (3 - 16)·-inf), would give NaN
    by the add (-inf + inf); a NaN d; and d < 0 with code 16 (weights -0, the add's +0):
    the stored and interleaved layouts give the block decoders' bits, at K = 2400 (several
    staging segments: the special one among finite ones)."""
    K = 2400
    specials = [(np.inf, 20), (-np.inf, 3), (np.nan, 7), (-0.5, 16), None]
    q = fu.Tensor(xq.from_bytes(ctx1, q5_0_rows(specials, K).tobytes(), (len(specials), K),
                                "q5_0"), ("o", "i"))
    xa = np.abs(rnd(3, K)) + 0.1         # positive: a row of +inf weights sums to +inf
    x = ctx1.tensor(xa, ("s", "i"))
    want = gemv_kernel(ctx1, x._raw, q._raw, 2, table=False)   # the block decoders
    assert np.isposinf(want[:, :2]).all() and np.isnan(want[:, 2]).all()
    assert np.isfinite(want[:, 3:]).all()
    for got in (gemv_kernel(ctx1, x._raw, q._raw, 2), x.dot(q, "i").numpy(),
                x.dot(q.for_matvec(), "i").numpy(),
                ctx1.tensor(xa[:1], ("s", "i")).dot(q.for_matvec(), "i").numpy()):
        assert_bitwise(got, want[:len(got)])


@pytest.mark.parametrize("interleaved", [False, True])
def test_q5_0_gemv_multiplies_once_a_block(interleaved):
    """The 16-lane q5_0 gemv's block loops: where the segment's scales are finite, one
    multiply and one add per block build its two tables (the multiplies bind the loop, with
    the FMAs and the permutes, on the FMA pipes); the other loop, for a segment with an inf
    or a NaN d, two multiplies. Counted per FMA (two a block) in the kernel's assembly. A
    host without 16-lane permutes (AVX2) has no tables: no loop takes the add, and no format
    is said to."""
    from fucina.codegen import jit, quant_gemm

    asm = jit.assembly(quant_gemm.QuantGemvKey("q5_0", 1, 4, interleaved=interleaved).ir("k"))
    per_fma = set()
    for body in asm_loops(asm):
        fmas = sum("vfmadd" in x for x in body)
        inner = not any(x.startswith(".LBB") for x in body[1:])   # no loop inside
        if fmas and inner:
            per_fma.add((sum("vmulps" in x for x in body) / fmas,
                         sum("vaddps" in x for x in body) / fmas))
    if quant_gemm.lanes() == 16:
        assert {(0.5, 0.5), (1.0, 0.0)} <= per_fma, per_fma
    else:
        assert (0.5, 0.5) not in per_fma, per_fma
        assert not any(quant_gemm.sums_tables(f) for f in FORMATS)


def test_for_matvec_leaves_other_tensors(ctx1):
    """Other block formats and dense tensors have no for_matvec copy: returned as they are."""
    q, _ = qweight(ctx1, 8, 256, "q4_k")
    assert q.for_matvec() is q
    q8, _ = qweight(ctx1, 8, 64, "q8_0")
    assert q8.for_matvec() is q8
    f = ctx1.tensor(rnd(4, 64), ("o", "i"))
    assert f.for_matvec() is f


def test_interleave_refuses_other_weights(ctx1):
    """exec.quant.interleave (what for_matvec calls) names the op, the format it expects and
    the one given."""
    from fucina.errors import DTypeError
    q8, _ = qweight(ctx1, 8, 64, "q8_0")
    with pytest.raises(DTypeError, match=r"interleave: expected a 2-D q4_0 .* got q8_0 of rank 2"):
        xq.interleave(ctx1, q8._raw)


def test_repeated_dots_keep_their_bits_per_layout(ctx1):
    """A dot remembers what the tags and layouts decide (ag/quant._dots): calls after the
    first give the first call's bits for a contiguous row, an offset slice and an x stored
    [K, 1] (copied, not viewed), and the remembered entry takes no other layout."""
    q, wd = qweight(ctx1, 300, 576, "q4_1")
    wide = ctx1.tensor(rnd(2, 1000), ("s", "i"))
    xs = [ctx1.tensor(rnd(1, 576), ("s", "i")), wide.narrow("i", 200, 576),
          ctx1.tensor(np.ascontiguousarray(rnd(576, 1)), ("i", "s"))]
    first = [x.dot(q, "i").numpy() for x in xs]
    for _ in range(3):
        for x, want in zip(xs, first):
            assert_bitwise(x.dot(q, "i").numpy(), want)
    check_close(first[1], wide.numpy()[:, 200:776], wd)
    with pytest.raises(fu.FucinaError, match="dot"):      # same tags, a wrong size
        ctx1.tensor(rnd(1, 577), ("s", "i")).dot(q, "i")
    forged = fu.Tensor(q._raw, q.tags, engine.Leaf(q.shape))   # a weight that requires grad
    with pytest.raises(fu.GradientQuantizedMatmulUnsupported, match="frozen"):
        ctx1.variable(rnd(1, 576), ("s", "i")).dot(forged, "i")


def test_bad_input(ctx1):
    q, _ = qweight(ctx1, 64, 576, "q4_1")
    with pytest.raises(fu.FucinaError, match="dot"):
        ctx1.tensor(rnd(1, 544), ("s", "i")).dot(q, "i")
    with pytest.raises(fu.FucinaError, match="dot"):
        ctx1.tensor(rnd(1, 576), ("s", "i")).to("f16").dot(q, "i")


# ---------------------------------------------------------------------------------------------
# dot_q8: the activation row rounded to 8 bits per 32-block, integer dots (codegen/quant_q8.py)

Q8 = GGUF_LLM
Q8_SHAPES = [(1536, 576), (576, 1536), (37, 128), (9, 160), (6, 224), (5, 96 * 4)]
Q8_K_SHAPES = [(1536, 768), (768, 1536), (37, 256), (5, 512)]   # K-quants: K a multiple of 256
needs_q8 = pytest.mark.skipif(not xq.quant_q8.available(),
                              reason="the host lacks AVX2 (dot_q8 is the exact dot)")


def q8_rounded(xa):
    """x as the q8_row kernel rounds it: per group of 4 values dx = max|x| / 127, q =
    round-half-even(x · (127 / max|x|)), then q · dx (numpy, float32 arithmetic as the
    kernel's)."""
    b = xa.reshape(-1, 4).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(xa.shape)


@needs_q8
@pytest.mark.parametrize("fmt,N,K", [(f, *s) for f in Q8
                                     for s in (Q8_K_SHAPES if f in KQUANT else Q8_SHAPES)])
def test_dot_q8_is_the_product_with_the_rounded_row(ctx1, ctx2, fmt, N, K):
    """The integer path equals x rounded per block times the stored weight (float64 numpy, to
    f32 summation accuracy), an odd count of blocks and N off the 4-output grid included; the
    same bits at 1 and 2 threads."""
    q1, wd = qweight(ctx1, N, K, fmt)
    q2 = fu.Tensor(xq.from_bytes(ctx2, q1._raw.buf, (N, K), fmt), q1.tags)
    xa = rnd(1, K)
    with fu.no_grad():
        got = [c.tensor(xa, ("s", "i")).dot_q8(q, "i").numpy() for c, q in ((ctx1, q1), (ctx2, q2))]
    assert_bitwise(got[0], got[1])
    xr = q8_rounded(xa).astype(np.float64)
    want = xr @ wd.T
    scale = (np.abs(xr) @ np.abs(wd).T)
    assert np.all(np.abs(got[0] - want) <= 4 * K * 2.0 ** -24 * scale + 1e-30)
    exact = xa.astype(np.float64) @ wd.T      # and the rounding's own error is the bound's
    bound = (np.abs(xa.reshape(-1, 4)).max(axis=1) / 254).repeat(4) @ np.abs(wd).T
    assert np.all(np.abs(got[0] - exact) <= bound * 1.001 + 1e-6)


# (byte offset, count) of a block's f16 scales: d, then dmin / m where there is one
SCALES_AT = {"q4_1": (0, 2), "q5_1": (0, 2), "q2_k": (80, 2), "q3_k": (108, 1),
             "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, 1)}


def random_blocks(rng, N, K, fmt):
    """[N, K] blocks of random code bytes (every code, q8_0's -128 included) with random
    finite f16 scales (and mins) of both signs."""
    bs, nbytes = FORMATS[fmt]
    raw = rng.integers(0, 256, (N, K // bs, nbytes), dtype=np.uint8)
    at, nscale = SCALES_AT.get(fmt, (0, 1))
    sc = (rng.standard_normal((N, K // bs, nscale)) * 0.05).astype(np.float16)
    raw[:, :, at:at + 2 * nscale] = sc.view(np.uint8).reshape(N, K // bs, 2 * nscale)
    return raw.reshape(N, -1)


def f32_round(v) -> np.float32:
    """The float32 nearest the exact rational v (ties to even): what one IEEE operation gives."""
    from fractions import Fraction

    c = np.float32(float(v))
    best = None
    for t in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        err = abs(Fraction(float(t)) - v)
        key = (err, int(np.array(t).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, t)
    return best[1]


def q8_model(xa, raw, N, K, fmt):
    """dot_q8 computed as codegen/quant_q8.py describes it, every f32 operation rounded once
    (Fractions): x's bytes, dx and sx as q8_row makes them; per output, per pair of blocks, per
    lane l of 16 (lanes 0-7 block 2p, 8-15 block 2p + 1; a lone last block's partner has no
    codes and d = m = 0): acc = fma(dot, d·dx, acc), acc = fma(m (q4_1, q5_1) | d, sx', acc)
    with sx' = sx (q4_1, q5_1) or sx·(-8 | -16 | -128), then the halving lane tree. q4_k's and
    q5_k's 32-value sub-blocks are blocks with d = d·sc and m = −dmin·m (ggml's 6-bit scales);
    q6_k's and q3_k's have signed codes (q − 32, q − 4), d = d·sc per group of 16 (lanes 0-3,
    4-7) and no second FMA; q2_k's have d = d·sc and m = −dmin·m per group of 16, the second
    FMA being fma(m·dx, the lane's Σ of x's bytes, acc)."""
    from fractions import Fraction as F

    f32 = np.float32
    bs, nbytes = FORMATS[fmt]
    nblk = K // 32
    xg = xa.reshape(-1, 4).astype(f32)
    amax = np.abs(xg).max(axis=1)
    dx = (amax / f32(127)).astype(f32)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    qx = np.rint((xg * inv[:, None]).astype(f32)).astype(np.int64)          # [groups, 4]
    sx = []
    for j in range(nblk):
        acc = f32(0.0)
        for g in range(8 * j, 8 * j + 8):
            acc = f32(acc + f32(dx[g] * f32(qx[g].sum())))
        sx.append(acc)
    rows = raw.reshape(N, -1)
    off = {"q4_0": f32(-8.0), "q5_0": f32(-16.0), "q8_0": f32(-128.0)}.get(fmt)
    with_m = fmt in ("q4_1", "q5_1")

    def block(n, j):
        """(32 codes, d, m) of 32-value block j of row n: d per lane or one for all, m None
        where there is no zero-point term."""
        if fmt == "q6_k":
            sup, s8 = divmod(j, 8)
            hh, sub = divmod(s8, 4)
            blk = rows[n, sup * nbytes:(sup + 1) * nbytes]
            ql = blk[64 * hh + 32 * (sub % 2):64 * hh + 32 * (sub % 2) + 32].astype(np.int64)
            qh = blk[128 + 32 * hh:160 + 32 * hh].astype(np.int64)
            codes = ((ql >> 4 * (sub // 2)) & 15 | ((qh >> 2 * sub) & 3) << 4) - 32
            sc = blk[192 + 8 * hh:200 + 8 * hh].view(np.int8)
            d = f32(blk[208:210].view(np.float16)[0])
            return codes, [f32(d * f32(sc[2 * sub + l // 4])) for l in range(8)], None
        if fmt in ("q4_k", "q5_k"):
            sup, sub = divmod(j, 8)
            blk = rows[n, sup * nbytes:(sup + 1) * nbytes]
            d, dmin = (f32(v) for v in blk[:4].view(np.float16))
            s = blk[4:16].astype(np.int64)
            if sub < 4:
                sc, mn = s[sub] & 63, s[sub + 4] & 63
            else:
                sc = (s[sub + 4] & 15) | (s[sub - 4] >> 6) << 4
                mn = (s[sub + 4] >> 4) | (s[sub] >> 6) << 4
            at = (16 if fmt == "q4_k" else 48) + 32 * (sub // 2)
            q = blk[at:at + 32].astype(np.int64)
            codes = q >> 4 if sub % 2 else q & 15
            if fmt == "q5_k":       # bit sub of qh's byte l: element l's fifth
                codes |= (blk[16:48].astype(np.int64) >> sub & 1) << 4
            return codes, f32(d * f32(sc)), -f32(dmin * f32(mn))
        if fmt in ("q2_k", "q3_k"):
            sup, s8 = divmod(j, 8)
            hh, sub = divmod(s8, 4)
            blk = rows[n, sup * nbytes:(sup + 1) * nbytes]
            at = (16 if fmt == "q2_k" else 32) + 32 * hh
            codes = blk[at:at + 32].astype(np.int64) >> 2 * sub & 3
            idx = [8 * hh + 2 * sub + l // 4 for l in range(8)]     # the lanes' scales
            if fmt == "q2_k":
                d, dmin = (f32(v) for v in blk[80:84].view(np.float16))
                s = blk[:16].astype(np.int64)
                return (codes, [f32(d * f32(s[i] & 15)) for i in idx],
                        [-f32(dmin * f32(s[i] >> 4)) for i in idx])
            codes = codes + 4 * (blk[:32].astype(np.int64) >> s8 & 1) - 4
            s = blk[96:108].astype(np.int64)    # scale i: low 4 bits, high 2 bits
            sc = [(s[i % 8] >> 4 * (i // 8) & 15 | (s[8 + i % 4] >> 2 * (i // 4) & 3) << 4) - 32
                  for i in idx]
            d = f32(blk[108:110].view(np.float16)[0])
            return codes, [f32(d * f32(v)) for v in sc], None
        blk = rows[n, j * nbytes:(j + 1) * nbytes]
        d = f32(blk[:2].view(np.float16)[0])
        m = f32(blk[2:4].view(np.float16)[0]) if with_m else d
        if fmt == "q8_0":
            return blk[2:].astype(np.int64) ^ 0x80, d, m            # w + 128
        nib = blk[nbytes - 16:]
        codes = np.concatenate([nib & 15, nib >> 4]).astype(np.int64)
        if fmt in ("q5_0", "q5_1"):   # bit e of qh is element e's fifth
            at = 4 if with_m else 2
            qh = int(blk[at:at + 4].view(np.uint32)[0])
            codes |= np.array([(qh >> e & 1) << 4 for e in range(32)])
        return codes, d, m

    y = np.zeros(N, f32)
    for n in range(N):
        acc = [f32(0.0)] * 16
        for p in range((nblk + 1) // 2):
            for h in (0, 1):
                j = 2 * p + h
                for l in range(8):
                    lane = 8 * h + l
                    if j < nblk:
                        codes, d, m = block(n, j)
                        d = d[l] if isinstance(d, list) else d
                        dot = int((codes[4 * l:4 * l + 4] * qx[8 * j + l]).sum())
                        dxl, sxl = dx[8 * j + l], (sx[j] if l == 0 else f32(0.0))
                        if isinstance(m, list):     # q2_k: m·dx against the lane's Σ q_x
                            m, sxl = f32(m[l] * dxl), f32(qx[8 * j + l].sum())
                    else:
                        d = m = f32(0.0)
                        dot, dxl, sxl = 0, f32(0.0), f32(0.0)
                    if off is not None:
                        sxl = f32(sxl * off)
                    a = f32_round(F(dot) * F(float(f32(d * dxl))) + F(float(acc[lane])))
                    acc[lane] = a if m is None else f32_round(F(float(m)) * F(float(sxl)) +
                                                              F(float(a)))
        v = acc
        while len(v) > 1:
            v = [f32(a + b) for a, b in zip(v[:len(v) // 2], v[len(v) // 2:])]
        y[n] = v[0]
    return y


@needs_q8
@pytest.mark.parametrize("fmt", Q8)
def test_dot_q8_follows_its_model_bit_for_bit(ctx1, fmt):
    """On every q8 host the kernels give q8_model's bits: random code bytes and scales (every
    code, q8_0's -128 included), x with an outlier, an all-zero group and a negative zero, an
    odd block count (a lone last block)."""
    rng = np.random.default_rng(32)
    for N, K in ((5, 512), (3, 256)) if fmt in KQUANT else ((5, 160), (3, 256)):
        raw = random_blocks(rng, N, K, fmt)
        w = fu.Tensor(xq.from_bytes(ctx1, raw.tobytes(), (N, K), fmt), ("o", "i"))
        xa = rng.standard_normal((1, K)).astype(np.float32)
        xa[0, 5], xa[0, 8:12], xa[0, 13] = 40.0, 0.0, -0.0
        with fu.no_grad():
            got = ctx1.tensor(xa, ("s", "i")).dot_q8(w, "i").numpy()[0]
        assert_bitwise(got, q8_model(xa[0], raw, N, K, fmt))


@needs_q8
@pytest.mark.parametrize("fmt", Q8)
def test_dot_q8_prefetches_every_line_into_l2(fmt):
    """The q8 gemv streams w from memory in decode: its prefetches go to L2 (prefetcht1; a t0
    stream throttled on Zen 4), and the whole-pair kernel's 68-byte q8_0 pairs take one per
    end, so no line of a row comes on demand (q8_0 head from memory 3.3 -> 1.2 ms)."""
    from fucina.codegen import jit, quant_q8

    asm = jit.assembly(quant_q8.Q8GemvKey(fmt, xq.Q8_COLS[fmt]).ir("k"))
    assert "prefetcht1" in asm and "prefetcht0" not in asm and "prefetchnta" not in asm
    if not (quant_q8.whole_pairs() and fmt in quant_q8.WHOLE):
        return
    ratios = {sum("prefetcht1" in x for x in body) / dots for body in asm_loops(asm)
              if (dots := sum("vpdpbusd" in x for x in body))}
    pair = 2 * FORMATS[fmt][1]
    assert ratios == {1.0 if pair <= 64 else 2.0}, (fmt, ratios)


def test_dot_q8_falls_back_and_refuses(ctx1):
    """Weights it does not serve (other formats, rows under 128 values) take the exact dot;
    gradients and more than one row are refused."""
    for fmt, K in (("tq2_0", 256), ("q4_0", 96), ("f32", 128)):
        if fmt == "f32":
            w = ctx1.tensor(rnd(7, K), ("o", "i"))
        else:
            w, _ = qweight(ctx1, 7, K, fmt)
        x = ctx1.tensor(rnd(1, K), ("s", "i"))
        with fu.no_grad():
            assert_bitwise(x.dot_q8(w, "i").numpy(), x.dot(w, "i").numpy())
    w, _ = qweight(ctx1, 7, 128, "q4_1")
    if xq.quant_q8.available():
        with pytest.raises(fu.UnsupportedGradient, match="dot_q8: inference only"):
            ctx1.variable(rnd(1, 128), ("s", "i")).dot_q8(w, "i")
        with fu.no_grad(), pytest.raises(fu.ShapeMismatch, match="dot_q8: expected one row"):
            ctx1.tensor(rnd(2, 128), ("s", "i")).dot_q8(w, "i")
    with fu.no_grad(), pytest.raises(fu.TagError):
        ctx1.tensor(rnd(1, 128), ("s", "x")).dot_q8(w, "i")
