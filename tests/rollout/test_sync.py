"""The weight-sync ordering contract (sync/weights.py), directly: two engines, each policy.

A new version is published while requests run on both engines; then new samples start.
Checked per policy: ``interrupt`` stops in-flight requests before the load (nothing runs
while weights change) and resumes them, so their later tokens carry the new version;
``continue`` loads while requests run, and tokens after the boundary carry it; ``drain``
lets in-flight samples finish on the old weights, loading only when nothing runs. Always:
``on_applied`` runs once, after every engine serves the new version, and a sample started
after it never sees the old one. Engines are doubles at the process edge; dispatcher,
lifecycle, graders and WeightSync are real.
"""

from __future__ import annotations

import asyncio

import pytest

from rollstream.clock import WallClock
from rollstream.config import RewardConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import Group, SampleStatus, Task

from .fakes import RandomEngine


async def _reward(task: Task, text: str) -> float:  # async: graded in the loop, no worker
    return 1.0


def _groups(start: int, n: int) -> list[Group]:
    return [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(1, 2, 3, 4), prompt_text="",
                           reference=""), 2) for i in range(start, start + n)]


async def _scenario(policy: str):
    engines = [RandomEngine(1, "a", max_delay_s=0.004, max_len=80),
               RandomEngine(2, "b", max_delay_s=0.004, max_len=80)]
    reward = get_reward(_reward)
    graders = GraderPool(RewardConfig(), lambda task: reward)
    dispatcher = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=80),
                            graders=graders, decode=lambda ids: "", clock=WallClock(),
                            lifecycle=Lifecycle(Ledger(), WallClock()))
    applied: list[tuple[int, list[int]]] = []

    def on_applied(version: int, sync_s: float) -> None:
        applied.append((version, [e.stats().version for e in engines]))

    sync = WeightSync(engines, dispatcher, policy, on_applied)  # type: ignore[arg-type]
    loop = asyncio.create_task(sync.run())
    old = _groups(0, 6)
    running = [asyncio.create_task(dispatcher.run_group(g)) for g in old]
    while sum(len(e._running) for e in engines) < 8:  # requests in flight on both engines
        await asyncio.sleep(0.002)
    assert all(e._running for e in engines)
    sync.publish(1, {})
    await sync.wait_applied()
    new = _groups(10, 4)
    running += [asyncio.create_task(dispatcher.run_group(g)) for g in new]
    await asyncio.gather(*running)
    loop.cancel()
    graders.close()
    return engines, applied, old, new


@pytest.mark.parametrize("policy", ["interrupt", "continue", "drain"])
def test_ordering_contract_with_two_engines(policy):
    engines, applied, old, new = asyncio.run(_scenario(policy))
    assert applied == [(1, [1, 1])]  # once, after every engine serves version 1
    for e in engines:
        assert [v for v, _ in e.loads] == [1]
    old_samples = [s for g in old for s in g.samples]
    assert all(s.status is SampleStatus.GRADED for g in old + new for s in g.samples)
    for s in old_samples:
        assert s.versions == sorted(s.versions), "versions never go back within a sample"
    for s in (s for g in new for s in g.samples):
        assert set(s.versions) == {1}, "started after on_applied: only the new weights"
    spanning = [s for s in old_samples if set(s.versions) == {0, 1}]
    running_at_load = [n for e in engines for _, n in e.loads]
    if policy == "interrupt":
        assert running_at_load == [0, 0]  # stopped at a token boundary before the load
        assert spanning and all(s.num_interrupts >= 1 for s in spanning)
    elif policy == "continue":
        assert any(running_at_load)  # loaded under running requests
        assert spanning and not any(s.num_interrupts for s in old_samples)
    else:  # drain
        assert running_at_load == [0, 0]
        assert not spanning and all(set(s.versions) == {0} for s in old_samples)
