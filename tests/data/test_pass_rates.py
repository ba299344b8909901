"""Pass-rate-aware sampling: the Beta arithmetic and the fitted prior, tasks whose groups never
vary drawn less but never below the floor, difficulty buckets of a generated source, drift,
and drawing in order until feedback comes."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.config.tasks import PassRateConfig
from rollstream.data.mix import TaskMix
from rollstream.data.pass_rates import PassRates, zero_variance_chance
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.trajectory import Group

TOK = build_char_tokenizer()
G = 8
ON = PassRateConfig(enabled=True, floor=0.1)


def test_zero_variance_chance_is_the_beta_moment():
    assert zero_variance_chance(1.0, 1.0, 8) == pytest.approx(2 / 9)  # E[p^8] = 1/9 for U(0,1)
    rng = random.Random(0)
    draws = [rng.betavariate(3.0, 1.5) for _ in range(50_000)]
    monte_carlo = sum(p ** 5 + (1 - p) ** 5 for p in draws) / len(draws)
    assert zero_variance_chance(3.0, 1.5, 5) == pytest.approx(monte_carlo, abs=6e-3)


def test_weights_fall_for_groups_that_never_vary_and_stay_for_those_that_do():
    rates = PassRates(ON, seed=0)
    assert rates.weight("s", "k") == 1.0  # no evidence
    for _ in range(4):
        rates.observe("s", "easy", [1.0] * G, G)
        rates.observe("s", "hard", [0.0] * G, G)
        rates.observe("s", "mixed", [1.0, 0.0] * (G // 2), G)
    assert rates.weight("s", "mixed") > 0.95  # its next group is near sure to train
    assert rates.weight("s", "easy") == pytest.approx(0.1)  # down to the floor
    assert rates.weight("s", "hard") == pytest.approx(0.1)
    assert rates.rate("s") == pytest.approx(1 / 2, abs=0.05)
    assert 0.1 < rates.weight("s", "unseen") < 0.5  # the prior: most of these groups agree


def test_the_prior_is_fitted_to_the_spread_of_the_sources_tasks():
    rng = random.Random(0)
    rates = PassRates(ON, seed=0)
    for _ in range(400):  # bimodal: a task is nearly always solved, or nearly never
        p = rng.choice((0.03, 0.97))
        rates.observe("bimodal", "k", [float(rng.random() < p) for _ in range(G)], G)
        p = rng.uniform(0.4, 0.6)  # every task middling
        rates.observe("middling", "k", [float(rng.random() < p) for _ in range(G)], G)
    a, b = rates.prior("bimodal")
    assert a + b < 0.5 and a / (a + b) == pytest.approx(0.5, abs=0.1)  # U-shaped
    a, b = rates.prior("middling")
    assert a + b > 20 and a / (a + b) == pytest.approx(0.5, abs=0.1)  # concentrated


def _dataset(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Q{i:03d}=", "answer": "1"})
                            + "\n" for i in range(n)))
    return path


def _report(mix: TaskMix, task, rewards) -> None:
    group = Group.new(task, G)
    mix.ended(group, rewards)
    mix.resolved(group, 0 if len(set(rewards)) == 1 else G)


def test_the_sampler_never_starves_a_task_below_its_floor(tmp_path: Path):
    src = SourceConfig(kind="jsonl", name="ds", path=str(_dataset(tmp_path, 24)))
    mix = TaskMix(TasksConfig(sources=(src,), num_eval=0, pass_rate=ON), TOK)
    rows = mix.source("ds").num_tasks("train")
    informative = {f"ds/r{i}" for i in range(3)}  # the rest: every group all correct
    drawn: Counter = Counter()
    for _ in range(3000):
        task = mix.next_task()
        drawn[task.uid] += 1
        _report(mix, task, [1.0, 0.0] * (G // 2) if task.uid in informative else [1.0] * G)
    passes = mix.state()["next_index"]["ds"] // rows  # each row was offered once per pass
    assert len(drawn) == rows
    for uid, n in drawn.items():
        assert n >= ON.floor * (passes - 1) - 1, (uid, n, passes)  # the floor, every row
        if uid in informative:
            assert n >= 0.95 * passes  # taken at nearly every offer
        else:
            assert n <= 0.3 * passes  # sampled less
    easy_share = sum(n for u, n in drawn.items() if u not in informative) / sum(drawn.values())
    assert easy_share < 0.75  # in order they would be 21 of 24 rows = 88 %


def test_a_task_whose_difficulty_drifts_is_seen_again_and_recovers(tmp_path: Path):
    src = SourceConfig(kind="jsonl", name="ds", path=str(_dataset(tmp_path, 24)))
    mix = TaskMix(TasksConfig(sources=(src,), num_eval=0, pass_rate=ON), TOK)
    rows = mix.source("ds").num_tasks("train")
    drifting = "ds/r4"  # all correct, like most rows, until it drifts

    def rewards(uid: str, drifted: bool) -> list[float]:
        row = int(uid.rsplit("r", 1)[1])
        if row in (1, 2) or (uid == drifting and drifted):
            return [1.0, 0.0] * (G // 2)
        return [1.0] * G if row % 2 == 0 else [0.0] * G

    def run(draws: int, drifted: bool) -> float:
        before = mix.state()["next_index"]["ds"]
        n = 0
        for _ in range(draws):
            task = mix.next_task()
            n += task.uid == drifting
            _report(mix, task, rewards(task.uid, drifted))
        return n / ((mix.state()["next_index"]["ds"] - before) / rows)  # taken per pass

    assert run(600, drifted=False) < 0.2  # all correct: near its floor
    run(200, drifted=True)  # it became harder: the floor keeps showing it, evidence moves
    assert run(300, drifted=True) > 0.9  # back to nearly every pass


def test_generated_tasks_are_weighted_by_difficulty_bucket_and_no_bucket_starves():
    cfg = TasksConfig(sources=(SourceConfig(kind="tick", name="t"),), pass_rate=ON)
    mix = TaskMix(cfg, TOK)
    src = mix.source("t")

    def rewards(bucket: int) -> list[float]:
        if bucket <= 4:
            return [1.0] * G  # easy: always right
        if bucket >= 12:
            return [0.0] * G  # hard: always wrong
        return [1.0, 0.0] * (G // 2)

    taken: Counter = Counter()
    for _ in range(2500):
        task = mix.next_task()
        bucket = int(src.difficulty(task)[1:])
        taken[bucket] += 1
        _report(mix, task, rewards(bucket))
    offered = Counter(int(src.difficulty(src.task(i, "train"))[1:])
                      for i in range(mix.state()["next_index"]["t"]))
    for bucket, n in offered.items():
        assert taken[bucket] >= ON.floor * n - 1, (bucket, taken[bucket], n)  # the floor
    informative = sum(taken[b] for b in taken if 4 < b < 12) / sum(taken.values())
    in_order = sum(offered[b] for b in offered if 4 < b < 12) / sum(offered.values())
    assert in_order < 0.4 and informative > 0.75


def test_before_any_group_ends_pass_rate_sampling_draws_in_order(tmp_path: Path):
    sources = (SourceConfig(kind="tick"),
               SourceConfig(kind="jsonl", name="ds", path=str(_dataset(tmp_path, 10))))
    plain = TaskMix(TasksConfig(sources=sources, num_eval=0), TOK)
    aware = TaskMix(TasksConfig(sources=sources, num_eval=0, pass_rate=ON), TOK)
    assert [plain.next_task().uid for _ in range(50)] == [aware.next_task().uid for _ in range(50)]


def test_pass_rates_survive_a_checkpoint(tmp_path: Path):
    src = SourceConfig(kind="jsonl", name="ds", path=str(_dataset(tmp_path, 12)))
    cfg = TasksConfig(sources=(src,), num_eval=0, pass_rate=ON)
    mix = TaskMix(cfg, TOK)
    for _ in range(100):
        task = mix.next_task()
        _report(mix, task, [1.0] * G if task.uid != "ds/r1" else [0.0, 1.0] * (G // 2))
    state = json.loads(json.dumps(mix.state()))
    fresh = TaskMix(cfg, TOK)
    fresh.restore(state)
    assert [fresh.next_task().uid for _ in range(40)] == [mix.next_task().uid for _ in range(40)]
