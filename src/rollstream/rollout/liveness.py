"""Liveness: a run that cannot train must stop with a diagnostic, not spin forever.

Every finished training group is one outcome: trainable (it reached the buffer) or not
(filtered, failed, dropped stale, with the reason of its samples). :meth:`Liveness.verdict`
names the cause once ``max_untrainable_streak`` groups in a row were untrainable, or once
fewer than ``min_trainable_share`` of the last ``trainable_share_window`` were trainable: a
temperature that makes every group equal, a reward that always fails, prompts that never fit,
a task the model never solves. The diagnostic counts the outcomes by status and reason
(numbers in reasons folded to ``N``) and shows one example sample for each.
"""

from __future__ import annotations

import re
from collections import Counter, deque

from rollstream.config import RolloutConfig
from rollstream.trajectory import Group, SampleStatus

_NUMBER = re.compile(r"\d+")


class Liveness:
    def __init__(self, cfg: RolloutConfig) -> None:
        self.max_streak = cfg.max_untrainable_streak
        self.min_share = cfg.min_trainable_share
        self.window = cfg.trainable_share_window
        # (trainable, reason key, example) per finished group, newest last
        self._outcomes: deque[tuple[bool, str, str]] = deque(
            maxlen=max(self.window, self.max_streak))
        self.streak = 0

    def trainable(self) -> None:
        self.streak = 0
        self._outcomes.append((True, "", ""))

    def untrainable(self, group: Group) -> None:
        """Count a group none of whose samples can be trained (each sample's reason kept)."""
        self.streak += 1
        terminal = [s for s in group.samples if s.status.is_terminal()]
        s = next((x for x in terminal if x.status is not SampleStatus.ABORTED), None)
        if s is None:
            key, example = "no sample finished", group.group_id
        else:
            key = f"{s.status.value}: {_NUMBER.sub('N', s.failure or 'no reason')[:160]}"
            example = f"{s.uid}: {s.failure}"
        self._outcomes.append((False, key, example))

    def verdict(self) -> str | None:
        """Why the run should stop, or None while it can still train."""
        if self.streak >= self.max_streak:
            recent = list(self._outcomes)[-self.streak:]
            return (f"{self.streak} groups in a row could not be trained "
                    f"(rollout.max_untrainable_streak = {self.max_streak}); "
                    + _diagnose(recent))
        window = list(self._outcomes)[-self.window:]
        if self.min_share > 0 and len(window) >= self.window:
            share = sum(t for t, _, _ in window) / len(window)
            if share < self.min_share:
                return (f"only {share:.1%} of the last {len(window)} groups could be trained "
                        f"(rollout.min_trainable_share = {self.min_share}); "
                        + _diagnose([o for o in window if not o[0]]))
        return None


def _diagnose(outcomes: list[tuple[bool, str, str]]) -> str:
    counts = Counter(key for _, key, _ in outcomes)
    examples: dict[str, str] = {}
    for _, key, example in outcomes:
        examples.setdefault(key, example)
    lines = [f"{n} x {key} (e.g. {examples[key]})" for key, n in counts.most_common(5)]
    return "untrainable groups by reason: " + "; ".join(lines)
