"""Files: FZT1 tensors, safetensors state dicts, ParamRegistry, checkpoint directories (SPEC T-15, T-16, T-18, T-19)."""
