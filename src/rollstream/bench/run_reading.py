"""What a benchmark run left in its folder, read into numbers: where its generated tokens
went (the ledger), its metrics lines, and the standard error of its held-out reward."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from rollstream.data.ledger_row import LedgerRow
from rollstream.run_files import RunFiles
from rollstream.trajectory import SampleStatus, eval_group_id, is_eval_uid


def token_breakdown(ledger: list[LedgerRow]) -> dict[str, int]:
    """Where a run's generated response tokens (evaluations excluded) went: ``kept`` by the
    loss, ``masked`` (tokens of trained samples the loss left out: too old, truncated
    support), and the tokens of samples ``dropped_stale``, ``filtered``, ``aborted`` or
    ``failed``. The parts sum to ``generated``."""
    out = dict.fromkeys(("generated", "kept", "masked", "dropped_stale", "filtered", "aborted",
                         "failed"), 0)
    for r in ledger:
        if is_eval_uid(r.sample_uid):
            continue
        n = r.num_tokens
        out["generated"] += n
        if r.status is SampleStatus.TRAINED:
            kept = r.num_trained_tokens or 0
            out["kept"] += kept
            out["masked"] += n - kept
        elif r.status.value in out:
            out[r.status.value] += n
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = RunFiles(run_dir).metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def reward_se(ledger: list[LedgerRow], *, round_index: int) -> float:
    """Standard error of the eval reward over prompts (samples of one prompt are correlated,
    so the prompt is the unit)."""
    tag = eval_group_id("", round_index) + "/"
    by_task: dict[str, list[float]] = {}
    for r in ledger:
        if is_eval_uid(r.sample_uid) and tag in r.sample_uid:
            by_task.setdefault(r.task_uid, []).append(float(r.reward or 0.0))
    means = [statistics.fmean(v) for v in by_task.values()]
    return statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else math.nan
