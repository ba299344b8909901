"""Benchmark: partial rollout against drain at the same staleness bound, over many seeds.

    rollstream bench pair [--config YAML] [--seeds N] [--json OUT] [--quick]

``bench modes`` runs its pair (``async_k2_partial``, ``async_k2_drain``) on two seeds, and two
runs of one row there differ by 8-18% (docs/benchmarks.md, 2026-12-04 at 7b90e3b to
7c9031c): as much as the effect it judges. This bench runs only the pairs,
``async_k{k}_partial`` and
``async_k{k}_drain`` for k in ``KS`` (the rows exactly as ``bench modes`` builds them: same
overrides, sizes, placement and model), on ``--seeds`` seeds. A seed fixes the task order and
the sampling, so the two rows of one seed train on the same prompts; they run back to back, in
an order that alternates from seed to seed (P D, D P, ...), so a drift in the machine's load
hits both sides alike.

Per k (``pairs.k{k}``): the ratio partial ÷ drain of trained samples/s seed by seed, their
geometric mean with a 95% confidence interval (Student's t on the log ratios, the seed as the
unit), the final held-out reward's difference partial − drain with its interval, and a
``verdict``: ``partial faster`` (interval above 1), ``drain faster`` (below 1) or ``within
noise``.

The ratio splits, seed by seed and exactly, into three factors (``factors``, each a ratio with
its interval): ``engine_rate`` (generated tokens per second of training), ``length`` (the mean
response length of a trained sample, inverted: what the policy writes, which drifts apart
from seed to seed as the two runs learn differently) and ``waste`` (generated tokens per
trained token, inverted: filtered, dropped and aborted samples).
``partial_vs_drain_equal_length`` (engine_rate × waste) is the ratio with the policy's lengths
set aside: what the schedule decides. Per row, the means over seeds of what explains a gap:
samples/s, generated tokens, the three factors,
the engine's busy share, its decode seconds per generated token, rows a decode pass, and
cache positions per generated token (``engine_work`` of ``bench modes``), and
``decode_by_rows``: its decode passes binned by the rows they held. ``best_partial``,
``best_drain``: each side's fastest k by mean samples/s, and ``best_partial_vs_best_drain``,
the ratio of the two with its seed-by-seed interval (what partial rollout buys when each side
may pick its own bound).

A benchmark measures; it does not assert. Only ratios within one run mean much.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.bench.modes import (
    FULL,
    LONG_YAML,
    QUICK,
    bench_overrides,
    mode_configs,
    row_config,
    run_config,
)
from rollstream.config import load_config
from rollstream.run_files import RunFiles

KS = (1, 2)  # the staleness bounds compared; k=2 is the examples' own and bench modes' pair
SEEDS_FULL, SEEDS_QUICK = 6, 2
SIDES = ("partial", "drain")
# Student's t, two-sided 95%, by degrees of freedom; above 30 the normal quantile
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
         17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (between the
    tabled ones, the next lower: a slightly wider interval)."""
    if df < 1:
        raise ValueError(f"t975: degrees of freedom must be >= 1, got {df}")
    if df > 30:
        return statistics.NormalDist().inv_cdf(0.975)
    return _T975[max(d for d in _T975 if d <= df)]


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% confidence interval of the mean of ``values`` (Student's t);
    with one value the interval is unbounded."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, -math.inf, math.inf
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of ratios, the interval taken on their logs."""
    mean, low, high = interval([math.log(r) for r in ratios])
    return math.exp(mean), math.exp(low), math.exp(high)


def verdict(low: float, high: float) -> str:
    """What a ratio's 95% interval says of partial (numerator) against drain (denominator)."""
    if low > 1.0:
        return "partial faster"
    if high < 1.0:
        return "drain faster"
    return "within noise"


def run_order(seeds: Sequence[int], ks: Sequence[int]) -> list[tuple[int, int, str]]:
    """(seed, k, side) in run order: a seed's two rows of each k back to back, the side that
    goes first alternating from seed to seed for each k (P D, D P, ...) and from one k to the
    next within a seed."""
    out: list[tuple[int, int, str]] = []
    for i, seed in enumerate(seeds):
        for j, k in enumerate(ks):
            sides = SIDES if (i + j) % 2 == 0 else tuple(reversed(SIDES))
            out += [(seed, k, side) for side in sides]
    return out


def engine_reading(run: dict[str, Any]) -> dict[str, float]:
    """What explains a row's rate: the engine's busy share, its decode seconds per generated
    token, rows a decode pass and cache positions per generated token."""
    work, gen = run["engine_work"], max(run["generated_tokens"], 1)
    return {"engine_busy": 1.0 - run["engine_idle_share"],
            "decode_us_per_token": 1e6 * work.get("decode_s", 0.0) / gen,
            "rows_per_pass": gen / max(work.get("decode_count", 0), 1),
            "positions_per_token": work.get("attention_positions", 0) / gen}


ROW_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 96), (97, None))


