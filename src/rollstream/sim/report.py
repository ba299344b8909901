"""``rollstream sim SCENARIO.yaml``: every mode of a scenario, a comparison table, a JSON file,
and with ``--out DIR`` plots and an HTML page (``sim/outputs.py``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rollstream.sim.profile import load_profile
from rollstream.sim.run import simulate_mode
from rollstream.sim.scenario import Scenario, load_scenario

log = logging.getLogger(__name__)


def run_scenario(sc: Scenario, *, progress: bool = False) -> dict[str, Any]:
    """Simulate each mode in order; the result as JSON-ready data. Ratios are to the first
    mode (``vs_first``: its trained tokens/s over the first mode's)."""
    profile = load_profile(sc.profile)
    t0 = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for mode in sc.modes:
        rows[mode.name] = simulate_mode(sc, mode, profile)
        if progress:
            log.info(f"  {mode.name}: {rows[mode.name]['wall_s']:.1f} s")
    base = next(iter(rows.values()))["trained_tok_s"]
    for r in rows.values():
        r["vs_first"] = r["trained_tok_s"] / base if base > 0 else None
    return {"scenario": sc.model_dump(mode="json"), "profile": profile.model_dump(mode="json"),
            "rows": rows, "wall_s": time.perf_counter() - t0}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sc = result["scenario"]
    console = Console(width=None if sys.stdout.isatty() else 180)
    t = Table(title=f"rollstream sim {sc['name']}: {sc['engines']} engines, profile "
              f"{result['profile']['name']}, {sc['steps']} steps x {sc['groups_per_step']} "
              f"groups x {sc['group_size']} (simulated; wall {result['wall_s']:.1f} s)")
    cols = ("mode", "step s", "engine util", "tail share", "trained tok/s", "vs first",
            "gen tok/s", "stale 0/1/2/3+ (share)", "dropped", "filtered", "interrupts", "wall s")
    for col in cols:
        t.add_column(col, justify="right")
    for name, r in result["rows"].items():
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        n = max(sum(hist.values()), 1)
        shares = [hist.get(k, 0) / n for k in (0, 1, 2)]
        shares.append(sum(v for k, v in hist.items() if k >= 3) / n)
        stale = " ".join(f"{x:.2f}" for x in shares)
        tail = r["tail_share_mean"]
        t.add_row(name, f"{r['step_s_mean']:,.1f}", f"{r['engine_utilization']:.2f}",
                  "-" if tail is None else f"{tail:.2f}", f"{r['trained_tok_s']:,.0f}",
                  "-" if r["vs_first"] is None else f"{r['vs_first']:.2f}",
                  f"{r['gen_tok_s']:,.0f}", stale,
                  str(r["statuses"].get("dropped_stale", 0)),
                  str(r["statuses"].get("filtered", 0)), str(r["interrupts"]),
                  f"{r['wall_s']:.1f}")
    console.print(t)
    drift = sc["workload"]["length_drift_per_step"]
    for name, r in result["rows"].items():
        if drift:
            key, what = (("turn_tokens_by_step", "model tokens per turn of trained episodes")
                         if "turn_tokens_by_step" in r else
                         ("response_tokens_by_step", "mean response tokens of trained samples"))
            console.print(f"{name}: {what} by step (drift {drift:+g} per step): "
                          + " ".join(f"{float(v):,.0f}" for v in r[key].values()))
        if "turns_mean" in r:
            share, turns = r["tool_time_share"], r["turns_mean"]
            console.print(f"{name}: model turns per trained episode "
                          f"{'-' if turns is None else f'{turns:.2f}'}, tool calls "
                          f"{r['tool_calls']:,} ({r['tool_timeouts']:,} timed out), mean tool "
                          f"s {r['tool_s_mean'] or 0:.2f}, tool time share of episodes "
                          f"{'-' if share is None else f'{share:.2f}'}")
        if r["stop_reason"]:
            console.print(f"{name} stopped early: {r['stop_reason']}")


def main(scenario: Path, *, json_out: Path | None = None,
         out_dir: Path | None = None) -> dict[str, Any]:
    result = run_scenario(load_scenario(scenario), progress=True)
    print_table(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
        log.info(f"wrote {json_out}")
    if out_dir is not None:
        from rollstream.sim.outputs import NO_PLOTS, have_matplotlib, write_scenario_outputs

        log.info(f"wrote {write_scenario_outputs(result, out_dir)}"
                 + ("" if have_matplotlib() else f" ({NO_PLOTS})"))
    return result
