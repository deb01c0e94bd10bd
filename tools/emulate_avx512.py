"""A pytest plugin that runs the 16-lane (AVX-512) kernels on an AVX2 CPU:

    .venv/bin/python -m pytest -p tools.emulate_avx512 tests/test_attention.py tests/test_norm.py

Every kernel is generated as on a Zen 4 host with AVX-512 F / BW / VL / DQ / CD (16 f32
lanes, 32 registers, mask registers: the IR a Zen 4 / Zen 5 machine builds), then compiled
for this CPU, whose LLVM backend splits the 512-bit vectors into 256-bit halves. What the
IR computes is what the AVX-512 build computes, so the suite's value tests (bitwise against
numpy, PyTorch, exact models) check the 16-lane code paths on a machine that cannot run
them. Use it after changing a kernel generator on an AVX2 host.

What it cannot check: the instructions LLVM selects for a real AVX-512 target, and the
kernels written in AVX-512-only intrinsics. Those stay as on a real AVX2 host: without VBMI,
VNNI and BF16 the q8 whole pairs, the K-quant register decoders and vdpbf16ps are not built;
vmath's exp takes its two-multiply 2^n instead of vscalefps (the same bits); a kernel whose
IR still calls an @llvm.x86.avx512 intrinsic (the 16-lane q4 / q5 tables) is skipped, not
compiled (this CPU's backend would abort the process). The tests that read the generated
assembly (FMA counts per micro-tile, spills) fail here by construction: each 16-lane
instruction is two. And the sign of a NaN an instruction propagates follows instruction
selection (tools/kernel_outputs.golden): tests/test_kernel_templates.py's 512-bit table
matches in 1212 of its 1221 cases here (Zen 3), the other 9 differ in NaN signs alone. The
kernel cache is a fresh temporary directory.

Session 25 (Zen 3) ran test_attention, test_gemm, test_matmul, test_gemm_bf16, test_norm,
test_softmax, test_elementwise, test_loss and test_quant_matvec this way: the 163 kernels of
the test manifest whose AVX-512 machine code changed since the last AVX-512 run (attention,
gemm_small, gemm_pack, gemm_tile_direct, group_norm, the bf16 emulation tile) all passed.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile

import llvmlite.binding as llvm
import pytest

llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
REAL_CPU = llvm.get_host_cpu_name()
REAL_FEATURES = llvm.get_host_cpu_features().flatten()
if "+avx2" not in REAL_FEATURES.split(","):
    raise pytest.UsageError("emulate_avx512: this CPU has no AVX2")
AVX512 = ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd"


class _Features:
    def flatten(self):
        return REAL_FEATURES + AVX512


# before fucina is imported: target.host() reads these once
llvm.get_host_cpu_features = lambda: _Features()
llvm.get_host_cpu_name = lambda: "znver4"
_CACHE = tempfile.mkdtemp(prefix="fucina-emulate-avx512-")
os.environ["FUCINA_CACHE_DIR"] = _CACHE

from fucina.codegen import jit, target, vmath  # noqa: E402

_INTRINSIC = re.compile(r'@"?(llvm\.x86\.avx512[\w.]*)')


@functools.lru_cache(maxsize=None)
def _this_cpu():
    """The TargetMachine of the real CPU (the IR's decisions stay the mocked host's)."""
    t = target.host()
    return llvm.Target.from_triple(t.triple).create_target_machine(
        cpu=REAL_CPU, features=REAL_FEATURES, opt=3, reloc="static", codemodel="jitdefault")


_optimized = jit._optimized


def _checked(ir_text, vectorize_loops):
    found = _INTRINSIC.search(ir_text)
    if found:
        pytest.skip(f"emulate_avx512: the kernel calls {found.group(1)}, which needs "
                    f"AVX-512 hardware")
    return _optimized(ir_text, vectorize_loops)


target.target_machine = _this_cpu
jit.target_machine = _this_cpu
jit._optimized = _checked
vmath._scalef = lambda x: False


def pytest_report_header(config):
    t = target.host()
    return (f"emulate_avx512: kernels built for {t.cpu} ({t.vector_bits}-bit vectors), "
            f"compiled for {REAL_CPU}; kernel cache {_CACHE}")


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
