"""examples/envs/hilo.py, the environment and tool examples/agent_env.yaml names: its turns,
hints and rewards under scripted answers, through the tool runner a run gives it; and the
rows the example trains on are the ones its module writes."""

from __future__ import annotations

import json
from pathlib import Path

from examples.envs.hilo import ROWS, Compare, HigherLower, rows

from rollstream.agent.environment import ModelTurn
from rollstream.agent.episodes import episode_sources
from rollstream.agent.tools import ToolManager
from rollstream.config import load_config

EXAMPLE = Path(__file__).parents[2] / "examples" / "agent_env.yaml"


async def _play(answers: list[str], *, target: int = 41, max_guesses: int = 8):
    env = HigherLower(row={"prompt": "higher than 37", "target": target},
                      tools=ToolManager([Compare()], timeout_s=5), max_guesses=max_guesses)
    seen = [await env.reset()]
    for i, text in enumerate(answers):
        obs = await env.step(ModelTurn(text=text, ended=True, turn_index=i))
        seen.append(obs)
        if obs.done:
            break
    return seen


async def test_a_walk_to_the_target_is_hinted_by_the_tool_and_graded_one():
    opening, *steps = await _play(["38", "39", "42", "41"])
    assert opening == [{"role": "user", "content": "higher than 37"}]
    assert [o.messages for o in steps[:3]] == [
        [{"role": "user", "content": "higher than 38"}],
        [{"role": "user", "content": "higher than 39"}],
        [{"role": "user", "content": "lower than 42"}]]
    assert [o.tool_results[0].content for o in steps] == ["higher", "higher", "lower", "equal"]
    assert steps[0].tool_calls[0].arguments == {"guess": 38, "target": 41}
    assert [o.done for o in steps] == [False, False, False, True]
    assert steps[-1].reward == 1.0 and steps[-1].messages == []


async def test_spent_guesses_or_an_answer_that_is_not_a_number_end_it_with_zero():
    *_, last = await _play(["38", "38", "38"], max_guesses=3)
    assert last.done and last.reward == 0.0 and last.tool_results[0].content == "higher"
    _, only = await _play(["forty"])
    assert only.done and only.reward == 0.0 and only.tool_calls == []


def test_the_example_names_the_game_and_reads_the_rows_its_module_writes():
    sources = episode_sources(load_config(EXAMPLE).tasks)
    assert sources["hilo"].make_environment is HigherLower and sources["hilo"].gives_reward
    assert [t.name for t in sources["hilo"].tools] == ["compare"]
    written = [json.loads(line) for line in ROWS.read_text().splitlines()]
    assert written == rows() and len(written) == 800
    for row in written:  # the kit's alphabet; the answer is the first step toward the target
        word, _, start = row["prompt"].partition(" than ")
        step = 1 if word == "higher" else -1
        assert int(row["answer"]) == int(start) + step
        assert 1 <= (row["target"] - int(start)) * step <= 5
