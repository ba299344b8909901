"""Smoke test of ``rollstream bench resume --quick``: two SIGKILLs, the audit's keys."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_resume_quick_loses_nothing(tmp_path, tiny_run_cache):
    from rollstream.bench.resume import main

    out = tmp_path / "resume.json"
    result = main(json_out=out, quick=True, cache_dir=tiny_run_cache)
    written = json.loads(out.read_text())
    assert written["final_exit_code"] == 0, written["final_output_tail"]
    assert written["steps_done"] == result["steps"] == 8
    assert len(written["kills"]) == 2
    for key in ("lost_samples", "duplicated_samples", "steps_repeated", "steps_missing"):
        assert written[key] == 0, (key, written)
    assert written["checkpoint_s"] is not None and written["checkpoint_s"] >= 0
    assert written["resume_s"] is not None and written["resume_s"] > 0
