"""The activation kernels' op table (SPEC §3.3–§3.6): `name: (arity, emit)` for the
elementwise generator, lowered from the templates in fucina/kernel_templates/activations.py
(where every formula, its accuracy and its operand order are written) by codegen/lowering.py.
The gated entries also serve codegen/selection.py's fused MoE kernels."""
from __future__ import annotations

from ..kernel_templates import activations as _t
from .lowering import lower_table

OPS = lower_table(_t.TEMPLATES, _t.CONSTANTS, _t.KERNELS)
