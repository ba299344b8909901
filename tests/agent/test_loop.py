"""The agent loop on the real embedded engine: token-exact multi-turn episodes, budgets with
their reasons, and a turn interrupted for a weight update that resumes on the new weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from rollstream.agent.chat import ChatRenderer, check_alignment
from rollstream.agent.environment import Observation, ThreadedEnvironment
from rollstream.agent.loop import AgentLoop, Budgets, EngineTurns, EpisodeEnd
from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.trajectory import SegmentKind

GREEDY = SamplingParams(temperature=0.0)
OPENING = [{"role": "system", "content": "sum the numbers"}, {"role": "user", "content": "3 4 5"}]


class Scripted:
    """A synchronous environment: answers ``replies`` tool messages, then grades."""

    def __init__(self, replies: int, *, delay_s: float = 0.0) -> None:
        self.replies, self.delay_s, self.turns = replies, delay_s, []

    def reset(self):
        return list(OPENING)

    def step(self, turn):
        import time

        time.sleep(self.delay_s)
        self.turns.append(turn)
        if len(self.turns) > self.replies:
            return Observation(messages=[], done=True, reward=float(len(turn.text)))
        return Observation(messages=[{"role": "tool", "content": f"ok {len(self.turns)}"}],
                           done=False)


def _loop(engine, model_dir, **budgets) -> AgentLoop:
    renderer = ChatRenderer(build_char_tokenizer())
    return AgentLoop(renderer=renderer, sampling=GREEDY, budgets=Budgets(**budgets))


async def test_episode_is_token_exact_and_alternates_model_and_environment(engine, model_dir):
    loop = _loop(engine, model_dir, max_turn_tokens=24)
    env = Scripted(replies=2)
    ep = await loop.run(ThreadedEnvironment(env), episode_id="ep0", generate=EngineTurns(engine))
    assert ep.end is EpisodeEnd.DONE and ep.reward == float(len(env.turns[-1].text))
    kinds = [s.kind for s in ep.segments]
    assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * 2 + [SegmentKind.POLICY]
    assert [t.kind for t in ep.turns] == kinds and ep.num_model_turns == 3
    assert all(not any(s.loss_mask) and set(s.versions) == {-1}
               for s in ep.segments if s.kind is SegmentKind.ENV)
    assert ep.token_ids == ep.prompt_ids + ep.response_ids
    check_alignment(loop.renderer, ep.messages, ep.token_ids)  # what the template renders
    # each model turn is what the engine serves for exactly the ids before it
    at = len(ep.prompt_ids)
    for i, seg in enumerate(ep.segments):
        if seg.kind is SegmentKind.POLICY:
            params = SamplingParams(temperature=0.0, max_new_tokens=24,
                                    stop_token_ids=tuple(loop.renderer.stop_token_ids(OPENING)))
            again = await engine.generate(GenerateRequest(
                request_id=f"again{i}", prompt_ids=ep.token_ids[:at], params=params))
            assert again.token_ids == seg.token_ids
            assert seg.logprobs == pytest.approx(again.logprobs, abs=1e-4)
        at += len(seg)


@pytest.mark.parametrize(("budgets", "end", "replies"), [
    ({"max_turns": 2}, EpisodeEnd.MAX_TURNS, 10),
    ({"max_turn_tokens": 5, "max_total_tokens": 20}, EpisodeEnd.MAX_TOKENS, 10),
])
async def test_budgets_end_the_episode_with_their_reason(engine, model_dir, budgets, end,
                                                         replies):
    ep = await _loop(engine, model_dir, **budgets).run(ThreadedEnvironment(Scripted(replies)),
                                                       episode_id="b",
                                                       generate=EngineTurns(engine))
    assert ep.end is end
    assert ep.num_model_turns <= budgets.get("max_turns", 8)
    assert len(ep.response_ids) <= budgets.get("max_total_tokens", 2048)
    assert all(t.num_tokens <= budgets.get("max_turn_tokens", 256)
               for t in ep.turns if t.kind is SegmentKind.POLICY)


async def test_wall_time_stops_a_slow_environment(engine, model_dir):
    loop = _loop(engine, model_dir, max_turn_tokens=8, max_wall_s=0.5)
    ep = await loop.run(ThreadedEnvironment(Scripted(10, delay_s=0.3)), episode_id="w", generate=EngineTurns(engine))
    assert ep.end is EpisodeEnd.MAX_WALL and ep.duration_s < 1.5


async def test_a_turn_interrupted_for_new_weights_resumes_on_them(engine, model_dir):
    loop = _loop(engine, model_dir, max_turn_tokens=400, max_total_tokens=400)
    env = Scripted(replies=0)
    ref = await loop.run(ThreadedEnvironment(env), episode_id="ref", generate=EngineTurns(engine))
    first = ref.segments[0]
    assert len(first) > 120, "the reference turn should be long (greedy, this seed)"

    task = asyncio.create_task(loop.run(ThreadedEnvironment(Scripted(replies=0)),
                                        episode_id="int", generate=EngineTurns(engine)))
    start = engine.stats().generated_tokens
    while engine.stats().generated_tokens < start + 40:
        await asyncio.sleep(0.001)
    await engine.interrupt()
    new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
           for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    await engine.load_weights(1, new)
    ep = await task
    turn, seg = ep.turns[0], ep.segments[0]
    assert turn.num_interrupts == 1 and ep.end is EpisodeEnd.DONE
    assert seg.versions == sorted(seg.versions) and set(seg.versions) == {0, 1}
    k = seg.versions.index(1)
    assert seg.token_ids[:k] == first.token_ids[:k]  # the old weights' tokens, kept as served
    assert seg.token_ids != first.token_ids  # the new weights took over
    assert turn.finish_reason in (FinishReason.STOP.value, FinishReason.LENGTH.value)


def test_bad_budgets_are_clear_errors():
    with pytest.raises(ValueError, match="Budgets.max_turns must be >= 1"):
        Budgets(max_turns=0)
    with pytest.raises(ValueError, match="Budgets.max_wall_s must be > 0"):
        Budgets(max_wall_s=0)
