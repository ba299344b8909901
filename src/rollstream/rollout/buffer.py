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

from rollstream.rollout.staleness import StalenessPolicy, Verdict
from rollstream.trajectory import Group

_OK = Verdict(ok=True)


def _age_key(group: Group) -> int:
    v = group.min_version()
    return 0 if v is None else v


class TrajectoryBuffer:
    def __init__(self, policy: StalenessPolicy) -> None:
        self.policy = policy
        self._groups: list[Group] = []
        self._changed = asyncio.Event()
        self._ok_at: dict[str, int] = {}  # group id -> the step it was last judged trainable at

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[Group]:
        """The buffered groups (a copy of the list)."""
        return list(self._groups)

    def put(self, group: Group) -> None:
        self._groups.append(group)
        self.notify()

    def notify(self) -> None:
        """Wake whoever waits in :meth:`wait_changed`."""
        self._changed.set()

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def pop_stale(self, step: int) -> list[tuple[Group, Verdict]]:
        """Remove and return the groups that may not train at ``step``, with their verdicts."""
        judged = [(g, _OK if self._ok_at.get(g.group_id) == step
                   else self.policy.group_verdict(g, step)) for g in self._groups]
        self._groups = [g for g, v in judged if v.ok]
        self._ok_at = {g.group_id: step for g in self._groups}
        return [(g, v) for g, v in judged if not v.ok]

    def pop_batch(self, n: int) -> list[Group] | None:
        """The ``n`` oldest groups, or None while fewer are buffered."""
        if len(self._groups) < n:
            return None
        self._groups.sort(key=_age_key)
        batch, self._groups = self._groups[:n], self._groups[n:]
        return batch

    def drain(self) -> list[Group]:
        out, self._groups = self._groups, []
        return out
