"""The dispatch queue: requests wait in the dispatcher for a free engine slot, in an order.

With ``rollout.dispatch: engine`` (no queue) every request goes to the least-loaded engine at
once and waits in that engine's own queue (first come, first served, bound to that engine).
With ``fifo`` or ``longest_first`` an engine gets at most ``stats().capacity`` requests (its
concurrent sequences); the others wait here and the next free slot, on whichever engine frees
it, goes to

* ``fifo``: the request that has waited longest;
* ``longest_first``: the request with the most predicted tokens left (``LengthPredictor``),
  so the long tail starts first and the short ones fill in behind it (LPT scheduling: a
  synchronous rollout's makespan is bounded by its longest request plus what was queued in
  front of it).

A free slot on several engines goes to the engine with the fewest predicted tokens
outstanding (balancing predicted load, not request counts). Late binding also means a request
never waits behind another engine's queue while a slot is free elsewhere.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Literal

from rollstream.engine.protocol import Engine

DispatchOrder = Literal["fifo", "longest_first"]


class DispatchQueue:
    def __init__(self, order: DispatchOrder, routable: Callable[[], list[Engine]]) -> None:
        if order not in ("fifo", "longest_first"):
            raise ValueError(f"dispatch order must be fifo or longest_first, got {order!r}")
        self.order = order
        self._routable = routable  # engines that may take requests now (UP, not drained)
        self._busy: dict[int, int] = {}  # id(engine) -> requests granted and not released
        self._work: dict[int, float] = {}  # id(engine) -> predicted tokens outstanding
        self._waiting: list[tuple[float, int, float, asyncio.Future[Engine | None]]] = []
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(not f.done() for *_, f in self._waiting)

    async def acquire(self, work: float) -> Engine | None:
        """A slot on an engine, held until :meth:`release`, for a request of ``work``
        predicted tokens; None when no engine is routable any more (the caller looks at
        engine health again)."""
        self._drop_done()
        if not self._waiting:
            engines = self._routable()
            free = self._free(engines)
            if free:
                return self._grant(free, work)
            if not engines:
                return None
        key = -work if self.order == "longest_first" else 0.0
        fut: asyncio.Future[Engine | None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (key, next(self._seq), work, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is not None:
                self.release(fut.result(), work)  # granted, but its waiter is gone
            raise

    def release(self, engine: Engine, work: float) -> None:
        """The request given ``engine`` for ``work`` tokens is over: its slot goes to the next
        waiter."""
        self._busy[id(engine)] -= 1
        self._work[id(engine)] -= work
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters in order (call when engines change: undrained,
        recovered); with no routable engine every waiter is woken with None."""
        engines = self._routable()
        while self._waiting:
            _, _, work, fut = self._waiting[0]
            if fut.done():
                heapq.heappop(self._waiting)
                continue
            if not engines:
                heapq.heappop(self._waiting)
                fut.set_result(None)
                continue
            free = self._free(engines)
            if not free:
                return
            heapq.heappop(self._waiting)
            fut.set_result(self._grant(free, work))

    def _free(self, engines: list[Engine]) -> list[Engine]:
        return [e for e in engines if self._busy.get(id(e), 0) < e.stats().capacity]

    def _grant(self, free: list[Engine], work: float) -> Engine:
        engine = min(free, key=lambda e: (self._work.get(id(e), 0.0), self._busy.get(id(e), 0)))
        self._busy[id(engine)] = self._busy.get(id(engine), 0) + 1
        self._work[id(engine)] = self._work.get(id(engine), 0.0) + work
        return engine

    def _drop_done(self) -> None:
        while self._waiting and self._waiting[0][3].done():
            heapq.heappop(self._waiting)
