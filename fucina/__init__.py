"""Fucina: named-axis tensors, autograd and training on the CPU, every kernel generated as
LLVM IR on first use, compiled for this CPU and cached on disk.

    import fucina as fu
    with fu.ExecContext() as ctx:
        x = ctx.tensor([[1, 2], [3, 4]], tags=("row", "col"))
        b = ctx.tensor([10, 20], tags=("col",))
        print((x + b).numpy())
"""
from . import elemental, rng
from .ag import attention as _attention, checkpoint as _checkpoint, conv as _conv
from .ag import gather_scatter as _gather_scatter, selection as _selection
from .ag.attention import *  # noqa: F401,F403  (each family module lists its public functions)
from .ag.checkpoint import *  # noqa: F401,F403
from .ag.conv import *  # noqa: F401,F403
from .ag.gather_scatter import *  # noqa: F401,F403
from .ag.selection import *  # noqa: F401,F403
from .ag.context import ExecContext
from .ag.engine import is_grad_enabled, no_grad
from .ag.gradcheck import GradcheckResult, gradcheck
from .ag.masks import band_mask
from .ag.rope import RopeTable, RopeTheta, yarn_blend_inv_freqs_f64
from .ag.tensor import Tensor, custom_vjp, einsum_many
from .errors import *  # noqa: F401,F403  (the SPEC §0.3 catalogue)
from .errors import __all__ as _errors
from .exec.context import ExecScope
from .exec.raw import MAX_RANK, LayoutClass

__version__ = "0.1.0"
__all__ = ["elemental", "rng", "ExecContext", "ExecScope", "Tensor", "einsum_many", "custom_vjp",
           "band_mask", "RopeTable", "RopeTheta", "yarn_blend_inv_freqs_f64", "LayoutClass", "MAX_RANK", "no_grad", "is_grad_enabled", "gradcheck",
           "GradcheckResult", *_errors]
for _family in (_attention, _checkpoint, _conv, _gather_scatter, _selection):
    __all__ += _family.__all__
_LAZY = ("es", "gguf", "io", "lora", "optim", "llm")  # layers 5 and 6: imported on first use
__all__ += list(_LAZY)


def __getattr__(name):
    """`fu.optim`, `fu.io`, `fu.es`, `fu.gguf`, `fu.lora`, `fu.llm` load when first touched, so
    `import fucina` stays fast for code that never trains."""
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fucina' has no attribute {name!r}")
