"""The one record of the template layer (plain data: no codegen imports)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """A lane formula: `inputs` (names, space separated: tensors first, then by-value
    parameters) and `body` (the expression language of codegen/lowering.py)."""

    inputs: str
    body: str

    @property
    def names(self) -> tuple:
        return tuple(self.inputs.split())

    @property
    def arity(self) -> int:
        return len(self.names)
