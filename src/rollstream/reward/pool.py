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

The worker processes are :class:`~rollstream.reward.workers.ProcessWorkers`: driven by the
event loop (no thread in this process), a timed-out call's worker is SIGKILLed and replaced
(``workers.py`` says why not pebble or ``concurrent.futures``). On ``runtime.kind: ray`` they
are Ray actors (:class:`~rollstream.runtime.ray.workers.RayWorkers`, the same guarantees),
handed in by the run's ``build_workers``; this pool does not know which.

Not covered: an ``async def`` reward that blocks the event loop (calls ``time.sleep``) or
swallows cancellation cannot be bounded from inside the loop; write async rewards that await.
``elapsed_s`` is wall time from the moment the call has a slot (a fresh worker's start, its
import of the reward's module and the reward's ``@reward_setup`` count; the timeout does not
include them): grading happens on real time even when the schedulers run on an injected clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollstream.reward.registry import SETUP_ATTR, Call, Response, Reward
from rollstream.reward.workers import (
    CallTimeout,
    PoolClosed,
    ProcessWorkers,
    WorkerDied,
    Workers,
)
from rollstream.trajectory import Task

if TYPE_CHECKING:
    from rollstream.config.schema import RewardConfig


@dataclass(slots=True, kw_only=True, frozen=True)
class GradeResult:
    """Outcome of one reward call: exactly one of ``reward`` / ``error`` is set."""

    reward: float | None
    error: str | None
    elapsed_s: float


class GraderPool:
    """Runs reward calls for the rollout loop (module docstring)."""

    def __init__(self, cfg: RewardConfig, resolve: Callable[[Task], Reward],
                 workers: Workers | None = None) -> None:
        """``workers``: where sync rewards run, ``cfg.num_workers`` of them (the run's
        ``build_workers`` picks them by ``runtime.kind``; None: :class:`ProcessWorkers`, which
        start at the first sync call). The pool closes them."""
        self._cfg = cfg
        self._resolve = resolve
        self._slots = asyncio.Semaphore(cfg.num_workers)
        self._workers: Workers = (workers if workers is not None
                                  else ProcessWorkers(cfg.num_workers))
        self._closed = False

    async def grade(self, task: Task, response: Response) -> GradeResult:
        """Grade one response; never raises for a reward's failure. A group reward sees a
        group of one."""
        return (await self._grade(task, [response]))[0]

    def grades_groups(self, task: Task) -> bool:
        """Whether ``task``'s reward is a group reward (grade its group with
        :meth:`grade_group`, once every sample has finished)."""
        return self._resolve(task).group

    async def grade_group(self, task: Task, responses: Sequence[Response]) -> list[GradeResult]:
        """Grade the responses of one group with ``task``'s group reward: one call, one slot,
        one result per response. A failed call fails every response with its reason."""
        if not self.grades_groups(task):
            raise ValueError(f"grade_group: the reward of task {task.uid} grades one response "
                             "at a time; use grade()")
        return await self._grade(task, responses)

    async def _grade(self, task: Task, responses: Sequence[Response]) -> list[GradeResult]:
        if self._closed:
            raise RuntimeError("GraderPool is closed")
        async with self._slots:
            t0 = time.perf_counter()
            rewards, error = await self._call(task, responses)
            elapsed = time.perf_counter() - t0
        if rewards is None:
            return [GradeResult(reward=None, error=error, elapsed_s=elapsed)] * len(responses)
        return [GradeResult(reward=r, error=None, elapsed_s=elapsed) for r in rewards]

    def close(self) -> None:
        """Stop accepting calls and stop the worker processes (nothing is left running)."""
        self._closed = True
        self._workers.close()

    # -- internals ----------------------------------------------------------------------------

    async def _call(self, task: Task,
                    responses: Sequence[Response]) -> tuple[list[float] | None, str | None]:
        try:
            reward = self._resolve(task)
            call = reward.call_args(task, responses)
            if reward.is_async:
                return call.checked(await self._call_async(reward, call))
            return await self._call_sync(reward, call)
        except _Timeout:
            return None, f"timeout after {self._cfg.timeout_s:g}s"
        except _Closed:
            return None, "reward pool closed"
        except WorkerDied as e:
            return None, str(e)
        except Exception as e:  # fault boundary: the reward's failure becomes the sample's
            return None, f"{type(e).__name__}: {e}"

    async def _call_async(self, reward: Reward, call: Call) -> object:
        try:
            async with asyncio.timeout(self._cfg.timeout_s) as deadline:
                return await reward.fn(call.task, call.text, **call.kwargs)
        except TimeoutError:
            if deadline.expired():
                raise _Timeout() from None
            raise  # the reward's own TimeoutError: report it as an error like any other

    async def _call_sync(self, reward: Reward,
                         call: Call) -> tuple[list[float] | None, str | None]:
        try:
            return await self._workers.call(call_in_worker, (reward.fn, call),
                                            self._cfg.timeout_s)
        except CallTimeout:
            raise _Timeout() from None
        except PoolClosed:
            raise _Closed() from None


class _Timeout(Exception):
    """A reward call ran past its deadline (distinct from a TimeoutError the reward raised)."""


class _Closed(Exception):
    """The pool was closed while the call waited."""


def call_in_worker(fn: Callable[..., object],
                   call: Call) -> tuple[list[float] | None, str | None]:
    """Runs in a worker process: the reward's outcome as (rewards, error), never an exception
    (so nothing unpicklable travels back, and a TimeoutError here is never the reward's)."""
    try:
        value = fn(call.task, call.text, **call.kwargs)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return call.checked(value)


def _setup_in_worker(fn: Callable[..., object], call: Call) -> None:
    """The reward's ``@reward_setup`` step, run by the worker before the call is timed."""
    setup = getattr(fn, SETUP_ATTR, None)
    if setup is not None:
        setup(call.task)


call_in_worker.setup = _setup_in_worker  # type: ignore[attr-defined]  (workers.setup_call)
