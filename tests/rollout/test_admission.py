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
