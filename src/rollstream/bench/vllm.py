"""Benchmark: the local engine vs a real vLLM server on the tiny model (CPU, fp32).

    python -m rollstream.bench.vllm [--json OUT] [--quick]

Both engines are driven the same way, through the engine protocol (``generate`` calls
gathered on one event loop; temperature 1, no top-k/top-p, no stop tokens so lengths are
fixed), one engine at a time so they never share the CPU:
  * ``fixed_cN``: N concurrent requests, prompt 16, 128 new tokens each (N = 1, 16, 64);
  * ``longtail``: 64 requests, log-normal lengths (p99/median = 10, median 24, cap 256),
    all submitted at once; only useful tokens count.
vLLM runs two ways on one server: through the adapter as a run uses it (streamed, one event
per 16 tokens) and as bare non-streaming HTTP POSTs of the same request body from a fresh
``httpx.AsyncClient`` per round (no adapter: what a client that does nothing else gets);
``vllm_adapter_vs_http`` says what the adapter costs. Then the weight sync:
``load_weights`` of the full state dict (vLLM: shared-memory buckets,
pause, in-place reload, version label, resume), median of 5.

Each throughput is the best of ``repeats`` runs (2, or 1 with --quick), after a warm-up.
vLLM runs with the adapter's defaults (``enforce_eager``, fp32 as the folder says, its worker
pinned to one core: vLLM reserves the other for its API server); the local engine gets both
cores (``threads=2``). Server start-up is reported, not counted, and so is the machine's
load average (these machines are shared; load from other processes slows vLLM's single
pinned core far more than the local engine's two floating threads). A benchmark measures; it
does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rollstream.bench.engine import PROMPT_LEN, THREADS, _build_model, _longtail_lengths, _prompts
from rollstream.config.schema import EngineConfig, LocalEngineConfig, VllmEngineConfig
from rollstream.engine.protocol import Engine, GenerateRequest, SamplingParams

NUM_SYNCS = 5


@dataclass(slots=True, kw_only=True)
class Case:
    name: str
    num_requests: int
    useful_tokens: int
    local_tok_s: float
    vllm_tok_s: float  # through the adapter (streamed, as a run uses it)
    vllm_http_tok_s: float  # the same server, bare non-streaming HTTP

    @property
    def ratio(self) -> float:
        return self.local_tok_s / self.vllm_tok_s


async def _timed(engine: Engine, prompts: list[list[int]], lengths: list[int],
                 repeats: int, tag: str) -> float:
    best = math.inf
    for rep in range(repeats):
        reqs = [GenerateRequest(request_id=f"{tag}-{rep}-{i}", prompt_ids=p,
                                params=SamplingParams(temperature=1.0, max_new_tokens=n, seed=i))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        best = min(best, time.perf_counter() - t0)
        short = [(o.request_id, len(o.token_ids), n, o.finish_reason.value, o.error)
                 for o, n in zip(outs, lengths, strict=True) if len(o.token_ids) != n]
        assert not short, f"{tag}: {len(short)} requests came back short, e.g. {short[:2]}"
    return best


async def _run_cases(engine: Engine, workloads: list[tuple[str, list[list[int]], list[int]]],
                     repeats: int) -> dict[str, float]:
    await _timed(engine, workloads[0][1][:4], [8] * min(4, len(workloads[0][1])), 1, "warm")
    return {name: sum(lengths) / await _timed(engine, prompts, lengths, repeats, name)
            for name, prompts, lengths in workloads}


async def _sync_seconds(engine: Engine, state: dict[str, torch.Tensor]) -> float:
    times = []
    for v in range(1, NUM_SYNCS + 1):
        t0 = time.perf_counter()
        await engine.load_weights(v, state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _bench(folder: Path, workloads: list, repeats: int, max_len: int) -> dict:
    from safetensors.torch import load_file

    from rollstream.engine.local import LocalEngine
    from rollstream.engine.vllm import build_vllm_engine

    state = load_file(folder / "model.safetensors")
    slots = max(len(p) for _, p, _ in workloads)
    local = LocalEngine(folder, LocalEngineConfig(max_slots=slots, max_seq_len=max_len,
                                                  threads=THREADS, device="cpu"))
    try:
        local_tok_s = await _run_cases(local, workloads, repeats)
        local_sync_s = await _sync_seconds(local, state)
    finally:
        await local.close()
    t0 = time.perf_counter()
    vcfg = VllmEngineConfig(max_model_len=512)
    vllm = build_vllm_engine(EngineConfig(kind="vllm", vllm=vcfg), folder,
                             engine_id="vllm-bench-0")
    start_s = time.perf_counter() - t0
    try:
        vllm_tok_s = await _run_cases(vllm, workloads, repeats)
        # the same server, bare HTTP: what the adapter costs
        http_tok_s = await _bare_http(vllm.server.url, workloads, repeats)
        vllm_sync_s = await _sync_seconds(vllm, state)
        sync_bytes = vllm.sync_timings[-1].num_bytes
    finally:
        await vllm.close()
    return dict(local=local_tok_s, vllm=vllm_tok_s, vllm_http=http_tok_s,
                local_sync_s=local_sync_s, vllm_sync_s=vllm_sync_s,
                vllm_start_s=start_s, sync_bytes=sync_bytes)


async def _bare_http(url: str, workloads: list, repeats: int) -> dict[str, float]:
    """The workloads as plain non-streaming POSTs of the adapter's request body (a client
    per round, nothing else): what vLLM's server gives a client that does no
    work of its own, the floor of the adapter's cost."""
    import httpx

    from rollstream.engine.vllm.wire import GENERATE_PATH, request_body

    async def one(client: httpx.AsyncClient, rid: str, prompt: list[int], n: int,
                  seed: int) -> int:
        req = GenerateRequest(request_id=rid, prompt_ids=prompt,
                              params=SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed))
        body = request_body(req, rid, n)
        body["stream"] = False  # one response: the least a client can do
        del body["sampling_params"]["stream_interval"]
        resp = await client.post(url + GENERATE_PATH, json=body)
        resp.raise_for_status()
        return len(resp.json()["choices"][0]["token_ids"])

    out = {}
    for name, prompts, lengths in workloads:
        best = math.inf
        for rep in range(repeats):  # a client per round: no keep-alive the server closed
            async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=None)) as client:
                t0 = time.perf_counter()
                got = await asyncio.gather(*(one(client, f"http-{name}-{rep}-{i}", p, n, i)
                                             for i, (p, n) in enumerate(zip(prompts, lengths,
                                                                            strict=True))))
                best = min(best, time.perf_counter() - t0)
            assert list(got) == lengths, f"bare HTTP {name}: tokens lost"
        out[name] = sum(lengths) / best
    return out


