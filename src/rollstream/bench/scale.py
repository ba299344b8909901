"""Benchmark: the embedded runtime vs ``runtime.kind: ray`` on this host.

    rollstream bench scale [--json OUT] [--quick]

**Training rows**, each a ``rollstream train`` process of examples/tick.yaml (the demo's
warm-started model from the cache, async k=2 with partial rollout, 16 groups x 8 samples per
step), the same config but for the runtime, one run at a time:

* ``embedded``: engine and trainer as threads of one process, the engine's step thread pinned
  to core 0 and the trainer's to core 1 (``bench modes``' placement);
* ``ray_disaggregated``: ``runtime.ray.placement=disaggregated``: the engine actor (its own
  process) on core 0, the trainer's thread on core 1 (the placement pins them itself);
* ``ray_colocated`` (not with ``--quick``): ``placement=colocated``, sharing both cores and
  taking turns;
* ``ray_out_of_band``: ``ray_disaggregated`` with ``runtime.ray.out_of_band_bytes=0``: every
  token payload through the object store, so both planes carry a sample (at the default
  threshold the demo's payloads all ride the calls).

Full: two rounds in the order A B C D, then D C B A, so a drift in the machine's load hits every
row alike; each row keeps its faster run (``bench modes``' rule) and every run is kept under
``runs``. Trained samples/s = trained samples over the steps' ``wait_s + train_s`` in
``metrics.jsonl``, so Ray's start, the model load and the evaluations are left out.

**In this process**, on a local Ray of 2 CPUs after the rows: weight sync seconds per MB per
path of ``runtime.ray.weight_sync`` (``bench weightsync``'s measurement, on the run's model
and, full, its bigger model), and the restart of an engine actor: an actor serving version v
is killed with ``ray.kill``; the proxy notices through its stats poll (``detect_s``), then
:meth:`RayEngine.restart` spawns a new actor and installs v (``replace_s``); timed until a
request on the new actor returns tokens of version v (``actor_restart_s``, median of
``restart_trials``); and a payload's round trip to an actor, riding the calls or through the
object store, by size (:func:`payload_round_trips`: where ``runtime.ray.out_of_band_bytes``
pays).

**Bytes per sample on each plane**: each Ray row's proxies count the pickled payload of every
call they make to their actor and of its reply (the control plane: ``runtime/ray/wire.py``:
generate, interrupt, stats polls, peeks; weights excluded) and, apart, the token payloads
that went through the object store (the data plane: those above
``runtime.ray.out_of_band_bytes``), training phase only (``summary.json``'s ``engines``),
divided by trained samples and by generated samples (every training sample that reached the
ledger: trained, filtered, dropped). A continuing request (a sample resumed after an
interrupt) sends only the tokens its actor does not hold (``episode_reused_tokens``).

**Multi-node rows** (``scale_nodes.py``), on a 3-node Ray cluster of this host between the
training rows and the in-process part: ``multinode_vs_single_node_samples_per_s`` (engines on
other nodes than the driver's against every actor on the driver's node: on one host, process
and object-store overhead, not a network), and a run an engine joins (``engine_join_s``) and
an engine node leaves (``node_loss_lost_samples``, by the ledger audit).

A benchmark measures; it does not assert. The machine is shared: the JSON records the load
average before and after.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollstream.bench.run_reading import row_numbers
from rollstream.bench.sampling import DEMO_YAML
from rollstream.bench.scale_nodes import ON_NODES, ONE_NODE, headline, on_nodes, print_nodes

EMBEDDED, DISAGGREGATED, COLOCATED = "embedded", "ray_disaggregated", "ray_colocated"
OUT_OF_BAND = "ray_out_of_band"
RAY = ["runtime.kind=ray", f"runtime.ray.object_store_bytes={256 << 20}"]
ROWS: dict[str, list[str]] = {
    EMBEDDED: [],  # bench_overrides pins engine and trainer threads
    # the placements pin (or share) the cores themselves: bench_overrides' pins would contradict
    DISAGGREGATED: [*RAY, "runtime.ray.placement=disaggregated",
                    "engine.local.cpu_affinity=[]", "train.cpu_affinity=[]"],
    # every token payload through the object store: both planes at work
    OUT_OF_BAND: [*RAY, "runtime.ray.placement=disaggregated", "runtime.ray.out_of_band_bytes=0",
                  "engine.local.cpu_affinity=[]", "train.cpu_affinity=[]"],
    COLOCATED: [*RAY, "runtime.ray.placement=colocated",
                "engine.local.cpu_affinity=[]", "train.cpu_affinity=[]"],
}


@dataclass(slots=True, kw_only=True, frozen=True)
class Sizes:
    steps: int
    num_eval: int
    samples_per_task: int
    rows: tuple[str, ...]
    rounds: int
    bigger_model: bool  # weight sync on bench weightsync's bigger model too
    restart_trials: int
    payload_bytes: tuple[int, ...]  # payload sizes timed inline and out of band
    payload_trials: int
    node_rounds: int  # rounds of the multi-node rows (bench/scale_nodes.py)
    operated_steps: int  # steps of the run an engine joins and a node leaves
    extra: tuple[str, ...] = ()


FULL = Sizes(steps=12, num_eval=32, samples_per_task=4,
             rows=(EMBEDDED, DISAGGREGATED, COLOCATED, OUT_OF_BAND),
             rounds=2, bigger_model=True, restart_trials=3,
             payload_bytes=tuple(1 << k for k in range(8, 23, 2)), payload_trials=50,
             node_rounds=2, operated_steps=12)
# a smoke run: a test's barely trained model solves nothing; keep every group
QUICK = Sizes(steps=2, num_eval=4, samples_per_task=1, rows=(EMBEDDED, DISAGGREGATED, OUT_OF_BAND),
              rounds=1,
              bigger_model=False, restart_trials=1, payload_bytes=(1 << 10, 1 << 20),
              payload_trials=3, node_rounds=1, operated_steps=5,
              extra=("train.groups_per_step=2", "rollout.group_size=4", "reward.num_workers=1",
                     "rollout.filter_zero_variance=false"))


def run_order(sizes: Sizes, rows: Sequence[str] | None = None,
              rounds: int | None = None) -> list[str]:
    """Rows in run order: A B C, then C B A, ... (one round with --quick)."""
    rows, rounds = tuple(rows or sizes.rows), rounds or sizes.rounds
    return [row for i in range(rounds) for row in (rows if i % 2 == 0 else rows[::-1])]


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``overrides`` (key=value) apply to every row (tests pass a tiny model there)."""
    import torch

    from rollstream.bench.modes import bench_overrides
    from rollstream.bench.sampling import run_pair
    from rollstream.config import load_config
    from rollstream.models.warmstart import prepare_model

    torch.set_num_threads(1)  # a warm start that is not cached yet runs here (bench modes)
    sizes = QUICK if quick else FULL
    base = load_config(DEMO_YAML, list(overrides))
    folder = prepare_model(base.model, base.tasks)
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-scale-"))
    common = [*overrides, *bench_overrides(folder, run_root), *sizes.extra,
              f"train.steps={sizes.steps}", f"tasks.num_eval={sizes.num_eval}",
              f"eval.samples_per_task={sizes.samples_per_task}"]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, row in enumerate(run_order(sizes)):
        label, load = f"{row}-{i}", os.getloadavg()[0]
        done = run_pair(common, {label: ROWS[row]}, bench="scale")[label]
        runs.setdefault(row, []).append({**row_numbers(run_root / label, done),
                                         "load_before": load})
    nodes = on_nodes(common, run_order(sizes, (ON_NODES, ONE_NODE), sizes.node_rounds),
                     sizes.operated_steps)
    in_process = {**on_ray(folder, sizes), "nodes": nodes}
    rows = {row: {**max(r, key=lambda x: x["samples_per_s"]), "runs": r}
            for row, r in runs.items()}
    result = summarise(rows, in_process, quick=quick, sizes=sizes, folder=folder,
                       load_before=load_before, bench_wall_s=time.perf_counter() - t0,
                       run_root=run_root)
    print_table(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


# ---- on a local Ray in this process -----------------------------------------------------
def on_ray(folder: Path, sizes: Sizes) -> dict[str, Any]:
    """Weight sync s/MB per path (bench weightsync's) and the actor restart, on a local Ray
    of 2 CPUs (bench weightsync's)."""
    from rollstream.bench import weightsync
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster

    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=1 << 30))
    try:
        models = {"run_model": asyncio.run(weightsync.bench_model(folder))}
        if sizes.bigger_model:
            with tempfile.TemporaryDirectory() as tmp:
                bigger = weightsync.build_model(Path(tmp) / "bigger", **weightsync.BIGGER)
                models["bigger"] = asyncio.run(weightsync.bench_model(bigger))
        restart = asyncio.run(restart_seconds(folder, sizes.restart_trials))
        payloads = payload_round_trips(sizes.payload_bytes, sizes.payload_trials)
    finally:
        cluster.stop()
    return {"weight_sync": models, "restart": restart, "payloads": payloads}


