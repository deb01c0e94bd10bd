"""tools/emulate_avx512 keeps working: the 16-lane (AVX-512) quantized matvec kernels, the ones
written in AVX-512 intrinsics included, pass their value tests on this CPU through it. A
subprocess: the plugin mocks the host before fucina is imported. The CPU must have AVX2 (every
host this project runs on: the plugin names it as a usage error otherwise, and the test fails
with that message rather than skip)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_16_lane_quant_kernels_pass_their_value_tests_under_emulation():
    """q4_0 / q4_1's 16-value tables (vpermps), q5_0's 32-value ones (vpermi2ps), the q5_k
    register decoder (vpermb, vpternlogd) against the block decoders on any bytes, and the q8
    whole-pair kernel (vpdpbusd; q4_0, q4_1, q8_0) against its Fractions model: 10 tests, none
    skipped. (A changed FMA or a wrong q8_0 zero point in the whole-pair kernel fails it.)"""
    tests = [f"tests/test_quant_matvec.py::{t}" for t in (
        "test_dot_q8_follows_its_model_bit_for_bit", "test_register_decode_on_any_bytes")]
    p = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "tools.emulate_avx512",
                        "-p", "no:cacheprovider", *tests, "-k", "q4_0 or q4_1 or q5_0 or q5_k or q8_0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "kernels built for znver4 (512-bit vectors)" in p.stdout
    assert "10 passed" in p.stdout and "skipped" not in p.stdout, p.stdout[-2000:]
