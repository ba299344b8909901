"""The trajectory buffer: graded groups waiting for the trainer.

The rollout puts finished, trainable groups here and takes batches out for trainer step
``step``: :meth:`pop_stale` first removes the groups the staleness policy rejects at that step
(:meth:`StalenessPolicy.group_verdict`, returned with their verdicts to be recorded
DROPPED_STALE), then :meth:`pop_batch` hands out the oldest ``n``, so a group overtaken by
faster ones is trained before it ages out.

A buffered group is finished (its tokens no longer change), so its verdict at a step is
final: :meth:`pop_stale` judges each group once per step, not on every call (the rollout
calls it whenever a group arrives; re-judging every buffered group each time cost
O(groups^2 x tokens) per step, most of a 512-engine simulation's time).
"""

from __future__ import annotations

import asyncio

from rollstream.staleness import StalenessPolicy, Verdict
from rollstream.trajectory import Group


def _age_key(group: Group) -> int:
    v = group.min_version()
    return 0 if v is None else v


class TrajectoryBuffer:
    def __init__(self, policy: StalenessPolicy) -> None:
        self.policy = policy
        self._groups: list[Group] = []  # in arrival order (pop_batch sorts it by age)
        self._changed = asyncio.Event()
        self._judged_at: int | None = None  # the step the groups were judged at
        self._unjudged: list[Group] = []  # put since then

    def set_policy(self, policy: StalenessPolicy) -> None:
        """A new staleness policy (a reconfiguration): every group is judged again."""
        self.policy = policy
        self._judged_at = None

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[Group]:
        """The buffered groups (a copy of the list)."""
        return list(self._groups)

    def put(self, group: Group) -> None:
        self._groups.append(group)
        self._unjudged.append(group)
        self.notify()

    def notify(self) -> None:
        """Wake whoever waits in :meth:`wait_changed`."""
        self._changed.set()

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def pop_stale(self, step: int) -> list[tuple[Group, Verdict]]:
        """Remove and return the groups that may not train at ``step``, with their verdicts."""
        todo = self._unjudged if step == self._judged_at else self._groups
        judged = [(g, self.policy.group_verdict(g, step)) for g in todo]
        self._judged_at, self._unjudged = step, []
        stale = [(g, v) for g, v in judged if not v.ok]
        if stale:
            gone = {id(g) for g, _ in stale}
            self._groups = [g for g in self._groups if id(g) not in gone]
        return stale

    def pop_batch(self, n: int) -> list[Group] | None:
        """The ``n`` oldest groups, or None while fewer are buffered."""
        if len(self._groups) < n:
            return None
        self._groups.sort(key=_age_key)
        batch, self._groups = self._groups[:n], self._groups[n:]
        if self._unjudged:
            taken = {id(g) for g in batch}
            self._unjudged = [g for g in self._unjudged if id(g) not in taken]
        return batch

    def drain(self) -> list[Group]:
        out, self._groups, self._unjudged = self._groups, [], []
        return out
