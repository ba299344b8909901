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
at ``now + duration`` of virtual time, and work handed to the default executor
(``asyncio.to_thread``: the agent loop's chat rendering in agentic scenarios) runs inline at
no virtual cost (what the real components spend in Python is not in the cost model).

Two costs of looptime's per-cycle check are taken out (``_lighten``), each ~3% of a
512-engine simulation: the I/O poll every cycle (``select`` with timeout 0: a syscall; the
simulation does no I/O, so a poll answers nothing; a select that may wait still goes to the
real selector) and the scan of executor futures kept in a ``WeakSet`` (a plain set here: the
simulation's executor is virtual, so it stays empty).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")
IDLE_TIMEOUT_S = 1.0  # seconds a deadlocked simulation (no timer, nothing ready) waits before failing


class VirtualExecutor(concurrent.futures.Executor):
    """Runs ``fn(*args)`` inline on the loop; its future resolves ``duration(result)`` virtual
    seconds later (the work's cost under the cost model, not the wall time it took), plus
    ``extend(that duration)`` seconds asked when it is over (work slowed by what happened
    meanwhile: contention with the engines)."""

    def __init__(self, duration: Callable[[Any], float],
                 extend: Callable[[float], float] | None = None) -> None:
        self.duration, self.extend = duration, extend

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        raise RuntimeError("VirtualExecutor runs only through loop.run_in_executor of a "
                           "VirtualTimeLoop")


class VirtualTimeLoop(looptime.LoopTimeEventLoop, asyncio.SelectorEventLoop):
    """The standard selector loop on looptime's virtual clock (module docstring)."""

    def __init__(self) -> None:
        super().__init__(start=0.0, noop_cycles=0, idle_timeout=IDLE_TIMEOUT_S)
        self.failure: BaseException | None = None
        self.set_exception_handler(_fail_fast)
        self._lighten()

    def _lighten(self) -> None:
        """The module docstring's two shortcuts, on looptime's private attributes (checked:
        a looptime that renames them fails here, not silently)."""
        select_name, futures_name = ("_LoopTimeEventLoop__original_select",
                                     "_LoopTimeEventLoop__sync_futures")
        if not hasattr(self, select_name) or not hasattr(self, futures_name):
            raise RuntimeError("looptime's internals changed: update sim/vloop.py")
        real_select = getattr(self, select_name)

        def select(timeout: float | None = None) -> list[Any]:
            return [] if timeout == 0 else real_select(timeout)

        setattr(self, select_name, select)
        setattr(self, futures_name, set())

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        if executor is None:  # the default executor (asyncio.to_thread): inline, no cost
            return self._inline(func, args)
        if not isinstance(executor, VirtualExecutor):
            return super().run_in_executor(executor, func, *args)
        fut: asyncio.Future[Any] = self.create_future()
        try:
            result = func(*args)
        except Exception as e:  # noqa: BLE001 (not swallowed: the awaiting task gets it)
            fut.set_exception(e)
            return fut
        base = executor.duration(result)
        if executor.extend is None:
            self.call_at(self.time() + base, _resolve, fut, result)
        else:
            self.call_at(self.time() + base, self._extended, executor.extend, base, fut, result)
        return fut

    def _inline(self, func: Any, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.create_future()
        try:
            fut.set_result(func(*args))
        except Exception as e:  # noqa: BLE001 (not swallowed: the awaiting task gets it)
            fut.set_exception(e)
        return fut

    def _extended(self, extend: Callable[[float], float], base: float,
                  fut: asyncio.Future[Any], result: Any) -> None:
        self.call_at(self.time() + extend(base), _resolve, fut, result)


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
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` with the cyclic garbage
    collector off (reference counting still frees everything else). A large simulation
    allocates millions of objects that each collection walks: full passes took ~20% of a
    512-engine run, the young generations ~4% more, and they find nothing: after 10 steps of
    ``examples/sim/kimi_k2_512.yaml`` run without the collector, ``gc.collect()`` finds 0
    unreachable objects and the peak memory is the same (docs/simulator.md, "Speed")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(main)
    finally:
        if was_enabled:
            gc.enable()


def _run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        try:
            return runner.run(main)
        except RuntimeError:
            failure = getattr(runner.get_loop(), "failure", None)
            if failure is None:
                raise
            raise SimulationError(f"the simulation failed: {failure!r}") from failure
