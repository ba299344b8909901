"""Reward workers as Ray actors (``RayWorkers``) behind the grader pool, with the guarantees
``tests/reward/test_pool.py`` checks for worker processes: results and reward errors with
their reasons, a timed-out call's actor killed and replaced, an actor killed mid-call (by
``ray.kill``, SIGKILL of its process, or its own ``os._exit``) failing only that call, an
actor that died idle costing no call, close leaving no actor; and ``build_workers`` choosing
the pool from ``runtime.kind``. One local Ray for the module."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.config import load_config
from rollstream.config.runtime import RayConfig
from rollstream.config.schema import RewardConfig
from rollstream.reward import GraderPool, get_reward
from rollstream.reward.workers import ProcessWorkers, WorkerDied
from rollstream.runtime.build import build_workers
from rollstream.runtime.ray.cluster import RayCluster
from rollstream.runtime.ray.workers import RayWorkers
from tests.reward import worker_rewards as w
from tests.reward.test_pool import STOPPED, _gone, said, task

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    yield cluster
    cluster.stop()


@pytest.fixture
def pools(ray_cluster) -> Iterator[list[GraderPool]]:
    made: list[GraderPool] = []
    yield made
    for pool in made:
        pool.close()


def _pool(pools: list[GraderPool], rewards: dict[str, object], **cfg: object
          ) -> tuple[GraderPool, RayWorkers]:
    checked = {k: get_reward(fn) for k, fn in rewards.items()}  # type: ignore[arg-type]
    config = RewardConfig(**cfg)  # type: ignore[arg-type]
    workers = RayWorkers(config.num_workers)
    pool = GraderPool(config, lambda t: checked[t.source], workers)
    pools.append(pool)
    return pool, workers


async def _pid_written(folder: Path) -> int:
    """The pid a ``hang`` call wrote once its actor started it."""
    async with asyncio.timeout(60):
        while not any(folder.iterdir()):
            await asyncio.sleep(0.02)
    (pid_file,) = folder.iterdir()
    return int(pid_file.name)


async def test_results_and_reward_errors_with_their_reasons(pools) -> None:
    pool, _ = _pool(pools, {"ok": "exact_match", "boom": w.boom, "hang": w.hang,
                            "own": w.own_timeout, "value": w.value_named,
                            "alarm": w.alarm_fires}, timeout_s=1.0, num_workers=2)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        pool.grade(task("", source="hang"), STOPPED),
        pool.grade(task(source="boom"), STOPPED),
        pool.grade(task(source="ok"), STOPPED),
        pool.grade(task(source="ok"), said("41")),
        pool.grade(task(source="own"), STOPPED),
        pool.grade(task("nan", "value"), STOPPED),
        pool.grade(task(source="alarm"), STOPPED),  # signal handlers: the actor's main thread
    )
    wall_s = time.perf_counter() - t0
    assert [(r.reward, r.error) for r in results] == [
        (None, "timeout after 1s"), (None, "ValueError: bad answer format"), (1.0, None),
        (0.0, None), (None, "TimeoutError: grader service did not answer"),
        (None, "reward returned nan, expected a finite number"), (1.0, None),
    ]
    assert results[0].elapsed_s >= 1.0
    assert wall_s < 30  # the hung call was killed at its deadline, not waited for (60 s)


async def test_a_rewards_setup_runs_in_the_actor_before_its_timeout_counts(pools) -> None:
    pool, _ = _pool(pools, {"setup": w.built_first, "inline": w.builds_in_call},
                    timeout_s=0.5, num_workers=1)
    results = [await pool.grade(task(seconds, source), STOPPED)
               for source, seconds in (("setup", "1.5"), ("inline", "1.2"))]
    assert [(r.reward, r.error) for r in results] == [(1.0, None), (None, "timeout after 0.5s")]


async def test_a_timed_out_actor_is_killed_and_replaced(pools, tmp_path: Path) -> None:
    pool, workers = _pool(pools, {"pid": w.pid, "hang": w.hang}, timeout_s=0.5,
                          num_workers=1)
    first = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    assert workers.pids == [first] and first != os.getpid()
    hung = await pool.grade(task(str(tmp_path), "hang"), STOPPED)
    assert hung.error == "timeout after 0.5s"
    assert [int(f.name) for f in tmp_path.iterdir()] == [first]  # the hang ran in that actor
    assert _gone(first, within_s=10)  # killed with its call
    second = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    assert second != first  # a fresh actor took over


@pytest.mark.parametrize(("how", "cause"), [
    ("ray.kill", "reward worker died (it was killed by `ray.kill`)"),
    ("SIGKILL", "reward worker died (its worker process has died"),
    ("os._exit", "reward worker died (its worker process has died"),
])
async def test_an_actor_killed_mid_call_fails_that_call_and_is_replaced(
        pools, tmp_path: Path, how: str, cause: str) -> None:
    import ray

    pool, workers = _pool(pools, {"pid": w.pid, "hang": w.hang, "die": w.die}, timeout_s=60,
                          num_workers=1)
    if how == "os._exit":
        result = await pool.grade(task(str(tmp_path), "die"), STOPPED)
        assert len(list(tmp_path.iterdir())) == 1  # it ran once: not retried as never started
    else:
        call = asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
        pid = await _pid_written(tmp_path)
        if how == "ray.kill":
            (worker,) = workers._all
            ray.kill(worker.actor)
        else:
            os.kill(pid, signal.SIGKILL)
        result = await asyncio.wait_for(call, 30)  # not the 60 s of the hang or the timeout
    assert result.reward is None and result.error.startswith(cause), result.error
    served = await pool.grade(task(source="pid"), STOPPED)
    assert served.error is None and workers.pids == [int(served.reward)]


async def test_an_actor_that_died_idle_costs_no_call(pools) -> None:
    pool, _ = _pool(pools, {"pid": w.pid}, num_workers=1)
    first = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    os.kill(first, signal.SIGKILL)
    assert _gone(first, within_s=10)
    result = await pool.grade(task(source="pid"), STOPPED)
    assert result.error is None and int(result.reward) != first


async def test_a_cancelled_call_kills_its_actor(pools, tmp_path: Path) -> None:
    pool, _ = _pool(pools, {"hang": w.hang}, timeout_s=60, num_workers=1)
    call = asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
    pid = await _pid_written(tmp_path)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert _gone(pid, within_s=10)


async def test_close_ends_every_call_and_leaves_no_actor(pools, tmp_path: Path) -> None:
    from ray.exceptions import RayActorError

    pool, workers = _pool(pools, {"hang": w.hang, "pid": w.pid}, timeout_s=60, num_workers=2)
    idle = int((await pool.grade(task(source="pid"), STOPPED)).reward)
    calls = [asyncio.create_task(pool.grade(task(str(tmp_path), "hang"), STOPPED))
             for _ in range(3)]  # one waits for an actor
    async with asyncio.timeout(60):
        while len(list(tmp_path.iterdir())) < 2:
            await asyncio.sleep(0.02)
    running = [int(f.name) for f in tmp_path.iterdir()]
    actors = [wk.actor for wk in workers._all]
    assert sorted(workers.pids) == sorted(running) and idle in running
    pool.close()
    results = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert [r.error for r in results] == ["reward pool closed"] * 3
    assert all(_gone(pid, within_s=10) for pid in running)
    for actor in actors:  # Ray itself has them dead
        with pytest.raises(RayActorError):
            await asyncio.wait_for(actor.pid.remote(), 10)
    assert workers.pids == []


async def test_harness_actors_on_the_driver_node_name_their_role(ray_cluster) -> None:
    """The harness's pool (pinned to the driver's node, where the agent proxy listens on
    127.0.0.1; one node here, so this checks that Ray places such actors, not where): a
    death is reported as the harness worker's, the replacement serves, and an exception the
    function raises reaches the caller as itself."""
    workers = RayWorkers(1, role="harness", on_driver_node=True)
    try:
        with pytest.raises(WorkerDied, match=r"^harness worker died \(its worker process"):
            await workers.call(w.die, (None, ""), 30)
        pid = int(await workers.call(w.pid, (None, ""), 30))
        assert workers.pids == [pid]
        with pytest.raises(ValueError, match="bad answer format"):  # fn's own exception
            await workers.call(w.boom, (None, ""), 30)
        assert workers.pids == [pid]  # and the actor lives on
    finally:
        workers.close()


def test_build_workers_picks_the_pool_by_runtime_kind() -> None:
    embedded = load_config(None, ["reward.num_workers=3"])
    pool = build_workers(embedded, 3, "reward")
    assert type(pool) is ProcessWorkers and (pool.size, pool.role) == (3, "reward")
    ray_cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.worker_num_cpus=0.5"])
    rewards, agents = build_workers(ray_cfg, 4, "reward"), build_workers(ray_cfg, 2, "harness")
    assert type(rewards) is RayWorkers and type(agents) is RayWorkers
    assert (rewards.size, rewards.num_cpus, rewards.on_driver_node) == (4, 0.5, False)
    assert (agents.role, agents.on_driver_node) == ("harness", True)  # the proxy's loopback
