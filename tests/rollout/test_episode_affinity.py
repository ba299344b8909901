"""Prefix affinity weighs real cache: an episode's next turn goes to the engine that holds
most of it cached, as the engines report it (``HoldsPrefixes.cached_tokens``), and spills to
another engine when that one has no free sequence, losing nothing. Real embedded engines and
a real dispatcher; the engines' prefix caches count what each request reused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollstream.clock import WallClock
from rollstream.config.schema import LocalEngineConfig, RewardConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.trajectory import Group, Sample, Segment, Task
from tests.engine.helpers import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
PROMPT = tuple(range(3, 43))  # 40 tokens: two whole blocks of 16 and some


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m"))


def _engines(model: Path, n: int, slots: int) -> list[LocalEngine]:
    cfg = LocalEngineConfig(max_slots=slots, max_seq_len=128, threads=1, device="cpu")
    return [LocalEngine(model, cfg, engine_id=f"e{i}") for i in range(n)]


async def _one(task: Task, text: str) -> float:
    return 1.0


def _dispatcher(engines: list[LocalEngine]) -> tuple[Dispatcher, GraderPool]:
    graders = GraderPool(RewardConfig(), lambda _: get_reward(_one))
    disp = Dispatcher(engines=engines, params=GREEDY, graders=graders, decode=lambda ids: "",
                      clock=WallClock(), lifecycle=Lifecycle(Ledger(), WallClock()),
                      prefix_affinity=True)
    return disp, graders


def _episode(disp: Dispatcher) -> Sample:
    sample = Group.new(Task(uid="t/0", source="t", prompt_ids=PROMPT, prompt_text="",
                            reference=""), 1).samples[0]
    disp.lifecycle.open(sample)
    return sample


def _hits(e: LocalEngine) -> float:
    return e.stats().work["prefix_hit_tokens"]


def _tools(sample: Sample, turn: int) -> None:
    """The environment's answer after a turn: 10 tokens."""
    sample.segments.append(Segment.env([50 + turn] * 10))


async def turn_away_from(disp: Dispatcher, sample: Sample, engine_id: str) -> None:
    """One greedy turn of ``sample`` while ``engine_id`` takes no request (drained)."""
    await disp.drain(engine_id)
    await disp.episode_turn(sample, GREEDY)
    disp.undrain(engine_id)


async def _close(engines: list[LocalEngine], graders: GraderPool) -> None:
    for e in engines:
        await e.close()
    graders.close()


async def test_an_episodes_next_turn_goes_where_most_of_it_is_cached(model: Path) -> None:
    """Turn 1 runs on e0, turn 2 on e1 (e0 drained: a spill), then e1's cache is dropped (a
    weight load). The router weighs what each engine holds of the next prompt, as the engine
    reports it (e0: turn 1's 47 computed tokens, two whole blocks; e1: nothing), so turn 3
    goes back to e0, although e1 ran the last turn, and e0 reuses exactly what the router
    counted."""
    from safetensors.torch import load_file

    engines = _engines(model, 2, slots=4)
    e0, e1 = engines
    disp, graders = _dispatcher(engines)
    try:
        sample = _episode(disp)
        await turn_away_from(disp, sample, "e1")
        assert sample.engine_id == "e0"
        _tools(sample, 1)
        assert disp.router.held(sample) == {"e0": 32}  # 40 + 8 - 1 computed: 2 blocks
        assert disp.router.held(sample)["e0"] == e0.cached_tokens(sample.served_ids())
        await turn_away_from(disp, sample, "e0")
        assert sample.engine_id == "e1" and disp.router.num_spills == 1
        _tools(sample, 2)
        # e1 computed turn 2's 40 + 8 + 10 + 8 - 1 = 65 tokens: 4 blocks; e0 still turn 1's
        assert disp.router.held(sample) == {"e1": 64, "e0": 32}
        await e1.load_weights(1, load_file(model / "model.safetensors"))  # drops its cache
        seen = disp.router.held(sample)
        assert seen == {"e1": 0, "e0": 32}
        before = _hits(e0), _hits(e1)
        await disp.episode_turn(sample, GREEDY)
        assert sample.engine_id == "e0"  # the engine that holds it, not the last one
        assert _hits(e0) - before[0] == seen["e0"] and _hits(e1) == before[1]
        assert disp.router.num_spills == 1 and disp.gauges()["spills"] == 1.0
    finally:
        await _close(engines, graders)


