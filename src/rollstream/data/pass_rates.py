"""Pass rates tracked online, and the draw weight they give a task (``tasks.pass_rate``).

A group whose rewards do not vary teaches nothing: the rollout filters it. So a task whose
recent groups were all correct or all wrong is worth drawing less. For each *key* (a task of
a dataset; a difficulty bucket of a generated source, whose tasks are drawn fresh and never
recur) the pass rate ``p`` has a Beta posterior: the source's prior ``Beta(k m, k (1 - m))``
plus the key's passes and failures, decayed so that its evidence halves every
``half_life_groups`` of its groups (recent groups count more, and a change of difficulty
shows). The chance that the next group of ``n`` samples has no variance is, for pass/fail
rewards, ``E[p^n] + E[(1 - p)^n]``, and under ``Beta(a, b)`` exactly
``E[p^n] = prod_{i<n} (a + i) / (a + b + i)``. The key's draw weight is one minus that
chance, the probability that its next group trains, clipped to ``[floor, 1]``.

The prior is the source's, fitted to its groups (empirical Bayes, by moments): ``m`` is the
mean pass share of a group, and the spread of the task pass rates ``p`` is what the spread of
the group pass shares ``x`` has beyond binomial noise, ``Var(p) = (n Var(x) - m (1 - m)) /
(n - 1)``; then ``k = m (1 - m) / Var(p) - 1`` (clipped to ``[0.1, 50]``; 2 until the source
has 4 groups; the source's moments follow its last few hundred groups, each weighted by the
inverse of the weight it was drawn with, so that they describe the tasks the source offers,
not the ones this sampler preferred). A source whose tasks
are either always solved or never (the usual case) gets a small ``k``, a U-shaped prior, so
one all-correct group already says much about a task; a source of uniformly middling tasks
gets a large one.

Drawing by weight from a cursor (:meth:`PassRates.accept`): the source offers its next task
in order and the key's *credit* grows by its weight; the task is taken when the credit
reaches 1, which then pays 1. The credit starts at a seeded phase in ``[0, 1)``. So a key
offered ``k`` times is taken at least ``floor * k - 1`` times whatever its rewards: nothing
starves, and a key whose difficulty drifts is still seen, and its new rewards lift it again.
Error diffusion instead of a coin: the bound holds for every run, not on average.

Rewards in ``[0, 1]`` count as that fraction of a pass (others are clipped), so a partial
credit reward is treated as a fractional pass; its chance of no variance is then an estimate.

Simplifications: one weight per key from its own evidence, no sharing between neighbouring
difficulty buckets; a dataset's state keeps an entry for every task it has seen.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from rollstream.config.tasks import PassRateConfig


def zero_variance_chance(a: float, b: float, n: int) -> float:
    """P(all n pass-or-fail samples agree) when p ~ Beta(a, b): E[p^n] + E[(1 - p)^n]."""
    all_pass = all_fail = 1.0
    for i in range(n):
        all_pass *= (a + i) / (a + b + i)
        all_fail *= (b + i) / (a + b + i)
    return all_pass + all_fail


_SOURCE_HALF_LIFE_GROUPS = 256.0  # the source's prior follows its last few hundred groups
_MIN_K, _MAX_K, _K_UNFITTED = 0.1, 50.0, 2.0


class PassRates:
    """Per source and key: decayed passes and failures, the draw credit; see the module."""

    def __init__(self, cfg: PassRateConfig, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self._decay = 0.5 ** (1.0 / cfg.half_life_groups)
        self._source_decay = 0.5 ** (1.0 / _SOURCE_HALF_LIFE_GROUPS)
        self._sources: dict[str, list[float]] = {}  # source -> [groups, sum x, sum x^2]
        self._keys: dict[str, dict[str, list[float]]] = {}  # source -> key -> [passes, failures]
        self._credit: dict[str, dict[str, float]] = {}  # source -> key -> credit
        self.group_size = 0  # samples per group, learned from the first observed group

    def observe(self, source: str, key: str, rewards: Sequence[float], group_size: int) -> None:
        """A group of ``key`` ended with these rewards (graded samples)."""
        if not rewards:
            return
        passes = sum(min(1.0, max(0.0, float(r))) for r in rewards)
        fails = len(rewards) - passes
        self.group_size = group_size
        represents = 1.0 / self.weight(source, key)  # the offers its draw stood for
        ev = self._keys.setdefault(source, {}).setdefault(key, [0.0, 0.0])
        ev[0] = self._decay * ev[0] + passes
        ev[1] = self._decay * ev[1] + fails
        x = passes / len(rewards)
        moments = self._sources.setdefault(source, [0.0, 0.0, 0.0])
        for i, value in enumerate((1.0, x, x * x)):
            moments[i] = self._source_decay * moments[i] + represents * value

    def weight(self, source: str, key: str) -> float:
        """The key's draw weight: the chance its next group trains, in ``[floor, 1]`` (1
        before any group was seen)."""
        ev = self._keys.get(source, {}).get(key)
        n = self.group_size
        if n < 2:
            return 1.0
        a0, b0 = self.prior(source)
        passes, fails = ev if ev is not None else (0.0, 0.0)
        informative = 1.0 - zero_variance_chance(a0 + passes, b0 + fails, n)
        return min(1.0, max(self.cfg.floor, informative))

    def prior(self, source: str) -> tuple[float, float]:
        """Beta(a, b) of a key without evidence, fitted to the source's groups (module)."""
        groups, sum_x, sum_x2 = self._sources.get(source, (0.0, 0.0, 0.0))
        m = (sum_x + 0.5) / (groups + 1.0)
        k, n = _K_UNFITTED, self.group_size
        if groups >= 4 and n >= 2:
            var_x = max(0.0, sum_x2 / groups - (sum_x / groups) ** 2)
            var_p = (n * var_x - m * (1.0 - m)) / (n - 1)
            k = m * (1.0 - m) / var_p - 1.0 if var_p > 0 else _MAX_K
            k = min(_MAX_K, max(_MIN_K, k))
        return k * m, k * (1.0 - m)

    def accept(self, source: str, key: str) -> bool:
        """Offer one task of ``key``: True when it is taken (its credit reached 1)."""
        credits = self._credit.setdefault(source, {})
        credit = credits.get(key)
        if credit is None:  # a seeded phase, so that keys of equal weight do not move in step
            credit = zlib.crc32(f"{self.seed}/{source}/{key}".encode()) / 2**32
        credit += self.weight(source, key)
        taken = credit >= 1.0
        credits[key] = credit - 1.0 if taken else credit
        return taken

    def rate(self, source: str) -> float | None:
        """The source's decayed pass share of a group (None before any group)."""
        groups, sum_x, _ = self._sources.get(source, (0.0, 0.0, 0.0))
        return sum_x / groups if groups else None

    def state(self) -> dict[str, Any]:
        """A copy (JSON): the rollout goes on while a checkpoint writes it."""
        return {"sources": {s: list(v) for s, v in self._sources.items()},
                "keys": {s: {k: list(v) for k, v in keys.items()}
                         for s, keys in self._keys.items()},
                "credit": {s: dict(keys) for s, keys in self._credit.items()},
                "group_size": self.group_size}

    def restore(self, state: dict[str, Any]) -> None:
        self._sources = {s: [float(x) for x in v] for s, v in state.get("sources", {}).items()}
        self._keys = {s: {k: [float(x) for x in v] for k, v in keys.items()}
                      for s, keys in state.get("keys", {}).items()}
        self._credit = {s: {k: float(c) for k, c in keys.items()}
                        for s, keys in state.get("credit", {}).items()}
        self.group_size = int(state.get("group_size", 0))
