"""The task mix inside the real rollout: the rollout's feedback keeps the trained mixture at the
weights, in-flight caps hold (and a capped run still trains every step), and the step metrics
(trained mixture, waste, length bias) agree with the ledger. Engines and the trainer are the
doubles of tests/rollout/fakes.py; the mix, dispatcher, rollout, graders and ledger are real."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from rollstream.clock import WallClock
from rollstream.config import RewardConfig, RolloutConfig, RunConfig, TrainConfig
from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.mix import TaskMix
from rollstream.engine.protocol import SamplingParams
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.runtime.build import build_loop
from rollstream.trajectory import Task

from .fakes import CountingTrainer, RandomEngine, run_then_close

TOK = build_char_tokenizer()
CONSTANT_SHARE = {"a": 70, "b": 10}  # % of a source's tasks whose every reward is the same


async def _reward(task: Task, text: str) -> float:
    """A task of source s gives every sample the same reward with CONSTANT_SHARE[s] % chance
    (its group is filtered); the others reward the parity of the response length."""
    if zlib.crc32(task.uid.encode()) % 100 < CONSTANT_SHARE.get(task.source, 0):
        return 1.0
    return float(len(text) % 2)


class WatchedEngine(RandomEngine):
    """Calls ``watch()`` at every request: a look at the rollout while the run is live."""

    watch = staticmethod(lambda: None)

    async def generate(self, request):
        self.watch()
        return await RandomEngine.generate(self, request)


class Recorder:
    def __init__(self) -> None:
        self.lines: dict[str, list[tuple[int, dict[str, float]]]] = defaultdict(list)

    def record(self, kind, step, values) -> None:
        self.lines[kind].append((step, dict(values)))

    def observe(self, name, value) -> None:
        pass


def _run(tmp_path: Path, tasks: TasksConfig, *, steps: int, seed: int = 0, watch=None):
    cfg = RunConfig(rollout=RolloutConfig(group_size=4, staleness={"max_staleness": 2}),
                    train=TrainConfig(steps=steps, groups_per_step=4), tasks=tasks)

    async def main():
        mix = TaskMix(cfg.tasks, TOK)
        engines = [WatchedEngine(seed + i, engine_id=f"rand-{i}") for i in range(2)]
        ledger = Ledger(tmp_path / "ledger.jsonl")
        reward = get_reward(_reward)
        graders = GraderPool(RewardConfig(timeout_s=5.0), lambda task: reward)
        trainer = CountingTrainer(seed, cfg.rollout.staleness_policy(),
                                  max_delay_s=0.002)
        metrics = Recorder()
        loop = build_loop(cfg, engines=engines, trainer=trainer, tasks=mix, graders=graders,
                          decode=lambda ids: "x" * len(ids), ledger=ledger, metrics=metrics,
                          clock=WallClock(), params=SamplingParams(max_new_tokens=24),
                          staleness=trainer.policy)
        if watch is not None:
            for e in engines:
                e.watch = lambda: watch(loop.rollout)
        res = await run_then_close(cfg, loop, graders, ledger)
        return mix, res, metrics

    mix, res, metrics = asyncio.run(main())
    return mix, res, metrics, read_ledger(tmp_path / "ledger.jsonl")


def _two(mix: str, **caps) -> TasksConfig:
    return TasksConfig(mix=mix, sources=(SourceConfig(kind="tick", name="a", **caps.get("a", {})),
                                         SourceConfig(kind="digits", name="b",
                                                      **caps.get("b", {}))))


def test_the_rollouts_feedback_keeps_the_trained_mixture_at_the_weights(tmp_path: Path):
    errors = {}
    for rule in ("quota", "weighted"):
        run_dir = tmp_path / rule
        run_dir.mkdir()
        mix, res, metrics, rows = _run(run_dir, _two(rule), steps=40)
        assert res.steps_done == 40
        trained = Counter(r.source for r in rows if r.status == "trained")
        counts = mix.state()["counts"]
        assert {n: counts[n]["trained"] for n in ("a", "b")} == {"a": trained["a"],
                                                                   "b": trained["b"]}
        last = metrics.lines["train"][-1][1]
        share_a = trained["a"] / (trained["a"] + trained["b"])
        assert last["mix_share/a"] == pytest.approx(share_a)
        errors[rule] = last["mixture_error_pp"]
    assert errors["quota"] <= 2.0, errors
    assert errors["weighted"] >= 10.0, errors  # a's groups are filtered far more often


def test_step_metrics_agree_with_the_ledger(tmp_path: Path):
    _, _, metrics, rows = _run(tmp_path, _two("quota"), steps=12)
    train = [v for _, v in metrics.lines["train"]]
    assert len(train) == 12
    trained_rows = [r for r in rows if r.status == "trained"]
    assert sum(v["trained_tokens"] for v in train) == sum(r.num_tokens for r in trained_rows)
    generated = sum(v["gen_tokens"] for v in train)
    assert sum(r.num_tokens for r in trained_rows) < generated
    assert generated <= sum(r.num_tokens for r in rows)  # the rest: groups live at the end
    for v in train:
        assert v["gen_tokens_per_trained_token"] == pytest.approx(
            v["gen_tokens"] / v["trained_tokens"])
        assert 0.3 < v["length_bias"] < 3.0


@pytest.mark.parametrize("rule", ["quota", "weighted"])
def test_in_flight_caps_hold_in_a_live_run_that_still_trains(tmp_path: Path, rule: str):
    peak: Counter = Counter()

    def watch(rollout) -> None:
        live = Counter(g.task.source for g in rollout.live.values())
        peak.update({s: max(0, n - peak[s]) for s, n in live.items()})  # peak = running max

    _, res, _, _ = _run(tmp_path, _two(rule, a={"max_in_flight": 1}, b={"max_in_flight": 2}),
                        steps=6, watch=watch)
    assert res.steps_done == 6 and peak == {"a": 1, "b": 2}


def test_a_per_task_cap_on_a_small_dataset_waits_and_trains(tmp_path: Path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"T{100 + i}#03=",
                                        "answer": "1"}) + "\n" for i in range(8)))
    src = SourceConfig(kind="jsonl", name="ds", path=str(data), max_in_flight_per_task=1)
    rows_in_train = TaskMix(TasksConfig(sources=(src,), num_eval=0), TOK).source(
        "ds").num_tasks("train")
    most_per_task, most_live = [0], [0]

    def watch(rollout) -> None:
        per_task = Counter(g.task.uid for g in rollout.live.values())
        most_per_task[0] = max([most_per_task[0], *per_task.values()])
        most_live[0] = max(most_live[0], len(rollout.live))

    # admission allows (2 + 1) x 4 = 12 groups: more than the rows, so the cap makes it wait
    _, res, _, _ = _run(tmp_path, TasksConfig(sources=(src,), num_eval=0), steps=8,
                        watch=watch)
    assert rows_in_train < 12
    assert res.steps_done == 8 and most_per_task == [1] and most_live[0] == rows_in_train
