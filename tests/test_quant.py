"""Block-quantized formats (SPEC R-9): every decoder bitwise against the `gguf` package's numpy
dequantizers (q8_k against a numpy transcription of ggml's dequantize_row_q8_K), the encoders
byte for byte against gguf's numpy quantizers (q8_0, tq2_0, f16, bf16) and libgguf, which
reproduces llama.cpp's reference quantizers (q4_k, q5_k, q6_k; q8_0 and tq2_0 too), quantized
tensors in the library (to(), no gradients, every other op refused) and thread invariance."""
import warnings

import libgguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

import fucina as fu
from conftest import assert_bitwise
from fucina.codegen.quant import ENCODABLE, FORMATS
from fucina.exec import quant as xq

RNG = np.random.default_rng(11)
GGML = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "q8_0": GT.Q8_0,
        "q2_k": GT.Q2_K, "q3_k": GT.Q3_K, "q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K,
        "q8_k": GT.Q8_K, "tq2_0": GT.TQ2_0}


def quantized(ctx, blocks: np.ndarray, shape, fmt, tags=("r", "c")):
    """A quantized Tensor over raw ggml block bytes."""
    return fu.Tensor(xq.from_bytes(ctx, blocks.tobytes(), shape, fmt), tags)


def hard_rows(rows, K):
    """Gaussian rows with the cases quantizers get wrong: all-zero rows and blocks, tiny and
    huge magnitudes, single outliers, one-signed rows, heavy tails, sparse rows, integers."""
    x = RNG.standard_normal((rows, K)).astype(np.float32)
    x[0] = 0
    x[1] *= 1e-30
    x[2] *= 3e4
    x[3, 5] = 40.0
    x[4, K - 1] = -1e4
    x[5, : K // 2] = 0
    x[6] = np.abs(x[6]) + 1
    x[7] = -np.abs(x[7])
    x[8] = RNG.standard_cauchy(K)
    x[9] *= RNG.random(K) < 0.05
    x[10] = np.round(x[10] * 3)
    x[11] *= 1e-6
    x[12] = 1.0
    return x


def ref_dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "q8_k":  # neither gguf nor libgguf decodes q8_k: ggml's loop, in numpy
        b = blocks.reshape(-1, 292)
        d = b[:, :4].copy().view(np.float32)
        with np.errstate(all="ignore"):
            return (d * b[:, 4:260].view(np.int8).astype(np.float32)).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random bytes hold inf/NaN scales
        return dequantize(blocks.reshape(-1), GGML[fmt]).reshape(-1)


# ---------------------------------------------------------------------------------------------
# decoders

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_random_blocks(ctx, fmt):
    """Arbitrary bytes (inf and NaN scales included) decode exactly as ggml decodes them."""
    bs, bb = FORMATS[fmt]
    rows, nb = 3, 5
    raw = RNG.integers(0, 256, rows * nb * bb, dtype=np.uint8)
    q = quantized(ctx, raw, (rows, nb * bs), fmt)
    assert q.dtype == fmt and q.shape == (rows, nb * bs) and not q.requires_grad
    got = q.to("f32")
    assert got.dtype == "f32" and got.tags == ("r", "c")
    assert_bitwise(got.numpy().reshape(-1), ref_dequantize(raw, fmt).astype(np.float32))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "q8_k"])
def test_decode_real_blocks(ctx1, fmt):
    """Blocks made by the real quantizers (llama.cpp's, through libgguf) from hard data."""
    x = hard_rows(16, 512)
    raw = libgguf.quantize_rows(x, int(GGML[fmt]))
    q = quantized(ctx1, raw, x.shape, fmt)
    assert_bitwise(q.to("f32").numpy(), ref_dequantize(raw, fmt).reshape(x.shape))
    assert np.array_equal(q.data_const(), raw)


# ---------------------------------------------------------------------------------------------
# encoders

