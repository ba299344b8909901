"""The run folder's file names, in one place (docs/run-dir.md describes each file).

Every module that writes or reads a run folder takes its paths from :class:`RunFiles`, so a
file is renamed, added or documented here and nowhere else. Imports nothing of rollstream:
the trainer, the monitor, the durable layer, the simulator and the benchmarks all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
LEDGER = "ledger.jsonl"
REPLAYS = "replays.jsonl"  # replay events, beside the ledger
METRICS = "metrics.jsonl"
TIMELINE = "timeline.jsonl"
RECONFIG = "reconfig.jsonl"
SUMMARY = "summary.json"
ENGINE_PASSES = "engine_passes.jsonl"
REPORT = "report.html"
DASHBOARD_URL = "dashboard.url"
DASHBOARD_TOKEN = "dashboard.token"
FINAL_CHECKPOINT = "checkpoint"  # the final weights, a Hugging Face folder
CHECKPOINTS = "checkpoints"  # durable checkpoints, one step_NNNNNN folder each
RAY_LOGS = "ray-logs"
VLLM_LOGS = "vllm-logs"
# the streams a resume reconciles: what the lost process wrote after its checkpoint moves to
# <stream>.superseded.jsonl (durable/resume.py)
SUPERSEDED_STREAMS = ("ledger", "replays", "metrics", "timeline")
# a folder holding any of these is a run folder (``rollstream report``, the dashboard)
RUN_MARKERS = (CONFIG, METRICS, LEDGER, TIMELINE, SUMMARY)


@dataclass(slots=True, frozen=True)
class RunFiles:
    """The paths of one run folder's files."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def replays(self) -> Path:
        return self.root / REPLAYS

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def timeline(self) -> Path:
        return self.root / TIMELINE

    @property
    def reconfig(self) -> Path:
        return self.root / RECONFIG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def engine_passes(self) -> Path:
        return self.root / ENGINE_PASSES

    @property
    def report(self) -> Path:
        return self.root / REPORT

    @property
    def dashboard_url(self) -> Path:
        return self.root / DASHBOARD_URL

    @property
    def dashboard_token(self) -> Path:
        return self.root / DASHBOARD_TOKEN

    @property
    def final_checkpoint(self) -> Path:
        return self.root / FINAL_CHECKPOINT

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def ray_logs(self) -> Path:
        return self.root / RAY_LOGS

    @property
    def vllm_logs(self) -> Path:
        return self.root / VLLM_LOGS

    def stream(self, name: str) -> Path:
        """A JSONL stream by its stem (``metrics``, ``timeline``, ``ledger``, ``replays``)."""
        if name not in SUPERSEDED_STREAMS:
            raise ValueError(f"no stream {name!r}; one of {', '.join(SUPERSEDED_STREAMS)}")
        return self.root / f"{name}.jsonl"

    def superseded(self, name: str) -> Path:
        """Where a resume moves the lines of stream ``name`` (a stem) past its checkpoint."""
        return self.stream(name).with_name(f"{name}.superseded.jsonl")

    def fresh_run_leftovers(self) -> tuple[Path, ...]:
        """The files a fresh run of this name removes (a previous run's records); its
        checkpoints folder goes too (:attr:`checkpoints`)."""
        return (*(self.stream(s) for s in SUPERSEDED_STREAMS),
                *(self.superseded(s) for s in SUPERSEDED_STREAMS),
                self.engine_passes, self.summary, self.reconfig)
