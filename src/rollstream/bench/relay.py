"""Benchmark: what carrying a vLLM server's HTTP through its Ray actor costs
(``runtime/ray/relay.py``), against the loopback, on one server.

    python -m rollstream.bench.relay [--json OUT] [--concurrency 1 16 64] [--rounds 3]

A 2-node ``LocalCluster`` on 127.0.0.1 (1 CPU each); one vLLM server (the benchmarks' tiny
model, the adapter's defaults: fp32, eager) launched by its actor on node 1, so that its Ray
engine streams through that actor; and a second engine attached to the same server's URL,
which streams over the loopback. Each round sends N concurrent requests (prompt 4, 128 new
tokens, temperature 1) to one engine, then the same to the other; tok/s is the best of the
rounds. ``relay_vs_loopback`` per N is through-the-actor over loopback. On one host the
actor, the driver and the server share the CPU: the cost is the relay's CPU as much as its
latency. A benchmark measures; it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

NEW_TOKENS = 128
MAX_MODEL_LEN = 512


async def _round(engine: Any, concurrency: int, tag: str) -> float:
    from rollstream.engine import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(request_id=f"{tag}-{i}", prompt_ids=[11 + i % 50, 22, 33, 44],
                            params=SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS,
                                                  seed=i))
            for i in range(concurrency)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    elapsed = time.perf_counter() - t0
    short = [o.request_id for o in outs if len(o.token_ids) != NEW_TOKENS]
    assert not short, f"{tag}: requests came back short: {short[:3]}"
    return concurrency * NEW_TOKENS / elapsed


def run(concurrency: list[int], rounds: int) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollstream.bench.cluster import LocalCluster, NodeSpec
    from rollstream.bench.engine import _build_model
    from rollstream.config.schema import EngineConfig, VllmEngineConfig
    from rollstream.engine.vllm import build_vllm_engine
    from rollstream.runtime.ray.vllm import build_ray_vllm_engines

    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster.start([NodeSpec(num_cpus=1, resources={}),
                                NodeSpec(num_cpus=1, resources={})]) as nodes:
        folder = _build_model(Path(tmp) / "model")
        ray.init(address=nodes.address, log_to_driver=False)
        cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=MAX_MODEL_LEN))
        [relayed] = build_ray_vllm_engines(
            cfg, folder, version=0, num_cpus=1, units=None, log_dir=Path(tmp) / "logs",
            per_node=True,
            strategy=NodeAffinitySchedulingStrategy(node_id=nodes.ids[1], soft=False))
        loopback = None
        try:
            assert relayed.server.streams == "actor", relayed.server.streams
            loopback = build_vllm_engine(
                EngineConfig(kind="vllm", vllm=VllmEngineConfig(
                    urls=(relayed.server.url,), max_model_len=MAX_MODEL_LEN)),
                folder, engine_id="loopback-0")
            asyncio.run(_round(loopback, 4, "warm"))
            tok_s: dict[str, dict[int, list[float]]] = {"loopback": {}, "actor": {}}
            for n in concurrency:
                for r in range(rounds):
                    for name, engine in (("loopback", loopback), ("actor", relayed)):
                        tok_s[name].setdefault(n, []).append(
                            asyncio.run(_round(engine, n, f"{name}-{n}-{r}")))
        finally:
            if loopback is not None:
                loopback.shutdown()
            relayed.shutdown()
            ray.shutdown()
    best = {name: {n: max(v) for n, v in rows.items()} for name, rows in tok_s.items()}
    return {"concurrency": concurrency, "rounds": rounds, "new_tokens": NEW_TOKENS,
            "loopback_tok_s": best["loopback"], "actor_tok_s": best["actor"],
            "relay_vs_loopback": {n: best["actor"][n] / best["loopback"][n]
                                  for n in concurrency},
            "all_rounds_tok_s": tok_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result = run(args.concurrency, args.rounds)
    print("| concurrent requests | loopback tok/s | through the actor tok/s | actor / loopback |")
    print("|---|---|---|---|")
    for n in args.concurrency:
        print(f"| {n} | {result['loopback_tok_s'][n]:,.0f} | {result['actor_tok_s'][n]:,.0f} "
              f"| {result['relay_vs_loopback'][n]:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
