"""Smoke test of ``rollstream bench sim_agent --quick``: two real tally runs, each replayed
episode by episode on the profile fitted from it, and where its turns spent their time."""

from __future__ import annotations

import json

import pytest

from rollstream.config.schema import WarmStartConfig

pytestmark = pytest.mark.slow


def test_bench_sim_agent_quick_replays_both_runs_and_measures_turn_costs(tmp_path,
                                                                          tiny_run_cache):
    """The warm start is the agent kill test's (tests/durable/test_kill.py): its demonstration
    noise is the tiny run's, not examples/agent.yaml's, so the two share one cache entry."""
    from rollstream.bench.sim_agent import main

    out = tmp_path / "sim_agent.json"
    main(json_out=out, quick=True, run_root=tmp_path / "runs",
         overrides=[f"model.warm_start.noise={WarmStartConfig().noise}",
                    f"model.cache_dir={tiny_run_cache}"])
    got = json.loads(out.read_text())
    for key in ("calibration_error_step_time", "calibration_error_utilization"):
        assert set(got[key]) == {"sync", "async"} and all(v >= 0 for v in got[key].values())
    for mode, costs in got["turn_costs"].items():
        rows = got["calibration"]["rows"][mode]
        assert rows["simulated"]["statuses"]["trained"] == 2 * 2 * 8  # every episode replayed
        assert costs["model_turns"] > 2 * 2 * 8  # episodes of several turns
        assert 0 < costs["tool_s_per_turn"] < costs["model_s_per_turn"]
        assert costs["harness_s_per_turn"] > 0 and 0 < costs["harness_share"] < 1
        at_mean = got["prefill_at_mean"][mode]  # the run's own seconds per prefilled token
        assert at_mean["per_token_s"] > 0 and at_mean["error_step_time"] >= 0
