"""Export a GGUF file: merge trained LoRA adapters into its weights and/or transcode its matrix
weights to another dtype (SPEC T-23).

    fucina export --from-gguf IN.gguf --out OUT.gguf      (python -m tools.export_gguf in a checkout)
        [--dtype verbatim|f32|f16|bf16|q8_0|q4_k|q5_k|q6_k|tq2_0]
        [--adapters DIR_OR_FILE --alpha F]

Merge (--adapters). The adapter file is the safetensors state dict a LoRA run saves (a
directory means a checkpoint directory, SPEC T-19: its adapters.safetensors). Entries are named
layers.<i>.<q|k|v|o|gate|up|down>.lora_a / .lora_b and merge into blk.<i>.attn_q, attn_k,
attn_v, attn_output, ffn_gate, ffn_up, ffn_down (".weight"): W' = W + (alpha/r)·B·A with
fu.lora.Adapter (rank r from A's shape; alpha is not in the file: pass the training value,
finetune's default is 16). An f32 base merges in f32, an f16 one through f32 back to f16
(merge_f16), a bf16 one through f32 back to bf16. A quantized base is refused: merge into an
f32/f16/bf16 model, then transcode. Errors: MissingAlpha, UnknownAdapterName (a name outside
the scheme, or a tensor the model lacks), MissingLoraB, OrphanLoraB, NoAdaptersFound,
InvalidStateDict (A/B not rank-2 F32), QuantizedBaseUnsupported, ShapeMismatch.

Transcode (--dtype, target T), per tensor, the first rule that applies:
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

Both at once. Merge and transcode are separate passes by design: merging needs a dense base
(a merge into a quantized tensor would chain-requantize). Given --adapters and --dtype together,
the export runs the two passes in that order in memory — merge into the stored dense type, then
transcode the merged tensors — and writes exactly the bytes of the two-command flow (merge to
OUT1, then --from-gguf OUT1 --dtype T).

Metadata passes through unchanged (each value with its GGUF type), so a verbatim export is
byte-identical to its input; the output is written atomically (a failed export leaves no file).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import io

import fucina as fu
from fucina.errors import InvalidStateDict
from fucina.io.safetensors import read_header

TARGETS = ("verbatim", "f32", "f16", "bf16", "q8_0", "q4_k", "q5_k", "q6_k", "tq2_0")
DENSE = ("f32", "f16", "bf16")
BLOCK_OF = {"q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256, "tq2_0": 256}
# trainer target -> GGUF tensor (SPEC T-21 target order)
GGUF_TENSOR = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
ADAPTER_NAME = re.compile(r"layers\.(0|[1-9][0-9]*)\.(q|k|v|o|gate|up|down)\.lora_(a|b)")


def plan(name: str, stored: str, shape: tuple, target: str) -> tuple[str, str]:
    """(dtype to write, why) for one tensor under the transcode policy above."""
    if target not in TARGETS:
        raise fu.InvalidExportOption(f"fucina export: expected --dtype in {TARGETS}, got {target!r}")
    if target == "verbatim":
        return stored, "verbatim"
    if len(shape) < 2 or not name.endswith(".weight") or "norm" in name:
        return stored, "kept (not a matrix weight)"
    if stored == target:
        return stored, "kept (already the target type)"
    if stored not in DENSE:
        raise fu.QuantizedSourceUnsupported(
            f"fucina export: tensor {name!r} is stored as {stored}; expected f32, f16 or bf16 to "
            f"transcode to {target} (no chain-requantizing: export such files with --dtype verbatim)")
    block = BLOCK_OF.get(target)
    if block and shape[-1] % block:
        return stored, f"kept (ne0 = {shape[-1]} is not a multiple of {block})"
    return target, f"{stored} -> {target}"


# ---------------------------------------------------------------------------------------------
# adapters

def adapter_file(path) -> str:
    """The safetensors file of --adapters: the file itself, or a checkpoint directory's
    adapters.safetensors."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inner = os.path.join(path, fu.io.ADAPTERS_STATE_FILE)
        if not os.path.isfile(inner):
            raise fu.NoAdaptersFound(f"fucina export: --adapters {path}: expected a checkpoint "
                                     f"directory holding {fu.io.ADAPTERS_STATE_FILE}, found none")
        return inner
    return path


