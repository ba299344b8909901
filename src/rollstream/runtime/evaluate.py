"""Held-out evaluation: score the eval prompts with the engines' current weights.

Eval samples go through the same dispatcher and graders as training samples, in groups whose
ids live in their own namespace (``{task_uid}#eval{round}``, never a training group's id), and
end in the ledger as EVALUATED (or FAILED with the reason); they are never trained. When no
engine is alive the evaluation records its unfinished samples ABORTED and raises
:class:`RolloutStopped` with the reason.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence

from rollstream.engine.protocol import SamplingParams
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.rollout import RolloutStopped
from rollstream.trajectory import Group, SampleStatus, Task, eval_group_id


async def evaluate(
    dispatcher: Dispatcher,
    tasks: Sequence[Task],
    *,
    params: SamplingParams,
    samples_per_task: int,
    round_index: int,
) -> dict[str, float]:
    """Mean reward over every eval sample (a failed sample scores 0), overall and per source;
    ``{"reward": nan}`` when there is no held-out task."""
    if not tasks:
        return {"reward": float("nan")}
    groups = [Group.new(t, samples_per_task, group_id=eval_group_id(t.uid, round_index))
              for t in tasks]
    await asyncio.gather(*(dispatcher.run_group(g, params) for g in groups))
    for g in groups:
        dispatcher.forget(g.group_id)
    move = dispatcher.lifecycle.move
    scores: dict[str, list[float]] = {}
    for g in groups:
        for s in g.samples:
            if s.status is SampleStatus.GRADED:
                move(s, SampleStatus.EVALUATED)
            elif not s.status.is_terminal():
                move(s, SampleStatus.ABORTED, dispatcher.fatal or "evaluation did not finish")
            scores.setdefault(g.task.source, []).append(
                s.reward if s.status is SampleStatus.EVALUATED and s.reward is not None else 0.0
            )
    if dispatcher.fatal is not None:
        raise RolloutStopped(dispatcher.fatal)
    out = {f"reward/{src}": statistics.fmean(v) for src, v in scores.items()}
    out["reward"] = statistics.fmean(x for v in scores.values() for x in v)
    return out
