"""The tables ``rollstream bench modes`` prints: engine saturation and contention, the rows,
where each row's tokens and engine time went, the staleness semantics, and the headline
ratios (bench/modes.py measures; this only shows)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rollstream.bench.modes_bound import factors_line


def print_tables(result: dict[str, Any]) -> None:
    """The tables of a ``bench modes`` result (its JSON) on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 170)
    p = result["probe"]
    t = Table(title="engine saturation and contention (engine core "
              f"{result['settings']['engine_core']}, trainer core "
              f"{result['settings']['trainer_core']})")
    for col in ("saturated tok/s", "with trainer tok/s", "trainer step alone s",
                "trainer step with engine s", "GIL wait engine / trainer", "runq"):
        t.add_column(col, justify="right")
    t.add_row(f"{p['saturated_tok_s']:,.0f}", f"{p['engine_tok_s_with_trainer']:,.0f}",
              f"{p['trainer_step_s_alone']:.2f}", f"{p['trainer_step_s_with_engine']:.2f}",
              f"{p['gil_wait_share_engine']:.2f} / {p['gil_wait_share_trainer']:.2f}",
              f"{p['runq_share_engine_and_trainer']:.2f}")
    console.print(t)
    load = result["machine"]["load_before"][0]
    t = Table(title=f"rollstream modes on {Path(result['config']).name} "
              f"({result['settings']['trained_samples_per_config']}"
              f" trained samples each; load {load:.1f}{', quick' if result['quick'] else ''})")
    cols = ("config", "train s", "trained tok/s", "gen tok/s", "engine util", "trainer busy",
            "runq", "reward", "dropped", "filtered", "aborted", "interrupts")
    for col in cols:
        t.add_column(col, justify="right")
    for label, r in result["rows"].items():
        t.add_row(label, f"{r['train_wall_s']:.1f}", f"{r['trained_tok_s']:,.0f}",
                  f"{r['gen_tok_s']:,.0f}", f"{r['engine_utilization']:.2f}",
                  f"{r['trainer_busy']:.2f}", f"{r['runq_share']:.2f}",
                  f"{r['reward_final']:.3f}±{r['reward_final_se']:.3f}",
                  str(r["dropped_stale"]), str(r["filtered"]), str(r["aborted"]),
                  str(r["interrupts"]))
    console.print(t)
    t = Table(title="where generated tokens and engine time went (training phase; shares of "
              "generated tokens; pf = prefill of admitted and resumed requests: passes of their "
              "own, fused into a decode step, tokens of both, seconds of the own passes; attn x = "
              "cache positions decode attention read ÷ those its rows hold; ch/pass = its chunks "
              "a decode pass; stale-blocked, gate-blocked = share of the time admission waited "
              "at the staleness limit, and for a weight load's closed dispatch gate; tail s = "
              "the run's end after its last generated token, the trainer alone)")
    cols = ("gen tok", "kept", "mask", "drop", "filt", "abort", "pf n", "fused", "pf tok", "pf s",
            "recomp s", "sort n", "sort s", "dec s", "attn x", "ch/pass", "eng idle",
            "trn idle", "stale-blocked", "gate-blocked", "tail s")
    t.add_column("config", no_wrap=True)
    for col in cols:
        t.add_column(col, justify="right")
    for label, r in result["rows"].items():
        tok, w = r["tokens"], r["engine_work"]
        gen = max(tok["generated"], 1)
        t.add_row(label, f"{tok['generated']:,}",
                  *(f"{tok[k] / gen:.3f}" for k in ("kept", "masked", "dropped_stale",
                                                    "filtered", "aborted")),
                  f"{w.get('prefill_count', 0):,.0f}", f"{w.get('fused_prefill_count', 0):,.0f}",
                  f"{w.get('prefill_tokens', 0) + w.get('fused_prefill_tokens', 0):,.0f}",
                  f"{w.get('prefill_s', 0):.1f}", f"{w.get('recompute_s', 0):.1f}",
                  f"{w.get('sort_count', 0):,.0f}", f"{w.get('sort_s', 0):.2f}",
                  f"{w.get('decode_s', 0):.1f}",
                  f"{w.get('attention_work', 0) / max(w.get('attention_positions', 0), 1):.2f}",
                  f"{w.get('attention_chunks', 0) / max(w.get('decode_count', 0), 1):.1f}",
                  f"{r['engine_idle_share']:.2f}",
                  f"{r['trainer_idle_share']:.2f}", f"{r['staleness_blocked']:.2f}",
                  f"{r['gate_blocked']:.2f}", f"{r['end_tail_s']:.2f}")
    console.print(t)
    if sem := result["staleness_semantics"]:
        t = Table(title="staleness semantics for long samples (async k=2, partial rollout)")
        for col in ("rule", "row", "train s", "trained samples/s", "reward", "dropped stale",
                    "masked tok", "staleness mean"):
            t.add_column(col, justify="right")
        for rule, r in sem.items():
            t.add_row(rule, r["row"], f"{r['train_wall_s']:.1f}",
                      f"{r['trained_samples_per_s']:.1f}",
                      f"{r['reward_final']:.3f}±{r['reward_final_se']:.3f}",
                      str(r["dropped_stale"]), f"{r['masked_tokens']:,}",
                      f"{r['staleness_mean']:.2f}")
        console.print(t)
    head, drain = result["async_config"], result["drain_config"]
    console.print(
        f"best async ({result['async_best_async_config']}) reaches "
        f"{result['async_best_share_of_bound']:.2f} of this machine's bound "
        f"(x{result['async_bound_vs_sync']:.2f} vs sync); {head} vs {drain}: "
        f"trained samples/s x{result['async_partial_vs_drain']:.2f}, reward "
        f"{result['reward_partial_minus_drain']:+.3f}")
    shares = result["share_of_bound"]
    for label in dict.fromkeys((result["async_best_async_config"], head, drain)):
        console.print(factors_line(label, shares[label]))
    if by_seed := result["async_partial_vs_drain_by_seed"]:
        console.print(f"{head} vs {drain} per seed: "
                      + ", ".join(f"seed {seed} x{x:.2f}" for seed, x in by_seed.items()))
    if spread := result["samples_per_s_run_to_run"]:
        console.print("two runs of one row apart (samples/s, |1 - 2| / mean): "
                      + ", ".join(f"{label} {x:.1%}" for label, x in spread.items()))
    console.print("trainer in a process of its own vs on a thread beside the engine: "
                  + ", ".join(f"{label} x{ratio:.2f}" for label, ratio
                              in result["trainer_process_vs_thread"].items())
                  + " (trained samples/s)")
    console.print(
        f"{result['async_config']} vs sync: trained tok/s x"
        f"{result['async_partial_vs_sync_throughput']:.2f} (ceiling if generation were free: "
        f"x{result['async_ceiling_vs_sync']:.2f}; sync rollout share "
        f"{result['rollout_share_sync']:.2f}); engine utilization "
        f"{result['engine_utilization_async']:.2f} (of its rate beside the trainer: "
        f"{result['engine_utilization_async_contended']:.2f}; busy "
        f"{result['engine_busy_async']:.2f}); reward "
        f"{result['reward_async']:.3f} vs "
        f"{result['reward_sync']:.3f} (noise {result['reward_noise']:.3f}: 2 eval s.e. "
        f"{result['reward_noise_2se']:.3f}, "
        f"2 run-to-run s.d. {2 * result['reward_run_to_run_sd']:.3f})"
    )
