"""Response-length prediction for dispatch (longest predicted first).

A sample's length is predicted from two things the run already sees:

* its **source's recent lengths** (the prior: the mean of the last 256 finished responses of
  that source; the predictor keeps this record, ``DispatchStats.per_source_tokens``, which the
  meters' ``len_mean`` reads);
* its **finished siblings** (the samples of its group share the prompt, so their lengths are
  the strongest evidence): their mean, shrunk toward the prior as if the prior were
  ``prior_weight`` more siblings.

``predict = (sum(siblings) + prior_weight * prior) / (len(siblings) + prior_weight)``; with
no history at all the prior is ``default`` (half the token budget). The prediction a sample
got when it was first dispatched is compared with its final length when it finishes:
``len_pred_err`` = ``|predicted - actual| / actual``, one value per finished sample.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import MutableMapping

from rollstream.trajectory import Sample

HIGH_QUANTILE = 0.9  # a group not heard from yet is ranked as if this long (rank())


def _quantile(ordered: list[int], q: float) -> float:
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


class LengthPredictor:
    """Owns the per-source length record it is given (``observe`` appends to it): sums are
    kept alongside, so a prediction costs O(1) however often the dispatch queue asks."""

    def __init__(self, history: MutableMapping[str, deque[int]], *, default: float,
                 prior_weight: float = 1.0, window: int = 256) -> None:
        if default <= 0 or prior_weight <= 0:
            raise ValueError(f"default ({default}) and prior_weight ({prior_weight}) must be > 0")
        self._history = history  # source -> recent finished lengths (DispatchStats' record)
        self._window = window
        self._sums = {src: float(sum(v)) for src, v in history.items()}
        self.default = default
        self.prior_weight = prior_weight
        self._siblings: dict[str, tuple[float, int]] = {}  # group id -> (sum, count) finished
        self._started: dict[str, set[str]] = {}  # group id -> uids of its samples dispatched
        # each source's recent lengths kept sorted too (insort per observation, not a sort)
        self._sorted = {src: sorted(v) for src, v in history.items()}
        self._high = {src: _quantile(v, HIGH_QUANTILE) for src, v in self._sorted.items() if v}
        self._first: dict[str, dict[str, float]] = {}  # group id -> uid -> first prediction
        self.errors: list[float] = []  # |predicted - actual| / actual, drained by the meters

    def prior(self, source: str) -> float:
        recent = self._history.get(source)
        return self._sums[source] / len(recent) if recent else self.default

    def rank(self, sample: Sample) -> tuple[float, int]:
        """How urgent ``sample`` is for longest-first dispatch: (its length if long, the
        number of its group's samples already dispatched, negated). A group with a finished
        sample is ranked by its prediction; one without by the source's upper quantile
        (``HIGH_QUANTILE``): until one of its samples finishes it may be a long one, and
        starting a long one late is what costs a makespan. Among equals a group with fewer
        samples started goes first, so early slots sample every group once and the first to
        finish tell the others' lengths."""
        known = sample.group_id in self._siblings
        size = self.predict(sample) if known else self._high.get(sample.task.source,
                                                                 self.default)
        return size, -len(self._started.get(sample.group_id, ()))

    def started(self, sample: Sample) -> None:
        """``sample`` got an engine (its first or a later request)."""
        self._started.setdefault(sample.group_id, set()).add(sample.uid)

    def predict(self, sample: Sample) -> float:
        """Predicted response length of ``sample`` (tokens, whole response); the first
        prediction of each sample is kept for its error."""
        total, n = self._siblings.get(sample.group_id, (0.0, 0))
        w = self.prior_weight
        guess = (total + w * self.prior(sample.task.source)) / (n + w)
        self._first.setdefault(sample.group_id, {}).setdefault(sample.uid, guess)
        return guess

    def observe(self, sample: Sample, length: int) -> None:
        """``sample`` finished with ``length`` response tokens: a sibling for its group, a
        recent length of its source, and the error of its first prediction."""
        total, n = self._siblings.get(sample.group_id, (0.0, 0))
        self._siblings[sample.group_id] = (total + length, n + 1)
        recent = self._history.setdefault(sample.task.source, deque(maxlen=self._window))
        full = recent.maxlen is not None and len(recent) == recent.maxlen
        dropped = recent[0] if full else 0
        recent.append(length)
        self._sums[sample.task.source] = self._sums.get(sample.task.source, 0.0) + length - dropped
        ordered = self._sorted.setdefault(sample.task.source, [])
        if full:
            del ordered[bisect.bisect_left(ordered, dropped)]
        bisect.insort(ordered, length)
        self._high[sample.task.source] = _quantile(ordered, HIGH_QUANTILE)
        first = self._first.get(sample.group_id, {}).pop(sample.uid, None)
        if first is not None:
            self.errors.append(abs(first - length) / max(length, 1))

    def forget(self, group_id: str) -> None:
        """A group's life is over: drop its siblings and the predictions of its samples."""
        self._siblings.pop(group_id, None)
        self._started.pop(group_id, None)
        self._first.pop(group_id, None)

    def take_errors(self) -> list[float]:
        errors, self.errors = self.errors, []
        return errors
