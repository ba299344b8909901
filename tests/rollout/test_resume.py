"""Resume inserted at a random step: the staleness and exactly-once guarantees of
test_controller hold across it, the task cursor goes on, and a partial sample saved by the
snapshot continues from its tokens with their versions. A "kill" is the first run going on
for a few steps past the snapshot (its later ledger lines are what a resume reconciles);
engines and trainers are the doubles of tests/rollout/fakes.py, the rest is real."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rollstream.clock import WallClock
from rollstream.config import RewardConfig, RunConfig, TrainConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.durable.checkpoint import Checkpoint
from rollstream.durable.resume import reconcile_ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.runtime.build import build_loop

from .fakes import CountingTrainer, NullMetrics, RandomEngine, run_then_close
from .test_controller import Tasks, _reward, rollout_cfg

GROUP = 3


class RecordingTrainer(CountingTrainer):
    """Also keeps each trained sample's tokens and versions."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tokens: dict[str, tuple[list[int], list[int]]] = {}

    def step(self, groups, step: int):
        for g in groups:
            for s in g.samples:
                self.tokens[s.uid] = (s.response_ids, s.versions)
        return super().step(groups, step)


def _loop(cfg, *, seed, ledger, tasks, trainer, start_step=0):
    async def in_loop(task, text):
        return _reward(task, text)

    graders = GraderPool(RewardConfig(timeout_s=5.0), lambda task, r=get_reward(in_loop): r)
    engines = [RandomEngine(seed + i, engine_id=f"rand-{i}") for i in range(2)]
    for e in engines:
        e.version = start_step
    loop = build_loop(cfg, engines=engines, trainer=trainer, tasks=tasks, graders=graders,
                      decode=lambda ids: "x" * len(ids), ledger=ledger, metrics=NullMetrics(),
                      clock=WallClock(), params=SamplingParams(max_new_tokens=24),
                      start_step=start_step, staleness=trainer.policy)
    return loop, graders


def run_with_resume(tmp: Path, *, k: int, on_update: str, seed: int,
                    steps: int, resume_at: int, lost: int, max_token_age: int | None,
                    max_context_age: int | None = None, replay: dict | None = None):
    extra = {} if max_context_age is None else {"max_context_age": max_context_age}
    if replay is not None:
        extra["replay"] = replay
    cfg = RunConfig(
        rollout=rollout_cfg(mode="async", k=k, on_update=on_update, max_token_age=max_token_age,
                            **extra),
        train=TrainConfig(steps=steps, groups_per_step=2),
    )
    path = tmp / "ledger.jsonl"
    policy = cfg.rollout.staleness_policy()
    snap: dict = {}

    async def first():
        ledger = Ledger(path)
        trainer = CountingTrainer(seed, policy)
        loop, graders = _loop(cfg, seed=seed, ledger=ledger, tasks=Tasks(), trainer=trainer)

        async def after_step(step, values):
            if step + 1 == resume_at:
                await loop.sync.wait_applied()
                snap.update(await loop.rollout.snapshot())

        dies = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"steps": min(steps, resume_at + lost)})})  # then the process "dies"
        await run_then_close(dies, loop, graders, ledger, after_step=after_step)

    async def second():
        ckpt = Checkpoint(path=tmp, state={"step": resume_at, "rollout": snap})
        skip, _ = reconcile_ledger(tmp, ckpt, group_size=GROUP)
        ledger = Ledger(path)
        trainer = RecordingTrainer(seed + 1, policy)
        tasks = Tasks()
        loop, graders = _loop(cfg, seed=seed + 7, ledger=ledger, tasks=tasks, trainer=trainer,
                              start_step=resume_at)
        loop.rollout.restore(snap, version=resume_at)
        loop.rollout.skip(skip)
        res = await run_then_close(cfg, loop, graders, ledger)
        return res, ledger, trainer, tasks

    asyncio.run(first())
    res, ledger, trainer, tasks = asyncio.run(second())
    return cfg, snap, res, ledger, trainer, tasks


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.integers(0, 3),
       on_update=st.sampled_from(["interrupt", "continue", "drain"]),
       max_token_age=st.sampled_from([None, 0, 1, 2]), resume_at=st.integers(1, 5),
       lost=st.integers(0, 2), context_extra=st.sampled_from([None, 0, 1, 2]))
