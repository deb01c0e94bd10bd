"""A pytest plugin that runs the 16-lane (AVX-512) kernels on an AVX2 CPU:

    .venv/bin/python -m pytest -p tools.emulate_avx512 tests/test_attention.py tests/test_norm.py

Every kernel is generated as on a Zen 4 host with AVX-512 F / BW / VL / DQ / CD / VBMI /
VNNI (16 f32 lanes, 32 registers, mask registers: the IR a Zen 4 / Zen 5 machine builds),
then compiled for this CPU, whose LLVM backend splits the 512-bit vectors into 256-bit
halves. The AVX-512 intrinsics the kernels call are given definitions in generic IR with the
instructions' arithmetic (_GENERIC: vpermps, vpermi2ps, vpermb, vpternlogd, vpdpbusd,
vscalefps), so the 16-lane q4 / q5 tables, the K-quant register decoders, the q8 whole pairs
and vmath's exp run too.
What the IR computes is what the AVX-512 build computes, so the suite's value tests (bitwise
against numpy, PyTorch, exact models) check the 16-lane code paths on a machine that cannot
run them. Use it after changing a kernel generator on an AVX2 host.

What it cannot check: the instructions LLVM selects for a real AVX-512 target, and AVX-512
BF16 (vdpbf16ps and its conversions: the host is built without it, so the bf16 GEMMs take
their emulation at 16 lanes; a kernel still calling another @llvm.x86.avx512 intrinsic is
skipped, not compiled: this CPU's backend would abort the process). The tests that read
the generated assembly (FMA counts per micro-tile, spills) fail here by construction: each
16-lane instruction is two. The sign of a NaN an instruction propagates follows instruction
selection (tools/kernel_outputs.golden): tests/test_kernel_templates.py's 512-bit table
matches in 1212 of its 1221 cases here (Zen 3), the other 9 differ in NaN signs alone.
The kernel cache is a fresh temporary directory. The permutes run lane by lane: slow.

Tests that compare with PyTorch's float32 bits at rounding level can fail here and not on a
real AVX-512 host: PyTorch on this CPU runs its AVX2 kernels, other bits than its AVX-512
ones (test_softmax's gradients and test_gpt's Adam steps now compare with torch in float64).
Tests that compare with another process (test_finetune's resume in a fresh process, its Ray
actors) fail by construction: the child runs this host's own 8-lane kernels.

Session 25 (Zen 3) ran test_attention, test_gemm, test_matmul, test_gemm_bf16, test_norm,
test_softmax, test_elementwise, test_loss, test_quant, test_quant_matmul, test_quant_matvec,
test_llm_generate, test_decoder_replay, test_gpt, the op files (activations, conv, rope,
reduce, selection, scan, gather_scatter, linear_ce, masks, reshape, typed, rng, optim_update,
moe: 1831 tests) and the training files (finetune, lora, qwen3, decoder_archs,
optim_training, optim_muon, nanochat, head_rows: 371 of 373, the two above failing) this
way: every value test passed, the
163 kernels of the test manifest whose AVX-512 machine code changed since the last AVX-512
run (attention, gemm_small, gemm_pack, gemm_tile_direct, group_norm, the bf16 emulation
tile) included, and the q8 whole-pair kernel against its Fractions model.
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
AVX512 = ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vbmi,+avx512vnni"


class _Features:
    def flatten(self):
        return REAL_FEATURES + AVX512


# before fucina is imported: target.host() reads these once
llvm.get_host_cpu_features = lambda: _Features()
llvm.get_host_cpu_name = lambda: "znver4"
_CACHE = tempfile.mkdtemp(prefix="fucina-emulate-avx512-")
os.environ["FUCINA_CACHE_DIR"] = _CACHE
os.environ.pop("FUCINA_ASSERT_WARM", None)      # a fresh cache: everything compiles
os.environ.pop("FUCINA_RECORD_MANIFEST", None)  # and its keys are another host's

from fucina.codegen import jit, target  # noqa: E402

_INTRINSIC = re.compile(r'@"?(llvm\.x86\.avx512[\w.]*)')


def _lanes(n, elem, body):
    """IR lines computing %r<n-1> lane by lane: body(k) gives lane k's lines and its value."""
    out, prev = [], "undef"
    for k in range(n):
        lines, v = body(k)
        out += lines + [f"  %r{k} = insertelement <{n} x {elem}> {prev}, {elem} {v}, i32 {k}"]
        prev = f"%r{k}"
    return out


