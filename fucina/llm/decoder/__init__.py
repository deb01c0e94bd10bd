"""The decoder family (SPEC T-21: qwen3, llama, qwen2, gemma3) over frozen GGUF weights and its
LoRA trainer.

    f = fu.gguf.read(path, ctx)
    model = fu.llm.decoder.Model.from_gguf(ctx, f)
    trainer = fu.llm.decoder.Trainer(model, fu.llm.decoder.Targets(), fu.lora.LoraConfig(8, 16), 42)
"""
from .config import ARCHITECTURES, Config, UnsupportedModel
from .model import LINEARS, Layer, Model, Ropes
from .train import DROPOUT_SALT, IGNORE_INDEX, TARGETS, Targets, Trainer, head_rows

__all__ = ["Config", "UnsupportedModel", "ARCHITECTURES", "Model", "Layer", "LINEARS", "Ropes",
           "Trainer", "Targets", "TARGETS", "IGNORE_INDEX", "DROPOUT_SALT", "head_rows"]
