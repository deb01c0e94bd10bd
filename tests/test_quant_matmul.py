"""Ops that read block-quantized tensors in place (SPEC A-8, T-24, §3.16): x.dot(w_q) against
the float64 product with the dequantized weight (and bitwise against the f32 GEMM where both
run the same FMA chain), its gradient to x against torch and finite differences, thread and
row-batch invariance, get_rows and the row-axis concat against numpy, and every refusal.

Tolerance of the matmul (SPEC §0.5 asks |Δ| <= 1e-5·k for unit-scale data): the classic bound
of an f32 sum of K products, |Δ| <= K · 2^-24 · sum_k |x_mk| |w_nk| (w the dequantized
weight, exactly the values the kernels multiply), checked element by element."""
import re

import numpy as np
import pytest
import torch

import fucina as fu
from conftest import assert_bitwise
from fucina.ag import engine
from fucina.codegen.quant import ENCODABLE, FORMATS
from fucina.exec import matmul as mm
from fucina.exec import quant as xq

RNG = np.random.default_rng(23)
ALL = list(FORMATS)


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def blocks_for(x: np.ndarray, fmt: str) -> np.ndarray:
    """Real ggml blocks of the rows of x: our encoders where they exist, llama.cpp's (through
    libgguf) otherwise; q8_k (no reference quantizer in either package) built by hand."""
    if fmt in ENCODABLE:
        with fu.ExecContext(threads=1) as c:
            return c.tensor(x, ("r", "c")).to(fmt).data_const().copy()
    if fmt == "q8_k":
        g = x.reshape(-1, 256)
        d = (np.abs(g).max(axis=1) / 127).astype(np.float32)
        qs = np.round(g / np.where(d == 0, 1, d)[:, None]).astype(np.int8)
        bsums = qs.reshape(-1, 16, 16).sum(axis=2).astype(np.int16)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 4), qs.view(np.uint8),
                              bsums.view(np.uint8).reshape(-1, 32)], axis=1)
        return raw.reshape(x.shape[0], -1)
    import libgguf
    from gguf import GGMLQuantizationType as GT
    return libgguf.quantize_rows(x, int(GT[fmt.upper()]))


def qweight(ctx, N, K, fmt, tags=("o", "i")):
    """A quantized [N, K] weight tensor and its dequantized values (float64)."""
    raw = blocks_for(rnd(N, K), fmt)
    q = fu.Tensor(xq.from_bytes(ctx, raw.tobytes(), (N, K), fmt), tags)
    return q, q.to("f32").numpy().astype(np.float64)


def check_close(got, x, wd):
    """got (f32) against x · wdᵀ in float64 within the f32 summation bound."""
    x = x.astype(np.float64).reshape(-1, wd.shape[1])
    want = x @ wd.T
    bound = wd.shape[1] * 2.0 ** -24 * (np.abs(x) @ np.abs(wd).T) + 1e-30
    err = np.abs(got.reshape(want.shape).astype(np.float64) - want)
    assert (err <= bound).all(), f"max err/bound {np.max(err / bound):.3f}"


# ---------------------------------------------------------------------------------------------
# forward values

@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 16, 21])
def test_dot_matches_dequantized_product(ctx, fmt, M):
    bs = FORMATS[fmt][0]
    K = 2 * bs if bs == 256 else 6 * bs
    N = 37                           # not a multiple of any item or panel width
    q, wd = qweight(ctx, N, K, fmt)
    xa = rnd(M, K)
    y = ctx.tensor(xa, ("s", "i")).dot(q, "i")
    assert y.tags == ("s", "o") and y.shape == (M, N) and y.dtype == "f32"
    assert not y.requires_grad
    check_close(y.numpy(), xa, wd)
    path = xq.matmul_path(ctx.tensor(xa, ("s", "i"))._raw, q._raw)
    assert path == ("gemv" if M <= xq.GEMV_MAX_ROWS else "packed")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "tq2_0", "q4_0"])
@pytest.mark.parametrize("M,N,K", [(17, 40, 512), (40, 300, 768), (100, 33, 256)])
def test_packed_path_is_the_f32_gemm_bitwise(ctx, fmt, M, N, K):
    """Many rows: w decoded into the GEMM's packed panels; the tile kernel runs the same FMA
    chain per element as the f32 GEMM does on w.to('f32')ᵀ (its packed or rowvec path)."""
    q, _ = qweight(ctx, N, K, fmt)
    x = ctx.tensor(rnd(M, K), ("s", "i"))
    assert xq.matmul_path(x._raw, q._raw) == "packed"
    wt = q.to("f32")._raw.permute((1, 0))
    assert mm.path_of(x._raw, wt).split()[0] in ("packed", "rowvec")
    assert_bitwise(x.dot(q, "i").numpy(), mm.gemm(ctx, x._raw, wt).to_numpy())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_1"])
