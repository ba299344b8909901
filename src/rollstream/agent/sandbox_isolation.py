"""How a sandbox is isolated: the command that starts ``sandbox_executor.py`` inside namespaces.

Two backends, picked by ``pick_isolation(backend)`` (``auto``: bubblewrap when it is on the
PATH, else ``unshare``):

* ``bwrap`` (bubblewrap): its own PID, network, IPC, UTS (and cgroup) namespaces, a read-only
  root of its own with the host's ``/usr`` and Python read-only, the working directory at
  ``/work``, a private ``/tmp`` and ``/dev/shm``, the artifact cache read-only at
  ``/artifacts``, the allow-list's sockets read-only at ``/net``.
* ``unshare`` (util-linux, for machines without bubblewrap): its own PID (with its own
  ``/proc``), network (loopback up), IPC, UTS and mount namespaces, a user namespace too when
  not run as root (``--map-root-user``). Every folder all users may write to (``/tmp``,
  ``/var/tmp``, ``/dev/shm``, ``/run/lock``, those that exist) is private, and the sandbox's
  own folders are under ``/tmp/.sandbox``: ``work`` (the working directory), ``artifacts`` and
  ``net`` (read-only); run as root with a Python under a folder others may not enter
  (``/root``), a tmpfs on that folder holds only Python. What it does not give, compared with
  bwrap: the rest of the host's file system is seen as it is, not a minimal read-only view (a
  program reads what its uid may read, and writes where its uid may write: run as root, that
  is only the folders above, which are private; run as another user, the program has that
  user's rights on the host's files); no cgroup namespace; the executor is the namespace's
  init (PID 1).

Both backends start the executor in two steps. First, as root of the fresh namespaces
(``sandbox_executor._enter``), it mounts one tmpfs of ``disk_bytes`` and binds folders of it on
the working directory and on every private scratch folder, so that everything a sandbox may
write shares one size cap. Then ``setpriv`` drops to the executor's own privileges: run as
root, the executor's uid (``executor_uid``) keeps only ``CAP_SETUID``, ``CAP_SETGID`` (to start
programs under their uid, ``uid``) and ``CAP_KILL`` (to end them); run as another user, one uid
serves both and every capability goes. The environment is the caller's to give: ``Sandbox``
passes a minimal one. The executor's source travels in its command line (``executor_code``):
a sandbox has no rollstream to import.
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
CONFINE = Path(__file__).with_name("sandbox_confine.py")  # the executor imports it


class SandboxError(RuntimeError):
    """A sandbox could not be started (its isolation tool missing or refused)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxSpec:
    """What one sandbox is made of, in host paths."""

    artifacts: Path | None  # the read-only cache shared by all sandboxes
    uid: int | None  # the uid programs run under (root only); None: the caller's own
    executor_uid: int | None  # the executor's, another one (root only)
    disk_bytes: int  # the size of the one tmpfs behind every folder it may write
    nproc: int | None  # RLIMIT_NPROC of each program (root only: per uid, so per sandbox)
    netdir: Path | None = None  # the allow-list's Unix sockets (``sandbox_net``)
    sockets: tuple[tuple[int, Path], ...] = ()  # (port inside, its socket in ``netdir``)


class Isolation(Protocol):
    name: str
    work: str  # the working directory, as programs see it

    def command(self, spec: SandboxSpec) -> list[str]:
        """The argv that starts the executor isolated as ``spec`` says."""
        ...


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"sandboxes need `{name}`: install it (Debian: apt-get install "
                           f"{package})")
    return path


