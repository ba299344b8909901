"""The built-in ``code`` reward: run a response's program against its row's tests in a sandbox.

The program is the last fenced block of the response (```` ```python ... ``` ````, any or no
language tag). The row's ``tests`` column (pass it with ``reward_kwargs: [tests]``) is either

* Python source, run after the program in the same file: the test passes when it exits 0
  (asserts, ``sys.exit``); or
* a list of ``{"stdin": ..., "stdout": ...}`` pairs: the program is run once per pair with
  that input, and passes when what it prints equals ``stdout`` (trailing whitespace of each
  line and trailing blank lines ignored).

The score is the share of tests passed (0.0 or 1.0 for Python source). A response without a
fenced block, or cut by its length budget, scores 0.0. Programs run in the run's sandbox pool
(``agent.sandbox``: its limits, no network unless allowed); the pairs run concurrently, as
many at once as the pool has sandboxes, so ``reward.timeout_s`` must cover
``agent.sandbox.wall_s`` times the pairs of a task over the pool size. A ``tests`` value of
another shape fails the sample's grading with the reason.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from rollstream.reward.registry import register_reward
from rollstream.trajectory import Task

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def last_code_block(text: str) -> str | None:
    """The body of the last fenced block of ``text``, or None."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


def _same_output(printed: str, expected: str) -> bool:
    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]

    return lines(printed) == lines(expected)


def _pairs(tests: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for i, t in enumerate(tests):
        if not (isinstance(t, Mapping) and isinstance(t.get("stdin", ""), str)
                and isinstance(t.get("stdout"), str)):
            raise ValueError(f"tests[{i}] must be {{stdin: str, stdout: str}}, got {t!r:.120}")
        pairs.append((t.get("stdin", ""), t["stdout"]))
    return pairs


@register_reward("code")
async def code_tests(task: Task, text: str, *, finish_reason: str, tests: Any) -> float:
    """The share of the row's ``tests`` the response's program passes (module docstring)."""
    from rollstream.agent.sandbox_shared import current_sandbox

    if isinstance(tests, str):
        pairs = None
    elif isinstance(tests, list) and tests:
        pairs = _pairs(tests)
    else:
        raise ValueError(f"tests must be Python source or a non-empty list of {{stdin, stdout}}"
                         f" pairs, got {tests!r:.120}")
    program = last_code_block(text)
    if finish_reason != "stop" or program is None:
        return 0.0
    sandbox = current_sandbox()
    if pairs is None:
        result = await sandbox.run(f"{program}\n\n{tests}\n")
        return 1.0 if result.ok else 0.0
    results = await asyncio.gather(*(sandbox.run(program, stdin=i) for i, _ in pairs))
    passed = sum(r.ok and _same_output(r.stdout, out) for r, (_, out) in zip(results, pairs,
                                                                             strict=True))
    return passed / len(pairs)
