"""The ``reasoning_gym`` reward: a ``kind: reasoning_gym`` task graded by its generator's own
scorer, ``score_answer(answer, entry)`` (1.0 right; reasoning-gym's default gives partial
credit ``len(answer) / len(response)`` to a response that contains the answer, some
generators have their own rules).

The answer is the response's text stripped of surrounding whitespace: reasoning-gym's own
harness extracts it from ``<answer>`` tags first, which the kit's alphabet cannot write, so a
prompt that asks for tags should be graded by a reward that extracts them. A response that
did not stop properly (``finish_reason == "length"``) scores 0, as the built-in rewards do.
The entry is made again in the grading process from the task's spec
(:mod:`rollstream.data.generators`): the reward is a module-level function that a reward
worker imports by reference. Importing reasoning-gym and building the generator (seconds on a
loaded machine) is the reward's ``@reward_setup``, so a worker's first grade is not timed out
by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollstream.data.generators import SPEC_KEY, entry_of, generator, spec_json
from rollstream.reward.registry import register_reward, reward_setup
from rollstream.trajectory import Task


def _spec(task: Task) -> Mapping[str, Any]:
    spec = task.extra.get(SPEC_KEY)
    if not isinstance(spec, Mapping):
        raise TypeError(f"task {task.uid} is not of a reasoning_gym source (no "
                        f"task.extra[{SPEC_KEY!r}]): the reasoning_gym reward grades only those")
    return spec


def _make_generator(task: Task) -> None:
    """The set-up: the task's generator, made once per process (the import, the dataset)."""
    spec = _spec(task)
    generator(spec_json(spec["dataset"], size=spec["size"], seed=spec["seed"],
                        options=spec["options"]))


@register_reward("reasoning_gym")
@reward_setup(_make_generator)
def reasoning_gym_score(task: Task, text: str, *, finish_reason: str) -> float:
    """The task's generator's ``score_answer`` of the stripped response (0 when capped)."""
    gen, entry = entry_of(_spec(task))
    if finish_reason != "stop":
        return 0.0
    return float(gen.score_answer(text.strip(), entry))
