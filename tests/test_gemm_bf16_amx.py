"""The bf16 GEMM on AMX tiles (fucina.codegen.gemm_bf16_amx): against an exact model of
tdpbf16ps — per tile of 32 k, an even and an odd FMA chain from +0, then C + (even + odd),
every sum rounded once and flushed below 2^-126 — bit for bit, in both operand orientations
(the weight read in place, C turned as stored, and both operands packed), across the edges of
its 32 x 32 blocks and 16-row micro-tiles. The shared semantics (bounds against numpy,
accumulate and rank terms, threads, cold and cached kernels) run for every engine in
tests/test_gemm_bf16.py. Skipped where the CPU or the OS gives no AMX tiles."""
import numpy as np
import pytest

import fucina as fu
from conftest import assert_bitwise
from fucina.exec import matmul_bf16 as mb
from fucina.exec.matmul_bf16 import gemm_bf16
from test_gemm_bf16 import _edge_cases, _near_tiny, _step, bf16, each_sum, operand

pytestmark = pytest.mark.skipif(not mb.amx_granted(), reason="no AMX bf16 tiles on this host")


def _tiles_chain(p):
    """tdpbf16ps's sums (SDM pseudo-code, the probe of the codegen docstring): for each group
    of 32 k from 0, e = the even elements' products, o = the odd ones', each a chain of _step
    from +0 in k order; c = _step(c, _step(e, o))."""
    acc = 0.0
    for g in range(0, len(p), 32):
        e = o = 0.0
        for k in range(g, min(g + 32, len(p))):
            if k % 2:
                o = _step(o, p[k])
            else:
                e = _step(e, p[k])
        acc = _step(acc, _step(e, o))
    return acc


def model(A, B):
    """c = the tiles' sums (_tiles_chain); inputs rounded/flushed as packed."""
    return each_sum(A, B, _tiles_chain)


def model_f32(A, B):
    """model() for operands whose products and sums stay far from 2^-126 and 2^128, vectorized:
    there each _step is numpy's f32 add of an exact product (bf16 products are f32 values)."""
    a, b = bf16(A), bf16(B)
    M, K = a.shape
    c = np.zeros((M, b.shape[1]), np.float32)
    for g in range(0, K, 32):
        e = np.zeros_like(c)
        o = np.zeros_like(c)
        for k in range(g, min(g + 32, K)):
            p = a[:, k:k + 1] * b[k:k + 1, :]
            if k % 2:
                o = o + p
            else:
                e = e + p
        c = c + (e + o)
    return c


def amx(ctx, A, B, weight=False):
    """gemm_bf16 on tiles; weight: B held as a bf16 [N, K] matrix (a frozen weight's layout,
    read in place where K % 32 == 0 and N % 16 == 0), else f32 [K, N]."""
    b = operand(ctx, B, True, "bf16") if weight else ctx.from_numpy(B)
    return gemm_bf16(ctx, ctx.from_numpy(A), b, "amx")


def swapped(a, b):
    return mb._plans[(a.lay, b.lay, "amx", False, False)].swapped


@pytest.mark.parametrize("layout", ["f32", "weight", "bf16 rows"])
def test_exact_model_edges(ctx1, layout):
    """The orders, roundings, flushes and the 2^-126 band of the vdpbf16ps edge rows (K = 4:
    one group), under the tile's own order; B as f32, as a bf16 weight [N, K], and as bf16
    [K, N] rows in whole 32-column panels (copied as they are: the tiles read its denormals
    as zeros themselves)."""
    A, B = _edge_cases()
    if layout == "bf16 rows":
        B = np.concatenate([B, B[:, ::-1], B[:, :8]], 1)
        B[:, 31] = [2.0 ** -130, 0, 0, 0]                 # a bf16 denormal of B ...
        A = np.vstack([A, [[2.0 ** 100, 0, 0, 0]]]).astype(np.float32)   # ... times 2^100
        c = gemm_bf16(ctx1, ctx1.from_numpy(A), ctx1.from_numpy(B, dtype="bf16"), "amx")
    else:
        c = amx(ctx1, A, B, layout == "weight")
    assert_bitwise(c.to_numpy(), model(A, B))


def test_exact_model_random(ctx1):
    """Sums around 2^-126 and ordinary ones, K across groups and a ragged last group."""
    rng = np.random.default_rng(5)
    A, B = _near_tiny(rng, 12, 24, 17)
    assert_bitwise(amx(ctx1, A, B).to_numpy(), model(A, B))
    for M, K, N in ((9, 70, 20), (17, 33, 5)):
        A = rng.standard_normal((M, K)).astype(np.float32) * np.float32(3)
        B = rng.standard_normal((K, N)).astype(np.float32)
        want = model(A, B)
        assert_bitwise(amx(ctx1, A, B).to_numpy(), want)
        assert_bitwise(model_f32(A, B), want)      # the vectorized model, where it applies


