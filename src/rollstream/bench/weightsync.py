"""Benchmark: weight sync from the driver to Ray engine actors on each path of
``runtime.ray.weight_sync`` (object store, gloo broadcast in buckets, shared memory).

    rollstream bench weightsync [--json OUT] [--quick]

A local Ray (2 CPUs) and two engine actors (local engine, 1 CPU each) per model: the kit's
tiny model at ``TinyModelConfig`` defaults and a bigger kit model (width 512, 8 layers; with
--quick only the tiny one). Per path: proxies over the same actors sharing one transport, one
warm-up sync (the broadcast group forms there), then ``NUM_SYNCS`` syncs of a full fp32 state
dict, each timed as weight sync does its loads (``load_weights`` on both engines, gathered)
while the engines are idle: the transport's cost, not the interrupt or drain around it. The
median per path, seconds per MB, and the ratio to the object store are reported (ratios
travel better than seconds on this shared machine; its load average is reported too). Then,
per model, full versus delta sync per path and engine dtype (``delta.py``: bytes and
seconds per sync of AdamW-trained versions, ``delta_bytes_vs_full``; on the bigger model
and with --quick, bfloat16 engines at one learning rate only). Then, per model, full and
delta sync to two bfloat16 engine actors on another node of a 2-node cluster on this host
(``delta.cross_node``), and ``per_sync``: seconds and MB per sync through shared memory, and
cross-node full and delta through the object store, with ``delta_bytes_vs_full``. A
benchmark measures; it does not assert.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.bench.sync_paths import PATHS, proxies

NUM_SYNCS = 5
BIGGER = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
          "intermediate_size": 1536}


def build_model(folder: Path, **overrides: Any) -> Path:
    from rollstream.config.schema import TinyModelConfig
    from rollstream.models.tiny import build_tiny_model
    from rollstream.models.tokenizer import build_char_tokenizer

    return build_tiny_model(TinyModelConfig(seed=0, **overrides), build_char_tokenizer(), folder)


async def _sync_seconds(engines: list, state: dict, first_version: int) -> list[float]:
    times = []
    for v in range(first_version, first_version + NUM_SYNCS + 1):
        tensors = {k: t.clone() for k, t in state.items()}  # a new version: a new dict
        t0 = time.perf_counter()
        await asyncio.gather(*(e.load_weights(v, tensors) for e in engines))
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first is the warm-up


async def bench_model(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from rollstream.config.schema import LocalEngineConfig
    from rollstream.runtime.ray.engines import build_ray_engines

    state = load_file(folder / "model.safetensors")
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    owners = build_ray_engines(folder, LocalEngineConfig(max_slots=4, max_seq_len=64,
                                                         threads=1),
                               num_engines=2, version=0, num_cpus=1)
    out: dict[str, Any] = {"num_bytes": num_bytes, "paths": {}}
    version = 1
    try:
        for path in PATHS:
            transport, engines = proxies(owners, path, False, "float32")  # whole versions
            times = await _sync_seconds(engines, state, version)
            version += NUM_SYNCS + 1
            transport.close()
            median = statistics.median(times)
            out["paths"][path] = {"median_s": median, "s_per_mb": median / (num_bytes / 1e6),
                                  "times_s": times}
    finally:
        for o in owners:
            await o.close()
    base = out["paths"]["object_store"]["median_s"]
    for row in out["paths"].values():
        row["vs_object_store"] = row["median_s"] / base
    return out


def main(json_out: Path | None = None, quick: bool = False) -> dict:
    from rollstream.bench.delta import bench_delta, cross_node, print_delta
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster

    load_start = os.getloadavg()[0]
    models = {"tiny": {}} if quick else {"tiny": {}, "bigger": BIGGER}
    result: dict[str, Any] = {"quick": quick, "num_syncs": NUM_SYNCS, "num_actors": 2,
                              "models": {}, "delta": {}, "cross_node": {}, "per_sync": {}}
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=1 << 30))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folders: dict[str, Path] = {}
            for name, overrides in models.items():
                folder = build_model(Path(tmp) / name, **overrides)
                result["models"][name] = {"config": overrides or "TinyModelConfig defaults",
                                          **asyncio.run(bench_model(folder))}
                result["delta"][name] = bench_delta(folder, quick or name != "tiny")
                folders[name] = folder
            cluster.stop()
            for name, folder in folders.items():  # engines on another node of a cluster
                result["cross_node"][name] = cross_node(folder)
                result["per_sync"][name] = per_sync(result, name)
    finally:
        cluster.stop()
    result["loadavg_1m"] = {"start": load_start, "end": os.getloadavg()[0]}
    _print_table(result)
    for name, delta in result["delta"].items():
        print_delta(name, delta)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def per_sync(result: dict[str, Any], model: str) -> dict[str, Any]:
    """Seconds and MB per sync to bfloat16 engines: through shared memory (engines on the
    driver's node, ``delta.py``'s rows), and full and delta through the object store to
    engines on another node (``delta.cross_node``); the cross-node delta's bytes over the
    full sync's."""
    from rollstream.bench.delta import CROSS_NODE_LR

    def sync(row: dict[str, Any]) -> dict[str, float]:
        return {"s": row["median_s"], "mb": row["median_bytes"] / 1e6}

    local = result["delta"][model]["rows"][f"bfloat16 lr {CROSS_NODE_LR:g}"]["shared_memory"]
    cross = result["cross_node"][model]["paths"]["object_store"]
    return {"engine_dtype": "bfloat16", "lr": CROSS_NODE_LR, "cross_node_path": "object_store",
            "shared_memory": sync(local["full"]), "shared_memory_delta": sync(local["delta"]),
            "cross_node_full": sync(cross["full"]), "cross_node_delta": sync(cross["delta"]),
            "delta_bytes_vs_full": cross["delta_bytes_vs_full"]}


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="weight sync to 2 Ray engine actors (median of "
                        f"{result['num_syncs']}, engines idle)")
    for col in ("model", "MB", "path", "s / sync", "s / MB", "vs object_store"):
        table.add_column(col)
    for name, m in result["models"].items():
        for path, row in m["paths"].items():
            table.add_row(name, f"{m['num_bytes'] / 1e6:.1f}", path, f"{row['median_s']:.4f}",
                          f"{row['s_per_mb']:.4f}", f"{row['vs_object_store']:.2f}")
    Console().print(table)
    for name, p in result["per_sync"].items():
        print(f"{name}, bfloat16 engines, per sync (s / MB): shared memory "
              f"{p['shared_memory']['s']:.4f} / {p['shared_memory']['mb']:.3f}; cross-node "
              f"full {p['cross_node_full']['s']:.4f} / {p['cross_node_full']['mb']:.3f}; "
              f"cross-node delta {p['cross_node_delta']['s']:.4f} / "
              f"{p['cross_node_delta']['mb']:.3f}; delta_bytes_vs_full "
              f"{p['delta_bytes_vs_full']:.3f}")
    print(f"load average (1 min): {result['loadavg_1m']}")
