"""Held-out evaluation: score the eval prompts with the current engine weights.

Eval samples go through the same dispatcher and graders as training samples, and end in the
ledger as EVALUATED (or FAILED with the reason); they are never trained.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence

from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.trajectory import Group, SampleStatus, Task


async def evaluate(
    dispatcher: Dispatcher,
    tasks: Sequence[Task],
    *,
    params: SamplingParams,
    samples_per_task: int,
    ledger: Ledger,
    round_index: int,
) -> dict[str, float]:
    """Mean reward over every eval sample (a failed sample scores 0), overall and per source."""
    groups = [Group.new(t, samples_per_task, k=1000 + round_index) for t in tasks]
    await asyncio.gather(*(dispatcher.run_group(g, params) for g in groups))
    scores: dict[str, list[float]] = {}
    now = dispatcher.clock.now()
    for g in groups:
        for s in g.samples:
            if s.status is SampleStatus.GRADED:
                ledger.record(s, SampleStatus.EVALUATED, None, now)
            scores.setdefault(g.task.source, []).append(
                s.reward if s.status is SampleStatus.EVALUATED and s.reward is not None else 0.0
            )
    out = {f"reward/{src}": statistics.fmean(v) for src, v in scores.items()}
    every = [x for v in scores.values() for x in v]
    out["reward"] = statistics.fmean(every) if every else 0.0
    return out
