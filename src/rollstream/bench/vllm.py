"""Benchmark: the local engine vs a real vLLM server on the tiny model (CPU), at matched
settings (fp32, eager) and at each side's best (bf16, compiled).

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
Two comparisons, one engine at a time:

* matched settings (``local_vs_vllm_*``): vLLM with the adapter's defaults (``enforce_eager``,
  fp32 as the folder says), the local engine at fp32;
* best settings (``local_vs_vllm_best_*``): vLLM as its CPU docs tell a user to run it on this
  machine: ``--dtype bfloat16`` (the dtype AMX accelerates; fp16 is "unstable" on CPU),
  compiled (no ``--enforce-eager``: vLLM's default, torch.compile of the model), threads as
  vLLM binds them by default (``VLLM_CPU_OMP_THREADS_BIND=auto``: on x86 it reserves one
  core per worker for the API server and engine-core process, so on 2 cores the worker's
  OpenMP runs one thread on core 0; the docs' advice is likewise to pin inference threads
  and reserve cores for serving). Binding both cores (``0-1``) was tried and measured
  slower (docs/vllm.md). The local engine is run at fp32 and bf16 and its faster dtype per
  case is compared (``cases.*.local_best_dtype``); the local engine gets both cores
  (``threads=2``) at either dtype. bf16 logprobs differ from fp32 ones: a throughput row only.

``settings`` records what each side ran with: dtype, eager or compiled, threads (vLLM's
worker cores as its own log reports them). Server start-ups are reported, not counted (the
compiled one compiles on every start: vLLM 0.32 fails to load its saved graph here), and so
is the machine's load average (these machines are shared; load from other processes slows
vLLM's single pinned core far more than the local engine's two floating threads). A
benchmark measures; it does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollstream.bench.engine import PROMPT_LEN, THREADS, _build_model, _longtail_lengths, _prompts
from rollstream.config.schema import EngineConfig, LocalEngineConfig, VllmEngineConfig
from rollstream.engine.protocol import Engine, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from rollstream.engine.vllm import VllmEngine

NUM_SYNCS = 5
LOCAL_DTYPES = ("float32", "bfloat16")
MAX_MODEL_LEN = 512  # both servers, as in the runs docs/vllm.md reports
# the adapter's defaults: eager, the folder's dtype (fp32)
VLLM_MATCHED = VllmEngineConfig(max_model_len=MAX_MODEL_LEN)
# vLLM's best on this CPU: bf16 (AMX), compiled, and its own default binding, set explicitly
# so that a VLLM_CPU_OMP_THREADS_BIND in the caller's environment does not change the row
VLLM_BEST = VllmEngineConfig(max_model_len=MAX_MODEL_LEN, enforce_eager=False,
                             extra_args=("--dtype", "bfloat16"))
VLLM_BEST_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
# the settings are read from the servers' INFO lines; TRL, once imported in this process
# (bench peers, its test), sets VLLM_LOGGING_LEVEL=ERROR in os.environ (trl/_compat.py)
VLLM_LOG_ENV = {"VLLM_LOGGING_LEVEL": "INFO"}


@dataclass(slots=True, kw_only=True)
class Case:
    name: str
    num_requests: int
    useful_tokens: int
    local_tok_s: float  # fp32
    local_bf16_tok_s: float
    vllm_tok_s: float  # matched settings, through the adapter (streamed, as a run uses it)
    vllm_http_tok_s: float  # the same server, bare non-streaming HTTP
    vllm_best_tok_s: float  # best settings, through the adapter

    @property
    def ratio(self) -> float:
        return self.local_tok_s / self.vllm_tok_s

    @property
    def local_best_dtype(self) -> str:
        return "bfloat16" if self.local_bf16_tok_s > self.local_tok_s else "float32"

    @property
    def best_ratio(self) -> float:
        """The local engine at its faster dtype over vLLM at its best settings."""
        return max(self.local_tok_s, self.local_bf16_tok_s) / self.vllm_best_tok_s


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

    state = load_file(folder / "model.safetensors")
    slots = max(len(p) for _, p, _ in workloads)
    local, local_sync_s = {}, 0.0
    for dtype in LOCAL_DTYPES:
        engine = LocalEngine(folder, LocalEngineConfig(max_slots=slots, max_seq_len=max_len,
                                                       threads=THREADS, device="cpu",
                                                       dtype=dtype))
        try:
            local[dtype] = await _run_cases(engine, workloads, repeats)
            if dtype == "float32":  # the sync a float32 trainer pays
                local_sync_s = await _sync_seconds(engine, state)
        finally:
            await engine.close()
    with _environ(VLLM_LOG_ENV):
        vllm, start_s = _start_vllm(folder, VLLM_MATCHED, "vllm-bench-0")
    try:
        vllm_tok_s = await _run_cases(vllm, workloads, repeats)
        # the same server, bare HTTP: what the adapter costs
        http_tok_s = await _bare_http(vllm.server.url, workloads, repeats)
        vllm_sync_s = await _sync_seconds(vllm, state)
        sync_bytes = vllm.sync_timings[-1].num_bytes
    finally:
        await vllm.close()
    matched_settings = _server_settings(vllm.server.log_path)
    with _environ({**VLLM_BEST_ENV, **VLLM_LOG_ENV}):  # also for a restart by the health watch
        best, best_start_s = _start_vllm(folder, VLLM_BEST, "vllm-bench-best-0")
        try:
            best_tok_s = await _run_cases(best, workloads, repeats)
        finally:
            await best.close()
    return dict(local=local, vllm=vllm_tok_s, vllm_http=http_tok_s, vllm_best=best_tok_s,
                local_sync_s=local_sync_s, vllm_sync_s=vllm_sync_s, vllm_start_s=start_s,
                vllm_best_start_s=best_start_s, sync_bytes=sync_bytes,
                vllm_settings=matched_settings,
                vllm_best_settings=_server_settings(best.server.log_path))


def _start_vllm(folder: Path, vcfg: VllmEngineConfig,
                engine_id: str) -> tuple[VllmEngine, float]:
    """A started vLLM engine and the seconds until its server answered /health."""
    from rollstream.engine.vllm import build_vllm_engine

    t0 = time.perf_counter()
    engine = build_vllm_engine(EngineConfig(kind="vllm", vllm=vcfg), folder, engine_id=engine_id)
    return engine, time.perf_counter() - t0


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _server_settings(log_path: Path | None) -> dict:
    """What a vLLM server ran with, as its own log says (the last start's: a restart logs
    again): dtype and eager/compiled from the engine's config line, and the worker's thread
    binding (``ompmultiprocessing.py``): ``VLLM_CPU_OMP_THREADS_BIND``, the worker's OpenMP
    cores and the cores left to the API server and engine-core process."""
    text = log_path.read_text(errors="replace") if log_path and log_path.exists() else ""

    def last(pattern: str) -> str | None:
        found = re.findall(pattern, text)
        return found[-1] if found else None

    def ids(found: str | None) -> list[int] | None:
        return None if found is None else [int(x) for x in found.split(",") if x.strip()]

    eager = last(r"\benforce_eager=(True|False)")
    cores = ids(last(r"local_rank=0, core ids=\[([\d, ]*)\]"))
    return {"dtype": last(r"\bdtype=torch\.(\w+)"),
            "mode": None if eager is None else "eager" if eager == "True" else "compiled",
            "omp_threads_bind": last(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'"),
            "omp_threads": None if cores is None else len(cores), "worker_cores": cores,
            "reserved_cores": ids(last(r"reserved_cpus=\[([\d, ]*)\]"))}


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
                  local_tok_s=raw["local"]["float32"][name],
                  local_bf16_tok_s=raw["local"]["bfloat16"][name], vllm_tok_s=raw["vllm"][name],
                  vllm_http_tok_s=raw["vllm_http"][name], vllm_best_tok_s=raw["vllm_best"][name])
             for name, prompts, lens in workloads]
    by_name = {c.name: c for c in cases}
    top = by_name[f"fixed_c{concurrencies[-1]}"]
    result = {
        "quick": quick,
        "repeats": repeats,
        "local_threads": THREADS,
        "settings": {
            "local": {"dtype": list(LOCAL_DTYPES), "mode": "eager", "threads": THREADS},
            "vllm_matched": raw["vllm_settings"],
            "vllm_best": raw["vllm_best_settings"],
        },
        "cases": {c.name: {**asdict(c), "ratio": c.ratio, "best_ratio": c.best_ratio,
                           "local_best_dtype": c.local_best_dtype} for c in cases},
        f"local_vs_vllm_c{concurrencies[-1]}": top.ratio,
        "local_vs_vllm_longtail": by_name["longtail"].ratio,
        # the local engine at its faster dtype (cases.*.local_best_dtype) / vLLM at its best
        f"local_vs_vllm_best_c{concurrencies[-1]}": top.best_ratio,
        "local_vs_vllm_best_longtail": by_name["longtail"].best_ratio,
        # what the adapter (streaming included) costs: its tok/s / bare HTTP's
        "vllm_adapter_vs_http": {c.name: c.vllm_tok_s / c.vllm_http_tok_s for c in cases},
        "vllm_weight_sync_s": raw["vllm_sync_s"],
        "local_weight_sync_s": raw["local_sync_s"],
        "weight_sync_bytes": raw["sync_bytes"],
        "vllm_start_s": raw["vllm_start_s"],
        "vllm_best_start_s": raw["vllm_best_start_s"],
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
    table = Table(title=f"local engine vs vLLM (tiny model{quick}): matched settings (fp32, "
                        "eager) and each side's best (vLLM bf16 compiled, local's faster dtype)")
    for col in ("case", "requests", "useful tokens", "local fp32", "local bf16", "vLLM matched",
                "local/vLLM", "vLLM bare HTTP", "vLLM best", "local best/vLLM best"):
        table.add_column(col, justify="right")
    for c in cases:
        dtype = "bf16" if c.local_best_dtype == "bfloat16" else "fp32"
        table.add_row(c.name, str(c.num_requests), str(c.useful_tokens), f"{c.local_tok_s:,.0f}",
                      f"{c.local_bf16_tok_s:,.0f}", f"{c.vllm_tok_s:,.0f}", f"{c.ratio:.2f}x",
                      f"{c.vllm_http_tok_s:,.0f}", f"{c.vllm_best_tok_s:,.0f}",
                      f"{c.best_ratio:.2f}x ({dtype})")
    console = Console()
    console.width = max(console.width, 150)  # ten columns; a pipe or log would cut them at 80
    console.print(table)
    settings = result["settings"]
    for side in ("vllm_matched", "vllm_best"):
        s = settings[side]
        console.print(f"{side}: {s['dtype']}, {s['mode']}, OMP bind {s['omp_threads_bind']!r}: "
                      f"worker cores {s['worker_cores']}, reserved {s['reserved_cores']}")
    console.print(f"weight sync of {result['weight_sync_bytes'] / 1e6:.1f} MB: vLLM "
                  f"{result['vllm_weight_sync_s']:.3f} s, local "
                  f"{result['local_weight_sync_s']:.3f} s (median of {NUM_SYNCS}); "
                  f"vLLM server start {result['vllm_start_s']:.0f} s (matched), "
                  f"{result['vllm_best_start_s']:.0f} s (best)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(json_out=args.json_out, quick=args.quick)
