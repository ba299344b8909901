"""Control and data planes apart (runtime/ray/dataplane.py) through a real engine actor: an
agent episode run through the dispatcher with deltas samples exactly what it samples with
whole prompts; so do episodes whose histories the actor evicted (they are sent again whole)
and an episode whose actor was killed and replaced mid-way; control messages stay under a
bound however long the history, while the tokens go out of band; no Ray process and no
shared-memory segment is left.

One local Ray and one engine actor for the module (its histories capped at
``ACTOR_CACHE_TOKENS``); each test makes its own proxies over it. Requests run one at a time,
so every forward pass holds one sequence and a seeded request samples the same tokens and
logprobs, bit for bit, however its prompt reached the actor."""

from __future__ import annotations

import asyncio
import os
import random
import time
import zlib
from pathlib import Path

import httpx
import pytest

from rollstream.agent.loop import Budgets
from rollstream.config.schema import LocalEngineConfig, TinyModelConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.engine.states import EngineHealth
from rollstream.trajectory import Group, SampleStatus
from tests.agent.test_harness import ScriptedSource, _dispatcher, _task
from tests.runtime.test_ray import _descendants

pytestmark = pytest.mark.ray
ACTOR_CACHE_TOKENS = 256  # the agent episode below fits (~90 tokens); three manual ones do not
# a generate call's control message (request id, sampling params, stamps, the reference of
# its tokens) and its reply's (finish reason, error, reference), pickled: measured 225 B and
# 164 B, whatever the history's length
CONTROL_BYTES_BOUND = 300
_state: dict = {}


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory):
    """The module's engine actor: every payload out of band (threshold 0)."""
    from rollstream.config.runtime import RayConfig
    from rollstream.models.tiny import build_tiny_model
    from rollstream.models.tokenizer import build_char_tokenizer
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.engines import build_ray_engines

    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, max_position=512, seed=3)  # tests/agent's
    model = build_tiny_model(cfg, build_char_tokenizer(), tmp_path_factory.mktemp("model"))
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # the interpreter's own (the reward workers start it)
    before, segments = _descendants(), set(os.listdir("/dev/shm"))
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        # no prefix cache: these tests compare the tokens and logprobs of whole prompts and
        # of deltas exactly, and a prompt whose prefix the cache holds (the same actor served
        # it) attends over that KV in another order, equal to 1e-4 only (test_local_prefix)
        (engine,) = build_ray_engines(
            model, LocalEngineConfig(max_slots=4, max_seq_len=512, threads=1,
                                     prefix_cache_tokens=0),
            num_engines=1, version=0, num_cpus=1,
            episode_cache_tokens=ACTOR_CACHE_TOKENS, out_of_band_bytes=0)
        _state["actor"], _state["model"] = engine.actor, model
        yield engine
    finally:
        cluster.stop()
        _state.clear()
    deadline = time.monotonic() + 10  # Ray's workers exit after its shutdown returns
    while (left := _descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"Ray processes outlived the module: {_cmdlines(left)}"
    assert set(os.listdir("/dev/shm")) <= segments, "a shared-memory segment was left"


def _cmdlines(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            out.append(f"{pid} (gone)")
    return out


def _proxy(owner, *, cache_tokens: int, out_of_band_bytes: int, max_restarts: int = 0):
    """A proxy over the module's (current) actor; ``cache_tokens`` 0: whole prompts."""
    from rollstream.runtime.ray.dataplane import Episodes
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.sync.object_store import ObjectStore

    engine = RayEngine(engine_id="ray-0", spawn=owner._spawn, weights=ObjectStore(),
                       version=0, max_restarts=max_restarts, actor=_state["actor"],
                       episodes=Episodes(cache_tokens), out_of_band_bytes=out_of_band_bytes)
    sizes: list[int] = []  # each call's control bytes, sent and received
    call, reply = engine.wire.call, engine.wire.reply

    def on_call(*args):
        before = engine.wire.sent_bytes
        call(*args)
        if args:  # generate and interrupt calls (stats and peek calls send nothing)
            sizes.append(engine.wire.sent_bytes - before)

    def on_reply(value):
        before = engine.wire.received_bytes
        reply(value)
        if type(value).__name__ == "GenerateReply":
            sizes.append(engine.wire.received_bytes - before)

    engine.wire.call, engine.wire.reply = on_call, on_reply
    return engine, sizes


async def _agent_episode(engine, tmp_path: Path, name: str):
    disp, graders = _dispatcher(engine, ScriptedSource(turns=3), Ledger(tmp_path / f"{name}.jsonl"),
                                budgets=Budgets(max_turns=3, max_turn_tokens=12,
                                                max_total_tokens=200))
    group = Group.new(_task(), 1)  # one sample: one sequence per forward pass
    try:
        await asyncio.wait_for(disp.run_group(group), 120)
    finally:
        graders.close()
    (sample,) = group.samples
    assert sample.status is SampleStatus.GRADED, sample.failure
    return [(s.kind, s.token_ids, s.logprobs, s.versions) for s in sample.segments]


async def test_an_agent_episode_with_deltas_samples_what_whole_prompts_sample(owner, tmp_path):
    whole, _ = _proxy(owner, cache_tokens=0, out_of_band_bytes=100 << 10)
    reference = await _agent_episode(whole, tmp_path, "whole")
    delta, sizes = _proxy(owner, cache_tokens=10_000, out_of_band_bytes=0)
    assert await _agent_episode(delta, tmp_path, "delta") == reference
    assert len(reference) == 5  # three model turns, two tool answers
    w, d = whole.stats().work, delta.stats().work
    assert w["data_sent_bytes"] == 0 and w["episode_reused_tokens"] == 0  # prompts whole, inline
    # with deltas: every turn after the first sent only what was added, out of band
    assert d["episode_reused_tokens"] > 0 and d["episode_misses"] == 0
    assert d["data_sent_bytes"] > 0 and d["data_received_bytes"] > 0
    assert max(sizes) <= CONTROL_BYTES_BOUND, sizes
    assert d["wire_sent_bytes"] + d["data_sent_bytes"] < w["wire_sent_bytes"]
    # the episode ended: its actor was told to drop the history with the next call
    assert delta._episodes.num_tokens == 0 and delta._episodes._forget


async def test_turns_of_the_agent_loop_and_of_proxy_sessions_send_deltas(owner):
    """Outside the dispatcher too: an agent loop calling the engine directly (``EngineTurns``)
    and an unbound proxy session name their episode, so later turns send what was added."""
    from rollstream.agent.chat import ChatRenderer
    from rollstream.agent.environment import ThreadedEnvironment
    from rollstream.agent.loop import AgentLoop, EngineTurns, EpisodeEnd
    from rollstream.agent.proxy import AgentProxy
    from rollstream.models.tokenizer import build_char_tokenizer
    from tests.agent.test_loop import Scripted

    tokenizer = build_char_tokenizer()
    engine, _ = _proxy(owner, cache_tokens=10_000, out_of_band_bytes=100 << 10)
    loop = AgentLoop(renderer=ChatRenderer(tokenizer), sampling=SamplingParams(temperature=0.0),
                     budgets=Budgets(max_turn_tokens=12))
    ep = await loop.run(ThreadedEnvironment(Scripted(replies=2)), episode_id="loop",
                        generate=EngineTurns(engine))
    assert ep.end is EpisodeEnd.DONE and ep.num_model_turns == 3
    work = engine.stats().work
    # turns 2 and 3 reused what the actor held: at least the prompt and turn 1, then turn 2
    assert work["episode_reused_tokens"] >= 2 * len(ep.prompt_ids), work
    assert work["episode_misses"] == 0

    engine, _ = _proxy(owner, cache_tokens=10_000, out_of_band_bytes=100 << 10)
    async with AgentProxy([engine], tokenizer) as proxy:
        handle = proxy.open_session("p")
        messages = [{"role": "user", "content": "what is 3 + 4"}]
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=60) as client:
            for _ in range(2):
                body = {"model": "tiny", "messages": messages, "max_tokens": 8,
                        "temperature": 0.0}
                reply = (await client.post("/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {handle.api_key}"}))
                reply.raise_for_status()
                text = reply.json()["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": "and then"}]
        (sample,) = proxy.close_session(handle.api_key)
    work = engine.stats().work
    assert sample.num_calls == 2 and work["episode_reused_tokens"] > 0, work
    # the session ended: the proxy's mirror forgot it and tells the actor with the next call
    assert engine._episodes.num_tokens == 0 and engine._episodes._forget


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _turns(rng: random.Random, num: int) -> tuple[list[int], list[list[int]]]:
    """An opening prompt and what an environment adds after each of ``num`` turns."""
    return ([rng.randrange(3, 60) for _ in range(rng.randrange(20, 40))],
            [[rng.randrange(3, 60) for _ in range(rng.randrange(5, 15))] for _ in range(num)])


