"""Per-group advantages from scalar rewards (no torch; pure Python).

Three estimators, picked once by ``TrainConfig.advantage``:

* ``grpo``: ``(r_i - mean) / (std + eps)``. ``std="sample"`` (the default, as verl and TRL
  compute it with ``torch.std``) is the Bessel-corrected standard deviation (divide by
  n - 1); ``std="population"`` divides by n (DeepSeekMath's formula). With n = 1 or all
  rewards equal the numerator is 0, so the advantage is 0.
* ``dr_grpo``: ``r_i - mean`` with no std division (Dr.GRPO, Liu et al. 2025). Its second
  change, dividing each sequence's token sum by a constant (the response length budget)
  instead of its own length, is a loss *aggregation* (``loss_agg:
  seq_mean_token_sum_norm``, what ``loss_agg: auto`` picks for dr_grpo), so it lives in
  :mod:`rollstream.train.losses`, not here.
* ``rloo``: ``r_i - mean of the other n-1 rewards`` (REINFORCE leave-one-out; computed as the
  identical ``n/(n-1) * (r_i - mean)``). A group of one has no baseline, so its advantage is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]
StdKind = Literal["sample", "population"]

GRPO_EPS = 1e-6


def _centred(rewards: Sequence[float]) -> list[float]:
    """``r_i - mean``; shifted by ``r_0`` first so an all-equal group gives exact zeros."""
    shifted = [r - rewards[0] for r in rewards]
    mean = math.fsum(shifted) / len(shifted)
    return [s - mean for s in shifted]


def _grpo(rewards: Sequence[float], std_kind: StdKind) -> list[float]:
    centred = _centred(rewards)
    dof = len(centred) - (1 if std_kind == "sample" else 0)
    if dof < 1:  # a group of one: no spread, and its centred reward is 0
        return [0.0] * len(centred)
    std = math.sqrt(math.fsum(c * c for c in centred) / dof)
    return [c / (std + GRPO_EPS) for c in centred]


def _dr_grpo(rewards: Sequence[float], std_kind: StdKind) -> list[float]:
    return _centred(rewards)


def _rloo(rewards: Sequence[float], std_kind: StdKind) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [0.0]
    return [n / (n - 1) * c for c in _centred(rewards)]


_ESTIMATORS: dict[str, Callable[[Sequence[float], StdKind], list[float]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
}


def compute_advantages(
    rewards: Sequence[float], kind: AdvantageKind, *, std: StdKind = "sample"
) -> list[float]:
    """Advantages of one group's rewards, in the same order (``std``: grpo's deviation)."""
    try:
        estimator = _ESTIMATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown advantage kind {kind!r}; known: {', '.join(sorted(_ESTIMATORS))}"
        ) from None
    if not rewards:
        raise ValueError("compute_advantages needs at least one reward")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    if std not in ("sample", "population"):
        raise ValueError(f"unknown std kind {std!r}; known: sample, population")
    return estimator([float(r) for r in rewards], std)
