"""Smoke test of ``rollstream bench agentic --quick``: both modes run the same episodes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_agentic_quick_runs_both_modes_on_the_same_episodes(tmp_path):
    from rollstream.bench.agentic import main

    out = tmp_path / "agentic.json"
    result = main(json_out=out, quick=True)
    written = json.loads(out.read_text())
    batched, async_ = written["modes"]["batched"], written["modes"]["async"]
    assert batched["model_turns"] == async_["model_turns"] == sum(
        t + 1 for t in written["turns_per_episode"])  # each tool turn, then the answer
    assert batched["generated_tokens"] == async_["generated_tokens"]  # greedy: the same turns
    assert written["async_vs_batched_episodes_per_s"] == pytest.approx(
        async_["episodes_per_s"] / batched["episodes_per_s"])
    assert 0 < written["engine_utilization_agentic"] <= 1.0
    proxy = written["proxy"]
    assert result["proxy_overhead_ms_p50"] == pytest.approx(
        proxy["proxy_ms_p50"] - proxy["direct_ms_p50"])
    assert proxy["direct_ms_p50"] > 0 and proxy["calls"] == 20
