"""``rollout.early_stop``: the beta-binomial rule (rollout/early_stop.py), its settings, and
the real rollout and dispatcher cancelling groups with it (in the simulator)."""

from __future__ import annotations

import pytest

from rollstream.config import RunConfig
from rollstream.config.early_stop import EarlyStopConfig
from rollstream.config.loader import ConfigError
from rollstream.config.staleness import StalenessConfig
from rollstream.rollout.early_stop import EarlyStop
from rollstream.trajectory import Group, SampleStatus, Task


def _group(k: int, source: str = "s", size: int = 8) -> Group:
    task = Task(uid=f"t{k}", source=source, prompt_ids=(1, 2), prompt_text="", reference="")
    return Group.new(task, size, k)


def _groups(rule: EarlyStop, *, witness: bool, source: str = "s", size: int = 8):
    """Groups that are (are not) witnesses of ``rule``, numbered on."""
    k = 0
    while True:
        g = _group(k, source, size)
        if rule.is_witness(g.group_id) == witness:
            yield g
        k += 1


def _grade(rule: EarlyStop, group: Group, rewards: list[float | None]):
    """Grade the group's samples in order (None: the sample FAILED); the first stop."""
    for s, r in zip(group.samples, rewards, strict=False):
        s.status = SampleStatus.GRADED if r is not None else SampleStatus.FAILED
        s.reward = r
        if (stop := rule.graded(group, s)) is not None:
            return stop
    return None


def _witness(rule: EarlyStop, groups, outcomes: list[list[float]]) -> None:
    for rewards in outcomes:
        g = next(groups)
        assert _grade(rule, g, rewards) is None  # a witness runs whole
        rule.ended(g)


def test_the_chance_is_measured_on_witnesses_in_the_order_samples_finish():
    rule = EarlyStop(EarlyStopConfig(after=2, min_groups=3), group_size=4)
    witnesses = _groups(rule, witness=True, size=4)
    _witness(rule, witnesses, [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0],
                               [1, 1, 1, 1]])
    # first 2 all failed: 3 witnesses, 2 of whose other 2 failed; first 3: 3 and 2
    assert rule.chance_rest_agrees("s", [0, 0]) == pytest.approx(2.5 / 4)
    assert rule.chance_rest_agrees("s", [0, 0, 0]) == pytest.approx(2.5 / 4)
    assert rule.chance_rest_agrees("s", [1, 1]) is None  # one witness: fewer than min_groups
    assert rule.chance_rest_agrees("s", [0, 1]) is None
    assert rule.chance_rest_agrees("other", [0, 0]) is None
    copy = EarlyStop(EarlyStopConfig(after=2, min_groups=3), group_size=4)
    copy.restore(rule.state())
    assert copy.chance_rest_agrees("s", [0, 0]) == rule.chance_rest_agrees("s", [0, 0])
    # a witness graded in part (cancelled, failed) measures nothing
    g = next(witnesses)
    _grade(rule, g, [0, 0, 0])
    rule.ended(g)
    assert rule.state() == copy.state()


def test_a_group_stops_only_when_its_graded_rewards_agree_and_the_rest_likely_would():
    rule = EarlyStop(EarlyStopConfig(after=2, stop_above=0.9, min_groups=8,
                                     witness_share=0.5), group_size=8)
    _witness(rule, _groups(rule, witness=True), [[0.0] * 8, [1.0] * 8] * 10)
    others = _groups(rule, witness=False)
    stop = _grade(rule, next(others), [0, 0, 0])
    assert stop is not None and stop.chance == pytest.approx(10.5 / 11)
    assert "first 2 rewards were all 0" in stop.reason
    assert _grade(rule, next(others), [1, 0, 0, 0, 0, 0, 0]) is None  # they varied
    assert _grade(rule, next(others), [None, 0, 0, 0, 0, 0, 0]) is None  # one failed
    assert _grade(rule, next(others), [0.5, 0.5, 0.5]) is None  # not a pass or a fail
    assert _grade(rule, next(_groups(rule, witness=False, source="o")), [0, 0]) is None
    assert _grade(rule, next(_groups(rule, witness=True)), [0] * 7) is None  # a witness


