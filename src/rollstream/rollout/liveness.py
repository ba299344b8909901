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
        # (trainable, reason key, example) per finished group of the share window, newest
        # last; the streak is kept as counts per reason key (and its first example), so
        # memory stays bounded however large max_untrainable_streak is (bench soak: 10^6)
        self._outcomes: deque[tuple[bool, str, str]] = deque(maxlen=self.window)
        self._streak_counts: Counter[str] = Counter()
        self._streak_examples: dict[str, str] = {}
        self.streak = 0

    def trainable(self) -> None:
        self.streak = 0
        self._streak_counts.clear()
        self._streak_examples.clear()
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
        self._streak_counts[key] += 1
        self._streak_examples.setdefault(key, example)

    def verdict(self) -> str | None:
        """Why the run should stop, or None while it can still train."""
        if self.streak >= self.max_streak:
            return (f"{self.streak} groups in a row could not be trained "
                    f"(rollout.max_untrainable_streak = {self.max_streak}); "
                    + _diagnose(self._streak_counts, self._streak_examples))
        if self.min_share > 0 and len(self._outcomes) >= self.window:
            window = list(self._outcomes)
            share = sum(t for t, _, _ in window) / len(window)
            if share < self.min_share:
                counts: Counter[str] = Counter()
                examples: dict[str, str] = {}
                for trainable, key, example in window:
                    if not trainable:
                        counts[key] += 1
                        examples.setdefault(key, example)
                return (f"only {share:.1%} of the last {len(window)} groups could be trained "
                        f"(rollout.min_trainable_share = {self.min_share}); "
                        + _diagnose(counts, examples))
        return None


def _diagnose(counts: Counter[str], examples: dict[str, str]) -> str:
    """The five commonest reasons (first seen first among equals), each with an example."""
    lines = [f"{n} x {key} (e.g. {examples[key]})" for key, n in counts.most_common(5)]
    return "untrainable groups by reason: " + "; ".join(lines)
