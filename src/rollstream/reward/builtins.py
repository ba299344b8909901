"""Built-in rewards: ``exact_match`` and ``math`` (math-verify).

Both return 1.0 or 0.0. math-verify's own timeouts use ``signal.alarm``, which works only in
the main thread; the grader pool runs sync rewards in worker threads and enforces
``RewardConfig.timeout_s`` itself, so they are turned off here (``None``).
"""

from __future__ import annotations

from rollstream.reward.registry import register_reward
from rollstream.trajectory import Task

EOS_TEXT = "<|endoftext|>"


def strip_response(text: str) -> str:
    """The response without surrounding whitespace and trailing end-of-text markers."""
    text = text.strip()
    while text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)].rstrip()
    return text


@register_reward("exact_match")
def exact_match(task: Task, response_text: str) -> float:
    """1.0 when the stripped response equals the (stripped) reference."""
    return 1.0 if strip_response(response_text) == task.reference.strip() else 0.0


@register_reward("math")
def math_reward(task: Task, response_text: str) -> float:
    """1.0 when math-verify finds the response's answer equal to the reference."""
    from math_verify import parse, verify  # sympy is heavy: import on first use

    gold = parse(task.reference, parsing_timeout=None)  # type: ignore[arg-type]
    pred = parse(strip_response(response_text), parsing_timeout=None)  # type: ignore[arg-type]
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
