"""Benchmark: the simulator, calibrated against real runs on this machine, and its speed.

    rollstream bench sim [--json OUT] [--quick]

1. **Calibration.** Two short real runs of ``examples/tick.yaml`` (the demo's model, task and
   settings; ``engine.local.fuse_prefill=false``: the simulated engine prefills in passes of
   their own) on the embedded engine, one ``sync`` and one with the example's own rollout
   (async, k = 2, partial rollout). CPU profiles are fitted from the runs' recordings
   (``rollstream.sim.calibrate``: forward passes, trainer steps, weight loads), then each run
   is simulated replaying its own ledger (its groups' lengths and answers) on the profile
   fitted from that run. Keys: ``calibration_error_step_time`` and
   ``calibration_error_utilization`` per mode, the relative error |simulated - measured| /
   measured of the mean step time and of the engine utilization (busy share); the same on
   the profile fitted from both runs, contention terms included
   (``calibration_joint_error_step_time``, ``calibration_joint_error_utilization``; details
   in ``calibration.joint``) and from the other run (``calibration.cross``), and the fitted
   profiles.
2. **Speed.** ``examples/sim/kimi_k2_512.yaml`` (512 engines, Kimi-K2-like workload, 10
   steps): wall seconds per mode; ``sim_wall_s_512_engines`` is the slowest mode's.
3. **Cost curve.** The same scenario's sync mode for 3 steps at a few sizes (``CURVE``):
   CPU seconds per sample as engines and requests grow (``speed_curve``).
4. **GPU async gain.** ``examples/sim/seer_moonlight_64.yaml``'s workload and profile at 256
   engines (256 groups of 8 per step, 64 trainer GPUs): ``gpu_async_partial_vs_sync``, async
   k = 2 with partial rollout's trained tokens/s over sync's.

``--quick`` (the smoke test): a tiny model, 3 steps of 4 groups, and the speed and GPU cases
at an eighth of their engines and groups for 2 simulated steps (the JSON says which). A
benchmark measures; it does not assert. The machine is shared: the JSON records the load
average before and after, and the simulations' CPU seconds beside their wall seconds.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.config.staleness import StalenessConfig
from rollstream.sim.calibrate import (
    RunRecord,
    fit_profile,
    measured,
    profile_yaml,
    replay_scenario,
)
from rollstream.sim.profile import load_profile
from rollstream.sim.report import run_scenario
from rollstream.sim.run import simulate_mode
from rollstream.sim.scenario import ModeConfig, load_scenario

ROOT = Path(__file__).resolve().parents[3]
CALIB_YAML = ROOT / "examples" / "tick.yaml"
KIMI_512 = ROOT / "examples" / "sim" / "kimi_k2_512.yaml"
SEER_64 = ROOT / "examples" / "sim" / "seer_moonlight_64.yaml"
# the rows of the calibration: sync, and the example's own rollout settings
CALIB_MODES = {"sync": ["rollout.mode=sync"], "async": []}


@dataclass(frozen=True)
class Sizes:
    steps: int  # real training steps per calibration run
    groups_per_step: int | None  # None: the example's
    num_eval: int
    sim_steps: int | None  # simulated steps of the speed and GPU cases (None: the scenario's)
    sim_scale: int  # engines and groups of the speed and GPU cases divided by this


FULL = Sizes(steps=12, groups_per_step=None, num_eval=8, sim_steps=None, sim_scale=1)
QUICK = Sizes(steps=3, groups_per_step=4, num_eval=4, sim_steps=2, sim_scale=8)


def real_runs(sizes: Sizes, run_root: Path, overrides: Sequence[str],
              config: Path = CALIB_YAML) -> dict[str, RunRecord]:
    """The calibration runs of ``config``, in process, one after the other."""
    import torch

    from rollstream.bench.modes import bench_overrides, row_config
    from rollstream.config import load_config
    from rollstream.models.warmstart import prepare_model
    from rollstream.runtime.train import run_training

    torch.set_num_threads(1)  # a warm start not cached yet runs here (see bench modes)
    base = load_config(config, list(overrides))
    folder = prepare_model(base.model, base.tasks)
    common = [*overrides, *bench_overrides(folder, run_root), f"train.steps={sizes.steps}",
              f"tasks.num_eval={sizes.num_eval}", "eval.samples_per_task=1",
              "engine.local.fuse_prefill=false"]
    if sizes.groups_per_step is not None:
        common.append(f"train.groups_per_step={sizes.groups_per_step}")
    out = {}
    for label, row in CALIB_MODES.items():
        print(f"bench sim: real run {label} ...", flush=True)
        cfg = row_config(config, common, [*row, f"name=calib-{label}"])
        run_training(cfg)
        out[label] = RunRecord(run_root / cfg.name)
    return out


def predict(rec: RunRecord, profile_path: Path) -> dict[str, Any]:
    """``rec``'s run simulated on a profile, beside what it measured."""
    real = measured(rec)
    sim = next(iter(run_scenario(replay_scenario(rec, str(profile_path)))["rows"].values()))
    return {
        "measured": real,
        "simulated": {k: sim[k] for k in ("step_s_mean", "engine_utilization",
                                          "tail_share_mean", "trained_tok_s", "statuses",
                                          "interrupts", "wall_s")},
        "error_step_time": abs(sim["step_s_mean"] - real["step_s_mean"]) / real["step_s_mean"],
        "error_utilization": abs(sim["engine_utilization"] - real["engine_utilization"])
        / real["engine_utilization"],
        "real_statuses": rec.summary["ledger"],
        "real_interrupts": rec.summary["interrupts"],
    }


