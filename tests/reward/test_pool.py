"""The grader pool: bounds, timeouts, errors with reasons, worker processes, async rewards.

Sync rewards come from ``tests.reward.worker_rewards`` (the workers import it); a test that
needs a process to be gone checks its pid."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollstream.config.schema import RewardConfig
from rollstream.reward import GraderPool, Response, Reward, get_reward
from rollstream.reward.builtins import math_reward
from rollstream.trajectory import Task
from tests.reward import worker_rewards as w

STOPPED = Response(text="42", token_ids=(52, 50, 1), finish_reason="stop")


def task(reference: str = "42", source: str = "test") -> Task:
    return Task(uid="t", source=source, prompt_ids=(1,), prompt_text="q", reference=reference)


def said(text: str, finish_reason: str = "stop") -> Response:
    return Response(text=text, token_ids=tuple(range(len(text))), finish_reason=finish_reason)


@pytest.fixture
def make_pool() -> Iterator[Callable[..., GraderPool]]:
    """Pools whose rewards are picked by ``task.source``; every pool is closed at teardown."""
    pools: list[GraderPool] = []

    def make(rewards: dict[str, object], **cfg: object) -> GraderPool:
        checked = {k: get_reward(fn) for k, fn in rewards.items()}  # type: ignore[arg-type]
        pool = GraderPool(RewardConfig(**cfg), lambda t: checked[t.source])  # type: ignore
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


async def test_mixed_failures_report_reasons_while_others_complete(make_pool) -> None:
    pool = make_pool({"ok": "exact_match", "boom": w.boom, "hang": w.hang, "own": w.own_timeout},
                     timeout_s=0.5, num_workers=2)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        pool.grade(task("", source="hang"), STOPPED),
        pool.grade(task(source="boom"), STOPPED),
        pool.grade(task(source="ok"), STOPPED),
        pool.grade(task(source="ok"), said("41")),
        pool.grade(task(source="own"), STOPPED),
        pool.grade(task(source="ok"), said("42", "length")),
    )
    wall_s = time.perf_counter() - t0
    assert [r.error for r in results] == [
        "timeout after 0.5s", "ValueError: bad answer format", None, None,
        "TimeoutError: grader service did not answer", None,
    ]
    assert [r.reward for r in results] == [None, None, 1.0, 0.0, None, 0.0]
    assert results[0].elapsed_s >= 0.5
    assert wall_s < 15  # the hung call was killed at its deadline, not waited for (60 s)


@pytest.mark.parametrize("name", ["none", "str", "nan", "inf", "-inf", "bool", "list"])
async def test_non_numbers_are_errors(make_pool, name: str) -> None:
    pool = make_pool({"test": w.value_named}, num_workers=1)
    result = await pool.grade(task(name), STOPPED)
    assert result.reward is None
    assert result.error == f"reward returned {w.VALUES[name]!r}, expected a finite number"


async def test_numbers_are_floats(make_pool) -> None:
    pool = make_pool({"test": w.value_named}, num_workers=1)
    result = await pool.grade(task("int"), STOPPED)
    assert result.reward == 3.0 and type(result.reward) is float and result.error is None


async def test_a_reward_gets_the_keywords_it_asks_for(make_pool) -> None:
    async def async_wants(t: Task, text: str, *, finish_reason: str) -> float:
        return 1.0 if (text, finish_reason) == ("42", "stop") else 0.0

    pool = make_pool({"sync": w.wants_everything, "async": async_wants}, num_workers=1)
    assert (await pool.grade(task(source="sync"), said("abc"))).reward == 3.0
    assert (await pool.grade(task(source="sync"), said("abcd", "length"))).reward == -4.0
    assert (await pool.grade(task(source="async"), STOPPED)).reward == 1.0


async def test_sync_concurrency_bound(make_pool, tmp_path: Path) -> None:
    pool = make_pool({"test": w.busy_interval}, num_workers=3)
    results = await asyncio.gather(*(pool.grade(task(str(tmp_path)), STOPPED) for _ in range(10)))
    assert [r.reward for r in results] == [1.0] * 10
    events = sorted(  # (time, +1 start / -1 end); at a tie an end sorts before a start
        (float(x), +1 if i == 0 else -1)
        for f in tmp_path.iterdir()
        for i, x in enumerate(f.read_text().split())
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == 3


async def test_async_concurrency_bound(make_pool) -> None:
    state = {"now": 0, "peak": 0}

    async def reward(t: Task, text: str) -> float:
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.03)
        state["now"] -= 1
        return 1.0

    pool = make_pool({"test": reward}, num_workers=3)
    results = await asyncio.gather(*(pool.grade(task(), STOPPED) for _ in range(10)))
    assert [r.reward for r in results] == [1.0] * 10
    assert state["peak"] == 3


async def test_async_rewards_timeouts_and_own_errors(make_pool) -> None:
    async def good(t: Task, text: str) -> float:
        await asyncio.sleep(0)
        return 0.25

    async def slow(t: Task, text: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    async def own_timeout(t: Task, text: str) -> float:
        raise TimeoutError("grader service did not answer")

    class Judge:
        async def __call__(self, t: Task, text: str) -> float:
            return 0.75

    rewards = {"good": good, "slow": slow, "own": own_timeout, "obj": Judge()}
    pool = make_pool(rewards, timeout_s=0.2)
    results = await asyncio.gather(*(pool.grade(task(source=s), STOPPED) for s in rewards))
    assert [(r.reward, r.error) for r in results] == [
        (0.25, None),
        (None, "timeout after 0.2s"),
        (None, "TimeoutError: grader service did not answer"),
        (0.75, None),
    ]


async def test_async_deadlines_each_call_its_own_and_an_outside_cancel_stays_a_cancel(
        make_pool) -> None:
    async def nap(t: Task, text: str) -> float:  # sleeps as many seconds as its reference
        await asyncio.sleep(float(t.reference))
        return 1.0

    pool = make_pool({"test": nap}, timeout_s=0.5)

    async def later(start_s: float, sleep_s: float) -> tuple[float | None, str | None]:
        await asyncio.sleep(start_s)
        r = await pool.grade(task(reference=str(sleep_s)), STOPPED)
        return r.reward, r.error

    # deadlines 0.5, 0.6, 0.7, 0.8 s: the calls in between finish, the long ones time out
    assert await asyncio.gather(later(0.0, 5), later(0.1, 0.1), later(0.2, 5),
                                later(0.3, 0.2)) == [
        (None, "timeout after 0.5s"), (1.0, None), (None, "timeout after 0.5s"), (1.0, None)]

    outside = asyncio.ensure_future(pool.grade(task(reference="5"), STOPPED))
    await asyncio.sleep(0.05)
    outside.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outside

    async def twice() -> list[tuple[float | None, str | None]]:  # one task, two deadlines
        return [await later(0, 5), await later(0, 0)]

    assert await twice() == [(None, "timeout after 0.5s"), (1.0, None)]


async def test_a_rewards_setup_runs_before_its_timeout_counts(make_pool) -> None:
    """A 1.5 s first-call build (reasoning-gym's import and generator) under a 0.5 s timeout:
    as ``@reward_setup`` it is not timed, done in the call it is; a setup that fails leaves
    the call to run and report for itself."""
    pool = make_pool({"setup": w.built_first, "inline": w.builds_in_call,
                      "fails": w.setup_fails}, timeout_s=0.5, num_workers=1)
    results = [await pool.grade(task(reference=seconds, source=s), STOPPED)  # one worker
               for s, seconds in (("setup", "1.5"), ("setup", "1.5"), ("inline", "1.2"),
                                  ("fails", "0"))]
    assert [(r.reward, r.error) for r in results] == [
        (1.0, None), (1.0, None), (None, "timeout after 0.5s"), (1.0, None)]
    assert results[0].elapsed_s >= 1.5 > results[1].elapsed_s  # the setup ran, once


def test_a_pool_used_again_on_a_new_loop_still_times_out_its_calls(make_pool) -> None:
    async def quick(t: Task, text: str) -> float:
        return 1.0

    async def slow(t: Task, text: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    pool = make_pool({"quick": quick, "slow": slow}, timeout_s=0.2)
    first = asyncio.run(pool.grade(task(source="quick"), STOPPED))  # its timer stays there
    t0 = time.monotonic()
    second = asyncio.run(pool.grade(task(source="slow"), STOPPED))
    assert (first.reward, second.error) == (1.0, "timeout after 0.2s")
    assert time.monotonic() - t0 < 5


async def test_math_verify_runs_with_its_signal_timeouts_in_the_workers(make_pool) -> None:
    pool = make_pool({"math": math_reward, "alarm": w.alarm_fires}, num_workers=2)
    # signal handlers work only in a main thread: a worker runs calls in its main thread
    assert (await pool.grade(task(source="alarm"), STOPPED)).reward == 1.0
    texts = ["\\boxed{0.5}", "$\\frac{2}{4}$", "0.4"]
    results = await asyncio.gather(*(pool.grade(task("1/2", "math"), said(x)) for x in texts))
    assert [(r.reward, r.error) for r in results] == [(1.0, None), (1.0, None), (0.0, None)]


async def test_a_timed_out_worker_is_replaced_and_close_leaves_no_process(
    make_pool, tmp_path: Path
) -> None:
    pool = make_pool({"pid": w.pid, "hang": w.hang}, timeout_s=0.5, num_workers=1)
    first = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    hung = await pool.grade(task(str(tmp_path), "hang"), STOPPED)
    assert hung.error == "timeout after 0.5s"
    assert [int(f.name) for f in tmp_path.iterdir()] == [first]  # the hang ran in that worker
    assert _gone(first)  # killed with its call
    second = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    assert second != first  # a fresh worker took over
    pool.close()
    assert _gone(second)
    assert not [p for p in multiprocessing.active_children() if p.pid in (first, second)]
    with pytest.raises(RuntimeError, match="closed"):
        await pool.grade(task(source="pid"), STOPPED)


async def test_a_worker_that_dies_is_reported_and_replaced(make_pool) -> None:
    pool = make_pool({"die": w.die, "pid": w.pid}, num_workers=1)
    result = await pool.grade(task(source="die"), STOPPED)
    assert result.error == "reward worker died (exit code 3)"
    assert (await pool.grade(task(source="pid"), STOPPED)).error is None


async def test_a_cancelled_call_kills_its_worker(make_pool, tmp_path: Path) -> None:
    pool = make_pool({"hang": w.hang}, timeout_s=30, num_workers=1)
    call = asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
    for _ in range(500):  # until the worker has started the call
        if any(tmp_path.iterdir()):
            break
        await asyncio.sleep(0.02)
    (pid_file,) = tmp_path.iterdir()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert _gone(int(pid_file.name))


async def test_close_ends_waiting_calls_with_a_reason(make_pool, tmp_path: Path) -> None:
    pool = make_pool({"hang": w.hang}, timeout_s=30, num_workers=1)
    call = asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
    for _ in range(500):
        if any(tmp_path.iterdir()):
            break
        await asyncio.sleep(0.02)
    pool.close()
    result = await call
    assert result.error == "reward pool closed"
    (pid_file,) = tmp_path.iterdir()
    assert _gone(int(pid_file.name))


async def test_resolver_failure_and_closed_pool() -> None:
    def resolve(t: Task) -> Reward:
        raise KeyError("no source named 'x'")

    pool = GraderPool(RewardConfig(), resolve)
    result = await pool.grade(task(), STOPPED)
    assert result.error == "KeyError: \"no source named 'x'\""
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.grade(task(), STOPPED)


async def test_close_ends_calls_waiting_for_a_worker(make_pool, tmp_path: Path) -> None:
    """Calls queued behind a busy worker end too when the pool closes, not only the one the
    worker runs."""
    pool = make_pool({"hang": w.hang}, timeout_s=30, num_workers=1)
    calls = [asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
             for _ in range(3)]
    for _ in range(500):
        if any(tmp_path.iterdir()):
            break
        await asyncio.sleep(0.02)
    pool.close()
    results = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert [r.error for r in results] == ["reward pool closed"] * 3
