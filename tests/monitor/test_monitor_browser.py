"""Headless Chromium renders the live dashboard and the report: data drawn, no console errors.

Needs Debian's chromium (``apt-get install -y chromium``; .ci/run installs it). Set
ROLLSTREAM_SCREENSHOT_DIR to keep the screenshot for a look.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.metrics import Metrics
from rollstream.monitor.report import write_report
from tests.monitor.synth import synth_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                       "(apt-get install -y chromium)"),
]


def chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1000",
            "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "HOME": str(profile)})


def console_messages(stderr: str) -> list[str]:
    """Every page console message (the page logs none itself) and uncaught exception."""
    return [x for x in stderr.splitlines() if ":CONSOLE" in x or "Uncaught" in x]


def assert_drawn(dom: str) -> None:
    dom = re.sub(r"<script\b.*?</script>", "", dom, flags=re.S)  # only what the script drew
    bars = re.findall(r'<rect class="span-bar" ([^>]*)>', dom)
    assert len(bars) > 300, "timeline bars missing"
    assert all('data-uid="s' in b and "data-version=" in b for b in bars)
    assert any('data-outcome="interrupted"' in b for b in bars)
    assert 'class="interrupt-mark"' in dom
    rows = {re.search(r'data-engine="(\w+)" data-slot="(\d+)"', b).groups() for b in bars}
    assert len(rows) == 16  # 2 engines x 8 slots
    assert len(set(re.findall(r'data-version="(\d+)"', dom))) > 10, "colour by version"
    assert re.search(r'data-chart="reward".*?data-series="train reward_mean"', dom, re.S)
    assert re.search(r'data-chart="reward".*?data-series="eval reward"', dom, re.S)
    assert re.search(r'data-chart="throughput".*?data-series="generated tokens/s"', dom, re.S)
    assert len(re.findall(r'class="hist-bar"', dom)) >= 2
    assert re.search(r'data-tile="trained samples"><div class="k">[^<]*</div>'
                     r'<div class="v">[1-9]', dom)
    # synth_run's 30 steps: a replayed group every 5th step, a temperature change at step 12
    assert re.search(r'data-tile="replayed groups"><div class="k">[^<]*</div>'
                     r'<div class="v">6</div>', dom)
    assert re.search(r'data-tile="last reconfigure"><div class="k">[^<]*</div>'
                     r'<div class="v">step 12: sampling.temperature 1→0.700</div>', dom)
    assert "dropped_stale" in dom and "reward timeout" in dom  # ledger table
    assert "max_staleness" in dom  # resolved config


NODE_A, NODE_B = "a1" * 28, "b2" * 28  # Ray's node ids: 56 hex digits


class Roster:
    """A live run's engines as ``runtime/control.py`` reports them: one joining, one leaving,
    on two nodes of a Ray cluster."""

    def engines(self) -> list[dict]:
        row = {"health": "up", "health_reason": None, "version": 7, "routing": "routed",
               "routing_reason": None, "in_flight": 3, "member": "serving",
               "node_id": NODE_A, "node_address": "10.0.0.1", "node_hostname": "gpu-a",
               "transport": "broadcast", "sync_version": 7, "sync_kind": "delta",
               "sync_bytes_last": 1_500_000, "sync_dtype": "bfloat16",
               "sync_bytes_total": 9_000_000, "syncs": 7}
        return [{**row, "engine_id": "local-0", "member": "leaving", "routing": "drained"},
                {**row, "engine_id": "local-1", "node_id": NODE_B, "node_address": "10.0.0.2",
                 "node_hostname": "gpu-b"},
                {**row, "engine_id": "local-2", "member": "joining", "in_flight": 0,
                 "node_id": None, "node_address": None, "node_hostname": None,
                 "transport": None, "sync_version": None, "sync_kind": None,
                 "sync_bytes_last": 0, "sync_dtype": None, "sync_bytes_total": 0, "syncs": 0}]

    def nodes(self) -> list[dict]:
        from rollstream.runtime.nodes import nodes_view

        return nodes_view(self.engines())


def test_live_dashboard_renders_in_chromium(tmp_path: Path) -> None:
    run_dir = tmp_path / "browser-run"
    metrics = synth_run(run_dir, num_steps=30, close=False)
    dash = Dashboard(metrics, run_dir, MonitorConfig(progress=False, dashboard_poll_s=0.5),
                     control=Roster())  # type: ignore[arg-type]
    url = dash.start()
    try:
        res = chromium(url, tmp_path / "profile", "--dump-dom")
        assert res.returncode == 0, res.stderr[-2000:]
        assert console_messages(res.stderr) == []
        assert 'class="badge live"' in res.stdout, "the page did not poll the live server"
        assert_drawn(res.stdout)
        engines = re.search(r'<div id="engines">(.*?)</div>', res.stdout, re.S).group(1)
        assert [tuple(re.findall(r"<td[^>]*>([^<]*)</td>", row)[:2]) for row in
                re.findall(r"<tr>(.*?)</tr>", engines)[1:]] == \
            [("local-0", "leaving"), ("local-1", "serving"), ("local-2", "joining")]
        assert [re.findall(r"<td[^>]*>([^<]*)</td>", row)[-1] for row in
                re.findall(r"<tr>(.*?)</tr>", engines)[1:]] == ["a1a1a1a1", "b2b2b2b2", "–"]
        cluster = re.search(r'<div id="cluster">(.*?)</div>', res.stdout, re.S).group(1)
        assert [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in
                re.findall(r"<tr>(.*?)</tr>", cluster)[1:]] == [
            [NODE_A, "10.0.0.1", "gpu-a", "local-0 leaving up/drained v7", "broadcast",
             "bfloat16", "v7", "1.500 MB", "9.000 MB"],
            [NODE_B, "10.0.0.2", "gpu-b", "local-1 serving up/routed v7", "broadcast",
             "bfloat16", "v7", "1.500 MB", "9.000 MB"],
            ["(joining)", "–", "–", "local-2 joining up/routed v7", "–", "–", "–",
             "0.000 MB", "0.000 MB"]]

        shot = tmp_path / "dashboard.png"
        res = chromium(url, tmp_path / "profile", f"--screenshot={shot}")
        assert res.returncode == 0 and console_messages(res.stderr) == []
        assert shot.stat().st_size > 30_000  # a blank page compresses to a few KB
        if keep := os.environ.get("ROLLSTREAM_SCREENSHOT_DIR"):
            shutil.copy(shot, Path(keep) / "dashboard.png")
    finally:
        dash.stop()
        metrics.close()


def test_report_renders_offline_in_chromium(tmp_path: Path) -> None:
    run_dir = tmp_path / "report-run"
    synth_run(run_dir, num_steps=30)
    report = write_report(run_dir)
    res = chromium(report.as_uri(), tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    assert console_messages(res.stderr) == []
    assert "report ·" in res.stdout
    assert_drawn(res.stdout)
    assert '<div class="card" id="engines-card" hidden="">' in res.stdout, "no live engines"
    assert '<div class="card" id="cluster-card" hidden="">' in res.stdout, "nor their nodes"


def test_dashboard_before_any_data(tmp_path: Path) -> None:
    metrics = Metrics(None, MonitorConfig(progress=False))
    with Dashboard(metrics, None, MonitorConfig(dashboard_poll_s=0.5)) as dash:
        assert dash.url is not None
        res = chromium(dash.url, tmp_path / "profile", "--dump-dom")
    metrics.close()
    assert res.returncode == 0 and console_messages(res.stderr) == []
    assert 'class="badge live"' in res.stdout
    assert "no data yet" in res.stdout and "no rollout spans yet" in res.stdout
