"""Operating a running job from outside its event loop: list the engines, drain one
(preemption: its requests continue elsewhere from their tokens), route to it again, add
engines and remove one (``runtime/fleet.py``: a removed engine drains, then is closed and its
resources released).

:class:`EngineControl` is thread-safe: each call runs on the run's event loop (the
dispatcher's owner) and waits for the answer. The live dashboard serves it over HTTP on
127.0.0.1 (``/api/engines``, docs/monitoring.md) and ``rollstream engines RUN_DIR --drain ID``
(``--add N``, ``--remove ID``) calls that route.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollstream.runtime.fleet import Fleet

CALL_TIMEOUT_S = 60.0  # a drain waits for its engine to hand back every request
JOIN_TIMEOUT_S = 600.0  # an engine that joins starts (a vLLM server, an actor) and loads weights


class EngineControl:
    def __init__(self, fleet: Fleet, loop: asyncio.AbstractEventLoop) -> None:
        self._fleet, self._loop = fleet, loop

    def _call(self, coro: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def engines(self) -> list[dict[str, Any]]:
        """Each engine's id, health (and why), version, routing state (and why), requests
        in flight (``Router.table``) and membership (``Fleet.table``)."""
        async def read() -> list[dict[str, Any]]:
            return self._fleet.table()
        return self._call(read())

    def nodes(self) -> list[dict[str, Any]]:
        """The engines by node, with their weight syncs (``Fleet.nodes``)."""
        async def read() -> list[dict[str, Any]]:
            return self._fleet.nodes()
        return self._call(read())

    def drain(self, engine_id: str) -> int:
        """Take ``engine_id`` out of routing; returns the requests it handed back
        (ValueError: no such engine)."""
        return self._call(self._fleet.dispatcher.drain(engine_id))

    def undrain(self, engine_id: str) -> None:
        async def undo() -> None:
            self._fleet.dispatcher.undrain(engine_id)
        self._call(undo())

    def add(self, count: int) -> list[str]:
        """Add ``count`` engines; their ids once they serve (``Fleet.add``)."""
        return self._call(self._fleet.add(count), JOIN_TIMEOUT_S)

    def remove(self, engine_id: str) -> int:
        """Drain, then close ``engine_id``; the requests it handed back (``Fleet.remove``)."""
        return self._call(self._fleet.remove(engine_id), CALL_TIMEOUT_S * 2)
