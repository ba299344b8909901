"""Weight sync to Ray engine actors on every path (``runtime.ray.weight_sync``): object store,
gloo broadcast in buckets, shared memory. One local Ray and two engine actors for the module;
each path gets its own proxies over those actors.

Per path: a new version published while requests run on both actors (policy ``continue``, so
the load lands under running requests) is applied once, after both serve it; tokens after the
boundary carry it, samples started after it see only it; then the actors hold bit-identical
copies of the published tensors, at the published version, and again for a second version.
A short run with ``broadcast``, then ``shared_memory``, trains and its trainer–engine logprob
mismatch stays ~0. Then
a short async run in each placement (runtime/placement.py), on the module's Ray too. Last,
per path, deltas (``runtime.ray.delta``) install the published versions bit for bit."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import replace
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
# The actors' context is the tiny model's whole (max_position_embeddings 512), so that the
# requests a load must land under run ~500 tokens, more than four times the 112 they ran
# when a loaded machine once saw every one end before the broadcast's load landed. Measured
# (2026-12-06, 2-core machine at load average ~10, the path tests alone): the load of
# version 2 landed after 40-65 tokens on broadcast, 1-157 on shared memory, 2 on the object
# store. The groups started after the load run SHORT_TOKENS: the three path tests took
# 2.3-3.0 s instead of 1.4-1.6 s (load average ~4).
MAX_SEQ_LEN = 512
STREAM_TOKENS = MAX_SEQ_LEN - 16  # the prompts of _groups are 6 tokens
SHORT_TOKENS = 32


@pytest.fixture(scope="module")
def actors(tmp_path_factory: pytest.TempPathFactory):
    """Two engine actors on the module's local Ray (0.5 CPU each: a run's actors fit too)."""
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.engines import build_ray_engines

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        owners = build_ray_engines(model, LocalEngineConfig(max_slots=8,
                                                            max_seq_len=MAX_SEQ_LEN,
                                                            threads=1),
                                   num_engines=2, version=0, num_cpus=0.5)
        yield model, owners
    finally:
        cluster.stop()


def _transport(path: str):
    from rollstream.sync.broadcast import Broadcast
    from rollstream.sync.object_store import ObjectStore
    from rollstream.sync.shm import SharedMemory

    if path == "broadcast":  # small buckets: several per version, a tensor above one
        return Broadcast(bucket_bytes=16 << 10)
    if path == "shared_memory":
        return SharedMemory(bucket_bytes=16 << 10)
    return ObjectStore()


def _proxies(owners, transport):
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.sync.broadcast import Broadcast

    engines = [RayEngine(engine_id=o.engine_id, spawn=o._spawn, weights=transport, version=0,
                         max_restarts=0, actor=o.actor) for o in owners]
    if isinstance(transport, Broadcast):
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
    params = SamplingParams(max_new_tokens=STREAM_TOKENS)
    dispatcher = Dispatcher(engines=engines, params=params,
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
    # started after the load: they need no long streams (running ones keep their length)
    dispatcher.set_params(replace(params, max_new_tokens=SHORT_TOKENS))
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
    caplog.set_level(logging.INFO, logger="rollstream.sync")
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
        assert not root.parent.exists() or any(root.parent.iterdir())  # gone unless shared
    if path == "broadcast":
        port = transport._store.port
        transport.close()
        with pytest.raises(ConnectionRefusedError):  # the rendezvous store is gone
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    transport.close()


def _run_config(tmp_path: Path, name: str, *extra: str):
    from rollstream.config import load_config

    return load_config(None, [
        "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.tiny.max_position=64", "model.warm_start.steps=0",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}", f"name={name}",
        "tasks.sources=[{kind: tick, max_items: 8}]", "tasks.num_eval=0",
        "engine.local.max_seq_len=64", "sampling.max_new_tokens=16", "rollout.group_size=4",
        "rollout.filter_zero_variance=false", "train.groups_per_step=2",
        "train.micro_batch_tokens=64", "monitor.progress=false", "runtime.kind=ray",
        "runtime.ray.engine_num_cpus=0.5", *extra])


def _train_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.parametrize("path", ["broadcast"])
def test_a_run_trains_with_engine_weights_equal_to_the_trainer(actors, tmp_path, caplog, path):
    """A 2-step sync run on the module's Ray: step 1 samples with the weights of step 0, sent
    to both actors by broadcast (mismatch ~ 0). Shared memory's weights are checked equal by
    the path test above; a second run for it cost 12 s of suite time for no other property."""
    from rollstream.runtime.train import run_training

    cfg = _run_config(tmp_path, path, "rollout.mode=sync", "train.steps=2",
                      "engine.num_engines=2", f"runtime.ray.weight_sync={path}",
                      f"runtime.ray.bucket_bytes={1 << 20}")
    caplog.set_level(logging.INFO, logger="rollstream.sync")
    summary = run_training(cfg)
    sent = "broadcast to 2 actors" if path == "broadcast" else "bytes written to"
    assert sent in caplog.text and "object store" not in caplog.text
    assert summary["steps"] == 2 and summary["trained_samples"] == 16, summary
    metrics = _train_metrics(tmp_path / path)
    steps = [m for m in metrics if m["kind"] == "train"]
    assert all(m["num_tokens"] > 0 for m in steps)
    assert steps[1]["mismatch"] < 1e-4, steps[1]  # engine weights == trainer weights (v1)
    assert any("sync_s" in m for m in metrics)


def _spy_steps(monkeypatch, probe):
    """Call ``probe(proxies)`` on the trainer's thread as each step starts and ends."""
    from rollstream.runtime.ray import engines
    from rollstream.train.trainer import Trainer

    proxies: list = []
    build, step = engines.build_ray_engines, Trainer.step

    def spy_build(*args, **kwargs):
        proxies.extend(built := build(*args, **kwargs))
        return built

    def spy_step(self, groups, step_index):
        probe(proxies)
        out = step(self, groups, step_index)
        probe(proxies)
        return out

    monkeypatch.setattr(engines, "build_ray_engines", spy_build)
    monkeypatch.setattr(Trainer, "step", spy_step)


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_a_run_in_each_placement_trains_where_it_should(actors, tmp_path, monkeypatch,
                                                        placement):
    """3 async steps (staleness 1, partial rollout), one engine actor: ``disaggregated`` runs
    the engine's step thread and the trainer's on the cores split_cores gives them;
    ``colocated`` has no request running on the engine while the trainer steps (async
    generation would otherwise overlap it)."""
    import os

    import ray

    from rollstream.runtime.placement import split_cores
    from rollstream.runtime.train import run_training

    seen: list = []

    def probe(proxies):
        actor = proxies[0].actor
        seen.append((sorted(os.sched_getaffinity(0)), ray.get(actor.cpu_affinity.remote()),
                     ray.get(actor.stats.remote()).num_running))

    _spy_steps(monkeypatch, probe)
    cfg = _run_config(tmp_path, placement, "rollout.mode=async",
                      "rollout.staleness.max_staleness=1", "train.steps=3", "engine.num_engines=1",
                      f"runtime.ray.placement={placement}")
    summary = run_training(cfg)
    assert summary["steps"] == 3 and summary["trained_samples"] == 24, summary
    assert not summary["unfinished_samples"]
    assert len(seen) == 6
    if placement == "disaggregated":
        engine_cores, trainer_cores = split_cores(os.sched_getaffinity(0))
        for trainer, threads, _ in seen[1:]:  # the trainer pins itself inside its 1st step
            assert trainer == list(trainer_cores)
            step_threads = [c for name, c in threads.items()
                            if name.startswith("rollstream-ray-")]
            assert step_threads and all(c == list(engine_cores) for c in step_threads), threads
    else:
        assert [running for _, _, running in seen] == [0] * 6


