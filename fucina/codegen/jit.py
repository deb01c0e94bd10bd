"""IR text -> optimized object code -> loaded machine code, and nothing else.

The cache (cache.py) sits between `compile_object` and `load_object`: a warm process only
ever calls `load_object`, which needs no IR and no optimizer.
"""
from __future__ import annotations

from .target import host, target_machine


def compile_object(ir_text: str, *, vectorize_loops: bool = False) -> bytes:
    """Parse, verify, run the new pass-builder pipeline at O3 and emit object code.

    Hand-vectorized kernels pass vectorize_loops=False: at O3 the loop vectorizer would
    re-vectorize their scalar tails for ~30% more compile time and no speed.
    """
    tm, mod = _optimized(ir_text, vectorize_loops)
    return tm.emit_object(mod)


def assembly(ir_text: str, *, vectorize_loops: bool = False) -> str:
    """The optimized machine code as text (tests read it to check for calls and spills)."""
    tm, mod = _optimized(ir_text, vectorize_loops)
    return tm.emit_assembly(mod)


def _optimized(ir_text: str, vectorize_loops: bool):
    import llvmlite.binding as llvm

    tm = target_machine()
    mod = llvm.parse_assembly(ir_text)
    mod.triple = host().triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(3)
    pto.loop_vectorization = vectorize_loops
    pto.slp_vectorization = vectorize_loops
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return tm, mod


class Loader:
    """Owns one MCJIT engine per process; object files are added to it and stay resident."""

    def __init__(self):
        import llvmlite.binding as llvm

        self._llvm = llvm
        backing = llvm.parse_assembly("")
        backing.triple = host().triple
        self._ee = llvm.create_mcjit_compiler(backing, target_machine())

    def load_object(self, obj: bytes, symbols: list[str]) -> dict[str, int]:
        """Load object code and return the address of each named symbol (0 never escapes)."""
        self._ee.add_object_file(self._llvm.ObjectFileRef.from_data(obj))
        self._ee.finalize_object()
        out = {}
        for name in symbols:
            addr = self._ee.get_function_address(name)
            if not addr:
                raise LookupError(f"symbol {name!r} missing from loaded object")
            out[name] = addr
        return out


_loader: Loader | None = None


def loader() -> Loader:
    global _loader
    if _loader is None:
        _loader = Loader()
    return _loader
