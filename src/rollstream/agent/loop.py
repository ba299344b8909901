"""The agent loop: one multi-turn episode, model and environment alternating, token in / out.

    prompt = render(env.reset())
    loop:  model turn  = generate(ids)                 -> policy segment (ids as served)
           observation = env.step(turn)                -> done? reward
           delta       = render.extend(new messages)   -> env segment (appended, never
                                                          re-tokenising what was served)

A template that rewrites earlier turns (one that drops past ``<think>`` blocks) cannot be
extended by appending: where ``ChatRenderer.rewrites`` says it does, the environment's answer
appends no token and the next turn is served the whole conversation rendered anew, recorded
as a :class:`~rollstream.trajectory.Context`. The episode is then trained as one turn-sample
per context, each on exactly the tokens it was served (``trajectory.turn_samples``).

Every model token keeps the logprob and the weight version that sampled it. Where the tokens
come from is a :class:`TurnGenerator`: :class:`EngineTurns` calls one engine directly (tests,
benchmarks); in a training run the dispatcher generates each turn with its own routing, gate,
retries and spans (``agent.harness``). A turn interrupted for a weight update continues from
its partial tokens, so one turn may hold tokens of several versions. Budgets end an episode
with an explicit reason (:class:`EpisodeEnd`): model turns, tokens per turn (a turn cut by it
is closed by the template and the episode goes on), tokens in all (model + environment), and
wall time; whichever comes first. Blocking work (tokenisation) runs off the event loop.

**Where an episode stands is read from its segments**, so an episode restored from a
checkpoint continues where it was: after an environment segment (or none) a model turn
starts; a policy segment that neither ended its turn nor reached the turn budget is a partial
turn and continues; a finished one waits for the environment. A restored episode's
environment is rebuilt by :meth:`AgentLoop.run` from ``env.reset()`` and the recorded model
turns, each answered again while its tool calls are served from the recorded results
(:class:`ReplayTools`: no recorded call is executed twice); the rendered answer must equal the
saved environment tokens, else :class:`ReplayDiverged`. An environment that can snapshot its
state (:class:`~rollstream.agent.environment.Snapshottable`) is instead restored: before each
model turn the loop records its snapshot and the conversation (``Episode.snapshot``, which a
training sample keeps as ``Sample.env_snapshot``), and a restored episode restores the last
one; only turns recorded after it, if any, are replayed.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rollstream.agent.chat import ChatRenderer, Message, TemplateError
from rollstream.agent.environment import Environment, ModelTurn, Observation, Snapshottable
from rollstream.agent.tools import ToolCall, ToolResult
from rollstream.engine import Engine, FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.protocol import OnTokens
from rollstream.rollout.dispatcher import TurnOutput
from rollstream.trajectory import (
    Context,
    EnvSnapshot,
    Segment,
    SegmentKind,
    Turn,
    append_policy_tokens,
    served_ids,
)


class EpisodeEnd(str, enum.Enum):
    DONE = "done"  # the environment ended it
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"  # the episode's token budget (model + environment)
    MAX_WALL = "max_wall"
    ENGINE_ERROR = "engine_error"  # the engine failed a turn (see Episode.error)


class ReplayDiverged(RuntimeError):
    """A restored episode's environment answered a recorded turn differently."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Budgets:
    max_turns: int = 8  # model turns
    max_turn_tokens: int = 256  # tokens of one model turn
    max_total_tokens: int = 2048  # tokens served past the prompt: model and environment
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Budgets.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_wall_s is not None and not self.max_wall_s > 0:
            raise ValueError(f"Budgets.max_wall_s must be > 0 or None, got {self.max_wall_s}")


