"""f32 <-> f16 / bf16 conversion kernels: bitwise against numpy and the SPEC R-9 formula."""
import numpy as np
import pytest

from conftest import assert_bitwise
from fucina.exec.dtypes import bf16_bits_to_f32


def spec_bf16(a):
    """SPEC R-9, transcribed with Python ints as an independent reference."""
    out = []
    for b in a.view(np.uint32).tolist():
        if (b & 0x7FFFFFFF) > 0x7F800000:
            out.append(((b >> 16) | 0x0040) & 0xFFFF)
        else:
            out.append((((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFFFFFF) >> 16) & 0xFFFF)
    return np.array(out, np.uint16)


def interesting_f32(n=20000):
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 500).astype(np.uint32) << 16) | np.uint32(0x8000)  # exact halfway
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                        0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000],
                       np.uint32)
    return np.concatenate([raw, ties, special]).view(np.float32)


def test_f32_to_bf16_is_spec_formula(ctx):
    a = interesting_f32()
    got = ctx.tensor(a, ("n",)).to("bf16").data_const()
    assert_bitwise(np.array(got), spec_bf16(a))


def test_bf16_to_f32_exact(ctx):
    h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    t = ctx.tensor(bf16_bits_to_f32(h), ("n",), dtype="bf16")
    stored = np.array(t.data_const())
    assert_bitwise(stored, spec_bf16(bf16_bits_to_f32(h)))  # signalling NaNs come back quieted
    assert_bitwise(t.to("f32").numpy(), bf16_bits_to_f32(stored))


def test_f32_to_f16_round_trip(ctx):
    a = interesting_f32()
    with np.errstate(all="ignore"):
        want = a.astype(np.float16)
    got = np.array(ctx.tensor(a, ("n",)).to("f16").data_const())
    assert_bitwise(got, want)
    every = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert_bitwise(ctx.tensor(every, ("n",), dtype="f16").to("f32").numpy(), every.astype(np.float32))


@pytest.mark.parametrize("src,dst", [("f16", "bf16"), ("bf16", "f16"), ("i64", "i64"), ("bool", "bool")])
def test_other_casts(ctx, src, dst):
    a = np.array([1, 0, 3, 1] if src != "bool" else [1, 0, 1, 1], np.float32)
    t = ctx.tensor(a, ("n",), dtype=src)
    assert np.array_equal(t.to(dst).numpy().astype(np.float32), a)
