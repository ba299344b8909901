"""``bench models --quick``: the LoRA rows on the demo's shape, bytes as the formula says, and
a short LoRA training run against a full one; the MoE rows (routing replay against a bfloat16
engine) present and in range."""

from __future__ import annotations

import json
import math


def test_quick_models_bench_measures_lora_sync_against_full(tmp_path):
    from rollstream.bench import models

    out = tmp_path / "models.json"
    result = models.main(json_out=out, quick=True)
    assert json.loads(out.read_text()) == result
    assert set(result["lora"]) == {"demo/all", "demo/attention"}
    every = result["lora"]["demo/all"]
    # 2r(d_in + d_out) / (d_in d_out) over the targeted weights: about 0.10 at rank 8
    assert 0.08 < every["bytes_vs_targeted"] < 0.12
    assert result["lora_sync_bytes_vs_full"] == every["lora_sync_bytes_vs_full"] < 0.12
    assert result["lora"]["demo/attention"]["adapter_bytes"] < every["adapter_bytes"]
    assert every["full_sync_s"] > 0 and every["adapter_sync_s"] > 0
    assert every["lowrank_step_s"] > 0 and every["merge_breakeven_steps"] > 0
    moe = result["moe"]
    assert 0 < moe["routing_agreement"] <= 1 and moe["mismatch_none"] > 0
    assert result["mismatch_replay_vs_none"] == moe["mismatch_replay_vs_none"] > 0
    # the bound splits every sampled token by whether the trainer's router agreed there
    assert moe["agreeing_tokens"] + moe["disagreeing_tokens"] == moe["num_tokens"]
    assert moe["agreeing_tokens"] > 0 and moe["mismatch_agreeing"] > 0
    assert result["mismatch_replay_vs_none_bound"] == moe["mismatch_replay_vs_none_bound"] > 0
    assert 0 < moe["stale_routing_agreement"] <= 1 and moe["num_tokens"] > 0
    # a LoRA run against a full one of the same shape: the adapter alone synced, equal samples
    lora, full = result["lora_runs"]["runs"]["lora"], result["lora_runs"]["runs"]["full"]
    assert 0 < lora["sync_bytes"] < full["sync_bytes"] * 0.12
    assert lora["trained_samples"] == full["trained_samples"] > 0
    ratio = result["lora_vs_full_samples_per_s"]
    assert math.isfinite(ratio) and ratio > 0
    assert ratio == lora["trained_samples_per_s"] / full["trained_samples_per_s"]
    # the MoE example's short runs with routing replay and without: the same samples trained,
    # routing agreement read from each run's steps
    runs = result["moe_runs"]
    assert runs["replay"]["trained_samples"] == runs["no_replay"]["trained_samples"] > 0
    for label in ("replay", "no_replay"):
        assert 0 < runs[label]["routing_agreement_mean"] <= 1
        assert 0 <= runs[label]["reward_initial"] <= 1 and 0 <= runs[label]["reward_final"] <= 1
