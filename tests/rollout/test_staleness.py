"""The staleness policy, exhaustively on small cases, and the buffer that asks it."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from rollstream.config import RolloutConfig
from rollstream.rollout.buffer import TrajectoryBuffer
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, KeptTokens, SampleStatus, Segment, Task


def _task(i: int = 0) -> Task:
    return Task(uid=f"t/{i}", source="t", prompt_ids=(1, 2), prompt_text="x", reference="y")


def _group(i: int, *versions_per_sample: list[int]) -> Group:
    g = Group.new(_task(i), len(versions_per_sample))
    for s, versions in zip(g.samples, versions_per_sample, strict=True):
        s.append_policy_tokens([5] * len(versions), [-0.1] * len(versions), list(versions))
        s.reward = float(s.sample_idx)
        s.status = SampleStatus.GRADED
    return g


def test_config_block_maps_modes_and_defaults_the_context_bound():
    def policy(mode, **bounds):
        return RolloutConfig(mode=mode, staleness=bounds).staleness_policy()

    assert policy(mode="sync").max_staleness == 0
    assert policy(mode="one_step").max_staleness == 1
    p = policy(mode="async", max_staleness=3)  # the default: drop
    assert (p.max_staleness, p.max_token_age, p.context_bound, p.rule) == (3, None, 3, "drop")
    p = policy(mode="async", max_staleness=3, max_token_age=2)
    assert p.context_bound == 6  # 2 x k by default
    assert policy(mode="async", max_staleness=3, max_token_age=2,
                  max_context_age=4).context_bound == 4
    assert policy(mode="async", max_staleness=3, max_token_age=2).rule == "mask"
    p = policy(mode="async", max_staleness=3, max_context_age=5)
    assert (p.rule, p.context_bound, p.kept_bound) == ("admission", 5, 5)
    assert policy(mode="async", max_staleness=3, max_context_age=3).rule == "drop"


def _kept(num: int, oldest: int | None, version_sum: int) -> KeptTokens:
    return KeptTokens(num_tokens=num, min_version=oldest, version_sum=version_sum)


def test_token_mask_and_kept_tokens():
    p = StalenessPolicy(max_staleness=2, max_token_age=1, max_context_age=4)
    assert p.oldest_kept_version(5) == 4
    assert p.keeps(7, 5) and p.keeps(4, 5) and not p.keeps(3, 5)
    assert not p.keeps(-1, 0)  # env tokens and padding
    g = _group(0, [2, 3, 4, 4])
    assert p.kept_tokens(g.samples[0], 5) == _kept(2, 4, 8)
    g.samples[0].segments[0].loss_mask[3] = False
    assert p.kept_tokens(g.samples[0], 5) == _kept(1, 4, 4)
    assert StalenessPolicy(max_staleness=2).kept_tokens(g.samples[0], 5) == _kept(3, 2, 9)


def test_kept_tokens_and_version_range_match_their_per_token_definitions():
    """kept_tokens and min/max_version work per segment; on random mixes of policy segments
    (some tokens out of the loss) and environment segments they agree with the per-token
    rule: loss-masked tokens of a version >= the oldest kept one."""
    rng = random.Random(0)
    for trial in range(300):
        s = _group(trial, []).samples[0]
        for _ in range(rng.randint(0, 4)):
            n = rng.randint(1, 6)
            if rng.random() < 0.3:
                s.segments.append(Segment.env([9] * n))
                continue
            s.append_policy_tokens([5] * n, [-0.1] * n, [rng.randint(0, 6) for _ in range(n)])
            if rng.random() < 0.5:
                s.segments[-1].loss_mask[rng.randrange(len(s.segments[-1]))] = False
        policy = [v for v in s.versions if v >= 0]
        assert (s.min_version(), s.max_version()) == (min(policy, default=None),
                                                      max(policy, default=None))
        for age in (None, 0, 2):
            p = StalenessPolicy(max_staleness=2, max_token_age=age, max_context_age=6)
            since = max(p.oldest_kept_version(7), 0)
            kept = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m and v >= since]
            assert p.kept_tokens(s, 7) == _kept(len(kept), min(kept, default=None),
                                                sum(kept))


def test_verdicts_and_reasons():
    k2 = StalenessPolicy(max_staleness=2)
    assert k2.sample_verdict(_group(0, [3, 4]).samples[0], 5).ok
    v = k2.sample_verdict(_group(0, [2, 4]).samples[0], 5)
    assert not v.ok and v.spoils_group
    assert v.reason == "staleness 3 > max_staleness 2 (oldest token version 2, trainer step 5)"
    age = StalenessPolicy(max_staleness=2, max_token_age=1, max_context_age=4)
    v = age.sample_verdict(_group(0, [2, 3]).samples[0], 5)  # context 3 <= 4, no token >= 4
    assert not v.ok and not v.spoils_group
    assert v.reason == "every token older than max_token_age 1 (trainer step 5)"
    v = age.sample_verdict(_group(0, [0, 5]).samples[0], 5)
    assert not v.ok and v.spoils_group
    assert v.reason.startswith("context age 5 > max_context_age 4")
    # a group: one all-masked sample is dropped alone, all of them drop the group
    assert age.group_verdict(_group(0, [2, 3], [4, 5]), 5).ok
    assert not age.group_verdict(_group(0, [2, 3], [3, 3]), 5).ok
    assert not age.group_verdict(_group(0, [0, 5], [4, 5]), 5).ok  # spoiled by one sample
    # live groups: doomed as soon as a token is older than the context bound
    assert age.live_verdict(_group(0, [1], []), 5).ok
    assert not age.live_verdict(_group(0, [0], []), 5).ok
    # admission: a sample older than k is trained whole while within H
    adm = StalenessPolicy(max_staleness=2, max_context_age=4)
    assert adm.sample_verdict(_group(0, [1, 2, 5]).samples[0], 5).ok
    assert adm.kept_tokens(_group(0, [1, 2, 5]).samples[0], 5) == _kept(3, 1, 8)
    v = adm.sample_verdict(_group(0, [0, 5]).samples[0], 5)
    assert not v.ok and v.spoils_group and v.reason.startswith("context age 5 > max_context_age 4")


def test_invalid_bounds():
    with pytest.raises(ValueError):
        StalenessPolicy(max_staleness=1, max_token_age=2)
    with pytest.raises(ValueError):
        StalenessPolicy(max_staleness=2, max_token_age=1, max_context_age=1)


@pytest.mark.parametrize(("k", "m", "h"), [(0, None, None), (1, None, None), (2, None, None),
                                           (2, 0, 4), (2, 1, 2), (2, 2, 3), (3, 2, 6),
                                           (1, None, 3), (2, None, 4), (0, None, 2)])
def test_written_guarantees_hold_exhaustively(k, m, h):
    """Every (versions, step) with versions in 0..5 (up to 3 tokens, non-decreasing as an
    engine stamps them) and steps 0..7: whatever the verdicts accept keeps no token older
    than m (mask), k (drop) or H (admission), and has seen no token older than H; under
    admission every sample within H is trained whole (its verdict never drops it)."""
    policy = StalenessPolicy(max_staleness=k, max_token_age=m, max_context_age=h)
    bound_kept = {"mask": m, "drop": k, "admission": h}[policy.rule]
    cases = [list(c) for n in (1, 2, 3)
             for c in itertools.combinations_with_replacement(range(6), n)]
    for versions in cases:
        for step in range(max(versions), 8):  # a step never precedes the tokens it trains
            sample = _group(0, versions).samples[0]
            v = policy.sample_verdict(sample, step)
            kept = policy.kept_tokens(sample, step)
            num, oldest_kept = kept.num_tokens, kept.min_version
            if v.ok:
                assert num > 0 and step - oldest_kept <= bound_kept, (versions, step)
                assert step - min(versions) <= policy.context_bound, (versions, step)
            if policy.rule == "admission" and step - min(versions) <= h:
                assert v.ok and num == len(versions), (versions, step)
            live = policy.live_verdict(Group(group_id=sample.group_id, task=sample.task,
                                             samples=[sample]), step)
            if not live.ok:  # doomed now: never trainable at this or any later step
                assert not any(policy.sample_verdict(sample, t).ok for t in range(step, 10))


def test_buffer_drops_stale_with_reasons_and_serves_oldest_first():
    async def main():
        buf = TrajectoryBuffer(StalenessPolicy(max_staleness=2))
        for i, v in enumerate([3, 1, 2, 0]):
            buf.put(_group(i, [v, v + 1], [v, v + 1]))
        stale = buf.pop_stale(3)
        assert [(g.task.uid, v.reason) for g, v in stale] == [
            ("t/3", "staleness 3 > max_staleness 2 (oldest token version 0, trainer step 3)")]
        assert buf.pop_batch(4) is None
        assert [g.task.uid for g in buf.pop_batch(2)] == ["t/1", "t/2"]  # oldest first
        assert len(buf) == 1
        await asyncio.wait_for(buf.wait_changed(), 1)  # the puts above were changes
        waiter = asyncio.create_task(buf.wait_changed())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        buf.put(_group(9, [4]))
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())


def test_buffer_judges_each_group_once_per_step_and_again_at_a_later_step():
    judged: list[str] = []

    class Counting(StalenessPolicy):
        def group_verdict(self, group, step):
            judged.append(f"{group.task.uid}@{step}")
            return super().group_verdict(group, step)

    buf = TrajectoryBuffer(Counting(max_staleness=2))
    buf.put(_group(0, [1], [1]))
    assert buf.pop_stale(2) == []
    buf.put(_group(1, [1], [1]))
    assert buf.pop_stale(2) == []  # the rollout calls it as each group arrives
    assert judged == ["t/0@2", "t/1@2"]  # group 0 not judged again at the same step
    stale = buf.pop_stale(4)  # a later step: both judged again, both now too old
    assert judged[2:] == ["t/0@4", "t/1@4"] and len(stale) == 2 and len(buf) == 0
