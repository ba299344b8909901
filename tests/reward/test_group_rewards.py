"""Group rewards: one call per group with every response, one number back per response.

Sync group rewards run in the pool's worker processes (``tests.reward.worker_rewards``); the
dispatcher test runs a real embedded engine and checks that a group is graded together, once,
after all its samples finished."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollstream.config.schema import RewardConfig
from rollstream.reward import GraderPool, Response, get_reward, group_reward, register_reward
from rollstream.trajectory import Task
from tests.reward import worker_rewards as w


def task(reference: str = "", source: str = "test", uid: str = "t") -> Task:
    return Task(uid=uid, source=source, prompt_ids=(1,), prompt_text="q", reference=reference)


def said(text: str, finish_reason: str = "stop") -> Response:
    return Response(text=text, token_ids=tuple(range(len(text))), finish_reason=finish_reason)


async def test_a_sync_group_reward_gets_lists_and_scores_each_response_in_order() -> None:
    pool = GraderPool(RewardConfig(num_workers=1), lambda t: get_reward(w.shortest_wins))
    try:
        assert pool.grades_groups(task())
        results = await pool.grade_group(task(), [said("abcd"), said("ab"), said("a", "length"),
                                                  said("xy")])
    finally:
        pool.close()
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 1.0]  # "a" was capped: not shortest
    assert all(r.error is None for r in results)


@pytest.mark.parametrize(("reference", "error"), [
    ("short", "group reward returned 1 values for 2 responses"),
    ("scalar", "group reward returned 1.0, expected a list of 2 numbers"),
    ("str", "group reward returned '1.0', expected a list of 2 numbers"),
    ("nan_at_1", "group reward, response 1: reward returned nan, expected a finite number"),
])
async def test_a_bad_group_result_fails_every_response_with_the_reason(reference: str,
                                                                       error: str) -> None:
    pool = GraderPool(RewardConfig(num_workers=1), lambda t: get_reward(w.group_value_named))
    try:
        results = await pool.grade_group(task(reference), [said("a"), said("b")])
        ok = await pool.grade_group(task("ok"), [said("a"), said("b")])
    finally:
        pool.close()
    assert [(r.reward, r.error) for r in results] == [(None, error)] * 2
    assert [r.reward for r in ok] == [0.5, 1.0]  # a tuple of numbers (an int too) is fine


async def test_an_async_group_reward_runs_in_the_loop_and_sees_columns() -> None:
    seen = []

    @group_reward
    async def by_rank(task: Task, texts: list[str], *, token_ids: list[tuple[int, ...]],
                      bonus: float) -> list[float]:
        seen.append((texts, token_ids))
        order = sorted(range(len(texts)), key=lambda i: texts[i])
        return [bonus * order.index(i) for i in range(len(texts))]

    reward = get_reward(by_rank).with_columns(["bonus"])
    t = Task(uid="t", source="s", prompt_ids=(1,), prompt_text="q", reference="",
             extra={"bonus": 0.5})
    pool = GraderPool(RewardConfig(), lambda _: reward)
    try:
        results = await pool.grade_group(t, [said("c"), said("a"), said("b")])
        one = await pool.grade(t, said("z"))  # a group of one
    finally:
        pool.close()
    assert [r.reward for r in results] == [1.0, 0.0, 0.5]
    assert seen[0] == (["c", "a", "b"], [(0,), (0,), (0,)])
    assert one.reward == 0.0 and seen[1] == (["z"], [(0,)])
    assert reward.score(t, said("z")) == 0.0  # outside a run: a group of one, in this process


def test_group_reward_marks_a_function_registered_before_or_after() -> None:
    @register_reward("test_group_under")
    @group_reward
    async def under(task: Task, texts: list[str]) -> list[float]:
        return [1.0] * len(texts)

    @group_reward
    @register_reward("test_group_over")
    async def over(task: Task, texts: list[str]) -> list[float]:
        return [1.0] * len(texts)

    assert get_reward("test_group_under").group and get_reward("test_group_over").group
    assert not get_reward(w.pid).group


async def test_a_per_sample_reward_is_not_graded_as_a_group() -> None:
    pool = GraderPool(RewardConfig(num_workers=1), lambda t: get_reward(w.pid))
    try:
        assert not pool.grades_groups(task())
        with pytest.raises(ValueError, match="grades one response at a time"):
            await pool.grade_group(task(), [said("a"), said("b")])
    finally:
        pool.close()


def test_the_dispatcher_grades_a_group_once_after_every_sample_finished(tmp_path: Path) -> None:
    from rollstream.clock import WallClock
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import Group, SampleStatus
    from tests.engine.helpers import make_tiny_model

    calls: list[tuple[str, list[int], list[str]]] = []

    @group_reward
    async def longest_first(task: Task, texts: list[str], *,
                            token_ids: list[tuple[int, ...]]) -> list[float]:
        calls.append((task.uid, [len(t) for t in token_ids], [s.status.value for s in live]))
        lengths = [len(t) for t in token_ids]
        return [float(n == max(lengths)) for n in lengths]

    reward = get_reward(longest_first)
    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=8, max_seq_len=96, threads=1, device="cpu")
    groups = [Group.new(task(uid=f"t/{i}"), 4) for i in range(3)]
    live = [s for g in groups for s in g.samples]

    async def main() -> None:
        engine = LocalEngine(model, cfg, engine_id="a")
        graders = GraderPool(RewardConfig(), lambda _: reward)
        disp = Dispatcher(engines=[engine], params=SamplingParams(max_new_tokens=24, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()), span=lambda **kw: None)
        try:
            await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        finally:
            await engine.close()
            graders.close()

    asyncio.run(main())
    assert sorted(uid for uid, _, _ in calls) == ["t/0", "t/1", "t/2"]  # once per group
    for g in groups:
        (_, lengths, statuses_then), = [c for c in calls if c[0] == g.task.uid]
        mine = [statuses_then[live.index(s)] for s in g.samples]
        assert mine == ["generated"] * 4  # called after every sample of its group finished
        assert lengths == [s.num_response_tokens for s in g.samples]
        assert all(s.status is SampleStatus.GRADED for s in g.samples)
        assert [s.reward for s in g.samples] == [float(n == max(lengths)) for n in lengths]