@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize("K", [256, 1024])
def test_encode_byte_exact(ctx, fmt, K):
    x = hard_rows(24, K)
    q = ctx.tensor(x, ("r", "c")).to(fmt)
    assert q.dtype == fmt and q.shape == x.shape
    got = q.data_const()
    assert got.shape == (24, K // FORMATS[fmt][0] * FORMATS[fmt][1])
    want = libgguf.quantize_rows(x, int(GGML[fmt]))
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad.tolist()} differ from llama.cpp's quantizer"
    if fmt in ("q8_0", "tq2_0"):  # the gguf package's own numpy quantizers agree too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert np.array_equal(got, quantize(x, GGML[fmt]))


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_encode_many_distributions(ctx2, fmt):
    """A few hundred rows from several distributions and scales, one launch."""
    parts = [RNG.standard_normal((64, 512)), RNG.uniform(-1, 1, (32, 512)),
             RNG.standard_cauchy((32, 512)), np.abs(RNG.standard_normal((32, 512))) + 0.5,
             RNG.standard_normal((32, 512)) * 1e-5, RNG.standard_normal((32, 512)) * 1e3,
             RNG.laplace(size=(32, 512))]
    x = np.concatenate(parts).astype(np.float32)
    got = ctx2.tensor(x, ("r", "c")).to(fmt).data_const()
    assert np.array_equal(got, libgguf.quantize_rows(x, int(GGML[fmt])))


