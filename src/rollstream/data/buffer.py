"""The trajectory buffer: graded groups waiting for the trainer.

``take`` forms a batch of ``n`` groups for trainer step ``step``: groups whose staleness
(step - oldest token version of any of their samples) exceeds ``max_staleness`` are returned
separately to be recorded DROPPED_STALE, never trained; of the rest the oldest go first, so a
group overtaken by faster ones is trained before it ages out.

With ``max_token_age`` (the trainer masks tokens older than ``step - max_token_age`` out of the
loss) only the tokens the loss keeps count: a group is stale when a kept token is older than
``max_staleness``, or when the loss would keep none of its tokens at all.
"""

from __future__ import annotations

import asyncio

from rollstream.trajectory import Group


def group_staleness(group: Group, step: int, max_token_age: int | None = None) -> int:
    return max((s.staleness(step, max_token_age) for s in group.samples if s.reward is not None),
               default=0)


def group_too_old(group: Group, step: int, max_token_age: int | None) -> bool:
    """A loss at ``step`` would keep none of the group's tokens (``max_token_age`` masks them)."""
    graded = [s for s in group.samples if s.reward is not None]
    return bool(graded) and all(s.too_old(step, max_token_age) for s in graded)


def group_is_stale(group: Group, step: int, max_staleness: int,
                   max_token_age: int | None = None) -> bool:
    return (group_too_old(group, step, max_token_age)
            or group_staleness(group, step, max_token_age) > max_staleness)


def group_min_version(group: Group) -> int:
    vs = [v for s in group.samples if (v := s.min_version()) is not None]
    return min(vs) if vs else 0


class TrajectoryBuffer:
    def __init__(self) -> None:
        self._groups: list[Group] = []
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Group) -> None:
        self._groups.append(group)
        self._changed.set()

    def pop_stale(self, step: int, max_staleness: int,
                  max_token_age: int | None = None) -> list[Group]:
        stale = [g for g in self._groups
                 if group_is_stale(g, step, max_staleness, max_token_age)]
        self._groups = [g for g in self._groups if g not in stale]
        return stale

    async def take(self, n: int, step: int, max_staleness: int,
                   max_token_age: int | None = None) -> tuple[list[Group], list[Group]]:
        """Wait until ``n`` fresh groups are ready; return (batch, stale groups removed)."""
        stale: list[Group] = []
        while True:
            stale += self.pop_stale(step, max_staleness, max_token_age)
            if len(self._groups) >= n:
                self._groups.sort(key=group_min_version)
                batch, self._groups = self._groups[:n], self._groups[n:]
                return batch, stale
            if stale:  # hand the stale ones back at once so their capacity is freed
                return [], stale
            self._changed.clear()
            await self._changed.wait()

    def drain(self) -> list[Group]:
        out, self._groups = self._groups, []
        return out
