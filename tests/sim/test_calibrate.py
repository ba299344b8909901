"""Calibration: the fits recover known costs from noisy synthetic passes, and a replay
simulates exactly the samples a run recorded."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from rollstream.config.staleness import StalenessConfig
from rollstream.data.ledger import read_ledger
from rollstream.engine.local.passes import PassTimes
from rollstream.sim.calibrate import fit_decode, fit_nonneg, fit_prefill, fit_trainer
from rollstream.sim.profile import DecodeCost, PrefillCost, TrainerCost, load_profile
from rollstream.sim.run import build_sim
from rollstream.sim.scenario import ModeConfig, Scenario
from rollstream.sim.vloop import run_virtual

NOISE = 0.05  # relative noise of every synthetic timing


def _noisy(rng: random.Random, seconds: float) -> float:
    return seconds * (1 + rng.gauss(0, NOISE))


def test_decode_and_prefill_fits_recover_the_costs_that_made_the_passes():
    truth = DecodeCost(overhead_s=4e-4, weights_s=0, per_seq_s=7e-5, per_context_token_s=2e-8,
                       combine="sum")
    pre = PrefillCost(overhead_s=4e-3, per_token_s=7e-5)
    rng, passes = random.Random(0), PassTimes()
    for _ in range(20_000):  # the recorder the local engine uses, binned as in a run
        rows = rng.randint(1, 128)
        context = rows * rng.randint(20, 500)
        passes.add("decode", rows, context, _noisy(rng, truth.step_s(rows, context)))
    for _ in range(2_000):
        rows = rng.randint(1, 16)
        tokens = rows * rng.randint(16, 160)
        passes.add("prefill", rows, tokens, _noisy(rng, pre.time_s(tokens)))
    lines = passes.lines()
    assert sum(p["count"] for p in lines) == 22_000 and len(lines) < 22_000
    fit, contention = fit_decode(lines)
    assert contention == 0  # no pass overlapped training
    assert fit.combine == "sum"
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=0.1)
    assert fit.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.05)
    assert fit.per_context_token_s == pytest.approx(truth.per_context_token_s, rel=0.1)
    got = fit_prefill(lines)
    assert got.overhead_s == pytest.approx(pre.overhead_s, rel=0.1)
    assert got.per_token_s == pytest.approx(pre.per_token_s, rel=0.05)


def test_trainer_fit_recovers_overhead_and_rate():
    truth = TrainerCost(step_overhead_s=0.3, tokens_per_s_per_device=39_000)
    rng = random.Random(1)
    tokens = [rng.randint(5_000, 40_000) for _ in range(40)]
    seconds = [_noisy(rng, truth.step_s(t, 1)) for t in tokens]
    fit, contention = fit_trainer(tokens, seconds)
    assert contention == 0
    assert fit.step_overhead_s == pytest.approx(truth.step_overhead_s, rel=0.25)
    assert fit.tokens_per_s_per_device == pytest.approx(truth.tokens_per_s_per_device, rel=0.05)


def test_calibration_recovers_known_contention_from_a_synthetic_trace():
    """Passes recorded during trainer steps cost 1.9x (the recorder's ``training`` flag), a
    trainer step 1 + 0.8 x the engines' busy share: one joint fit of a sync-like part (no
    overlap) and an async-like part recovers both factors and the base costs."""
    truth = DecodeCost(overhead_s=4e-3, weights_s=0, per_seq_s=9e-5, per_context_token_s=6e-7,
                       combine="sum")
    training = [False]
    rng, passes = random.Random(3), PassTimes(training=lambda: training[0])
    for i in range(20_000):
        training[0] = i >= 10_000 and rng.random() < 0.6  # the async half overlaps 60%
        rows = rng.randint(1, 64)
        context = rows * rng.randint(8, 240)
        step = truth.step_s(rows, context) * (1.9 if training[0] else 1.0)
        passes.add("decode", rows, context, _noisy(rng, step))
    fit, engine = fit_decode(passes.lines())
    assert engine == pytest.approx(0.9, rel=0.05)
    assert fit.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.1)
    assert fit.per_context_token_s == pytest.approx(truth.per_context_token_s, rel=0.1)
    cost = TrainerCost(step_overhead_s=1.3, tokens_per_s_per_device=2_500)
    tokens = [rng.randint(3_000, 9_000) for _ in range(24)]
    busy = [0.0] * 12 + [rng.uniform(0.6, 0.95) for _ in range(12)]  # sync, then async steps
    seconds = [_noisy(rng, cost.step_s(t, 1) * (1 + 0.8 * u)) for t, u in zip(tokens, busy)]
    trainer, contention = fit_trainer(tokens, seconds, engines_busy=busy)
    assert contention == pytest.approx(0.8, rel=0.15)
    assert trainer.tokens_per_s_per_device == pytest.approx(2_500, rel=0.15)


def test_a_cost_the_data_would_make_negative_is_zero_and_the_rest_refitted():
    x = np.column_stack([np.ones(50), np.arange(50.0)])
    y = 3.0 * np.arange(50.0) - 5.0  # an intercept of -5 is no cost
    coef = fit_nonneg(x, y)
    assert coef[0] == 0 and coef[1] == pytest.approx(np.dot(x[:, 1], y) / np.dot(x[:, 1], x[:, 1]))
    # steps too alike to show an overhead: the whole time is charged per token
    flat, _ = fit_trainer([100, 200, 300], [1.0, 1.0, 1.0 - 1e-9])
    assert flat.step_overhead_s == 0 and flat.tokens_per_s_per_device == pytest.approx(600 / 3)


def _recorded_run(tmp_path, groups):
    """A run directory holding what replay reads: config.yaml and the ledger."""
    tmp_path.mkdir()
    (tmp_path / "config.yaml").write_text(json.dumps({"sampling": {"max_new_tokens": 64}}))
    with (tmp_path / "ledger.jsonl").open("w") as fh:
        for k, (prompt, samples) in enumerate(groups):
            for i, (n, reward) in enumerate(samples):
                fh.write(json.dumps({"sample_uid": f"t{k % 3}#g{k}/{i}", "task_uid": f"t{k % 3}",
                                     "source": "t", "status": "trained", "num_tokens": n,
                                     "prompt_tokens": prompt, "reward": reward}) + "\n")
        fh.write(json.dumps({"sample_uid": "t0#eval0/0", "task_uid": "t0", "source": "t",
                             "status": "evaluated", "num_tokens": 5, "prompt_tokens": 9,
                             "reward": 1.0}) + "\n")
    return tmp_path


def test_a_replay_simulates_the_recorded_samples_group_by_group(tmp_path):
    rng = random.Random(2)
    groups = [(rng.randint(8, 30), [(rng.randint(1, 64), float(rng.random() < 0.5))
                                    for _ in range(4)]) for _ in range(12)]
    run_dir = _recorded_run(tmp_path / "run", groups)
    sc = Scenario(name="replay", seed=5, profile="cpu_this_machine", engines=2, steps=3,
                  groups_per_step=2, group_size=4, filter_zero_variance=False,
                  trainer_devices=1, replay=str(run_dir),
                  modes=(ModeConfig(name="k1", mode="async",
                                        staleness=StalenessConfig(max_staleness=1)),))
    ledger_path = tmp_path / "sim-ledger.jsonl"

    async def main():
        loop, controller, *_, ledger = await build_sim(sc, sc.modes[0], load_profile(sc.profile),
                                                       ledger_path)
        result = await controller.run()
        ledger.close()
        return result

    assert run_virtual(main()).steps_done == 3
    rows = [r for r in read_ledger(ledger_path) if r.status == "trained"]
    assert len(rows) == 3 * 2 * 4
    for r in rows:
        k, i = (int(x) for x in r.sample_uid.split("#g")[1].split("/"))
        prompt, samples = groups[k]
        assert r.num_tokens == samples[i][0] and r.reward == samples[i][1]
        assert r.prompt_tokens == prompt


def test_replay_and_workload_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="replay and workload are exclusive"):
        Scenario(replay=str(tmp_path), workload={"mean_response_tokens": 100})
