"""Sandboxes: isolated, resettable execution of untrusted code (tool calls, code rewards).

A sandbox is a process in namespaces of its own (PID, network, IPC, UTS, mount), made by
bubblewrap (``bwrap``) or, where it is missing, util-linux's ``unshare`` (``backend``; the
command lines and what ``unshare`` does not give are in ``sandbox_isolation``). With bwrap: no
network (a fresh network namespace has only its own loopback) but the endpoints of its
allow-list, if any (``allow_net``, ``sandbox_net``: reached inside at ``127.0.0.1:PORT``), a
read-only root with the host's ``/usr`` and Python, a private working directory at ``/work``,
a private ``/tmp`` and ``/dev/shm``, and an optional read-only artifact cache at ``/artifacts``
shared by every sandbox. Inside it runs ``sandbox_executor.py``, which takes one program at a
time, runs it in a fresh interpreter under CPU-time, memory, file-size and wall-time limits,
and afterwards kills every process the program left and empties its folders: a sandbox is
warm (no start cost) and reset between uses.

What a program cannot reach (docs/agents.md, Sandboxes, has the whole list, per backend):

* secrets: the executor and every program start with a minimal environment (``PATH``,
  ``LANG``, ``HOME`` = the working directory) plus the variables named in ``pass_env``;
* its executor, which serves the sandbox's later programs: run as root (CI, containers), the
  programs of slot ``s`` run as ``uid_base + s`` and its executor as ``uid_base +
  EXECUTOR_UID_OFFSET + s``; run as another user, one uid serves both (a user namespace maps
  only one), so the executor is non-dumpable and programs run under a seccomp filter that
  refuses ``ptrace``, access to another process's memory and signals to the executor (the
  filter is there as root too);
* more than its share: memory and processes are bounded per sandbox, over all its processes
  together, by a cgroup (``sandbox_cgroup``: v2, else v1) where the machine gives one, else by
  per-process rlimits (the pool warns once, at start, saying so); what it may write, by the one
  tmpfs of ``disk_mb`` behind all its writable folders.

Cleanup is guaranteed by the kernel: when the sandbox's init dies (bwrap's, or with
``unshare`` the executor itself) every process of the namespace dies with it, and it dies with
this process (``--die-with-parent``; ``setpriv --pdeathsig`` and ``unshare --kill-child``).

``SandboxPool`` keeps ``size`` warm sandboxes and hands one to each ``run``; a sandbox that
stops answering (its executor killed, or wedged past the wall limit) is killed and replaced,
and that run returns with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

from rollstream.agent.sandbox_cgroup import CgroupRoots, SandboxCgroup, find_cgroups
from rollstream.agent.sandbox_isolation import (
    Isolation,
    SandboxError,
    SandboxSpec,
    pick_isolation,
    python_executable,
)
from rollstream.agent.sandbox_net import Endpoint, NetBridge, parse_allow_net

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
REPLY_GRACE_S = 10.0  # on top of the wall limit, for the executor's cleanup
EXECUTOR_UID_OFFSET = 1000  # as root: slot s's executor runs as uid_base + this + s
# every character of output may be written as a 6-byte JSON escape, in stdout and stderr
REPLY_BYTES_PER_OUTPUT_BYTE = 12


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxLimits:
    """What a sandbox's program may use. Memory and processes count every process of the
    sandbox together where a cgroup is in force (``SandboxPool.limits_enforced_by``), else
    per process (memory) and per uid (processes)."""

    wall_s: float = 10.0
    cpu_s: float = 5.0  # per process
    memory_mb: int = 512  # all of it together (the files it keeps in ``disk_mb`` included),
    # and each process's address space
    max_procs: int = 16  # processes and threads, together
    file_size_mb: int = 16  # the largest file it may write
    disk_mb: int = 32  # what its writable folders may hold together (one tmpfs)
    max_output_bytes: int = 65536  # of stdout and of stderr each; the rest is cut

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_procs", "file_size_mb", "disk_mb",
                     "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.file_size_mb > self.disk_mb:
            raise ValueError(f"SandboxLimits.file_size_mb ({self.file_size_mb}) must be <= "
                             f"disk_mb ({self.disk_mb}): no file can be larger than the disk")


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


def process_uid(pid: str) -> int | None:
    """The real uid of a process (its ``/proc`` folder's owner is root when it is
    non-dumpable, as an executor is), or None once it is gone."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    return None


