"""The async grader pool: bounded, timed, isolated reward calls.

``GraderPool.grade(task, response)`` never raises for a reward's fault: every outcome is a
:class:`GradeResult` with either a finite ``reward`` or an ``error`` that says why (the caller
marks the sample FAILED with it). Guarantees:

* at most ``RewardConfig.num_workers`` reward calls run at once (an ``asyncio.Semaphore``);
  further calls wait for a slot;
* **sync rewards run in worker processes**: ``num_workers`` processes, started with
  ``spawn`` (safe in a process that has threads, unlike ``fork``) at the first sync call.
  A call still running ``timeout_s`` after a worker took it is killed with its process,
  which is replaced; the caller gets ``"timeout after Xs"``. A reward stuck in C code holds
  only its own process's GIL, so the event loop, the engines and the trainer run on. Each
  worker runs calls in its main thread, so signal-based timeouts inside a reward work
  (math-verify's are on there). A reward reaches the workers by reference (module + name):
  :func:`~rollstream.reward.registry.get_reward` rejects, at load time, one that cannot be
  sent (a lambda, a closure). Like any ``spawn`` child, a worker imports the main script, so a
  script that starts a run guards it with ``if __name__ == "__main__":`` (the CLI does);
* ``async`` rewards run in the event loop and are cancelled at the deadline
  (``asyncio.timeout``);
* an exception becomes ``"<ExceptionType>: <message>"``; a result that is not a finite number
  (None, str, bool, NaN, inf, ...) becomes ``"reward returned <repr>, expected a finite
  number"``; a worker that dies (a crash in C code, ``os._exit``) becomes ``"reward worker
  died (exit code N)"``;
* ``close()`` stops every worker process; calls still waiting then end with ``"reward pool
  closed"``.

The worker processes come from pebble's ``ProcessPool``: a per-call timeout that kills and
replaces only that call's worker (``concurrent.futures.ProcessPoolExecutor`` cannot kill one
worker; a hung call breaks the whole pool). Its workers turn SIGTERM into a clean exit that
Python code must reach, so the worker initializer restores the default action: a worker
stuck in C code then dies at once instead of after pebble's 3 s grace.

Not covered: an ``async def`` reward that blocks the event loop (calls ``time.sleep``) or
swallows cancellation cannot be bounded from inside the loop; write async rewards that await.
``elapsed_s`` is wall time from the moment the call has a slot (a fresh worker's start and its
import of the reward's module count; the timeout does not include them): grading happens on
real time even when the schedulers run on an injected clock.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pebble import ProcessExpired, ProcessPool

from rollstream.reward.registry import Response, Reward, checked_value
from rollstream.trajectory import Task

if TYPE_CHECKING:
    import concurrent.futures

    from rollstream.config.schema import RewardConfig


@dataclass(slots=True, kw_only=True, frozen=True)
class GradeResult:
    """Outcome of one reward call: exactly one of ``reward`` / ``error`` is set."""

    reward: float | None
    error: str | None
    elapsed_s: float


class GraderPool:
    """Runs reward calls for the rollout loop (module docstring)."""

    def __init__(self, cfg: RewardConfig, resolve: Callable[[Task], Reward]) -> None:
        self._cfg = cfg
        self._resolve = resolve
        self._slots = asyncio.Semaphore(cfg.num_workers)
        self._workers: ProcessPool | None = None
        self._running: set[concurrent.futures.Future[tuple[float | None, str | None]]] = set()
        self._closed = False

    async def grade(self, task: Task, response: Response) -> GradeResult:
        """Grade one response; never raises for a reward's failure."""
        if self._closed:
            raise RuntimeError("GraderPool is closed")
        async with self._slots:
            t0 = time.perf_counter()
            reward, error = await self._call(task, response)
            return GradeResult(reward=reward, error=error, elapsed_s=time.perf_counter() - t0)

    def close(self) -> None:
        """Stop accepting calls and stop the worker processes (nothing is left running)."""
        self._closed = True
        for fut in list(self._running):
            fut.cancel()
        if self._workers is not None:
            self._workers.stop()
            self._workers.join()
            self._workers = None

    # -- internals ----------------------------------------------------------------------------

    async def _call(self, task: Task, response: Response) -> tuple[float | None, str | None]:
        try:
            reward = self._resolve(task)
            if reward.is_async:
                return checked_value(await self._call_async(reward, task, response))
            return await self._call_sync(reward, task, response)
        except _Timeout:
            return None, f"timeout after {self._cfg.timeout_s:g}s"
        except _Closed:
            return None, "reward pool closed"
        except ProcessExpired as e:
            return None, f"reward worker died (exit code {e.exitcode})"
        except Exception as e:  # fault boundary: the reward's failure becomes the sample's
            return None, f"{type(e).__name__}: {e}"

    async def _call_async(self, reward: Reward, task: Task, response: Response) -> object:
        try:
            async with asyncio.timeout(self._cfg.timeout_s) as deadline:
                return await reward.fn(task, response.text, **reward.kwargs(response))
        except TimeoutError:
            if deadline.expired():
                raise _Timeout() from None
            raise  # the reward's own TimeoutError: report it as an error like any other

    async def _call_sync(
        self, reward: Reward, task: Task, response: Response
    ) -> tuple[float | None, str | None]:
        fut = self._live_workers().schedule(
            call_in_worker,
            args=(reward.fn, task, response.text, reward.kwargs(response)),
            timeout=self._cfg.timeout_s,
        )
        self._running.add(fut)
        try:
            return await asyncio.wrap_future(fut)
        except TimeoutError:  # the worker wraps every error of the reward: this is pebble's
            raise _Timeout() from None
        except asyncio.CancelledError:
            if self._closed and fut.cancelled():
                current = asyncio.current_task()
                if current is None or not current.cancelling():
                    raise _Closed() from None
            fut.cancel()  # our caller gave up: pebble kills the worker if it is running
            raise
        finally:
            self._running.discard(fut)

    def _live_workers(self) -> ProcessPool:
        if self._workers is not None and not self._workers.active:  # broken: start afresh
            self._workers.stop()
            self._workers.join()
            self._workers = None
        if self._workers is None:
            self._workers = ProcessPool(
                max_workers=self._cfg.num_workers,
                initializer=_init_worker,
                context=multiprocessing.get_context("spawn"),
            )
        return self._workers


class _Timeout(Exception):
    """A reward call ran past its deadline (distinct from a TimeoutError the reward raised)."""


class _Closed(Exception):
    """The pool was closed while the call waited."""


def call_in_worker(
    fn: Callable[..., object], task: Task, text: str, kwargs: dict[str, object]
) -> tuple[float | None, str | None]:
    """Runs in a worker process: the reward's outcome as (reward, error), never an exception
    (so nothing unpicklable travels back, and a TimeoutError here is never the reward's)."""
    try:
        value = fn(task, text, **kwargs)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return checked_value(value)


def _init_worker() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die at once, even inside C code
