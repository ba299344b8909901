"""``bench models``' mixture-of-experts section: how much of the engine–trainer mismatch
routing replay removes where the two route differently.

The kit's Qwen2-MoE at the demo's shape (``model.tiny.arch: qwen2_moe``, as built, no warm
start) is served by a bfloat16 embedded engine, which samples ``NUM_GROUPS`` groups of
``GROUP_SIZE`` responses (temperature 1, ``MAX_NEW_TOKENS`` tokens); a float32 trainer then
takes one step on those same samples twice, with ``train.routing_replay: off`` and
``replay``. Each step's first forward is the proximal policy, so its ``mismatch`` metric is
the mean |engine logprob − trainer logprob| over the sampled tokens, and
``mismatch_replay_vs_none`` = mismatch with replay / without (target ≤ 0.5).
``routing_agreement`` is the ``off`` step's: the share of recorded (token, layer) top-k sets
that the trainer's own router picks too. Both sides hold the same weights (version 0): the
disagreement measured is the one precision makes (bfloat16 against float32). The ``stale``
rows measure the same after the trainer took ``STALE_STEPS`` updates on these samples first
(at ``train.lr``'s default), as in async k = 2 where samples are two versions old: there the
mismatch holds the policy change too, which replay does not remove.

**Held-out reward each way** (``moe_runs``): two short runs of examples/tick_moe.yaml (its
warm-started model, cached under ``model.cache_dir`` after the first build), ``RUN_STEPS``
steps of async GRPO (k = 2) with a bfloat16 engine, placed as ``bench modes`` places a run:
``replay`` (the YAML's ``train.routing_replay: replay``) then ``no_replay`` (``off``), back to
back with the same seed (the same tasks in the same order; their samples part once the
policies do). Each
run's ``reward_initial`` / ``reward_final`` (held-out reward at the start and the end, with its
standard error), mean ``routing_agreement`` and ``mismatch`` over its steps. A benchmark
measures; it does not assert.

**Bound.** Replay can remove only the part of the mismatch that routing disagreement makes;
what bfloat16 does to the same experts' arithmetic stays. Each sampled token of the same-
weights rows is put on one side: *agreeing* where the trainer's own router (a forward of the
sample alone, no replay) picks the recorded experts at every MoE layer at the position that
predicts it and at every position before it (its attention reads them all), else
*disagreeing*. ``mismatch_agreeing`` / ``mismatch_disagreeing`` are the mean
|engine − trainer| logprob on each side without replay, ``mismatch_disagreeing_replay`` the
disagreeing side's with replay. ``mismatch_replay_vs_none_bound`` = (the agreeing side's sum
+ the disagreeing tokens at the agreeing side's mean) / the sum over all: the ratio if replay
brought every disagreeing token down to the numeric floor of the agreeing ones, the lowest it
can reach here. ``disagreeing_replay_vs_none`` = ``mismatch_disagreeing_replay`` /
``mismatch_disagreeing``: what replay does where it acts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

NUM_GROUPS = 4
GROUP_SIZE = 4
MAX_NEW_TOKENS = 48
STALE_STEPS = 2
RUN_STEPS = 20  # each held-out-reward run's training steps
MOE_YAML = Path(__file__).resolve().parents[3] / "examples" / "tick_moe.yaml"


def bench_moe(folder: Path, *, quick: bool = False) -> dict[str, Any]:
    """The MoE rows (module docstring) for the MoE model folder ``folder`` (``quick``: half
    the groups, half the tokens)."""
    from rollstream.config.schema import LocalEngineConfig, TrainConfig
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import GenerateRequest, SamplingParams
    from rollstream.staleness import StalenessPolicy
    from rollstream.train.trainer import Trainer
    from rollstream.trajectory import Group, SampleStatus, Task

    groups = [Group.new(Task(uid=f"moe/{i}", source="bench", prompt_text="", reference="",
                             prompt_ids=tuple((7 * i + j) % 60 + 3 for j in range(12 + i))),
                        GROUP_SIZE) for i in range(NUM_GROUPS // (2 if quick else 1))]
    samples = [s for g in groups for s in g.samples]
    engine = LocalEngine(folder, LocalEngineConfig(max_slots=16, max_seq_len=128, threads=1,
                                                   device="cpu", dtype="bfloat16"))
    t0 = time.perf_counter()
    try:
        outs = engine.generate_many([GenerateRequest(
            request_id=s.uid, prompt_ids=list(s.task.prompt_ids),
            params=SamplingParams(temperature=1.0, seed=i,
                                  max_new_tokens=MAX_NEW_TOKENS // (2 if quick else 1)))
            for i, s in enumerate(samples)])
    finally:
        engine.shutdown()
    generate_s = time.perf_counter() - t0
    for i, (s, o) in enumerate(zip(samples, outs, strict=True)):
        s.append_policy_tokens(o.token_ids, o.logprobs, o.versions, o.routing)
        s.reward, s.status = float(i % 2), SampleStatus.GRADED
    metrics, split = {}, {}
    for lag in (0, STALE_STEPS):
        for mode in ("off", "replay"):
            trainer = Trainer(TrainConfig(routing_replay=mode, updates_per_step=1), folder,
                              staleness=StalenessPolicy(max_staleness=STALE_STEPS))
            if not lag:  # before its step: the weights the engine sampled with
                split[mode] = trainer.logprobs(samples)
                if mode == "off":
                    split["agree"] = _agreement(trainer, samples)
            for step in range(lag):
                trainer.step(groups, step)
            metrics[f"{mode}{'/stale' if lag else ''}"] = trainer.step(groups, lag).metrics
    stale = _rows(metrics["off/stale"], metrics["replay/stale"])
    return {"engine_dtype": "bfloat16", "trainer_dtype": "float32",
            "num_samples": len(samples), "num_tokens": sum(len(o.token_ids) for o in outs),
            "generate_s": generate_s, **_rows(metrics["off"], metrics["replay"]),
            **_bound(samples, split["off"], split["replay"], split["agree"]),
            **{f"stale_{k}": v for k, v in stale.items()}}


def moe_runs(run_root: Path, cache_dir: Path | None = None, *,
             quick: bool = False) -> dict[str, Any]:
    """The held-out reward of a short run with routing replay and one without (module
    docstring); ``quick``: no warm start, one step each, two held-out prompts (the plumbing,
    not a reading)."""
    import statistics

    from rollstream.bench.modes import bench_overrides
    from rollstream.bench.run_reading import read_metrics
    from rollstream.bench.short_runs import run_back_to_back

    steps = 1 if quick else RUN_STEPS
    common = [*bench_overrides(None, run_root), "engine.local.dtype=bfloat16",
              f"train.steps={steps}"]
    if cache_dir is not None:
        common.append(f"model.cache_dir={cache_dir}")
    if quick:
        common += ["model.warm_start.steps=0", "rollout.filter_zero_variance=false",
                   "tasks.num_eval=2", "eval.samples_per_task=1",
                   "train.groups_per_step=2", "sampling.max_new_tokens=16"]
    rows = {"replay": [], "no_replay": ["train.routing_replay='off'"]}  # quoted: YAML's off
    runs = run_back_to_back(MOE_YAML, common, rows, bench="models")
    out: dict[str, Any] = {"steps": steps, "engine_dtype": "bfloat16"}
    for label, run in runs.items():
        trained = [r for r in read_metrics(run_root / label) if r.get("kind") == "train"]
        out[label] = {k: run[k] for k in ("reward_initial", "reward_final", "reward_final_se",
                                          "trained_samples", "train_wall_s")}
        for key in ("routing_agreement", "mismatch"):
            values = [r[key] for r in trained if r.get(key) is not None]
            out[label][f"{key}_mean"] = statistics.fmean(values) if values else None
    return out


def _agreement(trainer: Any, samples: list[Any]) -> list[list[bool]]:
    """Per sample, per response token: whether ``trainer``'s own router (no replay) picks
    the recorded experts at every MoE layer at the position predicting it and at every
    position before (which its attention reads), with the weights the engine sampled with
    (call before the trainer's step)."""
    import torch

    from rollstream.train.routing import routers, routing_ids

    own: list[Any] = []
    hooks = [r.register_forward_hook(lambda m, a, out: own.append(out[2].detach()))
             for r in routers(trainer.model)]
    out = []
    try:
        with torch.no_grad():
            for s in samples:
                ids, start = [*s.task.prompt_ids, *s.response_ids], len(s.task.prompt_ids)
                own.clear()
                trainer.model(input_ids=torch.tensor([ids]), use_cache=False)
                mine = torch.stack([o.view(len(ids), -1) for o in own], 1).sort(-1).values
                rec = routing_ids(s.routing)
                same = ((mine[:len(rec)] == rec.sort(-1).values).all(-1).all(-1)
                        & (rec >= 0).all(-1).all(-1))
                upto = same.cumprod(0)  # every position so far agreed (attention reads them)
                out.append([bool(upto[start + t - 1]) for t in range(len(s.response_ids))])
    finally:
        for h in hooks:
            h.remove()
    return out


def _bound(samples: list[Any], off: list[list[float]], replay: list[list[float]],
           agree: list[list[bool]]) -> dict[str, float]:
    """The module docstring's **Bound** from per-token logprobs and agreement."""
    sides: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for s, lo, lr, ag in zip(samples, off, replay, agree, strict=True):
        for engine, a, b, same in zip(s.logprobs, lo, lr, ag, strict=True):
            sides[same].append((abs(engine - a), abs(engine - b)))
    agreeing = [d for d, _ in sides[True]]
    floor = sum(agreeing) / max(len(agreeing), 1)
    total = sum(agreeing) + sum(d for d, _ in sides[False])
    dis = sides[False]
    none, replayed = (sum(d for d, _ in dis) / len(dis), sum(r for _, r in dis) / len(dis)) \
        if dis else (float("nan"), float("nan"))
    return {"agreeing_tokens": len(agreeing), "disagreeing_tokens": len(dis),
            "mismatch_agreeing": floor, "mismatch_disagreeing": none,
            "mismatch_disagreeing_replay": replayed,
            "disagreeing_replay_vs_none": replayed / none if dis else float("nan"),
            "mismatch_replay_vs_none_bound": (sum(agreeing) + len(dis) * floor) / total
            if total else float("nan")}


def _rows(off: dict[str, float], replay: dict[str, float]) -> dict[str, float]:
    return {"mismatch_none": off["mismatch"],
            "mismatch_replay": replay["mismatch"],
            "mismatch_kl_none": off["mismatch_kl"],
            "mismatch_kl_replay": replay["mismatch_kl"],
            "mismatch_replay_vs_none": replay["mismatch"] / off["mismatch"],
            "routing_agreement": off["routing_agreement"]}
