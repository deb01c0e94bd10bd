"""Files: FZT1 tensors, safetensors state dicts, ParamRegistry, checkpoint directories (SPEC T-15, T-16, T-18, T-19)."""
from .checkpoint import (ADAPTERS_STATE_FILE, MANIFEST_FILE, MODEL_STATE_FILE, OPTIMIZER_STATE_FILE,
                         TRAINER_STATE_FILE, TrainerState, begin_save, format_trainer_state,
                         load_trainer_state, parse_trainer_state, remove_stale_temps,
                         save_trainer_state, step_dir, verify_checkpoint, write_file_atomic,
                         write_manifest)
from .registry import ParamRegistry, ParamView
from .state_dict import Alias, NamedTensor, NamedTensorMut, load_state_dict, save_state_dict
from .tensors import load_tensors, save_tensors

__all__ = ["save_tensors", "load_tensors", "save_state_dict", "load_state_dict", "NamedTensor",
           "NamedTensorMut", "Alias", "ParamRegistry", "ParamView",
           "MODEL_STATE_FILE", "ADAPTERS_STATE_FILE", "OPTIMIZER_STATE_FILE", "TRAINER_STATE_FILE",
           "TrainerState", "begin_save", "write_file_atomic", "save_trainer_state",
           "load_trainer_state", "parse_trainer_state", "format_trainer_state", "step_dir",
           "MANIFEST_FILE", "write_manifest", "verify_checkpoint", "remove_stale_temps"]
