"""Sandboxes: isolated, resettable execution of untrusted code (tool calls, code rewards).

A sandbox is a process in namespaces of its own (PID, network, IPC, UTS), made by bubblewrap
(``bwrap``) or, where it is missing, util-linux's ``unshare`` (``backend``; the command lines
and what ``unshare`` does not give are in ``sandbox_isolation``). With bwrap: no network (a fresh
network namespace has only its own loopback) but the endpoints of its allow-list, if any
(``allow_net``, ``sandbox_net``: reached inside at ``127.0.0.1:PORT``), the host's ``/usr``
and Python read-only, a private working directory at ``/work``, a private ``/tmp``, and an
optional read-only artifact cache at ``/artifacts`` shared by every sandbox. Inside it runs
``sandbox_executor.py``, which takes one program at a time, runs it in a fresh interpreter
under CPU-time, memory, file-size and wall-time limits, and afterwards kills every process the
program left and empties ``/work`` and ``/tmp``: a sandbox is warm (no start cost) and reset
between uses.

Processes: run as root (CI, containers), each sandbox's programs run under a uid of their own
(``uid_base + slot``), so ``RLIMIT_NPROC`` counts only that sandbox's processes and a fork bomb
stops at ``max_procs``. Run as another user, bwrap makes a user namespace instead and the
process limit counts all of that user's processes (the limit is set that far above the
current count). Cleanup is guaranteed by the kernel: when the sandbox's init dies (bwrap's,
or with ``unshare`` the executor itself) every process of the namespace dies with it, and it
dies with this process (``--die-with-parent``; ``setpriv --pdeathsig`` and ``unshare
--kill-child``).

``SandboxPool`` keeps ``size`` warm sandboxes and hands one to each ``run``; a sandbox that
stops answering (its executor killed, or wedged past the wall limit) is killed and replaced,
and that run returns with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

from rollstream.agent.sandbox_isolation import Isolation, SandboxError, SandboxSpec, pick_isolation
from rollstream.agent.sandbox_net import Endpoint, NetBridge, parse_allow_net

READY_TIMEOUT_S = 30.0
REPLY_GRACE_S = 10.0  # on top of the wall limit, for the executor's cleanup


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxLimits:
    """What one program may use."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512  # address space of the program's interpreter
    max_procs: int = 16  # processes and threads of the program together
    file_size_mb: int = 16  # the largest file it may write
    max_output_bytes: int = 65536  # of stdout and of stderr each; the rest is cut

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_procs", "file_size_mb",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxResult:
    exit_code: int | None  # None: it was stopped before it exited
    stdout: str
    stderr: str
    error: str | None  # why it was stopped or hit a limit (None: it ran and exited)
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                count += os.stat(f"/proc/{entry}").st_uid == uid
    return count