def main(json_out: Path | None = None, quick: bool = False) -> dict:
    torch.set_num_threads(THREADS)
    load_start = os.getloadavg()[0]
    concurrencies, new_tokens = ((1, 8), 16) if quick else ((1, 16, 64), 128)
    tail_n, tail_median, tail_cap = (16, 4, 32) if quick else (64, 24, 256)
    repeats = 1 if quick else 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = _build_model(Path(tmp) / "model")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        workloads = [(f"fixed_c{c}", _prompts(c, vocab, seed=c), [new_tokens] * c)
                     for c in concurrencies]
        lengths = _longtail_lengths(tail_n, tail_median, tail_cap, seed=0)
        workloads.append(("longtail", _prompts(tail_n, vocab, seed=1000), lengths))
        raw = asyncio.run(_bench(folder, workloads, repeats,
                                 max_len=PROMPT_LEN + max(new_tokens, tail_cap)))
    cases = [Case(name=name, num_requests=len(prompts), useful_tokens=sum(lens),
                  local_tok_s=raw["local"][name], vllm_tok_s=raw["vllm"][name],
                  vllm_http_tok_s=raw["vllm_http"][name])
             for name, prompts, lens in workloads]
    by_name = {c.name: c for c in cases}
    result = {
        "quick": quick,
        "repeats": repeats,
        "local_threads": THREADS,
        "cases": {c.name: {**asdict(c), "ratio": c.ratio} for c in cases},
        f"local_vs_vllm_c{concurrencies[-1]}": by_name[f"fixed_c{concurrencies[-1]}"].ratio,
        "local_vs_vllm_longtail": by_name["longtail"].ratio,
        # what the adapter (streaming included) costs: its tok/s / bare HTTP's
        "vllm_adapter_vs_http": {c.name: c.vllm_tok_s / c.vllm_http_tok_s for c in cases},
        "vllm_weight_sync_s": raw["vllm_sync_s"],
        "local_weight_sync_s": raw["local_sync_s"],
        "weight_sync_bytes": raw["sync_bytes"],
        "vllm_start_s": raw["vllm_start_s"],
        # the machines are shared: a busy one slows vLLM's one pinned core the most
        "loadavg_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "longtail_lengths": {"median": statistics.median(lengths), "max": max(lengths),
                             "sum": sum(lengths)},
    }
    _print_table(cases, result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _print_table(cases: list[Case], result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    quick = ", quick" if result["quick"] else ""
    table = Table(title=f"local engine vs vLLM (tiny model, fp32{quick})")
    for col in ("case", "requests", "useful tokens", "local tok/s", "vLLM tok/s", "local/vLLM",
                "vLLM bare HTTP"):
        table.add_column(col, justify="right")
    for c in cases:
        table.add_row(c.name, str(c.num_requests), str(c.useful_tokens), f"{c.local_tok_s:,.0f}",
                      f"{c.vllm_tok_s:,.0f}", f"{c.ratio:.2f}x", f"{c.vllm_http_tok_s:,.0f}")
    console = Console()
    console.print(table)
    console.print(f"weight sync of {result['weight_sync_bytes'] / 1e6:.1f} MB: vLLM "
                  f"{result['vllm_weight_sync_s']:.3f} s, local "
                  f"{result['local_weight_sync_s']:.3f} s (median of {NUM_SYNCS}); "
                  f"vLLM server start {result['vllm_start_s']:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(json_out=args.json_out, quick=args.quick)
