"""Benchmark: what the task sampler makes of generation, from short real training runs.

Part of ``rollstream bench dispatch`` (bench/dispatch.py runs :func:`measure` after its
makespans): the mixture, waste and length-bias keys. Every run is
``examples/tick.yaml`` (the demo: its warm-started model, async k=2 with partial rollout, 16
groups x 8 samples per step) on the embedded engine, from the same weights, as a ``rollstream
train`` process; the two runs of a comparison run at the same time (:func:`run_pair`), so
that both see the same load on a shared machine:

* **mixture**: two tick sources of equal weight, ``long`` (1-32 items, a heavy tail:
  ``pareto_alpha`` 0.5) and ``short`` (1-6 items): different lengths and pass rates, long
  groups filtered more often (all wrong); ``tasks.mix: weighted`` (naive) and ``quota``
  (deficit-corrected), ``mix_steps`` steps each. ``mixture_error_pp`` ``{naive, corrected}``: the last step's metric, the largest
  |trained share - weight| over the sources since the run began, in percentage points.
* **waste**: the demo task as it is, ``tasks.pass_rate.enabled`` false (baseline) and true,
  each for the same training wall time (``max_wall_s``). ``gen_tokens_per_trained_token`` (on)
  and ``gen_tokens_per_trained_token_baseline`` (off): the run's sums of the train lines'
  ``gen_tokens`` and ``trained_tokens``, divided. ``reward_pass_rate_minus_baseline``: final
  held-out reward, on - off; ``reward_noise``: 2 x the standard error of that difference
  from the evaluation, prompts as the unit (``bench modes``' ``reward_noise_2se``).
* **length_bias**: the step metric (trained samples' mean response length ÷ that of every
  sample of the step's resolved groups bar zero-variance ones, stale drops and aborts
  included; rollout/step_tally.py) over every step of the async runs: its mean, and its min
  and max (``length_bias_range``).
* **the waste pair on a dataset**: the same two runs on the demo's tick tasks written as a
  JSONL dataset of ``dataset_rows`` training rows, which recur once per pass (pass rates are
  then kept per task, not per difficulty bucket): ``..._dataset`` keys (None with
  ``--quick``, which leaves this pair out).

Where the waste goes (``waste``, per waste run, from the ledger): generated tokens of trained
samples, of zero-variance groups (all correct, all wrong) and of the rest (dropped stale,
aborted, ...); per difficulty bucket (the pass-rate key: the number of items) the groups
drawn, their zero-variance share ``f`` and tokens per group. From the baseline's buckets,
``bucket_model``: the ratio the baseline's draw gives (a check against the measured one) and
the ratio if each bucket were drawn in proportion to ``1 - f`` (what the sampler's weights
are with exact pass rates, floor aside): what this sampler can save on this task at best
while it keeps every bucket in the mix.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rollstream.data.ledger_row import LedgerRow

ROOT = Path(__file__).resolve().parents[3]
DEMO_YAML = ROOT / "examples" / "tick.yaml"
ZERO_VARIANCE = "zero reward variance"  # the filter's reason (rollout/rollout.py)


@dataclass(slots=True, kw_only=True, frozen=True)
class Sizes:
    mix_steps: int
    waste_wall_s: float
    waste_max_steps: int
    num_eval: int
    samples_per_task: int
    dataset_rows: int  # training rows of the recurring-task dataset
    extra: tuple[str, ...] = ()


FULL = Sizes(mix_steps=16, waste_wall_s=200.0, waste_max_steps=100_000, num_eval=128,
             samples_per_task=4, dataset_rows=64)
# a smoke run: a few steps, the wall limit far away; a test's barely trained model solves
# nothing, so every group would be filtered: keep them
QUICK = Sizes(mix_steps=3, waste_wall_s=60.0, waste_max_steps=3, num_eval=8, samples_per_task=1,
              dataset_rows=8,
              extra=("train.groups_per_step=4", "rollout.group_size=4", "reward.num_workers=1",
                     "rollout.filter_zero_variance=false"))


def measure(*, quick: bool, overrides: Sequence[str], run_root: Path) -> dict[str, Any]:
    """Run the mixture pair, the waste pair and the waste pair on a dataset, one pair after
    another; the keys of the module docstring (``sampling_runs``: each run's numbers)."""
    from rollstream.bench.modes import bench_overrides
    from rollstream.config import load_config
    from rollstream.models.warmstart import prepare_model

    sizes = QUICK if quick else FULL
    base = load_config(DEMO_YAML, list(overrides))
    folder = prepare_model(base.model, base.tasks)  # before the sources change its hash
    common = [*overrides, *bench_overrides(folder, run_root), *sizes.extra]
    max_items = min(32, base.tasks.sources[0].max_items)
    # long: a heavier tail than the demo's (alpha 0.5: 39% of tasks at 20+ items, vs 12%)
    two = (f"tasks.sources=[{{kind: tick, name: long, max_items: {max_items}, "
           "pareto_alpha: 0.5}, {kind: tick, name: short, max_items: 6}]")
    mixture = {f"mix_{label}": [f"tasks.mix={mix}", two, f"train.steps={sizes.mix_steps}",
                                "tasks.num_eval=0"]
               for label, mix in (("naive", "weighted"), ("corrected", "quota"))}
    data = write_tick_dataset(run_root / "tick_rows.jsonl", base, folder,
                              num_train=sizes.dataset_rows, num_eval=sizes.num_eval)
    dataset = f"tasks.sources=[{{kind: jsonl, name: tick_rows, path: {data}}}]"

    def waste(prefix: str, *extra: str) -> dict[str, list[str]]:
        return {f"{prefix}_{label}": [
            *extra, f"tasks.pass_rate.enabled={str(on).lower()}",
            f"max_wall_s={sizes.waste_wall_s}", f"train.steps={sizes.waste_max_steps}",
            f"tasks.num_eval={sizes.num_eval}", f"eval.samples_per_task={sizes.samples_per_task}"]
            for label, on in (("baseline", False), ("pass_rate", True))}

    runs = {**run_pair(common, mixture), **run_pair(common, waste("waste"))}
    if not quick:  # the waste pair's code path again, with a JSONL source: not for a smoke run
        runs.update(run_pair(common, waste("dataset", dataset)))
    return summarise(runs)


def write_tick_dataset(path: Path, base: Any, folder: Path, *, num_train: int,
                       num_eval: int) -> Path:
    """The demo's tick tasks as a JSONL dataset whose ``num_train`` training rows recur, once
    per pass (held-out rows: ``num_eval`` of tick's held-out tasks, which the dataset's own
    split by prompt hash holds out as well): where pass rates are kept per task."""
    from transformers import AutoTokenizer

    from rollstream.data.mix import TaskMix

    mix = TaskMix(base.tasks, AutoTokenizer.from_pretrained(folder))
    src = mix.source(mix.names[0])
    tasks = [src.task(i, split) for split, n in (("train", num_train), ("eval", num_eval))
             for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": t.prompt_text, "answer": t.reference}) + "\n"
                            for t in tasks))
    return path


