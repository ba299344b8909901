"""The grader pool: bounds, timeouts, errors with reasons, async rewards."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from rollstream.config.schema import RewardConfig
from rollstream.reward.builtins import exact_match, math_reward
from rollstream.reward.pool import MAX_HUNG_PER_WORKER, GraderPool
from rollstream.trajectory import Task


def task(reference: str = "42", source: str = "test") -> Task:
    return Task(uid="t", source=source, prompt_ids=(1,), prompt_text="q", reference=reference)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown so that hung test rewards end their threads."""
    event = threading.Event()
    yield event
    event.set()


async def test_mixed_failures_report_reasons_while_others_complete(
    release: threading.Event,
) -> None:
    def boom(t: Task, text: str) -> float:
        raise ValueError("bad answer format")

    def hang(t: Task, text: str) -> float:
        release.wait(30)
        return 1.0

    rewards = {"ok": exact_match, "boom": boom, "hang": hang}
    pool = GraderPool(RewardConfig(timeout_s=0.2, num_workers=2), lambda t: rewards[t.source])
    t0 = time.perf_counter()
    results = await asyncio.gather(
        pool.grade(task(source="hang"), "42"),
        pool.grade(task(source="boom"), "42"),
        pool.grade(task(source="ok"), "42"),
        pool.grade(task(source="ok"), "41"),
        pool.grade(task(source="hang"), "42"),
        pool.grade(task(source="ok"), "42"),
    )
    wall_s = time.perf_counter() - t0
    assert [r.error for r in results] == [
        "timeout after 0.2s", "ValueError: bad answer format", None, None,
        "timeout after 0.2s", None,
    ]
    assert [r.reward for r in results] == [None, None, 1.0, 0.0, None, 1.0]
    assert results[0].elapsed_s == pytest.approx(0.2, abs=0.15)
    assert wall_s < 1.5  # hung calls were abandoned, not waited for
    assert pool.num_hung == 2
    release.set()
    for _ in range(100):
        if pool.num_hung == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.num_hung == 0
    pool.close()


@pytest.mark.parametrize(
    "value", [None, "1.0", float("nan"), float("inf"), -float("inf"), True, [1.0]]
)
async def test_non_numbers_are_errors(value: object) -> None:
    pool = GraderPool(RewardConfig(), lambda t: lambda t_, text: value)
    result = await pool.grade(task(), "x")
    assert result.reward is None
    assert result.error == f"reward returned {value!r}, expected a finite number"


async def test_numbers_are_floats() -> None:
    pool = GraderPool(RewardConfig(), lambda t: lambda t_, text: 3)
    result = await pool.grade(task(), "x")
    assert result.reward == 3.0 and type(result.reward) is float and result.error is None


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_concurrency_bound(kind: str) -> None:
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}

    def enter() -> None:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])

    def leave() -> None:
        with lock:
            state["now"] -= 1

    def sync_reward(t: Task, text: str) -> float:
        enter()
        time.sleep(0.03)
        leave()
        return 1.0

    async def async_reward(t: Task, text: str) -> float:
        enter()
        await asyncio.sleep(0.03)
        leave()
        return 1.0

    fn = sync_reward if kind == "sync" else async_reward
    pool = GraderPool(RewardConfig(num_workers=3), lambda t: fn)
    results = await pool.grade_group(task(), [str(i) for i in range(10)])
    assert [r.reward for r in results] == [1.0] * 10
    assert state["peak"] == 3


async def test_async_rewards_timeouts_and_own_errors() -> None:
    async def good(t: Task, text: str) -> float:
        await asyncio.sleep(0)
        return 0.25

    async def slow(t: Task, text: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    async def own_timeout(t: Task, text: str) -> float:
        raise TimeoutError("grader service did not answer")

    class Callable:
        async def __call__(self, t: Task, text: str) -> float:
            return 0.75

    rewards = {"good": good, "slow": slow, "own": own_timeout, "obj": Callable()}
    pool = GraderPool(RewardConfig(timeout_s=0.2), lambda t: rewards[t.source])
    results = await asyncio.gather(*(pool.grade(task(source=s), "x") for s in rewards))
    assert [(r.reward, r.error) for r in results] == [
        (0.25, None),
        (None, "timeout after 0.2s"),
        (None, "TimeoutError: grader service did not answer"),
        (0.75, None),
    ]


async def test_math_reward_runs_in_worker_threads() -> None:
    # math-verify's default signal-based timeouts would fail off the main thread
    pool = GraderPool(RewardConfig(num_workers=2), lambda t: math_reward)
    results = await pool.grade_group(task("1/2"), ["\\boxed{0.5}", "$\\frac{2}{4}$", "0.4"])
    assert [(r.reward, r.error) for r in results] == [(1.0, None), (1.0, None), (0.0, None)]


async def test_resolver_failure_and_closed_pool() -> None:
    def resolve(t: Task):
        raise KeyError("no source named 'x'")

    pool = GraderPool(RewardConfig(), resolve)
    result = await pool.grade(task(), "x")
    assert result.error == "KeyError: \"no source named 'x'\""
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.grade(task(), "x")


async def test_hung_threads_are_bounded(release: threading.Event) -> None:
    def hang(t: Task, text: str) -> float:
        release.wait(30)
        return 1.0

    pool = GraderPool(RewardConfig(timeout_s=0.05, num_workers=1), lambda t: hang)
    limit = MAX_HUNG_PER_WORKER * 1
    results = [await pool.grade(task(), "x") for _ in range(limit + 1)]
    assert [r.error for r in results[:limit]] == ["timeout after 0.05s"] * limit
    assert results[-1].error == (
        f"RuntimeError: {limit} timed-out reward calls are still running; not starting more"
    )
    assert results[-1].elapsed_s < 0.05
