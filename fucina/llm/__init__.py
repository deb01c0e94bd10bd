"""The LLM text layer: the GGUF byte-level BPE tokenizer, chat templates and SFT data (SPEC T-22).

    tok = fu.llm.Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    template = fu.llm.detect(f.metadata.get("tokenizer.chat_template")) or fu.llm.Template.CHATML
    sample = fu.llm.encode_pair(tok, template, fu.llm.Pair(question, answer))
    model = fu.llm.qwen3.Model.from_gguf(ctx, f)       # the Qwen3 model and its LoRA trainer
"""
from . import qwen3
from .data import (IGNORE_INDEX, EncodeOptions, Loader, LoaderState, Pair, Sample, SftText,
                   encode_pair, encode_prompt)
from .template import Template, detect
from .tokenizer import Tokenizer, UnsupportedTokenizer

__all__ = ["qwen3", "Tokenizer", "UnsupportedTokenizer", "Template", "detect", "IGNORE_INDEX", "Pair",
           "SftText", "EncodeOptions", "Sample", "encode_prompt", "encode_pair", "Loader",
           "LoaderState"]
