"""Placement on this host's CPUs (runtime/placement.py): the core split of ``disaggregated``,
and ``colocated``'s turns: while the trainer steps no request runs, and generation resumes
only once the engines serve the new weights. Engines are doubles at the process edge;
dispatcher, lifecycle, graders and weight sync are real (the Ray runs with both placements
are in test_ray_sync_and_placement.py)."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.clock import WallClock
from rollstream.config import RewardConfig, load_config
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.runtime.placement import TimeShare, placed_engine, placed_train, split_cores
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import Group, SampleStatus, Task
from tests.rollout.fakes import RandomEngine


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


async def _one(task: Task, text: str) -> float:
    return 1.0


async def _turn(policy: str):
    engines = [RandomEngine(1, "a", max_delay_s=0.004, max_len=60),
               RandomEngine(2, "b", max_delay_s=0.004, max_len=60)]
    reward = get_reward(_one)
    graders = GraderPool(RewardConfig(), lambda task: reward)
    dispatcher = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=60),
                            graders=graders, decode=lambda ids: "", clock=WallClock(),
                            lifecycle=Lifecycle(Ledger(), WallClock()))
    sync = WeightSync(engines, dispatcher, policy, lambda v, s: None)  # type: ignore[arg-type]
    loop = asyncio.create_task(sync.run())
    groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(1, 2, 3), prompt_text="",
                             reference=""), 2) for i in range(6)]
    running = [asyncio.create_task(dispatcher.run_group(g)) for g in groups]
    # running, and some tokens in (an interrupt before the first token leaves nothing of v0)
    while sum(len(e._running) for e in engines) < 8 or sum(e.generated for e in engines) < 16:
        await asyncio.sleep(0.002)
    async with TimeShare(dispatcher, sync).trainer_turn():
        for _ in range(20):  # the trainer's step: nothing generates meanwhile
            assert not any(e._running for e in engines)
            await asyncio.sleep(0.005)
        sync.publish(1, {})
    await sync.wait_applied()
    await asyncio.gather(*running)
    loop.cancel()
    graders.close()
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
