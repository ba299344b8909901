"""Weight sync to Ray engine actors on every path (``runtime.ray.weight_sync``): object store,
gloo broadcast in buckets, shared memory. One local Ray and two engine actors for the module;
each path gets its own proxies over those actors.

Per path: a new version published while requests run on both actors (policy ``continue``, so
the load lands under running requests) is applied once, after both serve it; tokens after the
boundary carry it, samples started after it see only it; then the actors hold bit-identical
copies of the published tensors, at the published version, and again for a second version.
A short run with ``broadcast`` trains and its trainer–engine logprob mismatch stays ~0."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path

import pytest
import torch

from rollstream.clock import WallClock
from rollstream.config import RewardConfig
from rollstream.config.schema import LocalEngineConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import Group, SampleStatus, Task
from tests.engine.helpers import make_tiny_model

pytestmark = pytest.mark.ray
PATHS = ["object_store", "broadcast", "shared_memory"]


@pytest.fixture(scope="module")
def actors(tmp_path_factory: pytest.TempPathFactory):
    """Two engine actors on the module's local Ray (0.5 CPU each: a run's actors fit too)."""
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.engines import build_ray_engines

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        owners = build_ray_engines(model, LocalEngineConfig(max_slots=8, max_seq_len=128,
                                                            threads=1),
                                   num_engines=2, version=0, num_cpus=0.5)
        yield model, owners
    finally:
        cluster.stop()


def _transport(path: str):
    from rollstream.runtime.ray import weights

    if path == "broadcast":  # small buckets: several per version, a tensor above one
        return weights.BroadcastWeights(bucket_bytes=16 << 10)
    if path == "shared_memory":
        return weights.SharedMemoryWeights(bucket_bytes=16 << 10)
    return weights.ObjectStoreWeights()


def _proxies(owners, transport):
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.runtime.ray.weights import BroadcastWeights

    engines = [RayEngine(engine_id=o.engine_id, spawn=o._spawn, weights=transport, version=0,
                         max_restarts=0, actor=o.actor) for o in owners]
    if isinstance(transport, BroadcastWeights):
        transport.members = lambda: {e.engine_id: e.actor for e in engines}
    return engines


def _groups(start: int, n: int) -> list[Group]:
    return [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=tuple(range(3 + i, 9 + i)),
                           prompt_text="", reference=""), 2) for i in range(start, start + n)]


async def _one(task: Task, text: str) -> float:
    return 1.0


def _perturbed(model: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in load_file(model / "model.safetensors").items()}


async def _sync_under_load(engines, model: Path) -> None:
    reward = get_reward(_one)
    graders = GraderPool(RewardConfig(), lambda task: reward)
    dispatcher = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=112),
                            graders=graders, decode=lambda ids: "", clock=WallClock(),
                            lifecycle=Lifecycle(Ledger(), WallClock()))
    applied: list[tuple[int, list[int]]] = []
    sync = WeightSync(engines, dispatcher, "continue",
                      lambda v, s: applied.append((v, [e.stats().version for e in engines])))
    loop = asyncio.create_task(sync.run())

    async def publish(version: int) -> None:
        published = _perturbed(model, version)
        sync.publish(version, published)
        await sync.wait_applied()
        assert applied[-1] == (version, [version, version])  # once, after both serve it
        for e in engines:  # bit-identical copies of what was published
            served = await e.actor.state_dict.remote()
            for name, t in published.items():
                assert torch.equal(served[name], t), (e.engine_id, name)

    await publish(1)  # idle engines (the broadcast group forms here)
    old = _groups(0, 4)
    running = [asyncio.create_task(dispatcher.run_group(g)) for g in old]
    while not all(e.stats().num_running for e in engines):  # as the actors report it
        await asyncio.sleep(0.01)
    await publish(2)  # under running requests
    new = _groups(10, 2)
    running += [asyncio.create_task(dispatcher.run_group(g)) for g in new]
    await asyncio.gather(*running)
    loop.cancel()
    graders.close()
    assert [v for v, _ in applied] == [1, 2]
    assert all(s.status is SampleStatus.GRADED for g in old + new for s in g.samples)
    old_samples = [s for g in old for s in g.samples]
    assert all(s.versions == sorted(s.versions) for s in old_samples)
    assert all(set(s.versions) <= {1, 2} for s in old_samples)
    assert any(set(s.versions) == {1, 2} for s in old_samples), "loaded under running requests"
    assert all(set(s.versions) == {2} for g in new for s in g.samples)


@pytest.mark.parametrize("path", PATHS)
def test_a_path_delivers_identical_weights_at_the_version_under_the_contract(actors, path,
                                                                           caplog):
    caplog.set_level(logging.INFO, logger="rollstream.runtime.ray.weights")
    model, owners = actors
    transport = _transport(path)
    engines = _proxies(owners, transport)
    asyncio.run(_sync_under_load(engines, model))
    assert "through the object store" not in caplog.text  # no fallback
    if path == "broadcast":
        assert caplog.text.count("broadcast to 2 actors") == 2, caplog.text
    if path == "shared_memory":
        root = transport.store.root
        assert [p.name for p in root.iterdir()] == [transport.store.latest.path.name]
        transport.close()
        assert not root.exists(), "shared memory left behind"
    if path == "broadcast":
        port = transport._store.port
        transport.close()
        with pytest.raises(ConnectionRefusedError):  # the rendezvous store is gone
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    transport.close()


def test_a_run_with_broadcast_trains_with_engine_weights_equal_to_the_trainer(actors, tmp_path,
                                                                             caplog):
    """A 2-step sync run on the module's Ray with ``weight_sync: broadcast``: step 1 samples
    with the weights of step 0, broadcast to both actors (mismatch ~ 0)."""
    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    cfg = load_config(None, [
        "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.tiny.max_position=64", "model.warm_start.steps=0",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}", "name=bcast",
        "tasks.sources=[{kind: tick, max_items: 4}]", "tasks.num_eval=0",
        "engine.local.max_seq_len=64", "sampling.max_new_tokens=16", "rollout.mode=sync",
        "rollout.group_size=4", "rollout.filter_zero_variance=false", "train.steps=2",
        "train.groups_per_step=2", "train.micro_batch_tokens=64", "monitor.progress=false",
        "runtime.kind=ray", "engine.num_engines=2", "runtime.ray.engine_num_cpus=0.5",
        "runtime.ray.weight_sync=broadcast", f"runtime.ray.bucket_bytes={1 << 20}"])
    caplog.set_level(logging.INFO, logger="rollstream.runtime.ray.weights")
    summary = run_training(cfg)
    assert "broadcast to 2 actors" in caplog.text and "object store" not in caplog.text
    assert summary["steps"] == 2 and summary["trained_samples"] == 16, summary
    metrics = [json.loads(line) for line in (tmp_path / "bcast" / "metrics.jsonl").open()]
    steps = [m for m in metrics if m["kind"] == "train"]
    assert all(m["num_tokens"] > 0 for m in steps)
    assert steps[1]["mismatch"] < 1e-4, steps[1]  # engine weights == trainer weights (v1)
    assert any("sync_s" in m for m in metrics)