def test_where_the_slow_samples_differ_nothing_is_stopped():
    """Samples that finish first pass, slow ones fail (as capped responses do): the first
    ones agree in every group, yet no group should stop, and none does."""
    rule = EarlyStop(EarlyStopConfig(after=2, min_groups=8, witness_share=0.5), group_size=8)
    _witness(rule, _groups(rule, witness=True), [[1, 1, 1, 1, 1, 1, 0, 0]] * 20)
    assert rule.chance_rest_agrees("s", [1, 1]) == pytest.approx(0.5 / 21)
    others = _groups(rule, witness=False)
    assert all(_grade(rule, next(others), [1, 1, 1, 1, 1, 1, 0, 0]) is None for _ in range(5))


def test_no_group_stops_before_min_groups_witnesses_were_measured():
    rule = EarlyStop(EarlyStopConfig(after=2, min_groups=10, witness_share=0.5), group_size=4)
    witnesses, others = _groups(rule, witness=True, size=4), _groups(rule, witness=False, size=4)
    stops = []
    for _ in range(12):
        stops.append(_grade(rule, next(others), [0, 0]))
        _witness(rule, witnesses, [[0, 0, 0, 0]])
    assert stops[:10] == [None] * 10 and all(s is not None for s in stops[10:])


@pytest.mark.parametrize(("early_stop", "rollout", "says"), [
    ({"after": 1}, {}, "rollout.early_stop.after = 1 must be 0 (off) or from 2 to"),
    ({"after": 8}, {}, "rollout.group_size - 1 = 7"),
    ({"after": 2}, {"filter_zero_variance": False}, "rollout.filter_zero_variance"),
    ({"stop_above": 0.5}, {}, "rollout.early_stop.stop_above is read only with"),
    ({"after": 2, "stop_above": 1.0}, {}, "stop_above"),
    ({"after": 2, "witness_share": 1.0}, {}, "witness_share"),
])
def test_bad_settings_fail_at_load_naming_the_field(tmp_path, early_stop, rollout, says):
    from rollstream.config.loader import load_config

    path = tmp_path / "run.yaml"
    path.write_text("{}")
    args = [f"rollout.early_stop.{k}={v}" for k, v in early_stop.items()]
    args += [f"rollout.{k}={str(v).lower()}" for k, v in rollout.items()]
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(path, args)
    assert RunConfig().rollout.early_stop.after == 0  # off by default


def test_the_real_rollout_cancels_stopped_groups_and_files_them_as_zero_variance(tmp_path):
    """The simulator runs the real dispatcher and rollout: with a workload whose groups
    mostly all pass or all fail, groups stop early; each stopped group's graded samples
    agree, the rest were cancelled unfinished, and it is FILTERED as zero variance; the
    metrics count them."""
    from rollstream.data.ledger import read_ledger
    from rollstream.sim.profile import load_profile
    from rollstream.sim.run import build_sim
    from rollstream.sim.scenario import ModeConfig, Scenario
    from rollstream.sim.vloop import run_virtual

    sc = Scenario.model_validate({
        "name": "es", "seed": 1, "profile": "gpu_h100_7b", "engines": 4, "token_block": 32,
        "steps": 12, "groups_per_step": 8, "group_size": 8, "trainer_devices": 2,
        "workload": {"mean_response_tokens": 3000, "max_response_tokens": 12288,
                     "pass_rate_mean": 0.4, "pass_rate_concentration": 0.1}})
    mode = ModeConfig(name="es", mode="async", staleness=StalenessConfig(max_staleness=2),
                      early_stop=EarlyStopConfig(after=2, min_groups=4, witness_share=0.3,
                                                 stop_above=0.7))
    ledger_path = tmp_path / "ledger.jsonl"

    async def main():
        _, controller, _, _, metrics, _, ledger = await build_sim(
            sc, mode, load_profile(sc.profile), ledger_path)
        result = await controller.run()
        ledger.close()
        return result, metrics

    result, metrics = run_virtual(main())
    assert result.steps_done == sc.steps
    rows = [r for r in read_ledger(ledger_path) if not r.sample_uid.endswith("#row")]
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r.sample_uid.rsplit("/", 1)[0], []).append(r)
    stopped = {g: rs for g, rs in by_group.items()
               if any("stopped early" in (r.reason or "") for r in rs)}
    assert len(stopped) >= 5, len(stopped)
    for rs in stopped.values():
        assert all(r.status == "filtered" for r in rs)
        graded = [r.reward for r in rs if r.reward is not None]
        assert len(graded) >= 2 and len(set(graded)) == 1, graded
        assert len(graded) < sc.group_size  # some were cancelled before they were graded
    counted = sum(v.get("early_stopped_groups", 0) for kind, _, _, v in metrics.records
                  if kind == "train")
    assert counted == len(stopped)
