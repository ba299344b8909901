"""The task mix with the rollout's feedback: the quota keeps the trained mixture at the weights
where drawing by weight does not, the oversampling bound, in-flight caps, the state.

The feedback loop here is a small model of the rollout (a staleness capacity, groups that take
time to generate, filtered groups retired, whole groups trained in batches, FIFO), driving the
real TaskMix through the same calls the rollout makes; tests/rollout/test_mix_loop.py runs the
real rollout."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.data.mix import TaskMix
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.trajectory import Group

TOK = build_char_tokenizer()
G = 4  # samples per group


def _mix(mix: str = "quota", **src_kw) -> TaskMix:
    a = SourceConfig(kind="tick", name="a", **src_kw.get("a", {}))
    b = SourceConfig(kind="digits", name="b", **src_kw.get("b", {}))
    return TaskMix(TasksConfig(sources=(a, b), mix=mix), TOK)


def feedback_loop(mix: TaskMix, *, steps: int, filtered: dict[str, float], gen_ticks: dict[str, int],
                  groups_per_step: int = 8, max_staleness: int = 2, seed: int = 0) -> Counter:
    """Trained samples per source after ``steps`` trainer steps of a model rollout: source s's
    groups are filtered with probability ``filtered[s]`` and take about ``gen_ticks[s]`` ticks
    to generate; a trainer step takes one tick and trains ``groups_per_step`` whole groups."""
    rng = random.Random(seed)
    live: list[tuple[int, Group]] = []  # (tick it ends, group)
    buffer: list[Group] = []
    admitted = retired = version = tick = 0
    trained: Counter = Counter()
    while version < steps:
        while admitted - retired < (version + max_staleness + 1) * groups_per_step:
            task = mix.next_task()
            assert task is not None
            group = Group.new(task, G, k=admitted)
            admitted += 1
            live.append((tick + rng.randint(1, 2 * gen_ticks[task.source]), group))
        tick += 1
        for end, group in [x for x in live if x[0] <= tick]:
            live.remove((end, group))
            zero = rng.random() < filtered[group.task.source]
            mix.ended(group, [1.0] * G if zero else [1.0, 0.0] * (G // 2))
            if zero:
                mix.resolved(group, 0)
                retired += 1
            else:
                buffer.append(group)
        if len(buffer) >= groups_per_step:
            batch, buffer = buffer[:groups_per_step], buffer[groups_per_step:]
            for group in batch:
                mix.resolved(group, G)
                trained[group.task.source] += G
            version += 1
    return trained


def test_quota_keeps_the_trained_mixture_at_the_weights_where_drawing_by_weight_does_not():
    # a: long and filtered 70% of the time; b: short and filtered 10%; equal weights
    filtered, gen_ticks = {"a": 0.7, "b": 0.1}, {"a": 6, "b": 1}
    quota, weighted = _mix("quota"), _mix("weighted")
    for mix in (quota, weighted):
        trained = feedback_loop(mix, steps=150, filtered=filtered, gen_ticks=gen_ticks)
        share_a = trained["a"] / sum(trained.values())
        metrics = mix.metrics()
        assert metrics["mix_share/a"] == pytest.approx(share_a)
        assert metrics["mixture_error_pp"] == pytest.approx(100 * abs(share_a - 0.5))
        if mix is quota:
            assert metrics["mixture_error_pp"] <= 2.0, metrics
        else:  # by weight: a trains 0.3 / (0.3 + 0.9) = 25 % of samples
            assert metrics["mixture_error_pp"] >= 15.0, metrics


def test_quota_follows_unequal_weights_and_three_sources():
    cfg = TasksConfig(sources=(SourceConfig(kind="tick", name="a", weight=1.0),
                               SourceConfig(kind="digits", name="b", weight=2.0),
                               SourceConfig(kind="math", name="c", weight=5.0)))
    mix = TaskMix(cfg, TOK)
    trained = feedback_loop(mix, steps=200, filtered={"a": 0.2, "b": 0.6, "c": 0.5},
                            gen_ticks={"a": 2, "b": 5, "c": 1}, seed=3)
    total = sum(trained.values())
    for name, target in (("a", 1 / 8), ("b", 2 / 8), ("c", 5 / 8)):
        assert abs(trained[name] / total - target) <= 0.02, (name, trained)


def test_without_feedback_quota_is_a_weighted_round_robin():
    mix = TaskMix(TasksConfig(sources=(SourceConfig(kind="tick", weight=1.0),
                                       SourceConfig(kind="digits", weight=3.0))), TOK)
    drawn = Counter()
    for i in range(1, 401):
        drawn[mix.next_task().source] += 1
        assert abs(drawn["digits"] - 0.75 * i) <= 1.0  # every prefix, not only on average


def test_max_oversample_bounds_the_draws_of_a_source_that_never_trains():
    mix = _mix("quota", a={"max_oversample": 1.5})
    trained = feedback_loop(mix, steps=60, filtered={"a": 1.0, "b": 0.0},
                            gen_ticks={"a": 1, "b": 1})
    counts = mix.state()["counts"]
    draws = counts["a"]["drawn"] + counts["b"]["drawn"]
    assert counts["a"]["drawn"] <= 1.5 * 0.5 * draws + 1  # at most 1.5x its weight's share
    assert counts["a"]["drawn"] >= 0.7 * draws  # and the correction does push it that far
    assert trained["a"] == 0 and mix.metrics()["mixture_error_pp"] == pytest.approx(50.0)


@pytest.mark.parametrize("rule", ["quota", "weighted"])
def test_a_source_at_its_in_flight_cap_is_passed_over_then_nothing_is_drawn(rule):
    mix = _mix(rule, a={"max_in_flight": 2}, b={"max_in_flight": 3})
    drawn = [mix.next_task() for _ in range(5)]
    assert Counter(t.source for t in drawn) == {"a": 2, "b": 3}
    assert mix.next_task() is None  # every source at its cap: the rollout waits
    first_a = next(t for t in drawn if t.source == "a")
    mix.ended(Group.new(first_a, G), [1.0] * G)  # one a group ends generating
    assert mix.next_task().source == "a"
    assert mix.next_task() is None


def _dataset(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Q{i:03d}=", "answer": "1"})
                            + "\n" for i in range(n)))
    return path


def test_a_row_at_its_per_task_cap_is_passed_over(tmp_path: Path):
    cfg = SourceConfig(kind="jsonl", name="ds", path=str(_dataset(tmp_path, 40)),
                       max_in_flight_per_task=1)
    mix = TaskMix(TasksConfig(sources=(cfg,), num_eval=0), TOK)
    rows = mix.source("ds").num_tasks("train")
    live = [mix.next_task() for _ in range(rows)]
    assert len({t.uid for t in live}) == rows  # every train row once
    assert mix.next_task() is None  # all at their cap
    mix.ended(Group.new(live[5], G), None)  # a cancelled group ends too
    assert mix.next_task().uid == live[5].uid
    assert mix.next_task() is None


def test_state_round_trips_the_counters_and_an_older_state_still_restores():
    mix = _mix()
    feedback_loop(mix, steps=5, filtered={"a": 0.5, "b": 0.2}, gen_ticks={"a": 3, "b": 1})
    state = json.loads(json.dumps(mix.state()))  # JSON, as a checkpoint writes it
    expected = [mix.next_task().uid for _ in range(30)]
    fresh = _mix()
    fresh.restore(state)
    assert [fresh.next_task().uid for _ in range(30)] == expected
    assert fresh.metrics() == mix.metrics()
    old = _mix()
    old.restore({"num_drawn": 7, "next_index": {"a": 3, "b": 4}})  # before the counters
    assert old.next_task().uid in ("a/train/3", "b/train/4")
    old.ended(Group.new(old.next_task(), G), [1.0] * G)
    old.resolved(Group.new(old.next_task(), G), G)  # groups it did not count: no error
    assert old.state()["counts"]["a"]["pending"] >= 0
