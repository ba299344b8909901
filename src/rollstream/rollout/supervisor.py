"""The engine supervisor: engines whose serving loop died are restarted at the current weights.

A local engine whose step loop raised returns its requests' partial tokens (the dispatcher
resubmits them on another engine, or waits while none is UP) and is RECOVERING while it has
restarts left (``engine.local.max_restarts``). The supervisor notices it and has weight sync
revive it (:meth:`WeightSync.revive`: fresh cache and thread, the version the other engines
serve, under the same lock as weight loads); it is then UP and takes work again. An engine
actor of the Ray runtime that died is revived the same way (a new actor replaces it,
``runtime/ray/engines.py``). A vLLM engine restarts its own server and is not this module's
business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollstream.clock import Clock, WallClock
from rollstream.engine.protocol import Engine, Restartable
from rollstream.sync.weights import WeightSync

log = logging.getLogger(__name__)
POLL_S = 0.2


class EngineSupervisor:
    def __init__(self, engines: list[Engine], sync: WeightSync, *,
                 on_restart: Callable[[str, float], None] | None = None,
                 clock: Clock | None = None) -> None:
        self.engines = engines  # the run's roster (runtime/fleet.py adds and removes)
        self.sync = sync
        self.on_restart = on_restart or (lambda engine_id, seconds: None)
        self.num_restarts = 0
        self.clock = clock or WallClock()

    async def run(self) -> None:
        """The supervision loop (a named task of the controller)."""
        while True:
            for engine in list(self.engines):  # the roster may change while one revives
                if isinstance(engine, Restartable) and engine.needs_restart():
                    await self._revive(engine)
            await asyncio.sleep(POLL_S)

    async def _revive(self, engine: Restartable) -> None:
        t0 = self.clock.now()
        try:
            await self.sync.revive(engine)
        except Exception:  # fault boundary: it stays down (its restart budget was spent)
            log.exception("restarting engine %s failed", getattr(engine, "engine_id", "?"))
            return
        self.num_restarts += 1
        self.on_restart(getattr(engine, "engine_id", "?"), self.clock.now() - t0)
