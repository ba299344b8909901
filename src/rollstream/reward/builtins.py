"""Built-in rewards: ``exact_match``, ``math`` (math-verify) and ``math_answer`` (the ``math``
task source's own rules).

All return 1.0 or 0.0 and score only a response that stopped properly (``finish_reason ==
"stop"``): a length-capped response never finished its answer, so it scores 0 even when its
text happens to match (as DAPO-style overlong handling and most verifiers do). The text has
no special tokens (the grading input is decoded as TRL does), so there is no end-of-text
marker to strip.

math-verify's own timeouts (``signal.alarm``) are on wherever the call runs in a main thread:
in the grader pool's worker processes, which run each call in their main thread, and in a
measurement that calls a reward directly from a main thread. Off the main thread, where
``signal`` cannot be used, they are off and only the pool's ``reward.timeout_s`` applies.
"""

from __future__ import annotations

import re
import threading

from rollstream.reward.registry import register_reward
from rollstream.trajectory import Task

MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own per-parse / per-verify bound (whole seconds)
_MATH_MAX_ANSWER_CHARS = 32
_OPERATOR_IN_ANSWER = re.compile(r"[+*/=]|\d\s*-")


@register_reward("exact_match")
def exact_match(task: Task, text: str, *, finish_reason: str) -> float:
    """1.0 when the response stopped properly and its stripped text equals the stripped
    reference."""
    return 1.0 if finish_reason == "stop" and text.strip() == task.reference.strip() else 0.0


@register_reward("math")
def math_reward(task: Task, text: str, *, finish_reason: str) -> float:
    """1.0 when the response stopped properly and math-verify finds its answer equal to the
    reference (any form math-verify extracts: ``\\boxed{}``, ``$...$``, a last number)."""
    if finish_reason != "stop":
        return 0.0
    return 1.0 if _math_equal(task.reference, text) else 0.0


@register_reward("math_answer")
def math_answer(task: Task, text: str, *, finish_reason: str) -> float:
    """The ``math`` source's reward: a properly ended response that is only the final value
    (restating the expression, ``12+7*3``, would verify as equal), equal by math-verify."""
    body = text.strip()
    if (
        finish_reason != "stop"
        or not body
        or len(body) > _MATH_MAX_ANSWER_CHARS
        or _OPERATOR_IN_ANSWER.search(body)
    ):
        return 0.0
    return 1.0 if _math_equal(task.reference, body) else 0.0


def _math_equal(reference: str, answer: str) -> bool:
    from math_verify import parse, verify  # sympy is heavy: only graders pay for it

    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(reference, parsing_timeout=limit)  # type: ignore[arg-type]
    pred = parse(answer, parsing_timeout=limit)  # type: ignore[arg-type]
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=limit)
