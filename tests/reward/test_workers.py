"""Reward worker processes that cannot start (they die before "ready", as when the program's
``__main__`` is a script read from stdin, which a spawned process cannot import) make every
call fail with that cause after a few tries, instead of being replaced forever."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollstream.reward import workers
from rollstream.reward.workers import MAX_FAILED_STARTS, ProcessWorkers, WorkerDied


def die_at_start(conn) -> None:
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
