"""Muon (SPEC T-6): Keller Jordan's reference (lerp-form momentum, Nesterov blend, Newton–Schulz
orthogonalization of the update) with Moonlight's optional RMS-matching scale, and an embedded
AdamW for the params Muon must not orthogonalize.

Routing: `add_param` sends a param of raw rank >= 2 (a conv filter flattens to [d0, rest]) to
Muon and anything smaller to the fallback; `add_fallback_param` forces the fallback (embeddings,
output/classifier heads: 2-D, but not hidden-space maps — routing them to Muon is silently wrong,
not an error). Each param belongs to one path (DuplicateParam across both). `step` runs every
Muon slot, then the fallback; clipping and norms span both.

Per Muon slot (f32; β = momentum, w = 1 − β, both float32):
    m1 = lerp(m0, g, w); u = lerp(g, m1, β) (nesterov) or m1     one fused kernel, ATen's
                                                                  lerp forms (switch at 0.5)
    O  = newton_schulz5(u[rows, cols], ns_steps)
    p  = p·keep − lr_eff·O                                        one fused kernel
keep = f32(1 − lr·wd) (1 without decay); lr_eff in float32: spectral lr·sqrt(max(1, rows/cols)),
match_rms_adamw (lr·0.2)·sqrt(max(rows, cols)). ns_dtype="bf16" runs the Newton–Schulz GEMMs
of bf16 leaves through the bf16 GEMM (operands rounded to bf16, f32 sums; what torch.optim.Muon
does for every leaf); f32 and f16 leaves, and every leaf by default, iterate in f32.

Frame (T-17): FZM3/FZM4/FZM5 | u8 scale | u8 nesterov | u32 ns_steps | u32 n | n × (name | dims |
momentum buffer | [master]), immediately followed by the fallback's own AdamW frame. The Muon
version is decided by its own momentum buffers and masters; a load commits Muon's slots only
after the fallback's frame was read and validated too.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ..ag.engine import is_grad_enabled
from ..ag.tensor import Tensor
from ..codegen.optim_lowrank import MuonApplyKey, MuonMomentumKey
from ..errors import (DTypeError, InvalidArgument, InvalidArgumentType, InvalidOptimizerConfig,
                      InvalidShape, UnsupportedGradient)
from ..exec import optim_lowrank as xl
from . import frames, validate
from .adam import AdamW, AdamWConfig
from .base import StateBuf, WithFallback
from .frames import Magics, StateDType, f32

SCALES = ("spectral", "match_rms_adamw")  # index = the frame's u8 scale code
NS_DTYPES = ("f32", "bf16")


def _fallback_default() -> AdamWConfig:
    return AdamWConfig(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0)


@dataclass
class MuonConfig:
    """scale: "spectral" (Keller) | "match_rms_adamw" (Moonlight: reuse AdamW-tuned lr/wd);
    state_dtype: storage of the momentum buffer; fallback: the embedded AdamW's config (its own
    state dtypes); ns_dtype: "f32" (default) or "bf16" — the Newton–Schulz arithmetic of bf16
    leaves. Mutable: schedules write `lr` (and `fallback.lr`)."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    weight_decay: float = 0.0
    scale: str = "spectral"
    state_dtype: StateDType = StateDType.f32
    fallback: AdamWConfig = field(default_factory=_fallback_default)
    ns_dtype: str = "f32"

    def __post_init__(self):
        self.state_dtype = StateDType.of(self.state_dtype)


