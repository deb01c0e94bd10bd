"""SGD (SPEC T-4): torch.optim.SGD's single-tensor step — coupled L2 decay, a momentum buffer
that starts as a clone of the first (decayed) gradient, optional nesterov — as one fused kernel
per slot. Frame magics FZS3 / FZS4 / FZS5.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.optim import SgdKey
from ..errors import InvalidArgument, InvalidOptimizerConfig
from ..exec.elementwise import f32_bits
from .base import Optimizer, StateBuf
from . import validate
from .frames import Magics, StateDType


@dataclass
class SgdConfig:
    """momentum 0 allocates no buffer; nesterov needs momentum != 0 and dampening == 0;
    state_dtype: storage of the momentum buffer (T-3). Mutable: schedules write `lr`."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    state_dtype: StateDType = StateDType.f32

    def __post_init__(self):
        self.state_dtype = StateDType.of(self.state_dtype)


class SGD(Optimizer):
    """`fu.optim.SGD(lr=..., momentum=..., dampening=..., weight_decay=..., nesterov=...,
    state_dtype=...)` or `SGD(SgdConfig(...))`."""

    Config = SgdConfig
    MAGICS = Magics(b"FZS3", b"FZS4", b"FZS5")
    RECORD = (("step", "u64"), ("momentum_buffer", "buf"))

    def _check_config(self):
        """torch.optim.SGD's checks (lr, momentum, weight_decay >= 0; nesterov needs momentum
        and zero dampening); stricter: every value finite, nesterov a bool."""
        c, op = self.config, "SGD"
        validate.non_negative(op, "lr", c.lr)
        validate.non_negative(op, "momentum", c.momentum)
        validate.real(op, "dampening", c.dampening)
        validate.non_negative(op, "weight_decay", c.weight_decay)
        validate.flag(op, "nesterov", c.nesterov)
        if c.nesterov and (c.momentum == 0 or c.dampening != 0):
            raise InvalidOptimizerConfig(f"SGD: nesterov requires momentum != 0 and dampening "
                                         f"== 0, got momentum={c.momentum} "
                                         f"dampening={c.dampening}")

    def _header(self):
        c = self.config
        return [("f32", c.momentum, "momentum"), ("f32", c.dampening, "dampening"),
                ("bool", c.nesterov, "nesterov")]

    def _init_state(self, slot):
        c = self.config
        n = slot.numel if c.momentum != 0 else 0
        return {"step": 0,
                "momentum_buffer": StateBuf(slot.ctx, c.state_dtype if n else StateDType.f32, n)}

    def _prepare(self):
        c = self.config
        return (f32_bits(c.lr), f32_bits(c.momentum), f32_bits(1.0 - c.dampening),
                f32_bits(c.weight_decay))

    def _update(self, slot, grad, prep):
        c = self.config
        buf = slot.state["momentum_buffer"]
        if c.momentum != 0 and buf.raw is None:
            raise InvalidArgument("SGD.step: momentum was 0 when this param was registered, so it "
                                  "has no momentum buffer; expected momentum != 0 from "
                                  "registration on")
        slot.state["step"] += 1
        first = slot.state["step"] == 1
        variant = (c.momentum != 0, c.nesterov, c.weight_decay != 0, first)
        key = slot.cache.get(variant)
        if key is None:
            key = slot.cache[variant] = SgdKey(slot.dtype, buf.dtype.name if variant[0] else "none",
                                               variant[2], variant[0] and c.nesterov, first)
        return (key, (slot.raw.addr, 0 if slot.master is None else slot.master.addr, grad.addr,
                      buf.addr), prep)