def pair_entries(entries, where: str) -> dict:
    """Check the adapter file's header entries against the naming scheme and the factor
    layout; returns prefix "layers.<i>.<target>" -> (gguf tensor name, A entry, B entry)."""
    factors: dict = {}
    for e in entries:
        m = ADAPTER_NAME.fullmatch(e.name)
        if m is None:
            raise fu.UnknownAdapterName(
                f"{where}: entry {e.name!r}: expected layers.<i>.<q|k|v|o|gate|up|down>.lora_a/b")
        if e.dtype != "F32" or len(e.shape) != 2:
            raise InvalidStateDict(f"{where}: entry {e.name!r}: expected a rank-2 F32 tensor, got "
                                   f"{e.dtype} of shape {list(e.shape)}")
        layer, target, ab = m.groups()
        factors.setdefault(f"layers.{layer}.{target}", {})[ab] = e
    out = {}
    for prefix, f in factors.items():
        if "b" not in f:
            raise fu.MissingLoraB(f"{where}: {prefix}.lora_a has no {prefix}.lora_b")
        if "a" not in f:
            raise fu.OrphanLoraB(f"{where}: {prefix}.lora_b has no {prefix}.lora_a")
        a, b = f["a"], f["b"]
        if a.shape[0] != b.shape[1]:
            raise fu.ShapeMismatch(f"{where}: {prefix}: lora_a {list(a.shape)} is [rank, in] and "
                                   f"lora_b {list(b.shape)} is [out, rank]; expected the same rank, "
                                   f"got {a.shape[0]} and {b.shape[1]}")
        _, layer, target = prefix.split(".")
        out[prefix] = (f"blk.{layer}.{GGUF_TENSOR[target]}.weight", a, b)
    if not out:
        raise fu.NoAdaptersFound(f"{where}: expected LoRA entries (layers.<i>.<target>.lora_a/b), "
                                 f"the file has none")
    return out


def adapter_source(path, config, alpha):
    """(safetensors source of our adapter names, alpha): a PEFT adapter directory is read by
    fu.llm.peft (its names mapped to ours, llama's q/k rows back in GGUF order, alpha from its
    config unless given); otherwise the file or checkpoint directory itself."""
    from fucina.llm import peft
    if peft.is_peft_dir(path):
        from safetensors.numpy import save as st_save
        ad = peft.read(path, config, alpha)
        return io.BytesIO(st_save(ad.tensors)), ad.alpha
    if alpha is None:
        raise fu.MissingAlpha("fucina export: --adapters needs --alpha (the adapter file stores A "
                              "and B but not the training-time alpha; finetune's default is 16)")
    return adapter_file(path), alpha


def load_adapters(ctx, path, alpha: float) -> dict:
    """GGUF tensor name -> (prefix, fu.lora.Adapter holding the file's A and B). `path`: a
    safetensors file path or a binary file object."""
    where = f"fucina export: --adapters {getattr(path, 'name', path)}"
    if isinstance(path, (str, bytes, os.PathLike)):
        path = adapter_file(path)
        with open(path, "rb") as fh:
            pairs = pair_entries(read_header(fh, where), where)
    else:
        path.seek(0)
        pairs = pair_entries(read_header(path, where), where)
        path.seek(0)
    template = fu.lora.Adapter("ne0", "ne1")   # a GGUF [out, in] weight is tagged ("ne1", "ne0")
    out = {}
    for prefix, (tensor, a, b) in pairs.items():
        config = fu.lora.LoraConfig(rank=a.shape[0], alpha=alpha)
        out[tensor] = (prefix, template.init(ctx, a.shape[1], b.shape[0], config, seed=0))
    fu.io.load_state_dict(path, [e for prefix, ad in out.values() for e in ad.named_tensors_mut(prefix)])
    return out


def stored_type(t) -> str:
    return t.type_name if isinstance(t, fu.gguf.RawTensorData) else t.dtype