class _Echo:
    """An actor that returns a payload as it came (``inline``), or puts it in the object
    store and returns its reference (``by_ref``): a generate call's two ways, without the
    engine."""

    def inline(self, blob: bytes) -> bytes:
        return blob

    def by_ref(self, blob: bytes) -> Any:  # Ray fetched the argument's reference
        import ray

        return [ray.put(blob)]  # a list: a returned reference alone would be resolved


def payload_round_trips(sizes: Sequence[int], trials: int) -> dict[str, Any]:
    """Seconds per round trip of a payload of each size to an actor and back, one call at a
    time: riding the call both ways, or through the object store both ways (``ray.put`` by
    the driver, by the actor for the reply; the calls carry the references), as
    ``runtime.ray.out_of_band_bytes`` chooses; median of ``trials`` after a warm-up."""
    import ray

    actor = ray.remote(_Echo).options(num_cpus=0).remote()
    try:
        out: dict[str, Any] = {}
        for size in sizes:
            blob = os.urandom(size)
            times: dict[str, list[float]] = {"inline_s": [], "out_of_band_s": []}
            for i in range(trials + 1):
                t0 = time.perf_counter()
                back = ray.get(actor.inline.remote(blob))
                t1 = time.perf_counter()
                (ref,) = ray.get(actor.by_ref.remote(ray.put(blob)))
                back2 = ray.get(ref)
                t2 = time.perf_counter()
                assert back == blob and back2 == blob
                if i:  # the first is a warm-up
                    times["inline_s"].append(t1 - t0)
                    times["out_of_band_s"].append(t2 - t1)
            med = {k: statistics.median(v) for k, v in times.items()}
            out[str(size)] = {**med, "out_of_band_vs_inline":
                              med["out_of_band_s"] / med["inline_s"]}
        return {"trials": trials, "by_bytes": out}
    finally:
        ray.kill(actor, no_restart=True)


