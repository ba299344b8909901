"""Per-group advantages from scalar rewards (no torch; pure Python).

Three estimators, picked once by ``TrainConfig.advantage``:

* ``grpo``: ``(r_i - mean) / (std + eps)`` with the **population** standard deviation
  (divide by n, as DeepSeekMath's GRPO and most open implementations do; with n = 1 or all
  rewards equal the numerator is 0, so the advantage is 0).
* ``dr_grpo``: ``r_i - mean`` with no std division (Dr.GRPO, Liu et al. 2025). Its second
  change, dividing each sequence's token sum by a constant (the response length budget)
  instead of its own length, is a loss *aggregation*, so it lives in the trainer
  (:func:`rollstream.train.losses.normaliser`), not here.
* ``rloo``: ``r_i - mean of the other n-1 rewards`` (REINFORCE leave-one-out; computed as the
  identical ``n/(n-1) * (r_i - mean)``). A group of one has no baseline, so its advantage is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]

GRPO_EPS = 1e-6


def _centred(rewards: Sequence[float]) -> list[float]:
    """``r_i - mean``; shifted by ``r_0`` first so an all-equal group gives exact zeros."""
    shifted = [r - rewards[0] for r in rewards]
    mean = math.fsum(shifted) / len(shifted)
    return [s - mean for s in shifted]


def _grpo(rewards: Sequence[float]) -> list[float]:
    centred = _centred(rewards)
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + GRPO_EPS) for c in centred]


def _dr_grpo(rewards: Sequence[float]) -> list[float]:
    return _centred(rewards)


def _rloo(rewards: Sequence[float]) -> list[float]:
    n = len(rewards)
    if n == 1:
        return [0.0]
    return [n / (n - 1) * c for c in _centred(rewards)]


_ESTIMATORS: dict[str, Callable[[Sequence[float]], list[float]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
}


def compute_advantages(rewards: Sequence[float], kind: AdvantageKind) -> list[float]:
    """Advantages of one group's rewards, in the same order."""
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
    return estimator([float(r) for r in rewards])
