"""Workers for blocking calls (synchronous rewards; the agent harness's OpenAI-SDK agents,
``agent/proxy_harness.py``), driven by the event loop itself: one pool, two transports.

:class:`WorkerPool` is the pool: idle workers in a queue, a call staged and then run, its
deadline, kill-and-replace of a worker that timed out, died or whose caller cancelled, a
retry when a worker died before a call started (nothing of it ran), and a break after
``MAX_FAILED_STARTS`` workers in a row died before they were ready. A transport is a
:class:`Link` (one worker) and the pool's ``_spawn``: :class:`ProcessWorkers` here, Ray actors
on ``runtime.kind: ray`` (:class:`~rollstream.runtime.ray.workers.RayWorkers`).

Each process worker is a ``spawn``-ed process (safe in a process that has threads, unlike
``fork``) joined to the parent by a pipe; it runs one call at a time in its main thread. The
parent side needs no thread: the event loop writes a call to an idle worker's pipe and
watches the pipes with ``add_reader``, so every message arrives as a loop callback::

    worker:  "ready" (imports done) ... recv call (unpickling imports the reward's module)
             -> fn.setup(*args), if fn has one -> "started" -> fn(*args) -> "done", result

A worker dies with the process that started it (Linux's parent-death signal, SIGKILL): a run
that was SIGKILLed cannot close the pipe of a worker stuck in a call, and such a worker (an
agent that never returns, a reward in an endless loop) would otherwise outlive it.

A worker takes calls only once it is ready, and a call's ``timeout_s`` counts from
"started": a worker's start-up, the import of a reward's module and the call's setup
(:func:`setup_call`) are not the reward's time (they are bounded by ``STARTUP_S``). A call
still running at its deadline is killed with its process (SIGKILL: a reward stuck in C code
cannot delay it) and the worker is replaced; a worker that dies mid-call fails that call with
its exit code and is replaced too; one that died idle is noticed by the next call it is given,
which goes to another worker.

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


class Link:
    """One worker as the pool drives it; a transport subclasses it. The pool sets ``started``
    and ``done`` for each call and reads them; the transport resolves them (and ``ready``)
    on the pool's loop, with WorkerDied when the worker is gone."""

    pid: int | None = None  # its process id, once known
    exitcode: int | None = None  # once it exited (None where the transport cannot tell)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ready: asyncio.Future[int] = loop.create_future()  # its pid: it takes calls
        self.ready_deadline: asyncio.TimerHandle | None = None
        self.started: asyncio.Future[None] | None = None  # the current call began
        self.done: asyncio.Future[Any] | None = None  # its result

    def stage(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Send a call; resolve ``started`` once the worker holds it (a worker that was gone
        before fails ``started``: nothing of the call ran)."""
        raise NotImplementedError

    def run(self) -> None:
        """Run the staged call (sent only after ``started`` resolved); resolve ``done``."""
        raise NotImplementedError

    def kill(self) -> None:
        """End the worker at once (a call stuck in C code cannot delay it)."""
        raise NotImplementedError


class _DiedIdle(Exception):
    """The worker was gone before the call started: the call can go to another one."""


class WorkerPool:
    """``size`` workers of one transport (``_spawn``), started at the first call; one call
    each at a time. ``role`` names them in errors (``reward``, ``harness``).

    A call is staged, and run only once the worker said it holds it ("started"): a call
    whose ``fn`` ends the worker at once cannot pass for one that never started, so a call
    is retried (once) only when nothing of it ran. Its ``timeout_s`` counts from "started":
    a worker's start and the import of ``fn``'s module are bounded by ``STARTUP_S`` instead.
    A call past its deadline, a cancelled caller and a death mid-call kill the worker and
    start a replacement; workers that die before they are ready, ``MAX_FAILED_STARTS`` in
    a row, break the pool (every call fails with the cause)."""

    def __init__(self, size: int, role: str) -> None:
        self.size, self.role = size, role
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Queue[Link | None] | None = None  # None: closed
        self._all: list[Link] = []
        self._closed = False
        self._failed_starts = 0  # workers in a row that died before they were ready
        self.broken: WorkerDied | None = None  # workers cannot start: every call fails so

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   timeout_s: float | None) -> Any:
        """``fn(*args)`` in a worker. Raises CallTimeout, WorkerDied, PoolClosed, or what the
        call raised (``fn`` itself, unpickling its result)."""
        for _ in range(2):  # once more when the worker had died idle (nothing ran)
            try:
                return await self._call_once(fn, args, timeout_s)
            except _DiedIdle as e:
                died = e
        raise WorkerDied(None, "died before the call started, twice", self.role,
                         cause=str(died))

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (those known: started, not yet stopped)."""
        return [w.pid for w in self._all if w.pid is not None]

    def close(self) -> None:
        """Kill every worker (their calls fail with PoolClosed); nothing is left running."""
        self._closed = True
        for worker in list(self._all):
            self._stop(worker, PoolClosed())
        if self._idle is not None:
            self._idle.put_nowait(None)

    # -- what a transport provides ------------------------------------------------------------
    def _spawn(self, loop: asyncio.AbstractEventLoop) -> Link:
        """Start one worker (it resolves ``ready`` when it can take calls)."""
        raise NotImplementedError

    def _broken(self, num_failed: int, error: BaseException) -> WorkerDied:
        """The pool's error once ``num_failed`` workers in a row died before they were ready
        (``error``: the last one's)."""
        raise NotImplementedError

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
            worker.stage(fn, args)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result and
            # drops a cancellation that arrives as the future completes (a cancelled caller
            # then waited for the call to time out instead of killing its worker)
            try:
                async with asyncio.timeout(STARTUP_S):
                    await asyncio.shield(worker.started)
            except TimeoutError:
                raise WorkerDied(worker.exitcode, "did not start the call", self.role,
                                 cause=f"not started within {STARTUP_S:g} s") from None
            except WorkerDied as e:
                raise _DiedIdle(str(e)) from None
            worker.run()  # only now (class docstring)
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
        loop = self._loop
        assert loop is not None
        worker = self._spawn(loop)
        self._all.append(worker)
        worker.ready.add_done_callback(lambda f: self._on_ready(worker, f))
        worker.ready_deadline = loop.call_later(
            STARTUP_S, lambda: worker.ready.done() or worker.ready.set_exception(
                WorkerDied(None, "did not start", self.role,
                           cause=f"not ready within {STARTUP_S:g} s")))

    def _on_ready(self, worker: Link, ready: asyncio.Future[int]) -> None:
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
        self.broken = self._broken(self._failed_starts, error)
        for other in list(self._all):
            self._stop(other, self.broken)
        if self._idle is not None:
            self._idle.put_nowait(None)

    def _replace(self, worker: Link, error: BaseException | None = None) -> None:
        if worker in self._all:
            self._stop(worker, error)
            if not self._closed:
                self._start()

    def _stop(self, worker: Link, error: BaseException | None) -> None:
        """Kill ``worker``; its pending call fails with ``error`` (None: nobody waits for it
        any more, cancel it)."""
        self._all.remove(worker)
        if worker.ready_deadline is not None:
            worker.ready_deadline.cancel()
        worker.kill()
        waiting = [f for f in (worker.started, worker.done) if f is not None and not f.done()]
        with contextlib.suppress(RuntimeError):  # their loop may be gone already
            for i, fut in enumerate(waiting):  # the caller awaits the first of them
                if error is None or i > 0:
                    fut.cancel()
                else:
                    fut.set_exception(error)


class _Process(Link):
    """A ``spawn``-ed process joined by a pipe that the loop watches (``add_reader``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ctx: Any, role: str) -> None:
        super().__init__(loop)
        self.loop, self.role = loop, role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True,
                                name=f"rollstream-{role}")
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.gone: WorkerDied | None = None  # it exited
        loop.add_reader(self.conn.fileno(), self._on_readable)

    def stage(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        assert self.started is not None
        try:
            if self.gone is None:
                self.conn.send((fn, args))  # the worker runs it at once, after "started"
        except OSError:  # the pipe broke: the process is gone
            self._exited()
        if self.gone is not None:
            self.started.set_exception(self.gone)

    def run(self) -> None:
        pass  # the worker runs a call as soon as it holds it

    def kill(self) -> None:
        if not self.loop.is_closed() and self.gone is None:
            self.loop.remove_reader(self.conn.fileno())
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL: a reward stuck in C code cannot delay it
        self.proc.join(timeout=5)
        self.conn.close()

    def _on_readable(self) -> None:
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):  # the process exited: fail what waits on it
            self._exited()
            for fut in (self.ready, self.started, self.done):
                if fut is not None and not fut.done():
                    fut.set_exception(self.gone)
                    break
            return
        if kind == "ready" and not self.ready.done():  # (done: its deadline passed)
            self.ready.set_result(self.proc.pid)
        elif kind == "started" and self.started is not None and not self.started.done():
            self.started.set_result(None)
        elif kind == "done" and self.done is not None and not self.done.done():
            self.done.set_result(value)

    def _exited(self) -> None:
        if self.gone is None:
            self.loop.remove_reader(self.conn.fileno())
            self.proc.join(timeout=5)
            self.exitcode = self.proc.exitcode
            self.gone = WorkerDied(self.exitcode, role=self.role)


class ProcessWorkers(WorkerPool):
    """Worker processes (module docstring) in the pool of :class:`WorkerPool`."""

    def __init__(self, size: int, role: str = "reward") -> None:
        super().__init__(size, role)
        self._ctx = multiprocessing.get_context("spawn")

    def _spawn(self, loop: asyncio.AbstractEventLoop) -> Link:
        return _Process(loop, self._ctx, self.role)

    def _broken(self, num_failed: int, error: BaseException) -> WorkerDied:
        """Workers die before they can start (a ``__main__`` a spawned process cannot import,
        an interpreter that fails at start-up)."""
        return WorkerDied(
            getattr(error, "exitcode", None), f"processes died before they were ready, "
            f"{num_failed} in a row (is the program's __main__ importable by a spawned "
            f"process? a script read from stdin is not)", self.role)


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


def setup_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """``fn.setup(*args)`` when ``fn`` has one: what the call needs that is not its work (a
    reward's ``@reward_setup``: an import, a grader built from the task), run by the worker
    before it says "started", so the call's timeout does not count it. A failure here is left to
    the call, which meets it again and reports it."""
    setup = getattr(fn, "setup", None)
    if setup is not None:
        with contextlib.suppress(Exception):
            setup(*args)


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
        setup_call(fn, args)
        conn.send(("started", None))
        conn.send(("done", fn(*args)))
