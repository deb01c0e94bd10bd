"""Language models from GGUF files: serving (`load`), the tokenizers (byte-level BPE, and
SentencePiece in `spm` for Gemma-style files: `Tokenizer.from_gguf` picks), chat templates,
SFT data (SPEC T-22) and the decoder models with their LoRA trainer.

    lm = fu.llm.load("model.gguf", ctx)                 # model + tokenizer + chat template
    print(lm.chat([{"role": "user", "content": "Hi"}], max_new=64).text)
    tok = fu.llm.Tokenizer.from_gguf(fu.gguf.read(path, ctx))
    template = fu.llm.detect(f.metadata.get("tokenizer.chat_template")) or fu.llm.Template.CHATML
    sample = fu.llm.encode_pair(tok, template, fu.llm.Pair(question, answer))
    model = fu.llm.decoder.Model.from_gguf(ctx, f)     # the decoder model and its LoRA trainer

`fu.llm.decoder` runs qwen3, llama, qwen2 and gemma3 files; `fu.llm.qwen3` is its earlier name.
"""
from . import decoder
from .data import (IGNORE_INDEX, Conversation, EncodeOptions, Loader, LoaderState, Pair, Sample,
                   SftText, chat_messages, chat_prompt_text, encode_chat, encode_pair,
                   encode_prompt)
from .generation import LM, Generation, KVCache, load
from .sampling import Settings as SamplingSettings
from .template import ChatTemplate, Template, detect
from .spm import SpmTokenizer
from .tokenizer import Tokenizer, UnsupportedTokenizer

qwen3 = decoder   # the name the package had while it ran qwen3 files only

__all__ = ["decoder", "qwen3", "Tokenizer", "SpmTokenizer", "UnsupportedTokenizer", "Template",
           "ChatTemplate", "detect", "IGNORE_INDEX", "Pair", "SftText", "Conversation", "EncodeOptions", "encode_chat", "chat_messages",
           "chat_prompt_text", "Sample", "encode_prompt", "encode_pair", "Loader",
           "LoaderState", "load", "LM", "Generation", "KVCache", "SamplingSettings"]
