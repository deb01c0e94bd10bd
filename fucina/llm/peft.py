"""LoRA adapters in the PEFT format, so Hugging Face `peft` loads what fucina trains (and back).

    fu.llm.peft.save(directory, trainer, base_model="SmolLM2-135M-Instruct")   # write
    adapters = fu.llm.peft.read(directory)          # ours or PEFT's: alpha, rank, tensors

A PEFT adapter directory is `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules,
...) and `adapter_model.safetensors` with one pair per adapted module,
`base_model.model.model.layers.<i>.<self_attn|mlp>.<name>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] — the same A and B as ours (`layers.<i>.<target>.lora_a/_b`), so the
mapping is a renaming, except for one thing: llama.cpp's converter permutes the rows of the
query and key projections of llama-architecture models (Hugging Face's half-split RoPE pairs
become interleaved pairs), and transformers undoes that permutation when it loads the GGUF.
Our q and k adapters live in the GGUF's row order, so their B rows are permuted on the way out
and back on the way in. (qwen2, qwen3 and gemma3 files are not permuted.)
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from .. import io
from ..errors import AdaptersMismatch

__all__ = ["save", "read", "Adapters", "CONFIG_FILE", "WEIGHTS_FILE", "HF_MODULES"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
PERMUTED_ARCHS = ("llama",)
_OURS = re.compile(r"^layers\.(\d+)\.(q|k|v|o|gate|up|down)\.lora_([ab])$")
_THEIRS = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])"
                     r"\.weight$")
_BACK = {v.split(".")[1]: k for k, v in HF_MODULES.items()}


@dataclass
class Adapters:
    """Adapters as read from a directory: alpha, rank, and our name -> float32 array."""

    alpha: float
    rank: int
    tensors: dict
    source: str        # "fucina" or "peft"

    @property
    def targets(self) -> tuple:
        found = {_OURS.match(n).group(2) for n in self.tensors}
        return tuple(t for t in HF_MODULES if t in found)


def _heads(config, target: str) -> int | None:
    """Heads whose rows llama.cpp permuted for this target (None: not permuted)."""
    if config.arch not in PERMUTED_ARCHS:
        return None
    return {"q": config.heads, "k": config.kv_heads}.get(target)


def _permutation(rows: int, heads: int) -> np.ndarray:
    """perm[r] = the Hugging Face row that is GGUF row r: within each head, GGUF row 2j + t
    holds HF row t·(hd/2) + j."""
    hd = rows // heads
    r = np.arange(rows)
    head, within = r // hd, r % hd
    return head * hd + (within % 2) * (hd // 2) + within // 2


def save(directory, trainer, *, base_model: str | None = None) -> None:
    """Write `trainer`'s adapters as a PEFT adapter directory (the two files, atomically)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = trainer.model.config
    tensors = {}
    for prefix, ad in trainer.named_adapters():
        _, layer, target = prefix.split(".")
        a, b = ad.a.numpy(), ad.b.numpy()
        heads = _heads(config, target)
        if heads is not None:
            hf = np.empty_like(b)
            hf[_permutation(b.shape[0], heads)] = b
            b = hf
        stem = f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}"
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a, dtype=np.float32)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b, dtype=np.float32)
    lc = trainer.lora_config
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lc.rank),
           "lora_alpha": float(lc.alpha), "lora_dropout": float(lc.dropout_p),
           "target_modules": [HF_MODULES[t].split(".")[1] for t in trainer.targets.names()],
           "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
           "init_lora_weights": True, "use_rslora": False, "use_dora": False,
           "modules_to_save": None, "layers_to_transform": None,
           "base_model_name_or_path": base_model, "revision": None}
    from safetensors.numpy import save as st_save      # the format's own writer
    blob = st_save(tensors, metadata={"format": "pt"})
    io.write_file_atomic(os.path.join(directory, WEIGHTS_FILE), lambda f: f.write(blob))
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    io.write_file_atomic(os.path.join(directory, CONFIG_FILE),
                         lambda f: f.write(text.encode("utf-8")))


