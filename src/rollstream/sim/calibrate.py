"""Calibration: fit a cost profile from real runs, and predict those runs with it.

A run directory of ``rollstream train`` on the local engine holds what the fit needs
(docs/run-dir.md): ``engine_passes.jsonl`` (forward-pass times binned by shape),
``metrics.jsonl`` (per step: the wait for the batch and the trainer's time) and
``ledger.jsonl`` (per sample: prompt and trained tokens, the step that trained it). The fits
are least squares (numpy), each weighted by how many passes a bin holds:

* decode step (the CPU form, ``combine: sum``): ``seconds = overhead + per_seq * rows +
  per_context_token * context`` over the decode bins;
* prefill pass: ``seconds = overhead + per_token * tokens`` over the prefill bins;
* trainer step: ``train_s = step_overhead + tokens / tokens_per_s`` over the steps, tokens =
  prompt + kept response tokens of the samples the step trained (what ``SimTrainer`` counts);
* weight sync: the mean time of a weight load (copy, and the cache recompute when rows were
  in flight);
* contention (engines and trainer on the same cores): decode passes recorded during a trainer
  step (``trainer: 1`` in the bins) cost ``1 + contention.engine`` times the others, and a
  trainer step ``1 + contention.trainer * u`` times its cost, ``u`` the engines' busy share
  during it (``engine_busy_in_train`` in ``metrics.jsonl``), fitted jointly with the costs
  (:func:`fit_contended`), so one profile holds a sync run (no overlap) and an async one.

A coefficient the data would make negative is fixed at 0 and the rest refitted (a cost never
shrinks with more work). :func:`replay_scenario` then builds the scenario that simulates a
run: its engines, steps, groups and rollout settings, the fitted profile and the replay of
its ledger (sim/replay.py); :func:`measured` reads the run's own step time and engine
utilization, defined as the simulator defines them (``sim/run.py``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rollstream.config.loader import read_yaml_mapping
from rollstream.config.staleness import StalenessConfig
from rollstream.data.ledger import read_ledger
from rollstream.data.ledger_row import PolicyTurn
from rollstream.run_files import RunFiles
from rollstream.sim.profile import Contention, DecodeCost, PrefillCost, Profile, TrainerCost
from rollstream.sim.scenario import ModeConfig, Scenario
from rollstream.trajectory import SampleStatus


def fit_nonneg(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Least squares ``x @ c ~ y`` (rows weighted by ``w``) with every ``c >= 0``: a
    coefficient that comes out negative is fixed at 0 and the others refitted."""
    sw = np.sqrt(np.ones(len(y)) if w is None else np.asarray(w, dtype=float))
    free = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while free.any():
        sol, *_ = np.linalg.lstsq(x[:, free] * sw[:, None], y * sw, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            return coef
        idx = np.flatnonzero(free)
        free[idx[np.argmin(sol)]] = False
    return coef


def fit_contended(x: np.ndarray, y: np.ndarray, share: np.ndarray,
                  w: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """``y ~ (x @ c) * (1 + k * share)``, every ``c >= 0`` and ``k >= 0``: alternating least
    squares (``c`` for a fixed ``k``, weighted so the residuals stay in ``y``'s units; then
    ``k``'s closed form for the fixed ``c``) until ``k`` settles. ``share`` is how much of
    each row overlapped the other party (0: none, so rows without overlap fit ``c`` alone)."""
    w = np.ones(len(y)) if w is None else np.asarray(w, dtype=float)
    k = 0.0
    for _ in range(100):
        scale = 1 + k * share
        coef = fit_nonneg(x, y / scale, w * scale ** 2)
        base = x @ coef
        den = np.sum(w * (base * share) ** 2)
        k_new = max(0.0, float(np.sum(w * base * share * (y - base)) / den)) if den > 0 else 0.0
        if abs(k_new - k) < 1e-9 * max(1.0, k):
            break
        k = k_new
    return coef, k


def _bins(passes: Sequence[dict[str, Any]], kind: str) -> tuple[np.ndarray, ...]:
    rows = [p for p in passes if p["kind"] == kind and p["count"] > 0]
    if not rows:
        raise ValueError(f"calibration: no {kind} pass recorded (engine_passes.jsonl)")
    count = np.array([p["count"] for p in rows], dtype=float)
    return (np.array([p["rows"] for p in rows], dtype=float), np.array(
        [p["tokens"] for p in rows], dtype=float) / count, np.array(
        [p["seconds"] for p in rows], dtype=float) / count, count,
        np.array([p.get("trainer", 0) for p in rows], dtype=float))


def fit_decode(passes: Sequence[dict[str, Any]]) -> tuple[DecodeCost, float]:
    """``(overhead + per_seq * rows + per_context_token * context) * (1 + contention *
    during_training)`` (combine: sum); returns the cost and the engine's contention."""
    rows, context, seconds, count, during = _bins(passes, "decode")
    c, k = fit_contended(np.column_stack([np.ones_like(rows), rows, context]), seconds,
                         during, count)
    return DecodeCost(overhead_s=c[0], weights_s=0.0, per_seq_s=c[1], per_context_token_s=c[2],
                      combine="sum"), k


def fit_prefill(passes: Sequence[dict[str, Any]]) -> PrefillCost:
    """``overhead + per_token * tokens`` over the prefill passes."""
    _, tokens, seconds, count, during = _bins(passes, "prefill")
    # the engine's contention comes from the decode passes (most of them); prefill passes
    # during training are left out of the base cost rather than fitted a factor of their own
    keep = during == 0 if (during == 0).any() else np.ones_like(during, dtype=bool)
    c = fit_nonneg(np.column_stack([np.ones_like(tokens), tokens])[keep], seconds[keep],
                   count[keep])
    return PrefillCost(overhead_s=c[0], per_token_s=c[1])


def fit_trainer(tokens: Sequence[float], seconds: Sequence[float], devices: int = 1,
                engines_busy: Sequence[float] | None = None) -> tuple[TrainerCost, float]:
    """``(step_overhead + tokens / (tokens_per_s_per_device * devices)) * (1 + contention *
    engines_busy)`` over the steps (``engines_busy``: the engines' busy share during each
    step; None: 0); returns the cost and the trainer's contention. Steps too alike in size to
    separate overhead and rate (the time does not grow with tokens in the fit) charge the
    whole time per token: no overhead, the mean rate."""
    t, s = np.asarray(tokens, dtype=float), np.asarray(seconds, dtype=float)
    u = np.zeros_like(t) if engines_busy is None else np.asarray(engines_busy, dtype=float)
    if t.sum() <= 0:
        raise ValueError("calibration: no trained token in the runs' ledgers")
    c, k = fit_contended(np.column_stack([np.ones_like(t), t]), s, u)
    if c[1] <= 0:
        c = np.array([0.0, float(np.sum(s / (1 + k * u)) / t.sum())])
    return TrainerCost(step_overhead_s=c[0], tokens_per_s_per_device=1.0 / (c[1] * devices)), k


def fit_weight_sync(passes: Sequence[dict[str, Any]]) -> float:
    loads = [p for p in passes if p["kind"] == "load"]
    n = sum(p["count"] for p in loads)
    return sum(p["seconds"] for p in loads) / n if n else 0.0


class RunRecord:
    """What calibration reads from one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        files = RunFiles(self.run_dir)
        self.config = read_yaml_mapping(files.config, "run config")
        path = files.engine_passes
        if not path.exists():
            raise ValueError(f"calibration: {path} is missing (a run of the local engine "
                             "writes it when it ends)")
        self.passes = [json.loads(line) for line in path.read_text().splitlines() if line]
        self.metrics = [json.loads(line) for line in
                        files.metrics.read_text().splitlines() if line]
        self.ledger = list(read_ledger(files.ledger))
        self.summary = json.loads(files.summary.read_text())

    def train_steps(self) -> list[dict[str, Any]]:
        return sorted((m for m in self.metrics if m["kind"] == "train"), key=lambda m: m["step"])

    def trained_tokens_by_step(self) -> dict[int, int]:
        """Prompt + kept response tokens of the samples each step trained (SimTrainer's)."""
        out: dict[int, int] = defaultdict(int)
        for r in self.ledger:
            if r.status is SampleStatus.TRAINED and r.num_trained_tokens:
                out[r.trained_at_step] += (r.prompt_tokens or 0) + r.num_trained_tokens
        return out


def fit_profile(records: Sequence[RunRecord], *, name: str = "cpu_this_machine",
                source: str = "") -> Profile:
    """A profile fitted from every pass and step of ``records`` (same engine and model)."""
    passes = [p for r in records for p in r.passes]
    tokens, seconds, busy = [], [], []
    for r in records:
        by_step = r.trained_tokens_by_step()
        for m in r.train_steps():
            tokens.append(by_step.get(m["step"], 0))
            seconds.append(m["train_s"])
            busy.append(m.get("engine_busy_in_train", 0.0))
    local = records[0].config["engine"]["local"]
    decode, engine_contention = fit_decode(passes)
    trainer, trainer_contention = fit_trainer(tokens, seconds, engines_busy=busy)
    return Profile(
        name=name, source=source or "fitted by rollstream.sim.calibrate from "
        + ", ".join(str(r.run_dir) for r in records),
        decode=decode, prefill=fit_prefill(passes),
        kv_capacity_tokens=local["max_slots"] * local["max_seq_len"],
        max_num_seqs=local["max_slots"], weight_sync_s=fit_weight_sync(passes),
        trainer=trainer, contention=Contention(engine=engine_contention,
                                               trainer=trainer_contention))


def profile_yaml(profile: Profile) -> str:
    return yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False)


def measured(record: RunRecord) -> dict[str, float]:
    """The run's mean step time (the steps' wait for a batch + trainer time: from the start
    of training to its last step) and engine utilization (busy seconds of the engines over
    that time, from the rollout meter's per-step readings)."""
    steps = record.train_steps()
    total = sum(m["wait_s"] + m["train_s"] for m in steps)
    rollout = sorted((m for m in record.metrics if m["kind"] == "rollout"),
                     key=lambda m: m["step"])
    # the meter's readings at each step: engine_busy over the time since the previous one
    t_end = [m["t_s"] for m in rollout]
    spans = np.diff([t_end[0] - (steps[0]["wait_s"] + steps[0]["train_s"]), *t_end])
    busy = sum(m["engine_busy"] * dt for m, dt in zip(rollout, spans, strict=True))
    return {"step_s_mean": total / len(steps),
            "engine_utilization": float(busy / spans.sum())}


def turn_costs(record: RunRecord) -> dict[str, float] | None:
    """Where an agent run's episodes spent their time, per model turn, from the ledger's
    ``turns`` (docs/run-dir.md): the model turn (queueing, generation, interrupts), the tool
    waits, and the harness's own time beside them, which no profile holds: an environment
    turn's seconds beyond its tool wait (the environment's step, rendering its answer), the gaps
    between turns (decoding the model's text) and before the first (the environment's reset,
    rendering the prompt). None for a single-turn run."""
    model_s = tool_s = harness_s = episode_s = 0.0
    turns = 0
    for r in record.ledger:
        ts = r.turns
        if not ts:
            continue
        for t, nxt in zip(ts, [*ts[1:], None], strict=True):
            if isinstance(t, PolicyTurn):
                turns += 1
                model_s += t.duration_s
            else:
                tool_s += t.tool_s
                harness_s += t.duration_s - t.tool_s
            if nxt is not None:
                harness_s += nxt.started_s - t.started_s - t.duration_s
        harness_s += ts[0].started_s  # the environment's reset, rendering the prompt
        episode_s += ts[-1].started_s + ts[-1].duration_s
    if not turns:
        return None
    return {"model_turns": turns, "model_s_per_turn": model_s / turns,
            "tool_s_per_turn": tool_s / turns, "harness_s_per_turn": harness_s / turns,
            "harness_share": harness_s / episode_s if episode_s > 0 else 0.0}


def replay_scenario(record: RunRecord, profile: str) -> Scenario:
    """The scenario that simulates ``record``'s run: its one mode, on ``profile`` (a path or
    a built-in name), replaying its ledger."""
    cfg, ro = record.config, record.config["rollout"]
    on_update = ro["on_update"] if ro.get("partial_rollout", True) else "drain"  # older runs
    st = ro.get("staleness") or {  # older runs: the bounds in rollout and train
        "max_staleness": ro["max_staleness"], "max_context_age": ro.get("max_context_age"),
        "max_token_age": cfg["train"].get("max_token_age")}
    bounds = {k: v for k, v in st.items() if k != "max_staleness" or ro["mode"] == "async"}
    mode = ModeConfig(name=ro["mode"], mode=ro["mode"], on_update=on_update,
                      staleness=StalenessConfig(**bounds))
    return Scenario(name=f"replay-{cfg['name']}", seed=cfg["seed"], profile=profile,
                    engines=len({p["engine_id"] for p in record.passes}),
                    steps=record.summary["steps"], groups_per_step=cfg["train"]["groups_per_step"],
                    group_size=ro["group_size"], filter_zero_variance=ro["filter_zero_variance"],
                    trainer_devices=1, replay=str(record.run_dir), modes=(mode,))
