"""Placement on this host's CPUs (runtime/placement.py): the core split of ``disaggregated``,
and ``colocated``'s turns: while the trainer steps no request runs, and generation resumes
only once the engines serve the new weights. Engines are doubles at the process edge;
dispatcher, lifecycle, graders and weight sync are real (the Ray runs with both placements
are in test_ray_sync_and_placement.py)."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.config import load_config
from rollstream.runtime.placement import TimeShare, placed_engine, placed_train, split_cores
from rollstream.trajectory import SampleStatus
from tests.rollout.fakes import TwoEngineSync, task_groups


@pytest.mark.parametrize(("cores", "engines", "trainer"), [
    ([0, 1], (0,), (1,)),
    ([3, 1, 2], (1, 2), (3,)),
    ([0, 1, 2, 3], (0, 1), (2, 3)),
    ([4, 5, 6, 7, 8], (4, 5, 6), (7, 8)),
])
def test_disaggregated_splits_the_cores_engines_low_trainer_high(cores, engines, trainer):
    assert split_cores(cores) == (engines, trainer)


def test_disaggregated_needs_two_cores():
    with pytest.raises(ValueError, match="needs 2 cores or more"):
        split_cores([0])


def test_placed_settings_are_derived_not_written_back(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.placement=disaggregated"])
    assert (placed_engine(cfg).cpu_affinity, placed_engine(cfg).threads) == ((0,), 1)
    assert (placed_train(cfg).cpu_affinity, placed_train(cfg).threads) == ((1,), 1)
    assert cfg.engine.local.cpu_affinity == cfg.train.cpu_affinity == ()
    for placement in ("colocated", None):  # nothing pinned
        other = load_config(None, ["runtime.kind=ray"] + (
            [f"runtime.ray.placement={placement}"] if placement else []))
        assert placed_engine(other) is other.engine.local and placed_train(other) is other.train


async def _turn(policy: str):
    async with TwoEngineSync(policy, max_len=60) as scene:
        engines = scene.engines
        groups = task_groups(0, 6, prompt_len=3)
        running = [asyncio.create_task(scene.dispatcher.run_group(g)) for g in groups]
        # running, and some tokens in (an interrupt before the first token leaves nothing of v0)
        await scene.until_running(8, num_tokens=16)
        async with TimeShare(scene.dispatcher, scene.sync).trainer_turn():
            for _ in range(20):  # the trainer's step: nothing generates meanwhile
                assert not any(e._running for e in engines)
                await asyncio.sleep(0.005)
            scene.sync.publish(1, {})
        await scene.sync.wait_applied()
        await asyncio.gather(*running)
    return engines, groups


@pytest.mark.parametrize("policy", ["interrupt", "continue", "drain"])
def test_colocated_engines_stop_for_the_trainer_and_wake_with_its_weights(policy):
    engines, groups = asyncio.run(_turn(policy))
    samples = [s for g in groups for s in g.samples]
    assert all(s.status is SampleStatus.GRADED for s in samples)
    assert all(s.versions == sorted(s.versions) for s in samples)
    assert [v for e in engines for v, _ in e.loads] == [1, 1]
    if policy == "drain":  # no partial rollout: the turn waited for them to finish
        assert all(set(s.versions) == {0} for s in samples)
    else:  # stopped at a token boundary, continued on the new weights
        assert any(set(s.versions) == {0, 1} for s in samples)
        assert any(s.num_interrupts for s in samples)