def test_weight_in_place_is_the_model(ctx1):
    """A bf16 weight [N, K] with K % 32 == 0, N % 16 == 0 is the A side, read in place, and
    C is turned as stored: the model's bits, as with both operands packed."""
    rng = np.random.default_rng(6)
    A = rng.standard_normal((21, 64)).astype(np.float32)
    B = bf16(rng.standard_normal((64, 48)))
    w = operand(ctx1, B, True, "bf16")
    a = ctx1.from_numpy(A)
    got = gemm_bf16(ctx1, a, w, "amx").to_numpy()
    assert swapped(a, w)
    packed = ctx1.from_numpy(B, dtype="bf16")
    assert_bitwise(gemm_bf16(ctx1, a, packed, "amx").to_numpy(), got)
    assert not swapped(a, packed)
    assert_bitwise(got, model(A, B))


@pytest.mark.parametrize("weight", [False, True])
def test_block_edges_keep_the_chains(weight):
    """Rows across a 16-row micro-tile and the 32 x 32 blocks, columns past a panel: every
    element is the model's, at 1 and 2 threads (the chunk grid depends on the shape only)."""
    rng = np.random.default_rng(8)
    for M, N in ((1, 16), (15, 32), (16, 48), (17, 16), (33, 80), (48, 32), (70, 112)):
        A = rng.standard_normal((M, 96)).astype(np.float32)
        B = rng.standard_normal((96, N)).astype(np.float32)
        want = model_f32(A, B)
        for th in (1, 2):
            with fu.ExecContext(threads=th) as ctx:
                assert_bitwise(amx(ctx, A, B, weight).to_numpy(), want)


def test_many_chunks_and_rank_term_across_threads():
    """A grid of many chunks (rows in blocks, columns in blocks of 256) with the rank term in
    the turned stores: bitwise at 1 and 2 threads, and near numpy."""
    from test_gemm_bf16 import check_close
    rng = np.random.default_rng(9)
    A = rng.standard_normal((300, 96)).astype(np.float32)
    B = rng.standard_normal((96, 640)).astype(np.float32)
    X = rng.standard_normal((300, 8)).astype(np.float32)
    Y = rng.standard_normal((8, 640)).astype(np.float32)
    outs = []
    for th in (1, 2):
        with fu.ExecContext(threads=th) as ctx:
            w = operand(ctx, B, True, "bf16")
            a = ctx.from_numpy(A)
            plain = gemm_bf16(ctx, a, w, "amx").to_numpy()
            got = gemm_bf16(ctx, a, w, "amx", rank_add=(ctx.from_numpy(X), ctx.from_numpy(Y),
                                                        0.25))
            outs.append((plain, got.to_numpy()))
            assert swapped(a, w)
            assert mb._plans[(a.lay, w.lay, "amx", False, False)].tile[1] >= 8
    for o in outs:
        assert_bitwise(o[0], outs[0][0])
        assert_bitwise(o[1], outs[0][1])
    assert_bitwise(outs[0][0], model_f32(A, B))
    check_close(outs[0][0], A, B)


@pytest.mark.parametrize("weight", [False, True])
def test_k_slices_keep_the_bits(weight, monkeypatch):
    """A long k in slices of KS tiles (the head's dx), the sums of the earlier slices waiting
    in a place of their own, each slice's B panels packed by the tile kernel itself (kvec: a
    transposed f32 a; wvec: a row-major b): the bits of one pass — with C added to and the
    rank term — at 1 and 2 threads, the model's (slices of 2 tiles over 5: a short last
    slice)."""
    rng = np.random.default_rng(10)
    K = 160 if weight else 150          # the weight read in place (K % 32 == 0), or packed
    A = rng.standard_normal((40, K)).astype(np.float32)
    B = rng.standard_normal((K, 48)).astype(np.float32)
    X = rng.standard_normal((40, 4)).astype(np.float32)
    Y = rng.standard_normal((4, 48)).astype(np.float32)
    C0 = rng.standard_normal((40, 48)).astype(np.float32)
    results = []
    for ks in (1 << 20, 2):
        monkeypatch.setattr(mb, "AMX_LONG_K", ks)
        monkeypatch.setattr(mb, "AMX_K_SLICE", ks)
        mb._plans.clear()
        for th in (1, 2):
            with fu.ExecContext(threads=th) as ctx:
                b = operand(ctx, B, True, "bf16") if weight else ctx.from_numpy(B)
                a = ctx.from_numpy(A)
                plain = gemm_bf16(ctx, a, b, "amx").to_numpy()
                out = ctx.from_numpy(C0.copy())
                gemm_bf16(ctx, a, b, "amx", out=out, accumulate=True,
                          rank_add=(ctx.from_numpy(X), ctx.from_numpy(Y), 0.5))
                results.append((plain, out.to_numpy()))
                plan = mb._plans[(a.lay, b.lay, "amx", False, False)]
                assert bool(plan.partial) == (ks == 2) and plan.swapped == weight
                assert (plan.bpack is None) == (ks == 2)   # slices pack B's panels in place
    mb._plans.clear()
    for r in results:
        assert_bitwise(r[0], results[0][0])
        assert_bitwise(r[1], results[0][1])
    assert_bitwise(results[0][0], model_f32(A, B))
