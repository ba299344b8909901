"""vLLM engines on ``runtime.kind: ray``: each engine's server is launched by a Ray actor.

    driver (this process)                          server actor (Ray places it, in the
    ---------------------                          engine's scale unit, engine_num_cpus)
    VllmEngine: streams, interrupts,  -- HTTP -->  vLLM API server, EngineCore, worker
      weight reloads, health watch                 (a process group the actor launched)
    ActorServer: start / alive / stop -- Ray  -->  ServerActor: VllmServer.start, poll, stop
      (a server on another node: the HTTP      --> ServerActor.relay --> the server's
       too, through its actor)                     127.0.0.1

The engine is the embedded runtime's :class:`~rollstream.engine.vllm.VllmEngine`, unchanged:
only who launches its server differs (:class:`ActorServer` stands in for the process handle,
``ServerProcess``). So everything the vLLM engine guarantees holds here too: exact version
boundaries of a reload (pause, reload in place, resume), partial outputs of streams a fault
cut, restart and weight restore. A dead actor (``ray.kill``, its process or node gone) is a
dead server: the engine's health watch sees it within a poll, cuts the streams, and its
restart launches a new actor, which serves the latest synced weights.

Data plane: a server binds 127.0.0.1 only (servers here never listen on the network). The
driver streams from a server on its own node over that loopback; a server on another node
it reaches through the server's actor, which makes each HTTP request to its server and
streams the answer back as a Ray streaming generator (``relay.py``): tokens, aborts, pauses,
reloads and health probes alike. Weights reach a server on the driver's node as they do
embedded: safetensors buckets in this host's ``/dev/shm`` that the server's worker reloads in
place. With ``runtime.ray.weight_sync: auto`` a server may run on another node: its actor
takes each version from Ray's object store and writes the buckets to its own node's shared
memory for the reload (``vllm_weights.py``). A server placed on another node without
``weight_sync: auto`` is refused with that reason (it would read the driver's shared memory).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.engine.vllm.server import (
    SHM_PATTERN,
    VllmServer,
    VllmServerError,
    remove_orphaned_segments,
    stop_group,
)
from rollstream.run_files import RunFiles
from rollstream.runtime.nodes import Node, this_node
from rollstream.runtime.ray.relay import NodeTransport, relay, relay_client
from rollstream.runtime.ray.vllm_weights import NodeStore, NodeWeights

if TYPE_CHECKING:
    import httpx

    from rollstream.config.schema import EngineConfig, RunConfig
    from rollstream.engine.vllm import VllmEngine
    from rollstream.runtime.ray.units import ScaleUnits
    from rollstream.sync.protocol import Payload
    from rollstream.sync.shm import WeightStore, WrittenWeights

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # an actor's stop: the server's grace period and then some
RELAY_CONCURRENCY = 4096  # an actor's calls at once: the engine client's connections
LOG_TAIL_TIMEOUT_S = 10.0


class ServerActor:
    """Launches one vLLM server on its node, carries the driver's HTTP to it when the driver
    is on another node (``relay.py``), and stops it. An asyncio actor: relayed streams wait
    on the server without holding a thread each, and blocking work runs on threads. The
    launch runs on a thread that lives as long as the server: the server's PDEATHSIG is tied
    to the launching thread, so a killed actor takes its server down (``server.py``)."""

    def __init__(self, spec: VllmServer) -> None:
        self.server = spec
        self._done = threading.Event()
        self._weights: NodeStore | None = None  # this node's copies (a server elsewhere)
        self._http: httpx.AsyncClient | None = None  # relay's, made on the actor's loop

    async def start(self) -> tuple[str, Node, int]:
        """The server's URL, this actor's node, the server's process group."""
        started, failed = threading.Event(), []

        def launch() -> None:
            try:
                self.server.start()
            except BaseException as e:  # raised to the caller below
                failed.append(e)
                return
            finally:
                started.set()
            self._done.wait()

        threading.Thread(target=launch, daemon=True, name="vllm-launch").start()
        await asyncio.to_thread(started.wait)
        if failed:
            raise failed[0]
        assert self.server.proc is not None
        return self.server.url, this_node(), self.server.proc.pid

    async def relay(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                    timeout: dict[str, float | None]) -> AsyncIterator[Any]:
        """One HTTP request of the driver's to this node's server (``relay.py``)."""
        if self._http is None:
            self._http = relay_client()
        async for item in relay(self._http, self.server.url, method, path, headers, body,
                                timeout):
            yield item

    async def write_weights(self, payload: Payload) -> WrittenWeights:
        """Write a version to this node's shared memory, for the server's reload."""
        if self._weights is None:
            self._weights = NodeStore()
        return await asyncio.to_thread(self._weights.write, payload)

    async def prune_weights(self) -> None:
        if self._weights is not None:
            await asyncio.to_thread(self._weights.prune)

    async def wait_ready(self, timeout_s: float) -> None:
        await self.server.wait_ready(timeout_s)

    async def exit_code(self) -> int | None:
        """None while the server runs; its exit code once it exited."""
        proc = self.server.proc
        return None if proc is None else proc.poll()

    async def log_tail(self, num_lines: int) -> str:
        return self.server.log_tail(num_lines)

    async def stop(self, grace_s: float) -> None:
        await asyncio.to_thread(self.server.stop, grace_s)
        if self._http is not None:
            await self._http.aclose()
        if self._weights is not None:
            self._weights.clear()
        self._done.set()


