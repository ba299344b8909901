"""How a sandbox is isolated: the command that starts ``sandbox_executor.py`` inside namespaces.

One backend so far, picked by ``pick_isolation(backend)``:

* ``bwrap`` (bubblewrap): its own PID, network, IPC, UTS (and cgroup) namespaces, a root of its
  own with the host's ``/usr`` and Python read-only, the working directory at ``/work``, a
  private ``/tmp``, the artifact cache read-only at ``/artifacts``, the allow-list's sockets
  read-only at ``/net``.

A backend only builds the command line; the limits are the same for every backend, set by
``Sandbox`` (the process limit, before exec) and by the executor (CPU time, memory, file size,
wall time), and the executor does the cleaning after each run. Run as root, the program drops
to a uid of its own through util-linux's ``setpriv``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

EXECUTOR = Path(__file__).with_name("sandbox_executor.py")


class SandboxError(RuntimeError):
    """A sandbox could not be started (its isolation tool missing or refused)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxSpec:
    """What one sandbox is made of, in host paths."""

    workdir: Path  # the program's private working directory
    artifacts: Path | None  # the read-only cache shared by all sandboxes
    uid: int | None  # the uid programs run under (root only); None: the caller's own
    netdir: Path | None = None  # the allow-list's Unix sockets (``sandbox_net``)
    sockets: tuple[tuple[int, Path], ...] = ()  # (port inside, its socket in ``netdir``)


class Isolation(Protocol):
    name: str

    def command(self, spec: SandboxSpec) -> list[str]:
        """The argv that starts the executor isolated as ``spec`` says."""
        ...


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"sandboxes need `{name}`: install it (Debian: apt-get install "
                           f"{package})")
    return path


def _python() -> str:
    """The base interpreter (a venv's python would need the venv, which holds our code)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _executor(spec: SandboxSpec, *, workdir: str, scratch: list[str], keep: list[str],
              netdir: str) -> list[str]:
    """The executor, told where its folders are, as seen inside (``sandbox_executor.main``)."""
    forward = [[port, f"{netdir}/{path.name}"] for port, path in spec.sockets]
    layout = {"workdir": workdir, "scratch": scratch, "keep": keep, "forward": forward}
    return [_python(), "-I", "-S", "-c", EXECUTOR.read_text(), json.dumps(layout)]


def _drop_privileges(setpriv: str, uid: int | None) -> list[str]:
    """As root: the program's own uid, no groups, no capabilities it could regain by exec."""
    ids = [] if uid is None else [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [setpriv, *ids, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def _system_mounts() -> list[str]:
    """The host's programs and libraries, read-only; Python from wherever it lives."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.exists():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = Path(sys.base_prefix).resolve()
    if not prefix.is_relative_to("/usr"):  # e.g. /root/.pyenv/...: its parents traversable
        for parent in reversed(prefix.parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(prefix), str(prefix)]
    return args


@dataclass(slots=True, frozen=True)
class Bubblewrap:
    """A root of its own: only the system, Python and the sandbox's folders are there."""

    bwrap: str
    setpriv: str | None  # needed as root only
    name: str = "bwrap"

    def command(self, spec: SandboxSpec) -> list[str]:
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid",
                "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += _system_mounts()
        argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp",
                 "--bind", str(spec.workdir), "/work", "--chdir", "/work"]
        if spec.artifacts is not None:
            argv += ["--ro-bind", str(spec.artifacts), "/artifacts"]
        if spec.netdir is not None:
            argv += ["--ro-bind", str(spec.netdir), "/net"]
        if spec.uid is not None:  # bwrap keeps root; the program gets a uid of its own
            assert self.setpriv is not None
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                     *_drop_privileges(self.setpriv, spec.uid)]
        else:
            argv += ["--unshare-user", "--"]
        return argv + _executor(spec, workdir="/work", scratch=["/work", "/tmp"], keep=[],
                                netdir="/net")


BACKENDS = ("auto", "bwrap")


def pick_isolation(backend: str) -> Isolation:
    """The backend named; ``auto``: bubblewrap. A clear error when its tools are missing."""
    if backend not in BACKENDS:
        raise ValueError(f"SandboxPool.backend must be one of {', '.join(BACKENDS)}, "
                         f"got {backend!r}")
    setpriv = _tool("setpriv", "util-linux") if os.geteuid() == 0 else None
    return Bubblewrap(_tool("bwrap", "bubblewrap"), setpriv)