def newton_schulz5(u: Tensor, steps: int) -> Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration: ≈ U·Vᵀ of the rank-2 f32 tensor `u`
    (singular values land in roughly (0.5, 1.5) by design). `u` is never written; the result is
    a new constant with u's tags. A tall input (rows > cols) iterates on its transpose."""
    op = "newton_schulz5"
    if not isinstance(u, Tensor):
        raise InvalidArgumentType(f"{op}: operand u: expected a fucina Tensor, got "
                                  f"{type(u).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps < 1 << 32:
        raise InvalidArgument(f"{op}: expected an int steps in [0, 2^32), got {steps!r}")
    raw = u._live(op)
    if raw.rank != 2:
        raise InvalidShape(f"{op}: operand u: expected a rank-2 tensor, got shape {raw.shape} "
                           f"(tags {u.tags})")
    if raw.dtype != "f32":
        raise DTypeError(f"{op}: operand u: expected dtype f32, got {raw.dtype}")
    if u.requires_grad and is_grad_enabled():
        raise UnsupportedGradient(f"{op}: operand u requires grad; expected a constant (the "
                                  f"iteration has no gradient: call it under fu.no_grad())")
    return Tensor._result(xl.newton_schulz5(raw.ctx, raw, int(steps)), u.tags)


def lr_eff(config: MuonConfig, rows: int, cols: int) -> float:
    """The shape-scaled learning rate, in float32 arithmetic."""
    lr = f32(config.lr)
    if config.scale == "spectral":
        return f32(lr * f32(math.sqrt(max(1.0, f32(f32(rows) / f32(cols))))))
    if config.scale == "match_rms_adamw":
        return f32(f32(lr * f32(0.2)) * f32(math.sqrt(f32(max(rows, cols)))))
    raise InvalidArgument(f"Muon: expected scale in {SCALES}, got {config.scale!r}")


class Muon(WithFallback):
    """`fu.optim.Muon(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
    scale="spectral", state_dtype=..., fallback=AdamWConfig(...))` or `Muon(MuonConfig(...))`.
    `muon.fallback` is the embedded AdamW (its config is `muon.config.fallback`)."""

    Config = MuonConfig
    MAGICS = Magics(b"FZM3", b"FZM4", b"FZM5")
    RECORD = (("momentum", "buf"),)

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.fallback = AdamW(self.config.fallback)

    def _check_config(self):
        """torch.optim.Muon's checks (lr, momentum, weight_decay >= 0), every value finite, plus
        the structural knobs a frame pins (scale, nesterov, ns_steps)."""
        c, op = self.config, "Muon"
        if c.scale not in SCALES:
            raise InvalidOptimizerConfig(f"Muon: expected scale in {SCALES}, got {c.scale!r}")
        if c.ns_dtype not in NS_DTYPES:
            raise InvalidOptimizerConfig(f"Muon: ns_dtype: expected one of "
                                         f"{', '.join(NS_DTYPES)}, got {c.ns_dtype!r}")
        if isinstance(c.ns_steps, bool) or not isinstance(c.ns_steps, numbers.Integral) \
                or not 0 <= c.ns_steps < 1 << 32:
            raise InvalidOptimizerConfig(f"Muon: expected an int ns_steps in [0, 2^32), got "
                                         f"{c.ns_steps!r}")
        validate.non_negative(op, "lr", c.lr)
        validate.non_negative(op, "momentum", c.momentum)
        validate.non_negative(op, "weight_decay", c.weight_decay)
        validate.flag(op, "nesterov", c.nesterov)
        if not isinstance(c.fallback, AdamWConfig):
            raise InvalidArgumentType(f"Muon: expected fallback to be an AdamWConfig, got "
                                      f"{type(c.fallback).__name__}")

    def close(self) -> None:
        self.fallback.close()
        super().close()

    # ---- registration: two paths, one identity check ----
    def _main(self, slot) -> bool:
        """Raw rank >= 2 → Muon; 0-D / 1-D → the AdamW fallback."""
        return slot.raw_rank >= 2

    # ---- stepping ----
    def step(self) -> None:
        """Every Muon slot with a gradient, then the fallback's step."""
        super().step()
        self.fallback.step()

    def _init_state(self, slot):
        return {"momentum": StateBuf(slot.ctx, self.config.state_dtype, slot.numel)}

    def _update(self, slot, grad, prep):
        c = self.config
        ctx = slot.ctx
        beta = f32(c.momentum)
        w = f32(1.0 - beta)
        buf = slot.state["momentum"]
        variant = (bool(c.nesterov), w < 0.5, beta < 0.5)
        key = slot.cache.get(variant)
        if key is None:
            key = slot.cache[variant] = MuonMomentumKey(buf.dtype.name, *variant)
        upd = ctx.empty((slot.rows, slot.cols))
        xl.muon_momentum(ctx, key, grad, buf.addr, upd, w, beta)
        ortho = xl.newton_schulz5(ctx, upd, c.ns_steps,
                                  bf16=c.ns_dtype == "bf16" and slot.dtype == "bf16")
        del upd
        keep = f32(1.0 - c.lr * c.weight_decay) if c.weight_decay != 0 else 1.0
        xl.muon_apply(ctx, MuonApplyKey(slot.dtype), slot.raw, slot.master, ortho, keep,
                      lr_eff(c, slot.rows, slot.cols))

    # ---- frames: Muon's records, then the fallback's whole frame ----
    def _header(self):
        c = self.config
        return [("u8", SCALES.index(c.scale), "scale"), ("bool", c.nesterov, "nesterov"),
                ("u32", c.ns_steps, "ns_steps")]

    def write_frame(self, f) -> None:
        frames.slot_names(self.fallback.slots, f"{type(self).__name__}.save_state")
        super().write_frame(f)
        self.fallback.write_frame(f)

    def stage_frame(self, r):
        own = super().stage_frame(r)
        return own, self.fallback.stage_frame(r)

    def commit_frame(self, staged) -> None:
        own, fb = staged
        self.fallback.commit_frame(fb)
        self.commit_slots(own)