def test_broadcast_goes_on_when_a_member_dies(actors, caplog):
    """A second actor beside ray-0 joins the broadcast group and is killed: the next sync installs
    the version in the live actor (the broadcast, or the object store when the broadcast
    failed) and fails only the dead one's load; the sync after it forms a group of the live
    actor alone. Last in the module: it leaves the killed actor's CPUs free."""
    import ray

    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.sync.broadcast import Broadcast

    caplog.set_level(logging.INFO, logger="rollstream.sync")
    model, owners = actors
    transport = Broadcast(bucket_bytes=16 << 10, timeout_s=5)  # the stall it bounds
    victim_actor = owners[1]._spawn(0)
    engines = [RayEngine(engine_id=owners[0].engine_id, spawn=owners[0]._spawn,
                         weights=transport, version=0, max_restarts=0, actor=owners[0].actor),
               RayEngine(engine_id="victim", spawn=owners[1]._spawn, weights=transport,
                         version=0, max_restarts=0, actor=victim_actor)]
    transport.members = lambda: {e.engine_id: a for e in engines
                                 if (a := e.live_actor()) is not None}

    async def main():
        v1 = _perturbed(model, 1)  # one dict for every engine, as weight sync hands them
        await asyncio.gather(*(e.load_weights(1, v1) for e in engines))
        assert "broadcast to 2 actors" in caplog.text
        ray.kill(victim_actor, no_restart=True)
        v2 = _perturbed(model, 2)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(e.load_weights(2, v2) for e in engines),
                                   return_exceptions=True)
        assert time.perf_counter() - t0 < transport.timeout_s + 15  # stalled at most that
        assert out[0] is None and isinstance(out[1], RuntimeError), out
        assert engines[1].live_actor() is None
        v3 = _perturbed(model, 3)
        await engines[0].load_weights(3, v3)  # weight sync loads the live engines only
        assert "broadcast to 1 actors" in caplog.text
        served = await engines[0].actor.state_dict.remote()
        assert all(torch.equal(served[k], t) for k, t in v3.items())

    asyncio.run(asyncio.wait_for(main(), 120))
    transport.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_delta_crosses_each_path_into_the_full_versions_bits(actors, path):
    """Delta sync (``sync/delta.py``, ``runtime.ray.delta: auto``) over each path to both
    actors: the first version goes full, the next two as deltas (a few elements moved, one
    tensor wholly), and the actors then hold the published tensors bit for bit."""
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.sync.broadcast import Broadcast
    from rollstream.sync.delta import DeltaSync

    model, owners = actors
    inner = _transport(path)
    sync = DeltaSync(inner, dtype="float32", name=path)
    engines = [RayEngine(engine_id=o.engine_id, spawn=o._spawn, weights=sync, version=0,
                         max_restarts=0, actor=o.actor) for o in owners]
    if isinstance(inner, Broadcast):
        inner.members = lambda: {e.engine_id: e.actor for e in engines}
    v1 = _perturbed(model, 7)
    first, last = next(iter(v1)), list(v1)[-1]
    v2 = {**v1, first: v1[first].clone(), last: v1[last] + 1}  # `last` moves wholly
    v2[first].view(-1)[:5] += 1
    v3 = {**v2, first: v2[first].clone()}
    v3[first].view(-1)[-3:] -= 1

    async def main() -> list[dict[str, torch.Tensor]]:
        for version, tensors in ((101, v1), (102, v2), (103, v3)):
            await asyncio.gather(*(e.load_weights(version, tensors) for e in engines))
        return [await e.actor.state_dict.remote() for e in engines]

    try:
        served = asyncio.run(main())
    finally:
        sync.close()
    assert [(r.version, r.kind) for r in sync.records] == \
        [(101, "full")] * 2 + [(102, "delta")] * 2 + [(103, "delta")] * 2
    assert all(r.num_bytes < 100 * 8 + v1[last].numel() * 4 for r in list(sync.records)[2:])
    work = engines[0].stats().work  # the proxy reports its loads
    assert (work["weight_loads_full"], work["weight_loads_delta"]) == (1.0, 2.0)
    for state in served:
        for name, t in v3.items():
            assert torch.equal(state[name].view(torch.int32), t.view(torch.int32)), name


