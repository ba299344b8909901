"""Smoke test of ``rollstream bench peers --quick`` on a tiny model (needs the optional TRL)."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_modes import TINY

pytest.importorskip("trl")


def test_bench_peers_quick_runs_both_sides(tmp_path, tiny_run_cache):
    from rollstream.bench.peers import main

    out = tmp_path / "peers.json"
    result = main(json_out=out, quick=True, run_root=tmp_path / "runs",
                  overrides=[*TINY, f"model.cache_dir={tiny_run_cache}"])
    written = json.loads(out.read_text())
    assert "error" not in written["trl"], written["trl"]
    assert written["samples_per_s_vs_trl"] == result["samples_per_s_vs_trl"] > 0
    for side in ("rollstream", "trl"):
        assert written[side]["trained_samples"] == 2 * 2 * 4  # steps x groups x group size
        assert written[side]["samples_per_s"] > 0
    # both shapes, TRL at 1 and 2 threads in fp32 and bf16, the fastest one compared
    wide = written["shapes"]["g16x8"]
    assert wide["samples_per_step"] == 8 * 16
    assert wide["rollstream"]["trained_samples"] == wide["trl"]["trained_samples"] == 2 * 128
    for sh in written["shapes"].values():
        runs = sh["trl_by_setting"]
        assert set(runs) == {"1t-fp32", "2t-fp32", "1t-bf16", "2t-bf16"}, runs
        assert all("error" not in r for r in runs.values()), runs
        assert {r["precision"] for r in runs.values()} == {"fp32", "bf16"}
        assert sh["trl"]["samples_per_s"] == max(r["samples_per_s"] for r in runs.values())
    assert written["samples_per_s_vs_trl_min_over_shapes"] == min(
        sh["samples_per_s_vs_trl"] for sh in written["shapes"].values())
