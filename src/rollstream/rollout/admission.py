"""Admission control: a staleness capacity in the spirit of AReaL.

Counted in groups. With ``G`` groups per trainer step, staleness bound ``k`` and the engines
serving weight version ``v``, a new group may start only while

    live_or_trained_groups < (v + k + 1) * G

where groups that were filtered, failed or dropped are retired and stop counting. Groups are
admitted in order, and each step consumes ``G``, so a group admitted under ``v`` is trained by
step ``v + k`` at the latest unless something overtakes it; what does overtake it is caught by
the buffer's hard check and becomes DROPPED_STALE, never trained.

The time admission spends waiting because the staleness limit is reached (not the run's
total) is ``blocked_s``: a run whose admission is blocked most of the time is bound by its
staleness bound, not by its engines or trainer (``bench modes``' ``staleness_blocked``).

``k = 0`` is exactly synchronous, on-policy RL: one batch is generated under ``v`` (filtered
groups are replaced under ``v`` too), then nothing starts until ``v + 1`` is served. ``k = 1``
is one-step off-policy: the capacity grows by one batch per served version, so the rollout of
step s+1 runs while step s trains.
"""

from __future__ import annotations

import asyncio


class StalenessCapacity:
    def __init__(self, *, groups_per_step: int, max_staleness: int,
                 total_groups: int | None = None) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError("groups_per_step must be >= 1 and max_staleness >= 0")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.total_groups = total_groups  # the run needs no more than this many trained groups
        self.num_admitted = 0
        self.num_retired = 0
        self._version = 0
        self._changed = asyncio.Event()
        self.blocked_s = 0.0  # event-loop seconds waited with the staleness limit reached

    @property
    def staleness_limit(self) -> int:
        """``(v + k + 1) * G``: what the staleness bound allows, before the run's total."""
        return (self._version + self.max_staleness + 1) * self.groups_per_step

    @property
    def limit(self) -> int:
        limit = self.staleness_limit
        return limit if self.total_groups is None else min(limit, self.total_groups)

    @property
    def num_counted(self) -> int:
        return self.num_admitted - self.num_retired

    @property
    def staleness_full(self) -> bool:
        """No room, and the staleness limit (not the run's total) is what stops admission."""
        return self.room() == 0 and (self.total_groups is None
                                     or self.staleness_limit < self.total_groups)

    def room(self) -> int:
        """Groups that may be admitted now."""
        return max(self.limit - self.num_counted, 0)

    def admit(self, n: int = 1) -> None:
        assert n <= self.room(), "admitted past the staleness capacity"
        self.num_admitted += n

    def retire(self, n: int = 1) -> None:
        """Groups that will never be trained (filtered, failed, dropped) free their place."""
        self.num_retired += n
        self.wake()

    def set_max_staleness(self, max_staleness: int) -> None:
        """A reconfigured bound: the limit moves at once. When it shrinks, groups already
        admitted above the new limit are not taken back; nothing starts until they are
        trained or retired."""
        assert max_staleness >= 0
        self.max_staleness = max_staleness
        self.wake()

    def set_version(self, version: int) -> None:
        """The engines now serve ``version``."""
        assert version >= self._version
        self._version = version
        self.wake()

    async def wait_changed(self) -> None:
        """Until the room may have changed (a retire, a new version, or :meth:`wake`); the
        wait counts in ``blocked_s`` when it began with the staleness limit reached."""
        loop = asyncio.get_running_loop()
        full, t0 = self.staleness_full, loop.time()
        await self._changed.wait()
        self._changed.clear()
        if full:
            self.blocked_s += loop.time() - t0

    def wake(self) -> None:
        self._changed.set()
