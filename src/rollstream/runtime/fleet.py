"""Engines that join and leave a live run: the one owner of the run's engine roster.

The roster is one list, shared by the dispatcher's router, weight sync, the supervisor and
the meters; only :class:`Fleet` changes it, through the router (:meth:`Router.join`,
:meth:`Router.leave`) under weight sync's lock (:meth:`WeightSync.admit`, ``release``).
``rollstream engines RUN --add N / --remove ID`` (the dashboard's API, ``runtime/control.py``)
and the autoscaler (``runtime/autoscale.py``) both act through :meth:`Fleet.add` and
:meth:`Fleet.remove`.

Joining (:meth:`add`): the engine is built the way the run built its engines (``make``, from
``runtime/build.py``: a local engine in this process, or an engine actor on Ray), off the
event loop; then, under the lock of weight loads, it loads the version the other engines serve
and enters the roster, so its first request's tokens carry the current version and every
later load reaches it. Ids continue after the highest given and are never reused.

Leaving (:meth:`remove`): the engine is drained (``Dispatcher.drain``: its requests are
interrupted at a token boundary and continue on other engines from their tokens), then, once
nothing is in flight on it, taken out of the roster between two loads and closed: a local
engine's thread ends, an engine actor is killed and its CPUs go back to Ray. The run's last
engine cannot be removed (nothing could serve its requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from rollstream.engine.protocol import Closeable, Engine, Joins
from rollstream.engine.states import EngineHealth
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.runtime.nodes import engine_node, node_columns, nodes_view
from rollstream.sync.weights import WeightSync, transport_of

log = logging.getLogger(__name__)
MAX_ADD = 16  # engines one call may add
LEAVE_POLL_S = 0.02  # how often a leaving engine is looked at until nothing runs on it
LEAVE_TIMEOUT_S = 60.0  # a leaving engine's requests must have come back by then

MakeEngine = Callable[[int], Engine]
"""Blocking: the run's engine number ``index`` (its id is the runtime's name for it), started
from the run's first weights and tagged with their version, as the run built the others."""


class Refused(ValueError):
    """A change the roster cannot take now (HTTP 409 on the dashboard)."""

    http_status = 409


