"""``bench weightsync``'s delta rows: bytes and seconds per sync, full versus delta
(``runtime.ray.delta``), on each path, for engines in bfloat16 and in float32.

The model (the kit's tiny one, or the bigger one) is trained ``NUM_STEPS`` steps with
AdamW (next-token loss on random tokens, fp32 master weights, as the trainer holds them) at
each learning rate of :data:`LRS`; each step's state dict is one version. How many bfloat16
elements change per step depends on the step size against the weights' magnitude: at
``train.lr``'s default (2e-4, large for LLM post-training) most do; at 1e-6 few do. Per
engine dtype, two engine actors of that dtype; per path, the versions go once with
``delta: false`` (each version whole, as the trainer holds it: float32) and once with
``delta: true`` (the first version full in the engine's dtype, then deltas where at most
half of the elements changed). Timed as ``weightsync.py`` times a sync (both engines'
``load_weights``, gathered, engines idle), the first version left out. Bytes are the tensor
bytes each engine received per sync. :func:`cross_node` times the two paths an engine on
another node can take (object store, broadcast), full and delta, to bfloat16 engines on the
second node of a 2-node cluster on this host (which shares the host's memory and loopback: no
network is crossed). A benchmark measures; it does not assert.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

NUM_STEPS = 6  # versions: the first is each mode's warm-up (and auto's full load)
DTYPES = ("bfloat16", "float32")
LRS = (2e-4, 1e-6)  # train.lr's default; a learning rate of RL post-training of LLMs


def trained_versions(folder: Path, lr: float, steps: int = NUM_STEPS) -> list[dict[str, Any]]:
    """The model's state dict after each of ``steps`` AdamW steps at ``lr`` (copies,
    float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    versions = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append({k: t.detach().clone() for k, t in model.state_dict().items()})
    return versions


async def _syncs(engines: list, versions: list[dict], first: int) -> list[float]:
    times = []
    for i, tensors in enumerate(versions):
        t0 = time.perf_counter()
        await asyncio.gather(*(e.load_weights(first + i, tensors) for e in engines))
        times.append(time.perf_counter() - t0)
    return times[1:]


async def bench_dtype(folder: Path, dtype: str, versions: list[dict],
                      paths: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Each of ``paths`` (None: every path), off and auto, to two engine actors of
    ``dtype``."""
    from rollstream.bench.sync_paths import PATHS, proxies
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.runtime.ray.engines import build_ray_engines
    from rollstream.sync.delta import DeltaSync, payload_bytes

    cfg = LocalEngineConfig.model_validate({"max_slots": 4, "max_seq_len": 64, "threads": 1,
                                            "dtype": dtype})
    owners = build_ray_engines(folder, cfg, num_engines=2, version=0, num_cpus=1)
    out: dict[str, Any] = {}
    version = 1
    try:
        for path in paths or PATHS:
            row: dict[str, Any] = {}
            for mode in ("full", "delta"):
                transport, engines = proxies(owners, path, mode == "delta", dtype)
                times = await _syncs(engines, versions, version)
                if isinstance(transport, DeltaSync):
                    sent = [r for r in transport.records if r.version > version]
                    per_sync = [r.num_bytes for r in sent if r.engine_id == owners[0].engine_id]
                    kinds = [r.kind for r in sent if r.engine_id == owners[0].engine_id]
                else:
                    per_sync = [payload_bytes(v) for v in versions[1:]]
                    kinds = ["full"] * len(per_sync)
                version += len(versions)
                transport.close()
                row[mode] = {"median_s": statistics.median(times), "times_s": times,
                             "bytes": per_sync, "median_bytes": statistics.median(per_sync),
                             "kinds": kinds}
            full, delta = row["full"], row["delta"]
            row["delta_bytes_vs_full"] = delta["median_bytes"] / full["median_bytes"]
            row["delta_s_vs_full"] = delta["median_s"] / full["median_s"]
            out[path] = row
    finally:
        for o in owners:
            await o.close()
    return out


def bench_delta(folder: Path, quick: bool = False) -> dict[str, Any]:
    """Every row; ``quick``: bfloat16 engines at lr 1e-6 only."""
    rows: dict[str, Any] = {}
    for lr in LRS[-1:] if quick else LRS:
        versions = trained_versions(folder, lr)
        for dtype in DTYPES[:1] if quick else DTYPES:
            rows[f"{dtype} lr {lr:g}"] = asyncio.run(bench_dtype(folder, dtype, versions))
    return {"steps": NUM_STEPS, "rows": rows}


CROSS_NODE = ("object_store", "broadcast")  # the paths an engine on another node can take
CROSS_NODE_LR = LRS[-1]


def cross_node(folder: Path) -> dict[str, Any]:
    """Full and delta sync to two bfloat16 engine actors on another node: a 2-node cluster
    on this host (``bench/cluster.py``) whose head, where this process runs, has no CPU for
    them; versions of AdamW at :data:`CROSS_NODE_LR`, paths :data:`CROSS_NODE`."""
    from ray._private.state import actors

    from rollstream.bench.cluster import LocalCluster, NodeSpec
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster

    versions = trained_versions(folder, CROSS_NODE_LR)
    store = 512 << 20  # the bigger model's versions (100 MB in float32) fit
    with LocalCluster.start([NodeSpec(num_cpus=0, object_store_bytes=store),
                             NodeSpec(num_cpus=2, object_store_bytes=store)]) as nodes:
        RayCluster.start(RayConfig(address=nodes.address))  # joined: stop() leaves it
        rows = asyncio.run(bench_dtype(folder, "bfloat16", versions, CROSS_NODE))
        # where Ray ran the engine actors (its actor table keeps dead actors' nodes)
        engine_nodes = sorted({a["Address"]["NodeID"] for a in actors().values()
                               if a["ActorClassName"] == "EngineActor"})
    return {"lr": CROSS_NODE_LR, "steps": NUM_STEPS, "dtype": "bfloat16", "paths": rows,
            "engine_nodes": engine_nodes, "driver_node": nodes.ids[0],
            "engines_off_the_driver_node": nodes.ids[0] not in engine_nodes}


def print_delta(model: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"delta sync, {model} model, {result['steps'] - 1} AdamW versions to "
                        "2 engine actors (median per sync; full: whole float32 state dict)")
    for col in ("engine dtype, AdamW lr", "path", "full MB", "full s", "delta MB", "delta s",
                "delta kinds", "bytes delta/full", "s delta/full"):
        table.add_column(col)
    for dtype, paths in result["rows"].items():
        for path, row in paths.items():
            off, auto = row["full"], row["delta"]
            table.add_row(dtype, path, f"{off['median_bytes'] / 1e6:.3f}",
                          f"{off['median_s']:.4f}", f"{auto['median_bytes'] / 1e6:.3f}",
                          f"{auto['median_s']:.4f}", ",".join(k[0] for k in auto["kinds"]),
                          f"{row['delta_bytes_vs_full']:.3f}", f"{row['delta_s_vs_full']:.2f}")
    Console().print(table)
