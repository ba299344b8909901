"""Benchmark: where requests wait and in what order, on a synchronous rollout's makespan.

    rollstream bench dispatch [--json OUT] [--quick]

The workload: ``examples/tick_long.yaml``'s warm-started model (cached) on a mix of two
sources of the tick family with different lengths and pass rates, ``long`` (up to 64 items,
responses up to 480 tokens) and ``short`` (up to 6 items), half each; 16 groups x 8 samples
per batch (128 requests) on two embedded engines of 16 slots each (32 slots: fewer than a
batch's requests), temperature 1, every request seeded by its sample id, weights fixed (no
training: this measures dispatch alone).

Each batch is generated once per dispatch setting, in turn, by a dispatcher of its own
(each keeps its length history across batches; a first batch, not timed, fills it):

* ``engine``: today's default, every request sent at once to the least-loaded engine, which
  queues it (first come, first served);
* ``fifo``: requests wait in the dispatcher and take free slots in arrival order;
* ``longest_first``: the same, most predicted tokens left first (docs/dispatch.md);
* ``oracle``: ``longest_first`` told every sample's true length (from the ``engine`` run of
  the same batch: seeded requests generate the same tokens in any order).

The makespan of a batch is the wall time from its first request to its last sample
generated (a trivial reward grades at once). Settings are interleaved per batch, so a slow
moment of the machine hits all of them alike. Keys: ``predictive_makespan_reduction`` (1 -
longest_first / engine, target >= 0.2), ``predictive_vs_dispatcher_fifo`` (1 -
longest_first / fifo), ``predictive_vs_oracle`` (oracle / longest_first, target >= 0.9),
``len_pred_err`` (mean over the timed batches' samples, longest_first's predictor), and per
setting the mean makespan and its per-batch values; ``same_tokens`` checks that every setting
generated the same lengths.

Then the other keys, which need training runs (bench/sampling.py: the mixture
error naive vs deficit-corrected, generated tokens per trained token with and without
pass-rate-aware sampling at equal wall time, the length bias of async training), in the same
JSON and a second table.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.trajectory import Group, Sample, Task

ROOT = Path(__file__).resolve().parents[3]
LONG_YAML = ROOT / "examples" / "tick_long.yaml"
SETTINGS = ("engine", "fifo", "longest_first", "oracle")


class _Oracle:
    """A length predictor that knows every sample's length (from an earlier run)."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths
        self.errors: list[float] = []

    def predict(self, sample: Sample) -> float:
        return float(self.lengths.get(sample.uid, 1))

    def rank(self, sample: Sample) -> tuple[float, int]:
        return self.predict(sample), 0

    def started(self, sample: Sample) -> None: ...

    def observe(self, sample: Sample, length: int) -> None: ...

    def forget(self, group_id: str) -> None: ...

    def take_errors(self) -> list[float]:
        return []


