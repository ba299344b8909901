"""Terminal progress of a run: step/total, reward, throughput, staleness, ETA.

On a terminal with ``monitor.progress: true`` this is a rich live bar. Otherwise (progress
off, output piped to a file or CI log) it prints one plain line per step, so logs stay
greppable and free of control codes. ``update`` merges values, so rollout and train values
can arrive separately; in plain mode a line is printed when a new step arrives, with the
values known at that moment, so pass a step's values in one call where possible.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress

from rollstream.config.schema import MonitorConfig

REWARD_KEYS = ("reward_mean", "reward")
THROUGHPUT_KEY = "gen_tok_s"
STALENESS_KEYS = ("staleness_mean", "staleness_max")


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m20s`` or ``42s``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class Progress:
    """Progress over `total_steps` trainer steps.

    `update(step, values)` takes the index of the trainer step just finished, as the
    controller numbers steps in metrics.jsonl (0-based), so after step 0 one step is done.
    `start_step` is the number of steps already done (resume).
    """

    def __init__(self, cfg: MonitorConfig, total_steps: int, *, file: TextIO | None = None,
                 start_step: int = 0) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.total_steps = total_steps
        self._file = file if file is not None else sys.stdout
        self._values: dict[str, float] = {}
        self._t0 = time.monotonic()
        self._start_step = start_step
        self._step = start_step
        self._printed_step: int | None = None
        self.live = bool(cfg.progress) and self._file.isatty()
        self._rich: RichProgress | None = None
        if self.live:
            self._rich = RichProgress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("reward [cyan]{task.fields[reward]}"),
                TextColumn("[green]{task.fields[tok_s]}[/] tok/s"),
                TextColumn("staleness {task.fields[staleness]}"),
                TextColumn("eta {task.fields[eta]}"),
                console=Console(file=self._file),
                refresh_per_second=4,
            )
            self._task = self._rich.add_task("train", total=total_steps, completed=start_step,
                                             **self._fields())
            self._rich.start()

    def eta_s(self) -> float | None:
        """Seconds left at the average pace so far (None before the first step)."""
        done = self._step - self._start_step
        if done <= 0:
            return None
        return (time.monotonic() - self._t0) / done * max(self.total_steps - self._step, 0)

    def _fields(self) -> dict[str, Any]:  # Any: splatted into rich's **fields
        v = self._values
        reward = next((v[k] for k in REWARD_KEYS if k in v), None)
        mean, high = (v.get(k) for k in STALENESS_KEYS)
        staleness = _fmt(mean, ".2f") + (f" (max {high:.0f})" if high is not None else "")
        return {"reward": _fmt(reward, ".3f"), "tok_s": _fmt(v.get(THROUGHPUT_KEY), ",.0f"),
                "staleness": staleness, "eta": format_duration(self.eta_s())}

    def line(self) -> str:
        """The plain one-line status: steps done of total, and the latest values."""
        f = self._fields()
        return (f"step {self._step}/{self.total_steps} | reward {f['reward']} | "
                f"{f['tok_s']} tok/s | staleness {f['staleness']} | eta {f['eta']}")

    def update(self, step: int, values: Mapping[str, float | int | None]) -> None:
        """Step `step` (0-based) finished: merge `values` (None values are ignored)."""
        self._values.update({k: float(x) for k, x in values.items() if x is not None})
        self._step = max(self._step, min(int(step) + 1, self.total_steps))
        if self._rich is not None:
            self._rich.update(self._task, completed=self._step, **self._fields())
        elif self._printed_step is None or self._step > self._printed_step:
            print(self.line(), file=self._file, flush=True)
            self._printed_step = self._step

    def close(self) -> None:
        """Stop the live display (leaving the final bar on screen)."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