async def _run_turns(engine, name: str, opening: list[int], answers: list[list[int]],
                     *, between=None) -> list[tuple]:
    """Turns of one episode on ``engine``: each prompt the last one, its output and the
    answer; ``between(i)`` is awaited before turn i."""
    prompt, outs = list(opening), []
    for i, answer in enumerate(answers):
        if between is not None:
            await between(i)
        out = await engine.generate(GenerateRequest(
            request_id=f"{name}/{i}", prompt_ids=prompt, episode_id=name,
            params=SamplingParams(temperature=1.0, max_new_tokens=10, seed=_seed(name))))
        assert out.error is None, out.error
        outs.append((out.token_ids, out.logprobs, out.versions, out.finish_reason))
        prompt = prompt + out.token_ids + answer
    return outs


async def test_histories_the_actor_evicted_are_sent_again_whole(owner):
    rng = random.Random(1)
    episodes = {f"ep{i}": _turns(rng, 5) for i in range(3)}
    whole, _ = _proxy(owner, cache_tokens=0, out_of_band_bytes=100 << 10)
    reference = {n: await _run_turns(whole, n, *t) for n, t in episodes.items()}
    # the driver mirrors more than the actor keeps (ACTOR_CACHE_TOKENS): interleaved, the
    # three histories (~100-150 tokens each by the last turns) evict one another on the actor
    # only
    delta, _ = _proxy(owner, cache_tokens=10_000, out_of_band_bytes=100 << 10)
    got: dict[str, list] = {n: [] for n in episodes}
    prompts = {n: list(t[0]) for n, t in episodes.items()}
    for turn in range(5):
        for n, (_, answers) in episodes.items():
            out = await delta.generate(GenerateRequest(
                request_id=f"{n}/{turn}", prompt_ids=prompts[n], episode_id=n,
                params=SamplingParams(temperature=1.0, max_new_tokens=10, seed=_seed(n))))
            got[n].append((out.token_ids, out.logprobs, out.versions, out.finish_reason))
            prompts[n] = prompts[n] + out.token_ids + answers[turn]
    assert got == reference
    work = delta.stats().work
    assert work["episode_misses"] > 0 and work["episode_reused_tokens"] > 0, work


