"""The simulated trainer: the real rollout's ``TrainerLike`` with a step time from the profile.

``step`` keeps, of every graded sample of the batch, the tokens the run's real
:class:`StalenessPolicy` lets a loss keep (``kept_tokens``: all of them, or those within
``max_token_age``), and returns them as a real :class:`StepResult`, so the rollout records
TRAINED / FILTERED and staleness exactly as in a run. Its cost, the profile's trainer step
time over the kept samples' prompt and response tokens (real tokens), is charged on virtual
time by the :class:`~rollstream.sim.vloop.VirtualExecutor` the controller runs steps on
(:meth:`take_elapsed`); with Profile.contention, ``sim/run.py`` lengthens it by the engines'
busy share while it ran. Not modelled: importance-sampling masks, several updates per step
(the per-token rate covers a step), the weights themselves (``state_dict`` is empty, so
weight sync moves nothing and its time is the engines' ``weight_sync_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rollstream.sim.profile import TrainerCost
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, KeptTokens, SampleStatus, StepResult


class SimTrainer:
    def __init__(self, cost: TrainerCost, *, devices: int, policy: StalenessPolicy,
                 token_block: int) -> None:
        self.cost, self.devices, self.policy, self.block = cost, devices, policy, token_block
        self.trained_tokens = 0  # real tokens (prompt + kept response) of every step
        self.num_steps = 0
        self._pending_s = 0.0

    def step(self, groups: Sequence[Group], step: int) -> StepResult:
        kept: dict[str, KeptTokens] = {}
        tokens = 0
        for group in groups:
            for s in group.samples:
                if s.status is not SampleStatus.GRADED:
                    continue
                by_age = self.policy.kept_tokens(s, step)
                n = by_age.num_tokens
                kept[s.uid] = by_age if n else replace(
                    by_age, reason="every token older than max_token_age")
                if n:
                    tokens += (n + len(s.task.prompt_ids)) * self.block
        step_s = self.cost.step_s(tokens, self.devices)
        self._pending_s += step_s
        self.trained_tokens += tokens
        self.num_steps += 1
        return StepResult(metrics={"sim_train_step_s": step_s}, kept=kept)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def take_elapsed(self) -> float:
        """Virtual seconds the steps since the last call cost (the executor charges them)."""
        s, self._pending_s = self._pending_s, 0.0
        return s
