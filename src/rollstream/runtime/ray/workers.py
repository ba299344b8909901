"""Reward and harness workers as Ray actors: :class:`RayWorkers`, the Ray transport of
:class:`~rollstream.reward.workers.WorkerPool` (``runtime.kind: ray``); the pool's logic, its
contract and its exceptions are those of :class:`~rollstream.reward.workers.ProcessWorkers`.

    driver (event loop)                               worker actor (own process)
    ----------------------------------------------    ---------------------------------
    start: Actor.remote(); pid.remote() -> "ready"    __init__; pid()
    call:  stage.remote(fn, args) -> "started"        unpickles fn, args (imports modules),
                                                      setup_call(fn, args)
           run.remote() -> "done", result             fn(*args), in the main thread

A call's run is sent when its stage has answered (the pool's rule): one round trip more than
sending both together, but a call whose ``fn`` ends the process at once (``os._exit``) cannot
pass for one that never started (sent together, the stage's reply could be lost with the
process, and the call was retried: ``fn`` ran twice). The actor is a plain (not async) one
with one call at a time, so ``fn`` runs in its process's main thread: signal-based timeouts
(math-verify's) work there.

Faults, as the pool handles them: a timed-out, cancelled or broken call's actor is
``ray.kill``-ed (its process ends, a reward stuck in C code cannot delay it) and replaced; a
death mid-call fails the call with WorkerDied naming Ray's account of the death; an actor
that died idle is noticed by the stage of the next call it is given, which goes to its
replacement. An exception ``fn`` raises is raised to the caller (the actor lives on); the
pool's callers pass functions that return their errors instead (``reward/pool.py``'s
``call_in_worker``).

Actors are not children of the run's process: a run that is SIGKILLed loses them with its
Ray job (Ray ends the actors a driver owns when it exits), which is what ProcessWorkers' parent-
death signal does for its processes. Each actor reserves ``num_cpus`` (``runtime.ray.
worker_num_cpus``, 0 by default: reward and harness workers mostly wait, and a reservation
would take CPUs from the engine actors, which Ray places by theirs). ``on_driver_node`` pins
the actors to the driver's node: the harness's agents reach the proxy on 127.0.0.1;
``resources`` (``runtime.ray.nodes.rewards``) sends reward actors to their nodes.

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
from collections.abc import Callable, Mapping
from typing import Any

from rollstream.reward.workers import Link, WorkerDied, WorkerPool, setup_call


class WorkerActor:
    """The actor body (made remote by :class:`RayWorkers`): one staged call at a time."""

    def __init__(self) -> None:
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    def pid(self) -> int:
        return os.getpid()

    def stage(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        setup_call(fn, args)
        self._call = (fn, args)

    def run(self) -> Any:
        assert self._call is not None, "run without stage"
        fn, args = self._call
        self._call = None
        return fn(*args)


class _Actor(Link):
    """One worker actor; each of its calls' replies resolves a loop future."""

    def __init__(self, loop: asyncio.AbstractEventLoop, actor: Any, role: str) -> None:
        super().__init__(loop)
        self.loop, self.actor, self.role = loop, actor, role
        self._settle(actor.pid.remote(), self.ready)

    def stage(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        assert self.started is not None
        self._settle(self.actor.stage.remote(fn, args), self.started)

    def run(self) -> None:
        assert self.done is not None
        self._settle(self.actor.run.remote(), self.done)

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # dead already, or Ray is shutting down
            ray.kill(self.actor, no_restart=True)

    def _settle(self, ref: Any, fut: asyncio.Future[Any]) -> None:
        """Resolve the loop future ``fut`` with ``ref``'s outcome (Ray calls back on its own
        thread; the loop's thread sets the result)."""
        loop = self.loop

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


class RayWorkers(WorkerPool):
    """``size`` worker actors in the pool of :class:`~rollstream.reward.workers.WorkerPool`
    (module docstring). ``role`` names them in errors (``reward``, ``harness``)."""

    def __init__(self, size: int, role: str = "reward", *, num_cpus: float = 0.0,
                 on_driver_node: bool = False,
                 resources: Mapping[str, float] | None = None) -> None:
        """``resources``: custom resources each actor asks for (its role's nodes,
        ``nodes.py``)."""
        super().__init__(size, role)
        self.num_cpus, self.on_driver_node = num_cpus, on_driver_node
        self.resources = dict(resources or {})

    def _spawn(self, loop: asyncio.AbstractEventLoop) -> Link:
        import ray

        options: dict[str, Any] = {"num_cpus": self.num_cpus, "max_restarts": 0,
                                   "resources": self.resources}
        if self.on_driver_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        return _Actor(loop, ray.remote(WorkerActor).options(**options).remote(), self.role)

    def _broken(self, num_failed: int, error: BaseException) -> WorkerDied:
        return WorkerDied(None, f"actors died before they were ready, {num_failed} in a row",
                          self.role, cause=str(error))


def death_cause(error: BaseException) -> str:
    """Ray's account of an actor's death, short: ``it was killed by `ray.kill```, ``its worker
    process has died. Worker exit type: SYSTEM_ERROR ...`` (its first sentence or two)."""
    text = str(error)
    m = re.search(r"The actor is dead because (.*)", text, re.DOTALL)
    cause = (m.group(1) if m else text).split(" Some common causes")[0]
    return " ".join(cause.split())[:300].rstrip(".")
