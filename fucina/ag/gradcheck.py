"""`fu.gradcheck` (SPEC §3.20): central finite differences against the analytical gradient,
on every element of every variable input."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import (GradientMismatch, GradientShapeMismatch, InvalidArgumentType,
                      InvalidGradcheckOptions, MissingAnalyticalGradient, NoVariableInputs)
from .engine import no_grad


@dataclass(frozen=True)
class GradcheckResult:
    checked: int
    max_abs_error: float
    max_rel_error: float


def gradcheck(loss_fn, inputs, eps: float = 1e-3, abs_tol: float = 1e-3, rel_tol: float = 1e-2,
              print_mismatch: bool = True) -> GradcheckResult:
    """Check loss_fn(*inputs)'s gradient w.r.t. every variable input; raise GradientMismatch on
    the first element with |g_num - g_ana| > abs_tol + rel_tol * |g_ana|."""
    for name, v in (("eps", eps), ("abs_tol", abs_tol), ("rel_tol", rel_tol)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (name == "eps" and v == 0):
            raise InvalidGradcheckOptions(f"gradcheck: expected {name} finite and "
                                          f"{'> 0' if name == 'eps' else '>= 0'}, got {v!r}")
    variables = [t for t in inputs if t.requires_grad]
    if not variables:
        raise NoVariableInputs("gradcheck: expected at least one variable among the inputs, got none")
    for t in variables:
        r = t._live("gradcheck")
        if not r.is_contiguous() or r.dtype != "f32":
            raise InvalidGradcheckOptions(f"gradcheck: expected contiguous f32 variable inputs, "
                                          f"got {r.dtype} shape {r.shape} strides {r.strides}")
        t.zero_grad()
    ctx = variables[0].ctx

    def scalar_loss():
        loss = loss_fn(*inputs)
        if not hasattr(loss, "tags") or loss.tags != ():
            raise InvalidArgumentType(f"gradcheck: loss_fn must return a scalar () tensor, got {loss!r}")
        return loss

    def evaluate() -> float:
        with ctx.exec_scope():
            return float(scalar_loss().item())

    with ctx.exec_scope():
        scalar_loss().backward()
    analytic = []
    for k, t in enumerate(variables):
        g = t.grad()
        if g is None:
            raise MissingAnalyticalGradient(f"gradcheck: variable input {k} {t.tags} received no gradient")
        if g.shape != t.shape:
            raise GradientShapeMismatch(f"gradcheck: input {k}: expected gradient shape {t.shape}, "
                                        f"got {g.shape}")
        analytic.append(g.numpy().astype(np.float64).reshape(-1))
        t.zero_grad()
    checked, max_abs, max_rel = 0, 0.0, 0.0
    with no_grad():
        for k, t in enumerate(variables):
            data = t._raw.storage_view().reshape(-1)  # the variable's own storage
            for i in range(data.size):
                orig = data[i]
                plus, minus = np.float32(float(orig) + eps), np.float32(float(orig) - eps)
                data[i] = plus
                f_plus = evaluate()
                data[i] = minus
                f_minus = evaluate()
                data[i] = orig
                num = (f_plus - f_minus) / (float(plus) - float(minus))  # the step actually taken
                ana = analytic[k][i]
                err = abs(num - ana)
                rel = err / abs(ana) if ana != 0 else (0.0 if err == 0 else math.inf)
                max_abs, max_rel = max(max_abs, err), max(max_rel, rel)
                checked += 1
                if not err <= abs_tol + rel_tol * abs(ana):
                    msg = (f"gradcheck: input {k} {t.tags} element {i}: numerical {num:.6g} vs "
                           f"analytical {ana:.6g} (|diff| {err:.3g} > {abs_tol} + {rel_tol}*|ana|)")
                    if print_mismatch:
                        print(msg)
                    raise GradientMismatch(msg)
    return GradcheckResult(checked, max_abs, max_rel)

