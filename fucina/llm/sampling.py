"""Choosing the next token from a row of logits: greedy, or a seeded draw after the usual
filters (issue 15).

    s = Settings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    token = pick(logits, s, seed, step, history)     # logits [1, vocab]; history: ids so far

The filters run in Hugging Face `generate`'s order: repetition penalty (every id already in the
prompt or the reply: a logit l becomes l / p when l > 0, else l · p), temperature (l / T), top-k,
top-p (keep the most probable tokens whose probability mass before them is below p; the first
always stays), min-p (keep tokens with probability ≥ min_p · the top token's). temperature 0 is
greedy: the first maximum (the lowest id on ties), after the repetition penalty.

The draw is exact and reproducible: the candidates are ordered by logit, descending, ties by id
(`top_k`; without top-k and top-p no order is needed and they stay in id order), their probabilities (softmax over the survivors of top-k) are zeroed where top-p or
min-p drops them, and the token is the first whose cumulative mass exceeds u · total, with u the
53-bit uniform of fu.rng's at(seed, step). Every step is a fucina kernel with a fixed summation
order, so (seed, prompt, settings) give the same tokens on every machine and thread count.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import rng
from ..errors import InvalidSamplingSettings

__all__ = ["Settings", "pick"]


@dataclass(frozen=True)
class Settings:
    """Sampling knobs (validated on construction: InvalidSamplingSettings)."""

    temperature: float = 0.0
    top_k: int = 0            # 0 = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        def real(name, v):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise InvalidSamplingSettings(f"sampling: {name}: expected a finite number, got "
                                              f"{v!r}")
            return float(v)
        t = real("temperature", self.temperature)
        if t < 0:
            raise InvalidSamplingSettings(f"sampling: temperature: expected >= 0 (0 = greedy), "
                                          f"got {t}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) \
                or self.top_k < 0:
            raise InvalidSamplingSettings(f"sampling: top_k: expected an int >= 0 (0 = no limit), "
                                          f"got {self.top_k!r}")
        p = real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidSamplingSettings(f"sampling: top_p: expected a value in (0, 1], got {p}")
        m = real("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise InvalidSamplingSettings(f"sampling: min_p: expected a value in [0, 1], got {m}")
        r = real("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise InvalidSamplingSettings(f"sampling: repetition_penalty: expected > 0 (1 = off), "
                                          f"got {r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits, history, penalty: float):
    """The repetition penalty on the ids in `history` (a new tensor; logits [1, vocab])."""
    if penalty == 1.0 or not history:
        return logits
    seen = np.unique(np.asarray(history, dtype=np.int64))
    rows = logits.gather("vocab", seen, "vocab")
    shrunk = rows.scale(1.0 / penalty).where(rows.compare("gt", 0.0), rows.scale(penalty))
    return logits.set_rows("vocab", seen, shrunk)


def pick(logits, settings: Settings, seed: int, step: int, history=()) -> int:
    """The next token id (see the module docstring). logits: f32 [1, vocab] tagged
    ("seq", "vocab"); seed, step: the draw's counter (step = the reply's token index)."""
    x = penalize(logits, history, settings.repetition_penalty)
    if settings.greedy:
        return int(x.argmax("vocab").item())
    vocab = x.shape[-1]
    k = vocab if settings.top_k == 0 else min(settings.top_k, vocab)
    scaled = x.scale(1.0 / settings.temperature)
    if k == vocab and settings.top_p == 1.0:     # no order needed: the candidates in id order
        values, ids = scaled, None
        probs = values.softmax("vocab").split_axis("vocab", ("cand",), (vocab,))
    else:
        values, ids = scaled.top_k("vocab", k, "cand")
        probs = values.softmax("cand")
    kept = probs
    if settings.top_p < 1.0:
        before = probs.cumsum("cand") - probs            # the mass ahead of each candidate
        kept = kept.masked_fill(before.compare("ge", settings.top_p), 0.0)
    if settings.min_p > 0.0:
        top = (probs.narrow("cand", 0, 1) if ids is not None else probs.max("cand")).item()
        kept = kept.masked_fill(probs.compare("lt", settings.min_p * top), 0.0)
    mass = kept.cumsum("cand")
    total = mass.narrow("cand", k - 1, 1).item()
    u = rng.half_open_unit(rng.at(seed, step)) * total
    spent = mass.compare("le", u).to("f32").sum_all().item()   # candidates used up by u
    j = min(int(spent), k - 1)
    return j if ids is None else int(ids.narrow("cand", j, 1).item())