async def _batch(disp: Any, tasks: list[Task], group_size: int, index: int) -> tuple[float, dict]:
    groups = [Group.new(t, group_size, k=index * len(tasks) + i) for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    await asyncio.gather(*(disp.run_group(g) for g in groups))
    makespan = time.perf_counter() - t0
    for g in groups:
        disp.forget(g.group_id)
    lengths = {s.uid: s.num_response_tokens for g in groups for s in g.samples}
    return makespan, lengths


async def _run(folder: Path, batches: list[list[Task]], *, group_size: int, slots: int,
               max_new_tokens: int, stop: tuple[int, ...]) -> dict[str, Any]:
    from rollstream.clock import WallClock
    from rollstream.config.schema import LocalEngineConfig, RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle

    async def graded(task: Task, text: str) -> float:
        return 0.0

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    engines = [LocalEngine(folder, LocalEngineConfig(
        max_slots=slots, max_seq_len=640, threads=1, device="cpu",
        cpu_affinity=(cores[i % len(cores)],) if cores else ()), engine_id=f"local-{i}")
        for i in range(2)]
    graders = GraderPool(RewardConfig(), lambda _: get_reward(graded))
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    oracle = _Oracle({})

    def dispatcher(setting: str) -> Dispatcher:
        disp = Dispatcher(engines=engines, params=params, graders=graders, decode=lambda ids: "",
                          clock=WallClock(), lifecycle=Lifecycle(Ledger(), WallClock()), seed=0,
                          dispatch="longest_first" if setting == "oracle" else setting)  # type: ignore[arg-type]
        if setting == "oracle":
            disp.predictor = oracle  # type: ignore[assignment]
        return disp

    disps = {s: dispatcher(s) for s in SETTINGS}
    rows: dict[str, list[float]] = {s: [] for s in SETTINGS}
    same = True
    errors: list[float] = []
    try:
        for b, tasks in enumerate(batches):
            lengths: dict[str, int] | None = None
            for setting in SETTINGS:
                makespan, got = await _batch(disps[setting], tasks, group_size, b)
                if setting == "engine":
                    lengths = got
                    oracle.lengths = got
                else:
                    same = same and got == lengths
                if setting == "longest_first":
                    taken = disps[setting].predictor.take_errors()
                    if b > 0:
                        errors.extend(taken)
                if b > 0:  # the first batch fills each dispatcher's length history
                    rows[setting].append(makespan)
                print(f"bench dispatch: batch {b} {setting:13s} {makespan:6.2f} s", flush=True)
    finally:
        for e in engines:
            await e.close()
        graders.close()
    return {"makespans": rows, "same_tokens": same,
            "len_pred_err": statistics.fmean(errors) if errors else float("nan")}


def main(json_out: Path | None = None, quick: bool = False, *,
         overrides: list[str] | None = None, run_root: Path | None = None) -> dict[str, Any]:
    """The makespans, then the training runs of bench/sampling.py (their run directories under
    ``run_root``, a temporary folder by default)."""
    import torch
    from transformers import AutoTokenizer

    from rollstream.bench import sampling
    from rollstream.config import load_config
    from rollstream.data.mix import TaskMix
    from rollstream.models.warmstart import prepare_model

    torch.set_num_threads(1)
    base = load_config(LONG_YAML, list(overrides or []))
    folder = prepare_model(base.model, base.tasks)  # cached: the tick_long warm start
    num_batches, groups, group_size, slots = (3, 8, 4, 8) if quick else (13, 16, 8, 16)
    max_items = min(64, base.tasks.sources[0].max_items)
    mixed = load_config(LONG_YAML, [
        *(overrides or []), "tasks.mix=weighted",
        f"tasks.sources=[{{kind: tick, name: long, max_items: {max_items}}}, "
        "{kind: tick, name: short, max_items: 6}]"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    mix = TaskMix(mixed.tasks, tokenizer)
    batches = [[mix.next_task() for _ in range(groups)] for _ in range(num_batches)]
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    run = asyncio.run(_run(folder, batches, group_size=group_size, slots=slots,
                           max_new_tokens=base.sampling.max_new_tokens, stop=stop))
    mean = {s: statistics.fmean(v) for s, v in run["makespans"].items()}
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-dispatch-"))
    trained = sampling.measure(quick=quick, overrides=list(overrides or []), run_root=run_root)
    result = {
        "bench": "dispatch",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "workload": {"config": str(LONG_YAML.relative_to(ROOT)),
                     "sources": {"long": f"tick, 1-{max_items} items", "short": "tick, 1-6 items"},
                     "groups_per_batch": groups, "group_size": group_size,
                     "engines": 2, "slots_per_engine": slots, "timed_batches": num_batches - 1,
                     "max_new_tokens": base.sampling.max_new_tokens, "temperature": 1.0},
        "makespan_s": mean,
        "makespan_s_per_batch": run["makespans"],
        "predictive_makespan_reduction": 1 - mean["longest_first"] / mean["engine"],
        "predictive_vs_dispatcher_fifo": 1 - mean["longest_first"] / mean["fifo"],
        "predictive_vs_oracle": mean["oracle"] / mean["longest_first"],
        "len_pred_err": run["len_pred_err"],
        "same_tokens": run["same_tokens"],
        **trained,
        "load_before": load_before, "load_after": os.getloadavg(),
        "bench_wall_s": time.perf_counter() - t0,
    }
    print(f"\n{'setting':14s} {'makespan s':>10s}  per batch")
    for s in SETTINGS:
        per = " ".join(f"{x:.2f}" for x in run["makespans"][s])
        print(f"{s:14s} {mean[s]:10.2f}  {per}")
    print(f"predictive_makespan_reduction {result['predictive_makespan_reduction']:.3f} "
          f"(vs dispatcher fifo {result['predictive_vs_dispatcher_fifo']:.3f}), "
          f"predictive_vs_oracle {result['predictive_vs_oracle']:.3f}, "
          f"len_pred_err {result['len_pred_err']:.3f}, same tokens: {result['same_tokens']}")
    sampling.print_table(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(json_out=Path(tempfile.gettempdir()) / "dispatch.json")
