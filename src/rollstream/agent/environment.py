"""Environments of multi-turn episodes: what answers a model turn.

An environment opens an episode with its messages (``reset``) and answers each model turn
(``step``) with an :class:`Observation`: messages to append (tool results, the next user
message), whether the episode is over, and its reward when it grades. The interface is async;
a synchronous environment (a simulator, a game) is wrapped in :class:`ThreadedEnvironment`,
which runs it off the event loop so that other episodes keep going.

:class:`ToolEnvironment` is the common case: the model calls tools (parsed with a
``ToolCallParser``, run by a ``ToolManager``); a turn without tool calls is its answer, graded
by ``grade(answer)``.

An environment that holds something for its episode (a session on a server) has an async
``close()``: the harness calls it when the episode ends, however it ends (:func:`aclose`).

An environment whose state is more than what the model turns and tool results determine (a
random draw at reset, a simulator, an external system) also implements
:class:`Snapshottable`: its state is saved with the episode at each turn boundary, and a
resumed episode restores it instead of rebuilding it by replay (``agent/loop.py``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollstream.agent.tools import (
    HermesToolParser,
    ToolCall,
    ToolCallParser,
    ToolResult,
    ToolRunner,
)

Message = dict[str, Any]


@dataclass(slots=True, kw_only=True, frozen=True)
class ModelTurn:
    """A model turn as the environment sees it."""

    text: str  # decoded, without the end-of-turn token
    ended: bool  # the model ended its turn (sampled the stop token), not cut by a budget
    turn_index: int  # 0-based among the episode's model turns


@dataclass(slots=True, kw_only=True, frozen=True)
class Observation:
    messages: list[Message]  # appended to the conversation (may be empty when done)
    done: bool
    reward: float | None = None  # the episode's reward, when the environment grades
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)


class Environment(Protocol):
    async def reset(self) -> list[Message]:
        """The episode's opening messages (system, user)."""

    async def step(self, turn: ModelTurn) -> Observation:
        """Answer one model turn."""


@runtime_checkable
class Snapshottable(Protocol):
    """An environment that can save and restore its own state (a capability beside
    :class:`Environment`). ``snapshot`` is called at each turn boundary, between its
    answer and the next model turn; ``restore`` on a fresh environment after ``reset()``,
    with a state an earlier ``snapshot`` returned, possibly in another process. The
    conversation itself is saved by the loop: the state is only what the environment keeps."""

    async def snapshot(self) -> dict[str, Any]:
        """Its state: a JSON object (saved in checkpoints)."""

    async def restore(self, state: dict[str, Any]) -> None:
        """Stand where ``state`` was taken."""


class SyncEnvironment(Protocol):
    def reset(self) -> list[Message]: ...

    def step(self, turn: ModelTurn) -> Observation: ...


@dataclass(slots=True)
class ThreadedEnvironment:
    """A synchronous environment run in a worker thread, off the event loop."""

    env: SyncEnvironment

    async def reset(self) -> list[Message]:
        return await asyncio.to_thread(self.env.reset)

    async def step(self, turn: ModelTurn) -> Observation:
        return await asyncio.to_thread(self.env.step, turn)


@dataclass(slots=True, kw_only=True)
class ToolEnvironment:
    """Runs the tool calls of each turn; the first turn without any is the answer."""

    messages: list[Message]
    tools: ToolRunner
    grade: Callable[[str], float] | None = None  # answer text -> reward
    parser: ToolCallParser = field(default_factory=HermesToolParser)

    async def reset(self) -> list[Message]:
        return list(self.messages)

    async def step(self, turn: ModelTurn) -> Observation:
        parsed = self.parser.parse(turn.text)
        if not parsed.calls and not parsed.errors:
            reward = None if self.grade is None else self.grade(parsed.content)
            return Observation(messages=[], done=True, reward=reward)
        results = await self.tools.run(parsed.calls)
        replies = [{"role": "tool", "content": r.content} for r in results]
        replies += [{"role": "tool", "content": f"error: {e}"} for e in parsed.errors]
        return Observation(messages=replies, done=False, tool_calls=parsed.calls,
                           tool_results=results)


async def aclose(obj: object) -> None:
    """``await obj.close()`` when ``obj`` has an async ``close()`` (an environment, a source
    that holds a server); anything else (None included) has nothing to release."""
    close = getattr(obj, "close", None)
    if inspect.iscoroutinefunction(close):
        await close()
