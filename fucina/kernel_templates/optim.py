"""Optimizer update rules (SPEC T-3…T-6, T-8): the per-element arithmetic of the fused update
kernels (codegen/optim.py, codegen/optim_lowrank.py), one template per rule (language:
codegen/lowering.py). The kernels own the loads, the stores (state narrowed to its dtype, a
16-bit param's f32 master) and which rules a configuration needs (decay or not, nesterov,
first step); every value a rule reads is f32, hyperparameters arrive as by-value scalars.

Each rule is written in SPEC order with separate multiplies and adds (no contraction), so any
chunking gives the same bits; the state value a later rule reads is the pre-narrow f32 one.
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS: dict = {}

KERNELS = {
    # shared
    "l2_decay": T("g p wd", "g + wd * p"),                       # coupled weight decay
    "ema": T("m x beta1 omb1", "beta1 * m + omb1 * x"),          # m = β1·m + (1−β1)·x
    "ema_sq": T("v x beta2 omb2", "beta2 * v + (omb2 * x) * x"),  # v = β2·v + ((1−β2)·x)·x
    "adam_direction": T("m v eps", "m / (sqrt(v) + eps)"),

    # SGD (T-4): buf = g (first step) | momentum·buf + (1−dampening)·g;
    # g = g + momentum·buf (nesterov) | buf;  p = p − lr·g
    "sgd_momentum": T("buf g momentum omd", "momentum * buf + omd * g"),
    "sgd_nesterov": T("g buf momentum", "g + momentum * buf"),
    "sgd_step": T("p g lr", "p - lr * g"),

    # Adam / AdamW (T-5): d = p·keep (AdamW) | p;  m = m + (1−β1)·(g − m);
    # v = β2·v + ((1−β2)·g)·g;  p = d − step_size·(m / (sqrt(v)/sqrt(bc2) + eps))
    "adamw_decay": T("p keep", "p * keep"),
    "adam_m": T("m g omb1", "m + omb1 * (g - m)"),
    "adam_step": T("d m v eps bc2s step_size",
                   "d - step_size * (m / (sqrt(v) / bc2s + eps))"),

    # Muon (T-6): the momentum lerp m → g with weight w = 1 − β, in ATen's two forms (the
    # form switches at weight 0.5); the nesterov blend g → m1 with weight β likewise
    "muon_momentum_small": T("m g w beta", "m + w * (g - m)"),
    "muon_momentum_large": T("m g w beta", "g - (g - m) * beta"),
    "muon_nesterov_small": T("m1 g w beta", "g + beta * (m1 - g)"),
    "muon_nesterov_large": T("m1 g w beta", "m1 - (m1 - g) * w"),
    "muon_apply": T("p o keep lr_eff", "p * keep - lr_eff * o"),
    "ns_axpby": T("x y s t", "s * x + t * y"),                   # Newton–Schulz: b·A + c·A²

    # APOLLO (T-8) and its legacy Hugging Face AdamW fallback (decay after the step)
    "apollo_build": T("g s", "g * s"),
    "apollo_build_front": T("g s front", "(g * s) * front"),
    "apollo_apply": T("p u limiter back step_size decay", """
        stepped = p - step_size * ((u / limiter) * back)
        stepped + decay * stepped"""),
    "hf_adamw_step": T("p m v eps step_size decay", """
        stepped = p - step_size * adam_direction(m, v, eps)
        stepped + decay * stepped"""),
}

TEMPLATES = KERNELS
