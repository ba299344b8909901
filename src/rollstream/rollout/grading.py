"""Grading a rollout's samples: the step between GENERATED and GRADED.

A sample's source names its reward (``reward/registry.py``). A per-sample reward scores each
sample the moment it finishes; a group reward (``@group_reward``) scores a group's generated
samples in one call once every sample has finished. Either way the reward sees the decoded
answer (the response of a single-turn sample, the last model turn of an episode), and a
failing reward marks its samples FAILED with the reason: the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable

from rollstream.engine.protocol import FinishReason
from rollstream.reward.pool import GradeResult, GraderPool
from rollstream.reward.registry import Response
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.trajectory import Group, Sample, SampleStatus, Task


class Grading:
    """Scores GENERATED samples through the grader pool and moves them to GRADED or FAILED."""

    def __init__(self, graders: GraderPool, decode: Callable[[list[int]], str],
                 lifecycle: Lifecycle) -> None:
        self.graders = graders
        self.decode = decode
        self.lifecycle = lifecycle

    def together(self, task: Task) -> bool:
        """Whether ``task``'s reward scores a group at once (after its last sample)."""
        return self.graders.grades_groups(task)

    async def sample(self, sample: Sample) -> None:
        """Score one GENERATED sample with its source's reward."""
        self._graded(sample, await self.graders.grade(sample.task, self._response(sample)))

    async def group(self, group: Group) -> None:
        """Score the GENERATED samples of ``group`` with one call of its group reward; a
        failing call marks each of them FAILED with the reason."""
        samples = [s for s in group.samples if s.status is SampleStatus.GENERATED]
        if not samples:
            return
        results = await self.graders.grade_group(group.task, [self._response(s) for s in samples])
        for s, result in zip(samples, results, strict=True):
            self._graded(s, result)

    def _response(self, sample: Sample) -> Response:
        ids, finish_reason = sample.answer()
        return Response(text=self.decode(ids), token_ids=tuple(ids),
                        finish_reason=finish_reason or FinishReason.LENGTH.value,
                        episode=sample.episode_record)

    def _graded(self, sample: Sample, result: GradeResult) -> None:
        sample.episode_record = None  # read: what is left of the episode is its samples'
        if result.error is not None:
            self.lifecycle.move(sample, SampleStatus.FAILED, f"reward: {result.error}")
            return
        sample.reward = result.reward
        self.lifecycle.move(sample, SampleStatus.GRADED)