@dataclass(slots=True, kw_only=True)
class Episode:
    """An episode as the loop sees it. ``segments`` and ``turns`` may be a training sample's
    own lists (``Sample.segments``, ``Sample.turns``): the loop then writes into the sample."""

    prompt_ids: list[int]
    messages: list[Message] = field(default_factory=list)  # as the template renders them
    segments: list[Segment] = field(default_factory=list)  # alternating policy / env
    turns: list[Turn] = field(default_factory=list)  # turns[i] describes segments[i]
    snapshot: EnvSnapshot | None = None  # a Snapshottable environment, before the last turn
    contexts: list[Context] = field(default_factory=list)  # where the template rewrote turns
    end: EpisodeEnd | None = None
    reward: float | None = None
    error: str | None = None
    duration_s: float = 0.0

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def token_ids(self) -> list[int]:
        """What the model is served next: the prompt and the response, or the last context
        and the segments since (``Sample.served_ids``)."""
        return served_ids(self.prompt_ids, self.segments, self.contexts)

    @property
    def num_served_tokens(self) -> int:
        """Tokens served past the prompt (what ``Budgets.max_total_tokens`` bounds): the
        response of an append-only episode."""
        return max(0, len(self.token_ids) - len(self.prompt_ids))

    @property
    def num_model_turns(self) -> int:
        return sum(s.kind is SegmentKind.POLICY for s in self.segments)


class TurnGenerator(Protocol):
    async def __call__(self, episode: Episode, params: SamplingParams, *, rid: str,
                       episode_id: str, deadline: float | None) -> TurnOutput | None:
        """Generate one model turn after ``episode.token_ids`` (``params.max_new_tokens`` is
        what is left of the turn's budget), appending its tokens to ``episode.segments`` as
        they come (a trailing policy segment is the same turn, continued). None: the episode
        cannot go on (its sample failed or was cancelled; the generator's owner records why).
        ``episode_id`` names the episode to the engine, so that an engine holding its history
        is sent only the tokens added since (``GenerateRequest.episode_id``)."""


@dataclass(slots=True)
class EngineTurns:
    """Turns generated by one engine, called directly."""

    engine: Engine

    async def __call__(self, episode: Episode, params: SamplingParams, *, rid: str,
                       episode_id: str, deadline: float | None) -> TurnOutput:
        return await generate_turn(self.engine, episode.token_ids, params, rid,
                                   episode.segments, deadline, episode_id=episode_id)


@dataclass(slots=True)
class ReplayTools:
    """A tool runner for a rebuilt environment: the first calls are answered from ``recorded``
    (one list of results per environment turn, as the checkpoint saved them) without running
    anything; later ones go to ``tools``. A recorded turn whose calls differ from the ones
    asked is :class:`ReplayDiverged`."""

    tools: Any  # a ToolManager (``run`` and ``schemas``)
    recorded: deque[list[ToolResult]] = field(default_factory=deque)

    def schemas(self) -> list[dict[str, Any]]:
        return self.tools.schemas()

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        if not self.recorded:
            return await self.tools.run(calls)
        results = self.recorded.popleft()
        asked = [(c.name, c.arguments) for c in calls]
        saved = [(r.call.name, r.call.arguments) for r in results]
        if asked != saved:
            raise ReplayDiverged(f"the rebuilt environment asked for {asked}, the checkpoint "
                                 f"recorded {saved}")
        return results