def test_packed_path_partial_k_block(ctx, fmt):
    """K = 13 blocks of 32: a full KC block of k, then a partial one (partial sums in C)."""
    q, wd = qweight(ctx, 50, 416, fmt)
    xa = rnd(20, 416)
    y = ctx.tensor(xa, ("s", "i")).dot(q, "i").numpy()
    check_close(y, xa, wd)
    x = ctx.tensor(xa, ("s", "i"))
    assert_bitwise(y, mm.gemm(ctx, x._raw, q.to("f32")._raw.permute((1, 0))).to_numpy())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q5_k", "tq2_0"])
def test_rows_of_a_batch_equal_single_rows(ctx1, fmt):
    """Up to GEMV_MAX_ROWS rows, each output row is bitwise the one-row product: the gemv
    kernel sums every output in one order (fixed by K) whatever the row count."""
    q, _ = qweight(ctx1, 45, 512, fmt)
    xa = rnd(xq.GEMV_MAX_ROWS, 512)
    full = ctx1.tensor(xa, ("s", "i")).dot(q, "i").numpy()
    for m in range(xa.shape[0]):
        one = ctx1.tensor(xa[m:m + 1], ("s", "i")).dot(q, "i").numpy()
        assert_bitwise(full[m:m + 1], one)
        assert_bitwise(full[m], ctx1.tensor(xa[m], ("i",)).dot(q, "i").numpy())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "tq2_0"])
@pytest.mark.parametrize("M", [1, 3, 12, 40])
def test_thread_invariance(fmt, M):
    """Enough outputs for many chunks (several tiles on the packed path): same bits at 1 and
    2 threads."""
    raw = blocks_for(rnd(2048, 512), fmt)
    xa = rnd(M, 512)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            q = fu.Tensor(xq.from_bytes(c, raw.tobytes(), (2048, 512), fmt), ("o", "i"))
            out.append(c.tensor(xa, ("s", "i")).dot(q, "i").numpy())
    assert_bitwise(out[0], out[1])


@pytest.mark.parametrize("N", [192, 576, 896])
def test_few_tiles_split_evenly_for_two_threads(N):
    """A prompt of tens of rows is one M block (MC_ROWS): N is cut into an even number of
    blocks of equal panel counts (two threads take a contiguous half each: SmolLM2's 576
    outputs made 3 tiles, run as 2 + 1), bitwise the f32 GEMM at 1 and 2 threads."""
    K = 576
    raw = blocks_for(rnd(N, K), "q4_1")
    xa = rnd(55, K)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            q = fu.Tensor(xq.from_bytes(c, raw.tobytes(), (N, K), "q4_1"), ("o", "i"))
            x = c.tensor(xa, ("s", "i"))
            tile = xq._mm_plan(x._raw, q._raw).steps[-1]
            NC = tile[4][5]
            blocks = [min(NC, N - n0) for n0 in range(0, N, NC)]
            assert tile[4][4] >= 55    # MC: one M block
            assert tile[1] == len(blocks) and len(blocks) % 2 == 0
            half = len(blocks) // 2
            assert sum(blocks[:half]) == sum(blocks[half:])
            out.append(x.dot(q, "i").numpy())
            wt = q.to("f32")._raw.permute((1, 0))
            assert_bitwise(out[-1], mm.gemm(c, x._raw, wt).to_numpy())
    assert_bitwise(out[0], out[1])


def test_layouts_and_tags(ctx1):
    """Any rank and axis order of x: result tags = x's free tags (x's order), then w's."""
    q, wd = qweight(ctx1, 24, 64, "q8_0")
    xa = rnd(2, 3, 64)
    y = ctx1.tensor(xa, ("b", "s", "i")).dot(q, "i")
    assert y.tags == ("b", "s", "o") and y.shape == (2, 3, 24)
    check_close(y.numpy(), xa, wd)
    xt = np.ascontiguousarray(xa.transpose(2, 0, 1))          # stored [i, b, s]
    y2 = ctx1.tensor(xt, ("i", "b", "s")).dot(q, "i")
    assert y2.tags == ("b", "s", "o")
    assert_bitwise(y2.numpy(), y.numpy())
    v = ctx1.tensor(xa[0, 0], ("i",)).dot(q, "i")               # a vector
    assert v.tags == ("o",) and v.shape == (24,)
    assert_bitwise(v.numpy(), y.numpy()[0, 0])
    big = ctx1.tensor(rnd(5, 128), ("s", "i"))                # a strided view of x
    xs = big.narrow("i", 32, 64)
    check_close(xs.dot(q, "i").numpy(), big.numpy()[:, 32:96], wd)


