"""What a user sees on the report and the live dashboard, laid out by headless Chromium.

On the synthesized run and on a real run of a few steps: every number of summary.json is
shown, formatted, inside its card; a finished run's tiles are the run's totals (from
summary.json, the ledger and metrics.jsonl), a live run's its last steps'; the evaluation
chart has one dot per evaluation, and says so when there are only the start and the end.
Screenshots go to ``test-out/`` (git-ignored); each test prints the path of its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.report import write_report
from tests.monitor.conftest import REAL_EVAL_EVERY, REAL_STEPS
from tests.monitor.page_check import CHROMIUM, SHOT_DIR, fmt_full, open_page, read_page
from tests.monitor.synth import synth_run, write_summary

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                       "(apt-get install -y chromium)"),
]
LIVE_STEPS = 10  # a live run's tiles cover its last 10 steps (docs/monitoring.md)
DRAWN = "document.querySelectorAll('#tiles .tile[data-tile=\"tokens/s\"]').length > 0"


def lines(run_dir: Path, name: str) -> list[dict[str, Any]]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def numbers(summary: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def assert_summary_shown(seen: dict[str, Any], summary: dict[str, Any]) -> None:
    assert seen["pageWidth"] <= seen["viewWidth"], "the page scrolls sideways"
    nums = numbers(summary)
    assert len(nums) >= 5
    for key, value in nums.items():
        row = seen["summary"].get(key)
        assert row is not None, f"summary value {key} not rendered"
        assert row["text"] == fmt_full(value), (key, row["text"], value)
        assert row["inside"] and row["seen"], f"{key}: {row['text']!r} is not visible in " \
            f"its card: {row}"


def token_ages(entry: dict[str, Any]) -> int:
    """Σ over a trained sample's kept tokens of their age (each at its own version)."""
    return entry["num_trained_tokens"] * entry["trained_at_step"] - entry["trained_version_sum"]


def expected_run_tiles(run_dir: Path) -> dict[str, float | None]:
    """A finished run's tiles, from its files."""
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = [e for e in lines(run_dir, "ledger.jsonl") if e["status"] == "trained"]
    train = [m for m in lines(run_dir, "metrics.jsonl") if m["kind"] == "train"]
    mix = [m["mixture_error_pp"] for m in train if m.get("mixture_error_pp") is not None]
    tokens = sum(e["num_trained_tokens"] for e in trained)
    return {
        "tokens/s": summary["generated_tokens"] / summary["train_wall_s"],
        "staleness": sum(map(token_ages, trained)) / tokens,
        "gen/trained tokens": (sum(m["gen_tokens"] for m in train)
                               / sum(m["trained_tokens"] for m in train)),
        "mixture error pp": sum(mix) / len(mix) if mix else None,
        "trained samples": summary["trained_samples"],
    }


def expected_live_tiles(run_dir: Path) -> dict[str, float | None]:
    """A live run's tiles over its last LIVE_STEPS steps, from its files."""
    metrics = lines(run_dir, "metrics.jsonl")
    train = [m for m in metrics if m["kind"] == "train"][-LIVE_STEPS:]
    roll = [m for m in metrics if m["kind"] == "rollout"][-LIVE_STEPS - 1:]
    first = train[0]["step"]
    trained = [e for e in lines(run_dir, "ledger.jsonl")
               if e["status"] == "trained" and e["trained_at_step"] >= first]
    made = sum(b["gen_tok_s"] * (b["t_s"] - a["t_s"]) for a, b in zip(roll, roll[1:]))
    return {
        "tokens/s": made / (roll[-1]["t_s"] - roll[0]["t_s"]),
        "staleness": (sum(map(token_ages, trained))
                      / sum(e["num_trained_tokens"] for e in trained)),
        "gen/trained tokens": (sum(m["gen_tokens"] for m in train)
                               / sum(m["trained_tokens"] for m in train)),
        "mixture error pp": sum(m["mixture_error_pp"] for m in train) / len(train),
    }


