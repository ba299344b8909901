"""Stopping likely zero-variance groups early (``rollout.early_stop``; docs/data.md).

Of the generation a run spends, the groups filtered for zero variance are all waste, and
whether a group will be one shows before it ends: its samples share a task, so their
outcomes are correlated. A group's samples all run at once as always; as each is graded,
:class:`EarlyStop` judges whether the ones not graded yet would agree with those that were,
and if that is likely enough the rollout cancels them (interrupted at a token boundary, never
resubmitted) and files the group FILTERED as zero variance. What it saves is the rest of the
group's slowest samples, which are also a step's tail.

How likely, it measures, per source, on **witness** groups: a share of groups
(``witness_share``, chosen by a hash of the group id, so a rerun picks the same) that are
never stopped. For each witness whose first ``g`` graded samples (g from ``after`` to the
group size - 1) all passed, or all failed, it counts whether the others did the same; the
chance that a stopped group's others would agree is that count's share (with half a count
of prior each way), in the cell (source, all passed or all failed, g). The first samples
graded are the first to finish, and where short responses pass more often than long ones
(a capped response fails) a model of exchangeable samples (a beta-binomial on the pass
rate) is wrong in a way that matters: measured in the simulator, it stopped groups whose
slow samples would have varied, and generation per trained token rose (docs/data.md). The
witnesses measure the chance in the order samples actually finish.

A group is stopped when the chance is above ``stop_above`` and its cell has at least
``min_groups`` witnesses; ``1 - chance`` is the chance that it would have trained, and the
sum over stopped groups is the informative groups the rule is expected to lose
(``early_stopped_lost_groups``). A reward above 0.5 is a pass; only rewards of exactly 1
or 0 count as all passed or all failed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from rollstream.config.early_stop import EarlyStopConfig
from rollstream.trajectory import Group, Sample, SampleStatus


@dataclass(slots=True, frozen=True)
class Stop:
    """Why a group stopped early, and the measured chance that its ungraded samples would
    have agreed with its graded ones (``1 - chance``: that it would have trained)."""

    reason: str
    chance: float


class EarlyStop:
    """The rule of one run (``rollout.early_stop``); off when ``cfg.after`` is 0."""

    def __init__(self, cfg: EarlyStopConfig, group_size: int) -> None:
        self.cfg, self.group_size = cfg, group_size
        # (source, outcome 0|1, g) -> [witnesses whose first g agreed, whose rest agreed too]
        self._cells: dict[tuple[str, int, int], list[int]] = {}
        self._graded: dict[str, list[float] | None] = {}  # group id -> rewards (None: failed)

    def is_witness(self, group_id: str) -> bool:
        """Whether the group runs whole to measure the rule (a fixed share, by its id)."""
        return zlib.crc32(group_id.encode()) % 10_000 < self.cfg.witness_share * 10_000

    def graded(self, group: Group, sample: Sample) -> Stop | None:
        """``sample`` of ``group`` was graded (or failed grading): whether to cancel the
        group's samples not graded yet. A group with a sample that failed, or a witness,
        is never stopped."""
        gid = group.group_id
        rewards = self._graded.setdefault(gid, [])
        if rewards is None:
            return None
        if sample.status is not SampleStatus.GRADED:
            self._graded[gid] = None
            return None
        rewards.append(float(sample.reward or 0.0))
        g, left = len(rewards), self.group_size - len(rewards)
        if g < self.cfg.after or left == 0 or self.is_witness(gid):
            return None
        chance = self.chance_rest_agrees(group.task.source, rewards)
        if chance is None or chance <= self.cfg.stop_above:
            return None
        return Stop(f"stopped early: its first {g} rewards were all {rewards[0]:g}, and the "
                    f"other {left} would agree with probability {chance:.2f} (measured; > "
                    f"rollout.early_stop.stop_above {self.cfg.stop_above:g})", chance)

    def chance_rest_agrees(self, source: str, rewards: list[float]) -> float | None:
        """The measured chance that a group's samples after ``rewards`` (its first graded,
        in order) all agree with them; None when they are not all 1 or all 0, or fewer than
        ``min_groups`` witnesses were measured for that case."""
        if len(set(rewards)) != 1 or rewards[0] not in (0.0, 1.0):
            return None
        seen, agreed = self._cells.get((source, int(rewards[0]), len(rewards)), (0, 0))
        if seen < self.cfg.min_groups:
            return None
        return (agreed + 0.5) / (seen + 1)

    def ended(self, group: Group) -> None:
        """``group``'s generation is over: a witness graded whole is measured."""
        rewards = self._graded.pop(group.group_id, None)
        if rewards is None or len(rewards) != self.group_size or \
                not self.is_witness(group.group_id):
            return
        for g in range(self.cfg.after, self.group_size):
            first = rewards[:g]
            if len(set(first)) != 1 or first[0] not in (0.0, 1.0):
                break  # they varied: so does every longer prefix
            cell = self._cells.setdefault((group.task.source, int(first[0]), g), [0, 0])
            cell[0] += 1
            cell[1] += all(r == first[0] for r in rewards[g:])

    def state(self) -> list[list[Any]]:
        return [[src, v, g, seen, agreed] for (src, v, g), (seen, agreed) in self._cells.items()]

    def restore(self, state: list[list[Any]]) -> None:
        self._cells = {(src, v, g): [seen, agreed] for src, v, g, seen, agreed in state}
