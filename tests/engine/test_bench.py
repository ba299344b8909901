"""Smoke test of ``rollstream bench engine --quick`` (measures nothing, checks the shape)."""

from __future__ import annotations

import json

from rollstream.bench.engine import main


def test_bench_engine_quick_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = main(json_out=out, quick=True)
    written = json.loads(out.read_text())
    assert written["local_vs_hf_batch64"] == result["local_vs_hf_batch64"] > 0
    assert written["local_vs_hf_longtail"] > 0
    refill = written["refill"]  # requests joined running rows: fused on one engine only
    assert refill["fused_prefill_count"] > 0 and refill["prefill_count_separate_engine"] > 0
    assert refill["prefill_count_fused_engine"] < refill["prefill_count_separate_engine"]
    assert written["fused_vs_separate_prefill"] > 0
    for case in ("fixed_b1", "fixed_b8", "longtail"):
        assert written["cases"][case]["local_tok_s"] > 0
        assert written["cases"][case]["hf_tok_s"] > 0
