"""Requests in flight per engine, and the least-loaded engine, without a scan of every engine.

Routing picks, for every request, the engine with the fewest requests in flight among those
that may take one, ties to the first in the dispatcher's engine order. Scanning every engine
per request costs engines x requests (at 512 simulated engines most of a simulation's time,
docs/simulator.md). Here a heap holds ``(load, engine index)`` entries: a change of load
pushes a fresh entry, and entries whose load is no longer the engine's are dropped when they
reach the top (lazy deletion; the heap is rebuilt when stale entries outnumber the engines
4 to 1). The least-loaded engine is the top valid entry that the caller's predicate admits;
the ones it refuses (drained, recovering) are put back. Same choice as ``min`` over the
engines in order, in O(log E) per change. An engine that joins a live run takes the next
index (:meth:`join`); one that leaves keeps its index as a tombstone whose load (``GONE``)
no heap entry matches, so its entries fall away as stale (:meth:`leave`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

E = TypeVar("E")
GONE = -1  # the load of a left engine: no heap entry (loads are >= 0) is ever valid for it


class LoadIndex(Generic[E]):
    def __init__(self, engines: Sequence[E]) -> None:
        self._engines = list(engines)
        self._pos = {id(e): i for i, e in enumerate(self._engines)}
        self._load = [0] * len(self._engines)
        self._heap = [(0, i) for i in range(len(self._engines))]

    def __getitem__(self, engine: E) -> int:
        return self._load[self._pos[id(engine)]]

    def join(self, engine: E) -> None:
        """``engine`` may be picked from now on (last in engine order)."""
        self._pos[id(engine)] = len(self._engines)
        self._engines.append(engine)
        self._load.append(0)
        heapq.heappush(self._heap, (0, len(self._engines) - 1))

    def leave(self, engine: E) -> None:
        """``engine`` is never picked again (its requests have ended)."""
        self._load[self._pos.pop(id(engine))] = GONE

    def add(self, engine: E, delta: int) -> None:
        i = self._pos[id(engine)]
        self._load[i] += delta
        heapq.heappush(self._heap, (self._load[i], i))
        if len(self._heap) > 4 * len(self._engines) + 64:
            self._heap = [(load, i) for i, load in enumerate(self._load) if load != GONE]
            heapq.heapify(self._heap)

    def least(self, admits: Callable[[E], bool]) -> E | None:
        """The least-loaded engine ``admits`` accepts (ties: engine order); None if none."""
        heap, refused, found = self._heap, [], None
        while heap:
            load, i = heap[0]
            if load != self._load[i]:  # stale
                heapq.heappop(heap)
                continue
            if admits(self._engines[i]):
                found = self._engines[i]
                break
            refused.append(heapq.heappop(heap))
        for entry in refused:
            heapq.heappush(heap, entry)
        return found
