"""``bench prefix --quick``: the cached engine prefills each group's prompt once, the
shared-prefix trainer lays it out once, and each ratio and its bound come out beside each
other."""

from __future__ import annotations

import json
import math

from rollstream.bench import prefix


def test_quick_prefix_bench_reports_the_ratio_and_its_bound(tmp_path):
    out = tmp_path / "prefix.json"
    result = prefix.main(json_out=out, quick=True)
    assert json.loads(out.read_text()) == result
    assert result["prefix_cache_vs_none_gen_tok_s"] > 0
    # 2 groups of 8: the first sample of each prefills the prompt, the 7 others its tail
    assert result["prefilled_tokens"]["none"] == result["prompt_tokens"]
    assert result["prefilled_tokens"]["cache"] < result["prompt_tokens"] / 4
    assert 7 / 8 - 0.1 < result["hit_share"] < 7 / 8
    assert 0 < result["prefill_share_without_cache"] < 1
    assert result["bound"] == 1 / (1 - result["prefill_share_without_cache"]
                                   * result["hit_share"])
    # the trainer: a group's prompt once (but its last token, in each sample), then each answer
    groups, tokens = result["groups"], result["trainer_tokens"]
    assert result["trainer_groups"] == groups
    assert tokens["flat"] == result["prompt_tokens"] + result["generated_tokens"]
    assert tokens["shared"] == (result["prompt_tokens"] // 8 - groups + 8 * groups
                                + result["generated_tokens"])
    assert result["shared_prefix_bound"] == tokens["flat"] / tokens["shared"]
    assert result["shared_prefix_vs_flat_trainer_step_s"] > 0
    # the training runs: the cache on in one engine, off in the other, the same samples trained
    both, neither = result["runs"]["both"], result["runs"]["neither"]
    assert both["engine_work"]["prefix_hit_tokens"] > 0
    assert neither["engine_work"].get("prefix_hit_tokens", 0) == 0
    assert 0.5 < result["run_hit_share"] < 1
    assert both["trained_samples"] == neither["trained_samples"] > 0
    ratio = result["both_vs_neither_trained_samples_per_s"]
    assert math.isfinite(ratio) and ratio > 0
    assert ratio == both["trained_samples_per_s"] / neither["trained_samples_per_s"]
    assert result["both_vs_neither_bound"] == max(result["bound"], result["shared_prefix_bound"])
