"""The scaling study: one scenario from a few engines to a thousand, beside published figures.

    rollstream sim examples/sim/seer_moonlight_64.yaml --study 8,32,128,512,1024 --out DIR

The scenario (profile, workload, token blocks, seed) is run at each engine count ``E`` with
its groups per step and trainer devices scaled by ``E / scenario.engines`` (so each engine
has the same work per step and the trainer the same share of devices), in three modes:
``sync``, ``async_k2_drain`` (async, max staleness 2, weight updates wait for in-flight
requests: no partial rollout) and ``async_k2_partial`` (the same with partial rollout:
requests interrupted at a weight update and resumed). Per engine count:

* ``tail_share``: sync's share of a step's rollout time spent on its last 10% of samples
  (Seer's measure);
* ``async_speedup``: async_k2_drain's trained tokens/s over sync's;
* ``partial_speedup``: async_k2_partial's over sync's (``partial_vs_drain``: over drain's).

Set beside them, the published figures (WORKLOADS.md: Seer, AReaL, ROLL Flash, MiMo,
RollPacker, Laminar, APRIL), each as its authors report it against their own baseline, on
their own models and clusters: a comparison of orders of magnitude, not a reproduction.
Writes ``study.json``, ``study.png`` (with matplotlib) and ``index.html`` to ``--out``.
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path
from typing import Any

from rollstream.config.staleness import StalenessConfig
from rollstream.sim.outputs import (
    NO_PLOTS,
    have_matplotlib,
    page_html,
    save_png,
    table_html,
    write_json,
)
from rollstream.sim.profile import load_profile
from rollstream.sim.run import simulate_mode
from rollstream.sim.scenario import ModeConfig, Scenario, load_scenario

log = logging.getLogger(__name__)

_K2 = StalenessConfig(max_staleness=2)
STUDY_MODES = (ModeConfig(name="sync", mode="sync"),
               ModeConfig(name="async_k2_drain", mode="async", staleness=_K2, on_update="drain"),
               ModeConfig(name="async_k2_partial", mode="async", staleness=_K2))

# (system, what, figure, how) from WORKLOADS.md, as their authors report them
PUBLISHED = (
    ("Seer", "tail share, sync", "46% / 58% / 26%",
     "last 10% of requests' share of rollout time: Moonlight / Qwen2-VL-72B / Kimi-K2 (paper)"),
    ("AReaL", "async speedup", "up to 2.77x", "fully async vs synchronous, same GPUs (abstract)"),
    ("ROLL Flash", "async speedup", "2.24x", "RLVR, rollout-train decoupling (abstract)"),
    ("MiMo", "async speedup", "2.29x", "continuous rollout, training speed (paper)"),
    ("DORA", "async speedup", "2-4x", "several policy versions live, very large scale (abstract)"),
    ("RollPacker", "tail handling", "2.03-2.56x", "tail batching vs veRL, up to 128 GPUs (abstract)"),
    ("Laminar", "tail handling", "up to 5.48x", "weights pulled any time, 1,024 GPUs (abstract)"),
    ("APRIL", "partial rollout", "+22.5% (avg), +44% (best)",
     "rollout throughput, recycling partial responses (abstract)"),
)


def scaled(base: Scenario, engines: int, steps: int | None) -> Scenario:
    """``base`` at ``engines`` engines: groups per step and trainer devices scaled alike."""
    f = engines / base.engines
    return base.model_validate({
        **base.model_dump(), "name": f"{base.name}-x{engines}", "engines": engines,
        "groups_per_step": max(1, round(base.groups_per_step * f)),
        "trainer_devices": max(1, round(base.trainer_devices * f)),
        "steps": steps or base.steps, "modes": [m.model_dump() for m in STUDY_MODES]})


def run_study(base: Scenario, engine_counts: list[int], steps: int | None = None, *,
              progress: bool = True) -> dict[str, Any]:
    profile = load_profile(base.profile)
    t0 = time.perf_counter()
    points = []
    for e in engine_counts:
        sc = scaled(base, e, steps)
        rows = {m.name: simulate_mode(sc, m, profile) for m in STUDY_MODES}
        sync, drain, part = (rows[m.name]["trained_tok_s"] for m in STUDY_MODES)
        point = {
            "engines": e, "groups_per_step": sc.groups_per_step,
            "trainer_devices": sc.trainer_devices, "steps": sc.steps,
            "tail_share": rows["sync"]["tail_share_mean"],
            "async_speedup": drain / sync, "partial_speedup": part / sync,
            "partial_vs_drain": part / drain,
            # per mode, what the samples became (statuses, staleness, preemptions): why a
            # mode's utilization or speedup moves with the engine count
            "rows": {k: {m: r[m] for m in ("step_s_mean", "engine_utilization",
                                           "tail_share_mean", "trained_tok_s", "gen_tok_s",
                                           "staleness_max", "staleness_hist", "statuses",
                                           "interrupts", "preemptions", "wall_s", "cpu_s")}
                     for k, r in rows.items()}}
        points.append(point)
        if progress:
            log.info(f"  {e} engines: tail share {point['tail_share']:.2f}, async "
                     f"{point['async_speedup']:.2f}x, partial {point['partial_speedup']:.2f}x "
                     f"({sum(r['wall_s'] for r in rows.values()):.0f} s)")
    return {"scenario": base.model_dump(mode="json"), "profile": profile.model_dump(mode="json"),
            "points": points, "published": [dict(zip(("system", "what", "figure", "how"), p,
                                                      strict=True)) for p in PUBLISHED],
            "wall_s": time.perf_counter() - t0}


def _draw(study: dict[str, Any]) -> Any:
    pts = study["points"]
    xs = [p["engines"] for p in pts]

    def draw(fig: Any) -> None:
        a, b = fig.subplots(1, 2)
        a.plot(xs, [p["tail_share"] or 0.0 for p in pts], "o-", label="simulated, sync")
        a.axhspan(0.26, 0.58, color="#f0c080", alpha=0.4, label="Seer: 26-58% (sync)")
        a.set_ylim(0, 1)
        a.set_title("tail share: last 10% of samples' share of a step", fontsize=10)
        b.plot(xs, [p["async_speedup"] for p in pts], "o-", label="async k=2, drain")
        b.plot(xs, [p["partial_speedup"] for p in pts], "s-", label="async k=2, partial")
        b.axhspan(2.24, 2.77, color="#a0c8f0", alpha=0.4, label="AReaL / ROLL Flash / MiMo")
        b.axhspan(2.03, 2.56, color="#c0e0a0", alpha=0.4, label="RollPacker")
        b.axhline(5.48, color="#999", ls="--", label="Laminar (1,024 GPUs)")
        b.set_title("trained tokens/s over sync's", fontsize=10)
        for ax in (a, b):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("engines")
            ax.legend(fontsize=8)
    return draw


def write_study(study: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "study.json", study)
    pngs = [save_png(out_dir / "study.png", _draw(study), size=(12, 5))] \
        if have_matplotlib() else []
    sc, prof = study["scenario"], study["profile"]
    rows = [[p["engines"], p["groups_per_step"], p["trainer_devices"],
             f"{p['tail_share']:.2f}" if p["tail_share"] is not None else "-",
             f"{p['async_speedup']:.2f}", f"{p['partial_speedup']:.2f}",
             f"{p['partial_vs_drain']:.2f}",
             " / ".join(f"{p['rows'][m.name]['engine_utilization']:.2f}" for m in STUDY_MODES)]
            for p in study["points"]]
    intro = (f"<p>Scenario <b>{html.escape(sc['name'])}</b> scaled (profile "
             f"<b>{html.escape(prof['name'])}</b>; {study['points'][0]['steps']} steps per "
             f"mode; {study['wall_s']:.0f} s of wall time). Speedups: trained tokens/s over "
             "sync's. Published figures are their authors' own, against their own baselines."
             "</p>")
    parts = [intro, table_html(("engines", "groups/step", "trainer devices", "tail share (sync)",
                                "async speedup (drain)", "async + partial speedup",
                                "partial vs drain", "engine util sync / drain / partial"),
                               rows),
             "<h2>Published</h2>", table_html(("system", "what", "figure", "how"),
                                              [list(p.values()) for p in study["published"]])]
    page = out_dir / "index.html"
    page.write_text(page_html("rollstream sim study: 8 to 1,024 engines", parts, pngs))
    return page


def main(scenario: Path, *, engines: str, steps: int | None = None,
         out_dir: Path | None = None, json_out: Path | None = None) -> dict[str, Any]:
    try:
        counts = [int(x) for x in engines.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--study takes engine counts separated by commas, got {engines!r}") \
            from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--study: engine counts must be >= 1, got {engines!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    study = run_study(load_scenario(scenario), counts, steps)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json(json_out, study)
        log.info(f"wrote {json_out}")
    if out_dir is not None:
        log.info(f"wrote {write_study(study, out_dir)}" + ("" if have_matplotlib()
                                                            else f" ({NO_PLOTS})"))
    return study
