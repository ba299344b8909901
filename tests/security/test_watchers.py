"""Background watchers fail loudly, and what they keep does not grow with the run.

The vLLM health watch meets an exception no transport error explains (a bug, a reply that
does not parse): it must count it as a failed probe, log the cause, and keep watching, so the
engine is restarted when it keeps failing and never left UP and unwatched. The process and
the /health probe are the watch's process edges, scripted here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from rollstream.engine import EngineHealth
from rollstream.engine.vllm.health import HEALTH_FAILURES_TO_DIE, ServerHealth
from rollstream.rollout.concurrency import ConcurrencyLimit


class _Process:
    """The server process as the watch sees it: alive, or exited with a reason."""

    def __init__(self) -> None:
        self.raises: BaseException | None = None

    def alive(self) -> bool:
        if self.raises is not None:
            raise self.raises
        return True

    def exit_reason(self) -> str:
        return "exited"


async def _until(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _health(probe, process=None):
    restarts: list[float] = []

    async def restart() -> None:
        restarts.append(time.monotonic())
        await asyncio.sleep(0.2)  # RECOVERING meanwhile

    health = ServerHealth(engine_id="vllm-0", server=process or _Process(), period_s=0.01,
                          probe=probe, drop_streams=lambda why: None, restart=restart)
    return health, restarts


async def test_a_probe_that_raises_is_a_failed_probe_and_the_watch_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """One raise among good answers: logged with its cause, no restart, and the watch still
    probes afterwards (before, the watch task ended at the raise, silently)."""
    calls = {"n": 0}

    async def probe() -> bool:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("a /health reply that does not parse")
        return True

    health, restarts = _health(probe)
    with caplog.at_level(logging.ERROR, logger="rollstream.engine.vllm.health"):
        health.start()
        try:
            await _until(lambda: calls["n"] >= 4, timeout_s=10)
        finally:
            health.close()
    assert restarts == []
    (record,) = [r for r in caplog.records if "health check raised" in r.getMessage()]
    assert record.exc_info is not None and "does not parse" in str(record.exc_info[1])


@pytest.mark.parametrize("where", ["probe", "process"])
async def test_a_check_that_keeps_raising_restarts_the_engine_as_failed_probes_do(
        where: str, caplog: pytest.LogCaptureFixture) -> None:
    """A probe (or the process check) that raises every time takes the failed-probe path:
    after HEALTH_FAILURES_TO_DIE of them the engine is declared dead, RECOVERING, and
    restarted; each cause is logged."""
    process = _Process()

    async def probe() -> bool:
        if where == "probe":
            raise RuntimeError("probe bug")
        return True

    if where == "process":
        process.raises = OSError("cannot read /proc")
    health, restarts = _health(probe, process)
    with caplog.at_level(logging.ERROR, logger="rollstream.engine.vllm.health"):
        health.start()
        try:
            await _until(lambda: health.status()[0] is EngineHealth.RECOVERING, 10)
            await _until(lambda: health.status()[0] is EngineHealth.UP, 10)
        finally:
            health.close()
    assert health.num_restarts >= 1 and restarts
    raised = [r for r in caplog.records if "health check raised" in r.getMessage()]
    assert len(raised) >= HEALTH_FAILURES_TO_DIE


def test_the_adaptive_concurrency_history_is_bounded_however_long_the_run() -> None:
    """A controller measuring window after window for a long run keeps a bounded history
    (its count of windows still grows); before, every window was kept."""
    ctl = ConcurrencyLimit(capacity=64, window_tokens=10, start=8)
    now, tokens = 0.0, 0
    ctl.observe(now_s=now, generated_tokens=tokens, in_flight=ctl.limit)
    for _ in range(5000):
        now += 1.0
        tokens += 10 * ctl.limit  # throughput grows with the limit, then holds
        ctl.observe(now_s=now, generated_tokens=tokens, in_flight=ctl.limit)
    assert 0 < len(ctl.history) <= 256
    assert ctl.num_windows == 5000
