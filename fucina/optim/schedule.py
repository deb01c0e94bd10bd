"""Learning-rate schedules (SPEC T-12): LrSchedule scales the base lr of every attached config
by a factor; warmup_cosine_factor is the usual linear warmup + cosine decay, a pure function of
the step (resume re-applies it: lr is deliberately not a checkpoint field). Arguments outside
their domain raise InvalidOptimizerConfig: a negative or non-finite base or factor would only
turn into a NaN or a sign-flipped update later."""
from __future__ import annotations

import math

from . import validate
from .base import f32


class LrSchedule:
    """`sched.attach(opt.config)`, then `sched.apply(factor)` each step: lr = f32(base·factor).

    attach() captures the target's current value as its base; attaching the same target again
    refreshes the base instead of adding a second entry."""

    def __init__(self):
        self.entries: list[list] = []  # [target, attr, base]

    def attach(self, target, attr: str = "lr") -> None:
        base = validate.non_negative("LrSchedule.attach", f"{type(target).__name__}.{attr}",
                                     getattr(target, attr))
        for e in self.entries:
            if e[0] is target and e[1] == attr:
                e[2] = base
                return
        self.entries.append([target, attr, base])

    def apply(self, factor: float) -> None:
        factor = validate.non_negative("LrSchedule.apply", "factor", factor)
        for target, attr, base in self.entries:
            setattr(target, attr, f32(base * factor))


def warmup_cosine_factor(step: int, total: int, warmup: int, min_factor: float) -> float:
    """Linear warmup over `warmup` steps ((step+1)/warmup), then cosine from 1 to min_factor at
    `total`; 0-based step, f64. step, total, warmup: ints >= 0; min_factor in [0, 1]."""
    op = "warmup_cosine_factor"
    for name, v in (("step", step), ("total", total), ("warmup", warmup)):
        validate.integer(op, name, v, 0, 1 << 63)
    min_factor = validate.real(op, "min_factor", min_factor, low=0.0, high=1.0)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return min_factor
    progress = min((step - warmup) / (total - warmup), 1.0)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