@pytest.mark.parametrize("src", ["f16", "bf16"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_encode_from_16_bit(ctx1, src, fmt):
    x = hard_rows(13, 256)
    t = ctx1.tensor(x, ("r", "c")).to(src)
    widened = t.numpy().astype(np.float32)
    assert np.array_equal(t.to(fmt).data_const(), libgguf.quantize_rows(widened, int(GGML[fmt])))


def test_16_bit_casts_match_gguf(ctx1):
    """f16 and bf16 'encoders' are the casts; gguf's quantizers are the oracle."""
    x = hard_rows(13, 256)
    x[3, :4] = [np.nan, np.inf, -np.inf, 1e-40]
    t = ctx1.tensor(x, ("r", "c"))
    f16 = t.to("f16").data_const()
    with np.errstate(over="ignore"):
        assert np.array_equal(f16.view(np.uint16), quantize(x, GT.F16).view(np.uint16))
    bf16 = t.to("bf16").data_const()
    assert np.array_equal(bf16.view(np.uint16), quantize(x, GT.BF16).view(np.uint16))


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_round_trip_error(ctx1, fmt):
    """Dequantize(quantize(x)) stays within the format's resolution of the block's scale."""
    x = RNG.standard_normal((8, 1024)).astype(np.float32)
    y = ctx1.tensor(x, ("r", "c")).to(fmt).to("f32").numpy()
    # (max error / max |x|, mean error / mean |x|) bounds: about twice what Gaussian data gives
    tmax, tmean = {"q8_0": (0.008, 0.012), "q6_k": (0.03, 0.04), "q5_k": (0.05, 0.08),
                   "q4_k": (0.1, 0.15), "tq2_0": (0.502, 1.0)}[fmt]
    err = np.abs(y - x)
    assert err.max() <= tmax * np.abs(x).max()
    assert err.mean() <= tmean * np.abs(x).mean()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k", "tq2_0"])
def test_thread_invariance(fmt):
    """Many chunks (rows of several blocks): identical bytes and values at 1 and 2 threads."""
    x = RNG.standard_normal((96, 2048)).astype(np.float32)
    out = []
    for threads in (1, 2):
        with fu.ExecContext(threads=threads) as c:
            q = c.tensor(x, ("r", "c")).to(fmt)
            out.append((q.data_const().copy(), q.to("f32").numpy()))
    assert np.array_equal(out[0][0], out[1][0])
    assert_bitwise(out[0][1], out[1][1])


def test_kernels_are_vectorised():
    """The decoders and the q8_0 encoder are hand-vectorised: their object code uses vector
    registers for the float math (packed `mulps`, no libm calls)."""
    from fucina.codegen import jit
    from fucina.codegen.quant import QuantKey

    for key in (QuantKey("q4_k", "decode"), QuantKey("q8_0", "decode"), QuantKey("q8_0", "encode")):
        asm = jit.assembly(key.ir("k"))
        assert "vmulps" in asm, key
        assert "call" not in asm, key


# ---------------------------------------------------------------------------------------------
# quantized tensors in the library: exactly the allowed operations

def test_to_and_numpy(ctx1):
    x = RNG.standard_normal((2, 3, 64)).astype(np.float32)
    q = ctx1.tensor(x, ("a", "b", "c")).to("q8_0")
    assert q.tags == ("a", "b", "c") and q.numel == x.size and q.requires_grad is False
    assert_bitwise(q.numpy(), q.to("f32").numpy())  # numpy() dequantizes
    assert q.data_const().shape == (2, 3, 68)
    assert "q8_0" in repr(q)


def test_bad_shapes(ctx1):
    with pytest.raises(fu.InvalidShape, match="multiple of 32"):
        ctx1.tensor(np.ones((2, 48), np.float32), ("r", "c")).to("q8_0")
    with pytest.raises(fu.InvalidShape, match="multiple of 256"):
        ctx1.tensor(np.ones((2, 128), np.float32), ("r", "c")).to("q4_k")
    with pytest.raises(fu.InvalidShape):
        ctx1.tensor(3.0, ()).to("q8_0")


def test_bad_casts(ctx1):
    x = ctx1.tensor(np.ones((2, 256), np.float32), ("r", "c"))
    with pytest.raises(fu.DTypeError, match="q4_0"):
        x.to("q4_0")  # decodes, but ggml-exact encoding is not offered for it
    q = x.to("q6_k")
    for target in ("f16", "bf16", "i64", "q8_0", "q6_k"):
        with pytest.raises(fu.DTypeError, match="only to 'f32'"):
            q.to(target)
    with pytest.raises(fu.DTypeError, match="expects an f32/f16/bf16"):
        ctx1.tensor(np.ones((1, 32), np.int64), ("r", "c"), dtype="i64").to("q8_0")
    with pytest.raises(fu.DTypeError):
        x.to("q9_9")


def test_no_gradients(ctx1):
    w = ctx1.variable(RNG.standard_normal((4, 32)).astype(np.float32), ("r", "c"))
    with pytest.raises(fu.GradientCastUnsupported, match="not differentiable"):
        w.to("q8_0")
    with fu.no_grad():
        q = w.to("q8_0")
    assert not q.requires_grad
    q2 = w.detach().to("q8_0")
    assert np.array_equal(q.data_const(), q2.data_const())
    assert not q.to("f32").requires_grad


def test_other_ops_refused(ctx1):
    q = ctx1.tensor(RNG.standard_normal((4, 64)).astype(np.float32), ("r", "c")).to("q8_0")
    y = ctx1.tensor(RNG.standard_normal((4, 64)).astype(np.float32), ("r", "c"))
    w = ctx1.tensor(RNG.standard_normal((64, 3)).astype(np.float32), ("c", "o"))
    ops = [lambda: q + y, lambda: y + q, lambda: q * 2.0, lambda: q.scale(2.0), lambda: -q,
           lambda: q.relu(), lambda: q.unary("exp"), lambda: q.sum("c"), lambda: q.sum_all(),
           lambda: q.max("c"), lambda: q.dot(w, "c"), lambda: q.einsum(w, ("r", "o")),
           lambda: q.softmax("c"), lambda: q.layer_norm("c", 1e-5), lambda: q.rms_norm("c", 1e-6),
           lambda: q.narrow("r", 0, 2), lambda: q.clamp(-1.0, 1.0), lambda: q.cumsum("c"),
           lambda: q.cross_entropy("c", [0, 1, 2, 3]), lambda: q.dropout(0.1, seed=1),
           lambda: y.where(y.compare("lt", 0.0), q), lambda: q.matmul(y, "trans_b", ("m", "n")),
           lambda: q.compare("lt", 0.0)]
    for op in ops:
        with pytest.raises(fu.DTypeError, match="q8_0"):
            op()
