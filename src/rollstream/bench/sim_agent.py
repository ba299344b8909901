"""Benchmark: the simulator's replay of real agent runs (multi-turn episodes with a tool).

    rollstream bench sim_agent [--json OUT] [--quick]

Two short real runs of ``examples/agent.yaml`` (tally: numbers dealt one per turn, added with
a calculator call), shrunk by :data:`SMALL` to the tiny run's model and cheap warm start
(``bench/tiny_run.py``; it writes the call format but adds badly, so every reward is 0 and
zero-variance filtering is off), 4-item tasks, at most 6 model turns of 16 tokens,
``engine.local.fuse_prefill=false`` (the simulated engine prefills in passes of their own):
one ``sync``, one with the example's own rollout (async). Then, as ``bench sim``'s
calibration (:func:`rollstream.bench.sim.calibration`): CPU profiles fitted from each run,
from both and from the other, and each run simulated by its replay, every episode with its
recorded turns, tool answers and tool waits (``sim/replay.py``), beside what it measured:
mean step time and engine utilization. And per run, where an episode's time went per model
turn (``turn_costs``): the model turn, the tool, and the harness's own time, which no profile
holds. Last, each run on its profile with the prefill cost replaced by the run's mean seconds
per prefilled token (``prefill_at_mean``): an episode re-prefills its whole context at every
model turn, so prefill is most of the engine's time here, and the per-pass fit (weighted by
pass count) misses its total (docs/simulator.md, "Replay of agent runs"). A benchmark
measures; it does not assert.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.bench.sim import (
    ROOT,
    Sizes,
    calibration,
    calibration_table,
    machine,
    predict,
    real_runs,
    write_json,
)
from rollstream.sim.calibrate import RunRecord, profile_yaml, turn_costs
from rollstream.sim.profile import PrefillCost, load_profile

AGENT_YAML = ROOT / "examples" / "agent.yaml"
SMALL = [  # the tiny run's model and warm start (bench/tiny_run.py), the agent kill test's task
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=192",
    "model.tiny.max_position=256", "model.warm_start.steps=200", "model.warm_start.lr=5e-3",
    "model.warm_start.tokens_per_step=2048", "tasks.sources=[{kind: tally, max_items: 4}]",
    "agent.max_turns=6", "agent.max_turn_tokens=16", "engine.local.max_slots=32",
    "engine.local.max_seq_len=256", "sampling.max_new_tokens=224",
    "rollout.filter_zero_variance=false", "train.lr=3e-4",
]
FULL = Sizes(steps=8, groups_per_step=6, num_eval=4, sim_steps=None, sim_scale=1)
QUICK = Sizes(steps=2, groups_per_step=2, num_eval=2, sim_steps=None, sim_scale=1)


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-sim-agent-"))
    load_before, t0 = os.getloadavg(), time.perf_counter()
    records = real_runs(sizes, run_root, [*SMALL, *overrides], config=AGENT_YAML)
    calib = calibration(records, run_root)
    result = {
        "date": datetime.date.today().isoformat(), "quick": quick,
        "steps": sizes.steps, "groups_per_step": sizes.groups_per_step,
        "calibration_error_step_time": {k: r["error_step_time"]
                                        for k, r in calib["rows"].items()},
        "calibration_error_utilization": {k: r["error_utilization"]
                                          for k, r in calib["rows"].items()},
        "turn_costs": {k: turn_costs(r) for k, r in records.items()},
        "prefill_at_mean": {k: prefill_at_mean(r, run_root / f"cpu_fitted_{k}.yaml")
                            for k, r in records.items()},
        "calibration": calib, **machine(load_before, t0, run_root),
    }
    print_tables(result)
    write_json(result, json_out)
    return result


def prefill_at_mean(record: RunRecord, fitted: Path) -> dict[str, Any]:
    """``record``'s run predicted on the profile ``fitted`` from it, its prefill cost replaced
    by the run's own seconds per prefilled token (its prefill passes outside trainer steps,
    summed: no overhead), which matches their total."""
    passes = [p for p in record.passes if p["kind"] == "prefill" and not p.get("trainer")]
    per_token_s = sum(p["seconds"] for p in passes) / sum(p["tokens"] for p in passes)
    profile = load_profile(str(fitted)).model_copy(
        update={"prefill": PrefillCost(overhead_s=0.0, per_token_s=per_token_s)})
    path = fitted.with_name(fitted.stem + "_prefill_at_mean.yaml")
    path.write_text(profile_yaml(profile))
    return {"per_token_s": per_token_s, **predict(record, path)}


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    console.print(calibration_table(result["calibration"]))
    t = Table(title="per model turn: seconds of the model turn, the tool, the harness itself")
    for col in ("run", "model turns", "model s", "tool s", "harness s", "harness share"):
        t.add_column(col, justify="right")
    for k, c in result["turn_costs"].items():
        t.add_row(k, str(c["model_turns"]), f"{c['model_s_per_turn']:.4f}",
                  f"{c['tool_s_per_turn']:.6f}", f"{c['harness_s_per_turn']:.4f}",
                  f"{c['harness_share']:.1%}")
    console.print(t)
    t = Table(title="each run on its profile with the prefill at its mean seconds per token")
    for col in ("run", "prefill us/token", "step s real", "step s sim", "error", "util real",
                "util sim", "error"):
        t.add_column(col, justify="right")
    for k, r in result["prefill_at_mean"].items():
        m, s = r["measured"], r["simulated"]
        t.add_row(k, f"{r['per_token_s'] * 1e6:.1f}", f"{m['step_s_mean']:.3f}",
                  f"{s['step_s_mean']:.3f}", f"{r['error_step_time']:.1%}",
                  f"{m['engine_utilization']:.3f}", f"{s['engine_utilization']:.3f}",
                  f"{r['error_utilization']:.1%}")
    console.print(t)
    console.print(f"load average before {result['load_avg_before'][0]:.1f}, after "
                  f"{result['load_avg_after'][0]:.1f}")
