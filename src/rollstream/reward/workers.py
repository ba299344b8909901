"""Worker processes for synchronous rewards, driven by the event loop itself (the agent
harness runs OpenAI-SDK agents in a pool of them too: ``agent/proxy_harness.py``).

Each worker is a ``spawn``-ed process (safe in a process that has threads, unlike ``fork``)
joined to the parent by a pipe; it runs one call at a time in its main thread. The parent
side needs no thread: the event loop writes a call to an idle worker's pipe and watches the
pipes with ``add_reader``, so every message arrives as a loop callback::

    worker:  "ready" (imports done) ... recv call (unpickling imports the reward's module)
             -> "started" -> fn(*args) -> "done", result

A worker dies with the process that started it (Linux's parent-death signal, SIGKILL): a run
that was SIGKILLed cannot close the pipe of a worker stuck in a call, and such a worker (an
agent that never returns, a reward in an endless loop) would otherwise outlive it.

A worker takes calls only once it is ready, and a call's ``timeout_s`` counts from
"started": a worker's start-up and the import of a reward's module are not the reward's time
(they are bounded by ``STARTUP_S``). A call still running at its deadline is killed with its
process (SIGKILL: a reward stuck in C code cannot delay it) and the worker is replaced; a
worker that dies mid-call fails that call with its exit code and is replaced too.

Why not pebble or ``concurrent.futures``: ``ProcessPoolExecutor`` cannot kill one worker (a
hung call breaks the whole pool), and pebble's pool, which can, runs three manager threads in
the training process; their GIL hand-offs slowed the engine thread. In the long-tail modes
bench config (async k=2, drain, rewards graded in pebble workers vs in the event loop,
interleaved runs) training took 47.7 / 48.6 s against 42.1 / 39.8 s (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

STARTUP_S = 120.0  # a worker's start-up, or its import of a reward's module, past this fails
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
MAX_FAILED_STARTS = 3  # workers that die before "ready", in a row: the pool stops replacing


class Workers(Protocol):
    """A pool of workers that run one blocking call each at a time, away from the event loop
    (a reward, an agent's episode). :class:`ProcessWorkers` here;
    :class:`~rollstream.runtime.ray.workers.RayWorkers` on ``runtime.kind: ray``;
    ``runtime/build.py``'s ``build_workers`` picks one from the config."""

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   timeout_s: float | None) -> Any:
        """``fn(*args)`` in a worker. Raises CallTimeout (the worker was killed and replaced),
        WorkerDied (it died during the call; replaced), PoolClosed."""
        ...

    def close(self) -> None:
        """Kill every worker; calls still running or waiting fail with PoolClosed."""
        ...


class WorkerDied(Exception):
    """The worker process exited (or could not start) during a call. ``cause``: why, when
    the exit code is not known (a Ray actor's death)."""

    def __init__(self, exitcode: int | None, why: str = "died", role: str = "reward",
                 cause: str | None = None) -> None:
        super().__init__(f"{role} worker {why} ({cause or f'exit code {exitcode}'})")
        self.exitcode = exitcode


class CallTimeout(Exception):
    """The call ran past its deadline; its worker was killed and replaced."""


class PoolClosed(Exception):
    """The pool was closed while the call ran or waited."""


class _Worker:
    def __init__(self, ctx: Any, role: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True,
                                name=f"rollstream-{role}")
        self.proc.start()
        child.close()
        self.ready = False  # it said "ready" (a worker that dies before cannot start here)
        self.started: asyncio.Future[None] | None = None  # the current call began
        self.done: asyncio.Future[Any] | None = None  # its result


