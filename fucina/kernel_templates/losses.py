"""Elementwise loss formulas (SPEC L-4) and their derivatives — one template per kernel
(language: codegen/lowering.py). fucina/ag/loss.py runs them by name and reduces the
per-element values (sum, mean or none).

Forward kernels read (x, t) and the loss's by-value parameters; derivative kernels read
(g, x, t), then `scale` (1/n for mean, else 1), then the same parameters. `maximum` and
`minimum` are the NaN-propagating ones (torch's clamp), so a NaN input gives a NaN loss.

  mse          (x − t)²
  huber        |d| ≤ δ ? d²/2 : δ(|d| − δ/2), d = x − t; its derivative s·g·clamp(d, −δ, δ)
  bce_logits   max(x, 0) − x·y + log1p(e^−|x|)        (stable for any logit)
  bce_probs    −(y ln p + (1 − y) ln(1 − p)), p = clamp(x, eps, 1 − eps); the input gradient
               is 0 outside the open interval (SPEC §7.1 item 5: torch clamps the log at −100)
  kl           t > 0 ? t·(ln t − x) : 0               (x log-probabilities)
  kl_log       e^t·(t − x)                            (log_target: t log-probabilities too)
"""
from __future__ import annotations

from .template import Template as T

CONSTANTS: dict = {}

KERNELS = {
    "mse_loss": T("x t", """
        d = x - t
        d * d"""),
    "mse_loss_dx": T("g x t scale", "((g * scale) * 2) * (x - t)"),
    "mse_loss_dt": T("g x t scale", "((g * scale) * 2) * (t - x)"),

    "huber_loss": T("x t delta", """
        d = x - t
        a = abs(d)
        (d * d) * 0.5 if a <= delta else delta * (a - delta * 0.5)"""),
    "huber_loss_dx": T("g x t scale delta",
                       "(g * scale) * minimum(maximum(x - t, -delta), delta)"),
    "huber_loss_dt": T("g x t scale delta",
                       "(g * scale) * minimum(maximum(t - x, -delta), delta)"),

    "bce_logits_loss": T("x y", "(maximum(x, 0) - x * y) + log1p(exp(-abs(x)))"),
    "bce_logits_loss_dx": T("g x y scale", "(g * scale) * (sigmoid(x) - y)"),
    "bce_logits_loss_dt": T("g x y scale", "(g * scale) * -x"),

    "bce_probs_loss": T("x y eps hi", """
        p = minimum(maximum(x, eps), hi)
        -(y * log(p) + (1 - y) * log(1 - p))"""),
    "bce_probs_loss_dx": T("g x y scale eps hi", """
        p = minimum(maximum(x, eps), hi)
        (g * scale) * ((p - y) / (p * (1 - p))) if (x > eps) & (x < hi) else 0"""),
    "bce_probs_loss_dt": T("g x y scale eps hi", """
        p = minimum(maximum(x, eps), hi)
        (g * scale) * (log(1 - p) - log(p))"""),     # ln(1 − p) − ln p

    "kl_div_loss": T("x t", "t * (log(t) - x) if t > 0 else 0"),
    "kl_div_loss_dx": T("g x t scale", "-((g * scale) * t)"),
    "kl_div_loss_dt": T("g x t scale", "(g * scale) * ((log(t) - x) + 1) if t > 0 else 0"),

    "kl_div_log_target_loss": T("x t", "exp(t) * (t - x)"),
    "kl_div_log_target_loss_dx": T("g x t scale", "-((g * scale) * exp(t))"),
    "kl_div_log_target_loss_dt": T("g x t scale", "(g * scale) * (exp(t) * ((t - x) + 1))"),
}

TEMPLATES = KERNELS
