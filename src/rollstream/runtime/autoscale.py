"""The autoscaler (``runtime.autoscale``): engines added while requests wait for engine slots,
removed while the engines idle behind the staleness bound, one change per window at most.

:class:`AutoscalePolicy` alone decides; it reads time from the run's clock and the signals it
is handed, so it runs on a fake clock in tests and on simulated time alike:

* grow (+1) when requests have waited for an engine slot for ``grow_after_s`` without a
  break, below ``max_engines``;
* shrink (-1) when, over the last ``window_s``, the engines' busy share (forward-pass
  seconds per engine-second) is below ``shrink_busy_below`` while admission is blocked by the
  staleness capacity (the engines wait for the trainer: fewer serve as much), above
  ``min_engines``;
* nothing else, and nothing within ``window_s`` of the last change; after a change the waiting
  time and the busy window start again (they described another roster).

:class:`Autoscaler` is the controller's loop around it: every ``POLL_S`` it reads the signals
from the dispatcher and the rollout, and acts through :class:`~rollstream.runtime.fleet.Fleet`
(the path ``rollstream engines --add / --remove`` takes). Shrinking removes the engine with the
fewest requests in flight (the newest among equals).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from rollstream.clock import Clock
from rollstream.config.runtime import AutoscaleConfig
from rollstream.engine.states import EngineHealth
from rollstream.monitor.rollout_meter import busy_by_engine, busy_share
from rollstream.rollout.admission import StalenessCapacity
from rollstream.runtime.fleet import Fleet

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the autoscaler reads its signals (its decisions are seconds apart)


@dataclass(slots=True, kw_only=True, frozen=True)
class Signals:
    """What the policy reads at one moment."""

    num_engines: int  # engines in the roster that are not leaving
    waiting: bool  # requests wait for an engine slot now
    staleness_blocked: bool  # admission is blocked by the staleness capacity now
    busy_s: dict[str, float]  # each engine's forward-pass seconds so far, by engine id


class AutoscalePolicy:
    def __init__(self, cfg: AutoscaleConfig, clock: Clock) -> None:
        self.cfg, self.clock = cfg, clock
        self._waiting_since: float | None = None
        self._busy: deque[tuple[float, dict[str, float]]] = deque()  # (time, busy) readings
        self._last_change: float | None = None
        self.reason = ""  # why the last change was made

    def busy_share(self) -> float | None:
        """The engines' busy share over the last ``window_s``; None until a window is full."""
        if not self._busy:
            return None
        (t0, first), (t1, last) = self._busy[0], self._busy[-1]
        return busy_share(first, last, t1 - t0) if t1 - t0 >= self.cfg.window_s else None

    def decide(self, s: Signals) -> int:
        """+1 (add an engine), -1 (remove one) or 0, given the signals now."""
        now, cfg = self.clock.now(), self.cfg
        self._waiting_since = (self._waiting_since if self._waiting_since is not None
                               else now) if s.waiting else None
        self._busy.append((now, dict(s.busy_s)))
        while len(self._busy) > 1 and now - self._busy[1][0] >= cfg.window_s:
            self._busy.popleft()  # the oldest reading that still spans the window stays
        if self._last_change is not None and now - self._last_change < cfg.window_s:
            return 0
        waited = now - self._waiting_since if self._waiting_since is not None else 0.0
        if waited >= cfg.grow_after_s and s.num_engines < cfg.max_engines:
            return self._changed(now, +1, f"requests waited {waited:.1f} s for an engine slot")
        share = self.busy_share()
        if (s.staleness_blocked and share is not None and share < cfg.shrink_busy_below
                and s.num_engines > cfg.min_engines):
            return self._changed(now, -1, f"engines busy {share:.0%} of the last "
                                          f"{cfg.window_s:g} s while the staleness bound "
                                          "blocked admission")
        return 0

    def _changed(self, now: float, change: int, reason: str) -> int:
        self._last_change, self.reason = now, reason
        self._waiting_since = None
        self._busy.clear()
        return change


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy, fleet: Fleet, capacity: StalenessCapacity
                 ) -> None:
        self.policy, self.fleet, self.capacity = policy, fleet, capacity

    def signals(self) -> Signals:
        """The signals now: the dispatch queue's waiters or the engines' own queues, the
        staleness capacity, the engines' busy seconds."""
        dispatcher = self.fleet.dispatcher
        stats = [e.stats() for e in self.fleet.engines]
        queued = dispatcher.queue.num_waiting if dispatcher.queue is not None else 0
        return Signals(
            num_engines=len(stats) - len(self.fleet.leaving),
            waiting=queued + sum(st.num_waiting for st in stats) > 0,
            staleness_blocked=self.capacity.staleness_full,
            busy_s=busy_by_engine(stats))

    async def run(self) -> None:
        """The autoscaling loop (a named task of the controller)."""
        while True:
            await self.policy.clock.sleep(POLL_S)
            change = self.policy.decide(self.signals())
            if change:
                await self._apply(change)

    async def _apply(self, change: int) -> None:
        try:
            if change > 0:
                added = await self.fleet.add(1)
                log.info(f"autoscale: added {added[0]}: {self.policy.reason}")
            else:
                victim = self._victim()
                await self.fleet.remove(victim)
                log.info(f"autoscale: removed {victim}: {self.policy.reason}")
        except Exception:  # noqa: BLE001 - fault boundary: the run goes on with its engines
            log.exception("autoscale: the change (%+d engine) failed", change)

    def _victim(self) -> str:
        """The engine with the fewest requests in flight, the newest among equals."""
        router, leaving = self.fleet.dispatcher.router, self.fleet.leaving
        serving = [e for e in self.fleet.engines if e.engine_id not in leaving
                   and e.stats().health is not EngineHealth.DEAD]
        return min(reversed(serving), key=lambda e: router.load[e]).engine_id
