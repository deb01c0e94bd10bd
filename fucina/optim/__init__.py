"""Optimizers, schedules and clipping (SPEC §5 T-1…T-13, T-17, T-24).

    opt = fu.optim.AdamW(lr=1e-3, weight_decay=0.01)
    opt.add_param(w); opt.add_param(b, name="b")
    loss.backward(); opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()

Every update is one generated kernel per param (read param, gradient, state; write state and
param); norms use the deterministic f64 sum of squares (T-7), so training is bitwise the same for
any thread count and resumes bit-exactly from save_state / load_state frames (T-17).
"""
from ..errors import (CheckpointConfigMismatch, CheckpointDtypeMismatch, CheckpointDuplicateName,
                      CheckpointInvalidName, CheckpointMagicMismatch, CheckpointMissingEntry,
                      CheckpointShapeMismatch, CheckpointTooManyEntries, CheckpointUnknownName,
                      CheckpointUnsupportedDtype, DuplicateParam, GradShapeMismatch,
                      NonContiguousParam, NotAVariable, OptimError)
from ..io import load_state_dict, load_tensors, save_state_dict, save_tensors  # SPEC's names
from .adam import Adam, AdamConfig, AdamW, AdamWConfig
from .apollo import Apollo, ApolloConfig
from .base import Optimizer, Slot, StateBuf
from .clip import sum_squares
from .frames import StateDType
from .muon import Muon, MuonConfig, newton_schulz5
from .schedule import LrSchedule, warmup_cosine_factor
from .set import OptimizerSet
from .sgd import SGD, SgdConfig

__all__ = ["SGD", "SgdConfig", "Adam", "AdamConfig", "AdamW", "AdamWConfig", "Muon", "MuonConfig",
           "newton_schulz5", "Apollo", "ApolloConfig", "OptimizerSet", "save_tensors",
           "load_tensors", "save_state_dict", "load_state_dict",
           "LrSchedule", "warmup_cosine_factor", "StateDType", "sum_squares", "Optimizer", "Slot",
           "StateBuf",
           # the OptimError family of SPEC §0.3 (also importable from fucina)
           "OptimError", "NotAVariable", "NonContiguousParam", "DuplicateParam",
           "GradShapeMismatch", "CheckpointMagicMismatch", "CheckpointShapeMismatch",
           "CheckpointConfigMismatch", "CheckpointInvalidName", "CheckpointDuplicateName",
           "CheckpointUnknownName", "CheckpointMissingEntry", "CheckpointDtypeMismatch",
           "CheckpointUnsupportedDtype", "CheckpointTooManyEntries"]
