"""The live dashboard over real HTTP on 127.0.0.1: endpoints, increments, stop."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.metrics import Metrics
from tests.monitor.synth import FakeClock, synth_run

CFG = MonitorConfig(progress=False, dashboard=True)


def test_live_dashboard_endpoints_and_increments(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    metrics = synth_run(run_dir, num_steps=12, close=False)
    dash = Dashboard(metrics, run_dir, CFG)
    url = dash.start()
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
        with httpx.Client(base_url=url, timeout=5) as http:
            page = http.get("/")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert '"mode":"live"' in page.text and "function drawTimeline" in page.text
            assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page.text)

            first = http.get("/api/poll").json()
            assert first["name"] == "live"
            assert first["metrics_next"] == len(first["metrics"]) > 40
            assert first["spans_next"] == len(first["spans"]) > 300
            assert first["ledger"]["num_samples"] > 300
            assert first["state"]["step"] == 12 and first["config"] and first["summary"]

            # the run goes on: only the new lines come back past the cursors
            metrics.record("train", 13, {"reward_mean": 0.9, "loss": 0.01})
            metrics.span(sample_uid="late", engine_id=1, slot=7, t_start_s=40.0, t_end_s=41.0,
                         version_start=13, version_end=13, num_tokens=9, outcome="done")
            with (run_dir / "ledger.jsonl").open("a") as f:  # as the data ledger appends
                f.write(json.dumps({"sample_uid": "late", "task_uid": "t", "source": "tick",
                                    "status": "trained",
                                    "min_version": 13, "trained_at_step": 13, "reward": 1.0,
                                    "t_s": 41.0}) + "\n")
            nxt = http.get("/api/poll", params={"metrics_since": first["metrics_next"],
                                                "spans_since": first["spans_next"]}).json()
            assert [m["step"] for m in nxt["metrics"]] == [13]
            assert [s["sample_uid"] for s in nxt["spans"]] == ["late"]
            assert nxt["ledger"]["num_samples"] == first["ledger"]["num_samples"] + 1
            assert nxt["state"]["kinds"]["train"]["reward_mean"] == 0.9

            state = http.get("/api/state").json()
            assert state["step"] == 13 and state["closed"] is False
            lines = http.get("/api/metrics", params={"since": 5}).json()
            assert lines["next"] == first["metrics_next"] + 1
            assert len(lines["lines"]) == lines["next"] - 5
            assert http.get("/api/timeline").json()["next"] == first["spans_next"] + 1
            assert "trained" in http.get("/api/ledger").json()["by_status"]
            assert "train:" in http.get("/api/config").json()["text"]
            assert http.get("/api/summary").json()["steps"] == 12
            prom = http.get("/metrics")
            assert prom.status_code == 200 and "rollstream_train_reward_mean 0.9" in prom.text
            assert http.get("/api/poll", params={"metrics_since": -1}).status_code == 422
            assert http.get("/favicon.ico").status_code == 204
    finally:
        dash.stop()
        metrics.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=2)


def test_dashboard_follows_a_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "files"
    writer = Metrics(run_dir, CFG, clock=FakeClock())
    writer.record("train", 0, {"reward_mean": 0.1})
    with Dashboard(None, run_dir, CFG) as dash:
        assert dash.url is not None
        with httpx.Client(base_url=dash.url, timeout=5) as http:
            assert http.get("/api/state").json()["step"] == 0
            writer.record("train", 1, {"reward_mean": 0.2})
            poll = http.get("/api/poll").json()
            assert [m["step"] for m in poll["metrics"]] == [0, 1]
            assert poll["config"] is None and poll["summary"] is None
            assert http.get("/metrics").status_code == 404
    writer.close()


def test_dashboard_needs_a_source_and_binds_the_given_port(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Metrics registry or a run directory"):
        Dashboard(None, None, CFG)
    first = Dashboard(Metrics(None, CFG), None, CFG)
    url = first.start()
    port = int(url.rsplit(":", 1)[1].strip("/"))
    try:
        busy = Dashboard(Metrics(None, CFG), None, MonitorConfig(dashboard_port=port))
        with pytest.raises(OSError):
            busy.start()
    finally:
        first.stop()
    again = Dashboard(Metrics(None, CFG), None, MonitorConfig(dashboard_port=port))
    assert again.start() == url
    again.stop()