def test_exec_scope_and_no_grad(ctx1):
    q, _ = qweight(ctx1, 8, 32, "q4_0")
    x = ctx1.variable(rnd(2, 32), ("s", "i"))
    with ctx1.exec_scope():
        y = x.dot(q, "i")
        assert y.scope_owned and y.requires_grad
    with fu.no_grad():
        assert not x.dot(q, "i").requires_grad
    assert not ctx1.tensor(rnd(2, 32), ("s", "i")).dot(q, "i").requires_grad


# ---------------------------------------------------------------------------------------------
# gradient: to x only

@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("xshape,xtags", [((3, 256), ("s", "i")), ((256, 2, 3), ("i", "b", "s")),
                                          ((40, 256), ("s", "i"))])
def test_gradient_against_torch(ctx, fmt, xshape, xtags):
    q, wd = qweight(ctx, 20, 256, fmt)
    xa = rnd(*xshape)
    x = ctx.variable(xa, xtags)
    y = x.dot(q, "i")
    c = rnd(*y.shape)
    (y * ctx.tensor(c, y.tags)).sum_all().backward()
    tx = torch.tensor(xa, requires_grad=True)
    perm = [xtags.index(t) for t in y.tags[:-1]] + [xtags.index("i")]
    ty = tx.permute(perm) @ torch.tensor(wd.astype(np.float32)).T
    (ty * torch.from_numpy(c)).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-4, atol=1e-4)
    assert x.grad().tags == xtags
    np.testing.assert_allclose(x.grad().numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_gradcheck(ctx1):
    q, _ = qweight(ctx1, 6, 32, "q8_0")
    x = ctx1.variable(rnd(3, 32) * 0.5, ("s", "i"))
    c = ctx1.tensor(rnd(3, 6), ("s", "o"))
    res = fu.gradcheck(lambda x: (x.dot(q, "i") * c).sum_all(), [x])
    assert res.checked == x.numel


def test_gradient_needs_no_copy_of_w(ctx1):
    """The weight stays quantized: backward decodes it, the graph keeps only the blocks."""
    q, wd = qweight(ctx1, 16, 64, "q4_0")
    x = ctx1.variable(rnd(4, 64), ("s", "i"))
    x.dot(q, "i").sum_all().backward()
    np.testing.assert_allclose(x.grad().numpy(), np.tile(wd.sum(axis=0), (4, 1)), rtol=1e-5,
                               atol=1e-5)
    assert q.dtype == "q4_0" and not q.requires_grad


# ---------------------------------------------------------------------------------------------
# refusals

def test_errors(ctx1):
    q, _ = qweight(ctx1, 8, 64, "q8_0")
    x = ctx1.tensor(rnd(2, 64), ("s", "i"))
    with pytest.raises(fu.TagError, match=r"\[free, contract\]"):
        x.dot(fu.Tensor(q._raw, ("i", "o")), "i")           # stored [contract, free]
    with pytest.raises(fu.TagError, match="batch"):
        ctx1.tensor(rnd(8, 64), ("o", "i")).dot(q, "i")       # 'o' shared: a batch tag
    q3 = ctx1.tensor(rnd(2, 8, 64), ("e", "o", "i")).to("q8_0")
    with pytest.raises(fu.TagError, match="free, contract"):
        x.dot(q3, "i")
    with pytest.raises(fu.TagError, match="not an axis"):
        x.dot(q, "k")
    with pytest.raises(fu.ShapeMismatch, match="contraction"):
        ctx1.tensor(rnd(2, 32), ("s", "i")).dot(q, "i")
    with pytest.raises(fu.DTypeError, match="left operand.*f16"):
        x.to("f16").dot(q, "i")
    with pytest.raises(fu.DTypeError, match="q8_0"):
        q.dot(x, "i")                                         # quantized on the left
    with pytest.raises(fu.TagError, match="use|only through dot"):
        x.einsum(q, ("s", "o"))
    with pytest.raises(fu.TagError, match="only through dot"):
        with ctx1.exec_scope():
            fu.einsum_many(("s", "o"), x, q)
    with pytest.raises(fu.DTypeError, match="q8_0"):
        x.matmul(q, "trans_b", ("s", "o"))
    other = fu.ExecContext(threads=1)
    try:
        with pytest.raises(fu.ContextMismatch):
            other.tensor(rnd(2, 64), ("s", "i")).dot(q, "i")
    finally:
        other.close()


def test_quantized_weight_requiring_grad_is_refused(ctx1):
    """Quantized tensors never carry gradients; one that does (a graph node attached below the
    public API) would need dW, which the quantized matmul does not give."""
    q, _ = qweight(ctx1, 8, 64, "q8_0")
    forged = fu.Tensor(q._raw, q.tags, engine.Leaf(q.shape))
    x = ctx1.variable(rnd(2, 64), ("s", "i"))
    with pytest.raises(fu.GradientQuantizedMatmulUnsupported, match="frozen"):
        x.dot(forged, "i")
    assert isinstance(fu.GradientQuantizedMatmulUnsupported("x"), fu.FucinaError)
    with fu.no_grad():
        assert x.dot(forged, "i").shape == (2, 8)


def test_exec_layer_checks(ctx1):
    q, _ = qweight(ctx1, 8, 64, "q8_0")
    x = ctx1.tensor(rnd(2, 64), ("s", "i"))._raw
    with pytest.raises(fu.DTypeError, match="block-quantized"):
        xq.matmul(ctx1, x, x)
    with pytest.raises(fu.ShapeMismatch, match="expected x"):
        xq.matmul(ctx1, ctx1.tensor(rnd(64), ("i",))._raw, q._raw)
    with pytest.raises(fu.DTypeError, match="f32 activations"):
        xq.matmul(ctx1, ctx1.tensor(np.ones((2, 64)), ("s", "i"), dtype="i64")._raw, q._raw)


def test_kernels_are_vectorised():
    from fucina.codegen import jit
    from fucina.codegen import gemm
    from fucina.codegen.quant_gemm import QuantGemvKey, QuantTileKey

    for key in (QuantGemvKey("q4_k", 1, 8), QuantGemvKey("q8_0", 4, 2),
                QuantTileKey("q6_k", gemm.mr(), gemm.NR_VECS, gemm.UNROLL)):
        asm = jit.assembly(key.ir("k"))
        # no libm call; with AVX2 LLVM zeroes a q6_k panel's rows past N (256 floats, edge
        # panels only) by a memset call
        called = set(re.findall(r"movabsq\t\$([A-Za-z_]\w*),", asm))
        assert asm.count("call") == asm.count("callq\t*%") and called <= {"memset"}, (key, called)
        assert "vfmadd" in asm and "vmulps" in asm, key


# ---------------------------------------------------------------------------------------------
# get_rows

def get_rows(t, *args):
    return t.get_rows(*args)


def qconcat(t, *args):
    return t.concat(*args)


@pytest.mark.parametrize("fmt", ALL)
def test_get_rows_all_formats(ctx, fmt):
    bs = FORMATS[fmt][0]
    q, wd = qweight(ctx, 50, 2 * bs, fmt, ("vocab", "d"))
    ids = [3, 0, 49, 3, 17]
    e = get_rows(q, "vocab", ids, "seq")
    assert e.tags == ("seq", "d") and e.dtype == "f32" and not e.requires_grad
    assert_bitwise(e.numpy(), wd[ids].astype(np.float32))


def test_get_rows_layouts(ctx):
    x = rnd(3, 7, 64)
    q = ctx.tensor(x, ("a", "b", "c")).to("q8_0")
    full = q.numpy()
    idx = ctx.tensor(np.array([6, 1, 1, 0]), ("j",), dtype="i64")
    assert_bitwise(get_rows(q, "b", idx, "j").numpy(), full[:, [6, 1, 1, 0]])
    r = get_rows(q, "a", np.array([2], np.int32), "a")       # out_tag may be the tag itself
    assert r.tags == ("a", "b", "c")
    assert_bitwise(r.numpy(), full[[2]])
    assert_bitwise(get_rows(q, "a", range(3), "z").numpy(), full)


def test_get_rows_thread_invariance():
    x = rnd(600, 256)
    ids = RNG.integers(0, 600, 3000)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            out.append(get_rows(c.tensor(x, ("v", "d")).to("q4_k"), "v", ids, "s").numpy())
    assert_bitwise(out[0], out[1])


def test_get_rows_errors(ctx1):
    q = ctx1.tensor(rnd(5, 32), ("vocab", "d")).to("q8_0")
    with pytest.raises(fu.IndexOutOfBounds, match=r"index 5 at position 1 .*'vocab' of size 5"):
        get_rows(q, "vocab", [0, 5], "s")
    with pytest.raises(fu.IndexOutOfBounds, match="index -1"):
        get_rows(q, "vocab", ctx1.tensor(np.array([2, -1]), ("j",), dtype="i64"), "s")
    with pytest.raises(fu.TagError, match="innermost"):
        get_rows(q, "d", [0], "s")
    with pytest.raises(fu.TagError, match="not an axis"):
        get_rows(q, "x", [0], "s")
    with pytest.raises(fu.TagError, match="unique"):
        get_rows(q, "vocab", [0], "d")
    with pytest.raises(fu.InvalidShape, match="at least one"):
        get_rows(q, "vocab", [], "s")
    with pytest.raises(fu.InvalidShape, match="flat"):
        get_rows(q, "vocab", [[0]], "s")
    with pytest.raises(TypeError, match="integers"):
        get_rows(q, "vocab", [0.5], "s")
    with pytest.raises(fu.DTypeError, match="i64"):
        get_rows(q, "vocab", ctx1.tensor([0.0], ("j",)), "s")
    with pytest.raises(fu.DTypeError, match="gather"):
        get_rows(ctx1.tensor(rnd(5, 32), ("vocab", "d")), "vocab", [0], "s")


# ---------------------------------------------------------------------------------------------
# concat

@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "tq2_0"])
def test_concat_rows(ctx, fmt):
    K = FORMATS[fmt][0]
    a = ctx.tensor(rnd(3, K), ("o", "i")).to(fmt)
    b = ctx.tensor(rnd(5, K), ("o", "i")).to(fmt)
    c = ctx.tensor(rnd(1, K), ("o", "i")).to(fmt)
    r = qconcat(a, "o", b, c)
    assert r.dtype == fmt and r.tags == ("o", "i") and r.shape == (9, K) and not r.requires_grad
    want = np.concatenate([a.data_const(), b.data_const(), c.data_const()])
    assert np.array_equal(r.data_const(), want)
    assert np.array_equal(qconcat(a, "o", [b, c]).data_const(), want)     # list form


