"""A user's multi-turn environment and tool, as examples/agent_env.yaml names them: a
higher-or-lower walk to a hidden number, refereed by a ``compare`` tool.

Each row hides a ``target`` and opens with a hint about a first number, ``higher than 37``;
the model answers a number, the environment runs ``compare`` on it and the target and answers
``higher than 38`` or ``lower than 38``, until the model says the target (reward 1) or
``max_guesses`` answers are spent, or an answer is not a number (reward 0)::

    user       higher than 37
    assistant  38           compare(38, 41) -> higher     user  higher than 38
    assistant  39           compare(39, 41) -> higher     user  higher than 39
    assistant  41           compare(41, 41) -> equal      (reward 1)

Shaped for the tiny-model kit (LEARNABILITY.md): the text fits its alphabet (letters, digits,
spaces), and what the next answer needs (the last hint's word and number) is the last thing
the model read. Stepping by one reaches the target in ``|target - start|`` answers; a slip
(a skipped or repeated number) costs answers, so RL has turns to make reliable. The warm start
imitates each row's ``answer``, the first answer (``python -m examples.envs.hilo`` writes the
rows).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.agent.environment import ModelTurn, Observation
from rollstream.agent.tools import ToolRunner
from rollstream.trajectory import ToolCall

ROWS = Path(__file__).parents[1] / "data" / "hilo.jsonl"


@dataclass(slots=True, kw_only=True)
class Compare:
    """The tool: how a guess stands to a target (``higher``: the target is higher)."""

    name: str = "compare"
    description: str = "Say whether the target is higher than, lower than or equal to a guess."
    parameters: dict = field(default_factory=lambda: {
        "type": "object",
        "properties": {"guess": {"type": "integer"}, "target": {"type": "integer"}},
        "required": ["guess", "target"]})

    async def __call__(self, guess: int, target: int) -> str:
        return "higher" if target > guess else "lower" if target < guess else "equal"


class HigherLower:
    """The game (module docstring), built from a row: ``prompt`` (the opening hint) and
    ``target``; ``tools`` is the episode's tool runner, which holds the source's ``compare``."""

    gives_reward = True  # the episode's reward is the game's

    def __init__(self, *, row: dict, tools: ToolRunner, max_guesses: int = 6) -> None:
        self.prompt, self.target = str(row["prompt"]), int(row["target"])
        self.tools, self.max_guesses = tools, max_guesses

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    async def step(self, turn: ModelTurn) -> Observation:
        answer = turn.text.strip()
        if not (answer.isdigit() and len(answer) <= 3):
            return Observation(messages=[], done=True, reward=0.0)
        call = ToolCall(id=f"compare{turn.turn_index}", name="compare",
                        arguments={"guess": int(answer), "target": self.target})
        (result,) = await self.tools.run([call])
        if not result.ok:  # the source must name the tool: fail the episode, loudly
            raise RuntimeError(f"the compare tool failed: {result.error}")
        if result.content == "equal":
            return Observation(messages=[], done=True, reward=1.0, tool_calls=[call],
                               tool_results=[result])
        if turn.turn_index + 1 >= self.max_guesses:
            return Observation(messages=[], done=True, reward=0.0, tool_calls=[call],
                               tool_results=[result])
        hint = f"{result.content} than {int(answer)}"
        return Observation(messages=[{"role": "user", "content": hint}], done=False,
                           tool_calls=[call], tool_results=[result])


def rows(*, seed: int = 0, max_distance: int = 5) -> list[dict]:
    """Every game of a first number in 10..89 and a target 1..``max_distance`` above or below
    it, shuffled; the opening hints the direction, the ``answer`` is the first step."""
    out = [{"prompt": f"{'higher' if sign > 0 else 'lower'} than {start}",
            "target": start + sign * distance, "answer": str(start + sign)}
           for start in range(10, 90) for sign in (1, -1)
           for distance in range(1, max_distance + 1)]
    random.Random(seed).shuffle(out)
    return out


def main(out: Path = ROWS) -> None:
    games = rows()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in games))
    sys.stderr.write(f"wrote {len(games)} games to {out}\n")


if __name__ == "__main__":
    main()
