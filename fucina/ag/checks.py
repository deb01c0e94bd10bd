"""Operand checks shared by the Tensor method families."""
from __future__ import annotations

import numbers

from ..errors import ActiveExecScopeRequired, ContextMismatch, InvalidArgumentType
from .engine import needs_graph


def same_ctx(op: str, x, y) -> None:
    """y must be a Tensor of x's context."""
    if type(y) is not type(x):
        raise InvalidArgumentType(f"{op}: expected a Tensor operand, got {type(y).__name__}")
    if y._live(op).ctx is not x._raw.ctx:
        raise ContextMismatch(f"{op}: operands belong to two different ExecContexts")


def real(op: str, s) -> float:
    """A Python real number (bools are refused) as a float."""
    if isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise InvalidArgumentType(f"{op}: expected a real number, got {type(s).__name__}")
    return float(s)


def require_scope(name: str, *operands) -> None:
    """SPEC §3.0: a composed op under gradients needs an open exec scope (its intermediates
    would otherwise outlive the step)."""
    ctx = operands[0]._raw.ctx
    if needs_graph(*operands) and not ctx.scopes:
        raise ActiveExecScopeRequired(
            f"{name}: a composed op under gradients needs an open exec scope; "
            f"expected `with ctx.exec_scope():` around it")
