"""Qwen3 (SPEC T-21): the decoder over frozen GGUF weights and its LoRA trainer.

    f = fu.gguf.read(path, ctx)
    model = fu.llm.qwen3.Model.from_gguf(ctx, f)
    trainer = fu.llm.qwen3.Trainer(model, fu.llm.qwen3.Targets(), fu.lora.LoraConfig(8, 16), 42)
"""
from .config import ARCHITECTURES, Config, UnsupportedModel
from .model import LINEARS, Layer, Model
from .train import DROPOUT_SALT, IGNORE_INDEX, TARGETS, Targets, Trainer

__all__ = ["Config", "UnsupportedModel", "ARCHITECTURES", "Model", "Layer", "LINEARS", "Trainer",
           "Targets", "TARGETS", "IGNORE_INDEX", "DROPOUT_SALT"]
