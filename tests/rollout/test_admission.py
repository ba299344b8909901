import asyncio

import pytest

from rollstream.rollout.admission import StalenessCapacity


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


def test_admission_wakes_on_version():
    async def main():
        cap = StalenessCapacity(groups_per_step=1, max_staleness=0)
        cap.admit(1)
        assert cap.room() == 0
        waiter = asyncio.create_task(cap.wait_changed())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        cap.set_version(1)
        await asyncio.wait_for(waiter, 1)
        assert cap.room() == 1

    asyncio.run(main())


def test_blocked_time_counts_waits_at_the_staleness_limit_only():
    async def wait(cap: StalenessCapacity, s: float, wake=None) -> float:
        waiter = asyncio.create_task(cap.wait_changed())
        await asyncio.sleep(s)
        (wake or cap.wake)()
        await asyncio.wait_for(waiter, 1)
        return cap.blocked_s

    async def main():
        cap = StalenessCapacity(groups_per_step=2, max_staleness=0, total_groups=4)
        assert await wait(cap, 0.05) == 0.0  # room left: waiting for a task, not blocked
        cap.admit(2)
        assert cap.staleness_full
        blocked = await wait(cap, 0.05, wake=lambda: cap.set_version(1))
        assert 0.04 <= blocked < 0.5
        cap.admit(2)  # the run's total: admission is over, not blocked by staleness
        assert cap.room() == 0 and not cap.staleness_full
        assert await wait(cap, 0.05) == blocked

    asyncio.run(main())
