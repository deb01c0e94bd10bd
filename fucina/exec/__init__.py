"""The exec layer: RawTensor, the context (pool, team, launch) and one module per op family."""
from .context import Context, validate_shape
from .raw import MAX_RANK, LayoutClass, RawTensor, contiguous_strides, numel

__all__ = ["Context", "LayoutClass", "MAX_RANK", "RawTensor", "contiguous_strides", "numel",
           "validate_shape"]
