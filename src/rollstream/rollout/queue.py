"""The dispatch queue: requests wait in the dispatcher for a free engine slot, in an order.

With ``rollout.dispatch: engine`` (no queue) every request goes to the least-loaded engine at
once and waits in that engine's own queue (first come, first served, bound to that engine).
With ``fifo`` or ``longest_first`` an engine gets at most ``stats().capacity`` requests (its
concurrent sequences); the others wait here and the next free slot, on whichever engine frees
it, goes to

* ``fifo``: the request that has waited longest;
* ``longest_first``: the request ranked highest by ``LengthPredictor.rank`` (the most tokens
  left, a group not heard from yet counting as long), so the long tail starts first and the
  short ones fill in behind it (LPT scheduling: a synchronous rollout's makespan is bounded
  by its longest request plus what was queued in front of it).

A free slot on several engines goes to the engine with the fewest predicted tokens
outstanding (balancing predicted load, not request counts), or, with prefix affinity, to the
one among them that holds the request's prefix (``Router.place``). Late binding also means a request
never waits behind another engine's queue while a slot is free elsewhere.

With ``rollout.concurrency: adaptive`` an engine's slots are not its capacity but the limit
its :class:`~rollstream.rollout.concurrency.ConcurrencyLimit` finds from the throughput it
measures (told at every release); a raised limit hands out the new slots at once. The router
may cap them further (a probing engine holds one request, ``rollout/breaker.py``).

A request retried after an engine fault names the engines that failed it (``avoid``): it
takes a slot elsewhere, waiting for one while another engine is routable, and a slot on one of
them only when every routable engine failed it. Other waiters may pass it meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

from rollstream.engine.protocol import Engine
from rollstream.rollout.concurrency import ConcurrencyLimit

DispatchOrder = Literal["fifo", "longest_first"]
Ask = tuple[tuple[float, ...], float]  # (rank: higher goes first, predicted tokens left)


LimitFactory = Callable[[int], ConcurrencyLimit]  # an engine's capacity -> its adaptive limit
# (the queue's choice, the engines with a free slot) -> the engine a request takes
Place = Callable[[Engine, list[Engine]], Engine]


class DispatchQueue:
    def __init__(self, order: DispatchOrder, routable: Callable[[], list[Engine]], *,
                 adaptive: LimitFactory | None = None,
                 now: Callable[[], float] | None = None,
                 cap: Callable[[Engine], int | None] | None = None) -> None:
        """``adaptive``: each engine's limit comes from the controller this makes from its
        capacity (None: the capacity); ``now``: the clock its windows are timed with;
        ``cap``: the router's cap on an engine's requests (None: no cap)."""
        if order not in ("fifo", "longest_first"):
            raise ValueError(f"dispatch order must be fifo or longest_first, got {order!r}")
        if adaptive is not None and now is None:
            raise ValueError("adaptive concurrency needs a clock (now)")
        self.order = order
        self._routable = routable  # engines that may take requests now (UP, routed)
        self._adaptive = adaptive
        self._now = now
        self._cap = cap
        self.limits: dict[str, ConcurrencyLimit] = {}  # engine_id -> its controller (adaptive)
        self._busy: dict[int, int] = {}  # id(engine) -> requests granted and not released
        self._work: dict[int, float] = {}  # id(engine) -> predicted tokens outstanding
        self._waiting: list[_Waiter] = []  # in arrival order

    @property
    def num_waiting(self) -> int:
        return sum(not w.fut.done() for w in self._waiting)

    async def acquire(self, ask: Callable[[], Ask], avoid: Collection[str] = (),
                      place: Place | None = None) -> Grant | None:
        """A slot on an engine, held until :meth:`release`, for a request whose rank and
        predicted tokens ``ask()`` tells (asked again whenever the order is decided: a
        prediction improves while the request waits, as its siblings finish), on an engine
        not in ``avoid`` (engine ids) while another is routable; None when no engine is
        routable any more (the caller looks at engine health again). ``place``: which of the
        usable free engines it takes, given the queue's choice (the router's prefix
        affinity); None: the queue's choice."""
        self._waiting = [w for w in self._waiting if not w.fut.done()]
        if not self._waiting:
            engines = self._routable()
            usable = _usable(self._free(engines), engines, avoid)
            if usable:
                return self._grant(self._placed(usable, place), ask()[1])
            if not engines:
                return None
        fut: asyncio.Future[Grant | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiter(ask=ask, fut=fut, avoid=frozenset(avoid), place=place))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and (grant := fut.result()) is not None:
                self.release(grant)  # granted, but its waiter is gone
            raise

    def release(self, grant: Grant) -> None:
        """The request holding ``grant`` is over: its slot goes to the next waiter (and,
        adaptive, its engine's controller measures the window so far)."""
        engine = grant.engine
        if self._adaptive is not None:
            self._limit(engine).observe(now_s=self._now(),  # type: ignore[misc]
                                        generated_tokens=engine.stats().generated_tokens,
                                        in_flight=self._busy[id(engine)])
        self._busy[id(engine)] -= 1
        self._work[id(engine)] -= grant.work
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters in order (call when engines change: undrained,
        recovered); with no routable engine every waiter is woken with None."""
        self._waiting = [w for w in self._waiting if not w.fut.done()]
        engines = self._routable()
        if not engines:
            for w in self._waiting:
                w.fut.set_result(None)
            self._waiting = []
            return
        while self._waiting:
            free = self._free(engines)
            if not free:
                return
            served = (j for j, w in enumerate(self._waiting)  # those a free slot may serve
                      if not w.avoid or _usable(free, engines, w.avoid))
            if self.order == "fifo":
                i = next(served, None)
                if i is None:
                    return
                work = self._waiting[i].ask()[1]
            else:  # the highest rank; the earliest among equals
                asked = {j: self._waiting[j].ask() for j in served}
                if not asked:
                    return
                i = max(asked, key=lambda j: (asked[j][0], -j))
                work = asked[i][1]
            w = self._waiting.pop(i)
            w.fut.set_result(self._grant(self._placed(_usable(free, engines, w.avoid), w.place),
                                         work))

    def forget(self, engine: Engine) -> None:
        """``engine`` left the run (nothing held on it): drop what was kept of it."""
        assert not self._busy.get(id(engine)), "an engine left with slots held"
        self._busy.pop(id(engine), None)
        self._work.pop(id(engine), None)
        self.limits.pop(engine.engine_id, None)

    def num_held(self, engine: Engine) -> int:
        """Requests granted on ``engine`` and not released."""
        return self._busy.get(id(engine), 0)

    def slots(self, engine: Engine) -> int:
        """The requests ``engine`` may hold now: its capacity, or its adaptive limit, within
        the router's cap."""
        capacity = engine.stats().capacity
        n = capacity if self._adaptive is None else min(capacity, self._limit(engine).limit)
        cap = self._cap(engine) if self._cap is not None else None
        return n if cap is None else min(n, cap)

    def _limit(self, engine: Engine) -> ConcurrencyLimit:
        limit = self.limits.get(engine.engine_id)
        if limit is None:
            limit = self.limits[engine.engine_id] = self._adaptive(  # type: ignore[misc]
                engine.stats().capacity)
        return limit

    def _free(self, engines: list[Engine]) -> list[Engine]:
        return [e for e in engines if self._busy.get(id(e), 0) < self.slots(e)]

    def _placed(self, free: list[Engine], place: Place | None) -> list[Engine]:
        """The free engines a request may take: all, or the one ``place`` picks."""
        return free if place is None else [place(self._least(free), free)]

    def _least(self, free: list[Engine]) -> Engine:
        """The free engine with the fewest predicted tokens outstanding (then requests)."""
        return min(free, key=lambda e: (self._work.get(id(e), 0.0), self._busy.get(id(e), 0)))

    def _grant(self, free: list[Engine], work: float) -> Grant:
        engine = self._least(free)
        self._busy[id(engine)] = self._busy.get(id(engine), 0) + 1
        self._work[id(engine)] = self._work.get(id(engine), 0.0) + work
        return Grant(engine, work)


def _usable(free: list[Engine], routable: list[Engine], avoid: Collection[str]) -> list[Engine]:
    """The free engines a request that avoids ``avoid`` may take now: those not in it; while
    a routable engine is not in it, only those (it waits for one); else any free one."""
    if not avoid:
        return free
    others = [e for e in free if e.engine_id not in avoid]
    if others or any(e.engine_id not in avoid for e in routable):
        return others
    return free


@dataclass(slots=True, kw_only=True)
class _Waiter:
    ask: Callable[[], Ask]  # what it asks, read when a slot is free
    fut: asyncio.Future[Grant | None]
    avoid: frozenset[str] = field(default_factory=frozenset)  # engine ids that failed it
    place: Place | None = None  # which free engine it takes (prefix affinity)


@dataclass(slots=True, frozen=True)
class Grant:
    """A slot on ``engine``, held for a request of ``work`` predicted tokens."""

    engine: Engine
    work: float
