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

from rollstream.trajectory import SampleStatus

from .fakes import TwoEngineSync, task_groups


async def _scenario(policy: str):
    applied: list[tuple[int, list[int]]] = []

    def on_applied(version: int, sync_s: float) -> None:
        applied.append((version, [e.stats().version for e in scene.engines]))

    scene = TwoEngineSync(policy, max_len=80, on_applied=on_applied)
    async with scene:
        old = task_groups(0, 6)
        running = [asyncio.create_task(scene.dispatcher.run_group(g)) for g in old]
        # requests in flight on both engines, with tokens of the old version (a request
        # interrupted before its first token would span nothing)
        await scene.until_running(8, num_tokens=16)
        assert all(e._running for e in scene.engines)
        scene.sync.publish(1, {})
        await scene.sync.wait_applied()
        new = task_groups(10, 4)
        running += [asyncio.create_task(scene.dispatcher.run_group(g)) for g in new]
        await asyncio.gather(*running)
    return scene.engines, applied, old, new


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
