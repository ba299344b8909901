"""Virtual time for the simulator: an asyncio loop whose clock jumps from event to event.

The loop is looptime's (``looptime.LoopTimeEventLoop`` mixed into the standard selector loop):
``loop.time()`` is virtual, and when nothing is ready the loop moves its clock straight to
the next scheduled timer instead of sleeping. So ``asyncio.sleep``, ``asyncio.timeout`` and
``call_at`` in the real components run unchanged and cost no wall time. Settings used here:

* ``noop_cycles=0``: looptime spins 42 empty loop cycles before each jump by default (for
  code that sets a timer one cycle late); at cluster scale the jumps are the simulation's
  events, so the spin would dominate. asyncio's own rule is enough: the loop jumps only when
  its ready queue is empty, i.e. every task is blocked.
* ``idle_timeout``: a simulation with no timer and nothing ready is deadlocked (every
  simulated engine and trainer keeps a timer while it works); looptime then fails every task
  with ``IdleTimeoutError`` after that many seconds instead of hanging.

Threads would make virtual time depend on wall time (looptime lets the clock move while an
executor future is pending), so the simulation runs no thread: work handed to a
:class:`VirtualExecutor` (the simulated trainer's steps) runs inline and its future resolves
at ``now + duration`` of virtual time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")
IDLE_TIMEOUT_S = 1.0  # seconds a deadlocked simulation (no timer, nothing ready) waits before failing


class VirtualExecutor(concurrent.futures.Executor):
    """Runs ``fn(*args)`` inline on the loop; its future resolves ``duration(result)`` virtual
    seconds later (the work's cost under the cost model, not the wall time it took)."""

    def __init__(self, duration: Callable[[Any], float]) -> None:
        self.duration = duration

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        raise RuntimeError("VirtualExecutor runs only through loop.run_in_executor of a "
                           "VirtualTimeLoop")


class VirtualTimeLoop(looptime.LoopTimeEventLoop, asyncio.SelectorEventLoop):
    """The standard selector loop on looptime's virtual clock (module docstring)."""

    def __init__(self) -> None:
        super().__init__(start=0.0, noop_cycles=0, idle_timeout=IDLE_TIMEOUT_S)
        self.failure: BaseException | None = None
        self.set_exception_handler(_fail_fast)

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        if not isinstance(executor, VirtualExecutor):
            return super().run_in_executor(executor, func, *args)
        fut: asyncio.Future[Any] = self.create_future()
        try:
            result = func(*args)
        except Exception as e:  # noqa: BLE001 (not swallowed: the awaiting task gets it)
            fut.set_exception(e)
            return fut
        self.call_at(self.time() + executor.duration(result), _resolve, fut, result)
        return fut


class SimulationError(RuntimeError):
    """A callback of the simulation raised (a bug: asyncio would only have logged it)."""


def _fail_fast(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An error in a loop callback (a simulated engine's timer) stops the simulation: left to
    asyncio's default handler it would be logged and the requests it held would hang."""
    exc = context.get("exception")
    if exc is None or not isinstance(loop, VirtualTimeLoop):
        loop.default_exception_handler(context)
        return
    if loop.failure is None:
        loop.failure = exc
    loop.stop()


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


class LoopClock:
    """The running loop's time (virtual under :class:`VirtualTimeLoop`) as a ``Clock``."""

    def __init__(self) -> None:
        self._t0 = asyncio.get_running_loop().time()

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self._t0

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        try:
            return runner.run(main)
        except RuntimeError:
            failure = getattr(runner.get_loop(), "failure", None)
            if failure is None:
                raise
            raise SimulationError(f"the simulation failed: {failure!r}") from failure
