"""``rollstream bench pair``: the run order, the intervals and verdicts it reports, and a
quick run on a tiny model that writes the documented keys (it measures nothing)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from rollstream.bench.pair import interval, main, ratio_interval, run_order, t975, verdict
from tests.bench.test_modes import TINY


def test_each_pair_alternates_which_side_goes_first_from_seed_to_seed():
    order = run_order([0, 1, 2, 3], [1, 2])
    assert len(order) == 16 and len(set(order)) == 16
    for k in (1, 2):
        firsts = [side for i, (seed, kk, side) in enumerate(order)
                  if kk == k and (i == 0 or order[i - 1][1] != k or order[i - 1][0] != seed)]
        assert len(firsts) == 4
        assert firsts.count("partial") == firsts.count("drain") == 2, (k, firsts)
    for i in range(0, 16, 2):  # the two rows of a (seed, k) run back to back
        assert order[i][:2] == order[i + 1][:2] and order[i][2] != order[i + 1][2]


def test_the_interval_is_students_t_on_the_seeds():
    values = [1.0, 2.0, 4.0]
    mean, low, high = interval(values)
    half = 4.303 * statistics.stdev(values) / math.sqrt(3)
    assert mean == pytest.approx(7 / 3)
    assert (low, high) == pytest.approx((7 / 3 - half, 7 / 3 + half))
    assert interval([5.0])[1:] == (-math.inf, math.inf)
    assert t975(7) == 2.365 and t975(27) == 2.060  # between tabled ones: the next lower df
    assert t975(1000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)
    # ratios: a geometric mean, the interval on the logs (so x and 1/x are symmetric)
    g, lo, hi = ratio_interval([2.0, 0.5])
    assert g == pytest.approx(1.0) and lo * hi == pytest.approx(1.0)


def test_the_verdict_needs_the_whole_interval_on_one_side_of_one():
    assert verdict(1.01, 1.2) == "partial faster"
    assert verdict(0.8, 0.99) == "drain faster"
    assert verdict(0.9, 1.1) == "within noise"


def test_bench_pair_quick_writes_json(tmp_path, tiny_run_cache):
    out = tmp_path / "pair.json"
    result = main(json_out=out, quick=True, run_root=tmp_path / "runs", ks=(2,),
                  overrides=[*TINY, f"model.cache_dir={tiny_run_cache}"])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert written["settings"]["seeds"] == 2 and list(written["pairs"]) == ["k2"]
    pair = written["pairs"]["k2"]
    assert pair["seeds"] == [0, 1] and len(pair["partial_vs_drain_by_seed"]) == 2
    rows = pair["rows"]
    assert set(rows) == {"async_k2_partial", "async_k2_drain"}
    for label, row in rows.items():  # each seed's run measured, and the engine read off it
        assert len(row["trained_samples_per_s_by_seed"]) == 2
        assert row["trained_samples_per_s"] == pytest.approx(
            statistics.fmean(row["trained_samples_per_s_by_seed"]))
        assert 0 < row["engine_busy"] <= 1 and row["decode_us_per_token"] > 0, label
        assert row["rows_per_pass"] >= 1 and row["positions_per_token"] > 0, label
        by_rows = row["decode_by_rows"]  # every decoded row-token in one bucket of rows a pass
        assert sum(b["share"] for b in by_rows) == pytest.approx(1.0), label
        for b in by_rows:
            assert (b["share"] > 0) == (b["us_per_token"] is not None), b
            assert b["positions_per_token"] is None or b["positions_per_token"] >= 1, b
    by_seed = [p / d for p, d in zip(rows["async_k2_partial"]["trained_samples_per_s_by_seed"],
                                     rows["async_k2_drain"]["trained_samples_per_s_by_seed"],
                                     strict=True)]
    assert pair["partial_vs_drain_by_seed"] == pytest.approx(by_seed)
    # the ratio is the product of its three factors, seed by seed
    factors = pair["factors"]
    assert set(factors) == {"engine_rate", "length", "waste"}
    products = [math.prod(f["by_seed"][i] for f in factors.values()) for i in range(2)]
    assert products == pytest.approx(by_seed)
    for f in factors.values():
        assert f["ci95"][0] <= f["ratio"] <= f["ci95"][1]
    equal_length = [r / x for r, x in zip(by_seed, factors["length"]["by_seed"], strict=True)]
    assert pair["partial_vs_drain_equal_length"] == pytest.approx(
        math.exp(statistics.fmean(math.log(x) for x in equal_length)))
    for label, row in rows.items():
        assert row["gen_tok_s"] > 0 and row["trained_len"] > 0, label
        assert row["generated_per_trained_token"] >= 1, label
    low, high = pair["partial_vs_drain_ci95"]
    assert low <= pair["partial_vs_drain"] <= high
    assert pair["verdict"] == verdict(low, high)
    assert written["best_partial"] == "async_k2_partial"
    assert written["best_partial_vs_best_drain"] == pytest.approx(pair["partial_vs_drain"])
    with pytest.raises(ValueError, match="--seeds must be >= 2"):
        main(quick=True, seeds=1, overrides=TINY)
