import asyncio

import pytest

from rollstream.data.buffer import TrajectoryBuffer
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.rollout.admission import StalenessCapacity
from rollstream.trajectory import Group, SampleStatus, Task


def _task(i: int = 0) -> Task:
    return Task(uid=f"t/{i}", source="t", prompt_ids=(1, 2), prompt_text="x", reference="y")


def test_capacity_bounds_groups_by_version():
    cap = StalenessCapacity(groups_per_step=4, max_staleness=1)
    assert cap.room() == 8
    cap.admit(8)
    assert cap.room() == 0
    cap.retire(2)  # filtered groups free their place
    assert cap.room() == 2
    cap.admit(2)
    cap.set_version(1)
    assert cap.room() == 4


def test_capacity_sync_is_one_batch_per_version():
    cap = StalenessCapacity(groups_per_step=3, max_staleness=0)
    assert cap.room() == 3
    cap.admit(3)
    assert cap.room() == 0
    cap.retire(1)
    assert cap.room() == 1  # a filtered group is replaced under the same version
    cap.admit(1)
    cap.set_version(1)
    assert cap.room() == 3
    with pytest.raises(AssertionError):
        cap.admit(4)


def test_wait_for_room_wakes_on_version():
    async def main():
        cap = StalenessCapacity(groups_per_step=1, max_staleness=0)
        cap.admit(1)
        waiter = asyncio.create_task(cap.wait_for_room())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        cap.set_version(1)
        assert await asyncio.wait_for(waiter, 1) == 1

    asyncio.run(main())


def _graded_group(i: int, version: int) -> Group:
    g = Group.new(_task(i), 2)
    for s in g.samples:
        s.append_policy_tokens([5, 6], [-0.1, -0.2], [version, version + 1])
        s.reward = float(s.sample_idx)
        s.status = SampleStatus.GRADED
    return g


def test_buffer_drops_stale_and_serves_oldest_first():
    async def main():
        buf = TrajectoryBuffer()
        for i, v in enumerate([3, 1, 2, 0]):
            buf.put(_graded_group(i, v))
        batch, stale = await buf.take(2, step=3, max_staleness=2)
        assert [g.task.uid for g in stale] == ["t/3"]  # version 0 at step 3 > 2
        assert [g.task.uid for g in batch] == ["t/1", "t/2"]  # oldest first
        assert len(buf) == 1

    asyncio.run(main())


def test_buffer_with_token_age_counts_only_kept_tokens():
    """max_token_age: tokens older than step - age are masked, so only the kept ones age a
    group; a group whose every token would be masked is stale."""
    async def main():
        buf = TrajectoryBuffer()
        for i, v in enumerate([0, 1]):  # tokens of versions (0, 1) and (1, 2)
            buf.put(_graded_group(i, v))
        old = _graded_group(2, 0)
        for s in old.samples:  # a third group: tokens of version 0 only
            s.segments[0].versions[:] = [0, 0]
        buf.put(old)
        # step 3, age 2: kept tokens >= 1; group 0 keeps its version-1 token (staleness 2 <= 2)
        batch, stale = await buf.take(2, step=3, max_staleness=2, max_token_age=2)
        assert [g.task.uid for g in stale] == ["t/2"]  # nothing of version >= 1
        assert [g.task.uid for g in batch] == ["t/0", "t/1"]
        # without the age mask group 0's oldest token (version 0) is 3 steps old: stale
        buf2 = TrajectoryBuffer()
        buf2.put(_graded_group(0, 0))
        assert len(buf2.pop_stale(3, 2)) == 1
        # a token-age bound looser than max_staleness does not loosen max_staleness
        buf3 = TrajectoryBuffer()
        buf3.put(_graded_group(0, 0))
        assert len(buf3.pop_stale(3, 1, max_token_age=3)) == 1

    asyncio.run(main())


def test_sample_staleness_with_token_age():
    g = _graded_group(0, 4)  # versions 4, 5
    s = g.samples[0]
    assert s.staleness(7) == 3 and s.min_version() == 4
    assert s.staleness(7, max_token_age=2) == 2 and s.min_version(since=5) == 5
    assert not s.too_old(7, 2) and s.too_old(8, 2) and not s.too_old(8, None)


def test_ledger_exactly_once_and_file(tmp_path):
    led = Ledger(tmp_path / "ledger.jsonl")
    g = _graded_group(0, 0)
    for s in g.samples:
        led.open(s)
    led.record(g.samples[0], SampleStatus.TRAINED)
    with pytest.raises(AssertionError):
        led.record(g.samples[0], SampleStatus.FILTERED)
    assert [s.uid for s in led.unfinished()] == [g.samples[1].uid]
    led.record(g.samples[1], SampleStatus.FAILED, "reward: boom")
    led.close()
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert [r["status"] for r in rows] == ["trained", "failed"]
    assert rows[1]["reason"] == "reward: boom" and rows[0]["max_version"] == 1


def test_ledger_reads_a_torn_last_line(tmp_path):
    p = tmp_path / "ledger.jsonl"
    p.write_text('{"sample_uid": "a", "status": "trained"}\n{"sample_uid": "b", "sta')
    assert [r["sample_uid"] for r in read_ledger(p)] == ["a"]
