"""Sandboxed programs see none of the run's secrets: the executor and every program start with
a minimal environment (PATH, LANG, HOME and the names listed in ``pass_env``), both backends,
run as root and as another user."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest

from rollstream.agent.sandbox import SandboxLimits, SandboxPool
from tests.security.sandbox_unprivileged import run_in_sandboxes_unprivileged

SECRET = "wandb-secret-0123456789"
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2.0, memory_mb=256, max_procs=8, file_size_mb=4)
# what a program prints: its environment, and the executor's (its parent) if it can read it
SPY = """
import json, os
try:
    executor = open(f"/proc/{os.getppid()}/environ", "rb").read().decode(errors="replace")
except OSError as e:
    executor = type(e).__name__
print(json.dumps({"env": dict(os.environ), "executor": executor}))
"""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
async def test_programs_and_their_executor_get_a_minimal_environment(backend, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    async with SandboxPool(1, limits=LIMITS, backend=backend, uid_base=62100) as pool:
        out = await pool.run(SPY)
        assert out.ok, out.stderr[-500:]
        seen = json.loads(out.stdout)
        assert SECRET not in out.stdout
        assert set(seen["env"]) <= {"PATH", "LANG", "HOME", "PWD"}  # PWD: bwrap's --chdir
        assert seen["env"]["HOME"] == pool.isolation.work
        assert seen["executor"] == "PermissionError"
        # from the host: no process of the sandbox (bwrap or unshare, the executor, its
        # program) holds the secret in its environment
        run = asyncio.create_task(pool.run("import time; time.sleep(1)"))
        processes = await _sandbox_processes(pool._sandboxes[0]._proc.pid)
        assert len(processes) >= 3
        for pid in processes:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert SECRET.encode() not in f.read(), f"process {pid} has the secret"
        assert (await run).ok


async def _sandbox_processes(top: int) -> list[int]:
    """The sandbox's processes on the host, once its program runs."""
    for _ in range(500):
        found = _descendants(top)
        for pid in found:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"time.sleep(1)" in f.read():
                    return found
        await asyncio.sleep(0.01)
    raise AssertionError("the program never started")


async def test_pass_env_gives_the_names_listed_and_nothing_else(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("DATASET_URL", "https://example.invalid/data")
    async with SandboxPool(1, limits=LIMITS, uid_base=62100, pass_env=["DATASET_URL"]) as pool:
        out = await pool.run(SPY)
    seen = json.loads(out.stdout)["env"]
    assert seen["DATASET_URL"] == "https://example.invalid/data" and SECRET not in out.stdout
    os.environ.pop("ROLLSTREAM_TEST_UNSET", None)
    with pytest.raises(ValueError, match=r"SandboxPool.pass_env\[1\] 'ROLLSTREAM_TEST_UNSET' is "
                                         "not set in this process's environment"):
        SandboxPool(1, pass_env=["PATH", "ROLLSTREAM_TEST_UNSET"])
    with pytest.raises(ValueError, match=r"pass_env\[0\] 'A B' is not a variable name"):
        SandboxPool(1, pass_env=["A B"])
    with pytest.raises(TypeError, match="pass_env must be a list of variable names, got str"):
        SandboxPool(1, pass_env="PATH")


def test_as_another_user_programs_see_no_secret_and_cannot_read_the_executor():
    runs = run_in_sandboxes_unprivileged(SPY, env={"WANDB_API_KEY": SECRET})
    assert set(runs) == {"bwrap", "unshare"}
    for backend, run in runs.items():
        assert run["stdout"] and SECRET not in run["stdout"], (backend, run["stderr"])
        seen = json.loads(run["stdout"])
        assert set(seen["env"]) <= {"PATH", "LANG", "HOME", "PWD"}, backend
        assert seen["executor"] == "PermissionError", backend
