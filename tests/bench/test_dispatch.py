"""Smoke test of ``rollstream bench dispatch --quick`` on a tiny model: every dispatch setting
generates the same samples (seeded requests: the order changes when tokens are made, not
which), and the keys are the ratios of the makespans they summarise; then the four short
training runs of bench/sampling.py (--quick) write the mixture, waste and
length-bias keys, in range (a smoke run: its numbers mean nothing)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.intermediate_size=192", "model.warm_start.steps=40",
        "model.warm_start.tokens_per_step=2048", "sampling.max_new_tokens=96",
        "tasks.sources=[{kind: tick, max_items: 12}]"]


def test_bench_dispatch_quick_runs_every_setting_on_the_same_samples(tmp_path):
    from rollstream.bench.dispatch import SETTINGS, main

    out = tmp_path / "dispatch.json"
    result = main(json_out=out, quick=True, overrides=[*TINY, f"model.cache_dir={tmp_path}"],
                  run_root=tmp_path / "runs")
    written = json.loads(out.read_text())
    assert written["same_tokens"] is True
    per = written["makespan_s_per_batch"]
    assert set(per) == set(SETTINGS) and all(len(v) == 2 and min(v) > 0 for v in per.values())
    mean = written["makespan_s"]
    assert result["predictive_makespan_reduction"] == pytest.approx(
        1 - mean["longest_first"] / mean["engine"])
    assert result["predictive_vs_oracle"] == pytest.approx(mean["oracle"] / mean["longest_first"])
    assert written["len_pred_err"] >= 0
    # the sampling keys, from the short training runs (bench/sampling.py)
    errors = written["mixture_error_pp"]
    assert set(errors) == {"naive", "corrected"}
    assert all(0 <= errors[k] <= 100 for k in errors), errors
    for key in ("gen_tokens_per_trained_token", "gen_tokens_per_trained_token_baseline"):
        assert math.isfinite(written[key]) and written[key] >= 1, (key, written[key])
    runs = written["sampling_runs"]
    for label in ("waste_baseline", "waste_pass_rate"):  # the ratio is the runs' sums divided
        r = runs[label]
        assert r["gen_tokens_per_trained_token"] == pytest.approx(
            r["gen_tokens"] / r["trained_tokens"])
        assert r["waste"]["tokens"]["generated"] >= r["waste"]["tokens"]["trained"] > 0
    assert runs["waste_pass_rate"]["pass_rate"] and not runs["waste_baseline"]["pass_rate"]
    assert runs["mix_naive"]["mix"] == "weighted" and runs["mix_corrected"]["mix"] == "quota"
    assert set(runs["mix_corrected"]["mix_share"]) == {"long", "short"}
    assert math.isfinite(written["reward_pass_rate_minus_baseline"])
    assert abs(written["reward_pass_rate_minus_baseline"]) <= 1
    assert math.isfinite(written["reward_noise"]) and written["reward_noise"] >= 0
    low, high = written["length_bias_range"]
    assert 0 < low <= written["length_bias"] <= high < 10
    assert all(isinstance(v, bool) for v in written["sampling_targets"].values())
    assert written["gen_tokens_per_trained_token_dataset"] is None  # not in a --quick run
