"""The GPU check's rollout part: partial rollout against drain across weight updates.

A stream of requests (prompts of random token ids, long-tail answer lengths, temperature 1,
no stop token, so every length is exact) goes through one embedded engine whose rows are kept
full: a request that finishes is replaced by the next. ``updates`` times, at even shares of
the workload's tokens, a weight update comes (the same weights loaded as a new version: only
what an update does to the rows is measured):

* ``drain``: nothing is admitted until every running request has finished (the batch thins
  out to its longest request), then the load, then the rows fill again;
* ``partial``: the running requests are interrupted at a token boundary, the load, then each
  is resubmitted as prompt + partial with its remaining tokens (its whole context prefilled
  again under the new weights, the engine's prefix cache dropped by the load), beside new
  ones.

Same requests and tokens both ways. Key ``partial_vs_drain_tok_s``: generated tokens/s with
partial rollout ÷ with drain (the best of the repeats each, alternated). Beside it what each
paid: the tokens prefilled and the tokens sampled per decode pass (about the rows it held).
A drained batch decodes few rows per pass; a partial one prefills long contexts again. On
CPU partial rollout's engine made 1.07–1.11x the tokens a second of drain's in training runs
(``bench pair``, docs/benchmarks.md: a pass costs more per token with fewer rows). On a GPU a
pass of a few rows costs nearly what a full one does, and a prefill is cheap per token:
whether thin decode passes cost more than long contexts there is what this part measures.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping
from typing import Any

import torch

from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import FinishReason, GenerateRequest, SamplingParams

MODES = ("partial", "drain")


def workload(num: int, prompt: int, median: int, cap: int, vocab: int,
             seed: int = 0) -> list[tuple[list[int], int]]:
    """``num`` requests: a prompt of ``prompt`` random ids each and a log-normal answer length
    (``median``, p99 ≈ 10 × median, at most ``cap``)."""
    rng = random.Random(seed)
    sigma = math.log(10) / 2.326  # p99 / median = 10
    return [([rng.randrange(2, vocab) for _ in range(prompt)],
             max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))))
            for _ in range(num)]


async def serve(engine: LocalEngine, work: list[tuple[list[int], int]], *, rows: int,
                updates: int, mode: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Every request of ``work`` to its full length through ``rows`` rows, with ``updates``
    weight loads handled by ``mode``; seconds, tokens and the engine's work meanwhile."""
    total = sum(n for _, n in work)
    marks = [total * (k + 1) // (updates + 1) for k in range(updates)]
    gate, idle, admit = asyncio.Event(), asyncio.Event(), asyncio.Semaphore(rows)
    gate.set()
    idle.set()
    running = 0
    before = engine.stats()
    pauses: list[float] = []

    async def one(i: int, prompt: list[int], n: int) -> int:
        nonlocal running
        got: list[int] = []
        async with admit:
            while len(got) < n:
                while not gate.is_set():  # a waiter woken by a set may resume after a clear
                    await gate.wait()
                running += 1
                idle.clear()
                try:
                    out = await engine.generate(GenerateRequest(
                        request_id=f"{mode}-{i}-{len(got)}", prompt_ids=prompt + got,
                        params=SamplingParams(temperature=1.0, max_new_tokens=n - len(got),
                                              seed=i)))
                finally:
                    running -= 1
                    if running == 0:
                        idle.set()
                if out.finish_reason is FinishReason.ERROR or out.error is not None:
                    raise RuntimeError(f"request {i}: {out.error}")
                got += out.token_ids
        return len(got)

    async def update() -> None:
        for k, mark in enumerate(marks):
            while engine.stats().generated_tokens - before.generated_tokens < mark:
                await asyncio.sleep(0.002)
            gate.clear()
            t0 = time.perf_counter()
            if mode == "partial":
                await engine.interrupt(None)
            await idle.wait()
            await engine.load_weights(before.version + k + 1, tensors)
            pauses.append(time.perf_counter() - t0)
            gate.set()

    t0 = time.perf_counter()
    updating = asyncio.ensure_future(update())
    made = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(work)))
    # the requests may end between two polls past a mark: the loads still due come now (every
    # mark is below the total), so both modes pay every load
    await asyncio.wait_for(updating, timeout=60.0)
    seconds = time.perf_counter() - t0
    assert sum(made) == total, "the engine lost tokens"
    after = engine.stats().work
    delta = {k: after[k] - before.work.get(k, 0.0) for k in after}
    return {"s": seconds, "tokens": float(total), "updates_done": float(len(pauses)),
            "update_pause_s": sum(pauses),
            "prefilled_tokens": delta["prefill_tokens"] + delta["fused_prefill_tokens"]
            + delta["recompute_tokens"],
            "tokens_per_decode_pass": total / max(delta["decode_count"], 1.0)}


def rollout_part(engine: LocalEngine, tensors: Mapping[str, torch.Tensor],
                 work: list[tuple[list[int], int]], *, rows: int, updates: int, repeats: int,
                 deadline: float) -> dict[str, Any]:
    """The part's JSON: each mode's runs, alternated (partial, drain, partial, ...; a repeat
    starts only before ``deadline``, ``time.monotonic()``), and the key ratio of the best."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    asyncio.run(serve(engine, work[:rows], rows=rows, updates=1, mode="partial",
                      tensors=tensors))  # warm-up: compiled ops, the allocator, both paths
    for rep in range(repeats):
        if rep and time.monotonic() > deadline:
            break
        for mode in MODES:
            runs[mode].append(asyncio.run(serve(engine, work, rows=rows, updates=updates,
                                                mode=mode, tensors=tensors)))
    best = {m: min(runs[m], key=lambda r: r["s"]) for m in MODES}
    tok_s = {m: best[m]["tokens"] / best[m]["s"] for m in MODES}
    return {"requests": len(work), "rows": rows, "updates": updates,
            "tokens": int(best["drain"]["tokens"]),
            "partial_tok_s": tok_s["partial"], "drain_tok_s": tok_s["drain"],
            "partial_vs_drain_tok_s": tok_s["partial"] / tok_s["drain"],
            "prefilled_tokens": {m: best[m]["prefilled_tokens"] for m in MODES},
            "tokens_per_decode_pass": {m: best[m]["tokens_per_decode_pass"] for m in MODES},
            "update_pause_s": {m: best[m]["update_pause_s"] for m in MODES},
            "updates_done": {m: best[m]["updates_done"] for m in MODES},
            "runs": runs}
