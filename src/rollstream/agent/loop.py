"""The agent loop: one multi-turn episode, model and environment alternating, token in / out.

    prompt = render(env.reset())
    loop:  model turn  = engine.generate(ids)          -> policy segment (ids as served)
           observation = env.step(turn)                -> done? reward
           delta       = render.extend(new messages)   -> env segment (appended, never
                                                          re-tokenising what was served)

Every model token keeps the logprob and the weight version that sampled it. A turn the engine
interrupts for a weight update (ABORT without an error) continues from its partial tokens as a
continuation request, so one turn may hold tokens of several versions. Budgets end an episode
with an explicit reason (:class:`EpisodeEnd`): model turns, tokens per turn (a turn cut by it
is closed by the template and the episode goes on), tokens in all (model + environment), and
wall time; whichever comes first. Blocking work (tokenisation) runs off the event loop.

Not here yet: dispatch through the rollout controller (admission, staleness, ledger),
checkpointing an episode mid-flight, and routing a session to the engine holding its prefix.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field, replace

from rollstream.agent.chat import ChatRenderer, Message
from rollstream.agent.environment import Environment, ModelTurn
from rollstream.agent.tools import ToolCall, ToolResult
from rollstream.engine import Engine, FinishReason, GenerateRequest, SamplingParams
from rollstream.trajectory import Segment, SegmentKind


class EpisodeEnd(str, enum.Enum):
    DONE = "done"  # the environment ended it
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"  # the episode's token budget (model + environment)
    MAX_WALL = "max_wall"
    ENGINE_ERROR = "engine_error"  # the engine failed a turn (see Episode.error)


@dataclass(slots=True, kw_only=True, frozen=True)
class Budgets:
    max_turns: int = 8  # model turns
    max_turn_tokens: int = 256  # tokens of one model turn
    max_total_tokens: int = 2048  # response tokens: model and environment
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Budgets.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_wall_s is not None and not self.max_wall_s > 0:
            raise ValueError(f"Budgets.max_wall_s must be > 0 or None, got {self.max_wall_s}")


@dataclass(slots=True, kw_only=True)
class Turn:
    """One turn: who produced its tokens, when, and the tool calls it made or answered."""

    kind: SegmentKind  # POLICY: the model; ENV: the environment and its tools
    num_tokens: int
    started_s: float  # since the episode started
    duration_s: float
    finish_reason: FinishReason | None = None  # model turns
    num_interrupts: int = 0  # model turns: continuations after engine interrupts
    tool_calls: list[ToolCall] = field(default_factory=list)  # env turns: the calls answered
    tool_results: list[ToolResult] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Episode:
    prompt_ids: list[int]
    messages: list[Message]  # the conversation as the template renders it
    segments: list[Segment] = field(default_factory=list)  # alternating policy / env
    turns: list[Turn] = field(default_factory=list)
    end: EpisodeEnd | None = None
    reward: float | None = None
    error: str | None = None
    duration_s: float = 0.0

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_model_turns(self) -> int:
        return sum(t.kind is SegmentKind.POLICY for t in self.turns)


@dataclass(slots=True, kw_only=True)
class AgentLoop:
    engine: Engine
    renderer: ChatRenderer
    sampling: SamplingParams = field(default_factory=SamplingParams)
    budgets: Budgets = field(default_factory=Budgets)

    async def run(self, env: Environment, *, episode_id: str) -> Episode:
        start = time.monotonic()
        deadline = None if self.budgets.max_wall_s is None else start + self.budgets.max_wall_s
        messages = await env.reset()
        prompt = await asyncio.to_thread(self.renderer.prompt, messages)
        stop = tuple(self.renderer.stop_token_ids(messages))
        ep = Episode(prompt_ids=prompt, messages=list(messages))
        while ep.end is None:
            ep.end = self._out_of_budget(ep, deadline)
            if ep.end is None:
                await self._turn(ep, env, episode_id, stop, start, deadline)
        ep.duration_s = time.monotonic() - start
        return ep

    def _out_of_budget(self, ep: Episode, deadline: float | None) -> EpisodeEnd | None:
        if ep.num_model_turns >= self.budgets.max_turns:
            return EpisodeEnd.MAX_TURNS
        if len(ep.response_ids) >= self.budgets.max_total_tokens:
            return EpisodeEnd.MAX_TOKENS
        if deadline is not None and time.monotonic() >= deadline:
            return EpisodeEnd.MAX_WALL
        return None

    async def _turn(self, ep: Episode, env: Environment, episode_id: str,
                    stop: tuple[int, ...], start: float, deadline: float | None) -> None:
        """One model turn and the environment's answer to it."""
        b = self.budgets
        budget = min(b.max_turn_tokens, b.max_total_tokens - len(ep.response_ids))
        t0 = time.monotonic()
        params = replace(self.sampling, max_new_tokens=budget, stop_token_ids=stop)
        out = await generate_turn(self.engine, ep.token_ids, params,
                                  f"{episode_id}/t{ep.num_model_turns}", deadline)
        segment, error, out_of_time = out.segment, out.error, out.out_of_time
        ep.segments.append(segment)
        ep.turns.append(Turn(kind=SegmentKind.POLICY, num_tokens=len(segment),
                             started_s=t0 - start, duration_s=time.monotonic() - t0,
                             finish_reason=out.finish_reason,
                             num_interrupts=out.num_interrupts))
        ended = out.finish_reason is FinishReason.STOP
        ids = segment.token_ids[:-1] if ended else segment.token_ids
        text = await asyncio.to_thread(self.renderer.tokenizer.decode, ids)
        ep.messages.append({"role": "assistant", "content": text})
        if error is not None:
            ep.end, ep.error = EpisodeEnd.ENGINE_ERROR, error
            return
        if out_of_time:
            ep.end = EpisodeEnd.MAX_WALL
            return
        t1 = time.monotonic()
        step = env.step(ModelTurn(text=text, ended=ended, turn_index=ep.num_model_turns - 1))
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                obs = await step
        except TimeoutError:
            ep.end = EpisodeEnd.MAX_WALL
            return
        if obs.done:
            ep.end, ep.reward = EpisodeEnd.DONE, obs.reward
            return
        delta = await asyncio.to_thread(self.renderer.extend, ep.messages, obs.messages,
                                        model_ended_turn=ended)
        if len(ep.response_ids) + len(delta) > b.max_total_tokens:
            ep.end = EpisodeEnd.MAX_TOKENS  # the environment's answer does not fit
            return
        ep.segments.append(Segment.env(delta))
        ep.messages.extend(obs.messages)
        ep.turns.append(Turn(kind=SegmentKind.ENV, num_tokens=len(delta), started_s=t1 - start,
                             duration_s=time.monotonic() - t1, tool_calls=obs.tool_calls,
                             tool_results=obs.tool_results))


