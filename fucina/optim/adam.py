"""Adam and AdamW (SPEC T-5): torch's `_single_tensor_adam` step as one fused kernel per slot.
Adam couples L2 decay into the gradient; AdamW decays the param first (p·(1 − lr·wd)). Frame
magics FZAD / FZD4 / FZD5 (Adam), FZA3 / FZA4 / FZA5 (AdamW).

Scalar prep runs in f64 on the config's Python floats and rounds once to f32 (as torch does with
its Python-float hyperparameters): bc1 = 1 − β1^t, sqrt(bc2) = sqrt(1 − β2^t),
step_size = lr / bc1, 1 − β1, 1 − β2, keep = 1 − lr·wd; t is the slot's step after increment.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass

from ..codegen.optim import AdamKey
from ..exec.elementwise import f32_bits
from .base import Optimizer, StateBuf
from . import validate
from .frames import Magics, StateDType


@dataclass
class AdamConfig:
    """state_dtype: storage of m; second_moment_dtype: storage of v (opt-in bf16: β2 = 0.999's
    ~0.1 %/step change is below bf16's ~0.39 % resolution, so v can stall); betas=(b1, b2) is
    accepted for beta1/beta2. Mutable (values are checked at construction and every step)."""

    lr: float = 1e-3
    beta1: float = validate.BETA1
    beta2: float = validate.BETA2
    eps: float = 1e-8
    weight_decay: float = 0.0
    state_dtype: StateDType = StateDType.f32
    second_moment_dtype: StateDType = StateDType.f32
    betas: InitVar[tuple | None] = None  # torch's spelling of (beta1, beta2)

    def __post_init__(self, betas):
        validate.resolve_betas(self, type(self).__name__, betas)
        self.state_dtype = StateDType.of(self.state_dtype)
        self.second_moment_dtype = StateDType.of(self.second_moment_dtype)


@dataclass
class AdamWConfig(AdamConfig):
    """AdamConfig with decoupled decay on by default."""

    weight_decay: float = 0.01


class Adam(Optimizer):
    """`fu.optim.Adam(lr=..., beta1=..., beta2=..., eps=..., weight_decay=..., state_dtype=...,
    second_moment_dtype=...)`: coupled L2 decay (g + wd·p)."""

    Config = AdamConfig
    MAGICS = Magics(b"FZAD", b"FZD4", b"FZD5")
    RECORD = (("step", "u64"), ("m", "buf"), ("v", "buf"))
    DECOUPLED = False

    def _check_config(self):
        validate.adam_like(type(self).__name__, self.config)

    def _init_state(self, slot):
        c = self.config
        return {"step": 0, "m": StateBuf(slot.ctx, c.state_dtype, slot.numel),
                "v": StateBuf(slot.ctx, c.second_moment_dtype, slot.numel)}

    def _prepare(self):
        """The config-wide f32 scalars: keep, wd, 1−β1, β2, 1−β2, eps."""
        c = self.config
        keep = 1.0 - c.lr * c.weight_decay if c.weight_decay != 0 else 1.0
        return (f32_bits(keep), f32_bits(c.weight_decay), f32_bits(1.0 - c.beta1),
                f32_bits(c.beta2), f32_bits(1.0 - c.beta2), f32_bits(c.eps))

    def _update(self, slot, grad, prep):
        c = self.config
        t = slot.state["step"] = slot.state["step"] + 1
        m, v = slot.state["m"], slot.state["v"]
        decay = c.weight_decay != 0
        key = slot.cache.get(decay)
        if key is None:
            key = slot.cache[decay] = AdamKey(self.DECOUPLED, slot.dtype, m.dtype.name,
                                              v.dtype.name, decay)
        return (key, (slot.raw.addr, 0 if slot.master is None else slot.master.addr,
                      grad.addr, m.addr, v.addr),
                prep + (f32_bits(math.sqrt(1.0 - c.beta2 ** t)),
                        f32_bits(c.lr / (1.0 - c.beta1 ** t))))


class AdamW(Adam):
    """`fu.optim.AdamW(lr=1e-3, weight_decay=0.01, ...)`: decoupled decay, p·(1 − lr·wd)
    before the Adam step."""

    Config = AdamWConfig
    MAGICS = Magics(b"FZA3", b"FZA4", b"FZA5")
    DECOUPLED = True
