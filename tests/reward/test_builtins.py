"""Built-in rewards and the registry."""

from __future__ import annotations

import pytest

from rollstream.reward import get_reward, known_rewards, register_reward, resolver_for
from rollstream.reward.builtins import exact_match, math_reward
from rollstream.trajectory import Task


def task(reference: str) -> Task:
    return Task(uid="t", source="test", prompt_ids=(1,), prompt_text="q", reference=reference)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("42", 1.0),
        ("42<|endoftext|>", 1.0),
        ("  42 \n<|endoftext|>\n", 1.0),
        ("42<|endoftext|><|endoftext|>", 1.0),
        ("042", 0.0),
        ("4 2", 0.0),
        ("<|endoftext|>42", 0.0),
        ("", 0.0),
    ],
)
def test_exact_match(response: str, expected: float) -> None:
    assert exact_match(task("42"), response) == expected


@pytest.mark.parametrize(
    ("reference", "response", "expected"),
    [
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("1/2", "The answer is $\\frac{1}{2}$.<|endoftext|>", 1.0),
        ("12", "so 3 * 4 = 12", 1.0),
        ("12", "13", 0.0),
        ("12", "no idea", 0.0),
        ("-7", "$-7$", 1.0),
    ],
)
def test_math(reference: str, response: str, expected: float) -> None:
    assert math_reward(task(reference), response) == expected


def test_registry() -> None:
    assert get_reward("exact_match") is exact_match and get_reward("math") is math_reward
    known = "unknown reward 'nope'; known rewards: .*exact_match.*math"
    with pytest.raises(ValueError, match=known):
        get_reward("nope")

    def mine(task: Task, response_text: str) -> float:
        return 0.5

    assert get_reward(mine) is mine  # objects pass through
    register_reward("test_builtins.mine")(mine)
    assert "test_builtins.mine" in known_rewards() and get_reward("test_builtins.mine") is mine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_builtins.mine")(exact_match)
    with pytest.raises(TypeError):
        get_reward(3)  # type: ignore[arg-type]


def test_resolver_for() -> None:
    auto = lambda t: exact_match  # noqa: E731
    assert resolver_for("auto", auto) is auto
    assert resolver_for("math", auto)(task("1")) is math_reward
    with pytest.raises(ValueError, match="unknown reward"):
        resolver_for("nope", auto)
