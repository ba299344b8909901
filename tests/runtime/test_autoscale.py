"""The autoscale policy on a fake clock (``runtime/autoscale.py``): it grows after requests
waited ``grow_after_s`` for an engine slot without a break, shrinks when the engines' busy
share over a full window is below the threshold while the staleness bound blocks admission,
stays within its bounds, and makes at most one change per window. And the settings that
contradict each other or the engines fail at load, naming the field."""

from __future__ import annotations

import pytest

from rollstream.config import ConfigError, load_config
from rollstream.config.runtime import AutoscaleConfig
from rollstream.runtime.autoscale import AutoscalePolicy, Signals
from tests.monitor.synth import FakeClock

CFG = AutoscaleConfig(min_engines=1, max_engines=3, grow_after_s=10.0, shrink_busy_below=0.3,
                      window_s=30.0)


class Engines:
    """Busy seconds of engines that are busy a given share of the time."""

    def __init__(self, n: int) -> None:
        self.busy = {f"e{i}": 0.0 for i in range(n)}

    def run(self, seconds: float, share: float) -> None:
        for k in self.busy:
            self.busy[k] += seconds * share


def _step(policy: AutoscalePolicy, clock: FakeClock, engines: Engines, *, seconds: float,
          share: float, waiting: bool = False, blocked: bool = False) -> list[int]:
    """Each second for ``seconds``: the engines work ``share`` of it; the decisions."""
    out = []
    for _ in range(int(seconds)):
        clock.t += 1.0
        engines.run(1.0, share)
        out.append(policy.decide(Signals(num_engines=len(engines.busy), waiting=waiting,
                                         staleness_blocked=blocked, busy_s=engines.busy)))
    return out


def test_grows_after_requests_waited_grow_after_s_without_a_break() -> None:
    clock, engines = FakeClock(), Engines(1)
    policy = AutoscalePolicy(CFG, clock)
    assert _step(policy, clock, engines, seconds=9, share=1.0, waiting=True) == [0] * 9
    assert _step(policy, clock, engines, seconds=1, share=1.0) == [0]  # a break: starts again
    got = _step(policy, clock, engines, seconds=11, share=1.0, waiting=True)
    assert got == [0] * 10 + [1], got  # first seen waiting at its first reading
    assert "waited 10.0 s for an engine slot" in policy.reason


def test_one_change_per_window_and_never_above_max_engines() -> None:
    clock, engines = FakeClock(), Engines(2)
    policy = AutoscalePolicy(CFG, clock)
    got = _step(policy, clock, engines, seconds=11, share=1.0, waiting=True)
    assert got[-1] == 1
    engines.busy["e2"] = 0.0  # it joined
    got = _step(policy, clock, engines, seconds=29, share=1.0, waiting=True)
    assert got == [0] * 29, "no second change within window_s of the first"
    got = _step(policy, clock, engines, seconds=40, share=1.0, waiting=True)
    assert got == [0] * 40, "three engines: max_engines"


def test_shrinks_when_idle_behind_the_staleness_bound_for_a_whole_window() -> None:
    clock, engines = FakeClock(), Engines(3)
    policy = AutoscalePolicy(CFG, clock)
    assert _step(policy, clock, engines, seconds=30, share=0.1, blocked=True) == [0] * 30, \
        "no decision before a whole window was seen"
    got = _step(policy, clock, engines, seconds=1, share=0.1, blocked=True)
    assert got == [-1] and policy.busy_share() is None  # its window starts again
    assert "busy 10% of the last 30 s while the staleness bound blocked" in policy.reason


def test_keeps_busy_or_unblocked_engines_and_min_engines() -> None:
    clock, engines = FakeClock(), Engines(3)
    policy = AutoscalePolicy(CFG, clock)
    assert set(_step(policy, clock, engines, seconds=60, share=0.1)) == {0}, \
        "idle engines with admission unblocked: the rollout is not staleness-bound"
    clock, engines = FakeClock(), Engines(3)
    policy = AutoscalePolicy(CFG, clock)
    assert set(_step(policy, clock, engines, seconds=60, share=0.5, blocked=True)) == {0}, \
        "busy above shrink_busy_below"
    assert policy.busy_share() == pytest.approx(0.5)
    clock, engines = FakeClock(), Engines(1)
    policy = AutoscalePolicy(CFG, clock)
    assert set(_step(policy, clock, engines, seconds=90, share=0.0, blocked=True)) == {0}, \
        "one engine: min_engines"


def test_a_roster_change_between_readings_never_reads_as_negative_busy() -> None:
    clock, engines = FakeClock(), Engines(2)
    policy = AutoscalePolicy(CFG, clock)
    _step(policy, clock, engines, seconds=20, share=0.9, blocked=True)
    del engines.busy["e0"]  # an operator removed it (its busy time leaves with it)
    _step(policy, clock, engines, seconds=20, share=0.9, blocked=True)
    assert policy.busy_share() == pytest.approx(0.9)


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.autoscale.min_engines=3", "runtime.autoscale.max_engines=2"],
     "runtime.autoscale.min_engines = 3 is above runtime.autoscale.max_engines = 2"),
    (["engine.num_engines=1", "runtime.autoscale.min_engines=2"],
     "engine.num_engines = 1 is outside runtime.autoscale's bounds (min_engines = 2"),
    (["engine.num_engines=5", "runtime.autoscale.max_engines=4"],
     "engine.num_engines = 5 is outside runtime.autoscale's bounds"),
    (["runtime.kind=ray", "runtime.ray.num_cpus=2", "runtime.autoscale.max_engines=3"],
     "runtime.autoscale.max_engines = 3 engine actors of runtime.ray.engine_num_cpus = 1.0 "
     "need more than runtime.ray.num_cpus = 2"),
    (["runtime.autoscale.shrink_busy_below=1.5"], "runtime.autoscale.shrink_busy_below"),
])
def test_autoscale_settings_that_contradict_fail_at_load(overrides, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_autoscale_settings_load() -> None:
    cfg = load_config(None, ["engine.num_engines=2", "runtime.autoscale.max_engines=3",
                             "runtime.autoscale.window_s=5"])
    scale = cfg.runtime.autoscale
    assert scale is not None and (scale.min_engines, scale.max_engines, scale.window_s) == \
        (1, 3, 5.0)
    assert load_config(None, []).runtime.autoscale is None
