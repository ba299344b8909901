"""Bounded replay (``rollout.replay``): the pool asks the staleness policy and counts uses,
``take`` replays only into a batch short of fresh groups and never past the share, and a run
(with a resume in the middle) records each sample's one terminal line plus its replays."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rollstream.config import RunConfig, TrainConfig
from rollstream.config.replay import ReplayConfig
from rollstream.data.ledger import read_jsonl, read_ledger
from rollstream.durable.audit import audit_run
from rollstream.rollout.replay import ReplayPool
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, SampleStatus

from .fakes import CountingTrainer, RandomEngine
from .test_controller import Tasks, rollout_cfg, run_controller
from .test_resume import _loop, run_with_resume
from .test_staleness import _group

REPLAY = {"max_share": 0.5, "max_uses": 2}


def _trained(i: int, version: int, rewards=(0.0, 1.0)) -> Group:
    g = _group(i, *([version] for _ in rewards))
    for s, r in zip(g.samples, rewards, strict=True):
        s.reward, s.status = r, SampleStatus.TRAINED
    return g


def _pool(k: int = 2, **replay) -> ReplayPool:
    return ReplayPool(ReplayConfig(**{**REPLAY, **replay}),
                      StalenessPolicy(max_staleness=k))


def test_pool_keeps_informative_trained_groups_only():
    pool = _pool()
    pool.offer(_trained(0, 1))
    pool.offer(_trained(1, 1, rewards=(1.0, 1.0)))  # zero variance: teaches nothing
    untrained = _trained(2, 1)
    for s in untrained.samples:
        s.status = SampleStatus.DROPPED_STALE
    pool.offer(untrained)
    assert len(pool) == 1
    off = _pool(max_share=0.0, max_uses=1)
    off.offer(_trained(3, 1))
    assert len(off) == 0


def test_pool_draws_at_most_max_uses_and_only_what_the_policy_accepts():
    pool = _pool(k=2, max_uses=2)
    pool.offer(_trained(0, 1))
    assert pool.draw(2, step=2) is None, "fewer replayable than asked: nothing drawn"
    assert [g.task.uid for g in pool.draw(1, step=2)] == ["t/0"]
    assert pool.draw(1, step=3) is not None  # age 2 = k: still accepted
    assert pool.draw(1, step=3) is None and len(pool) == 0, "used max_uses times: gone"
    pool.offer(_trained(1, 1))
    assert pool.draw(1, step=4) is None, "age 3 > k: the policy rejects it"
    assert len(pool) == 0, "evicted: staleness only grows"


def test_pool_prefers_the_least_stale_and_bounds_itself_by_the_policy():
    pool = _pool(k=3, max_uses=5)
    for i, v in enumerate([0, 2, 1]):
        pool.offer(_trained(i, v))
    assert [g.task.uid for g in pool.draw(2, step=3)] == ["t/1", "t/2"]
    pool.evict(4)  # version 0 is 4 old at step 4
    assert len(pool) == 2


def _take_loop(tmp_path):
    cfg = RunConfig(rollout=rollout_cfg(mode="async", k=2, on_update="continue",
                                        replay=REPLAY),
                    train=TrainConfig(steps=1, groups_per_step=4))
    policy = cfg.rollout.staleness_policy()
    from rollstream.data.ledger import Ledger

    loop, graders = _loop(cfg, seed=0, ledger=Ledger(None), tasks=Tasks(),
                          trainer=CountingTrainer(0, policy))
    graders.close()
    return loop.rollout


def test_take_replays_only_into_a_short_batch_and_never_past_the_share(tmp_path):
    rollout = _take_loop(tmp_path)
    for i in range(3):
        rollout.replay.offer(_trained(100 + i, 1))

    async def main():
        rollout.buffer.put(_group(0, [2], [2]))
        with pytest.raises(TimeoutError):  # 3 short > floor(0.5 x 4): wait for fresh ones
            await asyncio.wait_for(rollout.take(4, step=2), 0.2)
        rollout.buffer.put(_group(1, [2], [2]))
        batch = await rollout.take(4, step=2)
        assert [g.task.uid for g in batch[:2]] == ["t/0", "t/1"], "every ready fresh group"
        assert len(batch) == 4 and len(rollout._replaying) == 2
        rollout._replaying = set()
        for i in range(2, 6):
            rollout.buffer.put(_group(i, [2], [2]))
        batch = await rollout.take(4, step=2)
        assert [g.task.uid for g in batch] == ["t/2", "t/3", "t/4", "t/5"], \
            "fresh groups ready: no replay"

    asyncio.run(main())


def _events(tmp_path):
    path = tmp_path / "replays.jsonl"
    return read_jsonl(path) if path.exists() else []


def test_a_run_records_each_sample_once_plus_its_replays(tmp_path):
    loop, res, ledger, trainer = run_controller(
        tmp_path, mode="async", k=2, on_update="continue", seed=4, steps=8,
        engines=lambda: [RandomEngine(i, engine_id=f"rand-{i}", max_delay_s=0.004)
                         for i in range(2)], replay=REPLAY)
    assert res.steps_done == 8 and not ledger.unfinished()
    trained = [r for r in read_ledger(tmp_path / "ledger.jsonl") if r.status == "trained"]
    assert len(trained) == res.trained_samples > 0, "replays are not terminal lines"
    audit = audit_run(tmp_path, group_size=3, eval_group_size=1, groups_per_step=2, steps=8)
    assert audit["duplicated_samples"] == 0 and audit["steps_repeated"] == 0
    assert audit["replays"] > 0, "slow engines leave batches short: replays fill them"
    assert audit["replays_unbacked"] == 0
    assert audit["max_replays_per_sample"] <= REPLAY["max_uses"]
    seen: set[str] = set()
    for batch in trainer.batches:  # at most floor(0.5 x 2) = 1 replayed group a step
        ids = [gid for gid, _ in batch]
        assert len(ids) == 2 and sum(g in seen for g in ids) <= 1
        seen.update(ids)
    bound = loop.rollout.policy.kept_bound
    for e in _events(tmp_path):
        assert e["replayed_at_step"] - e["min_trained_version"] <= bound, e
    assert len(loop.rollout.replay) <= bound * 2, "the pool holds what may still replay"


@pytest.mark.parametrize("lost", [0, 2])
def test_resume_keeps_the_replay_pool_and_its_uses(tmp_path, lost):
    cfg, snap, res, ledger, trainer, _ = run_with_resume(
        tmp_path, k=2, on_update="continue", seed=11, steps=8, resume_at=3,
        lost=lost, max_token_age=None, replay=REPLAY)
    assert res.steps_done == 8 and not ledger.unfinished()
    assert "replay_pool" in snap and "replay_lines" in snap
    audit = audit_run(tmp_path, group_size=3, eval_group_size=1, groups_per_step=2, steps=8)
    assert audit["duplicated_samples"] == 0 and audit["steps_repeated"] == 0
    assert audit["replays"] > 0 and audit["replays_unbacked"] == 0
    assert audit["max_replays_per_sample"] <= REPLAY["max_uses"], "uses survive the resume"
    head = snap["replay_lines"]
    assert all(e["replayed_at_step"] < 3 for e in _events(tmp_path)[:head])
    superseded = tmp_path / "replays.superseded.jsonl"
    if superseded.exists():  # the lost process's replays: moved, never dropped
        assert all(r["replayed_at_step"] >= 3 for r in read_jsonl(superseded))


@pytest.mark.parametrize("rollout, train, field", [
    ({"mode": "sync", "replay": {"max_share": 0.5}}, {}, "rollout.replay.max_share"),
    ({"staleness": {"max_staleness": 2, "max_token_age": 0}, "replay": {"max_share": 0.5}}, {},
     "rollout.replay.max_share"),
    ({"replay": {"max_uses": 3}}, {}, "rollout.replay.max_uses"),
    ({"replay": {"max_share": 0.05}}, {"groups_per_step": 8}, "rollout.replay.max_share"),
])
def test_contradicting_replay_settings_fail_at_load(rollout, train, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        RunConfig.model_validate({"rollout": rollout, "train": train})
    RunConfig.model_validate({"rollout": {"replay": REPLAY}, "train": {"groups_per_step": 4}})
