"""Worker processes that die with a SIGKILLed parent, even stuck in a call; reward worker
processes that cannot start (they die before "ready", as when the program's
``__main__`` is a script read from stdin, which a spawned process cannot import) make every
call fail with that cause after a few tries, instead of being replaced forever."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollstream.reward import workers
from rollstream.reward.workers import MAX_FAILED_STARTS, ProcessWorkers, WorkerDied


def die_at_start(conn, parent) -> None:
    os._exit(3)


def add(a: int, b: int) -> int:
    return a + b


def test_workers_that_die_at_start_fail_calls_with_the_cause(monkeypatch) -> None:
    monkeypatch.setattr(workers, "_serve", die_at_start)
    pool = ProcessWorkers(2)
    spawned = []
    start = pool._start
    monkeypatch.setattr(pool, "_start", lambda: (spawned.append(1), start())[1])

    async def main() -> None:
        calls = [asyncio.create_task(pool.call(add, (1, 2), 5.0)) for _ in range(3)]
        for call in calls:
            with pytest.raises(WorkerDied, match="died before they were ready"):
                await asyncio.wait_for(call, 60)
        with pytest.raises(WorkerDied, match="a script read from stdin"):
            await pool.call(add, (1, 2), 5.0)  # at once: nothing more is started

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert len(spawned) <= 2 + MAX_FAILED_STARTS, "it stopped replacing them"
    assert pool.broken is not None and pool.broken.exitcode == 3


def test_healthy_workers_still_answer() -> None:
    pool = ProcessWorkers(1)

    async def main() -> int:
        return await pool.call(add, (2, 3), 30.0)

    try:
        assert asyncio.run(main()) == 5
    finally:
        pool.close()


def test_a_worker_stuck_in_a_call_dies_with_its_killed_parent(tmp_path) -> None:
    """A parent (a run) starts a worker whose call never returns, then is SIGKILLed: the
    worker goes too (nothing is left running), though its pipe was never closed by anyone."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "worker.pid"
    script = tmp_path / "parent.py"
    script.write_text(f"""
import asyncio
from rollstream.reward.workers import ProcessWorkers
from tests.reward.worker_rewards import write_pid_and_hang

if __name__ == "__main__":
    pool = ProcessWorkers(1)
    asyncio.run(pool.call(write_pid_and_hang, ({str(pid_file)!r},), 600.0))
""")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script)], env=env, cwd=root)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert parent.poll() is None, "the parent ended before its worker started"
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        os.kill(worker, 0)  # running, stuck in its call
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived its killed parent"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead: it waits for its reaper only
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_worker_that_died_idle_costs_no_call() -> None:
    """A worker killed between calls: the next call goes to its replacement (nothing of it
    ran in the dead one), as on the Ray transport; the pool is one implementation."""
    import signal

    pool = ProcessWorkers(1)

    async def main() -> tuple[int, int]:
        first = await pool.call(os.getpid, (), 30.0)
        os.kill(first, signal.SIGKILL)
        async with asyncio.timeout(10):
            while _alive(first):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the loop has read the pipe's end
        return first, await pool.call(os.getpid, (), 30.0)

    try:
        first, second = asyncio.run(main())
    finally:
        pool.close()
    assert second != first and pool.pids == []