def _processes_of(uids: Sequence[int]) -> int:
    return sum(process_uid(p) in uids for p in os.listdir("/proc") if p.isdigit())


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def sandbox_env(pass_env: Sequence[str]) -> dict[str, str]:
    """The variables a sandbox gets besides ``PATH``, ``LANG`` and ``HOME``: those named, with
    this process's values; a clear error for a name that is malformed or not set."""
    if isinstance(pass_env, str) or not isinstance(pass_env, Sequence):
        raise TypeError(f"SandboxPool.pass_env must be a list of variable names, got "
                        f"{type(pass_env).__name__}")
    env = {}
    for i, name in enumerate(pass_env):
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise ValueError(f"SandboxPool.pass_env[{i}] {name!r} is not a variable name "
                             "(letters, digits and _, not starting with a digit)")
        if name not in os.environ:
            raise ValueError(f"SandboxPool.pass_env[{i}] {name!r} is not set in this process's "
                             "environment")
        env[name] = os.environ[name]
    return env


class Sandbox:
    """One warm sandbox; runs one program at a time (``SandboxPool`` sees to that)."""

    def __init__(self, *, slot: int, root: Path, limits: SandboxLimits, isolation: Isolation,
                 artifacts: Path | None, uid_base: int, allow_net: tuple[Endpoint, ...],
                 env: dict[str, str], cgroups: CgroupRoots | None) -> None:
        self.slot, self.limits, self.isolation = slot, limits, isolation
        self.log_path = root / f"sandbox-{slot}.log"
        self._artifacts = artifacts
        self._as_root = os.geteuid() == 0
        self._uids = ((uid_base + slot, uid_base + EXECUTOR_UID_OFFSET + slot) if self._as_root
                      else (os.geteuid(),))
        bin_dir = os.path.dirname(python_executable())
        self._env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                     "HOME": isolation.work, **env}
        self._proc: asyncio.subprocess.Process | None = None
        self._bridge = NetBridge(allow_net, root / f"net-{slot}") if allow_net else None
        self._cgroup = None if cgroups is None else SandboxCgroup(cgroups, f"{root.name}-{slot}")

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _argv(self) -> list[str]:
        bridge, limits = self._bridge, self.limits
        return self.isolation.command(SandboxSpec(
            artifacts=self._artifacts, disk_bytes=limits.disk_mb << 20,
            uid=self._uids[0] if self._as_root else None,
            executor_uid=self._uids[1] if self._as_root else None,
            nproc=limits.max_procs if self._as_root else None,
            netdir=None if bridge is None else bridge.folder,
            sockets=() if bridge is None else tuple(bridge.sockets())))

    def _preexec(self) -> None:
        """In the child before exec: into the sandbox's cgroup; run as another user, the
        process limit (per uid: set that far above what the uid runs already)."""
        if self._cgroup is not None:
            self._cgroup.enter()
        if not self._as_root:
            import resource

            extra = _processes_of(self._uids)
            extra += self._bridge is not None  # the executor's thread for the allow-list
            n = self.limits.max_procs + 1 + extra  # + 1: the executor itself
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))

    async def start(self) -> None:
        if self._cgroup is not None:
            self._cgroup.create()
        if self._bridge is not None:
            try:
                await self._bridge.start()
            except BaseException:
                await self._bridge.close()
                raise
        log_file = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 - the child holds it
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log_file, start_new_session=True, preexec_fn=self._preexec,
                env=self._env, limit=REPLY_BYTES_PER_OUTPUT_BYTE * self.limits.max_output_bytes
                + (1 << 20))
        finally:
            log_file.close()
        try:  # a start that fails, or is cancelled, leaves nothing running
            try:
                line = await asyncio.wait_for(self._proc.stdout.readline(), READY_TIMEOUT_S)
            except TimeoutError:
                line = b""
            if not line.startswith(b'{"ready"'):
                raise SandboxError(f"sandbox {self.slot} ({self.isolation.name}) did not start: "
                                   f"{self._log_tail()}")
            if self._cgroup is not None:
                self._cgroup.limit(memory_bytes=self.limits.memory_mb << 20,
                                   num_procs=self.limits.max_procs)
        except BaseException:
            await asyncio.shield(self.close())
            raise

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:].strip() or "(no output)"
        return "(no log)"

    async def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        """Run ``code`` (a Python program) in the sandbox; a sandbox that does not answer is
        killed (the caller replaces it) and the result says so."""
        assert self.alive, "run() on a sandbox that is not running"
        request = {"code": code, "stdin": stdin, "limits": asdict(self.limits)}
        refused = (0, 0) if self._cgroup is None else self._cgroup.refusals()
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
        over = self._over_limit(refused)
        if not line:
            await self.close()
            return SandboxResult(exit_code=None, stdout="", stderr="",
                                 error=f"sandbox {why} (killed; a fresh one replaces it)"
                                 + (f": {over}" if over else ""),
                                 duration_s=time.monotonic() - start)
        reply = json.loads(line)
        error = reply["error"]
        if over and (error is None or error.startswith("killed by signal")):
            error = over
        return SandboxResult(exit_code=reply["exit_code"], stdout=reply["stdout"],
                             stderr=reply["stderr"], error=error,
                             duration_s=reply["duration_s"])

    def _over_limit(self, before: tuple[int, int]) -> str | None:
        """The sandbox-wide limit the cgroup enforced during the run, if any."""
        if self._cgroup is None:
            return None
        oom_kills, forks_refused = self._cgroup.refusals()
        if oom_kills > before[0]:
            return f"memory limit of {self.limits.memory_mb} MB exceeded"
        if forks_refused > before[1]:
            return f"process limit of {self.limits.max_procs} exceeded"
        return None

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
            while _processes_of(self._uids) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        if self._cgroup is not None:
            try:  # in a thread: its processes may take a moment to leave it
                await asyncio.to_thread(self._cgroup.remove)
            except OSError as e:  # a folder left in the cgroup tree, not a process
                log.warning("sandbox %d: its cgroup %s stays: %s", self.slot, self._cgroup.memory,
                            e)