def check_merge(tensors: dict, name: str, prefix: str, ad, src) -> None:
    """The base an adapter targets exists, is dense and has the adapter's [out, in] shape."""
    if name not in tensors:
        raise fu.UnknownAdapterName(f"fucina export: adapter {prefix!r} targets {name!r}, which "
                                    f"{src} does not have")
    t = tensors[name]
    stored = stored_type(t)
    if stored not in DENSE and not isinstance(t, fu.Tensor):
        raise fu.QuantizedBaseUnsupported(
            f"fucina export: adapter {prefix!r} targets {name!r}, stored as {stored}, a type "
            f"fucina cannot decode; expected f32/f16/bf16 or a ggml block type")
    if tuple(t.shape) != (ad.out_dim, ad.in_dim):
        raise fu.ShapeMismatch(f"fucina export: adapter {prefix!r}: expected {name!r} of shape "
                               f"[{ad.out_dim}, {ad.in_dim}] ([out, in]), got {list(t.shape)}")


def merge(t, prefix: str, ad):
    """The merged tensor (new, in t's dtype: f32, f16 or bf16; f32 for a block-quantized base,
    decoded exactly first) and why."""
    stored = t.dtype
    if stored not in DENSE:
        merged = t.to("f32")          # every block type decodes exactly to f32
        ad.merge_into(merged)
        return merged, (f"merged {prefix} (rank {ad.rank}, scale {ad.scale:g}) into {stored} "
                        f"decoded to f32")
    if stored == "f16":
        merged = ad.merge_f16(t)
    else:
        merged = t.to("f32")   # a writable copy of the (read-only, mapped) base
        ad.merge_into(merged)
        if stored == "bf16":
            merged = merged.to("bf16")
    return merged, f"merged {prefix} (rank {ad.rank}, scale {ad.scale:g}) into {stored}"


def _config(f):
    """The model config of a GGUF (for PEFT q/k row order), or None when it is no model fucina
    runs (then PEFT q/k adapters are refused by fu.llm.peft)."""
    try:
        return fu.llm.decoder.Config.from_gguf(f)
    except fu.FucinaError:
        return None


# ---------------------------------------------------------------------------------------------
# llama.cpp's LoRA adapter GGUF

def lora_gguf(base: str, dst: str, adapters, alpha: float | None = None, log=print) -> dict:
    """Write the adapters as llama.cpp's LoRA adapter file: general.type "adapter",
    general.architecture of the base, adapter.type "lora", adapter.lora.alpha, and per adapted
    weight `<base tensor>.lora_a` (ne [in, rank]) / `.lora_b` (ne [rank, out]) in f32, checked
    against the base's tensors. Returns name -> shape."""
    ctx = fu.ExecContext(threads=1)
    try:
        f = fu.gguf.read(base, ctx)
        arch = f.metadata.get("general.architecture")
        source, alpha = adapter_source(adapters, _config(f), alpha)
        merges = load_adapters(ctx, source, alpha)
        meta = fu.gguf.Metadata(types={})
        for key, value, vtype in (("general.architecture", arch, "str"),
                                  ("general.type", "adapter", "str"),
                                  ("adapter.type", "lora", "str"),
                                  ("adapter.lora.alpha", float(alpha), "f32")):
            meta[key], meta.types[key] = value, vtype
        tensors, shapes = {}, {}
        for name in sorted(merges, key=_layer_order):
            prefix, ad = merges[name]
            check_merge(f.tensors, name, prefix, ad, base)
            for suffix, t in ((".lora_a", ad.a), (".lora_b", ad.b)):
                tensors[name + suffix] = fu.Tensor(t._raw, fu.gguf.tags_for(2))
                shapes[name + suffix] = tuple(t.shape)
        fu.gguf.write(dst, tensors, meta)
        log(f"wrote {dst}: llama.cpp LoRA adapter for {arch}, {len(merges)} weights, "
            f"alpha {alpha:g}, rank {next(iter(merges.values()))[1].rank}")
        return shapes
    finally:
        ctx.close()


def _layer_order(name: str):
    parts = name.split(".")
    return (int(parts[1]), name) if len(parts) > 1 and parts[1].isdigit() else (-1, name)


# ---------------------------------------------------------------------------------------------
# export

