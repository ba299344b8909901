"""``runtime.kind: ray`` with ``train.backend: fsdp``: the trainer's ranks are Ray actors in
the run's scale unit, next to its engine actor. A rank actor killed (``ray.kill``) after the
step-2 checkpoint loses its step; the same command resumes from that checkpoint, as with
rank processes (tests/train/test_fsdp.py), every sample recorded once. The rank actors run
pinned to the trainer's core of ``placement: disaggregated``. Both runs join the test's Ray
(the run gives its scale unit back at the end, or the resume could not reserve it); nothing
of Ray is left after.
(The transport itself, loss and weights against the local trainer, errors and cleanup:
``tests/train/test_fsdp.py::test_driver_trains_syncs_and_cleans_up[ray]``.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from rollstream.config import load_config
from rollstream.runtime.placement import split_cores
from rollstream.runtime.ray.cluster import RayCluster
from rollstream.runtime.train import run_training
from tests.runtime.test_ray import _descendants
from tests.train.fsdp_runs import assert_resumed_whole, tiny_fsdp_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _allowed_cores(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list")).split()[-1]


def test_a_killed_rank_actor_loses_its_step_and_the_run_resumes_from_its_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rollstream.runtime.ray import ranks as ray_ranks

    assert not ray.is_initialized()
    before = _descendants()
    cfg = load_config(None, tiny_fsdp_run(tmp_path, "kill", mode="async", steps=3, extra=(
        "train.checkpoint_every=2", "monitor.report=false", "runtime.kind=ray",
        "runtime.ray.num_cpus=2", f"runtime.ray.object_store_bytes={100 << 20}",
        "runtime.ray.rank_num_cpus=0.5", "runtime.ray.engine_num_cpus=1",
        "runtime.ray.placement=disaggregated")))
    trainer_cores = ",".join(map(str, split_cores(sorted(os.sched_getaffinity(0)))[1]))
    run_dir = tmp_path / "kill"
    launched: list = []
    init = ray_ranks.RayRanks.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        launched.append(self)

    monkeypatch.setattr(ray_ranks.RayRanks, "__init__", spy)
    killed: list[dict] = []
    failures: list[BaseException] = []

    def kill_rank_1() -> None:  # once the step-2 checkpoint is whole
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not killed:
                if (run_dir / "checkpoints" / "step_000002" / "state.json").exists():
                    actor = launched[0].actors[1]
                    where = ray.get(actor.placement.remote())
                    where["cores"] = _allowed_cores(where["pid"])
                    ray.kill(actor, no_restart=True)
                    killed.append(where)
                time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failures.append(e)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    # The test's own Ray, which both runs (the lost one and its resume) join: so each run
    # must give its scale unit back (the unit holds both CPUs), and Ray starts once.
    cluster = RayCluster.start(cfg.runtime.ray)
    try:
        t0 = time.monotonic()
        summary = run_training(cfg)
        print(f"both runs: {time.monotonic() - t0:.1f} s")
        deadline = time.monotonic() + 10  # Ray frees a removed placement group shortly after
        while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.available_resources().get("CPU") == 2  # the unit was given back
    finally:
        cluster.stop()
    killer.join()
    assert not failures, failures
    assert killed and summary["trainer_restarts"] == 1, summary
    assert len(launched) == 2  # the ranks of the lost process, then those of the resume
    assert killed[0]["placement_group"] is not None  # in the run's scale unit
    assert killed[0]["cores"] == trainer_cores, killed  # disaggregated: the trainer's core
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 2, summary
    assert_resumed_whole(run_dir, 3)
    assert _descendants() - before == set(), "a Ray process outlived the run"
