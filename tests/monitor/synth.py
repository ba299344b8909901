"""A realistic synthetic run for the monitor tests (no controller needed).

2 engines x 8 slots decode samples of long-tailed length; the trainer publishes a new version
every `step_period_s` simulated seconds. Most in-flight samples are interrupted at an update
and resumed on the same slot with the new weights; one in five instead continues across the
update (its span ends on a later version). Samples finish as trained, filtered (zero
variance), dropped_stale or failed; per-step rollout/train/phase records, eval every 10
steps, and staleness/length histograms go through a real `Metrics` registry on a fake clock.
summary.json has the keys a real run writes (``runtime/train.py``), long JSON values included.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rollstream.config.schema import MonitorConfig, RunConfig
from rollstream.monitor.metrics import Metrics

SOURCES = ("tick", "math")


@dataclass(slots=True)
class FakeClock:
    t: float = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


@dataclass(slots=True, kw_only=True)
class Event:
    t: float
    order: int  # ties: spans, then ledger, then step records
    call: str
    args: dict = field(default_factory=dict)


def _samples(rng: random.Random, *, num_steps: int, engines: int, slots: int,
             period: float, tok_s: float) -> tuple[list[Event], list[dict]]:
    events: list[Event] = []
    done: list[dict] = []
    horizon = num_steps * period
    uid = 0
    for engine in range(engines):
        for slot in range(slots):
            t = rng.uniform(0.0, 0.4)
            while t < horizon - 1.0:
                uid += 1
                source = SOURCES[uid % 2]
                length = min(240, int(16 / rng.random() ** (1 / 1.1)))
                cont = rng.random() < 0.2
                remaining, v_min, interrupts = length, int(t // period), 0
                failed = rng.random() < 0.02
                while True:
                    v = int(t // period)
                    next_update = (v + 1) * period
                    t_finish = t + remaining / tok_s
                    if t_finish <= next_update or cont:
                        outcome = "failed" if failed else "done"
                        events.append(Event(t=t_finish, order=0, call="span", args=dict(
                            sample_uid=f"s{uid:05d}", engine_id=engine, slot=slot,
                            t_start_s=round(t, 4), t_end_s=round(t_finish, 4),
                            version_start=v, version_end=int(t_finish // period),
                            num_tokens=remaining, outcome=outcome)))
                        t = t_finish
                        break
                    made = int((next_update - t) * tok_s)
                    events.append(Event(t=next_update, order=0, call="span", args=dict(
                        sample_uid=f"s{uid:05d}", engine_id=engine, slot=slot,
                        t_start_s=round(t, 4), t_end_s=round(next_update, 4),
                        version_start=v, version_end=v, num_tokens=made,
                        outcome="interrupted")))
                    remaining -= made
                    interrupts += 1
                    t = next_update + rng.uniform(0.05, 0.2)  # re-prefill on new weights
                done.append(dict(uid=f"s{uid:05d}", source=source, t_end=t, length=length,
                                 v_min=v_min, interrupts=interrupts, failed=failed))
                t += rng.uniform(0.02, 0.15)  # dispatch gap
    return events, done


def synth_run(run_dir: Path, *, num_steps: int = 40, engines: int = 2, slots: int = 8,
              period: float = 3.0, seed: int = 0, cfg: MonitorConfig | None = None,
              close: bool = True, summary: bool = True,
              eval_steps: tuple[int, ...] | None = None) -> Metrics:
    """Write a whole synthetic run into run_dir through a Metrics registry (``summary``:
    with summary.json, as a run that ended; ``eval_steps``: where it evaluates, by default
    step 1 and every 10th)."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = cfg or MonitorConfig(progress=False)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(RunConfig().model_dump(mode="json")))
    clock = FakeClock()
    metrics = Metrics(run_dir, cfg, clock=clock)
    events, done = _samples(rng, num_steps=num_steps, engines=engines, slots=slots,
                            period=period, tok_s=40.0)
    per_step: dict[int, list[dict]] = {}
    for s in done:
        step = min(math.ceil(s["t_end"] / period), num_steps)
        staleness = step - s["v_min"]
        if s["failed"]:
            status, reason = "failed", rng.choice(["reward timeout", "engine error"])
        elif staleness > 2:
            status, reason = "dropped_stale", f"staleness {staleness} > 2"
        elif rng.random() < 0.15:
            status, reason = "filtered", "zero-variance group"
        else:
            status, reason = "trained", None
        progress = step / num_steps
        reward = float(rng.random() < 0.25 + 0.5 * progress)
        trained = status == "trained"
        kept = s["length"] - (s["length"] // 7)  # tokens the loss kept, when trained
        entry = {"sample_uid": s["uid"], "task_uid": f"t{int(s['uid'][1:]) // 8:04d}",
                 "source": s["source"], "status": status, "reason": reason,
                 "reward": None if status == "failed" else reward, "num_tokens": s["length"],
                 "min_version": s["v_min"], "max_version": step - 1,
                 "num_interrupts": s["interrupts"],
                 "trained_at_step": step if trained else None,
                 "min_trained_version": s["v_min"] if trained else None,
                 "num_trained_tokens": kept if trained else None,
                 # an interrupted sample's later half was sampled by the newest weights
                 "trained_version_sum": (kept * s["v_min"]
                                         + kept // 2 * max(step - 1 - s["v_min"], 0)
                                         if s["interrupts"] else kept * s["v_min"])
                 if trained else None}
        events.append(Event(t=s["t_end"] + 0.01, order=1, call="ledger", args=entry))
        per_step.setdefault(step, []).append(entry)
    for step in range(1, num_steps + 1):
        events.append(Event(t=step * period, order=2, call="step", args={"step": step}))
    for ev in sorted(events, key=lambda e: (e.t, e.order)):
        clock.t = ev.t
        if ev.call == "span":
            metrics.span(**ev.args)
        elif ev.call == "ledger":  # appended as the data ledger does
            with (run_dir / "ledger.jsonl").open("a") as f:
                f.write(json.dumps({**ev.args, "t_s": ev.t}) + "\n")
        else:
            step = ev.args["step"]
            _record_step(metrics, rng, step, num_steps, per_step.get(step, []),
                         eval_steps)
    if summary:
        write_summary(run_dir, num_steps=num_steps, wall_s=num_steps * period, engines=engines)
    if close:
        metrics.close()
    return metrics


def write_summary(run_dir: Path, *, num_steps: int, wall_s: float, engines: int = 2) -> None:
    """The summary.json a run in ``run_dir`` writes when it ends, from its files."""
    def rows(name: str) -> list[dict]:
        return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
    counts: dict[str, int] = {}
    for e in rows("ledger.jsonl"):
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    generated_tokens = sum(s["num_tokens"] for s in rows("timeline.jsonl"))
    train_wall_s = wall_s - 7.25
    (run_dir / "summary.json").write_text(json.dumps({
        "name": run_dir.name, "mode": "async", "reward_initial": 0.27, "reward_final": 0.71,
        "reward_initial_by_source": {"reward/tick": 0.3, "reward/math": 0.24},
        "reward_final_by_source": {"reward/tick": 0.75, "reward/math": 0.67},
        "wall_s": wall_s + 11.5, "train_wall_s": train_wall_s, "steps": num_steps,
        "trained_samples": counts.get("trained", 0), "resumed_from_step": None,
        "superseded_ledger_lines": 0, "generated_tokens": generated_tokens,
        "gen_tok_s": generated_tokens / train_wall_s, "interrupts": 350,
        # one long line in the file, as a real run's per-engine work is
        "engines": {f"local-{i}": {"busy_s": 80.123456 + i, "prefill_s": 3.21987654,
                                   "decode_s": 71.5550123, "load_s": 2.25, "passes": 4096.0}
                    for i in range(engines)},
        "ledger": counts, "unfinished_samples": [], "stop_reason": None, "stalled": False,
        "checkpoint": str(run_dir / "checkpoint"), "trainer_restarts": 0}, indent=2))


def _record_step(metrics: Metrics, rng: random.Random, step: int, num_steps: int,
                 entries: list[dict], eval_steps: tuple[int, ...] | None) -> None:
    trained = [e for e in entries if e["status"] == "trained"]
    stale = [e["trained_at_step"] - e["min_version"] for e in trained] or [0]
    for e in trained:
        metrics.observe("staleness", e["trained_at_step"] - e["min_version"])
        metrics.observe(f"len/{e['source']}", e["num_tokens"])
    progress = step / num_steps
    by_src = {src: [e for e in entries if e["source"] == src] for src in SOURCES}
    metrics.record("rollout", step, {
        "gen_tok_s": 600 + 40 * rng.random() - 80 * (step % 7 == 0),
        "engine_util": 0.85 + 0.1 * rng.random(), "in_flight": 16, "queued": rng.randint(0, 12),
        "interrupts": sum(e["num_interrupts"] for e in entries),
        "resumes": sum(e["num_interrupts"] for e in entries),
        "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
        **{f"len_mean/{src}": (sum(e["num_tokens"] for e in es) / len(es) if es else math.nan)
           for src, es in by_src.items()},
        **{f"pass_rate/{src}": (sum(e["reward"] or 0 for e in es) / len(es) if es else 0.0)
           for src, es in by_src.items()},
        "len_pred_err": 0.3 * rng.random(),
    })
    metrics.record("train", step, {
        "loss": 0.5 * math.exp(-2 * progress) + 0.05 * rng.random(), "kl": 0.01 * progress,
        "clip_frac": 0.05 + 0.05 * rng.random(), "is_weight_mean": 1 + 0.02 * rng.random(),
        "mismatch": 0.001 * rng.random(), "trained_samples": len(trained),
        "reward_mean": 0.25 + 0.5 * progress + 0.05 * rng.random(), "step_s": 0.9,
        "grad_norm": 0.5 + rng.random(),  # an extra name the monitor has not heard of
        "replayed_groups": 1 if step % 5 == 0 else 0,
        "gen_tokens": sum(e["num_tokens"] for e in entries),
        "trained_tokens": sum(e["num_trained_tokens"] for e in trained),
        "mixture_error_pp": 10 * rng.random() / step,
    })
    if step == 12:
        metrics.record("reconfig", step, {"sampling.temperature": 0.7,
                                          "sampling.temperature.old": 1.0})
    metrics.record("phase", step, {"rollout_s": 2.0, "train_s": 0.8, "sync_s": 0.1,
                                   "eval_s": 0.4 if step % 10 == 0 else 0.0})
    evaluates = step % 10 == 0 or step == 1 if eval_steps is None else step in eval_steps
    if evaluates:
        metrics.record("eval", step, {"reward": 0.27 + 0.45 * progress})
