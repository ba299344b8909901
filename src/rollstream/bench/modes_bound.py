"""The most any scheduler could gain over ``sync`` on the machine a ``bench modes`` run
measured, and what a row's share of it is made of.

A step can be no shorter than a trainer step (the ceiling if generation cost nothing) nor than
generating sync's tokens per trained step at the best rate the engine showed in the bench. The
longer of the two bounds the run: ``trainer`` or ``generation``. A row's share of the bound
(its trained tok/s over sync's, over the bound) is then a product of two factors (exactly for
one run each; a row run twice reports the mean of each quantity, so to within its rounding):

- bound by the trainer: the share of the row's time its trainer spent in steps, divided by
  what a trained token cost its trainer relative to sync's (the trainer beside a running
  engine is slower: two threads on two cores share the caches, memory bandwidth and the GIL);
- bound by generation: the engine's rate over the best rate, times the row's trained tokens
  per generated token relative to sync's (what a schedule throws away or keeps). The rate is
  itself the engine's busy share times its rate while busy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.run_files import RunFiles
from rollstream.trajectory import is_eval_uid


@dataclass(frozen=True)
class Bound:
    ceiling: float  # sync step ÷ sync trainer step
    best_rate: float  # tok/s: the probe's saturated rate or any row's, the higher
    bound: float  # sync step ÷ max(trainer step, sync's generated tokens a step ÷ best_rate)
    bound_by: str  # "trainer" or "generation"


def machine_bound(rows: dict[str, dict[str, Any]], saturated_tok_s: float) -> Bound:
    """The bound of a bench whose ``rows`` include ``sync``."""
    sync = rows["sync"]
    sync_step_s = sync["train_wall_s"] / sync["steps"]
    best_rate = max(saturated_tok_s, *(r["gen_tok_s"] for r in rows.values()))
    gen_step_s = sync["generated_tokens"] / sync["steps"] / best_rate
    by_trainer = sync["trainer_step_s"] >= gen_step_s
    return Bound(ceiling=sync_step_s / sync["trainer_step_s"], best_rate=best_rate,
                 bound=sync_step_s / max(sync["trainer_step_s"], gen_step_s),
                 bound_by="trainer" if by_trainer else "generation")


def share_of_bound(row: dict[str, Any], sync: dict[str, Any], b: Bound) -> dict[str, Any]:
    """``row``'s share of the bound and its two factors (module docstring)."""
    share = row["trained_tok_s"] / sync["trained_tok_s"] / b.bound
    if b.bound_by == "trainer":
        stepping = row["steps"] * row["trainer_step_s"] / row["train_wall_s"]
        cost = ((row["trainer_step_s"] / row["trained_tokens"] * row["steps"])
                / (sync["trainer_step_s"] / sync["trained_tokens"] * sync["steps"]))
        factors = {"trainer_stepping": stepping, "trainer_cost_per_token_vs_sync": cost}
    else:
        rate = row["gen_tok_s"] / b.best_rate
        busy = 1.0 - row["engine_idle_share"]
        factors = {"engine_rate_vs_best": rate, "engine_busy": busy,
                   "engine_rate_while_busy_vs_best": rate / busy if busy > 0 else 0.0,
                   "trained_per_generated_vs_sync":
                       (row["trained_tokens"] / row["generated_tokens"])
                       / (sync["trained_tokens"] / sync["generated_tokens"])}
    return {"share": share, "bound_by": b.bound_by, **factors}


def factors_line(label: str, s: dict[str, Any]) -> str:
    """One line: the share and what it is made of."""
    if s["bound_by"] == "trainer":
        return (f"{label}: {s['share']:.2f} of the bound (the trainer's) = trainer stepping "
                f"{s['trainer_stepping']:.2f} ÷ its cost per trained token "
                f"x{s['trainer_cost_per_token_vs_sync']:.2f} of sync's")
    return (f"{label}: {s['share']:.2f} of the bound (generation's) = the engine's rate "
            f"{s['engine_rate_vs_best']:.2f} of the best (busy {s['engine_busy']:.2f} x "
            f"{s['engine_rate_while_busy_vs_best']:.2f} while busy) x trained per generated "
            f"token x{s['trained_per_generated_vs_sync']:.2f} of sync's")


def end_tail_s(run_dir: Path) -> float:
    """Seconds from the last token a run's training phase generated to the start of its final
    evaluation, which follows the last trainer step (both read off ``timeline.jsonl``, one
    clock). With a staleness bound k the engine works up to k batches ahead, and those batches
    complete near the end together; the trainer then works them off with nothing left to
    generate, so the engine idles for about k trainer steps however good the schedule (at
    least the last step's). A longer run dilutes it."""
    path = RunFiles(run_dir).timeline
    if not path.exists():
        return float("nan")
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in spans if not is_eval_uid(r["sample_uid"])]
    if not train:
        return float("nan")
    last_start = max(r["t_start_s"] for r in train)
    final_eval = [r["t_start_s"] for r in spans
                  if is_eval_uid(r["sample_uid"]) and r["t_start_s"] > last_start]
    if not final_eval:
        return float("nan")
    return max(0.0, min(final_eval) - max(r["t_end_s"] for r in train))