@dataclass(slots=True, kw_only=True)
class AgentLoop:
    renderer: ChatRenderer
    sampling: SamplingParams = field(default_factory=SamplingParams)
    budgets: Budgets = field(default_factory=Budgets)

    async def run(self, env: Environment, *, episode_id: str, generate: TurnGenerator,
                  episode: Episode | None = None) -> Episode:
        """Run (or continue) an episode to its end. ``episode``: one to continue (a training
        sample's, maybe restored with segments); its ``prompt_ids`` must be what the template
        renders for ``env.reset()``. ``env`` is first brought to where it stands: restored
        from ``episode.snapshot`` when it can be, and its recorded turns after that replayed."""
        start = _now()
        deadline = None if self.budgets.max_wall_s is None else start + self.budgets.max_wall_s
        messages = await env.reset()
        prompt = await asyncio.to_thread(self.renderer.prompt, messages)
        if episode is None:
            episode = Episode(prompt_ids=prompt)
        elif episode.prompt_ids != prompt:
            raise TemplateError(f"episode {episode_id}: its prompt is not what the template "
                                "renders for the environment's opening messages")
        episode.messages = list(messages)
        ep = episode
        stop = tuple(self.renderer.stop_token_ids(messages))
        await self._restore(ep, env, stop)
        while ep.end is None:
            last = ep.segments[-1] if ep.segments else None
            if last is not None and last.kind is SegmentKind.POLICY and self._turn_over(ep):
                await self._answer(ep, env, stop, start, deadline)
            elif (end := self._out_of_budget(ep, deadline, partial=last)) is not None:
                ep.end = end
            else:
                await self._snapshot(ep, env)
                if not await self._model_turn(ep, generate, episode_id, stop, start, deadline):
                    break  # the generator gave up on the episode: its owner records why
        ep.duration_s = _now() - start
        return ep

    @staticmethod
    def _turn_over(ep: Episode) -> bool:
        """The trailing model turn is over: the generator returned and its turn was recorded
        (a turn interrupted by a checkpoint has tokens but no record yet: it goes on)."""
        return len(ep.turns) == len(ep.segments)

    def _out_of_budget(self, ep: Episode, deadline: float | None,
                       partial: Segment | None) -> EpisodeEnd | None:
        continuing = partial is not None and partial.kind is SegmentKind.POLICY
        if ep.num_model_turns - continuing >= self.budgets.max_turns:
            return EpisodeEnd.MAX_TURNS
        if ep.num_served_tokens >= self.budgets.max_total_tokens:
            return EpisodeEnd.MAX_TOKENS
        if deadline is not None and _now() >= deadline:
            return EpisodeEnd.MAX_WALL
        return None

    async def _model_turn(self, ep: Episode, generate: TurnGenerator, episode_id: str,
                          stop: tuple[int, ...], start: float, deadline: float | None) -> bool:
        """Generate (or continue) a model turn; False when the generator gave up."""
        b = self.budgets
        last = ep.segments[-1] if ep.segments else None
        done = len(last) if last is not None and last.kind is SegmentKind.POLICY else 0
        budget = min(b.max_turn_tokens - done, b.max_total_tokens - ep.num_served_tokens)
        t0 = _now()
        params = replace(self.sampling, max_new_tokens=budget, stop_token_ids=stop)
        index = ep.num_model_turns - (done > 0)
        out = await generate(ep, params, rid=f"{episode_id}/t{index}", episode_id=episode_id,
                             deadline=deadline)
        if out is None:
            return False
        if ep.segments and ep.segments[-1].kind is SegmentKind.POLICY:
            ep.turns.append(Turn(kind=SegmentKind.POLICY, num_tokens=len(ep.segments[-1]),
                                 started_s=t0 - start, duration_s=_now() - t0,
                                 finish_reason=out.finish_reason.value,
                                 num_interrupts=out.num_interrupts))
        if out.error is not None:
            ep.end, ep.error = EpisodeEnd.ENGINE_ERROR, out.error
        elif out.out_of_time:
            ep.end = EpisodeEnd.MAX_WALL
        elif not ep.segments or ep.segments[-1].kind is not SegmentKind.POLICY:
            ep.end, ep.error = EpisodeEnd.ENGINE_ERROR, "the engine returned no token"
        return True

    async def _model_text(self, seg: Segment, stop: tuple[int, ...]) -> tuple[str, bool]:
        ended = seg.token_ids[-1] in stop
        ids = seg.token_ids[:-1] if ended else seg.token_ids
        return await asyncio.to_thread(self.renderer.tokenizer.decode, ids), ended

    async def _answer(self, ep: Episode, env: Environment, stop: tuple[int, ...], start: float,
                      deadline: float | None) -> None:
        """The environment's answer to the trailing model turn."""
        text, ended = await self._model_text(ep.segments[-1], stop)
        ep.messages.append({"role": "assistant", "content": text})
        t1 = _now()
        step = env.step(ModelTurn(text=text, ended=ended, turn_index=ep.num_model_turns - 1))
        try:
            async with asyncio.timeout_at(deadline):
                obs = await step
        except TimeoutError:
            ep.end = EpisodeEnd.MAX_WALL
            return
        if obs.done:
            ep.end, ep.reward = EpisodeEnd.DONE, obs.reward
            return
        delta, context = await self._respond(ep, obs, ended, len(ep.segments) - 1)
        served = (ep.num_served_tokens if context is None
                  else len(context.token_ids) - len(ep.prompt_ids))
        if served + len(delta) > self.budgets.max_total_tokens:
            ep.end = EpisodeEnd.MAX_TOKENS  # the environment's answer does not fit
            return
        if context is not None:
            ep.contexts.append(context)
        ep.segments.append(Segment.env(delta))
        ep.messages.extend(obs.messages)
        ep.turns.append(Turn(kind=SegmentKind.ENV, num_tokens=len(delta), started_s=t1 - start,
                             duration_s=_now() - t1, tool_calls=obs.tool_calls,
                             tool_results=obs.tool_results))

    async def _respond(self, ep: Episode, obs: Observation, ended: bool,
                       turn: int) -> tuple[list[int], Context | None]:
        """The environment's answer to the model turn of segment ``turn`` as tokens: the ids
        to append (``extend``), or, where the template rewrites earlier turns, none and the
        next context (the whole conversation rendered anew, served from the next turn on)."""
        if await asyncio.to_thread(self.renderer.rewrites, ep.messages, obs.messages):
            ids = await asyncio.to_thread(self.renderer.prompt, [*ep.messages, *obs.messages])
            return [], Context(num_segments=turn + 2, token_ids=tuple(ids))
        delta = await asyncio.to_thread(self.renderer.extend, ep.messages, obs.messages,
                                        model_ended_turn=ended)
        return delta, None

    @staticmethod
    async def _snapshot(ep: Episode, env: Environment) -> None:
        """Record where a Snapshottable ``env`` stands before a new model turn (not before
        the rest of a partial one: its snapshot was taken before it began)."""
        n = len(ep.segments)
        partial = n > 0 and ep.segments[-1].kind is SegmentKind.POLICY
        taken = ep.snapshot is not None and ep.snapshot.num_segments == n
        if partial or taken or not isinstance(env, Snapshottable):
            return
        state = await env.snapshot()
        if not isinstance(state, dict):
            raise TypeError(f"{type(env).__name__}.snapshot() returned a "
                            f"{type(state).__name__}, not a dict (a JSON object)")
        name = type(env).__name__
        copied = _json_copy(state, name)
        if copied != state:  # restore() must get back what snapshot() gave
            raise TypeError(f"the snapshot of {name} does not come back unchanged from JSON "
                            f"(keys that are not strings, tuples?): {state!r} reads back as "
                            f"{copied!r}")
        ep.snapshot = EnvSnapshot(num_segments=n, state=copied,
                                  messages=_json_copy(ep.messages, "the conversation"))

    async def _restore(self, ep: Episode, env: Environment, stop: tuple[int, ...]) -> None:
        """Bring a fresh ``env`` (after ``reset``) to where the episode stands: restored from
        the episode's snapshot when it has one and ``env`` can take it, then the recorded turns
        after that point replayed."""
        snap = ep.snapshot
        if snap is not None and isinstance(env, Snapshottable):  # even one taken at reset
            if snap.num_segments > len(ep.segments):
                raise ReplayDiverged(f"the environment's snapshot was taken after segment "
                                     f"{snap.num_segments}, the episode has {len(ep.segments)}")
            await env.restore(copy.deepcopy(snap.state))
            ep.messages = copy.deepcopy(snap.messages)
        else:
            ep.snapshot = None  # an environment that cannot take it is replayed
        await self._replay(ep, env, stop, replay_start(ep, env))

    async def _replay(self, ep: Episode, env: Environment, stop: tuple[int, ...],
                      first: int = 0) -> None:
        """Answer the recorded model turns from segment ``first`` on again, so that ``env``
        stands where the episode does; each answer must render to the recorded environment
        tokens."""
        for i in range(first, len(ep.segments) - 1, 2):
            seg, saved = ep.segments[i], ep.segments[i + 1]
            if seg.kind is not SegmentKind.POLICY or saved.kind is not SegmentKind.ENV:
                raise ReplayDiverged(f"segments {i}, {i + 1} are not a model turn and its "
                                     "answer")
            text, ended = await self._model_text(seg, stop)
            ep.messages.append({"role": "assistant", "content": text})
            obs = await env.step(ModelTurn(text=text, ended=ended, turn_index=i // 2))
            delta, context = ([], None) if obs.done else await self._respond(ep, obs, ended, i)
            recorded = next((c for c in ep.contexts if c.num_segments == i + 2), None)
            if delta != saved.token_ids or context != recorded:
                ids, was = ((delta, saved.token_ids) if context is None or recorded is None
                            else (context.token_ids, recorded.token_ids))
                raise ReplayDiverged(
                    f"turn {i // 2}: the rebuilt environment answered "
                    f"{self.renderer.tokenizer.decode(list(ids))!r}"
                    f"{' (the conversation anew)' if context else ''}, the episode recorded "
                    f"{self.renderer.tokenizer.decode(list(was))!r}"
                    f"{' (the conversation anew)' if recorded else ''}")
            ep.messages.extend(obs.messages)


def replay_start(episode: Episode, env: Environment) -> int:
    """The first segment whose turn a rebuilt ``env`` answers again: after the episode's
    snapshot when ``env`` can restore it, else 0 (every recorded turn)."""
    snap = episode.snapshot
    return snap.num_segments if snap is not None and isinstance(env, Snapshottable) else 0


async def generate_turn(engine: Engine, ids: list[int], params: SamplingParams, rid: str,
                        segments: list[Segment], deadline: float | None = None, *,
                        episode_id: str | None = None,
                        on_tokens: OnTokens | None = None) -> TurnOutput:
    """One model turn on ``ids`` by ``engine``, appended to ``segments``: continues after
    interrupts (weight updates) until it stops, reaches ``params.max_new_tokens``, fails, or
    ``deadline`` (the event loop's clock, :func:`_now`) passes; then it is interrupted and what
    it has is kept. Its requests carry ``episode_id`` (the turn's episode, if any);
    ``on_tokens`` hears its tokens as they are sampled (``GenerateRequest.on_tokens``)."""
    budget = params.max_new_tokens
    done = 0
    interrupts, out_of_time = 0, False
    while True:
        request_id = f"{rid}/{interrupts}"
        request = GenerateRequest(request_id=request_id, prompt_ids=ids,
                                  params=replace(params, max_new_tokens=budget - done),
                                  episode_id=episode_id, on_tokens=on_tokens)
        task = asyncio.ensure_future(engine.generate(request))
        timeout = None if deadline is None else max(0.0, deadline - _now())
        finished, _ = await asyncio.wait({task}, timeout=timeout)
        if not finished:
            out_of_time = True
            await engine.interrupt([request_id])
        out = await task
        append_policy_tokens(segments, out.token_ids, out.logprobs, out.versions)
        ids = ids + out.token_ids
        done += len(out.token_ids)
        resumable = out.finish_reason is FinishReason.ABORT and out.error is None
        if resumable and not out_of_time and done < budget:
            interrupts += 1
            continue
        # an ABORT without an error here: interrupted at our own deadline
        error = out.error if out.finish_reason in (FinishReason.ERROR,
                                                   FinishReason.ABORT) else None
        return TurnOutput(finish_reason=out.finish_reason, error=error, num_tokens=done,
                          num_interrupts=interrupts, out_of_time=out_of_time)


def _json_copy(value: Any, what: str) -> Any:
    """A copy of ``value`` through JSON (what a checkpoint writes): it must be JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"the snapshot of {what} is not JSON: {e}") from None


def _now() -> float:
    """The episode's clock: the running event loop's (``time.monotonic`` on a real loop,
    virtual time in the simulator, so wall budgets, deadlines and turn records follow it)."""
    return asyncio.get_running_loop().time()
