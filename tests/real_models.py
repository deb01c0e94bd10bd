"""Where the real GGUF files of `make models` live, for tests that compare against them.

    from tests.real_models import require
    path = require("gemma3")        # skips the test, naming `make models`, when the file is absent
    tok = hf_tokenizer("gemma3")    # transformers' tokenizer of that file, built once a session
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tools.fetch_models import MODELS, ROOT


def models_dir() -> Path:
    env = os.environ.get("FUCINA_MODELS_DIR")
    return Path(env) if env else ROOT / "build" / "models"


def path(name: str) -> Path:
    """The file of model `name` ("qwen2", "gemma3") under $FUCINA_MODELS_DIR or build/models
    (it may not exist)."""
    if name not in MODELS:
        raise KeyError(f"real_models.path: name: expected one of {sorted(MODELS)}, got {name!r}")
    return models_dir() / MODELS[name].filename


def require(name: str) -> Path:
    """path(name), or skip the calling test when that file is absent."""
    p = path(name)
    if not p.is_file():
        pytest.skip(f"{p} is absent: run `make models` (or python -m tools.fetch_models "
                    f"--dest DIR with FUCINA_MODELS_DIR=DIR)")
    return p


@functools.lru_cache(maxsize=None)
def hf_tokenizer(name: str):
    """transformers' tokenizer of the real file `name` (skipping when absent), built once per
    test session: transformers converts the GGUF vocabulary in Python, 14-24 s a file here,
    and five tests of two modules read each one."""
    import transformers

    p = require(name)
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
