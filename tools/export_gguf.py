"""Transcode a GGUF file's matrix weights to another dtype (SPEC T-23, the transcode half).

    python -m tools.export_gguf --from-gguf IN.gguf --out OUT.gguf [--dtype verbatim|f32|f16|bf16|q8_0|q4_k|q5_k|q6_k|tq2_0]

Per tensor, with target T (the first rule that applies):
  1. T is verbatim                                   -> keep the stored bytes
  2. fewer than 2 dims, a name not ending in ".weight",
     or a name containing "norm"                      -> keep (token_embd / output ARE transcoded)
  3. the stored type is already T                     -> keep
  4. the stored type is not f32 / f16 / bf16           -> QuantizedSourceUnsupported (never
                                                         chain-requantize; re-emit such files verbatim)
  5. T is q8_0 and ne0 % 32 != 0, or T is a 256-block
     format and ne0 % 256 != 0                        -> keep the source type (llama-quantize
                                                         would fall back to a smaller quant instead)
  6. otherwise: widen the rows to f32, encode with the ggml-exact encoder of T.
Metadata passes through unchanged (each value with its GGUF type), so a verbatim export is
byte-identical to its input. Merging LoRA adapters into the base weights (the other half of
T-23) belongs to the LLM issue.
"""
from __future__ import annotations

import argparse
import sys
import time

import fucina as fu

TARGETS = ("verbatim", "f32", "f16", "bf16", "q8_0", "q4_k", "q5_k", "q6_k", "tq2_0")
DENSE = ("f32", "f16", "bf16")
BLOCK_OF = {"q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256, "tq2_0": 256}


def plan(name: str, stored: str, shape: tuple, target: str) -> tuple[str, str]:
    """(dtype to write, why) for one tensor under the transcode policy above."""
    if target not in TARGETS:
        raise ValueError(f"export_gguf: expected --dtype in {TARGETS}, got {target!r}")
    if target == "verbatim":
        return stored, "verbatim"
    if len(shape) < 2 or not name.endswith(".weight") or "norm" in name:
        return stored, "kept (not a matrix weight)"
    if stored == target:
        return stored, "kept (already the target type)"
    if stored not in DENSE:
        raise fu.QuantizedSourceUnsupported(
            f"export_gguf: tensor {name!r} is stored as {stored}; expected f32, f16 or bf16 to "
            f"transcode to {target} (no chain-requantizing: export such files with --dtype verbatim)")
    block = BLOCK_OF.get(target)
    if block and shape[-1] % block:
        return stored, f"kept (ne0 = {shape[-1]} is not a multiple of {block})"
    return target, f"{stored} -> {target}"


def export(src: str, dst: str, target: str, log=print) -> dict:
    """Transcode `src` into `dst`; returns name -> (dtype written, why)."""
    ctx = fu.ExecContext()
    try:
        f = fu.gguf.read(src, ctx)
        out, report = {}, {}
        t0 = time.perf_counter()
        for i, (name, t) in enumerate(f.tensors.items()):
            stored = t.type_name if isinstance(t, fu.gguf.RawTensorData) else t.dtype
            dtype, why = plan(name, stored, tuple(t.shape), target)
            if dtype == stored:
                out[name] = t
            else:
                wide = t if stored == "f32" else t.to("f32")
                out[name] = wide.to(dtype)
            report[name] = (dtype, why)
            log(f"[{i + 1}/{len(f.tensors)}] {name} {list(t.shape)}: {why}")
        fu.gguf.write(dst, out, f.metadata)
        log(f"wrote {dst}: {len(out)} tensors, {len(f.metadata)} metadata keys in "
            f"{time.perf_counter() - t0:.1f} s")
        return report
    finally:
        ctx.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-gguf", required=True, help="input GGUF file")
    ap.add_argument("--out", required=True, help="output GGUF file (written atomically)")
    ap.add_argument("--dtype", default="verbatim", choices=TARGETS)
    args = ap.parse_args(argv)
    try:
        export(args.from_gguf, args.out, args.dtype)
    except fu.FucinaError as e:
        print(f"export_gguf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
