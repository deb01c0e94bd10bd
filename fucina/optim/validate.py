"""Config checks shared by every optimizer and schedule: the domains torch.optim refuses (lr < 0,
eps < 0, betas outside [0, 1), weight_decay < 0, momentum < 0), plus what torch lets through
but only yields NaN or silently nothing here: non-finite values and non-numbers. Each check
raises InvalidOptimizerConfig (a ValueError) naming the optimizer, the field and the value.

Checked at construction and again at every step(), so a bad value assigned to `opt.config.lr`
(by hand or by a schedule) is refused before it reaches a parameter.
"""
from __future__ import annotations

import math
import numbers

from ..errors import InvalidOptimizerConfig


def real(op: str, name: str, v, *, low: float | None = None, low_open: bool = False,
         high: float | None = None, high_open: bool = False) -> float:
    """v as a finite float within [low, high] (an open end when low_open / high_open)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidOptimizerConfig(f"{op}: {name}: expected a real number, got "
                                     f"{type(v).__name__} {v!r}")
    f = float(v)
    ok = math.isfinite(f)
    if ok and low is not None:
        ok = f > low if low_open else f >= low
    if ok and high is not None:
        ok = f < high if high_open else f <= high
    if not ok:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + repr(float(low))
        hi = "inf)" if high is None else repr(float(high)) + (")" if high_open else "]")
        raise InvalidOptimizerConfig(f"{op}: {name}: expected a finite value in {lo}, {hi}, "
                                     f"got {v!r}")
    return f


def non_negative(op: str, name: str, v) -> float:
    return real(op, name, v, low=0.0)


def beta(op: str, name: str, v) -> float:
    return real(op, name, v, low=0.0, high=1.0, high_open=True)


def flag(op: str, name: str, v) -> bool:
    if not isinstance(v, bool):
        raise InvalidOptimizerConfig(f"{op}: {name}: expected a bool, got {type(v).__name__} "
                                     f"{v!r}")
    return v


def integer(op: str, name: str, v, low: int, high: int) -> int:
    """v as an int in [low, high)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not low <= v < high:
        raise InvalidOptimizerConfig(f"{op}: expected an int {name} in [{low}, {high}), got {v!r}")
    return int(v)


class _Default(float):
    """A dataclass default that knows it was not passed (so betas= can tell a clash)."""


BETA1, BETA2 = _Default(0.9), _Default(0.999)


def resolve_betas(config, op: str, betas) -> None:
    """torch's `betas=(b1, b2)` spelling: fills config.beta1/beta2; giving both spellings is an
    error. Afterwards beta1/beta2 are plain floats either way."""
    if betas is not None:
        if type(config.beta1) is not _Default or type(config.beta2) is not _Default:
            raise InvalidOptimizerConfig(f"{op}: pass betas=(b1, b2) or beta1=/beta2=, not both "
                                         f"(got betas={betas!r}, beta1={config.beta1!r}, "
                                         f"beta2={config.beta2!r})")
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise InvalidOptimizerConfig(f"{op}: betas: expected a pair (b1, b2), got "
                                         f"{betas!r}") from None
        config.beta1, config.beta2 = b1, b2
    for name in ("beta1", "beta2"):
        v = getattr(config, name)
        if type(v) is _Default:
            setattr(config, name, float(v))


def adam_like(op: str, c) -> None:
    """lr, beta1, beta2, eps, weight_decay as torch.optim.Adam checks them (and finite)."""
    non_negative(op, "lr", c.lr)
    beta(op, "beta1", c.beta1)
    beta(op, "beta2", c.beta2)
    non_negative(op, "eps", c.eps)
    non_negative(op, "weight_decay", c.weight_decay)
