"""The tiles' numbers: a finished run's totals, a live run's last steps (monitor/tiles.py)."""

from __future__ import annotations

import json

import pytest

from rollstream.data.ledger_row import LedgerRow, decode_row
from rollstream.monitor.runlog import RunLog
from rollstream.monitor.tiles import WINDOW_STEPS
from rollstream.trajectory import SampleStatus


def fed(num_steps: int) -> RunLog:
    """Step s: 100·(s+1) tokens generated, 50 trained (ages s % 3), at 10 s a step."""
    log = RunLog()
    for s in range(num_steps):
        log.add_record({"kind": "rollout", "step": s, "t_s": 10.0 * (s + 1),
                        "gen_tok_s": 10.0 * (s + 1)})
        log.add_record({"kind": "train", "step": s, "t_s": 10.0 * (s + 1),
                        "gen_tokens": 100.0 * (s + 1), "trained_tokens": 50.0,
                        "mixture_error_pp": float(s), "replayed_groups": 1.0})
        log.add_ledger(LedgerRow(sample_uid=f"t{s}#0/0", task_uid=f"t{s}", source="s",
                                 status=SampleStatus.TRAINED, trained_at_step=s,
                                 min_trained_version=s - s % 3, num_trained_tokens=50))
        log.add_ledger(LedgerRow(sample_uid=f"t{s}#0/1", task_uid=f"t{s}", source="s",
                                 status=SampleStatus.FILTERED, num_tokens=9))
    return log


def by_key(tiles: list[dict]) -> dict[str, dict]:
    return {t["key"]: t for t in tiles}


def test_a_finished_run_shows_its_totals() -> None:
    n = 25
    tiles = by_key(fed(n).tiles({"gen_tok_s": 123.5}))
    assert {t["scope"] for t in tiles.values()} == {"run"}
    assert tiles["tokens/s"]["value"] == 123.5
    assert tiles["staleness"]["value"] == pytest.approx(sum(s % 3 for s in range(n)) / n)
    assert tiles["gen/trained tokens"]["value"] == pytest.approx(
        sum(100 * (s + 1) for s in range(n)) / (50 * n))
    assert tiles["mixture error pp"]["value"] == pytest.approx((n - 1) / 2)
    assert tiles["trained samples"]["value"] == n and tiles["replayed groups"]["value"] == n


def test_a_live_run_shows_its_last_steps() -> None:
    n, k = 25, WINDOW_STEPS
    assert k == 10  # docs/monitoring.md
    tiles = by_key(fed(n).tiles(None))
    last = range(n - k, n)
    assert tiles["tokens/s"]["scope"] == f"last {k} steps"
    # each rollout line covers the 10 s since the one before
    assert tiles["tokens/s"]["value"] == pytest.approx(sum(10 * (s + 1) for s in last) / k)
    assert tiles["staleness"]["value"] == pytest.approx(sum(s % 3 for s in last) / k)
    assert tiles["gen/trained tokens"]["value"] == pytest.approx(
        sum(100 * (s + 1) for s in last) / (50 * k))
    assert tiles["mixture error pp"]["value"] == pytest.approx(sum(last) / k)
    assert tiles["trained samples"]["scope"] == "run" and tiles["trained samples"]["value"] == n


def test_a_run_starting_shows_what_there_is() -> None:
    assert by_key(fed(3).tiles(None))["staleness"]["scope"] == "last 3 steps"
    one = by_key(fed(1).tiles(None))
    assert one["tokens/s"]["scope"] == "last step" and one["tokens/s"]["value"] == 10.0
    empty = by_key(RunLog().tiles(None))
    assert all(t["value"] in (None, 0) for t in empty.values())


def test_staleness_weighs_each_kept_token_by_its_own_version() -> None:
    """A sample interrupted by a weight update holds tokens of two versions: each counts at
    its own age (Σ versions from the ledger), not at the sample's oldest; a ledger line
    written before that field existed counts at the oldest kept version."""
    log = RunLog()
    log.add_record({"kind": "train", "step": 4, "t_s": 1.0, "gen_tokens": 20.0,
                    "trained_tokens": 20.0})
    # 4 tokens of version 2 and 6 of version 4 trained at step 4: ages 2 and 0
    log.add_ledger(LedgerRow(sample_uid="a#g0/0", task_uid="a", source="s",
                             status=SampleStatus.TRAINED, trained_at_step=4,
                             min_trained_version=2, num_trained_tokens=10,
                             trained_version_sum=4 * 2 + 6 * 4))
    assert by_key(log.tiles({"gen_tok_s": 1.0}))["staleness"]["value"] == pytest.approx(0.8)
    assert by_key(log.tiles(None))["staleness"]["value"] == pytest.approx(0.8)
    log.add_ledger(decode_row(json.dumps(  # an older ledger's line: all at age 1
        {"sample_uid": "b#g0/0", "task_uid": "b", "source": "s", "status": "trained",
         "trained_at_step": 4, "min_trained_version": 3, "num_trained_tokens": 10})))
    assert by_key(log.tiles({"gen_tok_s": 1.0}))["staleness"]["value"] == pytest.approx(0.9)
