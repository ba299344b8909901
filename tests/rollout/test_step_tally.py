"""The step's waste and length-bias measures on a constructed case whose answer is worked out
by hand: groups trained whole, one filtered for zero variance, one dropped stale whole, a
trained group with a sample dropped stale, a group cancelled part-way, an agent sample."""

from __future__ import annotations

import pytest

from rollstream.rollout.step_tally import StepTally, policy_tokens
from rollstream.trajectory import Group, SampleStatus, Segment, Task

S = SampleStatus


def _group(name: str, lengths: list[int], statuses: list[SampleStatus]) -> Group:
    task = Task(uid=f"t/{name}", source="t", prompt_ids=(1, 2), prompt_text="", reference="")
    group = Group.new(task, len(lengths))
    for s, n, status in zip(group.samples, lengths, statuses, strict=True):
        s.append_policy_tokens([7] * n, [-1.0] * n, [0] * n)
        s.status = status  # the lifecycle's job in a run; here the case is set up by hand
    return group


def test_waste_and_length_bias_of_a_constructed_step():
    trained = _group("a", [10, 20, 30, 40], [S.TRAINED] * 4)
    agent = trained.samples[0]  # an episode: 10 policy, 5 environment, 5 policy tokens
    agent.segments.append(Segment.env([3] * 5))
    agent.append_policy_tokens([7] * 5, [-1.0] * 5, [0] * 5)
    assert agent.num_response_tokens == 20 and policy_tokens(agent) == 15
    zero_variance = _group("b", [100] * 4, [S.FILTERED] * 4)
    stale = _group("c", [80, 90, 100, 110], [S.DROPPED_STALE] * 4)
    part_stale = _group("d", [50, 5, 5, 5], [S.DROPPED_STALE, S.TRAINED, S.TRAINED, S.TRAINED])
    cancelled = _group("e", [12, 12, 12, 0], [S.DROPPED_STALE] * 4)  # the last never started

    tally = StepTally()
    for g in (trained, zero_variance, stale, part_stale, cancelled):
        tally.ended(g)
    for g in (trained, stale, part_stale, cancelled):
        tally.resolved(g, zero_variance=False)
    tally.resolved(zero_variance, zero_variance=True)
    out = tally.read()

    gen = (15 + 20 + 30 + 40) + 400 + 380 + 65 + 36  # policy tokens of every ended group
    trained_tokens = (15 + 20 + 30 + 40) + 15
    assert out["gen_tokens"] == gen and out["trained_tokens"] == trained_tokens
    assert out["gen_tokens_per_trained_token"] == pytest.approx(gen / trained_tokens)
    trained_mean = (20 + 20 + 30 + 40 + 5 + 5 + 5) / 7  # response lengths, env tokens in
    candidates_mean = (110 + 380 + 65 + 36) / 15  # not zero variance; started samples only
    assert out["length_bias"] == pytest.approx(trained_mean / candidates_mean)
    assert out["length_bias"] < 0.5  # long groups dropped stale: training saw short ones
    assert tally.read() == {"gen_tokens": 0.0, "trained_tokens": 0.0, "replayed_groups": 0.0,
                            "replayed_tokens": 0.0}  # a new step


def test_replayed_tokens_count_as_trained_but_not_in_the_length_bias():
    tally = StepTally()
    fresh = _group("a", [10, 30], [S.TRAINED] * 2)
    tally.ended(fresh)
    tally.resolved(fresh, zero_variance=False)
    replay = _group("b", [100, 300], [S.TRAINED] * 2)
    tally.replayed(replay.samples[:1])  # the loss kept tokens of one of its samples
    out = tally.read()
    assert out["replayed_groups"] == 1 and out["replayed_tokens"] == 100
    assert out["trained_tokens"] == 40 + 100 and out["gen_tokens"] == 40
    assert out["length_bias"] == pytest.approx(1.0)


def test_whole_groups_trained_have_no_length_bias_however_uneven():
    tally = StepTally()
    for name, lengths in (("a", [1, 200, 3, 90]), ("b", [64, 2, 2, 2])):
        g = _group(name, lengths, [S.TRAINED] * 4)
        tally.ended(g)
        tally.resolved(g, zero_variance=False)
    assert tally.read()["length_bias"] == pytest.approx(1.0)
