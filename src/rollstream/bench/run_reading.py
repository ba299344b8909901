"""What a benchmark run left in its folder, read into numbers: where its generated tokens
went (the ledger), its metrics lines, and the standard error of its held-out reward."""

from __future__ import annotations

import json
import math
import os
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


def row_numbers(run_dir: Path, collected: dict[str, Any]) -> dict[str, Any]:
    """One finished run's numbers: ``collected`` (bench/sampling.py's) and, from its metrics,
    summary and ledger, samples/s, the steps' wait and train time, the engines' busy share
    and the control plane's calls and bytes (Ray rows)."""
    from rollstream.data.ledger import read_ledger
    from rollstream.runtime.ray.wire import METER_KEYS

    summary = json.loads(RunFiles(run_dir).summary.read_text())
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "train"]
    wait_s, train_s = (sum(m[k] for m in steps) for k in ("wait_s", "train_s"))
    trained = summary["trained_samples"]
    generated = sum(1 for r in read_ledger(RunFiles(run_dir).ledger)
                    if not is_eval_uid(r.sample_uid))
    engines = summary["engines"].values()
    busy_s = sum(e["busy_s"] for e in engines)
    wire = {k: sum(e.get(k, 0.0) for e in engines) for k in METER_KEYS}
    wire_bytes = wire["wire_sent_bytes"] + wire["wire_received_bytes"]
    data_bytes = wire["data_sent_bytes"] + wire["data_received_bytes"]
    return {
        "samples_per_s": trained / (wait_s + train_s),
        "samples_per_s_wall": trained / summary["train_wall_s"],
        "train_wall_s": summary["train_wall_s"], "wall_s": summary["wall_s"],
        "steps": summary["steps"], "trained_samples": trained, "generated_samples": generated,
        "wait_s_mean": wait_s / len(steps), "train_s_mean": train_s / len(steps),
        "wait_share": wait_s / (wait_s + train_s),
        "gen_tok_s": collected["gen_tokens"] / summary["train_wall_s"],
        # one engine in every row: its forward passes' share of the training time
        "engine_busy_share": busy_s / summary["train_wall_s"],
        "engine_busy_in_train": statistics.fmean(m["engine_busy_in_train"] for m in steps),
        # tokens per second of forward passes: how fast the engine ran while it ran (its core
        # shared with another thread or process makes it slower)
        "engine_tok_per_busy_s": collected["gen_tokens"] / busy_s,
        "reward_initial": collected["reward_initial"],
        "reward_final": collected["reward_final"],
        "reward_final_se": collected["reward_final_se"],
        "dropped_stale": collected["dropped_stale"], "filtered": collected["filtered"],
        "aborted": collected["aborted"], "failed": collected["failed"],
        **wire, "wire_bytes": wire_bytes, "data_bytes": data_bytes,
        "control_plane_bytes_per_trained_sample": wire_bytes / trained,
        "control_plane_bytes_per_generated_sample": wire_bytes / generated,
        "data_plane_bytes_per_trained_sample": data_bytes / trained,
        "data_plane_bytes_per_generated_sample": data_bytes / generated,
        "load_after": os.getloadavg()[0],
    }