@dataclass(slots=True, kw_only=True)
class TurnOutput:
    segment: Segment  # the turn's tokens as served, with their logprobs and versions
    finish_reason: FinishReason
    error: str | None  # the engine failed the turn (ERROR, or ABORT of a dying engine)
    num_interrupts: int
    out_of_time: bool  # interrupted at ``deadline``


async def generate_turn(engine: Engine, ids: list[int], params: SamplingParams, rid: str,
                        deadline: float | None = None) -> TurnOutput:
    """One model turn on ``ids``: continues after interrupts (weight updates) until it stops,
    reaches ``params.max_new_tokens``, fails, or ``deadline`` (``time.monotonic``) passes;
    then it is interrupted and what it has is kept."""
    budget = params.max_new_tokens
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    interrupts, out_of_time = 0, False
    while True:
        request_id = f"{rid}/{interrupts}"
        request = GenerateRequest(request_id=request_id, prompt_ids=ids + tokens,
                                  params=replace(params, max_new_tokens=budget - len(tokens)))
        task = asyncio.ensure_future(engine.generate(request))
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            out_of_time = True
            await engine.interrupt([request_id])
        out = await task
        tokens += out.token_ids
        logprobs += out.logprobs
        versions += out.versions
        resumable = out.finish_reason is FinishReason.ABORT and out.error is None
        if resumable and not out_of_time and len(tokens) < budget:
            interrupts += 1
            continue
        # an ABORT without an error here: interrupted at our own deadline
        error = out.error if out.finish_reason in (FinishReason.ERROR,
                                                   FinishReason.ABORT) else None
        segment = Segment(kind=SegmentKind.POLICY, token_ids=tokens, logprobs=logprobs,
                          versions=versions, loss_mask=[True] * len(tokens))
        return TurnOutput(segment=segment, finish_reason=out.finish_reason, error=error,
                          num_interrupts=interrupts, out_of_time=out_of_time)


def _loop_time(deadline: float | None) -> float | None:
    """A ``time.monotonic`` deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
