"""Every error the library raises: one base class, the reference's error names as subclasses.

Messages name the op, the operand and what was expected versus given, in one line.
"""
from __future__ import annotations


class FucinaError(Exception):
    """Base of every Fucina error."""


def _family(base, names, doc):
    out = {}
    for name in names:
        out[name] = type(name, (base,), {"__doc__": doc, "__module__": __name__})
    return out


class InvalidArgument(FucinaError, ValueError):
    """An option outside its domain: an unknown op, kind or reduction name, a ddof, a thread
    count. Still a ValueError, as Python's own checks are."""


class InvalidArgumentType(FucinaError, TypeError):
    """An argument of the wrong Python type (a string where a number goes, an array where a
    Tensor goes). Still a TypeError, as Python's own checks are."""


class ContextMismatch(FucinaError):
    """Operands belong to two different ExecContexts."""


class ContextClosed(FucinaError, RuntimeError):
    """The ExecContext (or a tensor's context) was closed."""


class TensorError(FucinaError):
    """Shape family: extents, lengths and indices."""


class TagError(FucinaError, TypeError):
    """A named-axis problem, raised before any computation (a compile error in the reference)."""


class DTypeError(FucinaError, TypeError):
    """An op called on a dtype it does not support."""


class KernelCacheError(FucinaError):
    """FUCINA_ASSERT_WARM=1 and a kernel would have to be compiled."""


class GradientError(FucinaError):
    """Gradient family."""


class ScopeError(FucinaError):
    """Exec-scope family."""


class OptimError(FucinaError):
    """Optimizer family."""


class EsError(FucinaError):
    """Evolution-strategies family."""


class UseAfterRelease(FucinaError, RuntimeError):
    """A tensor was used after release() or after its exec scope closed."""


class ReadOnlyStorage(TensorError):
    """An op was asked to write into read-only storage (a memory-mapped GGUF tensor, a
    read-only numpy array). Not in the SPEC catalogue: the reference has no such storage."""


globals().update(_family(TensorError, [
    "ShapeMismatch", "InvalidShape", "InvalidDataLength", "IndexOutOfBounds", "DivisionByZero",
    "EmptySelection"], "Shape-family error."))
globals().update(_family(GradientError, [
    "UnsupportedGradient", "GradientCastUnsupported", "GradientPackedMatmulUnsupported",
    "GradientQuantizedMatmulUnsupported", "GradientPreparedConv2dUnsupported",
    "MutableDataRequiresNoGrad", "NoGradientGraph", "MissingOutputGradient",
    "MissingBackwardGradient", "BackwardAlreadyRun", "LinearCrossEntropyBackwardConsumed",
    "LinearDistillBackwardConsumed", "GraphNodeReleased"], "Gradient-family error."))
class GradcheckError(FucinaError):
    """gradcheck family."""


globals().update(_family(GradcheckError, [
    "InvalidGradcheckOptions", "NoVariableInputs", "MissingAnalyticalGradient",
    "GradientShapeMismatch", "GradientMismatch"], "gradcheck error."))
globals().update(_family(ScopeError, [
    "ActiveExecScopeRequired", "ActiveExecScopeUnsupported"], "Exec-scope error."))



class CheckpointError(FucinaError):
    """Activation checkpointing (SPEC T-14)."""


class TrainerStateError(FucinaError):
    """trainer_state.json (SPEC T-19)."""


class LoraError(FucinaError):
    """LoRA adapters (SPEC T-20)."""


class LlmError(FucinaError):
    """The Qwen3 trainer, SFT data and the export loop (SPEC T-21…T-23)."""


globals().update(_family(CheckpointError, [
    "NestedCheckpointRecompute", "CheckpointOutputNotDifferentiable",
    "CheckpointMissingInputGradient"], "Activation-checkpointing error."))
globals().update(_family(OptimError, [
    "NotAVariable", "GradShapeMismatch", "CheckpointMagicMismatch", "CheckpointShapeMismatch",
    "CheckpointConfigMismatch", "CheckpointInvalidName", "CheckpointDuplicateName",
    "CheckpointUnknownName", "CheckpointMissingEntry", "CheckpointDtypeMismatch",
    "CheckpointUnsupportedDtype", "CheckpointTooManyEntries"], "Optimizer / checkpoint-file error."))


class NonContiguousParam(OptimError, EsError):
    """A parameter (optimizer or ES slot) must be contiguous."""


class DuplicateParam(OptimError, EsError):
    """The same parameter was registered twice."""


class ParamNotRegistered(OptimError, KeyError):
    """An optimizer was asked about a tensor it does not hold (state_of). Still a KeyError,
    as a mapping's own lookup is."""


globals().update(_family(TrainerStateError, [
    "InvalidTrainerState", "UnsupportedTrainerStateVersion"], "trainer_state.json error."))
globals().update(_family(LoraError, ["InvalidRank", "InvalidDropout"], "LoRA error."))
globals().update(_family(EsError, [
    "InvalidConfig", "AnchorMissing", "UnsupportedDType", "NoParams", "RewardCountMismatch",
    "MemberActive", "MemberNotActive", "ReplicaShapeMismatch", "QuantizedWeightsUnsupported"],
    "Evolution-strategies error."))
globals().update(_family(LlmError, [
    "MoeUnsupported", "ExecScopeRequired", "InvalidSequenceLength", "LabelLengthMismatch",
    "MalformedJsonl", "SampleTooLong", "EmptyDataset", "InvalidLoaderState",
    "QuantizedSourceUnsupported", "QuantizedBaseUnsupported", "MissingAlpha",
    "UnknownAdapterName", "MissingLoraB", "OrphanLoraB", "NoAdaptersFound", "InvalidStateDict",
    "NoSupervisedTokens", "DatasetTooSmall"],
    "LLM-layer error."))


class UnsupportedModel(LlmError, ValueError):
    """The GGUF file is not a model fucina.llm runs (another architecture, or inconsistent
    hyperparameters). Not in the SPEC catalogue: the reference reports these as load errors."""


class DistError(FucinaError):
    """Running past one process (fucina.dist on Ray)."""


globals().update(_family(DistError, [
    "RayUnavailable", "ReplicaOutOfSync", "WorkersLost"], "Distributed-run error."))


class ChatTemplateError(LlmError, ValueError):
    """A chat template failed: its Jinja source does not compile, it raised (`raise_exception`),
    or the messages given to it are malformed."""


globals().update(_family(LlmError, [
    "InvalidSamplingSettings", "ContextOverflow", "AdaptersMismatch"], "Generation error."))


class UnsupportedTokenizer(LlmError, ValueError):
    """The GGUF tokenizer is not one fucina.llm implements, or its metadata is inconsistent.
    Not in the SPEC catalogue: the reference reports these as untyped load errors."""


class ChecksumMismatch(FucinaError):
    """Stored bytes differ from the checksum saved with them (a flipped or truncated file, a
    checkpoint directory whose manifest disagrees with a payload); the message names the file."""


class InvalidOptimizerConfig(OptimError, ValueError):
    """An optimizer or lr-schedule setting outside its domain (negative or non-finite lr,
    eps <= 0, betas outside [0, 1), ...), refused at construction as torch refuses it."""



class InvalidExportOption(LlmError, ValueError):
    """A `fucina export` option outside its domain (an unknown --dtype, --alpha without
    --adapters, a non-finite --alpha); the message names the option, expected vs given."""

__all__ = [n for n, v in globals().items() if isinstance(v, type) and issubclass(v, FucinaError)]
