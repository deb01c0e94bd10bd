"""The one record of the template layer (plain data: no codegen imports)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """A lane formula: `inputs` (names, space separated: tensors first, then by-value
    parameters), `body` (the expression language of codegen/lowering.py) and, for several
    results, the names of the locals returned (`outputs`)."""

    inputs: str
    body: str
    outputs: tuple = ()

    @property
    def names(self) -> tuple:
        return tuple(self.inputs.split())

    @property
    def arity(self) -> int:
        return len(self.names)
