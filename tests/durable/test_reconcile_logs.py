"""A resume sets aside what the lost process measured after its checkpoint: metrics and
timeline lines past the sizes the checkpoint stored move to ``<stream>.superseded.jsonl``
(never dropped), so each step is recorded once; the checkpoint's own record stands."""

from __future__ import annotations

import json
from pathlib import Path

from rollstream.config.schema import MonitorConfig
from rollstream.durable.checkpoint import Checkpoint
from rollstream.durable.resume import reconcile_logs
from rollstream.monitor.metrics import Metrics


def _span(metrics: Metrics, uid: str) -> None:
    metrics.span(sample_uid=uid, engine_id="e", slot=0, t_start_s=0.0, t_end_s=1.0,
                 version_start=0, version_end=0, num_tokens=3, outcome="done")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_after_the_checkpoint_are_set_aside(tmp_path: Path) -> None:
    m = Metrics(tmp_path, MonitorConfig())
    for step in range(2):
        m.record("train", step, {"loss": 1.0})
        _span(m, f"s{step}")
    sizes = m.sync()
    m.record("phase", 2, {"checkpoint_step": 2.0, "checkpoint_s": 0.1})
    m.record("train", 2, {"loss": 2.0})  # the lost process's step 2 (trained again)
    _span(m, "lost")
    m.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind":"train","st')  # torn by the kill
    ckpt = Checkpoint(path=tmp_path / "ckpt", state={"step": 2, "logs": sizes})
    assert reconcile_logs(tmp_path, ckpt) == 2
    metrics = _lines(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in metrics] == [("train", 0), ("train", 1),
                                                         ("phase", 2)]
    assert [r["sample_uid"] for r in _lines(tmp_path / "timeline.jsonl")] == ["s0", "s1"]
    gone = _lines(tmp_path / "metrics.superseded.jsonl")
    assert [(r["kind"], r["step"], r["superseded_at_resume_step"]) for r in gone] == [
        ("train", 2, 2)]
    assert [r["sample_uid"] for r in _lines(tmp_path / "timeline.superseded.jsonl")] == ["lost"]
    # a resumed registry reads the reconciled files and appends after them
    m2 = Metrics(tmp_path, MonitorConfig())
    m2.record("train", 2, {"loss": 3.0})
    m2.close()
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [
        0, 1, 2]


def test_no_checkpoint_sets_everything_aside(tmp_path: Path) -> None:
    m = Metrics(tmp_path, MonitorConfig())
    m.record("train", 0, {"loss": 1.0})
    m.close()
    assert reconcile_logs(tmp_path, None) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == ""
