"""Reward and harness workers as Ray actors: :class:`RayWorkers`, the
:class:`~rollstream.reward.workers.Workers` pool of ``runtime.kind: ray``, with
:class:`~rollstream.reward.workers.ProcessWorkers`' contract (same ``call`` / ``close``, same
exceptions, same guarantees).

    driver (event loop)                               worker actor (own process)
    ----------------------------------------------    ---------------------------------
    start: Actor.remote(); pid.remote() -> "ready"    __init__; pid()
    call:  stage.remote(fn, args) -> "started"        unpickles fn, args (imports modules)
           run.remote() -> "done", result             fn(*args), in the main thread

A call's run is sent when its stage has answered: one round trip more than sending both
together, but a call whose ``fn`` ends the process at once (``os._exit``) cannot pass for one
that never started (sent together, the stage's reply could be lost with the process, and the
call was retried: ``fn`` ran twice). Its ``timeout_s`` counts from "started", as in ProcessWorkers:
an actor's start and the import of a reward's module are not the reward's time (bounded by
``STARTUP_S``). The actor is a plain (not async) one with one call at a time, so ``fn`` runs
in its process's main thread: signal-based timeouts (math-verify's) work there.

Faults. A call past its deadline: the actor is ``ray.kill``-ed (its process ends, a reward
stuck in C code cannot delay it), a new one replaces it, the caller gets CallTimeout. An actor
that dies during a call (its process killed, ``os._exit``, a crash): the call fails with
WorkerDied naming Ray's account of the death, a new actor replaces it and serves the next
call. An actor that died while idle is noticed by the next call it is given, before the call
started: that call goes to its replacement instead (nothing of it ran). Actors that die before
they are ready, ``MAX_FAILED_STARTS`` in a row, break the pool: every call fails with the
cause. A cancelled caller's actor is killed and replaced too. ``close()`` kills every actor.
An exception ``fn`` raises is raised to the caller (the actor lives on); the pool's callers
pass functions that return their errors instead (``reward/pool.py``'s ``call_in_worker``).

Actors are not children of the run's process: a run that is SIGKILLed loses them with its
Ray job (Ray ends the actors a driver owns when it exits), which is what ProcessWorkers' parent-
death signal does for its processes. Each actor reserves ``num_cpus`` (``runtime.ray.
worker_num_cpus``, 0 by default: reward and harness workers mostly wait, and a reservation
would take CPUs from the engine actors, which Ray places by theirs). ``on_driver_node`` pins
the actors to the driver's node: the harness's agents reach the proxy on 127.0.0.1.

Results and arguments travel through Ray's object store: a function reaches the actor by
reference (module + name), so, as with ProcessWorkers, it must be importable there (on a
cluster: on every node).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
from collections.abc import Callable
from typing import Any

from rollstream.reward.workers import (
    MAX_FAILED_STARTS,
    STARTUP_S,
    CallTimeout,
    PoolClosed,
    WorkerDied,
)


class WorkerActor:
    """The actor body (made remote by :class:`RayWorkers`): one staged call at a time."""

    def __init__(self) -> None:
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    def pid(self) -> int:
        return os.getpid()

    def stage(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._call = (fn, args)

    def run(self) -> Any:
        assert self._call is not None, "run without stage"
        fn, args = self._call
        self._call = None
        return fn(*args)


class _Worker:
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.pid: int | None = None  # set when ready
        self.ready_deadline: asyncio.TimerHandle | None = None
        self.started: asyncio.Future[None] | None = None  # the current call began
        self.done: asyncio.Future[Any] | None = None  # its result


class _DiedIdle(Exception):
    """The actor was dead before the call started: the call can go to another one."""


class RayWorkers:
    """``size`` worker actors, started at the first call; one call each at a time (module
    docstring). ``role`` names them in errors (``reward``, ``harness``)."""

    def __init__(self, size: int, role: str = "reward", *, num_cpus: float = 0.0,
                 on_driver_node: bool = False) -> None:
        self.size, self.role = size, role
        self.num_cpus, self.on_driver_node = num_cpus, on_driver_node
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None: closed
        self._all: list[_Worker] = []
        self._closed = False
        self._failed_starts = 0  # actors in a row that died before they were ready
        self.broken: WorkerDied | None = None  # actors cannot start: every call fails so

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   timeout_s: float | None) -> Any:
        """``fn(*args)`` in an actor. Raises CallTimeout, WorkerDied, PoolClosed, or what
        ``fn`` raised."""
        for _ in range(2):  # once more when the actor had died idle (nothing ran)
            try:
                return await self._call_once(fn, args, timeout_s)
            except _DiedIdle as e:
                died = e
        raise WorkerDied(None, "died before the call started, twice", self.role,
                         cause=str(died))

    @property
    def pids(self) -> list[int]:
        """The ready actors' process ids."""
        return [w.pid for w in self._all if w.pid is not None]

    def close(self) -> None:
        """Kill every actor (their calls fail with PoolClosed); Ray ends their processes."""
        self._closed = True
        for worker in list(self._all):
            self._stop(worker, PoolClosed())
        if self._idle is not None:
            self._idle.put_nowait(None)

    # -- internals ----------------------------------------------------------------------------
    async def _call_once(self, fn: Callable[..., Any], args: tuple[Any, ...],
                         timeout_s: float | None) -> Any:
        if self.broken is not None:
            raise self.broken
        if self._closed:
            raise PoolClosed()
        if self._idle is None:
            self._loop, self._idle = asyncio.get_running_loop(), asyncio.Queue()
            for _ in range(self.size):
                self._start()
        worker = await self._idle.get()
        if worker is None:  # closed (or broken) while we waited: pass the word on
            self._idle.put_nowait(None)
            raise self.broken or PoolClosed()
        assert self._loop is not None
        worker.started, worker.done = self._loop.create_future(), self._loop.create_future()
        try:
            self._settle(worker.actor.stage.remote(fn, args), worker.started)
            try:
                async with asyncio.timeout(STARTUP_S):
                    await asyncio.shield(worker.started)
            except TimeoutError:
                raise WorkerDied(None, "did not start the call", self.role,
                                 cause=f"not staged within {STARTUP_S:g} s") from None
            except WorkerDied as e:
                raise _DiedIdle(str(e)) from None
            # only now: a run sent with the stage could end the process before the stage's
            # reply left it, and the call would pass for one that never started (run twice)
            self._settle(worker.actor.run.remote(), worker.done)
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(worker.done)
            except TimeoutError:
                raise CallTimeout() from None
        except (WorkerDied, _DiedIdle, CallTimeout, asyncio.CancelledError):
            self._replace(worker)  # a cancelled caller: the call may still be running
            raise
        finally:
            if worker in self._all:
                worker.started = worker.done = None
                self._idle.put_nowait(worker)

    def _start(self) -> None:
        import ray

        assert self._loop is not None
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "max_restarts": 0}
        if self.on_driver_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(WorkerActor).options(**options).remote()
        worker = _Worker(actor)
        self._all.append(worker)
        ready: asyncio.Future[int] = self._loop.create_future()
        ready.add_done_callback(lambda f: self._on_ready(worker, f))
        worker.ready_deadline = self._loop.call_later(
            STARTUP_S, lambda: ready.done() or ready.set_exception(
                WorkerDied(None, "did not start", self.role,
                           cause=f"not ready within {STARTUP_S:g} s")))
        self._settle(actor.pid.remote(), ready)

    def _settle(self, ref: Any, fut: asyncio.Future[Any]) -> None:
        """Resolve the loop future ``fut`` with ``ref``'s outcome (Ray calls back on its own
        thread; the loop's thread sets the result)."""
        loop = self._loop
        assert loop is not None

        def on_done(cf: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(self._resolve, fut, cf)

        ref.future().add_done_callback(on_done)

    def _resolve(self, fut: asyncio.Future[Any], cf: concurrent.futures.Future[Any]) -> None:
        if fut.done():
            return
        if cf.cancelled():
            fut.cancel()
            return
        error = cf.exception()
        if error is None:
            fut.set_result(cf.result())
        else:
            fut.set_exception(self._translate(error))

    def _translate(self, error: BaseException) -> BaseException:
        from ray.exceptions import RayActorError, RayTaskError

        if isinstance(error, RayActorError):
            return WorkerDied(None, role=self.role, cause=death_cause(error))
        if isinstance(error, RayTaskError):  # fn raised: its own exception (if Ray has it)
            cause = getattr(error, "cause", None)
            return cause if isinstance(cause, Exception) else error
        return error

    def _on_ready(self, worker: _Worker, ready: asyncio.Future[int]) -> None:
        if worker.ready_deadline is not None:
            worker.ready_deadline.cancel()
        error = None if ready.cancelled() else ready.exception()  # retrieved either way
        if worker not in self._all or ready.cancelled():
            return
        if error is None:
            assert self._idle is not None
            worker.pid, self._failed_starts = ready.result(), 0
            self._idle.put_nowait(worker)
            return
        self._failed_starts += 1
        if self._failed_starts < MAX_FAILED_STARTS:
            self._replace(worker)
            return
        # replacing it would loop forever: every call fails with the cause instead
        self.broken = WorkerDied(None, f"actors died before they were ready, "
                                 f"{self._failed_starts} in a row", self.role, cause=str(error))
        for other in list(self._all):
            self._stop(other, self.broken)
        if self._idle is not None:
            self._idle.put_nowait(None)

    def _replace(self, worker: _Worker, error: BaseException | None = None) -> None:
        if worker in self._all:
            self._stop(worker, error)
            if not self._closed:
                self._start()

    def _stop(self, worker: _Worker, error: BaseException | None) -> None:
        """Kill ``worker``'s actor; its pending call fails with ``error`` (None: nobody waits
        for it any more, cancel it)."""
        import ray

        self._all.remove(worker)
        if worker.ready_deadline is not None:
            worker.ready_deadline.cancel()
        with contextlib.suppress(Exception):  # dead already, or Ray is shutting down
            ray.kill(worker.actor, no_restart=True)
        waiting = [f for f in (worker.started, worker.done) if f is not None and not f.done()]
        with contextlib.suppress(RuntimeError):  # their loop may be gone already
            for i, fut in enumerate(waiting):  # the caller awaits the first of them
                if error is None or i > 0:
                    fut.cancel()
                else:
                    fut.set_exception(error)


def death_cause(error: BaseException) -> str:
    """Ray's account of an actor's death, short: ``it was killed by `ray.kill```, ``its worker
    process has died. Worker exit type: SYSTEM_ERROR ...`` (its first sentence or two)."""
    text = str(error)
    m = re.search(r"The actor is dead because (.*)", text, re.DOTALL)
    cause = (m.group(1) if m else text).split(" Some common causes")[0]
    return " ".join(cause.split())[:300].rstrip(".")