def without_overlap(rec: RunRecord) -> RunRecord:
    """``rec`` as if its recording did not say what overlapped a trainer step (no pass
    flagged, no busy share): what the fit had before its contention terms."""
    out = copy.copy(rec)
    out.passes = [{**p, "trainer": 0} for p in rec.passes]
    out.metrics = [{k: v for k, v in m.items() if k != "engine_busy_in_train"}
                   for m in rec.metrics]
    return out


def calibration(records: dict[str, RunRecord], out_dir: Path) -> dict[str, Any]:
    """Each run predicted on the profile fitted from it (the headline: ``rows``), on the one
    fitted from both runs (``joint``, with its contention terms), on the same without the
    overlap in the recording (``joint_no_contention``: what the terms buy), and on the other
    run's (``cross``: what one run alone cannot tell about the other)."""
    profiles: dict[str, Any] = {}
    paths: dict[str, Path] = {}
    for label, recs in [*((k, [r]) for k, r in records.items()),
                        ("joint", list(records.values())),
                        ("joint_no_contention", [without_overlap(r) for r in records.values()])]:
        profile = fit_profile(recs)
        paths[label] = out_dir / f"cpu_fitted_{label}.yaml"
        paths[label].write_text(profile_yaml(profile))
        profiles[label] = profile.model_dump(mode="json")
    labels = list(records)
    return {
        "profiles": profiles,
        "rows": {k: predict(r, paths[k]) for k, r in records.items()},
        "joint": {k: predict(r, paths["joint"]) for k, r in records.items()},
        "joint_no_contention": {k: predict(r, paths["joint_no_contention"])
                                for k, r in records.items()},
        "cross": {k: predict(r, paths[labels[1 - i]]) | {"profile_of": labels[1 - i]}
                  for i, (k, r) in enumerate(records.items())},
    }