def assert_tiles(seen: dict[str, Any], expected: dict[str, float | None], scope: str) -> None:
    for key, value in expected.items():
        tile = seen["tiles"].get(key)
        assert tile is not None, f"no tile {key}"
        want = "–" if value is None else fmt_full(value)
        assert tile["text"] == want, (key, tile["text"], value)
        if value is not None:
            assert float(tile["value"]) == pytest.approx(value, rel=1e-9), key
        assert tile["scope"] == (scope if key != "trained samples" else "run"), key
        assert tile["inside"] and tile["seen"], (key, tile)


def assert_eval_points(seen: dict[str, Any], run_dir: Path) -> int:
    evals = [m for m in lines(run_dir, "metrics.jsonl")
             if m["kind"] == "eval" and isinstance(m.get("reward"), (int, float))]
    assert seen["evalDots"] == len(evals), (seen["evalDots"], len(evals))
    return len(evals)


def shoot(page: Any, name: str) -> None:
    path = page.screenshot(SHOT_DIR / name)
    assert path.stat().st_size > 30_000  # a blank page compresses to a few KB
    print(f"screenshot: {path}")


def check_report(run_dir: Path, tmp_path: Path, shot: str) -> dict[str, Any]:
    report = write_report(run_dir)
    with open_page(report.as_uri(), tmp_path / "profile") as page:
        page.wait_for(DRAWN)
        seen = read_page(page)
        shoot(page, shot)
    assert_summary_shown(seen, json.loads((run_dir / "summary.json").read_text()))
    assert_tiles(seen, expected_run_tiles(run_dir), "run")
    return seen


def test_report_of_the_synthesized_run_shows_what_it_did(synth_dir: Path,
                                                         tmp_path: Path) -> None:
    seen = check_report(synth_dir, tmp_path, "report-synth.png")
    assert assert_eval_points(seen, synth_dir) == 5 and seen["evalLine"]
    assert seen["note"] is None


def test_report_of_a_real_run_shows_what_it_did(real_run_dir: Path, tmp_path: Path) -> None:
    seen = check_report(real_run_dir, tmp_path, "report-real.png")
    n = assert_eval_points(seen, real_run_dir)
    assert n == REAL_STEPS // REAL_EVAL_EVERY + 1  # the start, every 2 steps, the end
    assert seen["evalLine"] and seen["note"] is None


def test_report_with_only_start_and_end_evaluations_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "ends"
    synth_run(run_dir, num_steps=12, eval_steps=(1, 12))
    report = write_report(run_dir)
    with open_page(report.as_uri(), tmp_path / "profile") as page:
        page.wait_for(DRAWN)
        seen = read_page(page)
    assert assert_eval_points(seen, run_dir) == 2
    assert not seen["evalLine"], "two evaluations joined by a line read as a learning curve"
    assert seen["note"] and "only at the start and the end" in seen["note"]


def test_live_dashboard_shows_the_last_steps_then_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    metrics = synth_run(run_dir, num_steps=30, close=False, summary=False)
    dash = Dashboard(metrics, run_dir, MonitorConfig(progress=False, dashboard_poll_s=0.3))
    url = dash.start()
    try:
        with open_page(url, tmp_path / "profile") as page:
            page.wait_for(DRAWN)
            live = read_page(page)
            assert_tiles(live, expected_live_tiles(run_dir), f"last {LIVE_STEPS} steps")
            assert live["summary"] == {}
            metrics.close()
            # the run ends: its summary appears and the tiles become the run's
            write_summary(run_dir, num_steps=30, wall_s=90.0)
            page.wait_for("document.querySelectorAll('#summary tr[data-key]').length > 0")
            page.wait_for(DRAWN)
            done = read_page(page)
            shoot(page, "dashboard.png")
    finally:
        dash.stop()
        metrics.close()
    assert_summary_shown(done, json.loads((run_dir / "summary.json").read_text()))
    assert_tiles(done, expected_run_tiles(run_dir), "run")
    assert assert_eval_points(done, run_dir) == 4
