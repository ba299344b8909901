"""An engine actor that joins a live Ray run and leaves it: ``rollstream engines RUN --add 1``
starts an actor (outside the run's scale units) that serves the current version from its first
request; ``--remove`` drains it, kills the actor and gives its CPU back to Ray; the ledger
audit finds nothing lost or duplicated."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

import pytest

import rollstream
from rollstream.durable.audit import audit_run
from rollstream.run_files import DASHBOARD_URL
from tests.runtime.test_fleet import _catch, _cli, _rows, _spans, _until
from tests.security.conftest import small

pytestmark = pytest.mark.ray
STEPS, GROUPS, GROUP = 16, 4, 4
HOLDS = {2: "added", 8: "removed"}  # the run waits after these steps until the operator did it


@pytest.fixture(autouse=True)
def _no_ray_up() -> None:
    import ray

    assert not ray.is_initialized(), "another test's Ray is still up: the run would join it"


def _cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def _operate(run_dir: Path, seen: dict) -> None:
    import ray

    _until(lambda: (run_dir / DASHBOARD_URL).exists(), 300)
    _until(lambda: int(_rows(run_dir)["ray-0"][3]) >= 1, 300)
    seen["cpus_before"] = _cpus()
    seen["add"] = _cli("engines", str(run_dir), "--add", "1")
    with contextlib.suppress(AssertionError):  # Ray's resource view follows the start
        _until(lambda: _cpus() <= seen["cpus_before"] - 1, 30)
    seen["cpus_joined"] = _cpus()
    seen["rows_after_add"] = _rows(run_dir)
    actor = seen["fleets"][0].dispatcher.router.by_id["ray-1"].actor
    seen["added"].set()
    _until(lambda: any(s["engine_id"] == "ray-1" for s in _spans(run_dir)), 120)
    seen["remove"] = _cli("engines", str(run_dir), "--remove", "ray-1")
    seen["rows_after_remove"] = _rows(run_dir)
    seen["removed"].set()
    with contextlib.suppress(AssertionError):  # its CPU goes back as the actor ends
        _until(lambda: _cpus() >= seen["cpus_before"], 30)
    seen["cpus_left"] = _cpus()
    try:  # a killed actor answers nothing
        ray.get(actor.stats.remote(), timeout=30)
        seen["actor_dead"] = False
    except ray.exceptions.RayActorError:
        seen["actor_dead"] = True


def test_an_engine_actor_joins_and_leaves_a_live_ray_run(tmp_path: Path, kit_model: Path,
                                                          monkeypatch) -> None:
    from rollstream.runtime import fleet as fleet_module
    from rollstream.runtime import steps as steps_module

    run_dir = tmp_path / "r"
    seen: dict = {"fleets": [], "added": threading.Event(), "removed": threading.Event()}
    real_init, real_after = fleet_module.Fleet.__init__, steps_module.BetweenSteps.__call__

    def spy_init(self, **kwargs):  # the run's fleet, to hold the joined actor's handle
        real_init(self, **kwargs)
        seen["fleets"].append(self)

    async def holding(self, step, values):  # the run goes on once the operator acted
        await real_after(self, step, values)
        if step in HOLDS:
            await asyncio.to_thread(seen[HOLDS[step]].wait, 120)

    monkeypatch.setattr(fleet_module.Fleet, "__init__", spy_init)
    monkeypatch.setattr(steps_module.BetweenSteps, "__call__", holding)
    def operate() -> None:
        seen["error"] = _catch(_operate, run_dir, seen)
        seen["added"].set()  # a failed operation holds the run no longer
        seen["removed"].set()

    op = threading.Thread(target=operate, daemon=True)
    op.start()
    summary = rollstream.run(None, small(
        tmp_path, kit_model, "monitor.dashboard=true", "runtime.kind=ray",
        "runtime.ray.num_cpus=3", f"runtime.ray.object_store_bytes={100 << 20}",
        "engine.num_engines=1", f"train.steps={STEPS}", "train.checkpoint_every=0",
        "sampling.max_new_tokens=24", f"train.groups_per_step={GROUPS}",
        f"rollout.group_size={GROUP}"))
    op.join(timeout=60)
    assert seen.get("error") is None, seen.get("error")
    assert summary["steps"] == STEPS

    rc, out = seen["add"]
    assert rc == 0 and "added ray-1" in out, out
    assert seen["cpus_joined"] == seen["cpus_before"] - 1, "the actor holds one CPU"
    rows = seen["rows_after_add"]
    joined_at = int(rows["ray-1"][3])
    assert rows["ray-1"][5] == "serving" and joined_at == int(rows["ray-0"][3]) >= 1
    first = min((s for s in _spans(run_dir) if s["engine_id"] == "ray-1"),
                key=lambda s: s["t_start_s"])
    assert first["num_tokens"] > 0 and first["version_start"] >= joined_at, first

    rc, out = seen["remove"]
    assert rc == 0 and "removed ray-1" in out, out
    assert "ray-1" not in seen["rows_after_remove"]
    assert seen["actor_dead"], "the removed engine's actor was killed"
    assert seen["cpus_left"] == seen["cpus_before"], "its CPU went back to Ray"

    audit = audit_run(run_dir, group_size=GROUP, eval_group_size=1, groups_per_step=GROUPS,
                      steps=STEPS)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
    assert audit["steps_missing"] == audit["steps_repeated"] == 0, audit
