"""Benchmark: the embedded engine's prefix cache on long shared prompts.

    rollstream bench prefix [--json OUT] [--quick]

Shape (the issue's long-prompt workload): ``GROUPS`` groups of ``GROUP_SIZE`` (8) samples;
a group's samples share one prompt of 256 to 1,024 tokens, each sample answers 16 to 128
tokens (uniform draws; no stop token, so the lengths are exact), temperature 1, seeded. All
requests are submitted at once, group after group (new prompts in each repeat, the same for
both engines), to an engine of 32 rows with its default
settings (prefill fused into decode passes), on the project's tiny model (random weights:
only shapes matter for speed) with its positions raised to fit. --quick: 2 groups, shorter.

Two engines that differ only in ``prefix_cache_tokens`` (its default, and 0) are alive
together and the repeats alternate between them (with, without, with, ...), so that the
shared machine's load drifts onto both. Key ``prefix_cache_vs_none_gen_tok_s``: the median
over repeats of generated tokens/s with the cache ÷ without. Beside it the bound
``1 / (1 - p * h)``: ``h`` the hit share of the prompt tokens (``prefix_hit_tokens`` ÷
``prefix_query_tokens``) on the cached engine, ``p`` the prefill share of engine busy time
without the cache, read on a third engine with prefill passes of their own (``fuse_prefill:
false``; fused, a prefill's time is inside a decode pass and cannot be read apart).

Then the trainer on the last repeat's first groups, shared-prefix training against the flat
layout (:mod:`rollstream.bench.prefix_train`): key ``shared_prefix_vs_flat_trainer_step_s``
and its bound ``shared_prefix_bound``. Last, two short async training runs of
examples/tick_fewshot.yaml on the same model, both settings on against both off
(:mod:`rollstream.bench.prefix_run`): key ``both_vs_neither_trained_samples_per_s`` and its
bound ``both_vs_neither_bound``, the larger of the two bounds above.

A benchmark measures; it does not assert.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.bench.engine import THREADS, _time_requests
from rollstream.bench.prefix_run import run_part
from rollstream.bench.prefix_train import trainer_part
from rollstream.bench.weightsync import build_model
from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local import LocalEngine

GROUP_SIZE = 8
ROWS = 32


def _workload(quick: bool, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Each request's prompt and answer length, group after group (new prompts per seed: a
    repeat finds nothing of the one before in the cache)."""
    groups, prompt, answer = (2, (256, 320), (16, 32)) if quick else (16, (256, 1024), (16, 128))
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(groups):
        shared = [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt))]
        prompts += [shared] * GROUP_SIZE
        lengths += [rng.randint(*answer) for _ in range(GROUP_SIZE)]
    return prompts, lengths


def _run(engine: LocalEngine, prompts: list[list[int]], lengths: list[int], tag: str
         ) -> tuple[float, dict[str, float]]:
    """Seconds to generate every request, and the engine's work counts during it."""
    before = engine.stats().work
    elapsed = _time_requests(engine, prompts, lengths, tag)
    after = engine.stats().work
    return elapsed, {k: after[k] - before.get(k, 0.0) for k in after}


def _prefill_share(work: dict[str, float]) -> float:
    busy = sum(work[k] for k in ("prefill_s", "sort_s", "decode_s"))
    return work["prefill_s"] / busy if busy else 0.0


