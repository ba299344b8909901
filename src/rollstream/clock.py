"""Injected time: schedulers and the controller read time only through a Clock, so the same
code runs on wall time in a run and on simulated time in ``rollstream sim``."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Monotonic wall time in seconds since construction."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