def is_peft_dir(path) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE)) \
        and os.path.isfile(os.path.join(path, WEIGHTS_FILE))


def read(path, config=None, alpha: float | None = None) -> Adapters:
    """The adapters of a directory: a PEFT adapter directory (alpha and r from its config) or
    a fucina save directory (adapters.safetensors; alpha from trainer_state.json). `config`,
    the model's Config, undoes llama.cpp's q/k row permutation for PEFT adapters of llama-arch
    models (and is required for them). `alpha` overrides the recorded value."""
    path = os.fspath(path)
    from safetensors.numpy import load_file
    if is_peft_dir(path):
        try:
            with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
                cfg = json.load(f)
            raw = load_file(os.path.join(path, WEIGHTS_FILE))
        except (OSError, ValueError) as e:
            raise AdaptersMismatch(f"peft.read: {path}: unreadable adapter directory "
                                   f"({type(e).__name__}: {e})") from None
        if cfg.get("peft_type") != "LORA":
            raise AdaptersMismatch(f"peft.read: {path}: peft_type {cfg.get('peft_type')!r}; "
                                   f"expected 'LORA'")
        if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("fan_in_fan_out"):
            raise AdaptersMismatch(f"peft.read: {path}: DoRA, rsLoRA and fan_in_fan_out "
                                   f"adapters are not supported; expected plain LoRA")
        tensors = {}
        for name, arr in raw.items():
            m = _THEIRS.match(name)
            if m is None:
                raise AdaptersMismatch(f"peft.read: {path}: tensor {name!r} is not a LoRA "
                                       f"weight of a decoder projection")
            layer, module, ab = m.group(1), m.group(3), m.group(4).lower()
            target = _BACK[module]
            arr = np.asarray(arr, dtype=np.float32)
            if ab == "b":
                if config is None and target in ("q", "k"):
                    raise AdaptersMismatch(f"peft.read: {path}: q/k adapters need the model's "
                                           f"config to map their rows; pass config=")
                heads = None if config is None else _heads(config, target)
                if heads is not None:
                    arr = arr[_permutation(arr.shape[0], heads)]
            tensors[f"layers.{layer}.{target}.lora_{ab}"] = np.ascontiguousarray(arr)
        a = cfg.get("lora_alpha") if alpha is None else alpha
        rank = cfg.get("r")
        source = "peft"
    else:
        file = os.path.join(path, io.ADAPTERS_STATE_FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise AdaptersMismatch(f"peft.read: {path}: expected a finetune save directory "
                                   f"({io.ADAPTERS_STATE_FILE}) or a PEFT adapter directory "
                                   f"({CONFIG_FILE} + {WEIGHTS_FILE}), found neither")
        try:
            tensors = {k: np.asarray(v, np.float32) for k, v in load_file(file).items()}
        except (OSError, ValueError, Exception) as e:
            raise AdaptersMismatch(f"peft.read: {file}: not a readable safetensors file "
                                   f"({type(e).__name__}: {e})") from None
        state = io.load_trainer_state(os.path.dirname(file) if file != path else path)
        a = alpha if alpha is not None else (None if state is None else state.lora_alpha)
        rank = None
        source = "fucina"
    for name in tensors:
        if _OURS.match(name) is None:
            raise AdaptersMismatch(f"peft.read: {path}: tensor {name!r} is not a LoRA adapter "
                                   f"of ours (layers.<i>.<target>.lora_a/_b)")
    ranks = {t.shape[0] for n, t in tensors.items() if n.endswith("lora_a")}
    if len(ranks) != 1 or (rank is not None and ranks != {rank}):
        raise AdaptersMismatch(f"peft.read: {path}: expected one LoRA rank"
                               f"{'' if rank is None else f' (r = {rank})'}, got {sorted(ranks)}")
    if a is None:
        raise AdaptersMismatch(f"peft.read: {path}: no lora_alpha recorded; pass alpha=")
    return Adapters(float(a), ranks.pop(), tensors, source)