def _bucket(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def decode_by_rows(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The decode passes of runs (their ``engine_passes.jsonl``) by how many rows a pass held:
    per bucket the share of the row-tokens decoded, microseconds per row-token and cache
    positions per row-token (the context a token was decoded at). A decode pass costs more
    per token with fewer rows and with longer contexts: this says which a row paid."""
    acc = [[0.0, 0, 0] for _ in ROW_BUCKETS]  # seconds, row-tokens, positions
    for run_dir in run_dirs:
        for line in RunFiles(run_dir).engine_passes.read_text().splitlines():
            r = json.loads(line)
            if r["kind"] != "decode":
                continue
            b = next(i for i, (lo, hi) in enumerate(ROW_BUCKETS)
                     if lo <= r["rows"] and (hi is None or r["rows"] <= hi))
            acc[b][0] += r["seconds"]
            acc[b][1] += r["rows"] * r["count"]
            acc[b][2] += r["tokens"]
    total = max(sum(a[1] for a in acc), 1)
    return [{"rows": _bucket(lo, hi), "share": n / total,
             "us_per_token": 1e6 * sec / n if n else None,
             "positions_per_token": pos / n if n else None}
            for (lo, hi), (sec, n, pos) in zip(ROW_BUCKETS, acc, strict=True)]


def rate_factors(run: dict[str, Any]) -> dict[str, float]:
    """A run's trained samples/s as the product of three factors, exactly:
    ``gen_tok_s`` (the engine's generated tokens per second of training) ÷ ``trained_len``
    (mean tokens of a trained sample's response: what the policy writes) ÷
    ``generated_per_trained_token`` (generated tokens per response token of a trained sample,
    masked ones included: the waste of filtered, dropped and aborted samples, ≥ 1)."""
    from rollstream.data.ledger import read_ledger
    from rollstream.trajectory import SampleStatus

    ledger = read_ledger(RunFiles(run["run_dir"]).ledger)
    trained = sum(r.num_tokens for r in ledger if r.status is SampleStatus.TRAINED)
    return {"gen_tok_s": run["gen_tok_s"],
            "trained_len": trained / max(run["trained_samples"], 1),
            "generated_per_trained_token": run["generated_tokens"] / max(trained, 1)}


FACTOR_RATIOS = (  # (key, factor, exponent): partial ÷ drain of trained samples/s, per seed,
    ("engine_rate", "gen_tok_s", 1),  # = engine_rate x length x waste, each to its exponent
    ("length", "trained_len", -1),
    ("waste", "generated_per_trained_token", -1),
)


def summarise_pair(runs: dict[tuple[int, str], dict[str, Any]], k: int) -> dict[str, Any]:
    """One k's pair over the seeds both sides ran."""
    seeds = sorted({seed for seed, _ in runs})
    ratios = [runs[seed, "partial"]["trained_samples_per_s"]
              / runs[seed, "drain"]["trained_samples_per_s"] for seed in seeds]
    factors = {(seed, side): rate_factors(runs[seed, side]) for seed in seeds for side in SIDES}
    factor_ratios = {}
    for key, name, exponent in FACTOR_RATIOS:
        by_seed = [(factors[seed, "partial"][name] / factors[seed, "drain"][name]) ** exponent
                   for seed in seeds]
        mean, low, high = ratio_interval(by_seed)
        factor_ratios[key] = {"by_seed": by_seed, "ratio": mean, "ci95": [low, high]}
    # what the schedule decides, the policy's sample lengths set aside
    equal_length = [r / f for r, f in zip(ratios, factor_ratios["length"]["by_seed"],
                                          strict=True)]
    e_mean, e_low, e_high = ratio_interval(equal_length)
    rewards = [runs[seed, "partial"]["reward_final"] - runs[seed, "drain"]["reward_final"]
               for seed in seeds]
    r_mean, r_low, r_high = ratio_interval(ratios)
    d_mean, d_low, d_high = interval(rewards)
    rows = {}
    for side in SIDES:
        per_seed = [runs[seed, side] for seed in seeds]
        reading = [engine_reading(r) for r in per_seed]
        rows[f"async_k{k}_{side}"] = {
            "trained_samples_per_s": statistics.fmean(
                r["trained_samples_per_s"] for r in per_seed),
            "trained_samples_per_s_by_seed": [r["trained_samples_per_s"] for r in per_seed],
            "reward_final": statistics.fmean(r["reward_final"] for r in per_seed),
            "generated_tokens": statistics.fmean(r["generated_tokens"] for r in per_seed),
            "dropped_stale": statistics.fmean(r["dropped_stale"] for r in per_seed),
            **{name: statistics.fmean(factors[seed, side][name] for seed in seeds)
               for _, name, _ in FACTOR_RATIOS},
            **{key: statistics.fmean(x[key] for x in reading) for key in reading[0]},
            "decode_by_rows": decode_by_rows([r["run_dir"] for r in per_seed]),
        }
    return {"seeds": seeds, "partial_vs_drain_by_seed": ratios,
            "partial_vs_drain": r_mean, "partial_vs_drain_ci95": [r_low, r_high],
            "verdict": verdict(r_low, r_high),
            "factors": factor_ratios,
            "partial_vs_drain_equal_length": e_mean,
            "partial_vs_drain_equal_length_ci95": [e_low, e_high],
            "equal_length_verdict": verdict(e_low, e_high),
            "reward_partial_minus_drain": d_mean,
            "reward_partial_minus_drain_ci95": [d_low, d_high],
            "rows": rows}


def best_of_each_side(runs: dict[tuple[int, int, str], dict[str, Any]],
                      ks: Sequence[int]) -> dict[str, Any]:
    """Each side at its fastest k (mean samples/s over seeds), and the ratio of the two."""
    seeds = sorted({seed for seed, _, _ in runs})

    def mean_rate(k: int, side: str) -> float:
        return statistics.fmean(runs[s, k, side]["trained_samples_per_s"] for s in seeds)

    best = {side: max(ks, key=lambda k: mean_rate(k, side)) for side in SIDES}
    ratios = [runs[s, best["partial"], "partial"]["trained_samples_per_s"]
              / runs[s, best["drain"], "drain"]["trained_samples_per_s"] for s in seeds]
    mean, low, high = ratio_interval(ratios)
    return {"best_partial": f"async_k{best['partial']}_partial",
            "best_drain": f"async_k{best['drain']}_drain",
            "best_partial_vs_best_drain": mean, "best_partial_vs_best_drain_ci95": [low, high],
            "best_verdict": verdict(low, high)}


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = (), config: Path = LONG_YAML, seeds: int | None = None,
         ks: Sequence[int] = KS) -> dict[str, Any]:
    """Run the pairs on ``seeds`` seeds (default 6; --quick: 2, and steps as ``bench modes
    --quick``) on top of ``config``; ``overrides`` apply to every run (tests pass a tiny
    model there)."""
    import torch

    from rollstream.models.warmstart import prepare_model

    torch.set_num_threads(1)  # as bench modes: one thread here, one pinned each for the runs
    n_seeds = seeds if seeds is not None else (SEEDS_QUICK if quick else SEEDS_FULL)
    if n_seeds < 2:
        raise ValueError(f"bench pair: --seeds must be >= 2 (an interval needs two), got {n_seeds}")
    sizes = QUICK if quick else FULL
    base = load_config(config, list(overrides))
    folder = prepare_model(base.model, base.tasks)
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-pair-"))
    common = [
        *overrides, *bench_overrides(folder, run_root), f"train.steps={sizes.steps}",
        f"tasks.num_eval={sizes.num_eval}", f"eval.samples_per_task={sizes.samples_per_task}",
    ]
    modes = dict(mode_configs(base.rollout.staleness_policy().rule,
                              base.rollout.on_update))
    load_before, t0 = os.getloadavg(), time.perf_counter()
    runs: dict[tuple[int, int, str], dict[str, Any]] = {}
    order = run_order([base.seed + i for i in range(n_seeds)], ks)
    for i, (seed, k, side) in enumerate(order):
        label = f"async_k{k}_{side}"
        print(f"bench pair: {label} seed {seed} ({i + 1}/{len(order)}) ...", flush=True)
        cfg = row_config(config, common, [*modes[label], f"name={label}-s{seed}-{i}",
                                          f"seed={seed}"])
        runs[seed, k, side] = {**run_config(cfg), "run_dir": str(cfg.run_dir)}
    pairs = {f"k{k}": summarise_pair({(s, side): r for (s, kk, side), r in runs.items()
                                      if kk == k}, k) for k in ks}
    result = {
        "benchmark": "pair", "quick": quick,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config": str(config),
        "machine": {"cpus": os.cpu_count(), "load_before": list(load_before),
                    "load_after": list(os.getloadavg()),
                    "bench_wall_s": time.perf_counter() - t0},
        "settings": {"seeds": n_seeds, "ks": list(ks), "steps": sizes.steps,
                     "trained_samples_per_run": sizes.steps * base.train.groups_per_step
                     * base.rollout.group_size, "num_eval": sizes.num_eval,
                     "run_order": [f"async_k{k}_{side}/s{seed}" for seed, k, side in order],
                     "run_root": str(run_root)},
        "pairs": pairs,
        **best_of_each_side(runs, ks),
    }
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    print_tables(result)
    return result


def print_tables(result: dict[str, Any]) -> None:
    """The pairs' table and each k's verdict on the terminal."""
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 170)
    s = result["settings"]
    t = Table(title=f"partial rollout vs drain on {Path(result['config']).name} ({s['seeds']} "
              f"seeds x {s['trained_samples_per_run']} trained samples a run; means over seeds"
              f"{', quick' if result['quick'] else ''})")
    for col in ("row", "samples/s", "by seed", "reward", "gen tok", "gen tok/s", "len",
                "gen/trained", "dropped", "engine busy", "decode us/tok", "rows/pass",
                "positions/tok"):
        t.add_column(col, justify="right")
    for pair in result["pairs"].values():
        for label, r in pair["rows"].items():
            t.add_row(label, f"{r['trained_samples_per_s']:.1f}",
                      " ".join(f"{x:.0f}" for x in r["trained_samples_per_s_by_seed"]),
                      f"{r['reward_final']:.3f}", f"{r['generated_tokens']:,.0f}",
                      f"{r['gen_tok_s']:,.0f}", f"{r['trained_len']:.1f}",
                      f"{r['generated_per_trained_token']:.2f}",
                      f"{r['dropped_stale']:.1f}", f"{r['engine_busy']:.2f}",
                      f"{r['decode_us_per_token']:.1f}", f"{r['rows_per_pass']:.1f}",
                      f"{r['positions_per_token']:.1f}")
    console.print(t)
    t = Table(title="decode passes by rows held: share of row-tokens, us per row-token, "
              "positions per row-token (all seeds)")
    t.add_column("row")
    for lo, hi in ROW_BUCKETS:
        t.add_column(f"rows {_bucket(lo, hi)}", justify="right")
    for pair in result["pairs"].values():
        for label, r in pair["rows"].items():
            t.add_row(label, *(f"{b['share']:.0%} {b['us_per_token']:.0f} "
                               f"{b['positions_per_token']:.0f}" if b["us_per_token"] else "-"
                               for b in r["decode_by_rows"]))
    console.print(t)
    for name, pair in result["pairs"].items():
        low, high = pair["partial_vs_drain_ci95"]
        d_low, d_high = pair["reward_partial_minus_drain_ci95"]
        by_seed = ", ".join(f"{x:.2f}" for x in pair["partial_vs_drain_by_seed"])
        console.print(
            f"{name}: partial vs drain x{pair['partial_vs_drain']:.3f} (95% CI {low:.3f}-"
            f"{high:.3f}; by seed {by_seed}): {pair['verdict']}; reward "
            f"{pair['reward_partial_minus_drain']:+.3f} (95% CI {d_low:+.3f} to {d_high:+.3f})")
        parts = [f"{key} x{f['ratio']:.3f} ({f['ci95'][0]:.3f}-{f['ci95'][1]:.3f})"
                 for key, f in pair["factors"].items()]
        low, high = pair["partial_vs_drain_equal_length_ci95"]
        console.print(
            f"  = {' x '.join(parts)}; at equal length (engine_rate x waste) "
            f"x{pair['partial_vs_drain_equal_length']:.3f} (95% CI {low:.3f}-{high:.3f}): "
            f"{pair['equal_length_verdict']}")
    low, high = result["best_partial_vs_best_drain_ci95"]
    console.print(f"each side at its fastest k: {result['best_partial']} vs "
                  f"{result['best_drain']} x{result['best_partial_vs_best_drain']:.3f} (95% CI "
                  f"{low:.3f}-{high:.3f}): {result['best_verdict']}")