def python_executable() -> str:
    """The base interpreter (a venv's python would need the venv, which holds our code)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def executor_code() -> str:
    """The ``-c`` program: the executor's two stdlib-only modules, defined from their source (a
    sandbox has no rollstream to import), then its ``main``."""
    modules = [("sandbox_confine", CONFINE.read_text()),
               ("sandbox_executor", EXECUTOR.read_text())]
    return ("import sys, types\n"
            f"for name, source in {modules!r}:\n"
            "    module = sys.modules[name] = types.ModuleType(name)\n"
            "    exec(compile(source, name + '.py', 'exec'), module.__dict__)\n"
            "sys.modules['sandbox_executor'].main()\n")


def _executor(spec: SandboxSpec, *, workdir: str, scratch: list[str], keep: list[str],
              netdir: str) -> list[str]:
    """The executor, told where its folders are, as seen inside (``sandbox_executor.main``)."""
    forward = [[port, f"{netdir}/{path.name}"] for port, path in spec.sockets]
    layout = {"workdir": workdir, "scratch": scratch, "keep": keep, "forward": forward,
              "uid": spec.uid, "nproc": spec.nproc}
    return [python_executable(), "-I", "-S", "-c", executor_code(), json.dumps(layout)]


def _enter(spec: SandboxSpec, *, work: str, scratch: list[str], tmpfs: list, binds: list,
           loopback: bool) -> list[str]:
    """The first step, as root of the namespaces (``sandbox_executor._enter``): ``scratch``
    (``/tmp`` first) and ``work`` on one tmpfs of ``disk_bytes``, ``work`` owned by the
    programs' uid; the extra ``tmpfs`` and the ``binds``; the loopback up if asked."""
    setup = {"disk_bytes": spec.disk_bytes, "scratch": scratch, "work": work,
             "owner": spec.uid, "tmpfs": tmpfs, "binds": binds, "loopback": loopback}
    return [python_executable(), "-I", "-S", "-c", executor_code(), "--enter", json.dumps(setup)]


# as root, what the executor keeps: start programs under their uid, and end them
EXECUTOR_CAPS = "setuid,setgid,kill"


def _drop_privileges(setpriv: str, spec: SandboxSpec) -> list[str]:
    """The executor's privileges. As root: its own uid, no groups, only ``EXECUTOR_CAPS``
    (ambient, so that they survive the exec; the executor clears them in each program). As
    another user: no capabilities at all."""
    if spec.executor_uid is None:
        return [setpriv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
                "--no-new-privs", "--"]
    uid, keep = spec.executor_uid, f"-all,+{EXECUTOR_CAPS.replace(',', ',+')}"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", f"--inh-caps={keep}",
            f"--ambient-caps={keep}", f"--bounding-set={keep}", "--no-new-privs", "--"]


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


# what the first step needs: CAP_SYS_ADMIN to mount, CAP_SETPCAP to empty the bounding set (the
# executor is uid 0 of a user namespace when not run as root: an exec would give it back the
# rest); as root also CAP_CHOWN (the working directory goes to the programs' uid) and the
# executor's own, which it keeps
ENTER_CAPS = ("CAP_SYS_ADMIN", "CAP_SETPCAP", "CAP_CHOWN", "CAP_SETUID", "CAP_SETGID",
              "CAP_KILL")


@dataclass(slots=True, frozen=True)
class Bubblewrap:
    """A read-only root of its own: only the system, Python and the sandbox's folders."""

    bwrap: str
    setpriv: str
    name: str = "bwrap"
    work: str = "/work"

    def command(self, spec: SandboxSpec) -> list[str]:
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid",
                "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += _system_mounts()
        argv += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--dir", self.work]
        if spec.artifacts is not None:
            argv += ["--ro-bind", str(spec.artifacts), "/artifacts"]
        if spec.netdir is not None:
            argv += ["--ro-bind", str(spec.netdir), "/net"]
        # read-only: as another user, bwrap's root and /dev would be the program's to fill
        argv += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/"]
        if spec.executor_uid is None:  # root of the user namespace, or it could not mount
            argv += ["--unshare-user", "--uid", "0", "--gid", "0"]
        for cap in ENTER_CAPS if spec.executor_uid is not None else ENTER_CAPS[:2]:
            argv += ["--cap-add", cap]
        scratch = ["/tmp", "/dev/shm"]
        argv += ["--", *_enter(spec, work=self.work, scratch=scratch, tmpfs=[], binds=[],
                               loopback=False)]
        argv += _drop_privileges(self.setpriv, spec)
        return argv + _executor(spec, workdir=self.work, scratch=[self.work, *scratch],
                                keep=[], netdir="/net")


