"""Operating a running job from outside its event loop: list the engines, drain one
(preemption: its requests continue elsewhere from their tokens), route to it again.

:class:`EngineControl` is thread-safe: each call runs on the run's event loop (the
dispatcher's owner) and waits for the answer. The live dashboard serves it over HTTP on
127.0.0.1 (``/api/engines``, docs/monitoring.md) and ``rollstream engines RUN_DIR --drain ID``
calls that route.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollstream.rollout.dispatcher import Dispatcher

CALL_TIMEOUT_S = 60.0  # a drain waits for its engine to hand back every request


class EngineControl:
    def __init__(self, dispatcher: Dispatcher, loop: asyncio.AbstractEventLoop) -> None:
        self._dispatcher, self._loop = dispatcher, loop

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def engines(self) -> list[dict[str, Any]]:
        """Each engine's id, health (and why), version, routing state (and why) and requests
        in flight (``Router.table``)."""
        async def read() -> list[dict[str, Any]]:
            return self._dispatcher.engine_table()
        return self._call(read())

    def drain(self, engine_id: str) -> int:
        """Take ``engine_id`` out of routing; returns the requests it handed back
        (ValueError: no such engine)."""
        return self._call(self._dispatcher.drain(engine_id))

    def undrain(self, engine_id: str) -> None:
        async def undo() -> None:
            self._dispatcher.undrain(engine_id)
        self._call(undo())
