"""``ServerHealth``: whether a vLLM engine's server is UP, RECOVERING or DEAD, and the watch,
fault and restart that move it between them. It runs on the engine's I/O loop and is the
only place that changes that state.

    watch: process alive? /health every period_s --fault--> cut in-flight streams (engine)
                                                            recover: restart (engine), UP
                                                                     or, if it fails, DEAD

A server whose process exits or whose /health fails three times in a row (10 s timeout
each: a busy server on a loaded machine answers slowly; a check that raises anything else
counts as a failure, logged with its cause) is declared dead: in-flight
``generate`` calls return ABORT with their partial output and ``error`` saying the engine
died (the rollout layer requeues them); the engine restarts the server (or, attached,
waits for it), restores the latest synced weights from shared memory and their version
label, then serves again; new requests wait meanwhile (``stats().health`` is RECOVERING).
A failed restart, or ``close``, leaves the engine DEAD for good: later requests return ABORT
with the reason (bad prompts still return ERROR: they are the request's fault), ``interrupt``
does nothing and ``load_weights`` raises RuntimeError. ``num_restarts`` counts restarts.

A restart holds ``control``, the lock a weight reload also holds: the server is restarted
or reloaded, never both at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rollstream.engine.states import EngineHealth
from rollstream.engine.vllm.server import ServerProcess

log = logging.getLogger(__name__)
HEALTH_FAILURES_TO_DIE = 3
HEALTH_TIMEOUT_S = 10.0


class ServerHealth:
    """The health of one engine's server. ``probe`` asks /health once (True: it answered
    200), ``drop_streams(cut)`` cuts every in-flight stream of the engine with that reason,
    ``restart`` restarts the server and restores its weights (raising if it cannot)."""

    def __init__(self, *, engine_id: str, server: ServerProcess, period_s: float,
                 probe: Callable[[], Awaitable[bool]], drop_streams: Callable[[str], None],
                 restart: Callable[[], Awaitable[None]]) -> None:
        self.engine_id = engine_id
        self.server = server
        self.num_restarts = 0
        self.closed = False
        self.fatal: str | None = None  # why the engine is DEAD
        self.fault_reason: str | None = None  # why it is RECOVERING
        self.recovering: asyncio.Task | None = None
        self.ready = asyncio.Event()  # set while the server can serve (or the engine is DEAD)
        self.control = asyncio.Lock()  # held by a restart or a weight reload
        self._period_s = period_s
        self._probe, self._drop_streams, self._restart = probe, drop_streams, restart
        self._watch_task: asyncio.Task | None = None

    def status(self) -> tuple[EngineHealth, str | None]:
        """The health and why it is not UP (any thread)."""
        if self.fatal is not None or self.closed:
            return EngineHealth.DEAD, self.fatal or f"vllm engine {self.engine_id} closed"
        if self.recovering is not None:
            return EngineHealth.RECOVERING, self.fault_reason
        return EngineHealth.UP, None

    def start(self) -> None:
        """The server is up: serve, and watch it."""
        self.ready.set()
        self._watch_task = asyncio.create_task(self._watch())

    def close(self) -> None:
        """DEAD for good: stop watching and recovering; requests waiting for a recovery
        return ABORT now."""
        self.closed = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.recovering is not None:
            self.recovering.cancel()
        self.fatal = f"vllm engine {self.engine_id} closed"
        self.ready.set()

    async def serving(self) -> str | None:
        """Wait while a recovery runs; the reason the engine cannot serve, if any."""
        await self.ready.wait()
        return self.fatal

    async def is_dead(self) -> bool:
        """After a failed stream: has the server died (exited, or /health keeps failing)? A
        busy server on a loaded machine answers slowly, so one slow probe is not death."""
        if self.recovering is not None or not self.server.alive():
            return True
        return not (await self._probe() or await self._probe())

    def fault(self, reason: str) -> None:
        """Cut every in-flight stream and start one recovery (idempotent while recovering)."""
        if self.recovering is not None or self.closed:
            return
        log.warning("vllm engine %s died: %s; restarting", self.engine_id, reason)
        self.fault_reason = f"vllm engine {self.engine_id} died ({reason}); restarting"
        self.num_restarts += 1
        self.ready.clear()
        self._drop_streams(f"died: {reason}")
        self.recovering = asyncio.create_task(self._recover(reason))

    async def _watch(self) -> None:
        """Declare the server dead when its process exits or /health fails 3 times in a row.
        A check that raises anything (a bug, a reply that does not parse) is a failed probe,
        logged with its traceback: the watch never ends while the engine lives, so an engine
        is never left UP and unwatched."""
        failures, last_probe = 0, 0.0
        while True:
            await asyncio.sleep(0.5)
            if self.recovering is not None or self.fatal is not None:
                continue
            try:
                if not self.server.alive():
                    self.fault(self.server.exit_reason())
                    continue
                if time.monotonic() - last_probe < self._period_s:
                    continue
                healthy = await self._probe()
            except Exception:  # fault boundary: counted as a failed probe, with its cause
                log.exception("vllm engine %s: its health check raised; counted as a failed "
                              "probe", self.engine_id)
                healthy = False
            failures = 0 if healthy else failures + 1
            last_probe = time.monotonic()
            if failures >= HEALTH_FAILURES_TO_DIE:
                failures = 0
                self.fault(f"/health failed {HEALTH_FAILURES_TO_DIE} times in a row")

    async def _recover(self, reason: str) -> None:
        async with self.control:
            try:
                await self._restart()
            except Exception as e:  # fault boundary: the engine is DEAD, requests get ABORT
                self.fatal = f"vllm engine {self.engine_id} died ({reason}) and could not " \
                             f"be restarted: {e}"
                log.error(self.fatal)
            finally:
                self.recovering = self.fault_reason = None
                self.ready.set()