class ActorServer:
    """The driver's handle of a server an actor launched (``ServerProcess``). Each
    :meth:`start` (the first, and the engine's restarts) spawns a fresh actor reserving
    ``num_cpus``, placed by ``strategy`` (its scale unit's bundle; None: where Ray likes).
    ``per_node`` (``weight_sync: auto``): the actor may run on another node, which then
    writes the weights (:meth:`weights`) and carries the engine's HTTP (:meth:`transport`)."""

    launched = True

    def __init__(self, spec: VllmServer, *, num_cpus: float, strategy: Any,
                 per_node: bool = False) -> None:
        import ray

        self.spec = spec
        self._remote = ray.remote(ServerActor).options(
            num_cpus=num_cpus, max_concurrency=RELAY_CONCURRENCY, scheduling_strategy=strategy)
        self.per_node = per_node
        self.url = ""
        self._node: Node | None = None  # where the current actor runs
        self.actor: Any = None
        self._pgid = 0
        self._shm_before: frozenset[str] = frozenset()
        self._probe: Any = None  # an exit_code call in flight
        self._exit: str | None = None  # why the server is gone (None: it runs)

    def start(self) -> None:
        import ray

        self._shm_before = frozenset(glob.glob(SHM_PATTERN))
        self._exit, self._probe = None, None
        self.actor = self._remote.remote(self.spec)
        try:
            self.url, self._node, self._pgid = ray.get(self.actor.start.remote())
        except BaseException:
            self.stop()
            raise
        if (why := self._elsewhere()) is not None:
            self.stop()
            raise VllmServerError(f"Ray placed the vLLM server of {self.spec.log_path} on "
                                  f"another node ({self.node_id}, {self._node.address}): {why}")
        log.info("vllm server of %s on node %s (%s): streams by %s", self.spec.log_path,
                 self.node_id, self._node.address, self.streams)

    @property
    def node_id(self) -> str:
        """Ray's id of the node the current actor runs on ("" before the first start)."""
        return "" if self._node is None else self._node.node_id

    def node(self) -> Node:
        """The node its server runs on (``runtime/nodes.py``'s ``Placed``): the last actor's,
        the driver's before the first start."""
        return self._node or this_node()

    @property
    def near(self) -> bool:
        """Whether the current actor (the last one) runs on the driver's node: what decides
        both the weights' path (``vllm_weights.py``) and the HTTP's (``relay.py``)."""
        import ray

        return self.node_id == ray.get_runtime_context().get_node_id()

    def _elsewhere(self) -> str | None:
        """Why the server cannot serve from the node its actor runs on (None: it can)."""
        if self.near or self.per_node:
            return None
        return ("it would read weights from this node's shared memory; set "
                "runtime.ray.weight_sync: auto to have its actor write them on its node")

    @property
    def streams(self) -> str:
        """How the engine's HTTP reaches the server: ``loopback`` (the driver's node) or
        ``actor`` (another node: through the server's actor, ``relay.py``)."""
        return "loopback" if self.near else "actor"

    def transport(self, direct: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        """The engine's HTTP transport: ``direct`` to a server on this node, through the
        server's current actor to one on another node (chosen at each request)."""
        return NodeTransport(lambda: None if self.actor is None or self.near else self.actor,
                             direct)

    def weights(self, local: WeightStore) -> NodeWeights:
        """The engine's weight store: ``local`` (the driver's) while the server runs on this
        node, its actor's node's shared memory otherwise (``vllm_weights.py``)."""
        return NodeWeights(self, local)

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            await self.actor.wait_ready.remote(timeout_s)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        """Without blocking: the answer of the last probe of the actor (a new one is sent
        when none is in flight), False once the actor or its server is gone."""
        import ray

        if self._probe is not None and ray.wait([self._probe], timeout=0)[0]:
            try:
                code = ray.get(self._probe)
                if code is not None:
                    self._exit = f"server process exited (code {code})"
            except ray.exceptions.RayError as e:
                self._exit = f"its server actor died ({type(e).__name__})"
            self._probe = None
        if self._exit is None and self._probe is None and self.actor is not None:
            self._probe = self.actor.exit_code.remote()
        return self._exit is None

    def exit_reason(self) -> str:
        return self._exit or "server process exited"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server through its actor, or, when the actor is gone and its node is on
        this host, stop its process group and free the segments it left from here."""
        import ray

        actor, self.actor, self._probe = self.actor, None, None
        if actor is None:
            return
        try:  # the actor's server.stop stops the group and frees its segments
            ray.get(actor.stop.remote(grace_s), timeout=grace_s + STOP_TIMEOUT_S)
            stopped = True
        except ray.exceptions.RayError:
            stopped = False
        ray.kill(actor, no_restart=True)
        # the actor is gone: do it from here, if its node is on this host (a process group
        # id of another host names nothing here, or someone else's group)
        if not stopped and self._pgid and self.node().address == ray.util.get_node_ip_address():
            stop_group(self._pgid, grace_s=grace_s)
            remove_orphaned_segments(set(glob.glob(SHM_PATTERN)) - self._shm_before,
                                     dead_group=self._pgid)
        self._pgid = 0

    def log_tail(self, num_lines: int = 25) -> str:
        """The server's log lines: from its actor while one runs on another node (the file is
        on that node's host), else from the file here."""
        import ray

        if self.actor is not None and not self.near:
            try:
                return ray.get(self.actor.log_tail.remote(num_lines), timeout=LOG_TAIL_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # the actor is gone: what this host has, if anything
        return self.spec.log_tail(num_lines)


def build_ray_vllm_engines(cfg: EngineConfig, model_path: Path, *, version: int,
                           num_cpus: float, units: ScaleUnits | None, log_dir: Path,
                           per_node: bool = False, strategy: Any = None) -> list[VllmEngine]:
    """``cfg.num_engines`` vLLM engines ``ray-vllm-<i>``, each serving ``model_path`` at
    ``version`` from a server its actor launched (in ``units.engine(i)``, else placed by
    ``strategy``; ``num_cpus`` each), started together. ``per_node``: ``ActorServer``'s."""
    from rollstream.engine.vllm import build_vllm_engine

    def build(i: int) -> VllmEngine:
        placed = units.engine(i) if units is not None else strategy
        return build_vllm_engine(cfg, model_path, engine_id=f"ray-vllm-{i}", version=version,
                                 log_dir=log_dir,
                                 host=lambda spec: ActorServer(spec, num_cpus=num_cpus,
                                                               strategy=placed,
                                                               per_node=per_node),
                                 weights=lambda server, local: server.weights(local))

    with ThreadPoolExecutor(cfg.num_engines) as pool:
        futures = [pool.submit(build, i) for i in range(cfg.num_engines)]
    built, failed = [], None
    for f in futures:
        try:
            built.append(f.result())
        except BaseException as e:  # every engine is built or stopped, then the first error
            failed = failed or e
    if failed is not None:
        for engine in built:
            engine.shutdown()
        raise failed
    return built


def build_run_engines(cfg: RunConfig, model_path: Path, *, version: int, units: ScaleUnits,
                      run_dir: Path) -> list[VllmEngine]:
    """``engine.kind: vllm`` on Ray (engine/factory.py): the run's servers, their logs under
    the run directory's ``vllm-logs``; with ``runtime.ray.weight_sync: auto`` a server may run
    on another node of this host, its actor writing the weights there."""
    return build_ray_vllm_engines(cfg.engine, model_path, version=version,
                                  num_cpus=cfg.runtime.ray.engine_num_cpus, units=units,
                                  log_dir=RunFiles(run_dir).vllm_logs,
                                  per_node=cfg.runtime.ray.weight_sync == "auto")
