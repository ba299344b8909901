"""Run a Python script as an unprivileged uid, for the sandbox tests that need the non-root
path (one uid for the executor and its programs) while CI runs as root.

The script runs in a mount namespace of its own (util-linux ``unshare``) where this Python and
rollstream's source are reachable by any uid: where they live under a folder others may not
enter (a pyenv under ``/root``, 0700), a tmpfs on that folder holds only them, as the
``unshare`` backend does for sandboxes. A first interpreter, still root, makes those mounts and
drops to the uid, then execs the script. The host's files are not changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import rollstream

NOBODY = 65534
SRC = Path(rollstream.__file__).resolve().parents[1]
PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
# argv: needed folders (JSON), uid, then the command to exec
ENTER = r"""
import ctypes, json, os, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)

def mount(source, target, fstype, flags, data=None):
    if libc.mount(source, target.encode(), fstype, flags, data) != 0:
        raise OSError(ctypes.get_errno(), f"mount on {target}")

needed, uid = [Path(p) for p in json.loads(sys.argv[1])], int(sys.argv[2])
closed = {next(p for p in reversed(path.parents) if not p.stat().st_mode & 0o001)
          for path in needed if any(not p.stat().st_mode & 0o001 for p in path.parents)}
fds = [(os.open(p, os.O_PATH | os.O_DIRECTORY), p) for p in needed
       if any(p.is_relative_to(top) for top in closed)]
for top in closed:
    mount(b"tmpfs", str(top), b"tmpfs", 0, b"mode=0755")
for fd, path in fds:
    os.makedirs(path, exist_ok=True)
    mount(f"/proc/self/fd/{fd}".encode(), str(path), None, 4096)  # MS_BIND
    os.close(fd)
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
os.execv(sys.argv[3], sys.argv[3:])
"""


def run_unprivileged(script: str, *, uid: int = NOBODY, env: dict[str, str] | None = None,
                     timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``script`` as ``uid`` with rollstream importable (stdout and stderr captured)."""
    needed = json.dumps([str(Path(sys.base_prefix).resolve()), str(SRC)])
    code = f"import sys\nsys.path.insert(0, {str(SRC)!r})\n{script}"
    return subprocess.run(
        [shutil.which("unshare"), "--mount", "--propagation", "private", "--",
         PYTHON, "-I", "-S", "-c", ENTER, needed, str(uid), PYTHON, "-I", "-S", "-c", code],
        capture_output=True, text=True, timeout=timeout_s, cwd="/",
        env={"PATH": os.environ["PATH"], **(env or {})})


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
