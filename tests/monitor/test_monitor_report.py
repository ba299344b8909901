"""`write_report` turns a run directory into one self-contained HTML file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rollstream.cli import main
from rollstream.monitor.report import build_report, write_report

EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


def embedded(html: str) -> dict:
    m = re.search(r"window\.ROLLSTREAM = (\{.*?\});</script>", html, re.S)
    assert m, "boot object not found"
    return json.loads(m.group(1))


def test_report_embeds_the_run(synth_dir: Path) -> None:
    out = write_report(synth_dir)
    assert out == synth_dir / "report.html"
    html = out.read_text()
    assert not EXTERNAL.search(html), "report must not load anything from elsewhere"
    assert "@import" not in html and "url(http" not in html
    boot = embedded(html)
    assert boot["mode"] == "static"
    data = boot["data"]
    n_metrics = len((synth_dir / "metrics.jsonl").read_text().splitlines())
    n_spans = len((synth_dir / "timeline.jsonl").read_text().splitlines())
    n_ledger = len((synth_dir / "ledger.jsonl").read_text().splitlines())
    assert len(data["metrics"]) == n_metrics > 200
    assert len(data["spans"]) == n_spans > 1000
    assert data["ledger"]["num_samples"] == n_ledger
    assert set(data["ledger"]["by_status"]) == {"trained", "filtered", "dropped_stale", "failed"}
    assert set(data["ledger"]["by_source"]) == {"math", "tick"}
    assert {"reward timeout", "engine error"} <= set(data["ledger"]["reasons"]["failed"])
    assert data["summary"]["reward_final"] == 0.71
    assert yaml.safe_load(data["config"])["train"]["steps"] == 60
    kinds = {m["kind"] for m in data["metrics"]}
    assert kinds == {"rollout", "train", "phase", "eval", "hist", "reconfig"}
    assert any(s["outcome"] == "interrupted" for s in data["spans"])
    assert any(s["version_end"] > s["version_start"] for s in data["spans"])
    # the drawing code is the dashboard's, inline
    assert "function drawTimeline" in html and "<style>" in html


def test_report_via_cli(synth_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(synth_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(synth_dir / "report.html")


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such directory"):
        write_report(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a run directory: it holds none of .*metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="it is a file"):
        write_report(tmp_path / "notes.txt")


def test_partial_and_hostile_run_dir(tmp_path: Path) -> None:
    # a crashed run: config only, a torn metrics line, text that tries to end the script
    (tmp_path / "config.yaml").write_text("name: '</script><script>alert(1)</script>'\n")
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind":"train","step":0,"t_s":1.0,"loss":NaN}\nnot json\n{"kind":"tr')
    html = build_report(tmp_path)
    assert "</script><script>alert" not in html
    data = embedded(html)["data"]
    assert data["config"].startswith("name: '</script>")
    assert data["metrics"] == [{"kind": "train", "step": 0, "t_s": 1.0, "loss": None}]
    assert data["num_bad_lines"] == 1 and data["summary"] is None and data["spans"] == []