class Sandbox:
    """One warm sandbox; runs one program at a time (``SandboxPool`` sees to that)."""

    def __init__(self, *, slot: int, root: Path, limits: SandboxLimits, isolation: Isolation,
                 artifacts: Path | None, uid_base: int, allow_net: tuple[Endpoint, ...]) -> None:
        self.slot, self.limits, self.isolation = slot, limits, isolation
        self.workdir = root / f"work-{slot}"
        self.log_path = root / f"sandbox-{slot}.log"
        self._artifacts = artifacts
        self._as_root = os.geteuid() == 0
        self._uid = uid_base + slot if self._as_root else os.geteuid()
        self._proc: asyncio.subprocess.Process | None = None
        self._bridge = NetBridge(allow_net, root / f"net-{slot}") if allow_net else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _argv(self) -> list[str]:
        bridge = self._bridge
        return self.isolation.command(SandboxSpec(
            workdir=self.workdir, artifacts=self._artifacts,
            uid=self._uid if self._as_root else None,
            netdir=None if bridge is None else bridge.folder,
            sockets=() if bridge is None else tuple(bridge.sockets())))

    def _limit_processes(self) -> None:
        """In the child before exec: the process limit, inherited by the executor."""
        import resource

        extra = 0 if self._as_root else _processes_of(self._uid)
        extra += self._bridge is not None  # the executor's thread for the allow-list
        n = self.limits.max_procs + 1 + extra  # + 1: the executor itself
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            os.chown(self.workdir, self._uid, self._uid)
        if self._bridge is not None:
            try:
                await self._bridge.start()
            except BaseException:
                await self._bridge.close()
                raise
        log = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 - the child holds it
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, start_new_session=True, preexec_fn=self._limit_processes,
                limit=4 * self.limits.max_output_bytes + (1 << 20))
        finally:
            log.close()
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if not line.startswith(b'{"ready"'):
            await self.close()
            raise SandboxError(f"sandbox {self.slot} ({self.isolation.name}) did not start: "
                               f"{self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:].strip() or "(no output)"
        return "(no log)"

    async def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        """Run ``code`` (a Python program) in the sandbox; a sandbox that does not answer is
        killed (the caller replaces it) and the result says so."""
        assert self.alive, "run() on a sandbox that is not running"
        request = {"code": code, "stdin": stdin, "limits": asdict(self.limits)}
        start = time.monotonic()
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        why = "died"  # its reply channel closed (EOF), or its stdin did
        try:
            await self._proc.stdin.drain()
            line = await asyncio.wait_for(self._proc.stdout.readline(),
                                          self.limits.wall_s + REPLY_GRACE_S)
        except TimeoutError:
            line, why = b"", "stopped answering"
        except ConnectionError:
            line = b""
        except asyncio.CancelledError:  # its reply would be read as the next run's
            await asyncio.shield(self.close())
            raise
        if not line:
            await self.close()
            return SandboxResult(exit_code=None, stdout="", stderr="",
                                 error=f"sandbox {why} (killed; a fresh one replaces it)",
                                 duration_s=time.monotonic() - start)
        reply = json.loads(line)
        return SandboxResult(exit_code=reply["exit_code"], stdout=reply["stdout"],
                             stderr=reply["stderr"], error=reply["error"],
                             duration_s=reply["duration_s"])

    async def close(self) -> None:
        """Kill the sandbox and every process in it (the namespace dies with its init)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if self._bridge is not None:  # after the sandbox: none of its connections is left
            await self._bridge.close()
        if self._as_root:  # the namespace's processes die with its init: wait until they have
            deadline = time.monotonic() + 10.0
            while _processes_of(self._uid) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)


class SandboxPool:
    """``size`` warm sandboxes; ``run`` takes a free one, waiting when all are busy.

    ``backend``: ``auto`` (bubblewrap when on the PATH, else ``unshare``), ``bwrap`` or
    ``unshare`` (``sandbox_isolation``). ``allow_net``: the ``IP:PORT`` endpoints its programs
    may connect to, each at ``127.0.0.1:PORT`` inside (``sandbox_net``); empty: no network at
    all."""

    def __init__(self, size: int = 2, *, limits: SandboxLimits | None = None,
                 artifacts: Path | str | None = None, uid_base: int = 61000,
                 backend: str = "auto", allow_net: Sequence[str] = ()) -> None:
        if size < 1:
            raise ValueError(f"SandboxPool size must be >= 1, got {size}")
        if artifacts is not None:
            if not Path(artifacts).is_dir():
                raise ValueError(f"sandbox artifacts {artifacts} is not a folder")
            if os.geteuid() == 0 and Path(artifacts).stat().st_mode & 0o005 != 0o005:
                raise ValueError(f"sandbox artifacts {artifacts} must be readable by others "
                                 "(chmod o+rx): sandboxed programs run under uids of their own")
        endpoints = parse_allow_net(allow_net)
        self.isolation = pick_isolation(backend)
        self.limits = limits or SandboxLimits()
        self._root = Path(tempfile.mkdtemp(prefix="rollstream-sandbox-"))
        self._sandboxes = [
            Sandbox(slot=i, root=self._root, limits=self.limits, isolation=self.isolation,
                    uid_base=uid_base, allow_net=endpoints,
                    artifacts=None if artifacts is None else Path(artifacts).resolve())
            for i in range(size)
        ]
        self._free: asyncio.Queue[Sandbox] = asyncio.Queue()
        for sandbox in self._sandboxes:
            self._free.put_nowait(sandbox)
        self.num_started = 0
        self._closed = False

    async def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        sandbox = await self._free.get()
        try:
            if not sandbox.alive:  # first use, or it was killed: a fresh one
                await sandbox.start()
                self.num_started += 1
            return await sandbox.run(code, stdin=stdin)
        finally:
            self._free.put_nowait(sandbox)

    async def close(self) -> None:
        self._closed = True
        for sandbox in self._sandboxes:
            await sandbox.close()
        shutil.rmtree(self._root, ignore_errors=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


@dataclass(slots=True, kw_only=True)
class PythonTool:
    """The built-in ``python`` tool: runs the model's program in a sandbox of ``pool``. What
    the model reads is the program's stdout, then its stderr and why it was stopped, if so
    (a traceback is an answer the model learns from, not a failed call)."""

    pool: SandboxPool
    name: str = "python"
    description: str = ("Run a Python program in a sandbox (no network, limited time and "
                        "memory) and return what it prints.")
    parameters: dict = field(default_factory=lambda: {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program"}},
        "required": ["code"],
    })

    async def __call__(self, code: str) -> str:
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        result = await self.pool.run(code)
        parts = [result.stdout] if result.stdout else []
        if result.stderr and not result.ok:
            parts.append(result.stderr)
        if result.error is not None:
            parts.append(f"[stopped: {result.error}]")
        elif result.exit_code:
            parts.append(f"[exit code {result.exit_code}]")
        return "\n".join(p.rstrip("\n") for p in parts)
