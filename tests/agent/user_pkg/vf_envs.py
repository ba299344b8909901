"""A user's verifiers environment (``tests.agent.user_pkg.vf_envs:load_environment``),
written as a hub environment module is, over local rows: a multi-turn conversation that
answers each model turn with ``more <n>`` and a rubric that scores the model's text. The kit
model writes no particular format, so the rubric reads what any reply has: its length."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

ROWS = [{"prompt": [{"role": "user", "content": "go"}], "answer": "x", "task": "chat"}]


def score(replies: list[str]) -> float:
    """(Characters the model wrote in all its turns) mod 5, over 4: a number in [0, 1] that
    differs from reply to reply, recomputed from the trained tokens by the tests."""
    return (sum(map(len, replies)) % 5) / 4


def _replies(completion) -> list[str]:
    """The assistant messages' texts (dicts before verifiers 0.1.14, message objects since)."""
    def get(m, key):
        return m.get(key) if isinstance(m, dict) else getattr(m, key)

    return [get(m, "content") or "" for m in completion if get(m, "role") == "assistant"]


def reply_length_score(completion, **kwargs) -> float:
    """The rubric's function: :func:`score` of the rollout's assistant messages."""
    return score(_replies(completion))


def group_scores(replies: list[list[str]]) -> list[float]:
    """Of a group's rollouts (each one's replies): 1 for those that wrote the most characters
    of the group (all of them on a tie), else 0."""
    sizes = [sum(map(len, r)) for r in replies]
    return [float(n == max(sizes)) for n in sizes]


def longest_in_group(completions, **kwargs) -> list[float]:
    """A group reward function (verifiers tells them by their plural parameters): it
    compares the group's rollouts, :func:`group_scores`."""
    return group_scores([_replies(c) for c in completions])


class MoreEnv(vf.MultiTurnEnv):
    """Answers each model turn with ``more <turns so far>``; ends after ``max_turns``."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"more {len(state['trajectory'])}"}]


def load_environment(turns: int = 2) -> vf.Environment:
    return MoreEnv(dataset=Dataset.from_list(ROWS), max_turns=turns,
                   rubric=vf.Rubric(funcs=[reply_length_score]))


def load_group_environment(turns: int = 2) -> vf.Environment:
    """The same conversation, graded by a rubric that compares the group's rollouts too:
    reward = score + 0.5 * group score."""
    return MoreEnv(dataset=Dataset.from_list(ROWS), max_turns=turns,
                   rubric=vf.Rubric(funcs=[reply_length_score, longest_in_group],
                                    weights=[1.0, 0.5]))


ENV = load_environment()  # an environment object named by import path

NOT_AN_ENVIRONMENT = 42


def not_an_environment(turns: int = 2) -> dict:
    return {"turns": turns}


def load_from_the_hub() -> vf.Environment:
    """As a hub environment whose loader downloads its dataset, on a machine without
    network."""
    raise ConnectionError("cannot reach huggingface.co")
