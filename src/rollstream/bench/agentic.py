"""Benchmark: multi-turn episodes with slow, heavy-tailed tools, batched by turn vs async.

    rollstream bench agentic [--json OUT] [--quick]

The same 128 episodes on the embedded engine (kit model, char tokenizer, greedy), 32 in
flight at a time (the engine's slots), in several modes: each episode has a number of tool
turns drawn from a long-tailed distribution (median 3, at most 12), and after every model turn
but the last its tool answers after a latency drawn log-normal (median 50 ms, p99 2 s), seeded
per episode so every mode sees the same turns and latencies (``agentic_envs.py``). The tool is
simulated (a sleep, then a tool message); the model turns are real generation (at most 32
tokens each).

* ``batched``: waves of 32 episodes through ``AgentLoop``; in a wave every episode's turn k
  waits for the slowest tool of turn k of all (the turn-synchronous loop of frameworks that
  batch an agent step at a time), and the next wave starts when the last episode of this one
  ends;
* ``async`` (``builtin``): rollstream's loop, each episode on its own, a new one starting
  whenever one ends, the environments built in place;
* ``user_env``: the same loop and episodes, the environment named by its import path in a
  dataset source and built from each row through the run's own resolution (what a user's
  environment goes through);
* ``verifiers`` (with the ``verifiers`` extra): the same episodes as a ``vf.MultiTurnEnv``
  run by the verifiers adapter, its rollout calling the OpenAI-compatible proxy (a session
  per episode: rendering, HTTP, JSON, stitching);
* ``no_prefix_cache``: ``async`` on a second engine without the prefix cache
  (``prefix_cache_tokens: 0``), so every turn prefills the episode's whole history.

The async modes run in interleaved rounds (``REPEATS_FULL`` of them, the order rotating from
round to round). Keys: ``async_vs_batched_episodes_per_s`` (target >= 2),
``engine_utilization_agentic`` (the engine's busy time / wall time in the async mode; target
>= 0.8), ``user_env_vs_builtin_episodes_per_s``, ``verifiers_vs_builtin_episodes_per_s`` and
``prefix_cache_vs_none_episodes_per_s`` (``async`` / ``no_prefix_cache``; target >= 1.5)
(the geometric mean of the rounds' ratios, with ``*_ci95``: Student's t on their logs), with
``prefix_cache_vs_none_bound`` = ``1 / (1 - p * h)``: ``p`` (``prefill_share_without_cache``)
the prefill share of engine pass time without the cache and ``prefill_share_with_cache`` with
it, each read once after the rounds on an engine whose prefills are passes of their own
(``fuse_prefill: false``; fused, a prefill's time is inside a decode pass), ``h``
(``hit_share``) the share of prompt tokens the cache held over the ``async`` rounds (those
two runs are in ``prefill_apart``, reported as the modes are); per
mode the episodes/s, wall time, engine busy seconds and pass work, tokens and utilization of
its first round, ``repeats`` (each round's episodes/s); ``proxy_overhead_ms_p50``: the median
time of a one-turn call through the proxy with the ``openai`` SDK minus that of the same
request sent to the engine directly.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.environment import Observation
from rollstream.agent.loop import AgentLoop, Budgets, EngineTurns, EpisodeEnd
from rollstream.bench.agentic_envs import (
    MAX_TURNS,
    PATH,
    TOOL_MEDIAN_S,
    TOOL_P99_S,
    ToolEpisodeEnv,
    draw,
    rollout_row,
)
from rollstream.bench.pair import ratio_interval
from rollstream.config.schema import LocalEngineConfig, TinyModelConfig
from rollstream.engine import EngineStats, GenerateRequest, SamplingParams
from rollstream.engine.local.engine import LocalEngine
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import build_char_tokenizer

TURN_TOKENS = 32
REPEATS_FULL, REPEATS_QUICK = 8, 2  # 8: a ratio near 1 with its 95% interval within ~4%


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


class _ToolEpisode(ToolEpisodeEnv):
    """The bench's episode built in place (the built-in loop), with the batched mode's
    barrier after each tool turn."""

    def __init__(self, index: int, seed: int, barrier: _TurnBarrier | None) -> None:
        super().__init__(row={"index": index, "seed": seed})
        self.barrier = barrier

    async def step(self, turn) -> Observation:
        if self.step_count == self.turns:
            if self.barrier is not None:
                self.barrier.leave()
            return await super().step(turn)
        out = await super().step(turn)
        if self.barrier is not None:
            await self.barrier.wait()
        return out


def _user_envs(n: int, seed: int) -> list[Any]:
    """The same episodes as a user's environment named by import path: the source resolved
    and checked as a run's is (``episode_sources``), each episode's environment built from
    its row by the source, as the harness builds it."""
    from rollstream.agent.episodes import episode_sources
    from rollstream.config.schema import TasksConfig
    from rollstream.config.tasks import EPISODE_ROW
    from rollstream.trajectory import Task

    with tempfile.TemporaryDirectory(prefix="bench-agentic-rows-") as tmp:
        rows = Path(tmp) / "rows.jsonl"
        rows.write_text("".join(json.dumps({"index": i, "seed": seed, "prompt": "-",
                                            "answer": "x"}) + "\n" for i in range(n)))
        tasks = TasksConfig.model_validate({"sources": [{
            "name": "user", "kind": "jsonl", "path": str(rows), "harness": "agent",
            "environment": PATH}], "num_eval": 0})
        source = episode_sources(tasks)["user"]
    return [source.environment(Task(uid=f"user/{i}", source="user", prompt_ids=(1,),
                                    prompt_text="-", reference="x",
                                    extra={EPISODE_ROW: {"index": i, "seed": seed}}), None)
            for i in range(n)]


async def _run_mode(engine: LocalEngine, renderer: ChatRenderer, envs: list[Any],
                    concurrency: int, tag: str, batched: bool) -> dict[str, Any]:
    """The episodes of ``envs``, ``concurrency`` at a time: batched, in waves that each run to
    their end turn by turn; async, a new episode starting whenever one ends."""
    loop = AgentLoop(renderer=renderer,
                     sampling=SamplingParams(temperature=0.0),
                     budgets=Budgets(max_turns=MAX_TURNS + 1, max_turn_tokens=TURN_TOKENS,
                                     max_total_tokens=8192))
    turns = EngineTurns(engine)
    n = len(envs)
    before = engine.stats()
    t0 = time.perf_counter()
    if batched:
        episodes = []
        for lo in range(0, n, concurrency):
            wave = envs[lo:lo + concurrency]
            barrier = _TurnBarrier(len(wave))
            for env in wave:
                env.barrier = barrier
            episodes += await asyncio.gather(*(
                loop.run(env, episode_id=f"{tag}{env.index}", generate=turns) for env in wave))
    else:
        slots = asyncio.Semaphore(concurrency)

        async def one(env: Any):
            async with slots:
                return await loop.run(env, episode_id=f"{tag}{env.index}", generate=turns)

        episodes = await asyncio.gather(*(one(env) for env in envs))
    wall = time.perf_counter() - t0
    assert all(ep.end is EpisodeEnd.DONE for ep in episodes), [ep.end for ep in episodes]
    return _mode_result(engine, before, n, wall,
                        sum(ep.num_model_turns for ep in episodes),
                        sum(sum(env.latencies) for env in envs))


_WORK = ("prefill_s", "sort_s", "decode_s", "prefix_hit_tokens", "prefix_query_tokens")


def _mode_result(engine: LocalEngine, before: EngineStats, n: int, wall: float,
                 model_turns: int, tool_time_s: float) -> dict[str, Any]:
    stats = engine.stats()
    busy = stats.busy_s - before.busy_s
    return {"episodes": n, "wall_s": wall, "episodes_per_s": n / wall,
            "engine_busy_s": busy, "engine_utilization": busy / wall,
            "generated_tokens": stats.generated_tokens - before.generated_tokens,
            "model_turns": model_turns, "tool_time_s": tool_time_s,
            "work": {k: stats.work.get(k, 0.0) - before.work.get(k, 0.0) for k in _WORK}}


def _prefill_share(work: dict[str, float]) -> float:
    """Prefill passes' share of an engine's pass time (read where prefill is not fused)."""
    busy = work["prefill_s"] + work["sort_s"] + work["decode_s"]
    return work["prefill_s"] / busy if busy else 0.0


async def _verifiers_mode(engine: LocalEngine, renderer: ChatRenderer, n: int,
                          concurrency: int, seed: int, tag: str) -> dict[str, Any]:
    """The same episodes as a ``vf.Environment`` (``agentic_envs.load_environment``) through
    the verifiers adapter: its rollout against the proxy, a session per episode."""
    from rollstream.agent.proxy import AgentProxy
    from rollstream.agent.verifiers_env import VerifiersAgent
    from rollstream.config.tasks import EPISODE_ROW
    from rollstream.trajectory import Task

    agent = VerifiersAgent(environment="rollstream.bench.agentic_envs:load_environment",
                           kwargs_json=json.dumps({"seed": seed, "episodes": n}),
                           prompt_column="prompt")
    agent.load()  # built once per process, outside the timed part as a run builds it
    sampling = SamplingParams(temperature=0.0, max_new_tokens=TURN_TOKENS)
    slots = asyncio.Semaphore(concurrency)
    calls = []
    async with AgentProxy([engine], renderer.tokenizer) as proxy:
        async def one(i: int) -> None:
            async with slots:
                handle = proxy.open_session(f"{tag}{i}")
                task = Task(uid=f"vf/{i}", source="vf", prompt_ids=(1,), prompt_text="-",
                            reference="", extra={EPISODE_ROW: rollout_row(i, seed)})
                await agent(handle, task, sampling)
                calls.append(sum(s.num_calls for s in proxy.close_session(handle.api_key)))

        before = engine.stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return _mode_result(engine, before, n, wall, sum(calls),
                        sum(sum(draw(i, seed)[1]) for i in range(n)))


def _has_verifiers() -> str | None:
    """None when the verifiers extra is installed, else why its rows are skipped."""
    try:
        import verifiers  # noqa: F401
    except ImportError as e:
        return f"verifiers not installed (pip install 'rollstream[verifiers]'): {e}"
    return None


async def _bench(folder: Path, n: int, concurrency: int, seed: int,
                 repeats: int) -> dict[str, Any]:
    """Batched once; then ``repeats`` rounds of the async modes on the same episodes, their
    order rotating from round to round so that a drift in the machine's load hits each."""
    engine, plain, apart, apart_plain = (LocalEngine(folder, LocalEngineConfig(
        max_slots=concurrency, max_seq_len=2048, threads=2, device="cpu", **kw),
        engine_id=name) for name, kw in (
            ("cache", {}), ("none", {"prefix_cache_tokens": 0}),
            ("cache-apart", {"fuse_prefill": False}),  # prefill passes of their own: their
            ("none-apart", {"prefix_cache_tokens": 0, "fuse_prefill": False})))  # time apart
    renderer = ChatRenderer(build_char_tokenizer())
    sides = ["builtin", "user_env", "no_prefix_cache"] + (
        ["verifiers"] if _has_verifiers() is None else [])
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    try:
        for e in (engine, plain):
            warm = [_ToolEpisode(i, seed + 1, None) for i in range(4)]
            await _run_mode(e, renderer, warm, 4, "w", batched=False)
        batched = await _run_mode(engine, renderer, [_ToolEpisode(i, seed, None)
                                                     for i in range(n)],
                                  concurrency, "b", batched=True)
        for r in range(repeats):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                tag = f"{side[0]}{r}-"
                if side == "verifiers":
                    out = await _verifiers_mode(engine, renderer, n, concurrency, seed, tag)
                else:
                    envs = (_user_envs(n, seed) if side == "user_env" else
                            [_ToolEpisode(i, seed, None) for i in range(n)])
                    out = await _run_mode(plain if side == "no_prefix_cache" else engine,
                                          renderer, envs, concurrency, tag, batched=False)
                runs[side].append(out)
        unfused = {}  # on engines with prefill passes of their own, with the cache and without
        for name, e in (("with_cache", apart), ("without_cache", apart_plain)):
            await _run_mode(e, renderer, [_ToolEpisode(i, seed + 1, None) for i in range(4)], 4,
                            "w", batched=False)
            unfused[name] = await _run_mode(
                e, renderer, [_ToolEpisode(i, seed, None) for i in range(n)], concurrency,
                f"p-{name}-", batched=False)
        overhead = await _proxy_overhead(engine, renderer, calls=20 if n < 64 else 100)
    finally:
        for e in (engine, plain, apart, apart_plain):
            await e.close()
    return {"batched": batched, "runs": runs, "proxy": overhead, "prefill_apart": unfused}


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
    n, concurrency, seed = (8, 8, 0) if quick else (128, 32, 0)
    repeats = REPEATS_QUICK if quick else REPEATS_FULL
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        folder = build_tiny_model(TinyModelConfig(), build_char_tokenizer(), Path(tmp) / "m")
        out = asyncio.run(_bench(folder, n, concurrency, seed, repeats))
    runs = out["runs"]
    modes = {"batched": out["batched"], "async": runs["builtin"][0],
             **{side: got[0] for side, got in runs.items() if side != "builtin"}}
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
        "modes": modes,
        "repeats": {side: [r["episodes_per_s"] for r in got] for side, got in runs.items()},
        "proxy": out["proxy"],
        "async_vs_batched_episodes_per_s": (modes["async"]["episodes_per_s"]
                                            / modes["batched"]["episodes_per_s"]),
        "engine_utilization_agentic": modes["async"]["engine_utilization"],
        "proxy_overhead_ms_p50": out["proxy"]["overhead_ms_p50"],
    }
    for side in ("user_env", "verifiers"):
        if side not in runs:
            result[f"{side}_vs_builtin_skipped"] = _has_verifiers()
            continue
        mean, low, high = _ratio(runs[side], runs["builtin"])
        result[f"{side}_vs_builtin_episodes_per_s"] = mean
        result[f"{side}_vs_builtin_ci95"] = [low, high]
    mean, low, high = _ratio(runs["builtin"], runs["no_prefix_cache"])
    result["prefix_cache_vs_none_episodes_per_s"] = mean
    result["prefix_cache_vs_none_ci95"] = [low, high]
    # the bound 1 / (1 - p * h): p the prefill share of engine time without the cache, h the
    # hit share of the prompt tokens with it (over the rounds)
    works = [r["work"] for r in runs["builtin"]]
    h = sum(w["prefix_hit_tokens"] for w in works) / max(
        sum(w["prefix_query_tokens"] for w in works), 1.0)
    p = _prefill_share(out["prefill_apart"]["without_cache"]["work"])
    result["prefill_share_without_cache"] = p
    result["prefill_share_with_cache"] = _prefill_share(out["prefill_apart"]["with_cache"]["work"])
    result["prefill_apart"] = out["prefill_apart"]  # those two runs, as the modes are reported
    result["hit_share"] = h
    result["prefix_cache_vs_none_bound"] = 1.0 / (1.0 - p * h) if p * h < 1 else math.inf
    _print(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[float, float, float]:
    """The geometric mean of the rounds' episodes/s ratios a / b and its 95% interval."""
    return ratio_interval([x["episodes_per_s"] / y["episodes_per_s"]
                           for x, y in zip(a, b, strict=True)])


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
    low, high = result["prefix_cache_vs_none_ci95"]
    print(f"prefix_cache_vs_none_episodes_per_s = "
          f"{result['prefix_cache_vs_none_episodes_per_s']:.3f} (95% {low:.3f}-{high:.3f}; "
          f"bound 1/(1 - p*h) = {result['prefix_cache_vs_none_bound']:.3f}: prefill share "
          f"without the cache p = {result['prefill_share_without_cache']:.2f}, with it "
          f"{result['prefill_share_with_cache']:.2f}, hit share h = {result['hit_share']:.2f})")
    for side in ("user_env", "verifiers"):
        if f"{side}_vs_builtin_episodes_per_s" in result:
            low, high = result[f"{side}_vs_builtin_ci95"]
            print(f"{side}_vs_builtin_episodes_per_s = "
                  f"{result[f'{side}_vs_builtin_episodes_per_s']:.3f} (95% {low:.3f}-{high:.3f}, "
                  f"{len(result['repeats'][side])} interleaved rounds)")
        else:
            print(f"{side}: skipped, {result[f'{side}_vs_builtin_skipped']}")
