"""Benchmark: the controller's modes on the long-tail tick task, one process, one run each.

    rollstream bench modes [--json OUT] [--quick]

Configs, run one after another from the same warm-started weights (the base YAML's model
and task; the cached warm start) and trained on the same number of samples (``steps`` x 16
groups x 8): ``sync`` (staleness 0: partial rollout on/off is the same schedule there, so it
runs once), ``one_step`` and ``async`` with k = 1, 2, 4, each with partial rollout (the
base YAML's ``on_update``: interrupt and resume, or continue in place) and with
``on_update: drain`` (finish on the old weights). ``one_step`` is staleness 1, the same
controller settings as ``async k=1``: the two differ only by run-to-run noise, which is what
their difference measures. Every row follows the base YAML's staleness rule at its own k.
Two more rows compare the staleness semantics for a long sample at async k=2 with partial
rollout (staleness.py), next to the headline row's (the base YAML's rule:
``admission`` in both examples): ``async_k2_partial_<rule>`` for
each other rule of ``drop`` (``max_context_age`` = k: a group holding a token older than k is
dropped), ``mask`` (``max_token_age`` = k: older tokens masked) and ``admission`` (k
bounds admission only, samples trained whole up to ``max_context_age`` 2k), all with the
base's loss; key ``staleness_semantics``. Two more run the headline row and its drain pair
with the trainer in a process of its own (``trainer_proc_<row>``: the fsdp backend with one
rank, pinned to the trainer's core), so that the engine and the trainer no longer share an
interpreter; key ``trainer_process_vs_thread`` (trained samples/s, process ÷ thread).

The headline pair (``sync`` and ``async_k2_partial``, the examples' own rollout
settings) and the drain row partial rollout is judged against run first and again last,
A B C ... C B A, so a drift in the machine's load hits them alike. The second run takes the
next seed (its own task order and samples): a drain row generates the same tokens in every
run of one seed, so two runs of one seed measure only timing, while which groups a run must
filter (zero reward variance) moves its samples/s by more. Such a row reports the mean of its
two runs.

Placement: the engine thread is pinned to core 0 and the trainer thread to core 1 (one torch
thread each); the event loop and reward threads float. Before the runs the bench measures
the engine's **saturated** tokens/s on its core (the same engine config kept full with
``max_slots`` requests of the tick length mix, refilled as they finish; the better of a 20 s
and a 10 s window) and a contention probe: trainer steps on a fixed batch alone and while the
engine is saturated, with each thread's run / run-queue / blocked share from ``/proc`` (a
thread that always has work and is blocked is waiting for the GIL; bench/probe.py).

Per config (from ``run_training``'s summary, the run dir's ledger and metrics): wall and
training time, trained tokens/s (the tokens the loss kept of TRAINED samples / training wall
time; with ``max_token_age`` a resumed sample's older tokens are not counted),
generated tokens/s (response tokens of every training-phase sample, eval excluded),
**engine utilization** (generated tokens/s / saturated tokens/s), trainer busy share (trainer
compute / training wall time), final held-out reward with its standard error over eval
prompts, ledger counts and interrupts.

``--config`` picks the base YAML: default examples/tick_long.yaml, the long-tail shape of
the published workloads (rollout most of a synchronous step); examples/tick.yaml is the
demo's shape (a synchronous step spends ~30% of its time generating). The JSON's
``rollout_share_sync`` says which regime a run measured.

Two upper bounds come with the ratios: ``async_ceiling_vs_sync`` (a step no shorter than a
trainer step) and ``async_bound_vs_sync`` (nor shorter than generating sync's tokens per
trained step at the best rate the engine showed): what any scheduler could gain over ``sync``
on this engine. ``share_of_bound`` gives each row's share of the bound as a product of two
factors (``bench/modes_bound.py``, which also measures a run's ``end_tail_s``).

A benchmark measures; it does not assert. The machine is shared: the JSON records the load
average, and only ratios within one run mean much.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollstream.bench.modes_bound import end_tail_s, machine_bound, share_of_bound
from rollstream.bench.modes_tables import print_tables
from rollstream.bench.probe import ThreadMeter, probe
from rollstream.bench.run_reading import read_metrics, reward_se, token_breakdown
from rollstream.config import RunConfig, apply_override, load_config, validate
from rollstream.run_files import RunFiles
from rollstream.trajectory import SampleStatus, is_eval_uid

LONG_YAML = Path(__file__).resolve().parents[3] / "examples" / "tick_long.yaml"
HEADLINE_ASYNC = "async_k2_partial"  # the examples' own rollout settings
DRAIN_PAIR = "async_k2_drain"  # the same k without partial rollout
_S = "rollout.staleness"  # the config block of the bounds each row sets
# The trainer in a process of its own (the fsdp backend with one rank, pinned to the trainer's
# core) instead of a thread beside the engine's: the interpreter (GIL) is no longer shared
TRAINER_PROCESS = "trainer_proc_"
TRAINER_PROCESS_SETTINGS = ("train.backend=fsdp", "train.fsdp.world_size=1")
def rule_settings(rule: str, k: int) -> list[str]:
    """The overrides that make a row with staleness bound ``k`` follow ``rule`` (a staleness
    semantics of staleness.py; the headline row follows the base YAML's)."""
    return {"drop": [f"{_S}.max_token_age=null", f"{_S}.max_context_age={k}"],
            "mask": [f"{_S}.max_token_age={k}", f"{_S}.max_context_age={2 * k}"],
            "admission": [f"{_S}.max_token_age=null", f"{_S}.max_context_age={2 * k}"]}[rule]


STALENESS_RULES = ("drop", "mask", "admission")


@dataclass(slots=True, kw_only=True, frozen=True)
class Sizes:
    steps: int
    num_eval: int
    samples_per_task: int
    saturate_s: float
    probe_steps: int


FULL = Sizes(steps=16, num_eval=128, samples_per_task=4, saturate_s=20.0, probe_steps=3)
QUICK = Sizes(steps=2, num_eval=8, samples_per_task=1, saturate_s=2.0, probe_steps=1)


def mode_configs(base_rule: str = "admission",
                 base_on_update: str = "interrupt") -> list[tuple[str, list[str]]]:
    """(label, overrides) of every benchmarked config. ``base_rule``: the staleness rule of
    the base YAML (the headline row's); every row follows it at its own staleness bound k
    (``max_token_age`` k, ``max_context_age`` 2k or k), so a row's bounds mean the same.
    ``base_on_update``: the base YAML's ``rollout.on_update``; the partial rows use it (the
    library default, interrupt, when the base drains) and the drain rows ``drain``."""
    def bounds(k: int) -> list[str]:
        return rule_settings(base_rule, k)

    partial = base_on_update if base_on_update != "drain" else "interrupt"
    out = [("sync", ["rollout.mode=sync", f"rollout.on_update={partial}", *bounds(0)])]
    for tag, on_update in (("partial", partial), ("drain", "drain")):
        out.append((f"one_step_{tag}",
                    ["rollout.mode=one_step", f"rollout.on_update={on_update}", *bounds(1)]))
        for k in (1, 2, 4):
            out.append((f"async_k{k}_{tag}", ["rollout.mode=async", f"{_S}.max_staleness={k}",
                                              f"rollout.on_update={on_update}", *bounds(k)]))
    k2 = ["rollout.mode=async", f"{_S}.max_staleness=2", f"rollout.on_update={partial}"]
    for rule in STALENESS_RULES:  # the other two staleness semantics
        if rule != base_rule:
            out.append((f"{HEADLINE_ASYNC}_{rule}", [*k2, *rule_settings(rule, 2)]))
    by_label = dict(out)
    for label in (HEADLINE_ASYNC, DRAIN_PAIR):  # the same, the trainer in a process of its own
        out.append((f"{TRAINER_PROCESS}{label}", [*by_label[label], *TRAINER_PROCESS_SETTINGS]))
    return out


def row_config(config: Path, common: Sequence[str], row: Sequence[str]) -> RunConfig:
    """The base YAML with ``common`` and then a row's overrides applied. A row sets the mode
    itself, so the base's ``max_staleness``, which sync and one_step would contradict, is
    taken out first for them: the row replaces it, it does not contradict it."""
    data = yaml.safe_load(Path(config).read_text()) or {}
    for item in common:
        apply_override(data, item)
    settings = dict(item.split("=", 1) for item in row)
    if settings.get("rollout.mode") in ("sync", "one_step"):
        data.setdefault("rollout", {}).get("staleness", {}).pop("max_staleness", None)
    for item in row:
        apply_override(data, item)
    return validate(data)


def run_order(quick: bool, labels: Sequence[str]) -> list[str]:
    """``labels`` in run order. The headline pair and the drain row it is judged against run
    first and again last (A B C ... C B A), so a drift in the machine's load hits them alike;
    the second run has the next seed and a row reports the mean of its runs (quick: once)."""
    labels = list(labels)
    if quick:
        return labels
    twice = ["sync", HEADLINE_ASYNC, DRAIN_PAIR]
    middle = [x for x in labels if x not in twice]
    return [*twice, *middle, *reversed(twice)]


def merge_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row run more than once (each run its own seed): the mean of its runs' measurements
    (nested ones too; a setting, the same in every run, as it is), the final reward's standard
    error that of the mean; every run kept under ``repeats``."""
    if len(runs) == 1:
        return dict(runs[0])
    merged = _mean(runs)
    se2 = sum(r["reward_final_se"] ** 2 for r in runs)
    merged["reward_final_se"] = math.sqrt(se2) / len(runs)
    merged["repeats"] = [{k: r[k] for k in ("seed", "train_wall_s", "trained_samples_per_s",
                                            "trained_tok_s", "gen_tok_s", "generated_tokens",
                                            "reward_final", "reward_final_se", "runq_share")}
                         for r in runs]
    return merged


def ratio_by_seed(row: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Trained samples/s of ``row`` ÷ ``other``, seed by seed, over the seeds both ran."""
    theirs = {r["seed"]: r["trained_samples_per_s"] for r in other.get("repeats", [])}
    return {str(r["seed"]): r["trained_samples_per_s"] / theirs[r["seed"]]
            for r in row.get("repeats", []) if r["seed"] in theirs}


def _mean(values: list[Any]) -> Any:
    """The mean of numbers, key by key of dicts; anything else (or numbers all equal) as the
    first value."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _mean([v[k] for v in values]) for k in first if all(k in v for v in values)}
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if not numbers or all(v == first for v in values):
        return first
    return statistics.fmean(values)


# ---- one training run -------------------------------------------------------------------
def run_config(cfg: RunConfig) -> dict[str, Any]:
    from rollstream.data.ledger import read_ledger
    from rollstream.runtime.train import run_training

    with ThreadMeter() as meter:
        summary = run_training(cfg)
    run_dir = cfg.run_dir
    ledger = read_ledger(RunFiles(run_dir).ledger)
    # the tokens the loss kept (with max_token_age a resumed sample's old prefix is not)
    trained_tokens = sum(r.num_trained_tokens or 0 for r in ledger
                         if r.status is SampleStatus.TRAINED)
    generated = sum(r.num_tokens for r in ledger if not is_eval_uid(r.sample_uid))
    metrics = read_metrics(run_dir)
    steps = [r for r in metrics if r.get("kind") == "train"]
    rollout = [r for r in metrics if r.get("kind") == "rollout"]
    blocked = sum(r.get("staleness_blocked_s", 0.0) for r in rollout)
    gate = sum(r.get("gate_blocked_s", 0.0) for r in rollout)
    wall = summary["train_wall_s"]
    counts = Counter(r.status.value for r in ledger)
    work: Counter[str] = Counter()
    for per_engine in summary["engines"].values():
        work.update(per_engine)
    trainer_busy = sum(s["train_s"] for s in steps) / wall
    return {
        "wall_s": summary["wall_s"],
        "train_wall_s": wall,
        "steps": summary["steps"],
        "trained_samples": summary["trained_samples"],
        "trained_tokens": trained_tokens,
        "trained_tok_s": trained_tokens / wall,
        "trained_samples_per_s": summary["trained_samples"] / wall,
        "generated_tokens": generated,
        "gen_tok_s": generated / wall,
        "trainer_busy": trainer_busy,
        "tokens": token_breakdown(ledger),
        "engine_work": dict(work),
        "engine_idle_share": max(0.0, 1.0 - work["busy_s"] / wall),
        "end_tail_s": (tail := end_tail_s(run_dir)),  # the trainer alone at the end
        "engine_busy_before_tail": work["busy_s"] / (wall - tail),
        "trainer_idle_share": max(0.0, 1.0 - trainer_busy),
        "staleness_blocked": blocked / wall,
        "gate_blocked": gate / wall,
        "trainer_step_s": statistics.fmean(s["step_s"] for s in steps) if steps else math.nan,
        "wait_s_mean": statistics.fmean(s["wait_s"] for s in steps) if steps else math.nan,
        "staleness_mean": statistics.fmean(s["staleness_mean"] for s in steps) if steps else 0.0,
        "reward_initial": summary["reward_initial"],
        "reward_final": summary["reward_final"],
        "reward_final_se": reward_se(ledger, round_index=1),
        "dropped_stale": counts["dropped_stale"],
        "filtered": counts["filtered"],
        "aborted": counts["aborted"],
        "failed": counts["failed"],
        "interrupts": summary["interrupts"],
        # bytes the weight syncs moved (an adapter's alone under model.lora)
        "sync_bytes": sum(r.get("sync_bytes") or 0 for r in metrics if r.get("kind") == "phase"),
        "threads": meter.shares(),
        "runq_share": meter.runq_share(("engine", "trainer")),
        "load_after": os.getloadavg()[0],
    }


# ---- main -------------------------------------------------------------------------------
def cores() -> tuple[int, int]:
    """(engine core, trainer core): 0 and 1 when both are ours, else the two lowest we have."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])


def bench_overrides(folder: Path | None, run_root: Path) -> list[str]:
    """What every benchmarked rollstream run shares: the model folder (None: the config's own
    model, the kit's warm-started one), one pinned torch thread for the engine and one for the
    trainer, no UI, and the held-out reward measured at the start and the end only
    (``reward_se`` reads the second evaluation round as the final one, and an evaluation
    inside the training time would be timed as training)."""
    engine_core, train_core = cores()
    return [
        *([] if folder is None else [f"model.path={folder}"]),
        f"run_root={run_root}", "max_wall_s=null", "eval.every=0",
        "engine.local.threads=1", f"engine.local.cpu_affinity=[{engine_core}]",
        "train.threads=1", f"train.cpu_affinity=[{train_core}]",
        "monitor.progress=false", "monitor.report=false", "monitor.dashboard=false",
    ]


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = (), config: Path = LONG_YAML) -> dict[str, Any]:
    """Run every config on top of ``config``'s model, task and training settings;
    ``overrides`` (key=value) apply to all of them (tests pass a tiny model there)."""
    import torch

    from rollstream.models.warmstart import prepare_model

    # One torch thread here (a warm start that is not cached yet runs on it): two OpenMP
    # threads on a shared 2-core machine slow down many times when one core is busy.
    torch.set_num_threads(1)

    sizes = QUICK if quick else FULL
    base = load_config(config, list(overrides))
    folder = prepare_model(base.model, base.tasks)  # before any override that moves its hash
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-modes-"))
    common = [
        *overrides, *bench_overrides(folder, run_root), f"train.steps={sizes.steps}",
        f"tasks.num_eval={sizes.num_eval}", f"eval.samples_per_task={sizes.samples_per_task}",
    ]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    cfg0 = load_config(config, common)
    print(f"bench modes: probing the engine's saturated rate ({sizes.saturate_s:.0f} s) ...",
          flush=True)
    probed = probe(cfg0, folder, saturate_s=sizes.saturate_s, probe_steps=sizes.probe_steps)
    modes = dict(mode_configs(base.rollout.staleness_policy().rule, base.rollout.on_update))
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, label in enumerate(run_order(quick, modes)):
        print(f"bench modes: {label} ...", flush=True)
        seed = base.seed + len(runs.get(label, []))  # a row's second run: the next seed
        cfg = row_config(config, common, [*modes[label], f"name={label}-{i}", f"seed={seed}"])
        policy = cfg.rollout.staleness_policy()
        runs.setdefault(label, []).append(
            {"seed": seed, "max_staleness": policy.max_staleness,
             "on_update": cfg.rollout.on_update, "kv_on_load": cfg.engine.local.kv_on_load,
             "max_token_age": policy.max_token_age, "staleness_rule": policy.rule,
             "max_context_age": policy.context_bound, "loss": cfg.train.loss,
             **run_config(cfg)})
    rows = {label: merge_repeats(runs[label]) for label in modes}
    for row in rows.values():
        row["engine_utilization"] = row["gen_tok_s"] / probed["saturated_tok_s"]
    result = _summarise(rows, probed, quick=quick, sizes=sizes, cfg=cfg0,
                        load_before=load_before,
                        bench_wall_s=time.perf_counter() - t0, run_root=run_root,
                        config_path=Path(config))
    if json_out is not None:  # first: the runs' measurements outlive a failing table
        Path(json_out).write_text(json.dumps(result, indent=2))
    print_tables(result)
    return result