def run_pair(common: Sequence[str], rows: dict[str, list[str]], *,
             bench: str = "dispatch") -> dict[str, dict[str, Any]]:
    """Run each row as a ``rollstream train`` process, all at once: the two sides of a
    comparison share the machine's load (it is shared, and its load moves by minutes), and
    an equal wall time means equal conditions. Each pins its engine and trainer threads as
    ``bench modes`` does, so the two engines share one core and the two trainers the other.
    (One row: one run; ``bench`` names the benchmark in what it prints.)"""
    from rollstream.bench.modes import row_config

    procs = {}
    for label, extra in rows.items():
        cfg = row_config(DEMO_YAML, common, [*extra, f"name={label}"])
        run_dir = cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        path = Path(cfg.run_root) / f"{label}.json"  # JSON is YAML
        path.write_text(json.dumps(cfg.model_dump(mode="json")))
        log = (Path(cfg.run_root) / f"{label}.log").open("w")
        print(f"bench {bench}: training run {label} ({run_dir}) ...", flush=True)
        procs[label] = (cfg, log, start_train(path, log))
    out = {}
    for label, (cfg, log, proc) in procs.items():
        rc = proc.wait()
        log.close()
        if rc != 0:
            tail = Path(log.name).read_text()[-3000:]
            raise RuntimeError(f"bench {bench}: training run {label} exited {rc}:\n{tail}")
        out[label] = collect(cfg)
    return out


def start_train(config: Path, output: IO[str] | int, *, resume: bool = False) -> Any:
    """``rollstream train CONFIG [--resume]`` as a process of its own (a benchmark's run), its
    stdout and stderr into ``output`` (an open file, or ``subprocess.DEVNULL``), this package
    first on its ``PYTHONPATH``: a ``subprocess.Popen``. The one place the benchmarks start a
    run (a smoke test of a benchmark starts them warm: tests/warm.py)."""
    return subprocess.Popen([sys.executable, "-m", "rollstream", "train", str(config),
                             *(["--resume"] if resume else [])], stdout=output,
                            stderr=subprocess.STDOUT, env=_child_env())