async def restart_seconds(folder: Path, trials: int) -> dict[str, Any]:
    """Kill the engine actor ``trials`` times, each time serving a new version v: seconds
    until the proxy noticed (its stats poll), until :meth:`RayEngine.restart` returned (a new
    actor placed, with the model folder's weights, then v's tensors, as the rollout's
    supervisor has weight sync do it), and until a request on the new actor returned tokens of
    version v."""
    import ray
    from safetensors.torch import load_file

    from rollstream.config.schema import LocalEngineConfig
    from rollstream.engine.protocol import GenerateRequest, SamplingParams
    from rollstream.engine.states import EngineHealth
    from rollstream.runtime.ray.engines import build_ray_engines

    state = load_file(folder / "model.safetensors")
    cfg = LocalEngineConfig(max_slots=4, max_seq_len=64, threads=1, max_restarts=trials)
    (engine,) = build_ray_engines(folder, cfg, num_engines=1, version=0, num_cpus=1)
    params = SamplingParams(max_new_tokens=8, seed=0)
    out: list[dict[str, float]] = []
    try:
        for version in range(1, trials + 1):
            tensors = {k: t.clone() for k, t in state.items()}
            await engine.load_weights(version, tensors)
            t0 = time.perf_counter()
            ray.kill(engine.actor, no_restart=True)
            while engine.stats().health is EngineHealth.UP:
                await asyncio.sleep(0.001)
            t_detect = time.perf_counter()
            while not engine.needs_restart():  # its replacement is placed
                await asyncio.sleep(0.001)
            await engine.restart(version, tensors)
            t_up = time.perf_counter()
            served = await engine.generate(GenerateRequest(
                request_id=f"after-{version}", prompt_ids=[1, 2, 3], params=params))
            t_served = time.perf_counter()
            if served.error or set(served.versions) != {version}:
                raise RuntimeError(f"the restarted actor did not serve version {version}: "
                                   f"{served.error or served.versions}")
            out.append({"detect_s": t_detect - t0, "replace_s": t_up - t_detect,
                        "actor_restart_s": t_served - t0})
    finally:
        await engine.close()
    return {"trials": out, **{k: statistics.median(t[k] for t in out) for k in out[0]}}