async def test_an_episode_whose_actor_was_replaced_samples_the_same_tokens(owner):
    import ray

    opening, answers = _turns(random.Random(2), 4)
    whole, _ = _proxy(owner, cache_tokens=0, out_of_band_bytes=100 << 10)
    reference = await _run_turns(whole, "r", opening, answers)
    delta, _ = _proxy(owner, cache_tokens=10_000, out_of_band_bytes=0, max_restarts=1)

    async def kill_before_turn_2(i: int) -> None:
        if i != 2:
            return
        ray.kill(delta.actor, no_restart=True)
        while not delta.needs_restart():
            await asyncio.sleep(0.01)
        restart = asyncio.create_task(delta.restart(0, None))  # the folder's weights: v0
        await asyncio.sleep(0)  # it waits on the new actor now: its last restart, RECOVERING
        assert not restart.done() and delta.stats().health is EngineHealth.RECOVERING
        await restart
        _state["actor"] = delta.actor  # later tests use the new actor

    assert await _run_turns(delta, "r", opening, answers, between=kill_before_turn_2) == reference
    work = delta.stats().work
    # turn 1 reused turn 0's history; turn 2 went whole to the new actor (it held nothing
    # and the proxy knew: no miss), turn 3 reused turn 2's
    assert delta.num_restarts == 1 and work["episode_misses"] == 0
    assert work["episode_reused_tokens"] > 0 and work["data_objects"] >= 8  # 4 prompts, 4 replies


