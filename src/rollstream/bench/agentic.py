"""Benchmark: multi-turn episodes with slow, heavy-tailed tools, batched by turn vs async.

    rollstream bench agentic [--json OUT] [--quick]

The same 128 episodes twice on the embedded engine (kit model, char tokenizer, greedy), 32
in flight at a time (the engine's slots): each episode has a number of model turns drawn from a long-tailed distribution (median 3, at most
12), and after every model turn its tool answers after a latency drawn log-normal (median
50 ms, p99 2 s), seeded per episode so both modes see the same turns and latencies. The tool
is simulated (a sleep, then a tool message); the model turns are real generation (at most 32
tokens each) through ``AgentLoop``.

* ``batched``: waves of 32 episodes; in a wave every episode's turn k waits for the slowest
  tool of turn k of all (the turn-synchronous loop of frameworks that batch an agent step at
  a time), and the next wave starts when the last episode of this one ends;
* ``async``: rollstream's loop, each episode on its own, a new one starting whenever one ends.

Keys: ``async_vs_batched_episodes_per_s`` (target >= 2), ``engine_utilization_agentic``
(the engine's busy time / wall time in the async mode; target >= 0.8), and per mode the
episodes/s, wall time, tokens and utilization; ``proxy_overhead_ms_p50``: the median time of
a one-turn call through the OpenAI-compatible proxy with the ``openai`` SDK (a session each:
rendering, HTTP, JSON) minus that of the same request sent to the engine directly.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.environment import Observation
from rollstream.agent.loop import AgentLoop, Budgets, EngineTurns, EpisodeEnd
from rollstream.config.schema import LocalEngineConfig, TinyModelConfig
from rollstream.engine import GenerateRequest, SamplingParams
from rollstream.engine.local.engine import LocalEngine
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import build_char_tokenizer

TOOL_MEDIAN_S, TOOL_P99_S = 0.05, 2.0
TOOL_SIGMA = math.log(TOOL_P99_S / TOOL_MEDIAN_S) / 2.3263  # z of the 99th percentile
TURN_TOKENS = 32
MAX_TURNS = 12


class _TurnBarrier:
    """Turn k of every live episode waits until all have their tool results of turn k."""

    def __init__(self, live: int) -> None:
        self.live, self.arrived, self.event = live, 0, asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        event = self.event
        self._maybe_release()
        await event.wait()

    def leave(self) -> None:
        self.live -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.live and self.arrived >= self.live:
            self.event.set()
            self.arrived, self.event = 0, asyncio.Event()


class _ToolEpisode:
    """An episode whose every model turn is answered by a slow tool, for ``turns`` turns."""

    def __init__(self, index: int, seed: int, barrier: _TurnBarrier | None) -> None:
        rng = random.Random(f"{seed}/{index}")
        self.turns = min(MAX_TURNS, max(1, round(rng.lognormvariate(math.log(3), 0.8))))
        self.latencies = [rng.lognormvariate(math.log(TOOL_MEDIAN_S), TOOL_SIGMA)
                          for _ in range(self.turns)]
        self.index, self.barrier, self.step_count = index, barrier, 0

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": f"task {self.index}: add 12 and {self.index}"}]

    async def step(self, turn) -> Observation:
        if self.step_count == self.turns:
            if self.barrier is not None:
                self.barrier.leave()
            return Observation(messages=[], done=True, reward=0.0)
        await asyncio.sleep(self.latencies[self.step_count])
        self.step_count += 1
        if self.barrier is not None:
            await self.barrier.wait()
        return Observation(messages=[{"role": "tool", "content": f"result {self.step_count}"}],
                           done=False)


async def _run_mode(engine: LocalEngine, renderer: ChatRenderer, n: int, concurrency: int,
                    seed: int, batched: bool) -> dict[str, Any]:
    """``n`` episodes, ``concurrency`` at a time: batched, in waves that each run to their
    end turn by turn; async, a new episode starting whenever one ends."""
    loop = AgentLoop(renderer=renderer,
                     sampling=SamplingParams(temperature=0.0),
                     budgets=Budgets(max_turns=MAX_TURNS + 1, max_turn_tokens=TURN_TOKENS,
                                     max_total_tokens=8192))
    tag = "b" if batched else "a"
    turns = EngineTurns(engine)
    envs = [_ToolEpisode(i, seed, None) for i in range(n)]
    busy0, tokens0 = engine.stats().busy_s, engine.stats().generated_tokens
    t0 = time.perf_counter()
    if batched:
        episodes = []
        for lo in range(0, n, concurrency):
            wave = envs[lo:lo + concurrency]
            barrier = _TurnBarrier(len(wave))
            for env in wave:
                env.barrier = barrier
            episodes += await asyncio.gather(*(loop.run(env, episode_id=f"{tag}{env.index}", generate=turns)
                                               for env in wave))
    else:
        slots = asyncio.Semaphore(concurrency)

        async def one(env: _ToolEpisode):
            async with slots:
                return await loop.run(env, episode_id=f"{tag}{env.index}", generate=turns)

        episodes = await asyncio.gather(*(one(env) for env in envs))
    wall = time.perf_counter() - t0
    stats = engine.stats()
    assert all(ep.end is EpisodeEnd.DONE for ep in episodes), [ep.end for ep in episodes]
    return {"episodes": n, "wall_s": wall, "episodes_per_s": n / wall,
            "engine_utilization": (stats.busy_s - busy0) / wall,
            "generated_tokens": stats.generated_tokens - tokens0,
            "model_turns": sum(ep.num_model_turns for ep in episodes),
            "tool_time_s": sum(sum(env.latencies) for env in envs)}


async def _bench(folder: Path, n: int, concurrency: int, seed: int) -> dict[str, Any]:
    engine = LocalEngine(folder, LocalEngineConfig(max_slots=concurrency, max_seq_len=2048,
                                                   threads=2, device="cpu"))
    renderer = ChatRenderer(build_char_tokenizer())
    try:
        await _run_mode(engine, renderer, 4, 4, seed + 1, batched=False)  # warm-up
        batched = await _run_mode(engine, renderer, n, concurrency, seed, batched=True)
        async_ = await _run_mode(engine, renderer, n, concurrency, seed, batched=False)
        overhead = await _proxy_overhead(engine, renderer, calls=20 if n < 64 else 100)
    finally:
        await engine.close()
    return {"batched": batched, "async": async_, "proxy": overhead}


async def _proxy_overhead(engine: LocalEngine, renderer: ChatRenderer, calls: int) -> dict:
    """The same one-call conversation, ``calls`` times each, through the proxy with the
    openai SDK and straight to the engine (rendered ids): the difference of the medians."""
    import openai

    from rollstream.agent.proxy import AgentProxy

    messages = [{"role": "user", "content": "add 12 and 30"}]
    ids = renderer.prompt(messages)
    params = SamplingParams(temperature=0.0, max_new_tokens=8,
                            stop_token_ids=tuple(renderer.stop_token_ids(messages)))
    direct, proxied = [], []
    async with AgentProxy([engine], renderer.tokenizer) as proxy:
        for i in range(calls):
            t0 = time.perf_counter()
            await engine.generate(GenerateRequest(request_id=f"direct{i}", prompt_ids=ids,
                                                  params=params))
            direct.append(time.perf_counter() - t0)
            handle = proxy.open_session(f"overhead{i}")
            client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key)
            t0 = time.perf_counter()
            await client.chat.completions.create(model="kit", messages=messages, max_tokens=8,
                                                 temperature=0.0)
            proxied.append(time.perf_counter() - t0)
            await client.close()
            proxy.close_session(handle.api_key)
    return {"calls": calls, "direct_ms_p50": 1000 * statistics.median(direct),
            "proxy_ms_p50": 1000 * statistics.median(proxied),
            "overhead_ms_p50": 1000 * (statistics.median(proxied) - statistics.median(direct))}


def main(json_out: Path | None = None, quick: bool = False) -> dict[str, Any]:
    n, concurrency, seed = (16, 8, 0) if quick else (128, 32, 0)
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        folder = build_tiny_model(TinyModelConfig(), build_char_tokenizer(), Path(tmp) / "m")
        modes = asyncio.run(_bench(folder, n, concurrency, seed))
    probe = [_ToolEpisode(i, seed, None) for i in range(n)]
    latencies = sorted(x for env in probe for x in env.latencies)
    result = {
        "settings": {"episodes": n, "concurrency": concurrency, "turn_tokens": TURN_TOKENS,
                     "sampling": "greedy",
                     "tool_latency": f"log-normal, median {TOOL_MEDIAN_S * 1000:.0f} ms, "
                                     f"p99 {TOOL_P99_S:g} s (simulated: a sleep)",
                     "turns": f"log-normal, median 3, 1..{MAX_TURNS}",
                     "engine": "embedded, kit model (TinyModelConfig defaults), 2 threads"},
        "turns_per_episode": [env.turns for env in probe],
        "tool_latency_s_median": statistics.median(latencies),
        "tool_latency_s_max": latencies[-1],
        "modes": {k: modes[k] for k in ("batched", "async")},
        "proxy": modes["proxy"],
        "async_vs_batched_episodes_per_s": (modes["async"]["episodes_per_s"]
                                            / modes["batched"]["episodes_per_s"]),
        "engine_utilization_agentic": modes["async"]["engine_utilization"],
        "proxy_overhead_ms_p50": modes["proxy"]["overhead_ms_p50"],
    }
    _print(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    settings = result["settings"]
    table = Table(title=f"bench agentic: {settings['episodes']} episodes, "
                        f"{settings['concurrency']} at a time; tools {settings['tool_latency']}")
    for col in ("mode", "wall s", "episodes/s", "engine util.", "model turns", "tokens"):
        table.add_column(col, justify="right")
    for name, m in result["modes"].items():
        table.add_row(name, f"{m['wall_s']:.1f}", f"{m['episodes_per_s']:.2f}",
                      f"{m['engine_utilization']:.2f}", str(m["model_turns"]),
                      f"{m['generated_tokens']:,}")
    Console().print(table)
    print(f"async_vs_batched_episodes_per_s = {result['async_vs_batched_episodes_per_s']:.2f}"
          f"   engine_utilization_agentic = {result['engine_utilization_agentic']:.2f}"
          f"   proxy_overhead_ms_p50 = {result['proxy_overhead_ms_p50']:.1f} "
          f"(direct {result['proxy']['direct_ms_p50']:.1f} ms)")
