"""The in-memory view of a run that the dashboard and the report draw from.

`RunLog` holds metric lines, timeline spans and a running ledger summary behind a lock: the
metrics registry appends to it while a run goes (the dashboard reads it from another
thread), and `RunDirReader` fills one from a run directory's files, following them
incrementally (only new complete lines are parsed, a torn last line waits for its newline).
Non-finite floats become ``null`` here, because browsers' JSON.parse rejects NaN.
"""

from __future__ import annotations

import bisect
import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from rollstream.data.ledger_row import LedgerRow, decode_row
from rollstream.monitor.histogram import Hist
from rollstream.monitor.tiles import RunTotals
from rollstream.run_files import RUN_MARKERS, RunFiles
from rollstream.staleness import age

T = TypeVar("T")


def finite(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (recursively in lists and dicts)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


@dataclass(slots=True, kw_only=True)
class LedgerSummary:
    """Counts over ledger lines: per status, per source and status, failure reasons."""

    num_samples: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_source: dict[str, Counter[str]] = field(default_factory=dict)
    reasons: dict[str, Counter[str]] = field(default_factory=dict)  # status -> reason -> n
    staleness: Counter[int] = field(default_factory=Counter)  # trained: step - oldest kept version
    reward_sum: dict[str, float] = field(default_factory=dict)  # source -> sum of rewards
    reward_n: Counter[str] = field(default_factory=Counter)
    num_tokens: int = 0
    num_interrupts: int = 0

    def add(self, row: LedgerRow) -> None:
        status = row.status.value
        source = row.source or "-"
        self.num_samples += 1
        self.by_status[status] += 1
        self.by_source.setdefault(source, Counter())[status] += 1
        if status not in ("trained", "evaluated"):
            reason = row.reason or "(none)"
            self.reasons.setdefault(status, Counter())[reason] += 1
        step, version = row.trained_at_step, row.trained_version
        if status == "trained" and step is not None and version is not None:
            self.staleness[age(step, version)] += 1
        if row.reward is not None and math.isfinite(row.reward):
            self.reward_sum[source] = self.reward_sum.get(source, 0.0) + row.reward
            self.reward_n[source] += 1
        self.num_tokens += row.num_tokens
        self.num_interrupts += row.num_interrupts

    def to_json(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_interrupts": self.num_interrupts,
            "by_status": dict(self.by_status),
            "by_source": {
                src: {
                    "by_status": dict(c),
                    "reward_mean": (self.reward_sum[src] / self.reward_n[src]
                                    if self.reward_n[src] else None),
                }
                for src, c in sorted(self.by_source.items())
            },
            "reasons": {s: dict(c.most_common()) for s, c in sorted(self.reasons.items())},
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }


class _Window:
    """An append-only stream kept in bounded memory (all of it when ``limit`` is None).

    Items are addressed by their index in the whole stream. When ``limit`` items are held,
    the older half is thinned to every other item: the newer half stays whole, and the
    rest spans the run at a resolution that halves with age, so a chart of the whole run
    can still be drawn from a bounded number of points."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 4:
            raise ValueError(f"a window holds at least 4 items, got {limit}")
        self.limit = limit
        self.items: list[tuple[int, dict[str, Any]]] = []  # (index in the stream, item)
        self.total = 0  # items ever appended

    def append(self, item: dict[str, Any]) -> None:
        self.items.append((self.total, item))
        self.total += 1
        if self.limit is not None and len(self.items) >= self.limit:
            half = len(self.items) // 2
            self.items = self.items[:half:2] + self.items[half:]

    def since(self, index: int) -> tuple[list[dict[str, Any]], int]:
        first = bisect.bisect_left(self.items, index, key=lambda pair: pair[0])
        return [item for _, item in self.items[first:]], self.total


class RunLog:
    """Thread-safe, append-only copy of a run's metrics, spans and ledger summary.

    ``window`` bounds the metric lines and ``span_window`` the spans kept (at most N of each: the newest whole,
    older ones thinned; cursors stay indexes into the whole stream): a live run's memory
    stays flat however long it runs, while the files keep everything. None keeps all (the
    report, read from the files)."""

    def __init__(self, window: int | None = None, span_window: int | None = None) -> None:
        self._lock = threading.Lock()
        self._records = _Window(window)
        self._spans = _Window(span_window if span_window is not None else window)
        self._ledger = LedgerSummary()
        self._latest: dict[str, dict[str, Any]] = {}  # kind -> merged latest values
        self._hists: dict[str, Hist] = {}  # name -> total over the run
        self._totals = RunTotals()  # what the tiles read (monitor/tiles.py)
        self.num_bad_lines = 0

    def add_record(self, record: Mapping[str, Any]) -> None:
        rec = finite(dict(record))
        with self._lock:
            self._records.append(rec)
            kind = str(rec.get("kind"))
            if kind == "hist":
                self._add_hist(rec)
            else:
                self._latest.setdefault(kind, {}).update(rec)
                self._totals.add_record(rec)

    def _add_hist(self, rec: dict[str, Any]) -> None:
        name, edges, counts = rec.get("name"), rec.get("edges"), rec.get("counts")
        if not isinstance(name, str) or not isinstance(edges, list) or not isinstance(counts, list):
            return
        total = self._hists.get(name)
        if total is None or list(total.edges) != edges:
            total = self._hists[name] = Hist(edges=tuple(edges))
        if len(counts) == len(total.counts):
            total.merge(counts, int(rec.get("count") or 0), float(rec.get("sum") or 0.0))
            if rec.get("min") is not None:
                total.lo = min(total.lo, rec["min"])
            if rec.get("max") is not None:
                total.hi = max(total.hi, rec["max"])

    def add_span(self, span: Mapping[str, Any]) -> None:
        clean = finite(dict(span))
        with self._lock:
            self._spans.append(clean)

    def add_ledger(self, row: LedgerRow) -> None:
        with self._lock:
            self._ledger.add(row)
            self._totals.add_ledger(row)

    def state(self) -> dict[str, Any]:
        """Latest values per kind, the furthest step, run-wide histograms, ledger counts."""
        with self._lock:
            steps = [v["step"] for v in self._latest.values() if isinstance(v.get("step"), int)]
            return {
                "step": max(steps, default=None),
                "kinds": {k: dict(v) for k, v in self._latest.items()},
                "hist": {n: finite(h.to_json()) for n, h in self._hists.items()},
                "num_metric_lines": self._records.total,
                "num_spans": self._spans.total,
                "ledger": {"num_samples": self._ledger.num_samples,
                           "by_status": dict(self._ledger.by_status)},
            }

    def records(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Metric lines from index `since` on, and the next cursor."""
        with self._lock:
            return self._records.since(since)

    def spans(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Timeline spans from index `since` on, and the next cursor."""
        with self._lock:
            return self._spans.since(since)

    def ledger_summary(self) -> dict[str, Any]:
        with self._lock:
            return self._ledger.to_json()

    def tiles(self, summary: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """The page's tiles (monitor/tiles.py): the run's when ``summary`` (the run ended),
        else the last steps'."""
        with self._lock:
            return self._totals.tiles(summary, trained_samples=self._ledger.by_status["trained"])

    def ledger_counts(self) -> dict[tuple[str, str], int]:
        """(status, source) -> number of ledger lines."""
        with self._lock:
            return {(status, src): n for src, c in self._ledger.by_source.items()
                    for status, n in c.items()}


def _json_object(line: bytes) -> dict[str, Any]:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object ({type(obj).__name__})")
    return obj


class JsonlTail(Generic[T]):
    """Reads a JSONL file incrementally: each call yields the newly completed lines, each
    parsed by ``parse`` (a JSON object by default; a line it refuses is counted in
    ``num_bad``), read ``CHUNK_BYTES`` at a time (a resumed run reads its whole history at
    start: memory stays that of a chunk, not of the file)."""

    CHUNK_BYTES = 1 << 20

    def __init__(self, path: Path, parse: Callable[[bytes], T] = _json_object) -> None:
        self.path = path
        self.parse = parse
        self._offset = 0
        self.num_bad = 0

    def read_new(self) -> Iterator[T]:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(self._offset)
            buf = b""
            while data := f.read(self.CHUNK_BYTES):
                buf += data
                end = buf.rfind(b"\n") + 1  # a torn last line waits for its newline
                if end:
                    self._offset += end
                    yield from self._parse(buf[:end])
                    buf = buf[end:]

    def _parse(self, lines: bytes) -> Iterator[T]:
        for line in lines.splitlines():
            if not line.strip():
                continue
            try:
                yield self.parse(line)
            except (ValueError, RecursionError):
                self.num_bad += 1


def check_run_dir(run_dir: Path) -> Path:
    """`run_dir` as a Path, or ValueError saying why it is not a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"{run_dir} is not a run directory (no such directory)")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory (it is a file)")
    if not any((run_dir / name).is_file() for name in RUN_MARKERS):
        raise ValueError(f"{run_dir} is not a run directory: it holds none of "
                         f"{', '.join(RUN_MARKERS)}")
    return run_dir


STREAMS = ("metrics", "timeline", "ledger")


class RunDirReader:
    """A RunLog that follows a run directory's files; `refresh()` reads what is new.

    ``check=False`` accepts a directory that holds no run files yet (a run starting);
    ``window``: see :class:`RunLog`.
    """

    def __init__(self, run_dir: Path, *, check: bool = True, window: int | None = None,
                 span_window: int | None = None) -> None:
        self.run_dir = check_run_dir(run_dir) if check else Path(run_dir)
        self.log = RunLog(window, span_window)
        files = RunFiles(self.run_dir)
        self._metrics = JsonlTail(files.metrics)
        self._timeline = JsonlTail(files.timeline)
        self._ledger = JsonlTail(files.ledger, decode_row)
        self._lock = threading.Lock()  # one reader at a time per tail

    def refresh(self, streams: tuple[str, ...] = STREAMS) -> RunLog:
        """Read the new complete lines of `streams` into the log; returns the log."""
        with self._lock:
            if "metrics" in streams:
                for rec in self._metrics.read_new():
                    self.log.add_record(rec)
            if "timeline" in streams:
                for span in self._timeline.read_new():
                    self.log.add_span(span)
            if "ledger" in streams:
                for row in self._ledger.read_new():
                    self.log.add_ledger(row)
            self.log.num_bad_lines = (self._metrics.num_bad + self._timeline.num_bad
                                      + self._ledger.num_bad)
        return self.log


def read_config_text(run_dir: Path | None) -> str | None:
    """config.yaml as text to show (its secrets redacted, whoever wrote it), or None."""
    from rollstream.config.redact import redacted_text

    path = RunFiles(run_dir).config if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    return redacted_text(path.read_text(encoding="utf-8"))


def read_summary(run_dir: Path | None) -> dict[str, Any] | None:
    """summary.json (non-finite floats as None), or None when absent or not yet complete."""
    path = RunFiles(run_dir).summary if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None  # being written; the next poll will see it whole
    return finite(data) if isinstance(data, dict) else None