def test_resume_keeps_staleness_and_exactly_once(tmp_path_factory, seed, k, on_update,
                                                 max_token_age, resume_at, lost, context_extra):
    """Each staleness semantics (drop, mask, admission) keeps its bounds across a resume."""
    assume(max_token_age is None or max_token_age <= k)
    steps = 7
    tmp = tmp_path_factory.mktemp("run")
    h = None if context_extra is None else k + context_extra  # None: the default 2k
    cfg, snap, res, ledger, trainer, tasks = run_with_resume(
        tmp, k=k, on_update=on_update, seed=seed, steps=steps,
        resume_at=resume_at, lost=lost, max_token_age=max_token_age, max_context_age=h)
    policy = cfg.rollout.staleness_policy()
    assert res.steps_done == steps
    assert not ledger.unfinished(), "every dispatched sample reaches a terminal status"
    rows = read_ledger(tmp / "ledger.jsonl")
    uids = [r.sample_uid for r in rows]
    assert len(uids) == len(set(uids)), "no sample recorded twice"
    trained = [r for r in rows if r.status == "trained"]
    by_step: dict[int, set[str]] = {}
    for r in trained:
        by_step.setdefault(r.trained_at_step, set()).add(r.sample_uid.rsplit("/", 1)[0])
        assert r.trained_at_step - r.min_trained_version <= policy.kept_bound, r
        assert r.trained_at_step - r.min_version <= policy.context_bound, r
        if policy.rule != "admission":
            assert r.trained_at_step - r.min_trained_version <= k, r
        if max_token_age is not None:
            assert r.trained_at_step - r.min_trained_version <= max_token_age, r
    assert set(by_step) <= set(range(steps))
    assert all(len(groups) <= cfg.train.groups_per_step for groups in by_step.values()), \
        "a step's trained groups come from one batch: no step trained twice"
    drawn = {f"t/{i}" for i in range(tasks.state()["next"])}
    assert {r.task_uid for r in rows} == drawn, "every drawn task is in the ledger"
    superseded = tmp / "ledger.superseded.jsonl"
    if superseded.exists():  # nothing dropped silently: a superseded line's sample is redone
        # when the resumed run draws its task again (a run that filtered or dropped fewer
        # samples after the resume can end its steps before it reaches that task: the line
        # stays in the superseded file, the record of the future the resume discarded)
        for r in read_ledger(superseded):
            assert r.sample_uid in set(uids) or r.status != "trained" \
                or r.task_uid not in drawn, r
    # a partial sample the snapshot saved continued from its tokens, versions kept
    saved = {f"{g['group_id']}/{s['idx']}": [t for seg in s["segments"]
                                            for t in zip(seg["token_ids"], seg["versions"])]
             for g in (*snap["live"], *snap["buffer"]) for s in g["samples"] if s["segments"]}
    for uid, pairs in saved.items():
        if uid in trainer.tokens:
            ids, versions = trainer.tokens[uid]
            assert list(zip(ids, versions))[:len(pairs)] == pairs, uid
    restored = [r for r in rows if r.restored_tokens > 0]
    assert all(r.sample_uid in saved for r in restored)


def test_a_partial_sample_continues_across_a_resume(tmp_path):
    """Slow engines and a snapshot mid-generation: some saved sample has tokens, and its
    ledger line says how many it carried over."""
    _, snap, _, _, trainer, _ = run_with_resume(
        tmp_path, k=2, on_update="continue", seed=5, steps=6, resume_at=2,
        lost=1, max_token_age=None)
    partial = [s for g in snap["live"] for s in g["samples"]
               if s["status"] == "interrupted" and s["segments"]]
    assert partial, "the snapshot caught samples mid-generation"
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert any(r.restored_tokens > 0 for r in rows)


def test_a_run_with_no_engine_alive_keeps_its_partial_samples_for_a_resume(tmp_path):
    """Both engines die mid-generation: the run stops (stalled) with its stranded samples
    still holding their tokens, so the stop's snapshot saves them; only then are they
    recorded ABORTED. A resume with working engines supersedes those lines, continues the
    samples from their tokens and finishes every step: nothing the dead engines made is lost."""
    cfg = RunConfig(rollout=rollout_cfg(mode="async", k=1, on_update="continue"),
                    train=TrainConfig(steps=4, groups_per_step=2))
    path = tmp_path / "ledger.jsonl"
    policy = cfg.rollout.staleness_policy()
    snap: dict = {}

    async def first():
        ledger = Ledger(path)
        loop, graders = _loop(cfg, seed=3, ledger=ledger, tasks=Tasks(),
                              trainer=CountingTrainer(3, policy))
        for i, e in enumerate(loop.dispatcher.engines):
            e.die_after_tokens = 30 + 20 * i

        async def before_stop(res):
            assert res.stalled and res.stop_reason.startswith("no engine is alive"), res
            snap["step"] = res.steps_done
            snap.update(await loop.rollout.snapshot())

        res = await run_then_close(cfg, loop, graders, ledger, before_stop=before_stop)
        return res

    res = asyncio.run(first())
    assert res.stalled and snap
    held = {f"{g['group_id']}/{s['idx']}" for g in snap["live"] for s in g["samples"]}
    saved = {f"{g['group_id']}/{s['idx']}": sum(len(seg["token_ids"]) for seg in s["segments"])
             for g in snap["live"] for s in g["samples"]
             if s["status"] == "interrupted" and s["segments"]}
    assert saved, "the stranded samples kept their tokens"
    aborted = {r.sample_uid for r in read_ledger(path) if r.status == "aborted"}
    assert held <= aborted, "after the snapshot the stop records them ABORTED"

    async def second():
        step = snap.pop("step")
        ckpt = Checkpoint(path=tmp_path, state={"step": step, "rollout": snap})
        skip, superseded = reconcile_ledger(tmp_path, ckpt, group_size=GROUP)
        assert superseded >= len(saved)
        ledger = Ledger(path)
        trainer = RecordingTrainer(4, policy)
        loop, graders = _loop(cfg, seed=11, ledger=ledger, tasks=Tasks(), trainer=trainer,
                              start_step=step)
        loop.rollout.restore(snap, version=step)
        loop.rollout.skip(skip)
        return await run_then_close(cfg, loop, graders, ledger), ledger

    res, ledger = asyncio.run(second())
    assert res.steps_done == 4 and not res.stalled
    assert not ledger.unfinished()
    rows = {r.sample_uid: r for r in read_ledger(path)}
    assert len(rows) == len(read_ledger(path)), "one line per sample"
    assert all(rows[uid].status != "aborted" for uid in held)
    for uid, n in saved.items():
        assert rows[uid].restored_tokens == n, (uid, rows[uid])
