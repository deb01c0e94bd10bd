"""The host target: CPU name, features and the vector width every generated kernel is built for.

llvmlite emits SSE2-only code unless told the host CPU and its features, so everything that
compiles or keys the cache goes through `host()`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    triple: str
    cpu: str
    features: str
    vector_bits: int  # widest float vector register: 512 on AVX-512, 256 on AVX2, 128 otherwise

    @property
    def f32_lanes(self) -> int:
        return self.vector_bits // 32

    @property
    def vector_regs(self) -> int:
        """Vector registers a kernel can keep live: 32 zmm with AVX-512, else 16 (ymm / xmm).
        Register-blocked tiles size their accumulators to it (more spill to the stack)."""
        return 32 if self.vector_bits >= 512 else 16

    def has(self, *names) -> bool:
        """Every named CPU feature is enabled: whole entries of the feature list ("+fma" is
        not "+fma4")."""
        enabled = set(self.features.split(","))
        return all(f"+{n}" in enabled for n in names)

    @property
    def amd(self) -> bool:
        """An AMD core (LLVM names them znver*, bdver*, btver*): the kernels' tile and path
        choices were measured there; Intel cores (two 512-bit FMA pipes) differ in places."""
        return self.cpu.startswith(("znver", "bdver", "btver"))

    @property
    def mask_registers(self) -> bool:
        """AVX-512's k registers: a masked store is as cheap as a plain one. Without them
        (AVX2) a masked store is vmaskmovps, about 12 cycles a ymm store on Zen 3."""
        return self.vector_bits >= 512


@functools.lru_cache(maxsize=None)
def host() -> Target:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features().flatten()
    enabled = {f[1:] for f in features.split(",") if f.startswith("+")}
    bits = 512 if "avx512f" in enabled else 256 if "avx2" in enabled else 128
    return Target(llvm.get_process_triple(), llvm.get_host_cpu_name(), features, bits)


@functools.lru_cache(maxsize=None)
def target_machine():
    """One TargetMachine for the process: creating it costs ~1 ms, compiling reuses it.

    Static relocation: with "pic" under MCJIT's large code model, loading an object that calls
    an outside symbol (a memset LLVM inserts, say) made later objects read constants from the
    wrong address."""
    import llvmlite.binding as llvm

    t = host()
    return llvm.Target.from_triple(t.triple).create_target_machine(
        cpu=t.cpu, features=t.features, opt=3, reloc="static", codemodel="jitdefault")
