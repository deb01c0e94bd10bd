"""Activations with their backward rules (SPEC §3.3): the UnaryOp family and its aliases."""
from __future__ import annotations

from ..exec import elementwise as ew
from .engine import finish_op

UNARY = ("exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt")

# unary op -> (backward kernel, reads the forward "x" or output "y"); None = a plain kernel below
_UNARY_GRAD = {
    "relu": ("relu_grad", "x"), "tanh": ("tanh_grad", "y"), "sigmoid": ("sigmoid_grad", "y"),
    "sqrt": ("sqrt_grad", "y"), "exp": ("mul", "y"), "log": ("div", "x"), "neg": None,
}


def unary(op: str, x):
    r = x._raw
    ctx = r.ctx
    dtype = ew.compute_dtype_of(op, (r.dtype,))
    out = ew.run(ctx, op, dtype, r.shape, (r,))

    def vjp(needs):
        def run(g):
            rule = _UNARY_GRAD[op]
            if rule is None:
                return (ew.run(ctx, "neg", "f32", r.shape, (g,)),)
            kernel, reads = rule
            return (ew.run(ctx, kernel, "f32", r.shape, (g, r if reads == "x" else out)),)
        return run

    return finish_op(op, out, x.tags, (x,), vjp)


class ActivationMethods:
    """Tensor methods of the activation family."""

    __slots__ = ()

    def unary(self, op: str):
        if op not in UNARY:
            raise ValueError(f"unary: expected one of {UNARY}, got {op!r}")
        self._live(op)
        return self._result(*unary(op, self))

    def exp(self):
        return self.unary("exp")

    def log(self):
        return self.unary("log")

    def tanh(self):
        return self.unary("tanh")

    def sigmoid(self):
        return self.unary("sigmoid")

    def relu(self):
        return self.unary("relu")

    def neg(self):
        return self.unary("neg")

    def sqrt(self):
        return self.unary("sqrt")