# ---- the result -------------------------------------------------------------------------
def summarise(rows: dict[str, dict[str, Any]], on_ray: dict[str, Any], *, quick: bool,
              sizes: Sizes, folder: Path, load_before: tuple[float, float, float],
              bench_wall_s: float, run_root: Path) -> dict[str, Any]:
    emb, ray_row = rows[EMBEDDED], rows[DISAGGREGATED]

    def vs_embedded(row: str) -> float:
        return rows[row]["samples_per_s"] / emb["samples_per_s"]

    # the ratio within each round (runs of one round are neighbours in time)
    by_round = [r["samples_per_s"] / e["samples_per_s"]
                for e, r in zip(emb["runs"], ray_row["runs"], strict=True)]
    restart = on_ray["restart"]
    return {
        "benchmark": "scale",
        "quick": quick,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_before": list(load_before),
                    "load_after": list(os.getloadavg()), "bench_wall_s": bench_wall_s},
        "settings": {"config": str(DEMO_YAML), "model": str(folder), "steps": sizes.steps,
                     "rounds": sizes.rounds, "order": run_order(sizes),
                     "num_eval": sizes.num_eval, "extra": list(sizes.extra),
                     "rows": {row: ROWS[row] for row in sizes.rows}, "run_root": str(run_root)},
        "rows": rows,
        "ray_vs_embedded_samples_per_s": vs_embedded(DISAGGREGATED),
        "ray_vs_embedded_samples_per_s_by_round": by_round,
        "ray_colocated_vs_embedded_samples_per_s":
            vs_embedded(COLOCATED) if COLOCATED in rows else None,
        "weight_sync_s_per_mb": {path: m["s_per_mb"] for path, m in
                                 on_ray["weight_sync"]["run_model"]["paths"].items()},
        "weight_sync": on_ray["weight_sync"],
        "control_plane_bytes_per_sample": {
            "per_trained_sample": ray_row["control_plane_bytes_per_trained_sample"],
            "per_generated_sample": ray_row["control_plane_bytes_per_generated_sample"],
            "sent_per_trained_sample": ray_row["wire_sent_bytes"] / ray_row["trained_samples"],
            "received_per_trained_sample":
                ray_row["wire_received_bytes"] / ray_row["trained_samples"],
            "calls_per_trained_sample": ray_row["wire_calls"] / ray_row["trained_samples"],
            "row": DISAGGREGATED,
            "note": "pickled payload of every generate, interrupt, stats and peek call and "
                    "reply, training phase, token payloads up to runtime.ray.out_of_band_bytes "
                    "included; Ray's per-call framing and weights not counted",
        },
        "bytes_per_trained_sample_by_plane": {row: planes(r) for row, r in rows.items()
                                               if row != EMBEDDED},
        "payload_round_trips": on_ray["payloads"],
        "actor_restart_s": restart["actor_restart_s"],
        # the multi-node rows (bench/scale_nodes.py)
        **headline(on_ray["nodes"]), "nodes": on_ray["nodes"],
        "actor_restart": restart,
        "targets": {"ray_vs_embedded_samples_per_s_ge_1":
                    rows[DISAGGREGATED]["samples_per_s"] >= emb["samples_per_s"]},
    }


