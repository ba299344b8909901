"""A user's environments: a guessing game built from a dataset row, and ones that are wrong
in the ways a config can be wrong (for the load-time checks)."""

from __future__ import annotations

from rollstream.agent.environment import ModelTurn, Observation
from rollstream.trajectory import ToolCall


class GuessNumber:
    """Guess the row's ``target``; each wrong guess is measured by the source's ``length``
    tool (run by the environment itself, so a model that cannot write tool calls still runs
    it) and answered with a hint; the episode ends at a right guess (reward 1) or after
    ``max_guesses`` (reward 0)."""

    gives_reward = True

    def __init__(self, *, row: dict, tools, max_guesses: int = 3) -> None:
        self.prompt, self.target = row["prompt"], str(row["target"])
        self.tools, self.max_guesses = tools, max_guesses

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    async def step(self, turn: ModelTurn) -> Observation:
        if self.target in turn.text:
            return Observation(messages=[], done=True, reward=1.0)
        if turn.turn_index + 1 >= self.max_guesses:
            return Observation(messages=[], done=True, reward=0.0)
        call = ToolCall(id=f"len{turn.turn_index}", name="length",
                        arguments={"text": turn.text})
        (result,) = await self.tools.run([call])
        if not result.ok:  # the source's tool must be there: fail the episode, loudly
            raise RuntimeError(f"the length tool failed: {result.error}")
        return Observation(messages=[{"role": "user", "content": f"no {result.content}"}],
                           done=False, tool_calls=[call], tool_results=[result])


class SyncCountdown:
    """A plain (not async) environment: the model's turns count down from the row's ``n``;
    graded by the source's reward."""

    def __init__(self, *, row: dict) -> None:
        self.prompt, self.left = row["prompt"], int(row["n"])

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def step(self, turn: ModelTurn) -> Observation:
        self.left -= 1
        done = self.left <= 0
        return Observation(messages=[] if done else [{"role": "user", "content": "again"}],
                           done=done)


class NoStep:
    """Not an environment: no step()."""

    def __init__(self, *, row: dict) -> None: ...

    async def reset(self) -> list[dict]:
        return []


class NoRow:
    """An environment that cannot be built from a row."""

    def __init__(self, size: int) -> None: ...

    async def reset(self) -> list[dict]:
        return []

    async def step(self, turn: ModelTurn) -> Observation:
        return Observation(messages=[], done=True)
