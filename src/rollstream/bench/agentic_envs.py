"""The simulated tool episodes of ``bench agentic``, written as a user writes an environment.

An episode (``index``, ``seed``) has a number of tool turns drawn log-normal (median 3,
1..:data:`MAX_TURNS`); after each model turn but the last its tool answers after a latency
drawn log-normal (median :data:`TOOL_MEDIAN_S`, p99 :data:`TOOL_P99_S`): a sleep, then a tool
message. :func:`draw` is the one definition of an episode's turns and latencies, so each
way of running it sees the same episodes:

* :class:`ToolEpisodeEnv`: an environment built from a dataset row (``row={"index", "seed"}``),
  as ``tasks.sources[].environment`` names a user's (the bench names this one by its import
  path and builds it through the run's own resolution, ``agent/episodes.py``);
* :func:`load_environment`: the same episodes as a ``vf.Environment`` (the ``verifiers``
  extra), whose rollout runs against the run's OpenAI-compatible proxy.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from rollstream.agent.environment import ModelTurn, Observation

TOOL_MEDIAN_S, TOOL_P99_S = 0.05, 2.0
TOOL_SIGMA = math.log(TOOL_P99_S / TOOL_MEDIAN_S) / 2.3263  # z of the 99th percentile
MAX_TURNS = 12
PATH = "rollstream.bench.agentic_envs:ToolEpisodeEnv"  # the environment by import path


def draw(index: int, seed: int) -> tuple[int, list[float]]:
    """Episode ``index``'s tool turns and their latencies (seconds), seeded."""
    rng = random.Random(f"{seed}/{index}")
    turns = min(MAX_TURNS, max(1, round(rng.lognormvariate(math.log(3), 0.8))))
    return turns, [rng.lognormvariate(math.log(TOOL_MEDIAN_S), TOOL_SIGMA) for _ in range(turns)]


def opening(index: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"task {index}: add 12 and {index}"}]


class ToolEpisodeEnv:
    """Every model turn answered by a slow tool, for the episode's drawn number of turns;
    the next model turn after the last is its answer."""

    def __init__(self, *, row: dict[str, Any]) -> None:
        self.index = int(row["index"])
        self.turns, self.latencies = draw(self.index, int(row["seed"]))
        self.step_count = 0

    async def reset(self) -> list[dict[str, Any]]:
        return opening(self.index)

    async def step(self, turn: ModelTurn) -> Observation:
        if self.step_count == self.turns:
            return Observation(messages=[], done=True, reward=0.0)
        await asyncio.sleep(self.latencies[self.step_count])
        self.step_count += 1
        return Observation(messages=[{"role": "tool", "content": f"result {self.step_count}"}],
                           done=False)


def rollout_row(index: int, seed: int) -> dict[str, Any]:
    """The dataset row of episode ``index`` for :func:`load_environment`'s rollouts."""
    return {"prompt": opening(index), "answer": "", "example_id": index,
            "info": {"index": index, "seed": seed}}


def load_environment(seed: int = 0, episodes: int = 1) -> Any:
    """The episodes as a ``vf.MultiTurnEnv``: after each model turn but the last, a sleep of
    the drawn latency and the tool's message (sent as a user message: an OpenAI tool message
    needs a tool call to answer); the rollout stops after ``turns + 1`` model turns, as
    :class:`ToolEpisodeEnv` does. Its rubric scores 0, as the bench's environment does."""
    import verifiers as vf
    from datasets import Dataset

    class ToolEpisodes(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            info = state["info"]
            _, latencies = draw(int(info["index"]), int(info["seed"]))
            k = len(state["trajectory"]) - 1  # the tool turn this model turn asked for
            await asyncio.sleep(latencies[k])
            return [{"role": "user", "content": f"result {k + 1}"}]

        @vf.stop
        async def answered(self, state, **kwargs) -> bool:
            info = state["info"]
            turns, _ = draw(int(info["index"]), int(info["seed"]))
            return len(state["trajectory"]) > turns

    def zero(completion, **kwargs) -> float:
        return 0.0

    rows = [rollout_row(i, seed) for i in range(episodes)]
    return ToolEpisodes(dataset=Dataset.from_list(rows), max_turns=MAX_TURNS + 2,
                        rubric=vf.Rubric(funcs=[zero]))