def _child_env() -> dict[str, str]:
    """This process's environment, with this package first on PYTHONPATH (a worktree's source
    tree is what a child imports, as the parent does)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def collect(cfg: Any) -> dict[str, Any]:
    """One finished run's numbers, from its summary, metrics and ledger."""
    from rollstream.bench.run_reading import read_metrics, reward_se
    from rollstream.data.ledger import read_ledger
    from rollstream.run_files import RunFiles

    run_dir = cfg.run_dir
    summary = json.loads(RunFiles(run_dir).summary.read_text())
    ledger = read_ledger(RunFiles(run_dir).ledger)
    steps = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    gen = sum(s.get("gen_tokens", 0.0) for s in steps)
    trained = sum(s.get("trained_tokens", 0.0) for s in steps)
    last = steps[-1] if steps else {}
    counts = Counter(r.status.value for r in ledger)
    final = summary["reward_final"]
    return {
        "mix": cfg.tasks.mix, "pass_rate": cfg.tasks.pass_rate.enabled,
        "steps": summary["steps"], "train_wall_s": summary["train_wall_s"],
        "max_wall_s": cfg.max_wall_s, "trained_samples": summary["trained_samples"],
        "reward_initial": summary["reward_initial"],
        "reward_final": final if final is not None and not math.isnan(final) else None,
        "reward_final_se": reward_se(ledger, round_index=1),
        "dropped_stale": counts["dropped_stale"], "filtered": counts["filtered"],
        "aborted": counts["aborted"], "failed": counts["failed"],
        "gen_tokens": gen, "trained_tokens": trained,
        "gen_tokens_per_trained_token": gen / trained if trained else math.nan,
        "length_bias_steps": [s["length_bias"] for s in steps if "length_bias" in s],
        "mixture_error_pp": last.get("mixture_error_pp", math.nan),
        "mix_share": {k.split("/", 1)[1]: v for k, v in last.items()
                      if k.startswith("mix_share/")},
        "waste": waste_breakdown(ledger, _bucket_of(cfg)),
    }


def _bucket_of(cfg: Any) -> Any:
    """task uid -> its difficulty bucket, regenerated from the uid (a generated source's
    pass-rate key); a dataset's tasks all fall in one bucket, the source's name."""
    from transformers import AutoTokenizer

    from rollstream.data.mix import TaskMix
    from rollstream.data.sources import Bucketed

    mix = TaskMix(cfg.tasks, AutoTokenizer.from_pretrained(Path(cfg.model.path)))

    def bucket(task_uid: str) -> str:
        name, _, rest = task_uid.partition("/")
        src = mix.source(name)
        if not isinstance(src, Bucketed) or src.num_tasks("train") is not None:
            return name
        split, index = rest.split("/")
        return f"{name}/{src.difficulty(src.task(int(index), split))}"  # type: ignore[arg-type]

    return bucket


def waste_breakdown(ledger: list[LedgerRow], bucket_of: Any) -> dict[str, Any]:
    """Where generated response tokens went (evaluation excluded): ``trained``, zero-variance
    groups ``all_correct`` / ``all_wrong``, ``other`` (dropped stale, aborted, failed); per
    bucket: ``groups``, ``zero_variance`` (share of its groups), ``gen_per_group`` and
    ``trained_per_group`` (tokens)."""
    from rollstream.trajectory import SampleStatus, is_eval_uid

    tokens = dict.fromkeys(("generated", "trained", "all_correct", "all_wrong", "other"), 0)
    groups: dict[str, dict[str, Any]] = {}
    for r in ledger:
        if is_eval_uid(r.sample_uid) or r.is_dataset_row:
            continue
        n = r.num_tokens
        tokens["generated"] += n
        zero = r.status is SampleStatus.FILTERED and ZERO_VARIANCE in (r.reason or "")
        if r.status is SampleStatus.TRAINED:
            part = "trained"
        elif zero:
            part = "all_correct" if (r.reward or 0.0) > 0.5 else "all_wrong"
        else:
            part = "other"
        tokens[part] += n
        g = groups.setdefault(r.sample_uid.rsplit("/", 1)[0],
                              {"task": r.task_uid, "gen": 0, "trained": 0, "zero": False})
        g["gen"] += n
        g["trained"] += n if part == "trained" else 0
        g["zero"] = g["zero"] or zero
    by_bucket: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for g in groups.values():
        by_bucket[bucket_of(g["task"])].append(g)
    buckets = {b: {"groups": len(gs),
                   "zero_variance": sum(g["zero"] for g in gs) / len(gs),
                   "gen_per_group": statistics.fmean(g["gen"] for g in gs),
                   "trained_per_group": statistics.fmean(g["trained"] for g in gs)}
               for b, gs in sorted(by_bucket.items())}
    gen = max(tokens["generated"], 1)
    return {"tokens": tokens, "shares": {k: v / gen for k, v in tokens.items()},
            "buckets": buckets}


