"""Benchmark: resident memory over a long run.

    rollstream bench soak [--json OUT] [--minutes M] [--quick]

A real run (``rollstream train`` as a subprocess: ``bench/tiny_run.py``'s, a durable
checkpoint every 50 steps,
no step limit, liveness stops off: the task saturates and most groups end filtered, which
makes many ledger lines) for ``--minutes`` (default 20; ``--quick``: 2) of training, stopped by its
``max_wall_s``. The resident set size (``VmRSS``) of the run's process and of its reward
workers is sampled every 10 s (``--quick``: 2 s). Keys: ``rss_slope_mb_per_hour`` (least
squares over the samples after the first 2 minutes, ``--quick``: 30 s; target <= 10),
``rss_max_mb``, ``rss_start_mb`` / ``rss_end_mb`` (first and last sample after the warm-up),
``workers_rss_max_mb``, ``trained_samples`` and ``ledger_lines`` (what the run did), and the
samples themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.bench import sampling
from rollstream.bench.tiny_run import tiny_run_config
from rollstream.config import load_config
from rollstream.models.warmstart import prepare_model
from rollstream.run_files import RunFiles


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per hour."""
    n = len(points)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var if var else float("nan")


def main(json_out: Path | None = None, quick: bool = False, *, minutes: float | None = None,
         cache_dir: Path | None = None) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (2.0 if quick else 20.0)
    every_s, warmup_s = (2.0, 30.0) if quick else (10.0, 120.0)
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        root = Path(tmp)
        # the task saturates (every group all-correct, filtered) long before the end: a soak
        # must keep going, so liveness never stops it
        cfg = tiny_run_config("soak", root / "runs", steps=1_000_000, checkpoint_every=50,
                              cache_dir=cache_dir, max_wall_s=minutes * 60,
                              rollout={"min_trainable_share": 0.0,
                                       "max_untrainable_streak": 1_000_000})
        path = root / "soak.yaml"  # the bench's input, beside the run folders
        path.write_text(json.dumps(cfg))
        loaded = load_config(path, [])
        prepare_model(loaded.model, loaded.tasks)
        proc = sampling.start_train(path, subprocess.DEVNULL)
        t0, samples, workers_max = time.perf_counter(), [], 0.0
        while proc.poll() is None:
            rss = _rss_mb(proc.pid)
            if rss is not None:
                samples.append((round(time.perf_counter() - t0, 1), round(rss, 1)))
                workers = [r for c in _children(proc.pid) if (r := _rss_mb(c)) is not None]
                workers_max = max(workers_max, sum(workers))
            time.sleep(every_s)
        run_dir = Path(loaded.run_root) / loaded.name
        files = RunFiles(run_dir)
        summary = json.loads(files.summary.read_text()) if files.summary.exists() else {}
        ledger = files.ledger
        ledger_lines = len(ledger.read_text().splitlines()) if ledger.exists() else 0
    after = [(t, v) for t, v in samples if t >= warmup_s]
    result = {
        "benchmark": "soak", "quick": quick, "minutes": minutes,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg": os.getloadavg(), "exit_code": proc.returncode,
        "rss_slope_mb_per_hour": slope_per_hour(after),
        "rss_max_mb": max((v for _, v in samples), default=None),
        "rss_start_mb": after[0][1] if after else None,
        "rss_end_mb": after[-1][1] if after else None,
        "workers_rss_max_mb": round(workers_max, 1),
        "trained_samples": summary.get("trained_samples"), "steps": summary.get("steps"),
        "ledger_lines": ledger_lines, "warmup_s": warmup_s, "every_s": every_s,
        "samples": samples,
    }
    print(f"bench soak: {minutes:g} min, {result['steps']} steps, {ledger_lines} ledger lines; "
          f"RSS {result['rss_start_mb']} -> {result['rss_end_mb']} MB after the warm-up, max "
          f"{result['rss_max_mb']} MB, slope {result['rss_slope_mb_per_hour']:.1f} MB/h "
          f"(target <= 10); reward workers {workers_max:.0f} MB", flush=True)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result