def planes(row: dict[str, Any]) -> dict[str, float]:
    """A Ray row's bytes per trained sample on each plane, and what its episodes reused."""
    n = row["trained_samples"]
    return {"control": row["control_plane_bytes_per_trained_sample"],
            "data": row["data_plane_bytes_per_trained_sample"],
            "control_sent": row["wire_sent_bytes"] / n,
            "control_received": row["wire_received_bytes"] / n,
            "data_sent": row["data_sent_bytes"] / n,
            "data_received": row["data_received_bytes"] / n,
            "calls": row["wire_calls"] / n, "data_objects": row["data_objects"] / n,
            "reused_prompt_tokens": row["episode_reused_tokens"] / n,
            "episode_misses": row["episode_misses"]}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)  # a log file is not a terminal: no 80-column wrap
    table = Table(title="bench scale: examples/tick.yaml, one run per row and round "
                        "(samples/s: trained ÷ the steps' wait_s + train_s)")
    for col in ("row", "samples/s (runs)", "train s", "wait share", "train_s / step",
                "engine busy", "engine tok / busy s", "gen tok/s", "reward final",
                "ctl / data bytes per trained sample"):
        table.add_column(col)
    for row, r in result["rows"].items():
        runs = " / ".join(f"{x['samples_per_s']:.1f}" for x in r["runs"])
        ctl = (f"{r['control_plane_bytes_per_trained_sample']:,.0f} / "
               f"{r['data_plane_bytes_per_trained_sample']:,.0f}") if r["wire_calls"] else "-"
        table.add_row(row, f"{r['samples_per_s']:.1f} ({runs})", f"{r['train_wall_s']:.1f}",
                      f"{r['wait_share']:.2f}", f"{r['train_s_mean']:.2f}",
                      f"{r['engine_busy_share']:.2f}", f"{r['engine_tok_per_busy_s']:,.0f}",
                      f"{r['gen_tok_s']:,.0f}",
                      f"{r['reward_final']:.3f} ± {r['reward_final_se']:.3f}", ctl)
    console.print(table)
    sync = Table(title="weight sync to 2 engine actors, s per MB (bench weightsync)")
    for col in ("model", "MB", *result["weight_sync"]["run_model"]["paths"]):
        sync.add_column(col)
    for name, m in result["weight_sync"].items():
        sync.add_row(name, f"{m['num_bytes'] / 1e6:.1f}",
                     *(f"{p['s_per_mb']:.4f}" for p in m["paths"].values()))
    console.print(sync)
    ctl, rs = result["control_plane_bytes_per_sample"], result["actor_restart"]
    colo = result["ray_colocated_vs_embedded_samples_per_s"]
    print(f"ray_vs_embedded_samples_per_s {result['ray_vs_embedded_samples_per_s']:.2f} "
          f"(by round: {', '.join(f'{x:.2f}' for x in result['ray_vs_embedded_samples_per_s_by_round'])})"
          + ("" if colo is None else f"; colocated vs embedded {colo:.2f}"))
    print(f"control plane ({DISAGGREGATED}): {ctl['per_trained_sample']:,.0f} B per trained "
          f"sample ({ctl['per_generated_sample']:,.0f} per generated; "
          f"{ctl['calls_per_trained_sample']:.1f} calls per trained sample)")
    for row, p in result["bytes_per_trained_sample_by_plane"].items():
        print(f"{row}: control {p['control']:,.0f} B + data {p['data']:,.0f} B per trained "
              f"sample ({p['data_objects']:.2f} objects; {p['reused_prompt_tokens']:.1f} prompt "
              "tokens not resent)")
    trips = result["payload_round_trips"]["by_bytes"]
    print("payload round trip to an actor, out of band / inline: " + ", ".join(
        f"{int(n):,} B {t['out_of_band_s'] * 1e3:.2f}/{t['inline_s'] * 1e3:.2f} ms"
        for n, t in trips.items()))
    print(f"actor restart: {rs['actor_restart_s']:.2f} s kill to serving (detect "
          f"{rs['detect_s']:.3f} s, replace {rs['replace_s']:.2f} s; median of "
          f"{len(rs['trials'])})")
    print_nodes(result)
    print(f"load average before {result['machine']['load_before']}, after "
          f"{result['machine']['load_after']}")
