"""Limits per sandbox: one cgroup per sandbox bounds the memory and the processes of all its
processes together (its programs, what they fork, the files they leave in its tmpfs).

``find_cgroups()`` picks the mechanism once, at pool start, in this order:

* cgroup v2, where the pool's own cgroup offers the ``memory`` and ``pids`` controllers and
  may hand them to children (its ``cgroup.subtree_control`` takes ``+memory +pids``: a
  cgroup that holds processes itself, other than the root, may not, so a process in a
  systemd service usually falls through);
* cgroup v1, where a ``memory`` and a ``pids`` hierarchy are mounted and the pool's cgroups in
  them are writable (root, typically);
* else None: the per-process rlimits (``SandboxLimits``) are all there is, and ``SandboxPool``
  warns once, naming why.

Each sandbox gets ``<the pool's cgroup>/<name>`` in each hierarchy. Its process enters it
before exec (so everything it starts is inside); once the executor is ready, the limits are
set on top of what the executor itself uses, so ``memory_mb`` and ``max_procs`` are the
programs' share. The kernel counts what it refused (``oom_kill``, pids ``max``), which is how a
run's result names the limit it hit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REMOVE_TIMEOUT_S = 5.0  # for the processes of a closed sandbox to leave its cgroup


@dataclass(slots=True, kw_only=True, frozen=True)
class CgroupRoots:
    """Where the sandboxes' cgroups are made: the pool's own cgroup in each hierarchy."""

    version: int  # 1 or 2
    memory: Path
    pids: Path  # the same folder as ``memory`` in v2

    @property
    def name(self) -> str:
        return f"cgroup v{self.version}"


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root of the mount, fs type, super options) of each cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, tail = line.partition(" - ")
            fstype, _source, options = (tail.split() + ["", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                parts = fields.split()
                found.append((parts[4], parts[3], fstype, set(options.split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path (``/proc/self/cgroup``)."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _folder(mount_point: str, mount_root: str, path: str) -> Path:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path
    return Path(mount_point, relative.lstrip("/")).resolve()


def _probe(folder: Path) -> None:
    """Raise OSError unless a child cgroup can be made and removed in ``folder``."""
    probe = folder / f"rollstream-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    probe.mkdir()
    probe.rmdir()


def _v2(mounts: list, own: dict[str, str]) -> CgroupRoots:
    mount = next((m for m in mounts if m[2] == "cgroup2"), None)
    if mount is None or "" not in own:
        raise OSError("no cgroup v2 mount")
    folder = _folder(mount[0], mount[1], own[""])
    offered = set((folder / "cgroup.controllers").read_text().split())
    if not {"memory", "pids"} <= offered:
        raise OSError(f"cgroup v2 at {folder} offers {' '.join(sorted(offered)) or 'nothing'}, "
                      "not memory and pids")
    enabled = set((folder / "cgroup.subtree_control").read_text().split())
    if not {"memory", "pids"} <= enabled:
        (folder / "cgroup.subtree_control").write_text("+memory +pids")
    _probe(folder)
    return CgroupRoots(version=2, memory=folder, pids=folder)


def _v1(mounts: list, own: dict[str, str]) -> CgroupRoots:
    folders = {}
    for controller in ("memory", "pids"):
        mount = next((m for m in mounts if m[2] == "cgroup" and controller in m[3]), None)
        if mount is None or controller not in own:
            raise OSError(f"no cgroup v1 {controller} hierarchy")
        folders[controller] = _folder(mount[0], mount[1], own[controller])
        _probe(folders[controller])
    return CgroupRoots(version=1, memory=folders["memory"], pids=folders["pids"])


def find_cgroups() -> tuple[CgroupRoots | None, str]:
    """The cgroups sandboxes can get (module docstring), or None and why not."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as e:
        return None, f"cgroups unreadable ({e})"
    reasons = []
    for find in (_v2, _v1):
        try:
            return find(mounts, own), ""
        except OSError as e:
            reasons.append(str(e))
    return None, "; ".join(reasons)


def _counter(path: Path, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class SandboxCgroup:
    """One sandbox's cgroup (module docstring); ``create``, ``enter`` in its first process,
    ``limit`` once it is ready, ``remove`` after it is closed."""

    def __init__(self, roots: CgroupRoots, name: str) -> None:
        self.roots = roots
        self.memory, self.pids = roots.memory / name, roots.pids / name
        self._folders = list(dict.fromkeys([self.memory, self.pids]))

    def create(self) -> None:
        self.remove()  # a previous one of that name, left by a crash
        for folder in self._folders:
            folder.mkdir()

    def enter(self) -> None:
        """In the sandbox's first process, before exec: everything it starts is inside."""
        for folder in self._folders:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def limit(self, *, memory_bytes: int, num_procs: int) -> None:
        """Bound the sandbox to what it uses now (the executor) plus these."""
        v1 = self.roots.version == 1
        used = int((self.memory / ("memory.usage_in_bytes" if v1 else "memory.current"))
                   .read_text())
        (self.memory / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(
            str(used + memory_bytes))
        swap = self.memory / ("memory.memsw.limit_in_bytes" if v1 else "memory.swap.max")
        if swap.exists():  # no swap either: the limit is on memory, not on RAM alone
            swap.write_text(str(used + memory_bytes) if v1 else "0")
        running = int((self.pids / "pids.current").read_text())
        (self.pids / "pids.max").write_text(str(running + num_procs))

    def refusals(self) -> tuple[int, int]:
        """(processes killed for memory, forks refused) so far."""
        events = "memory.oom_control" if self.roots.version == 1 else "memory.events"
        return (_counter(self.memory / events, "oom_kill"),
                _counter(self.pids / "pids.events", "max"))

    def remove(self) -> None:
        """Kill whatever is left in it, then remove it (its processes take a moment to go)."""
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        for folder in self._folders:
            while folder.exists():
                with contextlib.suppress(OSError):
                    for pid in (folder / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    folder.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
