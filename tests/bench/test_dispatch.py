"""Smoke test of ``rollstream bench dispatch --quick`` on a tiny model: every dispatch setting
generates the same samples (seeded requests: the order changes when tokens are made, not
which), and the keys are the ratios of the makespans they summarise."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.intermediate_size=192", "model.warm_start.steps=40",
        "model.warm_start.tokens_per_step=2048", "sampling.max_new_tokens=96",
        "tasks.sources=[{kind: tick, max_items: 12}]"]


def test_bench_dispatch_quick_runs_every_setting_on_the_same_samples(tmp_path):
    from rollstream.bench.dispatch import SETTINGS, main

    out = tmp_path / "dispatch.json"
    result = main(json_out=out, quick=True, overrides=[*TINY, f"model.cache_dir={tmp_path}"])
    written = json.loads(out.read_text())
    assert written["same_tokens"] is True
    per = written["makespan_s_per_batch"]
    assert set(per) == set(SETTINGS) and all(len(v) == 2 and min(v) > 0 for v in per.values())
    mean = written["makespan_s"]
    assert result["predictive_makespan_reduction"] == pytest.approx(
        1 - mean["longest_first"] / mean["engine"])
    assert result["predictive_vs_oracle"] == pytest.approx(mean["oracle"] / mean["longest_first"])
    assert written["len_pred_err"] >= 0