def bucket_model(buckets: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Generated ÷ trained tokens if buckets were drawn with these weights: ``as_drawn`` (the
    groups' own counts: reproduces the run's ratio, a check of the model) and ``by_pass_rate``
    (each bucket's count x its informative share 1 - f: the sampler's weights with exact pass
    rates, floor aside)."""
    def ratio(weight: Any) -> float:
        gen = sum(weight(b) * b["gen_per_group"] for b in buckets.values())
        trained = sum(weight(b) * b["trained_per_group"] for b in buckets.values())
        return gen / trained if trained else math.nan

    return {"as_drawn": ratio(lambda b: b["groups"]),
            "by_pass_rate": ratio(lambda b: b["groups"] * (1.0 - b["zero_variance"]))}


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base, on = runs["waste_baseline"], runs["waste_pass_rate"]
    bias = [x for r in runs.values() for x in r["length_bias_steps"]]
    diff, noise = _diff(on, base)
    corrected = runs["mix_corrected"]["mixture_error_pp"]
    waste = on["gen_tokens_per_trained_token"]
    bias_mean = statistics.fmean(bias) if bias else math.nan
    data, data_base = runs.get("dataset_pass_rate"), runs.get("dataset_baseline")
    on_data = () if data is None else (
        data["gen_tokens_per_trained_token"], data_base["gen_tokens_per_trained_token"],
        *_diff(data, data_base))
    return {
        "mixture_error_pp": {"naive": runs["mix_naive"]["mixture_error_pp"],
                             "corrected": corrected},
        "gen_tokens_per_trained_token": waste,
        "gen_tokens_per_trained_token_baseline": base["gen_tokens_per_trained_token"],
        "reward_pass_rate_minus_baseline": diff,
        "reward_noise": noise,
        "length_bias": bias_mean,
        "length_bias_range": [min(bias), max(bias)] if bias else [math.nan, math.nan],
        "bucket_model": bucket_model(base["waste"]["buckets"]),
        # the same pair where tasks recur (pass rates kept per task)
        # (None with --quick, which leaves this pair out)
        **dict(zip(("gen_tokens_per_trained_token_dataset",
                    "gen_tokens_per_trained_token_dataset_baseline",
                    "reward_pass_rate_minus_baseline_dataset", "reward_noise_dataset"),
                   on_data if data is not None else (None,) * 4)),
        "sampling_targets": {
            "mixture_error_pp_corrected_le_2": corrected <= 2.0,
            "gen_tokens_per_trained_token_le_1.4": waste <= 1.4,
            "reward_pass_rate_not_worse_beyond_noise": diff >= -noise,
            "length_bias_within_0.95_1.05": bool(bias) and 0.95 <= min(bias)
            and max(bias) <= 1.05,
        },
        "sampling_runs": runs,
    }


def _diff(on: dict[str, Any], off: dict[str, Any]) -> tuple[float, float]:
    """Final held-out reward on - off, and 2 x its standard error from the evaluation."""
    return (on["reward_final"] - off["reward_final"],
            2 * math.hypot(on["reward_final_se"], off["reward_final_se"]))


def print_table(result: dict[str, Any]) -> None:
    runs = result["sampling_runs"]
    print(f"\n{'run':18s} {'steps':>5s} {'train s':>7s} {'gen/trained':>11s} {'mix err pp':>10s} "
          f"{'len bias':>13s} {'reward':>14s} {'zero-var tok':>12s} {'dropped':>7s}")
    for label, r in runs.items():
        lb = r["length_bias_steps"]
        span = f"{min(lb):.2f}-{max(lb):.2f}" if lb else "-"
        reward = ("-" if r["reward_final"] is None
                  else f"{r['reward_final']:.3f}±{r['reward_final_se']:.3f}")
        shares = r["waste"]["shares"]
        print(f"{label:18s} {r['steps']:5d} {r['train_wall_s']:7.1f} "
              f"{r['gen_tokens_per_trained_token']:11.2f} {r['mixture_error_pp']:10.1f} "
              f"{span:>13s} {reward:>14s} "
              f"{shares['all_correct'] + shares['all_wrong']:12.2f} {r['dropped_stale']:7d}")
    m = result["bucket_model"]
    print(f"mixture_error_pp naive {result['mixture_error_pp']['naive']:.1f}, corrected "
          f"{result['mixture_error_pp']['corrected']:.1f}; gen_tokens_per_trained_token "
          f"{result['gen_tokens_per_trained_token']:.2f} (baseline "
          f"{result['gen_tokens_per_trained_token_baseline']:.2f}; bucket model: as drawn "
          f"{m['as_drawn']:.2f}, by pass rate {m['by_pass_rate']:.2f}); reward on - off "
          f"{result['reward_pass_rate_minus_baseline']:+.3f} (noise "
          f"{result['reward_noise']:.3f}); length_bias {result['length_bias']:.3f}")
    if result["gen_tokens_per_trained_token_dataset"] is not None:
        print(f"on a recurring dataset {result['gen_tokens_per_trained_token_dataset']:.2f} "
              f"(baseline {result['gen_tokens_per_trained_token_dataset_baseline']:.2f})")
