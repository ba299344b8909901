"""Smoke test of ``rollstream bench sim --quick`` on a tiny model: two real runs, a profile
fitted from their recordings, each run replayed on it, and the keys its JSON must hold."""

from __future__ import annotations

import json

import pytest

from rollstream.sim.profile import load_profile

pytestmark = pytest.mark.slow

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.intermediate_size=192", "model.warm_start.steps=40",
        "model.warm_start.tokens_per_step=2048", "sampling.max_new_tokens=64",
        "tasks.sources=[{kind: tick, max_items: 6}]",
        "rollout.filter_zero_variance=false"]  # a model this briefly warm-started earns no reward


def test_bench_sim_quick_fits_a_profile_and_predicts_both_runs(tmp_path):
    from rollstream.bench.sim import main

    out = tmp_path / "sim.json"
    main(json_out=out, quick=True, run_root=tmp_path / "runs",
         overrides=[*TINY, f"model.cache_dir={tmp_path}"])
    got = json.loads(out.read_text())
    for key in ("calibration_error_step_time", "calibration_error_utilization",
                "calibration_joint_error_step_time", "calibration_joint_error_utilization"):
        assert set(got[key]) == {"sync", "async"} and all(v >= 0 for v in got[key].values())
    calib = got["calibration"]
    assert set(calib["joint_no_contention"]) == {"sync", "async"}
    assert calib["profiles"]["joint_no_contention"]["contention"] == {"engine": 0.0,
                                                                     "trainer": 0.0}
    for label in ("sync", "async", "joint"):
        fitted = load_profile(str(tmp_path / "runs" / f"cpu_fitted_{label}.yaml"))
        assert fitted.decode.combine == "sum" and fitted.decode.step_s(8, 800) > 0
        assert fitted.model_dump(mode="json") == calib["profiles"][label]
    assert {r["profile_of"] for r in calib["cross"].values()} == {"sync", "async"}
    # a sync run's engine never decodes during a trainer step: nothing to fit a slowdown on
    assert calib["profiles"]["sync"]["contention"]["engine"] == 0
    assert all(v >= 0 for v in calib["profiles"]["joint"]["contention"].values())
    curve = got["speed_curve"]
    assert len(curve) == 5 and all(r["samples"] > 0 and r["cpu_s"] > 0 for r in curve)
    for mode, row in [*calib["rows"].items(), *calib["joint"].items()]:
        real, sim = row["measured"], row["simulated"]
        assert real["step_s_mean"] > 0 and 0 < real["engine_utilization"] <= 1, mode
        assert row["error_step_time"] == pytest.approx(
            abs(sim["step_s_mean"] - real["step_s_mean"]) / real["step_s_mean"])
    # a synchronous replay trains exactly the run's samples
    row = got["calibration"]["rows"]["sync"]
    assert row["simulated"]["statuses"]["trained"] == row["real_statuses"]["trained"] > 0
    assert got["sim_wall_s_512_engines"] == max(got["speed_512"]["wall_s"].values()) > 0
    gpu = got["gpu_256"]["rows"]
    assert got["gpu_async_partial_vs_sync"] == pytest.approx(
        gpu["async_k2_partial"]["trained_tok_s"] / gpu["sync"]["trained_tok_s"])
    assert len(got["load_avg_before"]) == 3