class SandboxPool:
    """``size`` warm sandboxes; ``run`` takes a free one, waiting when all are busy.

    ``backend``: ``auto`` (bubblewrap when on the PATH, else ``unshare``), ``bwrap`` or
    ``unshare`` (``sandbox_isolation``). ``allow_net``: the ``IP:PORT`` endpoints its programs
    may connect to, each at ``127.0.0.1:PORT`` inside (``sandbox_net``); empty: no network at
    all. ``pass_env``: names of this process's environment variables that programs get too
    (nothing else of it). ``limits_enforced_by``: ``cgroup v2``, ``cgroup v1`` or ``rlimit``
    (module docstring)."""

    def __init__(self, size: int = 2, *, limits: SandboxLimits | None = None,
                 artifacts: Path | str | None = None, uid_base: int = 61000,
                 backend: str = "auto", allow_net: Sequence[str] = (),
                 pass_env: Sequence[str] = ()) -> None:
        if not 1 <= size <= EXECUTOR_UID_OFFSET:
            raise ValueError(f"SandboxPool size must be in 1..{EXECUTOR_UID_OFFSET}, got {size}")
        if artifacts is not None:
            if not Path(artifacts).is_dir():
                raise ValueError(f"sandbox artifacts {artifacts} is not a folder")
            if os.geteuid() == 0 and Path(artifacts).stat().st_mode & 0o005 != 0o005:
                raise ValueError(f"sandbox artifacts {artifacts} must be readable by others "
                                 "(chmod o+rx): sandboxed programs run under uids of their own")
        endpoints = parse_allow_net(allow_net)
        env = sandbox_env(pass_env)
        self.isolation = pick_isolation(backend)
        self.limits = limits or SandboxLimits()
        cgroups, why_not = find_cgroups()
        self.limits_enforced_by = "rlimit" if cgroups is None else cgroups.name
        if cgroups is None:
            log.warning("sandboxes: no cgroup for their memory and processes (%s); the limits "
                        "are per-process rlimits: memory_mb per process, max_procs per uid",
                        why_not)
        self._root = Path(tempfile.mkdtemp(prefix="rollstream-sandbox-"))
        self._sandboxes = [
            Sandbox(slot=i, root=self._root, limits=self.limits, isolation=self.isolation,
                    uid_base=uid_base, allow_net=endpoints, env=env, cgroups=cgroups,
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