class Fleet:
    def __init__(self, *, dispatcher: Dispatcher, sync: WeightSync, make: MakeEngine | None,
                 on_change: Callable[[int], None] | None = None) -> None:
        """``make``: builds a joining engine (None: this run cannot add engines, e.g. tests'
        own engines); ``on_change(num_engines)`` hears of every join and leave."""
        self.dispatcher, self.sync, self.make = dispatcher, sync, make
        self.on_change = on_change or (lambda n: None)
        self.engines = dispatcher.engines  # the roster
        self._next_index = len(self.engines)
        self.joining: set[str] = set()  # being built or loading weights, not yet routed
        self.leaving: set[str] = set()  # draining, then closing
        self.left: list[Engine] = []  # closed; their stats stay readable (the run's totals)

    async def add(self, n: int) -> list[str]:
        """Add ``n`` engines (1..MAX_ADD); returns their ids once each serves the current
        version and takes requests."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ADD:
            raise Refused(f"count must be an integer from 1 to {MAX_ADD}, got {n!r}")
        if self.make is None:
            raise Refused("this run cannot add engines: it was given its engines, or attached "
                          "to servers it did not start (engine.vllm.urls)")
        indices = [self._take_index() for _ in range(n)]
        return list(await asyncio.gather(*(self._join(i) for i in indices)))

    def _take_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    async def _join(self, index: int) -> str:
        assert self.make is not None
        engine = await asyncio.to_thread(self.make, index)
        engine_id = engine.engine_id
        self.joining.add(engine_id)
        try:
            if engine_id in self.dispatcher.router.by_id:
                raise AssertionError(f"engine id {engine_id} is taken")
            await self.sync.admit(engine, self.dispatcher.router.join)
        except BaseException:
            await _close(engine)
            raise
        finally:
            self.joining.discard(engine_id)
        if self.dispatcher.queue is not None:
            self.dispatcher.queue.wake()
        log.info(f"engine {engine_id} joined at version {self.sync.version}")
        self.on_change(len(self.engines))
        return engine_id

    async def remove(self, engine_id: str) -> int:
        """Drain ``engine_id``, take it out of the run and close it; returns the requests it
        handed back. ValueError: no such engine; :class:`Refused`: it is leaving already, or
        it is the last engine that serves."""
        engine = self.dispatcher.router.engine(engine_id)
        if engine_id in self.leaving:
            raise Refused(f"engine {engine_id} is leaving already")
        others = [e for e in self.engines if e is not engine and e.engine_id not in self.leaving
                  and e.stats().health is not EngineHealth.DEAD]
        if not others:
            raise Refused(f"engine {engine_id} is the run's last live engine: add one first")
        self.leaving.add(engine_id)
        try:
            handed_back = await self.dispatcher.drain(engine_id)
            await self._until_idle(engine)
            await self.sync.release(engine, self._leave)
        finally:
            self.leaving.discard(engine_id)
        await _close(engine)
        self.left.append(engine)
        log.info(f"engine {engine_id} left ({handed_back} requests handed back)")
        self.on_change(len(self.engines))
        return handed_back

    async def _until_idle(self, engine: Engine) -> None:
        """Until no request runs on ``engine``: one that took it between the drain and now
        (a dispatch-queue grant made before it) is interrupted too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LEAVE_TIMEOUT_S
        while ids := [rid for rid, f in self.dispatcher.in_flight.items() if f.engine is engine]:
            if loop.time() > deadline:
                raise RuntimeError(f"engine {engine.engine_id}: requests {ids} did not come "
                                   f"back within {LEAVE_TIMEOUT_S:g} s of its drain")
            if engine.stats().health is not EngineHealth.DEAD:
                await engine.interrupt(ids)
            await asyncio.sleep(LEAVE_POLL_S)

    def _leave(self, engine: Engine) -> None:
        self.dispatcher.router.leave(engine)
        if self.dispatcher.queue is not None:
            self.dispatcher.queue.forget(engine)

    def every_engine(self) -> list[Engine]:
        """The roster and the engines that left it: the run's work was done by all of them."""
        return [*self.engines, *self.left]

    def table(self) -> list[dict[str, Any]]:
        """The router's table (``Router.table``) with each engine's membership: ``serving``,
        ``leaving`` (draining, then closing), and a row for each engine ``joining`` (built,
        loading the current version); and each engine's node and weight syncs
        (``runtime/nodes.py``, :meth:`_synced`)."""
        by_id = self.dispatcher.router.by_id
        rows = [{**row, "member": "leaving" if row["engine_id"] in self.leaving else "serving",
                 **node_columns(engine_node(e := by_id[row["engine_id"]])), **self._synced(e)}
                for row in self.dispatcher.engine_table()]
        return rows + [{"engine_id": engine_id, "health": EngineHealth.RECOVERING.value,
                        "health_reason": "joining: loading the current version",
                        "version": self.sync.version, "routing": "drained",
                        "routing_reason": None, "in_flight": 0, "generated_tokens": 0,
                        "member": "joining",
                        **node_columns(None), **self._synced(None)}
                       for engine_id in sorted(self.joining)]

    def _synced(self, engine: Engine | None) -> dict[str, Any]:
        """What weight syncs moved to ``engine`` (``WeightSync.moved``): its transport, and
        of its last load the version, kind, bytes and dtype; its bytes and loads in total."""
        moved = None if engine is None else self.sync.moved.get(engine.engine_id)
        last = moved.last if moved is not None else None
        return {"transport": None if engine is None else transport_of(engine),
                "sync_version": last and last.version, "sync_kind": last and last.kind,
                "sync_bytes_last": last.num_bytes if last else 0,
                "sync_dtype": last and last.dtype,
                "sync_bytes_total": moved.total_bytes if moved else 0,
                "syncs": moved.loads if moved else 0}

    def nodes(self) -> list[dict[str, Any]]:
        """The engine table by node (``runtime/nodes.py``'s :func:`nodes_view`)."""
        return nodes_view(self.table())


async def _close(engine: Engine) -> None:
    """Close ``engine`` alone: an engine sharing run-wide parts leaves them open (``Joins``)."""
    if isinstance(engine, Joins):
        await engine.leave()
    elif isinstance(engine, Closeable):
        await engine.close()
