"""GGUF files (read and write) and block-quantized tensors (SPEC R-9, issue 9)."""
