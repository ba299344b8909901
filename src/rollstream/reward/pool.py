"""The async grader pool: bounded, timed, isolated reward calls.

``GraderPool.grade`` never raises for a reward's fault: every outcome is a
:class:`GradeResult` with either a finite ``reward`` or an ``error`` that says why (the caller
marks the sample FAILED with it). Guarantees:

* at most ``RewardConfig.num_workers`` reward calls run at once (an ``asyncio.Semaphore``);
  further calls wait for a slot, and the timeout starts only when the call starts;
* each call is bounded by ``timeout_s``. ``async`` rewards are cancelled at the deadline. Sync
  rewards run on a thread of their own (a daemon thread per call; thread start-up is ~0.1 ms,
  nothing next to a reward). A Python thread cannot be killed, so a sync call that overruns
  is *abandoned*: the caller gets ``"timeout after Xs"`` at once, its slot is freed, and the
  stuck thread runs on until its function returns. Daemon threads (unlike a
  ``ThreadPoolExecutor``'s, which are joined at exit) never keep the process alive. To bound
  the damage, while ``MAX_HUNG_PER_WORKER * num_workers`` abandoned calls are still running,
  new sync calls fail fast with an error instead of starting more threads;
* an exception becomes ``"<ExceptionType>: <message>"``; a result that is not a finite number
  (None, str, bool, NaN, inf, ...) becomes ``"reward returned <repr>, expected a finite
  number"``.

Not covered: an ``async def`` reward that blocks the event loop (calls ``time.sleep``) or
swallows cancellation cannot be bounded from inside the loop; write async rewards that await.
``elapsed_s`` is wall time of the call itself (not the wait for a slot): grading happens on
real time even when the schedulers run on an injected clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollstream.config.schema import RewardConfig
from rollstream.reward.registry import AsyncRewardFn, RewardFn, SyncRewardFn
from rollstream.trajectory import Task

MAX_HUNG_PER_WORKER = 4


@dataclass(slots=True, kw_only=True, frozen=True)
class GradeResult:
    """Outcome of one reward call: exactly one of ``reward`` / ``error`` is set."""

    reward: float | None
    error: str | None
    elapsed_s: float


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(type(fn), "__call__", None)
    )


def _checked(value: object) -> tuple[float | None, str | None]:
    if inspect.iscoroutine(value):  # a sync callable that returned a coroutine
        value.close()
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and math.isfinite(value):  # type: ignore[arg-type]
        return float(value), None  # type: ignore[arg-type]
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return None, f"reward returned {shown}, expected a finite number"


class GraderPool:
    """Runs reward calls for the rollout loop (module docstring)."""

    def __init__(self, cfg: RewardConfig, resolve: Callable[[Task], RewardFn]) -> None:
        self._cfg = cfg
        self._resolve = resolve
        self._slots = asyncio.Semaphore(cfg.num_workers)
        self._abandoned: list[concurrent.futures.Future[object]] = []
        self._closed = False

    @property
    def num_hung(self) -> int:
        """Abandoned (timed-out) sync calls whose threads are still running."""
        self._abandoned = [f for f in self._abandoned if not f.done()]
        return len(self._abandoned)

    async def grade(self, task: Task, response_text: str) -> GradeResult:
        """Grade one response; never raises for a reward's failure."""
        if self._closed:
            raise RuntimeError("GraderPool is closed")
        async with self._slots:
            t0 = time.perf_counter()
            reward, error = await self._call(task, response_text)
            return GradeResult(reward=reward, error=error, elapsed_s=time.perf_counter() - t0)

    async def grade_group(self, task: Task, texts: Sequence[str]) -> list[GradeResult]:
        """Grade a group's responses concurrently (results in the order of ``texts``)."""
        return list(await asyncio.gather(*(self.grade(task, t) for t in texts)))

    def close(self) -> None:
        """Stop accepting new calls (running calls finish or time out as usual)."""
        self._closed = True

    # -- internals ----------------------------------------------------------------------------

    async def _call(self, task: Task, text: str) -> tuple[float | None, str | None]:
        try:
            fn = self._resolve(task)
            if _is_async(fn):
                value = await self._call_async(fn, task, text)  # type: ignore[arg-type]
            else:
                value = await self._call_sync(fn, task, text)  # type: ignore[arg-type]
        except _Timeout:
            return None, f"timeout after {self._cfg.timeout_s:g}s"
        except Exception as e:  # fault boundary: the reward's failure becomes the sample's
            return None, f"{type(e).__name__}: {e}"
        return _checked(value)

    async def _call_async(self, fn: AsyncRewardFn, task: Task, text: str) -> object:
        try:
            async with asyncio.timeout(self._cfg.timeout_s) as deadline:
                return await fn(task, text)
        except TimeoutError:
            if deadline.expired():
                raise _Timeout() from None
            raise  # the reward's own TimeoutError: report it as an error like any other

    async def _call_sync(self, fn: SyncRewardFn, task: Task, text: str) -> object:
        hung = self.num_hung
        if hung >= MAX_HUNG_PER_WORKER * self._cfg.num_workers:
            raise RuntimeError(
                f"{hung} timed-out reward calls are still running; not starting more"
            )
        fut = _start_thread(fn, task, text)
        try:
            await asyncio.wait_for(_waiter(fut), timeout=self._cfg.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if not fut.done():
                self._abandoned.append(fut)
            if isinstance(e, TimeoutError):
                raise _Timeout() from None
            raise
        return fut.result()


class _Timeout(Exception):
    """A reward call ran past its deadline (distinct from a TimeoutError the reward raised)."""


def _start_thread(fn: SyncRewardFn, task: Task, text: str) -> concurrent.futures.Future[object]:
    """Run ``fn(task, text)`` on a new daemon thread; its outcome lands in the future."""
    fut: concurrent.futures.Future[object] = concurrent.futures.Future()

    def run() -> None:
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(task, text))
        except BaseException as e:  # handed to the caller, who decides
            fut.set_exception(e)

    threading.Thread(target=run, name="rollstream-reward", daemon=True).start()
    return fut


def _waiter(fut: concurrent.futures.Future[object]) -> asyncio.Future[None]:
    """An asyncio future done when ``fut`` is; safe if the loop is gone by then (a hung
    thread may finish long after its caller's loop closed)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def wake(_: concurrent.futures.Future[object]) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass

    fut.add_done_callback(wake)
    return waiter
