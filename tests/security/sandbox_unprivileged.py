"""Run a Python script as an unprivileged uid, for the sandbox tests that need the non-root
path (one uid for the executor and its programs) while CI runs as root.

The script runs in a mount namespace of its own where this Python and rollstream's source are
reachable by any uid: where they live under a folder others may not enter (a pyenv under
``/root``, 0700), a tmpfs on that folder holds only them, as the ``unshare`` backend does for
sandboxes. The host's files are not changed.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import rollstream

NOBODY = 65534
CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x00020000, 4096, 16384, 1 << 18
SRC = Path(rollstream.__file__).resolve().parents[1]
PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _closed_top(path: Path) -> Path | None:
    """The topmost folder above ``path`` that others may not enter."""
    return next((p for p in reversed(path.parents) if not p.stat().st_mode & 0o001), None)


def _mount(libc, source: bytes | None, target: str, fstype: bytes | None, flags: int,
           data: bytes | None = None) -> None:
    if libc.mount(source, target.encode(), fstype, flags, data) != 0:
        raise OSError(ctypes.get_errno(), f"mount on {target}")


def _enter_as(uid: int, needed: list[Path]):
    libc = ctypes.CDLL(None, use_errno=True)

    def enter() -> None:  # in the child, before exec
        if libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        tops = {top for path in needed if (top := _closed_top(path)) is not None}
        fds = [(os.open(p, os.O_PATH | os.O_DIRECTORY), p) for p in needed
               if any(p.is_relative_to(top) for top in tops)]
        for top in tops:
            _mount(libc, b"tmpfs", str(top), b"tmpfs", 0, b"mode=0755")
        for fd, path in fds:
            os.makedirs(path, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}".encode(), str(path), None, MS_BIND)
            os.close(fd)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    return enter


def run_unprivileged(script: str, *, uid: int = NOBODY, env: dict[str, str] | None = None,
                     timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``script`` as ``uid`` with rollstream importable (stdout and stderr captured)."""
    needed = [Path(sys.base_prefix).resolve(), SRC]
    code = f"import sys\nsys.path.insert(0, {str(SRC)!r})\n{script}"
    return subprocess.run(
        [PYTHON, "-I", "-S", "-c", code], capture_output=True, text=True,
        timeout=timeout_s, cwd="/", env={"PATH": os.environ["PATH"], **(env or {})},
        preexec_fn=_enter_as(uid, needed))


def run_in_sandboxes_unprivileged(program: str, *, env: dict[str, str] | None = None
                                  ) -> dict[str, dict]:
    """Run ``program`` in a sandbox of each backend, as another user; per backend: its
    ``stdout``, ``stderr``, what a second program printed (``again``: the executor still
    serves) and the pool's ``num_started``."""
    script = f"""
import asyncio, json
from rollstream.agent.sandbox import SandboxPool
async def main():
    for backend in ("bwrap", "unshare"):
        async with SandboxPool(1, backend=backend) as pool:
            out = await pool.run({program!r})
            again = await pool.run("print('still served')")
            print(json.dumps({{"backend": backend, "stdout": out.stdout,
                              "stderr": out.stderr[-800:], "again": again.stdout,
                              "num_started": pool.num_started}}))
asyncio.run(main())
"""
    done = run_unprivileged(script, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = [json.loads(line) for line in done.stdout.splitlines()]
    return {run.pop("backend"): run for run in runs}
