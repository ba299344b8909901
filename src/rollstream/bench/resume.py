"""Benchmark: a run killed with SIGKILL at random moments and resumed each time.

    rollstream bench resume [--json OUT] [--quick]

The run: ``bench/tiny_run.py``'s (the e2e test's tiny model on tick, async k=2 with partial
rollout, 4 groups x 8 samples per step) with a durable checkpoint every 2 steps, 20 steps
(``--quick``: 8 steps, 2 kills). It runs as ``rollstream train`` subprocesses; after
each new checkpoint the bench waits a random 0-2 s (seeded; the seed is in the JSON) and
sends SIGKILL, five times, then resumes once more to the end. The run directory is then
audited (:func:`rollstream.durable.audit.audit_run`).

Keys: ``lost_samples`` and ``duplicated_samples`` (target 0 and 0), ``steps_repeated``
(target 0: no step's result counts twice), ``steps_redone`` (steps trained after a checkpoint
by a process that was then killed, trained again: at most ``checkpoint_every - 1`` per
kill), ``resumed_partial_tokens`` (tokens partial samples continued from after a restart;
> 0), ``checkpoint_s`` (median time generation was held for a checkpoint, over every
checkpoint of every process) and ``checkpoint_total_s`` (median whole checkpoint),
``resume_s`` (median, from starting the resumed process to its first engine span in
``timeline.jsonl``: the first tokens it generated were delivered), ``kills``.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.bench import sampling
from rollstream.bench.tiny_run import EVAL_SAMPLES, GROUP, GROUPS, tiny_run_config
from rollstream.config import load_config
from rollstream.durable import checkpoint as durable
from rollstream.durable.audit import audit_run
from rollstream.models.warmstart import prepare_model
from rollstream.run_files import RunFiles


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


class _FirstSpan:
    """When a started process's first engine span lands in ``timeline.jsonl``: the first time
    the file holds more lines than the fewest seen since the start (a resumed run first cuts
    the file back to its checkpoint, so the count before the start is no baseline)."""

    def __init__(self, path: Path) -> None:
        self.path, self.t0 = path, time.perf_counter()
        self.fewest, self.seconds = _lines(path), None

    def poll(self) -> None:
        if self.seconds is None:
            n = _lines(self.path)
            if n > self.fewest:
                self.seconds = time.perf_counter() - self.t0
            self.fewest = min(self.fewest, n)


def main(json_out: Path | None = None, quick: bool = False, *,
         cache_dir: Path | None = None) -> dict[str, Any]:
    """``cache_dir``: the warm-started model's cache (default: the config's, as other benches)."""
    steps, num_kills = (8, 2) if quick else (20, 5)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        root = Path(tmp)
        cfg_path = root / "resume.yaml"  # the bench's input, beside the run folders
        cfg_path.write_text(json.dumps(tiny_run_config(
            "resume", root / "runs", steps=steps, checkpoint_every=2, cache_dir=cache_dir)))
        cfg = load_config(cfg_path, [])
        prepare_model(cfg.model, cfg.tasks)  # the warm start, before any clock
        run_dir = cfg.run_dir
        kills, resume_s, seen, t_bench = [], [], -1, time.perf_counter()
        while len(kills) < num_kills:
            first_span = _FirstSpan(RunFiles(run_dir).timeline)
            proc = sampling.start_train(cfg_path, subprocess.DEVNULL, resume=seen >= 0)
            while proc.poll() is None:
                first_span.poll()
                ckpt = durable.latest(run_dir)
                if ckpt is not None and ckpt.step > seen:
                    break
                time.sleep(0.02)
            if seen >= 0 and first_span.seconds is not None:
                resume_s.append(first_span.seconds)
            if proc.poll() is not None:
                break  # it finished before a kill
            seen = durable.latest(run_dir).step
            delay = rng.uniform(0.0, 2.0)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills.append({"after_checkpoint": seen, "delay_s": round(delay, 3)})
            print(f"bench resume: killed {delay:.2f} s after checkpoint {seen}", flush=True)
        first_span = _FirstSpan(RunFiles(run_dir).timeline)
        with (root / "final.log").open("w") as log:
            proc = sampling.start_train(cfg_path, log, resume=True)
            while proc.poll() is None:
                first_span.poll()
                time.sleep(0.02)
        if first_span.seconds is not None:
            resume_s.append(first_span.seconds)
        tail = (root / "final.log").read_text(errors="replace")[-2000:]
        audit = audit_run(run_dir, group_size=GROUP, eval_group_size=EVAL_SAMPLES, groups_per_step=GROUPS,
                          steps=steps)
        phases = [json.loads(line) for line in RunFiles(run_dir).metrics.read_text().splitlines()
                  if "checkpoint_hold_s" in line]
        summary_path = RunFiles(run_dir).summary
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result = {
        "benchmark": "resume", "quick": quick,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg": os.getloadavg(), "seed": seed, "steps": steps, "kills": kills,
        "final_exit_code": proc.returncode, "final_output_tail": tail if proc.returncode else "",
        "steps_done": summary.get("steps"), **audit,
        "checkpoint_s": statistics.median(p["checkpoint_hold_s"] for p in phases) if phases else None,
        "checkpoint_s_max": max((p["checkpoint_hold_s"] for p in phases), default=None),
        "checkpoint_total_s": (statistics.median(p["checkpoint_s"] for p in phases)
                               if phases else None),
        "num_checkpoints": len(phases),
        "resume_s": statistics.median(resume_s) if resume_s else None,
        "resume_s_all": [round(x, 2) for x in resume_s],
        "bench_s": time.perf_counter() - t_bench,
    }
    _print(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rollstream resume after {len(r['kills'])} SIGKILLs ({r['steps']} steps,"
                        f" seed {r['seed']})")
    for col in ("key", "value", "target"):
        table.add_column(col)
    targets = {"lost_samples": "0", "duplicated_samples": "0", "steps_repeated": "0",
               "resumed_partial_tokens": "> 0"}
    for key in ("steps_done", "samples", "lost_samples", "duplicated_samples", "steps_repeated",
                "steps_missing", "steps_redone", "superseded_lines", "resumed_partial_samples",
                "resumed_partial_tokens", "checkpoint_s", "checkpoint_s_max",
                "checkpoint_total_s", "num_checkpoints", "resume_s"):
        v = r[key]
        table.add_row(key, f"{v:.3f}" if isinstance(v, float) else str(v), targets.get(key, ""))
    Console().print(table)