def speed_512(sizes: Sizes) -> dict[str, Any]:
    sc = load_scenario(KIMI_512)
    sc = sc.model_validate({**sc.model_dump(), "steps": sizes.sim_steps or sc.steps,
                            "engines": sc.engines // sizes.sim_scale,
                            "groups_per_step": sc.groups_per_step // sizes.sim_scale})
    print(f"bench sim: {sc.name}, {sc.steps} steps ...", flush=True)
    res = run_scenario(sc, progress=True)
    return {"steps": sc.steps, "engines": sc.engines,
            "wall_s": {k: r["wall_s"] for k, r in res["rows"].items()},
            "cpu_s": {k: r["cpu_s"] for k, r in res["rows"].items()},
            "step_s_mean": {k: r["step_s_mean"] for k, r in res["rows"].items()}}


# (engines, groups per step) of the cost curve: requests and engines x requests both grow,
# and the last row has the 512-engine row's requests on a quarter of its engines
CURVE = ((64, 100), (128, 200), (256, 400), (512, 800), (128, 800))


def cost_curve(sizes: Sizes) -> list[dict[str, Any]]:
    """The Kimi-K2-like scenario's sync mode, 3 steps, at each ``CURVE`` size: CPU seconds
    per ledger line (sample), to show how the cost grows with engines x requests."""
    base = load_scenario(KIMI_512)
    out = []
    for engines, groups in CURVE:
        sc = base.model_validate({**base.model_dump(), "steps": 3 if sizes.sim_steps is None
                                  else 1, "engines": max(1, engines // sizes.sim_scale),
                                  "groups_per_step": max(1, groups // sizes.sim_scale),
                                  "modes": [base.modes[0].model_dump()]})
        row = simulate_mode(sc, sc.modes[0], load_profile(sc.profile))
        samples = sum(row["statuses"].values())
        out.append({"engines": sc.engines, "groups_per_step": sc.groups_per_step,
                    "samples": samples, "cpu_s": row["cpu_s"], "wall_s": row["wall_s"],
                    "ms_per_sample": 1000 * row["cpu_s"] / samples,
                    "us_per_sample_engine": 1e6 * row["cpu_s"] / samples / sc.engines})
        print(f"bench sim: cost curve {sc.engines} engines x {samples} samples: "
              f"{row['cpu_s']:.1f} CPU s", flush=True)
    return out


def gpu_256(sizes: Sizes) -> dict[str, Any]:
    base = load_scenario(SEER_64)
    sc = base.model_validate({
        **base.model_dump(), "name": "seer_moonlight_256", "engines": 256 // sizes.sim_scale,
        "groups_per_step": 4 * base.groups_per_step // sizes.sim_scale,
        "trainer_devices": 4 * base.trainer_devices // sizes.sim_scale,
        "steps": sizes.sim_steps or base.steps,
        "modes": [ModeConfig(name="sync", mode="sync").model_dump(),
                  ModeConfig(name="async_k2_partial", mode="async",
                             staleness=StalenessConfig(max_staleness=2)).model_dump()]})
    print(f"bench sim: {sc.name}, {sc.steps} steps ...", flush=True)
    res = run_scenario(sc, progress=True)
    rows = res["rows"]
    return {"engines": sc.engines, "steps": sc.steps, "groups_per_step": sc.groups_per_step,
            "rows": {k: {m: r[m] for m in ("step_s_mean", "engine_utilization",
                                           "tail_share_mean", "trained_tok_s", "wall_s")}
                     for k, r in rows.items()},
            "ratio": rows["async_k2_partial"]["trained_tok_s"] / rows["sync"]["trained_tok_s"]}


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Every part in turn (module docstring); ``overrides`` (key=value) apply to the real
    runs (tests pass a tiny model there)."""
    sizes = QUICK if quick else FULL
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-sim-"))
    load_before, t0 = os.getloadavg(), time.perf_counter()
    calib = calibration(real_runs(sizes, run_root, overrides), run_root)
    speed, curve, gpu = speed_512(sizes), cost_curve(sizes), gpu_256(sizes)
    rows = calib["rows"]
    result = {
        "date": datetime.date.today().isoformat(), "quick": quick,
        "calibration_error_step_time": {k: r["error_step_time"] for k, r in rows.items()},
        "calibration_error_utilization": {k: r["error_utilization"] for k, r in rows.items()},
        # one profile (with its contention terms) fitted from both runs, predicting each
        "calibration_joint_error_step_time": {k: r["error_step_time"]
                                              for k, r in calib["joint"].items()},
        "calibration_joint_error_utilization": {k: r["error_utilization"]
                                                for k, r in calib["joint"].items()},
        "sim_wall_s_512_engines": max(speed["wall_s"].values()),
        "sim_cpu_s_512_engines": max(speed["cpu_s"].values()),
        "gpu_async_partial_vs_sync": gpu["ratio"],
        "calibration": calib, "speed_512": speed, "speed_curve": curve, "gpu_256": gpu,
        **machine(load_before, t0, run_root),
    }
    print_tables(result)
    write_json(result, json_out)
    return result


def machine(load_before: tuple[float, ...], t0: float, run_root: Path) -> dict[str, Any]:
    """The keys every simulator bench ends with: the machine's load before and after, its
    cores, where the runs are, and the bench's wall time since ``t0``."""
    return {"load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "cpus": len(os.sched_getaffinity(0)), "run_root": str(run_root),
            "bench_wall_s": time.perf_counter() - t0}


def write_json(result: dict[str, Any], json_out: Path | None) -> None:
    if json_out is not None:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_out}")


def calibration_table(calib: dict[str, Any]) -> Any:
    """The calibration's rows as a rich table: each run beside its simulations."""
    from rich.table import Table

    t = Table(title="calibration: each real run vs its simulation (profile fitted from: the "
              "run itself / both runs / the other run)")
    for col in ("mode", "profile", "step s real", "step s sim", "error", "util real",
                "util sim", "error"):
        t.add_column(col, justify="right")
    for part, name in (("rows", "itself"), ("joint", "both"),
                       ("joint_no_contention", "both, no contention"), ("cross", "other")):
        for mode, r in calib[part].items():
            m, s = r["measured"], r["simulated"]
            t.add_row(mode, name, f"{m['step_s_mean']:.3f}", f"{s['step_s_mean']:.3f}",
                      f"{r['error_step_time']:.1%}", f"{m['engine_utilization']:.3f}",
                      f"{s['engine_utilization']:.3f}", f"{r['error_utilization']:.1%}")
    return t


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    console.print(calibration_table(result["calibration"]))
    sp, gpu = result["speed_512"], result["gpu_256"]
    console.print(f"{sp['engines']} engines, {sp['steps']} steps: wall s (CPU s) "
                  + ", ".join(f"{k} {v:.1f} ({sp['cpu_s'][k]:.1f})"
                              for k, v in sp["wall_s"].items()))
    t = Table(title="cost curve: sync, Kimi-K2-like, CPU seconds (speed_curve)")
    for col in ("engines", "groups/step", "samples", "CPU s", "ms per sample"):
        t.add_column(col, justify="right")
    for r in result["speed_curve"]:
        t.add_row(str(r["engines"]), str(r["groups_per_step"]), f"{r['samples']:,}",
                  f"{r['cpu_s']:.2f}", f"{r['ms_per_sample']:.3f}")
    console.print(t)
    console.print(f"256 engines (Seer-like, {gpu['steps']} steps): async k=2 partial / sync "
                  f"trained tok/s = {gpu['ratio']:.2f}")
    console.print(f"load average before {result['load_avg_before'][0]:.1f}, after "
                  f"{result['load_avg_after'][0]:.1f}")
