"""The rollout meter: generation rates between two readings, for the ``rollout`` metrics.

Each :meth:`RolloutMeter.read` returns what happened since the previous one (the first since
:meth:`start`): generated tokens/s, the engines' mean busy share, the queues, the dispatch
counters, mean response length per source (its recent samples) and the rollout's own gauges.
Only training-time generation counts: ``start`` is called when training starts, so an
evaluation before it is not in the rates.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from rollstream.clock import Clock, WallClock
from rollstream.engine.protocol import Engine, EngineStats


class DispatchCounters(Protocol):
    num_interrupts: int
    num_resumes: int
    num_engine_failures: int
    generated_tokens: int
    per_source_tokens: dict[str, deque[int]]  # recent response lengths per source


class RolloutMeter:
    def __init__(self, engines: list[Engine], counters: DispatchCounters,
                 in_flight: Callable[[], int], gauges: Callable[[], dict[str, float]],
                 clock: Clock | None = None) -> None:
        """``engines``: the run's roster (engines may join and leave: runtime/fleet.py)."""
        self.engines, self.counters = engines, counters
        self.in_flight, self.gauges = in_flight, gauges
        self.clock = clock or WallClock()  # rates per second of this clock (virtual in `sim`)
        self._last: tuple[float, int, dict[str, float]] = (self.clock.now(), 0, {})

    def start(self) -> None:
        self._last = (self.clock.now(), self.counters.generated_tokens, busy_by_engine(
            e.stats() for e in self.engines))

    def read(self) -> dict[str, float]:
        now, c = self.clock.now(), self.counters
        stats = [e.stats() for e in self.engines]
        busy = busy_by_engine(stats)
        last_t, last_tokens, last_busy = self._last
        dt = max(now - last_t, 1e-9)
        self._last = (now, c.generated_tokens, busy)
        out = {
            "gen_tok_s": (c.generated_tokens - last_tokens) / dt,
            "engine_busy": busy_share(last_busy, busy, dt),
            "in_flight": float(self.in_flight()),
            "queued": float(sum(s.num_waiting for s in stats)),
            "interrupts": float(c.num_interrupts),
            "resumes": float(c.num_resumes),
            "engine_failures": float(c.num_engine_failures),
        }
        for src, lengths in c.per_source_tokens.items():
            out[f"len_mean/{src}"] = statistics.fmean(lengths)
        return {**out, **self.gauges()}


def busy_by_engine(stats: Iterable[EngineStats]) -> dict[str, float]:
    """Each engine's busy seconds so far, by engine id."""
    return {st.engine_id: st.busy_s for st in stats}


def busy_share(before: Mapping[str, float], after: Mapping[str, float], dt: float) -> float:
    """The engines' mean busy share over ``dt`` seconds between two :func:`busy_by_engine`
    readings: an engine counts from the first reading that holds it (one that joined in
    between adds no busy time yet) to the last (one that left is in neither), so the roster
    changing between readings never makes the share negative."""
    if not after or dt <= 0:
        return 0.0
    busy = sum(b - before.get(engine_id, b) for engine_id, b in after.items())
    return busy / dt / len(after)