def _summarise(rows: dict[str, dict[str, Any]], probed: dict[str, Any], *, quick: bool,
               sizes: Sizes, cfg: RunConfig, load_before: tuple[float, float, float],
               bench_wall_s: float, run_root: Path, config_path: Path) -> dict[str, Any]:
    sync, head = rows["sync"], rows[HEADLINE_ASYNC]
    diff = head["reward_final"] - sync["reward_final"]
    noise_eval = 2 * math.hypot(sync["reward_final_se"], head["reward_final_se"])
    # Both headline rewards are means of two runs, so their difference has the spread of one run
    noise_runs = 2 * (sd_runs := reward_run_to_run_sd(rows))
    noise = max(noise_eval, noise_runs)
    b = machine_bound(rows, probed["saturated_tok_s"])  # the most any scheduler could gain
    shares = {label: share_of_bound(row, sync, b) for label, row in rows.items()}
    best = max(rows, key=lambda label: rows[label]["trained_tok_s"])
    best_async = max((label for label in rows if label != "sync"),
                     key=lambda label: rows[label]["trained_tok_s"])
    best_share = shares[best_async]["share"]
    partial_vs_drain = (head["trained_samples_per_s"]
                        / rows[DRAIN_PAIR]["trained_samples_per_s"])
    by_seed = ratio_by_seed(head, rows[DRAIN_PAIR])
    # each row's two runs apart (the same settings): how far one run's samples/s is noise
    spread = {label: abs(a - b) / statistics.fmean((a, b)) for label, row in rows.items()
              if len(r := row.get("repeats", [])) == 2
              for a, b in [(r[0]["trained_samples_per_s"], r[1]["trained_samples_per_s"])]}
    ratio = head["trained_tok_s"] / sync["trained_tok_s"]
    util = head["engine_utilization"]
    # while the trainer steps on the other core the engine's saturated rate is lower (shared
    # memory bandwidth, the GIL): the ceiling of a run where both work at once
    util_contended = head["gen_tok_s"] / probed["engine_tok_s_with_trainer"]
    return {
        "benchmark": "modes",
        "quick": quick,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_before": list(load_before),
                    "load_after": list(os.getloadavg()), "bench_wall_s": bench_wall_s},
        "settings": {
            "engine_core": cfg.engine.local.cpu_affinity[0],
            "trainer_core": cfg.train.cpu_affinity[0], "steps": sizes.steps,
            "groups_per_step": cfg.train.groups_per_step, "group_size": cfg.rollout.group_size,
            "trained_samples_per_config": sizes.steps * cfg.train.groups_per_step
            * cfg.rollout.group_size,
            "max_new_tokens": cfg.sampling.max_new_tokens, "max_slots": cfg.engine.local.max_slots,
            "micro_batch_tokens": cfg.train.micro_batch_tokens,
            "updates_per_step": cfg.train.updates_per_step, "num_eval": sizes.num_eval,
            "eval_samples_per_task": sizes.samples_per_task, "model": str(cfg.model.path),
            "run_root": str(run_root),
        },
        "probe": probed,
        "rows": rows,
        "async_config": HEADLINE_ASYNC,
        "drain_config": DRAIN_PAIR,  # the headline row's pair without partial rollout
        "async_partial_vs_sync_throughput": ratio,
        "async_partial_vs_sync_samples_per_s": head["trained_samples_per_s"]
        / sync["trained_samples_per_s"],
        "async_ceiling_vs_sync": b.ceiling,
        "async_bound_vs_sync": b.bound,
        "async_bound_by": b.bound_by,
        "async_best_config": best,
        "async_best_vs_sync_throughput": rows[best]["trained_tok_s"] / sync["trained_tok_s"],
        # judged against this machine's own bound (machines differ)
        "async_best_async_config": best_async,
        "async_best_share_of_bound": best_share,
        # each row's share and the two factors it is the product of (bench/modes_bound.py)
        "share_of_bound": shares,
        # partial rollout vs drain at the same k (trained samples/s)
        "async_partial_vs_drain": partial_vs_drain,
        "async_partial_vs_drain_by_seed": by_seed,
        # (|run 1 - run 2| / mean) of the rows run twice: the noise a single ratio carries
        "samples_per_s_run_to_run": spread,
        # trained samples/s with the trainer in its own process over the same row's with the
        # trainer on a thread of the engine's process (the GIL the two share)
        "trainer_process_vs_thread": {
            label: rows[f"{TRAINER_PROCESS}{label}"]["trained_samples_per_s"]
            / rows[label]["trained_samples_per_s"] for label in (HEADLINE_ASYNC, DRAIN_PAIR)},
        "reward_partial_minus_drain": head["reward_final"] - rows[DRAIN_PAIR]["reward_final"],
        # a long sample that spans more than k versions: dropped, masked, or kept whole
        "staleness_semantics": {
            rule: {"row": label, **{key: rows[label][key] for key in (
                "reward_final", "reward_final_se", "trained_samples_per_s", "trained_tok_s",
                "train_wall_s", "dropped_stale", "staleness_mean")},
                "masked_tokens": rows[label]["tokens"]["masked"],
                "dropped_stale_tokens": rows[label]["tokens"]["dropped_stale"]}
            for label in rows
            if label == HEADLINE_ASYNC or label.startswith(f"{HEADLINE_ASYNC}_")
            for rule in [rows[label]["staleness_rule"]]},
        # share of a synchronous step spent waiting for rollouts (published: 0.63-0.87)
        "rollout_share_sync": 1.0 - sync["trainer_busy"],
        "config": str(config_path),
        "engine_utilization_async": util,
        "engine_utilization_async_contended": util_contended,
        # the share of the training time the headline row's engine was computing (the target
        # "the engine >= 85% busy"); utilization = busy x its rate while busy
        "engine_busy_async": 1.0 - head["engine_idle_share"],
        "engine_utilization_sync": sync["engine_utilization"],
        "reward_sync": sync["reward_final"],
        "reward_async": head["reward_final"],
        "reward_initial": sync["reward_initial"],
        "reward_async_minus_sync": diff,
        "reward_noise_2se": noise_eval,
        "reward_run_to_run_sd": sd_runs,
        "reward_noise": noise,
        "targets": {
            "async_partial_vs_sync_throughput_ge_2": ratio >= 2.0,
            "engine_utilization_async_ge_0.85": util >= 0.85,
            "engine_utilization_async_contended_ge_0.85": util_contended >= 0.85,
            "engine_busy_async_ge_0.85": head["engine_idle_share"] <= 0.15,
            "reward_async_within_noise_of_sync": abs(diff) <= noise,
            "async_partial_vs_drain_ge_1": partial_vs_drain >= 1.0,
            "async_best_share_of_bound_ge_0.9": best_share >= 0.9,
        },
    }


def reward_run_to_run_sd(rows: dict[str, dict[str, Any]]) -> float:
    """Spread of the final reward between runs of the same schedule: one_step vs async k=1
    (identical settings) and the repeats of the rows run twice. It includes what the eval
    standard error leaves out: each run trains on different samples."""
    pairs = [(rows[f"one_step_{t}"]["reward_final"], rows[f"async_k1_{t}"]["reward_final"])
             for t in ("partial", "drain")]
    pairs += [(r[0]["reward_final"], r[1]["reward_final"])
              for row in rows.values() if len(r := row.get("repeats", [])) == 2]
    return math.sqrt(statistics.fmean((a - b) ** 2 for a, b in pairs) / 2)
