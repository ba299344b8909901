"""The one metrics registry of a run.

Every number the controller reports goes through `Metrics`, which fans it out to:

    record / observe / span
        -> run directory  metrics.jsonl, timeline.jsonl (one line each, flushed)
        -> RunLog         in-memory view for the live dashboard (`latest()`, the /api routes)
        -> Prometheus     gauges, histograms, ledger counter (served when prometheus_port set)
        -> trackers       TensorBoard / wandb / MLflow when switched on in MonitorConfig

Formats are those of docs/run-dir.md; ``observe`` adds ``kind: "hist"`` lines (see
docs/monitoring.md): observations are summarised at the next ``record`` call, with its step,
and at ``close``. Hist lines are additive: sum the lines of a name for a run total.

The ledger file has one writer, the data ledger (``rollstream.data.ledger.Ledger``); the
in-memory view follows ledger.jsonl on disk, and `view()` brings it up to date.

Time: ``t_s`` is seconds since the registry started, read from an injected Clock (wall time
by default, simulated time in ``rollstream sim``). Files are opened on first write; on
resume they are appended to (a torn last line is closed first) and the in-memory view starts
from what is already there. All methods are thread-safe.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rollstream.clock import Clock, WallClock
from rollstream.config.schema import MonitorConfig
from rollstream.monitor.histogram import Hist, edges_for
from rollstream.monitor.prom import PromExporter
from rollstream.monitor.runlog import RunDirReader, RunLog
from rollstream.monitor.trackers import Tracker, build_trackers
from rollstream.run_files import RunFiles

log = logging.getLogger(__name__)
OUTCOMES = ("done", "interrupted", "failed")
LOG_STREAMS = ("metrics", "timeline")  # the run directory's <stream>.jsonl files
# metric lines and spans a live run keeps in memory for the dashboard (runlog.RunLog: the
# newer half whole, older ones thinned; the files keep all), so memory stays flat however
# long a run goes: the newest ~100 steps' records in full, 8,192 spans (the timeline's)
LIVE_WINDOW, LIVE_SPANS = 1024, 8192


def _open_append(path: Path) -> IO[str]:
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        if torn:  # a crash mid-line; end it so our first line stays parseable
            with path.open("a", encoding="utf-8") as f:
                f.write("\n")
    return path.open("a", encoding="utf-8", buffering=1)


def _number(name: str, value: Any) -> float | int | None:
    """A JSON number (None for None/NaN/inf); numpy scalars and 0-d tensors are accepted."""
    if isinstance(value, (bool, numbers.Integral)):
        return int(value)
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}") from None
    return x if math.isfinite(x) else None


class Metrics:
    """Records a run's metrics, histograms, timeline spans and ledger lines.

    ``run_dir=None`` keeps everything in memory (and Prometheus/trackers), writing no files.
    """

    def __init__(self, run_dir: Path | None, cfg: MonitorConfig, *,
                 clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._clock = clock or WallClock()
        self._t0 = self._clock.now()
        self._lock = threading.RLock()
        self._pending: dict[str, Hist] = {}
        self._closed = False
        self._files: dict[str, IO[str]] = {}
        self._reader: RunDirReader | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._reader = RunDirReader(self.run_dir, check=False, window=LIVE_WINDOW,
                                        span_window=LIVE_SPANS)
            self.log = self._reader.refresh()  # resume: start from what is on disk
        else:
            self.log = RunLog(LIVE_WINDOW, LIVE_SPANS)
        self.prom = PromExporter(lambda: self.view().ledger_counts())
        self.prometheus_port: int | None = None
        if cfg.prometheus_port is not None:
            self.prometheus_port = self.prom.serve(cfg.prometheus_port)
        self._trackers: list[Tracker] = build_trackers(cfg, self.run_dir)

    @property
    def prometheus_url(self) -> str | None:
        """http://127.0.0.1:PORT/metrics when serving Prometheus, else None."""
        if self.prometheus_port is None:
            return None
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    def now_s(self) -> float:
        """Seconds since the registry started (the ``t_s`` of lines it writes)."""
        return round(self._clock.now() - self._t0, 6)

    def _write(self, stream: str, obj: Mapping[str, Any]) -> None:
        if self.run_dir is None:
            return
        f = self._files.get(stream)
        if f is None:
            f = self._files[stream] = _open_append(RunFiles(self.run_dir).stream(stream))
        f.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
        f.flush()

    def sync(self) -> dict[str, int]:
        """Flush and fsync ``metrics.jsonl`` and ``timeline.jsonl``; their sizes in bytes (a
        checkpoint stores them: what a resume finds past them was written after it)."""
        sizes: dict[str, int] = {}
        with self._lock:
            for stream in LOG_STREAMS:
                f = self._files.get(stream)
                if f is not None:
                    f.flush()
                    os.fsync(f.fileno())
                    sizes[stream] = f.tell()
                elif self.run_dir is not None and (
                        path := RunFiles(self.run_dir).stream(stream)).exists():
                    sizes[stream] = path.stat().st_size
                else:
                    sizes[stream] = 0
        return sizes

    def record(self, kind: str, step: int, values: Mapping[str, float | int]) -> None:
        """Append ``{"kind", "step", "t_s", **values}`` and update gauges and trackers.

        Non-finite (and None) values are written as null (and NaN in Prometheus).
        """
        if not kind or kind == "hist":
            raise ValueError(f"record kind must be a non-empty name other than 'hist', "
                             f"got {kind!r}")
        clean = {name: _number(name, v) for name, v in values.items()}
        with self._lock:
            self._check_open()
            self._flush_hists(step)
            line = {"kind": kind, "step": int(step), "t_s": self.now_s(), **clean}
            self._write("metrics", line)
            self.log.add_record(line)
            self.prom.set_gauges(kind, int(step), clean)
            finite_values = {k: float(v) for k, v in clean.items() if v is not None}
            for tracker in list(self._trackers):
                try:
                    tracker.scalars(kind, int(step), finite_values)
                except Exception as e:  # fault boundary: an external sink never stops a run
                    log.warning(f"monitor: dropping tracker {type(tracker).__name__} after "
                                f"error: {e!r}")
                    self._trackers.remove(tracker)

    def observe(self, name: str, value: float) -> None:
        """Add one value to histogram `name` (non-finite values are ignored)."""
        value = float(value)
        if not math.isfinite(value):
            return
        with self._lock:
            self._check_open()
            hist = self._pending.get(name)
            if hist is None:
                hist = self._pending[name] = Hist(edges=edges_for(name))
            hist.add(value)
            self.prom.observe(name, value)

    def _flush_hists(self, step: int) -> None:
        for name, hist in sorted(self._pending.items()):
            line = {"kind": "hist", "step": int(step), "t_s": self.now_s(), "name": name,
                    **hist.to_json()}
            self._write("metrics", line)
            self.log.add_record(line)
        self._pending.clear()

    def span(self, *, sample_uid: str, engine_id: int | str, slot: int, t_start_s: float,
             t_end_s: float, version_start: int, version_end: int, num_tokens: int,
             outcome: str) -> None:
        """Append one uninterrupted stretch of a sample on an engine to timeline.jsonl."""
        if outcome not in OUTCOMES:
            raise ValueError(f"span outcome must be one of {OUTCOMES}, got {outcome!r}")
        if t_end_s < t_start_s:
            raise ValueError(f"span of {sample_uid}: t_end_s {t_end_s} < t_start_s {t_start_s}")
        line = {"sample_uid": sample_uid, "engine_id": engine_id, "slot": int(slot),
                "t_start_s": float(t_start_s), "t_end_s": float(t_end_s),
                "version_start": int(version_start), "version_end": int(version_end),
                "num_tokens": int(num_tokens), "outcome": outcome}
        with self._lock:
            self._check_open()
            self._write("timeline", line)
            self.log.add_span(line)

    def view(self) -> RunLog:
        """The in-memory view of the run, with ledger lines on disk read in."""
        if self._reader is not None:
            self._reader.refresh(("ledger",))
        return self.log

    def latest(self) -> dict[str, Any]:
        """Current state for the dashboard: latest values per kind, furthest step, run-wide
        histograms, ledger counts, counts of lines, and ``t_s`` now."""
        state = self.view().state()
        state["t_s"] = self.now_s()
        state["closed"] = self._closed
        return state

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Metrics is closed")

    def close(self) -> None:
        """Flush pending histograms, close files, stop the Prometheus server and trackers."""
        with self._lock:
            if self._closed:
                return
            if self._pending:
                step = self.log.state()["step"]
                self._flush_hists(step if step is not None else 0)
            self._closed = True
            for f in self._files.values():
                f.close()
            self._files.clear()
            self.prom.stop()
            for tracker in self._trackers:
                tracker.close()

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