def _blocks(sample) -> int:
    """The whole blocks of prefix cache an episode's last turn left on its engine."""
    return (len(sample.served_ids()) - 1) // 16 * 16


async def _fresh_held(disp, sample, engine_id: str, want, timeout_s: float = 20.0) -> dict:
    """The router's count of what each engine holds of ``sample``, once ``engine_id``'s
    reads ``want`` (a Ray proxy's mirror is as of its actor's last poll; asking polls)."""
    deadline = time.monotonic() + timeout_s
    while (held := disp.router.held(sample)).get(engine_id) != want:
        assert time.monotonic() < deadline, held
        await asyncio.sleep(0.05)
    return held


async def test_the_router_weighs_what_each_engine_actor_holds(owner):
    """Two engine actors with prefix caches: their proxies mirror each cache from the
    actor's polls (``PrefixIndex``), so the router weighs real cache on Ray as it does for
    embedded engines (tests/rollout/test_episode_affinity.py): turn 1 on ray-0, turn 2 on
    ray-1 (ray-0 drained), then ray-1's cache is dropped by a weight load: turn 3 goes back
    to ray-0, which holds turn 1, and reuses exactly what the router counted."""
    import ray
    from safetensors.torch import load_file

    from rollstream.runtime.ray.engines import build_ray_engines
    from tests.rollout.test_episode_affinity import (
        GREEDY,
        _dispatcher,
        _episode,
        _tools,
        turn_away_from,
    )

    engines = build_ray_engines(_state["model"], LocalEngineConfig(
        max_slots=4, max_seq_len=128, threads=1, prefix_cache_tokens=1024),
        num_engines=2, version=0, num_cpus=0.5)
    e0, e1 = engines
    disp, graders = _dispatcher(engines)
    try:
        sample = _episode(disp)
        await turn_away_from(disp, sample, "ray-1")
        assert sample.engine_id == "ray-0"
        one = _blocks(sample)  # what its row computed, all but the last token, whole blocks
        _tools(sample, 1)
        assert one > 0 and (await _fresh_held(disp, sample, "ray-0", one)) == {"ray-0": one}
        await turn_away_from(disp, sample, "ray-0")
        assert sample.engine_id == "ray-1" and disp.router.num_spills == 1
        two = _blocks(sample)
        _tools(sample, 2)
        assert two > one
        assert (await _fresh_held(disp, sample, "ray-1", two)) == {"ray-1": two, "ray-0": one}
        await e1.load_weights(1, load_file(_state["model"] / "model.safetensors"))
        seen = await _fresh_held(disp, sample, "ray-1", 0)  # its cache was dropped
        assert seen == {"ray-1": 0, "ray-0": one}
        hits = e0.stats().work["prefix_hit_tokens"]
        await disp.episode_turn(sample, GREEDY)
        assert sample.engine_id == "ray-0"  # the engine that holds it, not the last one
        deadline = time.monotonic() + 20  # the proxy's stats are as of the actor's last poll
        while e0.stats().work["prefix_hit_tokens"] == hits and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert e0.stats().work["prefix_hit_tokens"] - hits == seen["ray-0"]
    finally:
        graders.close()
        for e in engines:
            ray.kill(e.actor, no_restart=True)