async def _three_turns(disp: Dispatcher, sample: Sample, before_turn_2=None) -> list[str]:
    """Three greedy turns with the environment's tokens between them; the engine of each."""
    ran = []
    for turn in range(3):
        if turn == 1 and before_turn_2 is not None:
            await before_turn_2()
        await disp.episode_turn(sample, GREEDY)
        ran.append(sample.engine_id or "")
        _tools(sample, turn)
    return ran


async def test_an_episode_whose_engine_is_full_spills_to_another_and_loses_nothing(
        model: Path) -> None:
    """Engines of one sequence each. After turn 1, another client (not the router's: the
    agent proxy, another run) takes the home engine's one sequence with a long request; turn
    2 spills to the other engine at once rather than waiting behind it, is counted, and the
    episode's tokens, logprobs and versions are those of the same episode on one engine."""
    engines = _engines(model, 2, slots=1)
    disp, graders = _dispatcher(engines)
    blocker: list[asyncio.Future] = []
    try:
        sample = _episode(disp)

        async def fill_home() -> None:
            home = disp.router.by_id[sample.engine_id or ""]
            assert disp.router.held(sample) == {home.engine_id: 32}
            request = GenerateRequest(request_id="other-client", prompt_ids=[1, 2, 3],
                                      params=SamplingParams(temperature=0.0,
                                                            max_new_tokens=120))
            blocker.append(asyncio.ensure_future(home.generate(request)))
            while home.stats().num_running == 0:
                await asyncio.sleep(0.001)

        ran = await asyncio.wait_for(_three_turns(disp, sample, fill_home), 60)
        assert ran[1] != ran[0], ran  # spilled, not queued behind the other client
        assert ran[2] == ran[1], ran  # where most of it is cached now (turn 2's context)
        assert disp.router.num_spills == 1 and disp.gauges()["spills"] == 1.0
        out = await asyncio.wait_for(blocker[0], 60)  # the other client's request is intact
        assert len(out.token_ids) == 120
    finally:
        await _close(engines, graders)

    ref_engines = _engines(model, 1, slots=1)
    ref_disp, ref_graders = _dispatcher(ref_engines)
    try:
        ref = _episode(ref_disp)
        await _three_turns(ref_disp, ref)
    finally:
        await _close(ref_engines, ref_graders)
    assert sample.response_ids == ref.response_ids and sample.versions == ref.versions
    assert sample.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def _first_sample(disp: Dispatcher, uid: str, prompt: tuple[int, ...]) -> Sample:
    sample = Group.new(Task(uid=uid, source="t", prompt_ids=prompt, prompt_text="",
                            reference=""), 2).samples[0]
    disp.lifecycle.open(sample)
    return sample


async def test_a_groups_first_sample_goes_where_its_prompt_is_cached(model: Path) -> None:
    """A group whose prompt begins with an instruction an earlier group left in e1's prefix
    cache goes to e1, although e0 is the least loaded (ties go to e0), prefills only the rest,
    and its group's later samples follow it there; a prompt no engine holds goes to e0."""
    engines = _engines(model, 2, slots=4)
    e0, e1 = engines
    disp, graders = _dispatcher(engines)
    instruction = tuple(range(3, 35))  # 32 tokens: two whole blocks
    try:
        first = _first_sample(disp, "a/0", (*instruction, 40, 41, 42))
        await turn_away_from(disp, first, "e0")
        assert first.engine_id == "e1"
        assert disp.router.load.least(disp.router.admits) is e0
        second = _first_sample(disp, "b/0", (*instruction, 43, 44))
        assert disp.router.holders(second.task.prompt_ids) == [e1]
        before = _hits(e1)
        await disp.episode_turn(second, GREEDY)
        assert second.engine_id == "e1" and _hits(e1) - before == 32
        assert disp.router.home[second.group_id] == "e1"  # the group's next samples: e1
        other = _first_sample(disp, "c/0", tuple(range(50, 90)))
        assert disp.router.holders(other.task.prompt_ids) == []
        await disp.episode_turn(other, GREEDY)
        assert other.engine_id == "e0"
    finally:
        await _close(engines, graders)
