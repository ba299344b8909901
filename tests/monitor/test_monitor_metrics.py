"""The metrics registry writes the documented run-directory formats and Prometheus text."""

from __future__ import annotations

import json
import math
import sys
import threading
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.histogram import LENGTH_EDGES, STALENESS_EDGES, Hist, edges_for
from rollstream.monitor.metrics import Metrics
from tests.monitor.synth import FakeClock

CFG = MonitorConfig(progress=False)
SPAN_KEYS = {"sample_uid", "engine_id", "slot", "t_start_s", "t_end_s", "version_start",
             "version_end", "num_tokens", "outcome"}


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def ledger_entry(uid: str, status: str = "trained", source: str = "math", **kw: object) -> dict:
    return {"sample_uid": uid, "task_uid": "t0", "source": source, "status": status,
            "reason": kw.get("reason"), "reward": kw.get("reward", 1.0), "num_tokens": 12,
            "min_version": 0, "max_version": 1, "num_interrupts": 1,
            "trained_at_step": 2 if status == "trained" else None, "t_s": kw.get("t_s", 0.0)}


def append_ledger(run_dir: Path, *entries: dict) -> None:
    """Append lines as the data ledger (the file's one writer) does."""
    with (run_dir / "ledger.jsonl").open("a") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")


def test_record_writes_metrics_jsonl_flushed_per_call(tmp_path: Path) -> None:
    clock = FakeClock(t=100.0)
    m = Metrics(tmp_path, CFG, clock=clock)
    clock.t = 101.5
    m.record("train", 3, {"loss": 0.25, "reward_mean": 0.5, "trained_samples": 64,
                          "kl": math.nan, "is_weight_mean": True, "new_name": 7,
                          "np_f": np.float32(0.75), "np_i": np.int64(3), "gone": None})
    # readable before close: flushed each call
    (line,) = lines(tmp_path / "metrics.jsonl")
    assert line == {"kind": "train", "step": 3, "t_s": 1.5, "loss": 0.25, "reward_mean": 0.5,
                    "trained_samples": 64, "kl": None, "is_weight_mean": 1, "new_name": 7,
                    "np_f": 0.75, "np_i": 3, "gone": None}
    with pytest.raises(TypeError, match="loss"):
        m.record("train", 4, {"loss": "high"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="hist"):
        m.record("hist", 4, {})
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        m.record("train", 5, {"loss": 1.0})


def test_observe_is_summarised_at_next_record_and_at_close(tmp_path: Path) -> None:
    m = Metrics(tmp_path, CFG, clock=FakeClock())
    for v in (0, 0, 1, 2, 2, 2, 40, 1000):
        m.observe("staleness", v)
    m.observe("len/math", 100)
    m.observe("staleness", math.inf)  # ignored
    m.record("train", 7, {"loss": 1.0})
    m.observe("staleness", 1)
    m.close()
    hist = [x for x in lines(tmp_path / "metrics.jsonl") if x["kind"] == "hist"]
    assert [(h["name"], h["step"]) for h in hist] == [("len/math", 7), ("staleness", 7),
                                                     ("staleness", 7)]
    st = hist[1]
    assert st["edges"] == list(STALENESS_EDGES)
    assert len(st["counts"]) == len(st["edges"]) + 1
    assert st["counts"][0] == 2 and st["counts"][1] == 1 and st["counts"][2] == 3
    assert st["counts"][-1] == 1  # 1000 overflows the last edge
    assert st["counts"][st["edges"].index(64.0)] == 1  # 40 lands in (32, 64]
    assert (st["count"], st["sum"], st["min"], st["max"]) == (8, 1047, 0, 1000)
    assert hist[0]["edges"] == list(LENGTH_EDGES) and sum(hist[0]["counts"]) == 1


def test_hist_edges_and_buckets() -> None:
    assert edges_for("staleness") == STALENESS_EDGES
    assert edges_for("len/tick") == LENGTH_EDGES
    assert edges_for("pass/math")[-1] == 1.0
    h = Hist(edges=(1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 2.5):
        h.add(v)
    assert h.counts == [2, 2, 1]  # le semantics: 1.0 -> first bucket, 2.0 -> second


def test_span_and_ledger_lines(tmp_path: Path) -> None:
    clock = FakeClock()
    m = Metrics(tmp_path, CFG, clock=clock)
    m.span(sample_uid="s1", engine_id=0, slot=3, t_start_s=0.5, t_end_s=1.25,
           version_start=2, version_end=2, num_tokens=40, outcome="interrupted")
    m.span(sample_uid="s1", engine_id="vllm-1", slot=5, t_start_s=1.3, t_end_s=2.0,
           version_start=3, version_end=4, num_tokens=12, outcome="done")
    with pytest.raises(ValueError, match="outcome"):
        m.span(sample_uid="s2", engine_id=0, slot=0, t_start_s=0, t_end_s=1, version_start=0,
               version_end=0, num_tokens=1, outcome="aborted")
    with pytest.raises(ValueError, match="t_end_s"):
        m.span(sample_uid="s2", engine_id=0, slot=0, t_start_s=2, t_end_s=1, version_start=0,
               version_end=0, num_tokens=1, outcome="done")
    spans = lines(tmp_path / "timeline.jsonl")
    assert [set(s) for s in spans] == [SPAN_KEYS, SPAN_KEYS]
    assert spans[0]["outcome"] == "interrupted" and spans[1]["engine_id"] == "vllm-1"

    m.close()


def test_latest_counts_the_data_ledgers_lines(tmp_path: Path) -> None:
    m = Metrics(tmp_path, CFG, clock=FakeClock())
    m.record("rollout", 1, {"gen_tok_s": 500.0, "len_mean/math": 30.0})
    m.record("train", 1, {"reward_mean": 0.5})
    m.record("rollout", 2, {"in_flight": 16})
    m.observe("staleness", 1)
    m.record("train", 2, {"reward_mean": 0.6})
    append_ledger(tmp_path, ledger_entry("a"))
    # the data ledger appends to the file (torn last line included)
    with (tmp_path / "ledger.jsonl").open("a") as f:
        f.write(json.dumps(ledger_entry("b", "filtered", reason="zero variance")) + "\n")
        f.write('{"sample_uid": "c", "sta')
    state = m.latest()
    assert state["step"] == 2
    assert state["kinds"]["rollout"] == {"kind": "rollout", "step": 2, "t_s": 0.0,
                                         "gen_tok_s": 500.0, "len_mean/math": 30.0,
                                         "in_flight": 16}
    assert state["kinds"]["train"]["reward_mean"] == 0.6
    assert state["hist"]["staleness"]["count"] == 1
    assert state["ledger"] == {"num_samples": 2, "by_status": {"trained": 1, "filtered": 1}}
    summary = m.view().ledger_summary()
    assert summary["reasons"] == {"filtered": {"zero variance": 1}}
    assert summary["staleness"] == {"2": 1}
    m.close()


def test_in_memory_registry_writes_no_files(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Metrics(None, CFG) as m:
        m.record("eval", 0, {"reward": 0.3})
        m.span(sample_uid="s", engine_id=0, slot=0, t_start_s=0, t_end_s=1, version_start=0,
               version_end=0, num_tokens=3, outcome="done")
        state = m.latest()
    assert state["kinds"]["eval"]["reward"] == 0.3
    assert state["num_spans"] == 1 and state["ledger"]["num_samples"] == 0
    assert list(tmp_path.iterdir()) == []


def test_resume_appends_after_a_torn_line(tmp_path: Path) -> None:
    with Metrics(tmp_path, CFG, clock=FakeClock()) as m:
        m.record("train", 1, {"loss": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "st')  # crash mid-line
    with Metrics(tmp_path, CFG, clock=FakeClock()) as m:
        assert m.latest()["kinds"]["train"]["loss"] == 1.0  # view starts from the file
        m.record("train", 2, {"loss": 0.5})
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(text[-1])["step"] == 2 and len(text) == 3


def test_concurrent_writers_keep_lines_whole(tmp_path: Path) -> None:
    m = Metrics(tmp_path, CFG)

    def work(k: int) -> None:
        for i in range(200):
            m.record("rollout", i, {"gen_tok_s": float(k)})
            m.observe("staleness", i % 3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.close()
    rows = lines(tmp_path / "metrics.jsonl")
    assert sum(r["kind"] == "rollout" for r in rows) == 800
    assert sum(sum(r["counts"]) for r in rows if r["kind"] == "hist") == 800


def test_prometheus_text_and_server(tmp_path: Path) -> None:
    m = Metrics(tmp_path, MonitorConfig(progress=False, prometheus_port=0), clock=FakeClock())
    m.record("train", 4, {"loss": 0.125, "reward_mean": 0.5, "kl": math.nan})
    m.record("rollout", 4, {"gen_tok_s": 1234.0, "len_mean/math": 33.0, "len_mean/tick": 80.0})
    m.record("rollout", 5, {"odd/x": 1.0, "odd": 2.0})  # label form first, then plain: no clash
    m.observe("staleness", 1)
    m.observe("len/tick", 20)
    append_ledger(tmp_path, ledger_entry("a"), ledger_entry("b", "dropped_stale", source="tick"))
    text = m.prom.text().decode()
    assert "rollstream_train_loss 0.125" in text
    assert "rollstream_train_reward_mean 0.5" in text
    assert "rollstream_train_kl NaN" in text
    assert 'rollstream_rollout_len_mean{source="math"} 33.0' in text
    assert 'rollstream_rollout_odd{source="x"} 1.0' in text
    assert 'rollstream_rollout_odd{source=""} 2.0' in text
    assert 'rollstream_step{kind="rollout"} 5.0' in text
    assert 'rollstream_staleness_bucket{le="1.0"} 1.0' in text
    assert 'rollstream_len_count{source="tick"} 1.0' in text
    assert 'rollstream_ledger_samples_total{source="tick",status="dropped_stale"} 1.0' in text
    assert m.prometheus_url is not None and m.prometheus_url.startswith("http://127.0.0.1:")
    r = httpx.get(m.prometheus_url, timeout=5)
    assert r.status_code == 200 and "rollstream_rollout_gen_tok_s 1234.0" in r.text
    m.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(m.prometheus_url, timeout=2)


def test_prometheus_plain_then_labelled_falls_back_to_flat_name() -> None:
    m = Metrics(None, CFG)
    m.record("eval", 0, {"reward": 0.25, "reward/math": 0.5})
    text = m.prom.text().decode()
    assert "rollstream_eval_reward 0.25" in text and "rollstream_eval_reward_math 0.5" in text
    m.close()


def test_tensorboard_missing_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tensorboard") else real(name, *a))
    m = Metrics(tmp_path, MonitorConfig(progress=False, tensorboard=True))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "monitor: tensorboard is on but neither 'tensorboard' nor 'tensorboardX' is installed; "
        "skipping it"]
    m.record("train", 0, {"loss": 1.0})
    m.close()


def test_wandb_and_mlflow_trackers_get_scalars(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    run = types.SimpleNamespace(log=lambda d: calls.append(("wandb", d)),
                                finish=lambda: calls.append(("wandb-finish",)))
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls.append(("wandb-init", kw)) or run  # type: ignore[attr-defined]
    mlflow = types.ModuleType("mlflow")
    mlflow.set_experiment = lambda name: None  # type: ignore[attr-defined]
    mlflow.start_run = lambda run_name: calls.append(("mlflow-start", run_name))  # type: ignore[attr-defined]
    mlflow.log_metrics = lambda d, step: calls.append(("mlflow", d, step))  # type: ignore[attr-defined]
    mlflow.end_run = lambda: calls.append(("mlflow-end",))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    cfg = MonitorConfig(progress=False, trackers=("wandb", "mlflow"))
    with Metrics(tmp_path / "myrun", cfg) as m:
        m.record("train", 3, {"loss": 0.5, "kl": math.nan})
    assert ("wandb", {"train/step": 3, "train/loss": 0.5}) in calls
    assert ("mlflow", {"train/loss": 0.5}, 3) in calls
    assert ("mlflow-start", "myrun") in calls and ("wandb-finish",) in calls


def test_failing_tracker_is_dropped_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    mlflow = types.ModuleType("mlflow")
    mlflow.set_experiment = lambda name: None  # type: ignore[attr-defined]
    mlflow.start_run = lambda run_name: None  # type: ignore[attr-defined]
    mlflow.end_run = lambda: None  # type: ignore[attr-defined]

    def boom(d: dict, step: int) -> None:
        raise ConnectionError("tracking server down")

    mlflow.log_metrics = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    with Metrics(tmp_path, MonitorConfig(progress=False, trackers=("mlflow",))) as m:
        m.record("train", 0, {"loss": 1.0})
        assert any("dropping tracker" in r.getMessage() for r in caplog.records
                   if r.levelname == "WARNING")
        m.record("train", 1, {"loss": 0.5})
    assert len(lines(tmp_path / "metrics.jsonl")) == 2