def test_concat_middle_axis(ctx):
    a = ctx.tensor(rnd(2, 3, 64), ("e", "o", "i")).to("q8_0")
    b = ctx.tensor(rnd(2, 4, 64), ("e", "o", "i")).to("q8_0")
    r = qconcat(a, "o", b)
    assert r.shape == (2, 7, 64)
    assert np.array_equal(r.data_const(), np.concatenate([a.data_const(), b.data_const()], axis=1))
    big = ctx.tensor(rnd(300, 2, 256), ("o", "e", "i")).to("q6_k")   # many copy chunks
    r = qconcat(big, "o", big)
    assert np.array_equal(r.data_const(), np.concatenate([big.data_const()] * 2))


def test_concat_then_dot(ctx1):
    """A fused QKV weight made by concatenating three quantized projections."""
    ws = [ctx1.tensor(rnd(n, 64), ("o", "i")).to("q8_0") for n in (8, 4, 4)]
    x = ctx1.tensor(rnd(2, 64), ("s", "i"))
    fused = x.dot(qconcat(ws[0], "o", ws[1], ws[2]), "i").numpy()
    assert_bitwise(fused, np.concatenate([x.dot(w, "i").numpy() for w in ws], axis=1))


def test_concat_dense_falls_through(ctx1):
    a, b = ctx1.variable(rnd(2, 3), ("r", "c")), ctx1.tensor(rnd(1, 3), ("r", "c"))
    r = qconcat(a, "r", b)
    assert r.requires_grad
    assert_bitwise(r.numpy(), fu.concat("r", a, b).numpy())


