"""Adaptive concurrency: how many requests an engine may hold, found by hill climbing on its
measured throughput (``rollout.concurrency: adaptive``).

An engine's throughput (tokens/s) rises with the requests it runs at once until its step cost
grows as fast as its rows (compute-bound, or its cache spills); past that knee more requests
only add latency (each request's tokens/s is throughput / requests). The dispatch queue
(``rollout/queue.py``) grants an engine at most :attr:`ConcurrencyLimit.limit` requests, and
this controller moves that limit toward the knee:

* every window of ``window_tokens`` generated tokens (``EngineStats.generated_tokens`` deltas
  over the dispatcher's clock) it measures the engine's throughput at the current limit;
* CLIMB: while a raise (x1.5, at least +1, at most the capacity) gains more than
  ``min_gain`` (5%) over the last accepted window, keep raising; a raise that does not pay
  is undone and the limit HOLDs;
* DESCEND (a probe downward): while a cut keeps throughput within ``min_gain`` of where the
  probe started, keep cutting (the same throughput at fewer requests is lower latency); a cut
  that costs more is undone, HOLD;
* HOLD: the reference throughput is the mean of the windows held so far (one window is
  noisy; the mean follows a drifting workload and starts afresh at every hold); after
  ``hold_windows`` windows it probes again, up and down in turn, so a changed workload (longer
  prompts, another engine's load) is followed.

Rising latency needs no rule of its own: at a fixed throughput, latency per token is
in-flight / throughput, so "raise only while throughput gains more than 5%" is "let latency
rise only when throughput pays for it". This is the hill climbing of TCP Vegas and of
gradient concurrency limiters (Netflix ``concurrency-limits`` Gradient2), with throughput,
not RTT, as the signal, and multiplicative steps both ways (AIMD would cut harder; a
throughput plateau is not congestion loss, so a symmetric step is enough).

Deliberately simple: deterministic (no random probes), one window per decision, a window in
which the engine was not held at its limit (too few requests waiting) measures the demand,
not the engine, and is discarded. Cache use is not a signal: ``EngineStats`` does not report
it; the engine's capacity (its KV rows) is the upper bound.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollstream.config.schema import RolloutConfig

HOLD_WINDOWS = 8  # windows at a held limit before probing again
HISTORY_WINDOWS = 256  # recent windows kept for reports: memory does not grow with run length


class Phase(str, enum.Enum):
    CLIMB = "climb"  # raising while it pays
    DESCEND = "descend"  # cutting while it costs nothing
    HOLD = "hold"  # at the accepted limit until the next probe


def step_up(limit: int, capacity: int) -> int:
    return min(capacity, max(limit + 1, math.ceil(limit * 1.5)))


def step_down(limit: int) -> int:
    return max(1, min(limit - 1, math.floor(limit / 1.5)))


@dataclass(slots=True, kw_only=True)
class Window:
    """One measurement: the limit it ran at and the throughput it gave."""

    limit: int
    tokens_per_s: float


class ConcurrencyLimit:
    """The adaptive request limit of one engine, in [1, capacity]."""

    def __init__(self, *, capacity: int, window_tokens: int, min_gain: float = 0.05,
                 hold_windows: int = HOLD_WINDOWS, start: int | None = None) -> None:
        if capacity < 1 or window_tokens < 1 or not 0 < min_gain < 1 or hold_windows < 1:
            raise ValueError(f"bad concurrency settings: capacity={capacity}, window_tokens="
                             f"{window_tokens}, min_gain={min_gain}, hold_windows={hold_windows}")
        self.capacity = capacity
        self.window_tokens = window_tokens
        self.min_gain = min_gain
        self.hold_windows = hold_windows
        self.limit = min(capacity, start if start is not None else max(4, capacity // 4))
        self.phase = Phase.CLIMB
        self.best: Window | None = None  # the last accepted window (the reference)
        self._probe_from: Window | None = None  # the window a downward probe started from
        # the last HISTORY_WINDOWS windows measured, in order (for reports); all of them counted
        self.history: deque[Window] = deque(maxlen=HISTORY_WINDOWS)
        self.num_windows = 0
        self._held = 0  # windows in HOLD since the last probe
        self._held_sum = 0.0  # their tokens/s, summed
        self._next_probe = Phase.CLIMB
        self._start: tuple[float, int] | None = None  # (time, tokens) the window began at
        self._observations = self._full = 0  # of this window: all, and those at the limit

    def observe(self, *, now_s: float, generated_tokens: int, in_flight: int) -> bool:
        """A request on this engine ended (``in_flight``: the requests it held just before);
        ``generated_tokens``: the engine's total. Returns whether the limit changed."""
        if self._start is None:
            self._start = (now_s, generated_tokens)
            return False
        self._observations += 1
        self._full += in_flight >= self.limit
        t0, tok0 = self._start
        tokens = generated_tokens - tok0
        if tokens < self.window_tokens or now_s <= t0:
            return False
        saturated = 2 * self._full >= self._observations
        self._start = (now_s, generated_tokens)
        self._observations = self._full = 0
        if not saturated:  # too few requests to hold the limit: it measured demand
            return False
        return self._decide(Window(limit=self.limit, tokens_per_s=tokens / (now_s - t0)))

    def _decide(self, w: Window) -> bool:
        self.history.append(w)
        self.num_windows += 1
        before = self.limit
        best = self.best
        if self.phase is Phase.HOLD or best is None:
            self._held += 1
            self._held_sum += w.tokens_per_s
            self.best = Window(limit=w.limit, tokens_per_s=self._held_sum / self._held)
            if best is None or self._held >= self.hold_windows:
                self._probe()
        elif self.phase is Phase.CLIMB:
            if w.tokens_per_s > best.tokens_per_s * (1 + self.min_gain):
                self.best = w
                self._move(step_up(w.limit, self.capacity))
            else:
                self._hold(best.limit)
        else:  # DESCEND
            start = self._probe_from or best
            if w.tokens_per_s >= start.tokens_per_s * (1 - self.min_gain):
                self.best = w
                self._move(step_down(w.limit))
            else:
                self._hold(best.limit)
        return self.limit != before

    def _probe(self) -> None:
        self.phase, self._held, self._held_sum = self._next_probe, 0, 0.0
        self._probe_from = self.best
        self._next_probe = Phase.DESCEND if self.phase is Phase.CLIMB else Phase.CLIMB
        self._move(step_up(self.limit, self.capacity) if self.phase is Phase.CLIMB
                   else step_down(self.limit))

    def _move(self, limit: int) -> None:
        if limit == self.limit:  # at a bound: nothing further to try
            self._hold(limit)
        self.limit = limit

    def _hold(self, limit: int) -> None:
        self.phase, self._held, self._held_sum, self.limit = Phase.HOLD, 0, 0.0, limit


def concurrency_limits(cfg: RolloutConfig) -> Callable[[int], ConcurrencyLimit] | None:
    """What ``rollout.concurrency`` asks of the dispatch queue: None (``capacity``: an engine
    holds its capacity) or, ``adaptive``, a controller per engine made from its capacity."""
    if cfg.concurrency == "capacity":
        return None
    return lambda capacity: ConcurrencyLimit(capacity=capacity,
                                             window_tokens=cfg.concurrency_window_tokens,
                                             min_gain=cfg.concurrency_min_gain)