def _permvar(n, elem, idx_elem):
    """a[idx & (n − 1)] per lane (vpermps / vpermb)."""
    def lane(k):
        return [f"  %i{k} = extractelement <{n} x {idx_elem}> %idx, i32 {k}",
                f"  %j{k} = and {idx_elem} %i{k}, {n - 1}",
                f"  %e{k} = extractelement <{n} x {elem}> %a, {idx_elem} %j{k}"], f"%e{k}"
    return (f"(<{n} x {elem}> %a, <{n} x {idx_elem}> %idx)", _lanes(n, elem, lane), f"%r{n - 1}")


def _permi2():
    """(idx & 16 ? b : a)[idx & 15] per lane (vpermi2ps)."""
    def lane(k):
        return [f"  %i{k} = extractelement <16 x i32> %idx, i32 {k}",
                f"  %j{k} = and i32 %i{k}, 15", f"  %h{k} = and i32 %i{k}, 16",
                f"  %s{k} = icmp ne i32 %h{k}, 0",
                f"  %x{k} = extractelement <16 x float> %a, i32 %j{k}",
                f"  %y{k} = extractelement <16 x float> %b, i32 %j{k}",
                f"  %e{k} = select i1 %s{k}, float %y{k}, float %x{k}"], f"%e{k}"
    return ("(<16 x float> %a, <16 x i32> %idx, <16 x float> %b)", _lanes(16, "float", lane),
            "%r15")


def _dpbusd():
    """acc + the sum of each lane's four unsigned (a) by signed (b) byte products."""
    lines = ["  %ab = bitcast <16 x i32> %a to <64 x i8>",
             "  %bb = bitcast <16 x i32> %b to <64 x i8>",
             "  %aw = zext <64 x i8> %ab to <64 x i32>", "  %bw = sext <64 x i8> %bb to <64 x i32>",
             "  %p = mul <64 x i32> %aw, %bw"]
    for k in range(4):
        idx = ", ".join(f"i32 {4 * i + k}" for i in range(16))
        lines.append(f"  %q{k} = shufflevector <64 x i32> %p, <64 x i32> undef, <16 x i32> <{idx}>")
    lines += ["  %s0 = add <16 x i32> %q0, %q1", "  %s1 = add <16 x i32> %q2, %q3",
              "  %s2 = add <16 x i32> %s0, %s1", "  %r = add <16 x i32> %acc, %s2"]
    return "(<16 x i32> %acc, <16 x i32> %a, <16 x i32> %b)", lines, "%r"


def _pternlog():
    """Per bit, bit (a << 2 | b << 1 | c) of imm (vpternlogd)."""
    v = "<16 x i32>"
    ones = "<" + ", ".join(["i32 -1"] * 16) + ">"
    lines = [f"  %na = xor {v} %a, {ones}", f"  %nb = xor {v} %b, {ones}",
             f"  %nc = xor {v} %c, {ones}", f"  %zero = xor {v} %a, %a"]
    for k in range(8):
        x, y, z = ("%a" if k & 4 else "%na"), ("%b" if k & 2 else "%nb"), ("%c" if k & 1 else "%nc")
        lines += [f"  %bit{k} = lshr i32 %imm, {k}", f"  %one{k} = trunc i32 %bit{k} to i1",
                  f"  %xy{k} = and {v} {x}, {y}", f"  %xyz{k} = and {v} %xy{k}, {z}",
                  f"  %m{k} = select i1 %one{k}, {v} %xyz{k}, {v} zeroinitializer",
                  f"  %t{k} = or {v} {f'%t{k - 1}' if k else '%zero'}, %m{k}"]
    return f"({v} %a, {v} %b, {v} %c, i32 %imm)", lines, "%t7"


