"""APOLLO (SPEC T-8; apollo_torch, arXiv 2412.05270): AdamW-like moments kept on a random
low-rank projection of each 2-D gradient, used only to estimate a per-channel (or per-tensor)
scaling of the raw gradient — SGD memory, AdamW-like steps. `ApolloConfig.mini()` is
APOLLO-Mini (rank 1, tensor scaling, scale 128).

Routing: raw rank == 2 → the low-rank path; anything else, and `add_fallback_param*`, → the
legacy Hugging Face AdamW the reference falls back to (eps outside the bias correction, decay
AFTER the step at the raw lr: deliberately not torch's AdamW). State is always f32.

Per low-rank slot [rows, cols] (tall: rows >= cols), with t the step after increment:
    P   regenerated when absent or when step // update_proj_gap changed (step before the
        increment): gaussian_fill(seed + chunk·0x9E3779B97F4A7C15, P, 1/sqrt(rank)) — a pure
        function of (slot seed, chunk), so checkpoints store the seed, never P;
        tall P [rank, cols], wide P [rows, rank]. Moments are not reset.
    R   = G·Pᵀ [rows, rank] (tall) | Pᵀ·G [rank, cols] (wide), by the GEMM
    m, v moments of R; s[c] = f32(sqrt(Σ opt²)/(sqrt(Σ r²) + 1e-8)) per channel (rows of R for
        tall, columns for wide, or one for tensor scaling), opt = m/(sqrt(v) + eps), f64 sums in
        flat order — one kernel (codegen/optim_lowrank.py)
    U   = (G·s[channel])·front (front = sqrt(scale) iff scale_front and scale != 1)
    norm-growth limiter (unless disabled): cur = f32(sqrt(sum_squares(U))); limiter =
        max(cur/(prev + 1e-8), 1.01)/1.01 and prev = cur/limiter once prev was recorded, else
        limiter 1 and prev = cur (float32 arithmetic)
    p   = stepped + decay·stepped, stepped = p − step_size·((U/limiter)·back),
        back = sqrt(scale) iff not scale_front and scale != 1, decay = f32(−lr·wd) if wd > 0
step_size = lr, or f32(lr·sqrt(1 − β2^t)/(1 − β1^t)) with correct_bias (f64).

Frame (T-17): FZP3 | FZP5 (v5 iff any slot, either list, carries an f32 master) | u64 rank |
u64 update_proj_gap | u32 scale bits | u8 scale_type | u8 correct_bias | u8 scale_front |
u8 disable_limiter | u32 n_main | n_main × (name | dims | u64 step | u64 seed | u32 prev_norm
bits | raw f32 m | raw f32 v | [master]) | u32 n_fb | n_fb × (name | dims | u64 step | raw f32 m |
raw f32 v | [master]). A load forces every projection to be regenerated at the next step.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass

from .. import rng
from ..codegen.optim_lowrank import ApolloApplyKey, HfAdamwKey
from ..exec import optim as xo
from ..exec import optim_lowrank as xl
from ..exec.matmul import gemm
from ..errors import InvalidArgument, InvalidOptimizerConfig
from . import frames, validate
from .base import Optimizer, StateBuf, WithFallback, slots_version
from .frames import V3, V5, Magics, StateDType, f32

SCALE_TYPES = ("channel", "tensor")  # index = the frame's u8 scale_type code
MASK64 = (1 << 64) - 1


@dataclass
class ApolloConfig:
    """rank / update_proj_gap / scale / scale_type / correct_bias / scale_front /
    disable_norm_growth_limiter are structural (pinned by checkpoints); seed: the base of the
    per-slot projection seeds. Mutable: schedules write `lr`."""

    lr: float = 0.01
    beta1: float = validate.BETA1
    beta2: float = validate.BETA2
    eps: float = 1e-6
    weight_decay: float = 0.0
    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 1.0
    scale_type: str = "channel"
    correct_bias: bool = True
    scale_front: bool = False
    disable_norm_growth_limiter: bool = False
    seed: int = 0
    betas: InitVar[tuple | None] = None  # torch's spelling of (beta1, beta2)

    def __post_init__(self, betas):
        validate.resolve_betas(self, "ApolloConfig", betas)

    @classmethod
    def mini(cls, **overrides) -> "ApolloConfig":
        """APOLLO-Mini: rank 1, tensor-wise scaling, scale 128 (then any overrides)."""
        return cls(**{"rank": 1, "scale_type": "tensor", "scale": 128.0, **overrides})


def _step_size(c: ApolloConfig, t: int) -> float:
    if not c.correct_bias:
        return f32(c.lr)
    return f32(c.lr * math.sqrt(1.0 - c.beta2 ** t) / (1.0 - c.beta1 ** t))


def _moment_scalars(c: ApolloConfig) -> tuple:
    return f32(c.beta1), f32(1.0 - c.beta1), f32(c.beta2), f32(1.0 - c.beta2)


def _decay(c: ApolloConfig) -> float:
    return f32(-(c.lr * c.weight_decay)) if c.weight_decay > 0 else 0.0


def _sqrt_scale(c: ApolloConfig) -> float:
    return f32(math.sqrt(f32(c.scale)))


class _HfAdamW(Optimizer):
    """APOLLO's fallback list: legacy-HF AdamW slots stepped with the owning Apollo's config
    (never used alone; its records are the tail of the Apollo frame)."""

    Config = ApolloConfig
    RECORD = (("step", "u64"), ("m", "raw"), ("v", "raw"))

    def _init_state(self, slot):
        return {"step": 0, "m": StateBuf(slot.ctx, StateDType.f32, slot.numel),
                "v": StateBuf(slot.ctx, StateDType.f32, slot.numel)}

    def _update(self, slot, grad, prep):
        c = self.config
        st = slot.state
        st["step"] += 1
        scalars = (*_moment_scalars(c), f32(c.eps), _step_size(c, st["step"]), _decay(c))
        xl.hf_adamw(slot.ctx, HfAdamwKey(slot.dtype), slot.raw, slot.master, grad,
                    st["m"].addr, st["v"].addr, scalars)


class Apollo(WithFallback):
    """`fu.optim.Apollo(lr=0.01, rank=128, update_proj_gap=200, ...)`, `Apollo(ApolloConfig(...))`
    or `Apollo(ApolloConfig.mini(lr=0.005))`. APOLLO recipes train without global clipping (the
    norm-growth limiter replaces it); clip_grad_norm still spans both lists."""

    Config = ApolloConfig
    MAGICS = Magics(b"FZP3", None, b"FZP5")
    RECORD = (("step", "u64"), ("seed", "u64"), ("prev_norm", "f32"), ("m", "raw"),
              ("v", "raw"))

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.fallback = _HfAdamW(self.config)

    def _check_config(self):
        """torch-style domains for lr, betas, eps, weight_decay (finite), the structural knobs
        (rank and update_proj_gap >= 1, scale > 0, scale_type, the three flags) and seed (u64)."""
        c, op = self.config, "Apollo"
        for name in ("rank", "update_proj_gap"):
            validate.integer(op, name, getattr(c, name), 1, 1 << 64)
        if c.scale_type not in SCALE_TYPES:
            raise InvalidOptimizerConfig(f"Apollo: expected scale_type in {SCALE_TYPES}, got "
                                         f"{c.scale_type!r}")
        validate.integer(op, "seed", c.seed, 0, 1 << 64)
        validate.adam_like(op, c)
        validate.real(op, "scale", c.scale, low=0.0, low_open=True)
        for name in ("correct_bias", "scale_front", "disable_norm_growth_limiter"):
            validate.flag(op, name, getattr(c, name))

    def close(self) -> None:
        self.fallback.close()
        super().close()

    # ---- registration ----
    def _main(self, slot) -> bool:
        """Raw rank == 2 → the low-rank path; anything else → the legacy-HF AdamW fallback."""
        return slot.raw_rank == 2

    def _init_state(self, slot):
        c = self.config
        rank = int(c.rank)
        tall = slot.rows >= slot.cols
        n = (slot.rows if tall else slot.cols) * rank
        slot.cache.update(rank=rank, proj=None, proj_chunk=None)
        return {"step": 0, "seed": (int(c.seed) + len(self.slots) + 1) & MASK64,
                "prev_norm": -1.0, "m": StateBuf(slot.ctx, StateDType.f32, n),
                "v": StateBuf(slot.ctx, StateDType.f32, n)}

    # ---- stepping ----
    def step(self) -> None:
        """Every low-rank slot with a gradient, then the fallback list."""
        super().step()
        self.fallback.step()

    def _projection(self, slot, chunk: int):
        """P for this chunk of steps: regenerated from (seed, chunk) when it changed."""
        cache = slot.cache
        if cache["proj"] is None or cache["proj_chunk"] != chunk:
            rank = cache["rank"]
            tall = slot.rows >= slot.cols
            if cache["proj"] is None:
                cache["proj"] = slot.ctx.empty((rank, slot.cols) if tall else (slot.rows, rank))
            seed = (slot.state["seed"] + chunk * rng.GAMMA) & MASK64
            rng.gaussian_fill(seed, cache["proj"], f32(1.0 / f32(math.sqrt(f32(rank)))))
            cache["proj_chunk"] = chunk
        return cache["proj"]

    def _update(self, slot, grad, prep):
        c = self.config
        ctx, st = slot.ctx, slot.state
        rows, cols = slot.rows, slot.cols
        if c.rank != slot.cache["rank"]:
            raise InvalidArgument(f"Apollo.step: rank changed from {slot.cache['rank']} (at "
                                  f"registration) to {c.rank}; expected a fixed rank")
        tall = rows >= cols
        g = grad.view((rows, cols), (cols, 1))
        proj = self._projection(slot, st["step"] // c.update_proj_gap)
        r = gemm(ctx, g, proj.permute((1, 0))) if tall else gemm(ctx, proj.permute((1, 0)), g)
        st["step"] += 1
        mode = "tensor" if c.scale_type == "tensor" else ("tall" if tall else "wide")
        scaling = slot.cache.get(("scaling", mode))
        if scaling is None:
            channels = 1 if mode == "tensor" else (rows if tall else cols)
            scaling = slot.cache[("scaling", mode)] = ctx.empty((channels,))
        xl.apollo_scale(ctx, r, st["m"].addr, st["v"].addr, scaling, mode,
                        (*_moment_scalars(c), f32(c.eps)))
        del r
        upd = ctx.empty((rows, cols))
        sqrt_scale = _sqrt_scale(c)
        xl.apollo_build(ctx, upd, g, scaling, mode,
                        sqrt_scale if c.scale_front and f32(c.scale) != 1.0 else None)
        limiter = 1.0
        if not c.disable_norm_growth_limiter:
            cur = f32(math.sqrt(xo.sum_squares(ctx, upd)))
            prev = st["prev_norm"]
            if prev >= 0:
                limiter = f32(max(f32(cur / f32(prev + f32(1e-8))), f32(1.01)) / f32(1.01))
                st["prev_norm"] = f32(cur / limiter)
            else:
                st["prev_norm"] = cur
        back = sqrt_scale if not c.scale_front and f32(c.scale) != 1.0 else 1.0
        xl.apollo_apply(ctx, ApolloApplyKey(slot.dtype), slot.raw, slot.master, upd,
                        (limiter, back, _step_size(c, st["step"]), _decay(c)))

    # ---- frames: one version and header, the low-rank records, then the fallback's ----
    def _header(self):
        c = self.config
        return [("u64", c.rank, "rank"), ("u64", c.update_proj_gap, "update_proj_gap"),
                ("f32", c.scale, "scale"), ("u8", SCALE_TYPES.index(c.scale_type), "scale_type"),
                ("bool", c.correct_bias, "correct_bias"), ("bool", c.scale_front, "scale_front"),
                ("bool", c.disable_norm_growth_limiter, "disable_norm_growth_limiter")]

    def frame_version(self) -> int:
        return V5 if slots_version(self.all_slots(), ()) == V5 else V3

    def write_frame(self, f) -> None:
        frames.slot_names(self.fallback.slots, f"{type(self).__name__}.save_state")
        super().write_frame(f)

    def write_slots(self, f, version, names) -> None:
        super().write_slots(f, version, names)
        op = f"{type(self).__name__}.save_state"
        self.fallback.write_slots(f, version, frames.slot_names(self.fallback.slots, op))

    def stage_slots(self, r, version):
        return super().stage_slots(r, version), self.fallback.stage_slots(r, version)

    def commit_slots(self, staged) -> None:
        main, fb = staged
        super().commit_slots(main)
        self.fallback.commit_slots(fb)

    def _after_load(self, slot) -> None:
        slot.cache["proj_chunk"] = None  # regenerate P from the restored seed and step
