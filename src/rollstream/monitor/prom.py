"""Prometheus exposition of the metrics registry.

Gauges are named ``rollstream_<kind>_<name>``; a name with a ``/<source>`` suffix
(``len_mean/math``) becomes the label ``source="math"`` on ``rollstream_<kind>_len_mean``.
A Prometheus family has one label set, so should one name be used both with and without a
suffix, whichever comes second adapts: a later suffixed form gets a flattened name
(``rollstream_<kind>_len_mean_math``), a later plain form the label ``source=""``.
Histograms from ``observe`` are ``rollstream_<name>`` with the same label rule. Ledger lines
count into ``rollstream_ledger_samples_total{status, source}``, read from the registry's
ledger view at scrape time (so lines written by the data ledger count too). Each exporter
has its own ``CollectorRegistry`` so several registries (tests, sims) never collide.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, Metric

from rollstream.monitor.histogram import edges_for

_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def prom_name(*parts: str) -> str:
    """Join parts into a valid Prometheus metric name."""
    name = _INVALID.sub("_", "_".join(p for p in parts if p))
    return name if not name[0].isdigit() else f"_{name}"


LedgerCounts = Callable[[], dict[tuple[str, str], int]]


class _LedgerCollector:
    """Exposes ledger counts, computed when scraped."""

    def __init__(self, counts: LedgerCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("rollstream_ledger_samples",
                                     "Samples that reached a terminal status",
                                     labels=["status", "source"])
        for (status, source), n in sorted(self._counts().items()):
            family.add_metric([status, source], n)
        yield family


class PromExporter:
    """Owns one CollectorRegistry; optionally serves it on 127.0.0.1."""

    def __init__(self, ledger_counts: LedgerCounts) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauges: dict[str, Gauge] = {}
        self._hists: dict[str, Histogram] = {}
        self._labelled: dict[str, bool] = {}  # family name -> declared with a source label
        self._step = Gauge(
            "rollstream_step", "Last step recorded per kind", ["kind"], registry=self.registry
        )
        self.registry.register(_LedgerCollector(ledger_counts))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _family(self, base: str, name: str) -> tuple[str, str | None]:
        """(family name, source label or None) for a metric name, fixing label conflicts."""
        stem, _, source = name.partition("/")
        family = prom_name(base, stem)
        want_label = bool(source)
        declared = self._labelled.setdefault(family, want_label)
        if declared == want_label:
            return family, source or None
        if declared:  # plain name into a labelled family: an empty label means "no source"
            return family, ""
        return prom_name(base, name), None

    def set_gauges(self, kind: str, step: int, values: dict[str, float | None]) -> None:
        with self._lock:
            self._step.labels(kind=kind).set(step)
            for name, value in values.items():
                family, source = self._family(f"rollstream_{kind}", name)
                gauge = self._gauges.get(family)
                if gauge is None:
                    labels = ["source"] if source is not None else []
                    gauge = Gauge(family, f"{kind} metric {name.split('/')[0]}", labels,
                                  registry=self.registry)
                    self._gauges[family] = gauge
                target = gauge.labels(source=source) if source is not None else gauge
                target.set(math.nan if value is None else value)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            family, source = self._family("rollstream", name)
            hist = self._hists.get(family)
            if hist is None:
                labels = ["source"] if source is not None else []
                hist = Histogram(family, f"distribution of {name.split('/')[0]}", labels,
                                 buckets=edges_for(name), registry=self.registry)
                self._hists[family] = hist
            (hist.labels(source=source) if source is not None else hist).observe(value)

    def text(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def serve(self, port: int) -> int:
        """Serve /metrics on 127.0.0.1:port (0 = a free port); returns the bound port."""
        assert self._server is None, "already serving"
        self._server, self._thread = start_http_server(port, addr="127.0.0.1",
                                                       registry=self.registry)
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=5)
            self._server = self._thread = None