class ProcessWorkers:
    """``size`` worker processes, started at the first call; one call each at a time.
    ``role`` names them in errors and process names (``reward``, ``harness``)."""

    def __init__(self, size: int, role: str = "reward") -> None:
        self.size, self.role = size, role
        self._ctx = multiprocessing.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None: closed
        self._all: list[_Worker] = []
        self._closed = False
        self._failed_starts = 0  # workers in a row that died before they were ready
        self.broken: WorkerDied | None = None  # workers cannot start: every call fails so

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   timeout_s: float | None) -> Any:
        """``fn(*args)`` in a worker; ``fn`` and ``args`` are pickled (functions by reference).
        Raises CallTimeout, WorkerDied, PoolClosed, or what unpickling the result raises."""
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
            worker.conn.send((fn, args))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result and
            # drops a cancellation that arrives as the future completes (a cancelled caller
            # then waited for the call to time out instead of killing its worker)
            try:
                async with asyncio.timeout(STARTUP_S):
                    await asyncio.shield(worker.started)
            except TimeoutError:
                raise WorkerDied(worker.proc.exitcode, "did not start the call",
                                 self.role) from None
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(worker.done)
            except TimeoutError:
                raise CallTimeout() from None
        except (WorkerDied, CallTimeout, asyncio.CancelledError):
            self._replace(worker)  # a cancelled caller: the call may still be running
            raise
        except OSError:  # the pipe broke: the process is gone
            self._replace(worker)
            raise WorkerDied(worker.proc.exitcode, role=self.role) from None
        finally:
            if worker in self._all:
                worker.started = worker.done = None
                self._idle.put_nowait(worker)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (started, not yet stopped)."""
        return [w.proc.pid for w in self._all]

    def close(self) -> None:
        """Kill every worker (their calls fail with PoolClosed); nothing is left running."""
        self._closed = True
        for worker in list(self._all):
            self._stop(worker, PoolClosed())
        if self._idle is not None:
            self._idle.put_nowait(None)

    # -- internals ----------------------------------------------------------------------------
    def _start(self) -> None:
        assert self._loop is not None
        worker = _Worker(self._ctx, self.role)
        self._all.append(worker)
        self._loop.add_reader(worker.conn.fileno(), self._on_readable, worker)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            kind, value = worker.conn.recv()
        except (EOFError, OSError):  # the process exited: fail its call, start another
            worker.proc.join(timeout=5)
            if not worker.ready:
                self._failed_starts += 1
                if self._failed_starts >= MAX_FAILED_STARTS:  # replacing it would loop forever
                    self._break(worker)
                    return
            self._replace(worker, WorkerDied(worker.proc.exitcode, role=self.role))
            return
        if kind == "ready":
            assert self._idle is not None
            worker.ready, self._failed_starts = True, 0
            self._idle.put_nowait(worker)
        elif kind == "started" and worker.started is not None:
            worker.started.set_result(None)
        elif kind == "done" and worker.done is not None and not worker.done.done():
            worker.done.set_result(value)

    def _break(self, worker: _Worker) -> None:
        """Workers die before they can start (a ``__main__`` a spawned process cannot import,
        an interpreter that fails at start-up): stop replacing them; every call fails with
        the cause instead of waiting for a worker that never comes."""
        self.broken = WorkerDied(
            worker.proc.exitcode, f"processes died before they were ready, "
            f"{self._failed_starts} in a row (is the program's __main__ importable by a "
            f"spawned process? a script read from stdin is not)", self.role)
        self._stop(worker, self.broken)
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
        """Kill ``worker``; its pending call fails with ``error`` (None: nobody waits for it
        any more, cancel it)."""
        self._all.remove(worker)
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.remove_reader(worker.conn.fileno())
        if worker.proc.is_alive():
            worker.proc.kill()  # SIGKILL: a reward stuck in C code cannot delay it
        worker.proc.join(timeout=5)
        waiting = [f for f in (worker.started, worker.done) if f is not None and not f.done()]
        with contextlib.suppress(RuntimeError):  # their loop may be gone already
            for i, fut in enumerate(waiting):  # the caller awaits the first of them
                if error is None or i > 0:
                    fut.cancel()
                else:
                    fut.set_exception(error)
        worker.conn.close()


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (its
    process's death; the pool starts workers from the event loop's thread). Linux only:
    elsewhere a worker outlives a killed parent until its call returns."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _serve(conn: Connection, parent: int) -> None:
    """A worker's main loop: one call at a time, until the pipe closes."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()  # unpickling imports the reward's module
        except (EOFError, OSError):
            return
        conn.send(("started", None))
        conn.send(("done", fn(*args)))