def test_auto_gives_each_actor_the_transport_of_its_node(actors):
    """``weight_sync: auto`` (``sync/per_node.py``): actors on the driver's node read each
    version from shared memory, actors on another node get it through the object store and
    nothing is written to shared memory for them; each proxy reports the transport of its
    actor's node, and the delta sync's records name it. The module's actors run on this one
    node, so the other-node case is the same actors seen by a transport whose own node is
    another one (the choice is the destination's node id against the transport's)."""
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.nodes import this_node
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.runtime.ray.transport import build_transport
    from rollstream.sync.per_node import PerNode

    model, owners = actors
    here = this_node().node_id
    tensors = _perturbed(model, 11)
    for node, want in ((here, "shared_memory"), ("f" * len(here), "object_store")):
        sync = build_transport(RayConfig(weight_sync="auto"), "float32")
        per_node = sync.inner
        assert isinstance(per_node, PerNode) and per_node.here == here
        per_node.here = node  # as a transport on that node would see these actors
        engines = [RayEngine(engine_id=o.engine_id, spawn=o._spawn, weights=sync, version=0,
                             max_restarts=0, actor=o.actor) for o in owners]

        async def main(engines=engines) -> list[dict[str, torch.Tensor]]:
            await asyncio.gather(*(e.load_weights(201, tensors) for e in engines))
            return [await e.actor.state_dict.remote() for e in engines]

        try:
            served = asyncio.run(main())
            written = per_node.near.store.latest
            assert [e.weight_transport for e in engines] == [want] * 2
            assert {r.transport for r in sync.records} == {want}
            assert (written is not None) == (want == "shared_memory"), written
            for state in served:
                assert all(torch.equal(state[k], t) for k, t in tensors.items())
        finally:
            sync.close()
        assert not per_node.near.store.root.exists()
