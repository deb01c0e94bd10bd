"""What a GGUF file holds: architecture, sizes, tensor types, tokenizer, chat template.

    fucina info MODEL.gguf [--json]

Works on any GGUF fucina can read, also on architectures fu.llm cannot run yet (it says so).
A missing, truncated or foreign file is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

__all__ = ["main", "describe"]


def describe(path: str) -> dict:
    """The facts `fucina info` prints, as a dict."""
    import fucina as fu
    from fucina.llm.decoder import Config
    with fu.ExecContext(threads=1) as ctx:
        f = fu.gguf.read(path, ctx)
        meta = f.metadata
        arch = meta.get("general.architecture")
        types, params = collections.Counter(), 0
        nbytes = collections.Counter()
        for name, info in f.infos.items():
            kind = getattr(info, "type_name", None) or str(getattr(info, "dtype", "?"))
            types[kind] += 1
            n = int(np.prod(info.shape))
            params += n
            nbytes[kind] += int(getattr(info, "nbytes", 0) or 0)
        out = {"file": os.path.abspath(path), "file_bytes": os.path.getsize(path),
               "name": meta.get("general.name"), "architecture": arch,
               "parameters": params,
               "tensors": {k: {"count": types[k], "bytes": nbytes[k]} for k in sorted(types)}}
        try:
            c = Config.from_gguf(f)
            out["runs_in_fucina"] = True
            out.update(layers=c.num_layers, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads,
                       head_dim=c.head_dim, ffn=c.ffn, vocab=c.vocab,
                       context_length=c.context_length, rope_theta=c.rope_theta,
                       rms_eps=c.rms_eps)
            if c.sliding_window:
                sliding = sum(c.is_sliding(l) for l in range(c.num_layers))
                out["sliding"] = {"window": c.sliding_window, "layers": sliding,
                                  "rope_theta": c.rope_theta_local}
        except fu.FucinaError as e:
            out["runs_in_fucina"] = False
            out["why_not"] = f"{type(e).__name__}: {e}"
            if isinstance(arch, str):
                out["context_length"] = meta.get(f"{arch}.context_length")
        tokens = meta.get("tokenizer.ggml.tokens")
        out["tokenizer"] = {
            "model": meta.get("tokenizer.ggml.model"), "pre": meta.get("tokenizer.ggml.pre"),
            "vocab": len(tokens) if isinstance(tokens, list) else None,
            "bos": _token(tokens, meta.get("tokenizer.ggml.bos_token_id")),
            "eos": _token(tokens, meta.get("tokenizer.ggml.eos_token_id"))}
        source = meta.get("tokenizer.chat_template")
        kind = fu.llm.detect(source) if isinstance(source, str) else None
        out["chat_template"] = {"present": isinstance(source, str),
                                "format": kind.value if kind is not None else None,
                                "chars": len(source) if isinstance(source, str) else 0,
                                "head": source.splitlines()[:3] if isinstance(source, str) else []}
    return out


def _token(tokens, i):
    if not isinstance(i, int) or not isinstance(tokens, list) or not 0 <= i < len(tokens):
        return None
    return {"id": i, "text": tokens[i]}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def render(d: dict) -> str:
    lines = [f"file          {d['file']} ({_mb(d['file_bytes'])})",
             f"name          {d['name']}",
             f"architecture  {d['architecture']}"
             + ("" if d["runs_in_fucina"] else f"  (fu.llm cannot run it: {d['why_not']})"),
             f"parameters    {d['parameters']:,}"]
    if d["runs_in_fucina"]:
        lines += [f"layers        {d['layers']}, hidden {d['hidden']}, ffn {d['ffn']}",
                  f"attention     {d['heads']} heads / {d['kv_heads']} KV heads x {d['head_dim']}",
                  f"vocab         {d['vocab']}",
                  f"context       {d['context_length']}, RoPE base {d['rope_theta']:g}, "
                  f"RMS eps {d['rms_eps']:g}"]
        if d.get("sliding"):
            w = d["sliding"]
            lines.append(f"sliding       window {w['window']} in {w['layers']} of {d['layers']} "
                         f"layers, their RoPE base {w['rope_theta']:g}")
    elif d.get("context_length"):
        lines.append(f"context       {d['context_length']}")
    lines.append("tensor types  " + ", ".join(
        f"{k} x{v['count']} ({_mb(v['bytes'])})" for k, v in d["tensors"].items()))
    t = d["tokenizer"]
    special = ", ".join(f"{k} {v['text']!r} ({v['id']})" for k in ("bos", "eos")
                        if (v := t[k]) is not None)
    lines.append(f"tokenizer     {t['model']} (pre {t['pre']}), {t['vocab']} tokens"
                 + (f"; {special}" if special else ""))
    c = d["chat_template"]
    if c["present"]:
        lines.append(f"chat template {c['format'] or 'unrecognised format'}, {c['chars']} chars:")
        lines += [f"              {ln[:100]}" for ln in c["head"]]
    else:
        lines.append("chat template none (chatml is used)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fucina info", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL.gguf")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    a = ap.parse_args(argv)
    import fucina as fu
    try:
        d = describe(a.model)
    except (fu.FucinaError, OSError, ValueError) as e:
        print(f"fucina info: {a.model}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=2) if a.json else render(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