def _scalef():
    """a·2^b for integral b, rounded once (vscalefps with every lane selected): the exact
    product in double, then one rounding to float."""
    v, d, q = "<16 x float>", "<16 x double>", "<16 x i64>"
    lines = [f"  %n = fptosi {v} %b to {q}",
             f"  %e = add {q} %n, <{', '.join(['i64 1023'] * 16)}>",
             f"  %sh = shl {q} %e, <{', '.join(['i64 52'] * 16)}>",
             f"  %p = bitcast {q} %sh to {d}", f"  %ad = fpext {v} %a to {d}",
             f"  %m = fmul {d} %ad, %p", f"  %r = fptrunc {d} %m to {v}"]
    return f"({v} %a, {v} %b, {v} %src, i16 %k, i32 %rc)", lines, "%r"


# the AVX-512 intrinsics with a generic definition (every other one skips its test)
_GENERIC = {
    "llvm.x86.avx512.permvar.sf.512": ("<16 x float>", lambda: _permvar(16, "float", "i32")),
    "llvm.x86.avx512.permvar.qi.512": ("<64 x i8>", lambda: _permvar(64, "i8", "i8")),
    "llvm.x86.avx512.vpermi2var.ps.512": ("<16 x float>", _permi2),
    "llvm.x86.avx512.vpdpbusd.512": ("<16 x i32>", _dpbusd),
    "llvm.x86.avx512.pternlog.d.512": ("<16 x i32>", _pternlog),
    "llvm.x86.avx512.mask.scalef.ps.512": ("<16 x float>", _scalef),
}


def _generic(ir_text: str) -> str:
    """ir_text with each _GENERIC intrinsic's declaration replaced by a definition in generic
    IR under its own name (LLVM reserves llvm.* for declarations)."""
    for name, (ret, make) in _GENERIC.items():
        decl = re.search(rf'declare [^\n]*@"{re.escape(name)}"\([^\n]*\n', ir_text)
        if decl is None:
            continue
        params, lines, value = make()
        emu = "emulate_avx512." + name[len("llvm.x86.avx512."):]
        body = "\n".join([f'define internal {ret} @"{emu}"{params} {{', "entry:", *lines,
                          f"  ret {ret} {value}", "}", ""])
        ir_text = ir_text.replace(decl.group(0), body).replace(f'@"{name}"', f'@"{emu}"')
    return ir_text


@functools.lru_cache(maxsize=None)
def _this_cpu():
    """The TargetMachine of the real CPU (the IR's decisions stay the mocked host's)."""
    t = target.host()
    return llvm.Target.from_triple(t.triple).create_target_machine(
        cpu=REAL_CPU, features=REAL_FEATURES, opt=3, reloc="static", codemodel="jitdefault")


_optimized = jit._optimized


def _checked(ir_text, vectorize_loops):
    ir_text = _generic(ir_text)
    found = _INTRINSIC.search(ir_text)
    if found:
        pytest.skip(f"emulate_avx512: the kernel calls {found.group(1)}, which needs "
                    f"AVX-512 hardware")
    return _optimized(ir_text, vectorize_loops)


target.target_machine = _this_cpu
jit.target_machine = _this_cpu
jit._optimized = _checked


def pytest_report_header(config):
    t = target.host()
    return (f"emulate_avx512: kernels built for {t.cpu} ({t.vector_bits}-bit vectors), "
            f"compiled for {REAL_CPU}; kernel cache {_CACHE}")


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
