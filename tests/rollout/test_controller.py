"""The controller's scheduling invariants over random completion orders: staleness never
exceeds its bound, every dispatched sample reaches the ledger exactly once, sync is exactly
on-policy. Engines and the trainer are doubles at the process edge (tests/rollout/fakes.py);
the dispatcher, capacity, buffer, sync, graders and ledger are the real ones."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rollstream.clock import WallClock
from rollstream.config import RewardConfig, RolloutConfig, RunConfig, TrainConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.runtime.build import build_loop
from rollstream.trajectory import SampleStatus, Task

from .fakes import CountingTrainer, NullMetrics, RandomEngine, run_then_close


class Tasks:
    def __init__(self) -> None:
        self._n = 0

    def state(self) -> dict[str, int]:
        return {"next": self._n}

    def restore(self, state: dict[str, int]) -> None:
        self._n = state["next"]

    def next_task(self) -> Task:
        i, self._n = self._n, self._n + 1
        return Task(uid=f"t/{i}", source="t", prompt_ids=(i % 7 + 1, i % 5 + 1, i % 3 + 1, 9),
                    prompt_text="", reference="")


def _reward(task: Task, text: str) -> float:
    return float(len(text) % 3 == 0)


def rollout_cfg(*, mode: str, k: int, on_update: str, max_token_age: int | None = None,
                max_context_age: int | None = None, **extra) -> RolloutConfig:
    """The rollout section as a user would write it: no setting the mode contradicts."""
    staleness = {key: v for key, v in (("max_token_age", max_token_age),
                                       ("max_context_age", max_context_age)) if v is not None}
    if mode == "async":
        staleness["max_staleness"] = k
    return RolloutConfig(mode=mode, on_update=on_update, group_size=3, staleness=staleness,
                         **extra)


def run_controller(tmp_path, *, mode: str, k: int, on_update: str, seed: int,
                   steps: int = 6, num_engines: int = 2, max_token_age: int | None = None,
                   engines=None, reward=_reward, max_wall_s: float | None = None,
                   metrics=None, **rollout_extra):
    cfg = RunConfig(
        rollout=rollout_cfg(mode=mode, k=k, on_update=on_update, max_token_age=max_token_age,
                            **rollout_extra),
        train=TrainConfig(steps=steps, groups_per_step=2),
        max_wall_s=max_wall_s,
    )

    async def main():
        engs = engines() if engines is not None else [
            RandomEngine(seed + i, engine_id=f"rand-{i}") for i in range(num_engines)]
        ledger = Ledger(tmp_path / "ledger.jsonl")
        async def in_loop(task: Task, text: str) -> float:  # no worker process for a test double
            return reward(task, text)

        graders = GraderPool(RewardConfig(timeout_s=5.0), lambda task, r=get_reward(in_loop): r)
        policy = cfg.rollout.staleness_policy()
        trainer = CountingTrainer(seed, policy)
        loop = build_loop(cfg, engines=engs, trainer=trainer, tasks=Tasks(), graders=graders,
                          decode=lambda ids: "x" * len(ids), ledger=ledger,
                          metrics=metrics or NullMetrics(), clock=WallClock(),
                          params=SamplingParams(max_new_tokens=24), staleness=policy)
        res = await run_then_close(cfg, loop, graders, ledger)
        return loop, res, ledger, trainer

    return asyncio.run(main())


def check_invariants(tmp_path, loop, res, ledger, trainer, k, max_token_age=None):
    assert res.steps_done == len(trainer.batches)
    assert not ledger.unfinished(), "every dispatched sample reaches a terminal status"
    rows = read_ledger(tmp_path / "ledger.jsonl")
    uids = [r.sample_uid for r in rows]
    assert len(uids) == len(set(uids)), "no sample recorded twice"
    trained = [r for r in rows if r.status == "trained"]
    assert len(trained) == res.trained_samples > 0
    policy = loop.rollout.policy
    bound = policy.context_bound
    kept = k if policy.rule != "admission" else bound  # admission: k bounds admission only
    for r in trained:  # the tokens the loss keeps are at most k (and max_token_age) old
        assert r.trained_at_step - r.min_trained_version <= min(kept, policy.kept_bound), r
        assert r.trained_at_step - r.min_version <= bound, r  # nor any token it saw
        assert r.num_trained_tokens > 0, r
        # the ledger keeps the kept tokens' version sum (the staleness tile's exact age)
        assert (r.min_trained_version * r.num_trained_tokens <= r.trained_version_sum
                <= r.max_version * r.num_trained_tokens), r
        if max_token_age is None:
            assert r.min_trained_version == r.min_version, r
        else:
            assert r.trained_at_step - r.min_trained_version <= max_token_age, r
            assert r.min_trained_version <= r.max_version, r
    trained_in_batches = [u for b in trainer.batches for _, us in b for u in us]
    assert len(trained_in_batches) == len(set(trained_in_batches)), "nothing trained twice"
    statuses = {r.status.value for r in rows}
    assert statuses <= {"trained", "filtered", "dropped_stale", "failed", "aborted"}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.integers(0, 3),
       on_update=st.sampled_from(["interrupt", "continue", "drain"]),
       max_token_age=st.sampled_from([None, 0, 1, 2, 3]),
       context_extra=st.sampled_from([None, 0, 1, 2]))
def test_staleness_bound_and_exactly_once_async(tmp_path_factory, seed, k, on_update,
                                                max_token_age, context_extra):
    """Every semantics (drop, mask, admission: max_context_age = k + context_extra, or its
    default 2k when None) keeps its written bounds and exactly-once recording."""
    assume(max_token_age is None or max_token_age <= k)  # else a config error (test_config)
    tmp = tmp_path_factory.mktemp("run")
    extra = {} if context_extra is None else {"max_context_age": k + context_extra}
    loop, res, ledger, trainer = run_controller(tmp, mode="async", k=k,
                                                on_update=on_update, seed=seed,
                                                max_token_age=max_token_age, **extra)
    check_invariants(tmp, loop, res, ledger, trainer, k, max_token_age)


def test_token_age_trains_resumed_samples_instead_of_dropping_them(tmp_path_factory):
    """Partial rollout at k=1 drops samples whose oldest token is too old (drop, the
    default). With max_token_age=1 their recent tokens are trained instead (old ones
    masked), and the only samples dropped are those whose every token is too old (mask).
    With max_context_age=2 and no token age they are trained whole (admission). Three seeded
    runs each (the completion orders are random)."""
    def run(max_token_age, rows_only=False, **extra):
        rows = []
        for seed in (11, 12, 13):
            tmp = tmp_path_factory.mktemp("run")
            loop, res, ledger, trainer = run_controller(
                tmp, mode="async", k=1, on_update="continue", seed=seed,
                steps=20, max_token_age=max_token_age, **extra)
            check_invariants(tmp, loop, res, ledger, trainer, 1, max_token_age)
            rows += read_ledger(tmp / "ledger.jsonl")
        if rows_only:
            return rows
        dropped = [r.reason for r in rows if r.status == "dropped_stale"]
        masked = [r for r in rows if r.status == "trained"
                  and r.min_trained_version > r.min_version]
        return dropped, masked

    dropped, masked = run(None)
    assert dropped and all(reason.startswith("staleness") for reason in dropped)
    assert not masked
    dropped, masked = run(1)
    assert masked, "resumed samples trained on their recent tokens"
    # dropped: every token masked, or seen context older than max_context_age (2 x k)
    assert all(reason.startswith(("every token older than max_token_age 1",
                                  "context age")) for reason in dropped), dropped
    # admission (AReaL's): k=1 bounds admission only; samples up to 2 versions old train whole
    rows = run(None, max_context_age=2, rows_only=True)
    old = [r for r in rows if r.status == "trained"
           and r.trained_at_step - r.min_version == 2]
    assert old and all(r.min_trained_version == r.min_version for r in old)
    assert all(r.reason.startswith("context age 3 > max_context_age 2")
               for r in rows if r.status == "dropped_stale")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sync_mode_is_exactly_on_policy(tmp_path, seed):
    loop, res, ledger, trainer = run_controller(tmp_path, mode="sync", k=0,
                                               on_update="interrupt", seed=seed)
    check_invariants(tmp_path, loop, res, ledger, trainer, 0)
    rows = [r for r in read_ledger(tmp_path / "ledger.jsonl") if r.status == "trained"]
    assert all(r.min_version == r.max_version == r.trained_at_step for r in rows)
    assert not any(r.status == "aborted" for r in read_ledger(tmp_path / "ledger.jsonl"))
    # sync admits a batch, then waits at its staleness limit while it generates and trains
    # (the per-step metrics read it since the previous step: here the run's total)
    assert loop.rollout.capacity.blocked_s > 0
    loop.rollout.stats()
    assert loop.rollout.stats()["staleness_blocked_s"] == 0  # counted since the last call


def test_one_step_overlaps_by_one_version(tmp_path):
    loop, res, ledger, trainer = run_controller(tmp_path, mode="one_step", k=1,
                                               on_update="drain", seed=3, steps=8)
    check_invariants(tmp_path, loop, res, ledger, trainer, 1)
    rows = [r for r in read_ledger(tmp_path / "ledger.jsonl") if r.status == "trained"]
    assert any(r.trained_at_step - r.min_version == 1 for r in rows)


def test_partial_rollout_interrupts_and_keeps_versions(tmp_path):
    engines: list[RandomEngine] = []

    def make():
        engines.extend(RandomEngine(4 + i, engine_id=f"rand-{i}") for i in range(2))
        return engines

    loop, res, ledger, trainer = run_controller(tmp_path, mode="async", k=3,
                                                on_update="interrupt", seed=4, steps=8,
                                                engines=make)
    check_invariants(tmp_path, loop, res, ledger, trainer, 3)
    rows = read_ledger(tmp_path / "ledger.jsonl")
    resumed = [r for r in rows if r.num_interrupts > 0 and r.status == "trained"]
    assert resumed, "some trained samples were interrupted and resumed"
    assert any(r.max_version > r.min_version for r in resumed)
    # every sample holds exactly the tokens its engines generated for it, across interrupts
    made: dict[str, int] = {}
    for e in engines:
        for uid, n in e.tokens_by_sample.items():
            made[uid] = made.get(uid, 0) + n
    assert {r.sample_uid: r.num_tokens for r in rows if r.num_tokens} == made


def test_a_dying_loop_stops_the_run_with_its_traceback(tmp_path, monkeypatch):
    step_ok = CountingTrainer.step

    def boom(self, groups, step):
        if step == 2:
            raise RuntimeError("trainer exploded at step 2")
        return step_ok(self, groups, step)

    monkeypatch.setattr(CountingTrainer, "step", boom)
    with pytest.raises(BaseExceptionGroup) as info:
        run_controller(tmp_path, mode="async", k=2, on_update="interrupt", seed=5)
    assert "trainer exploded at step 2" in str(info.value.exceptions)


def test_adaptive_concurrency_keeps_the_invariants_through_weight_updates(tmp_path):
    """rollout.concurrency: adaptive, wired from config by build_loop, under interrupts and
    resumes: every sample reaches a terminal status once, nothing is trained twice, each
    engine got a controller. (These fake engines have unbounded capacity, so the limit does
    not bind here; test_dispatch_queue.py shows it binding on real engines.)"""
    loop, res, ledger, trainer = run_controller(
        tmp_path, mode="async", k=1, on_update="interrupt", seed=5, steps=6,
        dispatch="fifo", concurrency="adaptive", concurrency_window_tokens=64)
    check_invariants(tmp_path, loop, res, ledger, trainer, 1)
    queue = loop.dispatcher.queue
    assert queue is not None and set(queue.limits) == {"rand-0", "rand-1"}
    assert all(1 <= c.limit <= c.capacity for c in queue.limits.values())
    assert "concurrency_mean" in loop.dispatcher.gauges()


class _Observed(NullMetrics):
    def __init__(self) -> None:
        self.staleness: list[float] = []

    def observe(self, name, value) -> None:
        if name == "staleness":
            self.staleness.append(value)


def test_the_staleness_metric_is_each_trained_samples_age_in_the_ledger(tmp_path):
    """The controller's staleness histogram holds, per trained sample, trained step - oldest
    kept version, as the ledger (and so the run log and the simulator) has it: a sample whose
    oldest kept token is of version 0 counts its full age, not 0."""
    seen = _Observed()
    loop, res, ledger, trainer = run_controller(tmp_path, mode="async", k=2,
                                                on_update="interrupt", seed=4, metrics=seen)
    rows = [r for r in read_ledger(tmp_path / "ledger.jsonl")
            if r.status is SampleStatus.TRAINED]
    ages = sorted(float(r.trained_at_step - r.min_trained_version) for r in rows)
    assert sorted(seen.staleness) == ages
    assert any(r.min_trained_version == 0 and r.trained_at_step > 0 for r in rows)
