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
    for case in ("fixed_b1", "fixed_b8", "longtail"):
        assert written["cases"][case]["local_tok_s"] > 0
        assert written["cases"][case]["hf_tok_s"] > 0
