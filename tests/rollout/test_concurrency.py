"""The adaptive concurrency controller against synthetic throughput curves: it climbs to the
knee of a saturating curve, settles at the top of one that peaks, follows a workload that
changes, stays in [1, capacity] and ignores windows that measured demand, not the engine."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from rollstream.rollout.concurrency import ConcurrencyLimit, Phase, step_down, step_up

Curve = Callable[[int], float]  # requests in flight -> tokens/s


def saturating(a: float, b: float) -> Curve:
    """A step costs a + b * rows (a fixed part, reading weights, and a part per row)."""
    return lambda rows: rows / (a + b * rows)


def peaked(top: float) -> Curve:
    """Throughput that peaks at ``top`` rows and falls after (a cache that spills)."""
    return lambda rows: rows * math.exp(-rows / top)


def drive(ctl: ConcurrencyLimit, curve: Curve, num_events: int, *, t0: float = 0.0,
          tokens0: int = 0, full: bool = True) -> tuple[list[int], float, int]:
    """A saturated engine: a request ends every 0.01 s, tokens arrive at 100 x
    ``curve(limit)`` (enough per window that counting whole tokens adds no noise).
    Returns the limit after each event, and the clock and token count at the end."""
    t, tokens, limits = t0, float(tokens0), []
    for _ in range(num_events):
        t += 0.01
        tokens += curve(ctl.limit)
        ctl.observe(now_s=t, generated_tokens=int(tokens),
                    in_flight=ctl.limit if full else ctl.limit - 1)
        assert 1 <= ctl.limit <= ctl.capacity
        limits.append(ctl.limit)
    return limits, t, int(tokens)


def grid_knee(curve: Curve, start: int, capacity: int, gain: float) -> int:
    """The limit a climb by step_up stops at: the first whose next step gains < ``gain``."""
    limit = start
    while limit < capacity and curve(step_up(limit, capacity)) > curve(limit) * (1 + gain):
        limit = step_up(limit, capacity)
    return limit


def modal(limits: list[int]) -> int:
    """The limit held most over the second half of a run (probes aside)."""
    late = limits[len(limits) // 2:]
    return max(set(late), key=late.count)


def test_it_climbs_to_the_knee_of_a_saturating_curve_and_stays_there() -> None:
    curve = saturating(a=1.0, b=0.1)  # half of its 10 tok/s ceiling at 10 rows
    assert ConcurrencyLimit(capacity=256, window_tokens=200).limit == 64  # a quarter
    ctl = ConcurrencyLimit(capacity=256, window_tokens=200, start=4)
    # a x1.5 step gains 1.5 (a + bL) / (a + 1.5 bL): below 5% from L = 6a/b = 60 on
    knee = grid_knee(curve, 4, 256, 0.05)
    assert 60 <= knee < 120
    limits, _, _ = drive(ctl, curve, 20_000)
    settled = limits[len(limits) // 2:]
    # it probes a step up and down now and then (a window's noise may carry it one step
    # further, until the next probe), but holds at the knee most of the time
    assert modal(limits) == knee
    assert step_down(knee) <= min(settled) and max(settled) <= step_up(step_up(knee, 256), 256)
    assert sum(s == knee for s in settled) > 0.6 * len(settled)
    assert curve(knee) > 0.8 * curve(256) and knee < 256 // 2  # most throughput, less latency


def test_it_settles_at_the_top_of_a_curve_that_peaks_and_falls() -> None:
    curve = peaked(top=32)
    ctl = ConcurrencyLimit(capacity=256, window_tokens=50, start=4)
    limits, _, _ = drive(ctl, curve, 20_000)
    settled = limits[len(limits) // 2:]
    modal = max(set(settled), key=settled.count)
    assert curve(modal) > 0.95 * curve(32)  # within 5% of the best throughput there is
    assert max(settled) <= step_up(step_up(32, 256), 256)  # never far down the falling side


def test_a_changed_workload_is_followed() -> None:
    """Longer sequences make each row cost more: the knee moves down; the controller's
    periodic probes downward find it, and its probes upward find it again when it moves back."""
    ctl = ConcurrencyLimit(capacity=256, window_tokens=200, start=4)
    light, heavy = saturating(a=1.0, b=0.05), saturating(a=1.0, b=0.4)
    light_knee, heavy_knee = grid_knee(light, 4, 256, 0.05), grid_knee(heavy, 1, 256, 0.05)
    assert heavy_knee < step_down(step_down(light_knee))
    limits, t, tok = drive(ctl, light, 10_000)
    assert step_down(light_knee) <= modal(limits) <= light_knee
    limits, t, tok = drive(ctl, heavy, 20_000, t0=t, tokens0=tok)
    assert step_down(heavy_knee) <= modal(limits) <= step_up(heavy_knee, 256)  # came down
    limits, _, _ = drive(ctl, light, 20_000, t0=t, tokens0=tok)
    assert step_down(light_knee) <= modal(limits) <= light_knee  # and went back up


def test_windows_the_engine_could_not_fill_decide_nothing() -> None:
    ctl = ConcurrencyLimit(capacity=64, window_tokens=100, start=8)
    drive(ctl, saturating(1.0, 0.01), 5_000, full=False)  # too few requests to fill it
    assert ctl.limit == 8 and not ctl.history and ctl.phase is Phase.CLIMB


def test_bounds_and_settings() -> None:
    ctl = ConcurrencyLimit(capacity=3, window_tokens=50)
    assert ctl.limit == 3  # min(capacity, max(4, capacity / 4))
    limits, _, _ = drive(ctl, lambda rows: float(rows), 2_000)  # linear: always pays
    assert max(limits) == 3
    limits, _, _ = drive(ConcurrencyLimit(capacity=16, window_tokens=50, start=8),
                         lambda rows: 100.0 / rows, 20_000)  # every extra request costs
    assert limits[-1] <= 2
    assert step_up(1, 64) == 2 and step_up(4, 64) == 6 and step_up(60, 64) == 64
    assert step_down(2) == 1 and step_down(1) == 1 and step_down(9) == 6
    with pytest.raises(ValueError, match="window_tokens=0"):
        ConcurrencyLimit(capacity=4, window_tokens=0)