def main(json_out: Path | None = None, quick: bool = False) -> dict[str, Any]:
    import torch

    torch.set_num_threads(THREADS)
    repeats = 1 if quick else 5
    train_repeats = 1 if quick else 3
    load_before, t0 = list(os.getloadavg()), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "model", max_position=1024 + 128)
        base = {"max_slots": ROWS, "max_seq_len": 1024 + 128, "threads": THREADS,
                "device": "cpu"}
        engines = {"cache": LocalEngine(folder, LocalEngineConfig(**base)),
                   "none": LocalEngine(folder, LocalEngineConfig(**base, prefix_cache_tokens=0)),
                   "separate": LocalEngine(folder, LocalEngineConfig(
                       **base, prefix_cache_tokens=0, fuse_prefill=False))}
        try:
            vocab = engines["cache"].spec.vocab_size
            warm, _ = _workload(True, vocab, seed=-1)
            for name, e in engines.items():  # warm up (TorchScript, allocator)
                _run(e, warm[:GROUP_SIZE], [4] * GROUP_SIZE, f"w-{name}")
            tok_s: dict[str, list[float]] = {"cache": [], "none": []}
            work: dict[str, dict[str, float]] = {}
            for rep in range(repeats):
                prompts, lengths = _workload(quick, vocab, seed=rep)
                for name, rates in tok_s.items():
                    s, work[name] = _run(engines[name], prompts, lengths, f"r{rep}")
                    rates.append(sum(lengths) / s)
            _, work["separate"] = _run(engines["separate"], prompts, lengths, "p")
        finally:
            for e in engines.values():
                e.shutdown()
        trained = trainer_part(folder, prompts, lengths, group_size=GROUP_SIZE, vocab=vocab,
                               threads=THREADS, repeats=train_repeats)
        ran = run_part(folder, Path(tmp) / "runs", max_seq_len=base["max_seq_len"], quick=quick)
    ratios = [c / n for c, n in zip(tok_s["cache"], tok_s["none"], strict=True)]
    cached = work["cache"]  # of the last repeat, as the bound's p and h
    h = cached["prefix_hit_tokens"] / max(cached["prefix_query_tokens"], 1.0)
    p = _prefill_share(work["separate"])
    bound = 1.0 / (1.0 - p * h) if p * h < 1 else math.inf
    result = {
        "quick": quick, "threads": THREADS, "repeats": repeats, "rows": ROWS,
        "groups": len(prompts) // GROUP_SIZE, "group_size": GROUP_SIZE,
        "prompt_tokens": sum(map(len, prompts)), "generated_tokens": sum(lengths),  # a repeat's
        "prefix_cache_tokens": LocalEngineConfig().prefix_cache_tokens,  # the default
        "gen_tok_s": tok_s,
        "prefix_cache_vs_none_gen_tok_s": statistics.median(ratios),
        "ratios": ratios,
        "hit_share": h, "prefill_share_without_cache": p,
        "bound": bound,
        "prefilled_tokens": {k: w["prefill_tokens"] + w["fused_prefill_tokens"]  # last repeat
                             for k, w in work.items()},
        "prefix_evicted_tokens": cached["prefix_evicted_tokens"],
        "prefix_copy_s": cached["prefix_copy_s"],
        "busy_s": {k: sum(w[x] for x in ("prefill_s", "sort_s", "decode_s"))
                   for k, w in work.items()},
        **trained,
        **ran,  # the training runs, both settings on against both off (prefix_run.py)
        "both_vs_neither_bound": max(bound, trained["shared_prefix_bound"]),
        "load_avg_before": load_before, "load_avg_after": list(os.getloadavg()),
        "cpus": len(os.sched_getaffinity(0)), "bench_wall_s": time.perf_counter() - t0,
    }
    _print(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console

    best = {k: max(v) for k, v in r["gen_tok_s"].items()}
    Console().print(
        f"prefix cache ({r['groups']} groups of {r['group_size']}, {r['prompt_tokens']:,} prompt"
        f" tokens, {r['generated_tokens']:,} generated, {r['rows']} rows, {r['threads']} "
        f"threads{', quick' if r['quick'] else ''}): best gen tok/s {best['cache']:,.0f} with, "
        f"{best['none']:,.0f} without; median ratio over {r['repeats']} interleaved repeats "
        f"[bold]{r['prefix_cache_vs_none_gen_tok_s']:.2f}x[/bold] (bound 1/(1 - p*h) = "
        f"{r['bound']:.2f}x: prefill share without the cache p = "
        f"{r['prefill_share_without_cache']:.2f}, hit share h = {r['hit_share']:.2f}); "
        f"prefilled tokens {r['prefilled_tokens']['cache']:,.0f} with, "
        f"{r['prefilled_tokens']['none']:,.0f} without")
    Console().print(
        f"shared-prefix training ({r['trainer_groups']} groups of {r['group_size']}): seconds "
        f"per step flat {min(r['trainer_step_s']['flat']):.1f}, shared "
        f"{min(r['trainer_step_s']['shared']):.1f} (best); median ratio over "
        f"{len(r['trainer_ratios'])} interleaved repeats "
        f"[bold]{r['shared_prefix_vs_flat_trainer_step_s']:.2f}x[/bold] (bound, flat tokens / "
        f"shared tokens: {r['trainer_tokens']['flat']:,} / {r['trainer_tokens']['shared']:,} "
        f"= {r['shared_prefix_bound']:.2f}x)")
    both, neither = r["runs"]["both"], r["runs"]["neither"]
    Console().print(
        f"async training runs ({r['run_steps']} steps of {r['run_groups_per_step']} groups, "
        f"examples/tick_fewshot.yaml): trained samples/s {both['trained_samples_per_s']:.2f} "
        f"with the prefix cache and shared-prefix training, {neither['trained_samples_per_s']:.2f}"
        f" with neither: [bold]{r['both_vs_neither_trained_samples_per_s']:.2f}x[/bold] (bound, "
        f"the larger of the two above: {r['both_vs_neither_bound']:.2f}x; the run's hit share "
        f"{r['run_hit_share']:.2f})")