def export(src: str, dst: str, target: str = "verbatim", log=print, *, adapters=None,
           alpha: float | None = None) -> dict:
    """Merge `adapters` (if given) and transcode `src` into `dst`; returns name -> (dtype
    written, why)."""
    if target not in TARGETS:
        raise fu.InvalidExportOption(f"fucina export: expected --dtype in {TARGETS}, got {target!r}")
    if adapters is None:
        if alpha is not None:
            raise fu.InvalidExportOption("fucina export: --alpha is the adapters' scale numerator; expected "
                             "it with --adapters, got it alone")
    elif alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                or not math.isfinite(alpha)):
        raise fu.InvalidExportOption(f"fucina export: expected a finite --alpha, got {alpha!r}")
    ctx = fu.ExecContext()
    try:
        f = fu.gguf.read(src, ctx)
        merges = {}
        t0 = time.perf_counter()
        if adapters is not None:
            source, alpha = adapter_source(adapters, _config(f), alpha)
            merges = load_adapters(ctx, source, alpha)
            for name, (prefix, ad) in merges.items():
                check_merge(f.tensors, name, prefix, ad, src)
            log(f"{len(merges)} adapters from {adapters}, alpha {alpha:g}")
        out, report = {}, {}
        for i, (name, t) in enumerate(f.tensors.items()):
            stored = stored_type(t)
            steps = []
            if name in merges:
                t, why = merge(t, *merges[name])
                steps.append(why)
                stored = t.dtype
            elif merges and target != "verbatim" and stored not in DENSE \
                    and isinstance(t, fu.Tensor) and plan(name, "f32", tuple(t.shape),
                                                          target)[0] != "f32":
                # one command from a downloaded (quantized) base: its matrices are decoded
                # exactly and written at the --dtype asked for, as the merged ones are
                steps.append(f"{stored} decoded to f32")
                t, stored = t.to("f32"), "f32"
            dtype, why = plan(name, stored, tuple(t.shape), target)
            if dtype != stored:
                t = (t if stored == "f32" else t.to("f32")).to(dtype)
            if not steps or target != "verbatim":
                steps.append(why)
            out[name] = t
            report[name] = (dtype, "; ".join(steps))
            log(f"[{i + 1}/{len(f.tensors)}] {name} {list(t.shape)}: {report[name][1]}")
        fu.gguf.write(dst, out, f.metadata)
        log(f"wrote {dst}: {len(out)} tensors, {len(f.metadata)} metadata keys in "
            f"{time.perf_counter() - t0:.1f} s")
        return report
    finally:
        ctx.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fucina export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-gguf", required=True, help="input GGUF file (the base model)")
    ap.add_argument("--out", help="output GGUF file (written atomically)")
    ap.add_argument("--lora-gguf", metavar="OUT.gguf",
                    help="write the adapters as llama.cpp's LoRA adapter GGUF (no merge; "
                         "llama.cpp serves base + adapter) instead of a model")
    ap.add_argument("--dtype", default="verbatim", choices=TARGETS,
                    help="transcode target (default verbatim); with --adapters it runs after the merge")
    ap.add_argument("--adapters", metavar="DIR_OR_FILE",
                    help="LoRA adapters to merge: an adapters safetensors file or a checkpoint "
                         "directory holding adapters.safetensors")
    ap.add_argument("--alpha", type=float,
                    help="the adapters' training-time alpha (required with --adapters unless "
                         "they are a PEFT directory, whose config records it)")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.lora_gguf is None):
        ap.error("expected exactly one of --out (a model) or --lora-gguf (an adapter file)")
    if args.lora_gguf is not None and (args.adapters is None or args.dtype != "verbatim"):
        ap.error("--lora-gguf writes the --adapters as they are: expected --adapters, no --dtype")
    dst = args.out if args.out is not None else args.lora_gguf
    if os.path.isdir(dst):
        ap.error(f"{dst} is a directory; expected the path of the GGUF file to write")
    try:
        if args.lora_gguf is not None:
            lora_gguf(args.from_gguf, args.lora_gguf, args.adapters, args.alpha)
        else:
            export(args.from_gguf, args.out, args.dtype, adapters=args.adapters,
                   alpha=args.alpha)
    except (fu.FucinaError, ValueError, OSError) as e:
        print(f"fucina export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