UNSHARE_ROOT = "/tmp/.sandbox"  # where the sandbox's own folders are bound (unshare)
SHARED_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # writable by all, if present


@dataclass(slots=True, frozen=True)
class Unshare:
    """Namespaces from util-linux's ``unshare`` and a private tmpfs on every shared scratch
    folder; the host's files otherwise seen as they are (see the module docstring)."""

    unshare: str
    setpriv: str
    name: str = "unshare"
    work: str = f"{UNSHARE_ROOT}/work"

    def command(self, spec: SandboxSpec) -> list[str]:
        scratch = [d for d in SHARED_SCRATCH if os.path.isdir(d) and not os.path.islink(d)
                   and os.stat(d).st_mode & 0o002]
        assert scratch[0] == "/tmp", "the sandbox's folders are bound under /tmp"
        tmpfs, binds = [], []
        if spec.artifacts is not None:
            binds.append([str(spec.artifacts), f"{UNSHARE_ROOT}/artifacts", True])
        if spec.netdir is not None:
            binds.append([str(spec.netdir), f"{UNSHARE_ROOT}/net", True])
        prefix = Path(sys.base_prefix).resolve()
        closed = [p for p in reversed(prefix.parents[:-1]) if not p.stat().st_mode & 0o001]
        if closed and spec.uid is not None:
            # Python under a folder others may not enter (a pyenv in /root, 0700): a tmpfs on
            # that folder with only Python in it, as bwrap builds it (and /root's files hidden)
            tmpfs.append([str(closed[0]), "0755"])
            binds.append([str(prefix), str(prefix), True])
        # --pdeathsig: unshare dies with this process; --kill-child: the namespace with unshare
        argv = [self.setpriv, "--pdeathsig", "KILL", "--", self.unshare, "--fork",
                "--kill-child", "--pid", "--mount-proc", "--net", "--ipc", "--uts"]
        if spec.uid is None:
            argv.append("--map-root-user")
        argv += ["--", *_enter(spec, work=self.work, scratch=scratch, tmpfs=tmpfs, binds=binds,
                               loopback=True)]
        argv += _drop_privileges(self.setpriv, spec)
        # UNSHARE_ROOT is cleaned too: a program run as the namespace's root may write in it
        mounts = [f"{UNSHARE_ROOT}/{name}" for name in ("work", "artifacts", "net")]
        return argv + _executor(spec, workdir=mounts[0],
                                scratch=[mounts[0], *scratch, UNSHARE_ROOT],
                                keep=[UNSHARE_ROOT, *mounts], netdir=mounts[2])


BACKENDS = ("auto", "bwrap", "unshare")


def pick_isolation(backend: str) -> Isolation:
    """The backend named (``auto``: bubblewrap if found, else unshare); a clear error when its
    tools are missing."""
    if backend not in BACKENDS:
        raise ValueError(f"SandboxPool.backend must be one of {', '.join(BACKENDS)}, "
                         f"got {backend!r}")
    if backend == "auto":
        if shutil.which("bwrap"):
            backend = "bwrap"
        elif shutil.which("unshare"):
            backend = "unshare"
        else:
            raise SandboxError("sandboxes need bubblewrap or util-linux's unshare, and neither "
                               "is on the PATH: install bubblewrap (Debian: apt-get install "
                               "bubblewrap; `make test` does so)")
    if backend == "bwrap":
        return Bubblewrap(_tool("bwrap", "bubblewrap"), _tool("setpriv", "util-linux"))
    return Unshare(_tool("unshare", "util-linux"), _tool("setpriv", "util-linux"))