def test_concat_errors(ctx1):
    a = ctx1.tensor(rnd(2, 64), ("o", "i")).to("q8_0")
    with pytest.raises(fu.DTypeError, match="operand 1: expected q8_0.*q4_0"):
        qconcat(a, "o", fu.Tensor(xq.from_bytes(ctx1, bytes(2 * 36), (2, 64), "q4_0"), ("o", "i")))
    with pytest.raises(fu.DTypeError, match="operand 1: expected q8_0.*f32"):
        qconcat(a, "o", ctx1.tensor(rnd(2, 64), ("o", "i")))
    with pytest.raises(fu.DTypeError, match="expected f32 like operand 0.*q8_0"):
        qconcat(ctx1.tensor(rnd(2, 64), ("o", "i")), "o", a)
    with pytest.raises(fu.TagError, match="innermost"):
        qconcat(a, "i", a)
    with pytest.raises(fu.TagError, match="in that order"):
        qconcat(a, "o", fu.Tensor(a._raw, ("i", "o")))
    with pytest.raises(fu.ShapeMismatch, match="'i' has size 32"):
        qconcat(a, "o", ctx1.tensor(rnd(2, 32), ("o", "i")).to("q8_0"))
    with pytest.raises(fu.TagError, match="not an axis"):
        qconcat(a, "x", a)
