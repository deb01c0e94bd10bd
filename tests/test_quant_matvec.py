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
from conftest import assert_bitwise
from fucina.codegen.quant import FORMATS
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


def test_bad_input(ctx1):
    q, _ = qweight(ctx1, 64, 576, "q4_1")
    with pytest.raises(fu.FucinaError, match="dot"):
        ctx1.tensor(rnd(1, 544), ("s", "i")).dot(q, "i")
    with pytest.raises(fu.FucinaError, match="dot"):
        ctx1.tensor(rnd(1, 576), ("s", "i")).to("f16").dot(q, "i")
