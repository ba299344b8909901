"""Smoke test of ``rollstream bench agentic --quick``: every mode runs the same episodes (a
user's environment named by import path and the verifiers adapter beside the built-in loop),
and the ratios are what their rounds give."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow


def test_bench_agentic_quick_runs_every_mode_on_the_same_episodes(tmp_path):
    from rollstream.bench.agentic import main

    out = tmp_path / "agentic.json"
    result = main(json_out=out, quick=True)
    written = json.loads(out.read_text())
    modes = written["modes"]
    assert set(modes) == {"batched", "async", "user_env", "verifiers", "no_prefix_cache"}
    turns = sum(t + 1 for t in written["turns_per_episode"])  # each tool turn, then the answer
    assert {m["model_turns"] for m in modes.values()} == {turns}
    tool_s = {round(m["tool_time_s"], 9) for m in modes.values()}
    assert len(tool_s) == 1, tool_s  # the same latencies
    # greedy on the same conversations: the same turns (verifiers' tool replies are user
    # messages, so its tokens may differ), with the prefix cache or without
    assert modes["batched"]["generated_tokens"] == modes["async"]["generated_tokens"] \
        == modes["user_env"]["generated_tokens"] == modes["no_prefix_cache"]["generated_tokens"]
    for side in ("user_env", "verifiers"):
        rounds = list(zip(written["repeats"][side], written["repeats"]["builtin"], strict=True))
        assert len(rounds) == 2 and modes[side]["episodes_per_s"] == rounds[0][0]
        ratio = written[f"{side}_vs_builtin_episodes_per_s"]
        assert ratio == pytest.approx(math.prod(a / b for a, b in rounds) ** 0.5)
        low, high = written[f"{side}_vs_builtin_ci95"]
        assert low < ratio < high
    rounds = list(zip(written["repeats"]["builtin"], written["repeats"]["no_prefix_cache"],
                      strict=True))
    ratio = written["prefix_cache_vs_none_episodes_per_s"]
    assert ratio == pytest.approx(math.prod(a / b for a, b in rounds) ** 0.5)
    p, h = written["prefill_share_without_cache"], written["hit_share"]
    assert 0 < p < 1 and 0 < h < 1 and 0 < written["prefill_share_with_cache"] < p
    assert written["prefix_cache_vs_none_bound"] == pytest.approx(1 / (1 - p * h))
    assert modes["no_prefix_cache"]["work"]["prefix_hit_tokens"] == 0 < \
        modes["async"]["work"]["prefix_hit_tokens"]
    assert written["async_vs_batched_episodes_per_s"] == pytest.approx(
        modes["async"]["episodes_per_s"] / modes["batched"]["episodes_per_s"])
    assert 0 < written["engine_utilization_agentic"] <= 1.0
    proxy = written["proxy"]
    assert result["proxy_overhead_ms_p50"] == pytest.approx(
        proxy["proxy_ms_p50"] - proxy["direct_ms_p50"])
    assert proxy["direct_ms_p50"] > 0 and proxy["calls"] == 20
