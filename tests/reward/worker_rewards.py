"""Sync rewards for the grader-pool tests. They run in the pool's worker processes, which
import this module to find them (by module + name), so it stays light: no torch, no pytest.

A reward's behaviour is picked by the task (``reference`` / ``source``) or the response text,
since a worker cannot see test-local state; rewards that must report back write files under
a folder named in ``task.reference``.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
import uuid
from pathlib import Path

from rollstream.reward.registry import group_reward, reward_setup
from rollstream.trajectory import Task

VALUES: dict[str, object] = {
    "none": None, "str": "1.0", "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
    "bool": True, "list": [1.0], "int": 3,
}


def value_named(task: Task, text: str) -> object:
    """Returns ``VALUES[task.reference]``."""
    return VALUES[task.reference]


def pid(task: Task, text: str) -> float:
    """The worker's process id."""
    return float(os.getpid())


def hang(task: Task, text: str) -> float:
    """Sleeps far past any test's timeout, after writing its pid to ``{reference}/<pid>``."""
    if task.reference:
        (Path(task.reference) / str(os.getpid())).write_text("")
    time.sleep(60)
    return 1.0


def boom(task: Task, text: str) -> float:
    raise ValueError("bad answer format")


def own_timeout(task: Task, text: str) -> float:
    raise TimeoutError("grader service did not answer")


def die(task: Task | None, text: str) -> float:
    """Ends its process at once, after writing its pid to ``{reference}/<pid>`` when the
    reference is a folder."""
    if task is not None and task.reference and Path(task.reference).is_dir():
        (Path(task.reference) / str(os.getpid())).write_text("")
    os._exit(3)


def backtrack(task: Task, text: str) -> float:
    """Catastrophic regex backtracking: ``(a+)+$`` on ``"a" * n + "b"`` tries ~2**n splits in
    C code that holds the GIL the whole time. 0.0 once it gives up."""
    return 0.0 if re.match(r"(a+)+$", text) is None else 1.0


def alarm_fires(task: Task, text: str) -> float:
    """1.0 when a SIGALRM handler interrupts a sleep, as math-verify's timeouts need (signal
    handlers can be set only in a main thread: in a thread this raises ValueError)."""

    def handler(signum: int, frame: object) -> None:
        raise InterruptedError("alarm")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        time.sleep(5)
        return 0.0
    except InterruptedError:
        return 1.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def busy_interval(task: Task, text: str) -> float:
    """Sleeps 0.3 s and records (start, end) wall times in a file under ``task.reference``."""
    start = time.time()
    time.sleep(0.3)
    (Path(task.reference) / uuid.uuid4().hex).write_text(f"{start} {time.time()}")
    return 1.0


def wants_everything(task: Task, text: str, *, finish_reason: str, token_ids: tuple[int, ...]
                     ) -> float:
    """Proves what arrives: len(token_ids) when it stopped, minus that when capped."""
    return float(len(token_ids)) * (1 if finish_reason == "stop" else -1)


@group_reward
def shortest_wins(task: Task, texts: list[str], *, finish_reason: list[str]) -> list[float]:
    """1 for the shortest response that stopped (ties: all of them), 0 for the others; a
    value per response, in order (runs in a worker process)."""
    stopped = [len(t) for t, f in zip(texts, finish_reason, strict=True) if f == "stop"]
    best = min(stopped, default=None)
    return [1.0 if f == "stop" and len(t) == best else 0.0
            for t, f in zip(texts, finish_reason, strict=True)]


@group_reward
def group_value_named(task: Task, texts: list[str]) -> object:
    """Returns ``GROUP_VALUES[task.reference]`` whatever the group."""
    return GROUP_VALUES[task.reference]


GROUP_VALUES: dict[str, object] = {
    "short": [1.0], "scalar": 1.0, "str": "1.0", "nan_at_1": [0.0, math.nan], "ok": (0.5, 1),
}


def write_pid_and_hang(path: str) -> None:
    """Writes this worker's pid to ``path``, then never returns."""
    Path(path).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


_BUILT: set[str] = set()


def _build_slowly(task: Task) -> None:
    """A setup that takes ``task.reference`` seconds the first time (an import, a grader)."""
    if task.reference not in _BUILT:
        time.sleep(float(task.reference))
        _BUILT.add(task.reference)


@reward_setup(_build_slowly)
def built_first(task: Task, text: str) -> float:
    """1.0, once its setup has built what it needs (it builds it itself if not)."""
    _build_slowly(task)
    return 1.0


def builds_in_call(task: Task, text: str) -> float:
    """The same work without the setup: its first call pays for it, timed."""
    _build_slowly(task)
    return 1.0


def _setup_fails(task: Task) -> None:
    raise RuntimeError("setup failed")


@reward_setup(_setup_fails)
def setup_fails(task: Task, text: str) -> float:
    """Its setup raises; the call itself is fine."""
    return 1.0
