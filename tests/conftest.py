"""Shared fixtures: contexts at 1 and 2 threads, and numpy helpers for bitwise comparisons."""
import io

import numpy as np
import pytest

import fucina as fu


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def ctx(request):
    c = fu.ExecContext(threads=request.param)
    yield c
    c.close()


@pytest.fixture
def ctx1():
    c = fu.ExecContext(threads=1)
    yield c
    c.close()


@pytest.fixture
def ctx2():
    c = fu.ExecContext(threads=2)
    yield c
    c.close()


def bits(a) -> np.ndarray:
    """The raw bits of a float array, so NaN payloads and signed zeros compare exactly."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    gb, wb = bits(got), bits(want)
    # all NaNs are equal for our purposes unless the test checks payloads itself
    nan = np.isnan(got) & np.isnan(want) if got.dtype.kind == "f" else np.zeros(got.shape, bool)
    bad = (gb != wb) & ~nan
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[:3].tolist()}: " \
        f"got {got[bad][:3]} want {want[bad][:3]}"


def ulp_diff(got, want64) -> np.ndarray:
    """|got - want| in units of the float32 ulp at want (want given in float64)."""
    want32 = want64.astype(np.float32)
    spacing = np.spacing(np.abs(want32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want64) / spacing


# ---- optimizer test helpers (shared by the test_optim_* modules) ----

def bf16_round(a) -> np.ndarray:
    """f32 values rounded to bf16 (R-9) and widened back."""
    from fucina.exec.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32)))


def feed_grad(ctx, w, g):
    """Set w's accumulated gradient to exactly g (a fresh leaf gradient, like one backward)."""
    w.zero_grad()
    w.backward(grad=ctx.tensor(np.asarray(g, np.float32).reshape(w.shape), w.tags))


def state_bytes(opt) -> bytes:
    """The optimizer's bare save_state frame (SPEC T-17 bytes, without the CRC32 envelope)."""
    f = io.BytesIO()
    opt.save_state(f, checksum=False)
    return f.getvalue()


def load_state_bytes(opt, data: bytes):
    opt.load_state(io.BytesIO(data))


def assert_cold_equals_warm(forget, run):
    """run() with its kernels compiled (after forget() dropped them from memory) and then
    loaded from the disk cache (after forget() again) gives the same bits."""
    from fucina.codegen import kernels
    forget()
    n0 = kernels.stats.compiled
    cold = run()
    assert kernels.stats.compiled > n0
    forget()
    l0, c0 = kernels.stats.loaded, kernels.stats.compiled
    warm = run()
    assert kernels.stats.compiled == c0 and kernels.stats.loaded > l0
    for x, y in zip(cold, warm):
        assert_bitwise(x, y)


def asm_loops(asm: str) -> list[list[str]]:
    """Every loop of an assembly listing: the lines from a label to a backward jump to it
    (nested loops appear once each, the outer ones holding the inner)."""
    lines = asm.splitlines()
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines)
              if ln.startswith(".LBB") and ln.rstrip().endswith(":")}
    loops = []
    for j, ln in enumerate(lines):
        parts = ln.split()
        if len(parts) == 2 and parts[0].startswith("j") and labels.get(parts[1], j) < j:
            loops.append(lines[labels[parts[1]]:j + 1])
    return loops
