"""Engines as Ray actors: an ``EngineActor`` (engine_actor.py) hosts a local engine in its own
process, and :class:`RayEngine` is the driver-side proxy that implements the engine protocol
over it.

    driver (controller, dispatcher, weight sync)         engine actor (own process)
    ----------------------------------------------       ---------------------------
    RayEngine.generate ------- actor.generate.remote ---> LocalEngine.generate
      (dataplane.py: the tokens an episode added since its last call, packed; a payload
       above runtime.ray.out_of_band_bytes by reference through the object store, both ways)
    RayEngine.interrupt ------ actor.interrupt.remote --> LocalEngine.interrupt
    RayEngine.load_weights --- the run's weight transport (sync/; by node with auto) --->
                               actor.install
    RayEngine.stats() -------- cached; one actor.poll.remote in flight, read when ready
                               (its engine's stats, and its prefix cache's changes since:
                               the proxy's mirror answers cached_tokens without a call)
                               (and every PEEK_S one actor.peek.remote: the partial tokens
                               sampled since the last peek; what streamed requests hear)
    (wire.py counts these calls and their pickled bytes, and the out-of-band payloads apart,
     in stats().work)

Everything the protocol promises (token-boundary interrupts, per-token versions, partial
tokens on abort, bad requests failing alone) is the local engine's, unchanged. ``stats()``
never waits on the actor: it answers from the last reply (requests in flight counted on this
side) and asks for a fresh one.

Faults. An actor that dies (its process was killed, or its node left) makes the proxy DEAD
for that actor: in-flight calls return ABORT with ``error`` naming the engine and the cause
and the tokens the driver last peeked for them (every PEEK_S the actor copies its running
requests' tokens, logprobs and versions to the driver; what was sampled since is sampled
again on resubmission), later calls return ABORT at once, weight loads raise. A local engine
whose step loop died inside a live actor is reported the same way. A call that raises inside
a live actor returns ABORT with the cause and the peeked tokens too, but the engine stays UP:
the router's breaker decides whether to keep routing to it (``rollout/breaker.py``). While
restarts are left (``engine.local.max_restarts``), and while one runs, the proxy is RECOVERING
and asks Ray for a new actor at once; once it is placed (``replacement.py``: maybe on another
node, maybe later) :meth:`RayEngine.restart` (the supervisor, through weight sync) gives it
the current weights; then UP again.

A request with ``on_tokens`` streams through the same peeks, every ``STREAM_PEEK_S``
(``peeks.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config.runtime import DEFAULT_EPISODE_CACHE_TOKENS, DEFAULT_OUT_OF_BAND_BYTES
from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local.prefix import PrefixIndex
from rollstream.engine.protocol import EngineStats, GenerateOutput, GenerateRequest
from rollstream.engine.states import EngineHealth
from rollstream.runtime.nodes import Node
from rollstream.runtime.ray.dataplane import Episodes, is_ref, output, pack_ids
from rollstream.runtime.ray.engine_actor import spawn_actor
from rollstream.runtime.ray.errors import aborted as _aborted
from rollstream.runtime.ray.errors import actor_errors as _actor_errors
from rollstream.runtime.ray.errors import lost_errors as _lost_errors
from rollstream.runtime.ray.errors import task_errors as _task_errors
from rollstream.runtime.ray.peeks import STREAM_PEEK_S, Peeked
from rollstream.runtime.ray.replacement import Replacement, Totals
from rollstream.runtime.ray.wire import WireMeter
from rollstream.sync.protocol import Destination, Payload, SyncRecord, Transport

if TYPE_CHECKING:
    import torch

    from rollstream.config.schema import RunConfig
    from rollstream.runtime.ray.units import ScaleUnits

log = logging.getLogger(__name__)
PEEK_S = 0.2  # how often the driver copies the running requests' tokens while it polls


class RayEngine:
    """Implements the engine protocol (and ``Closeable``, ``Restartable``, ``KeepsEpisodes``)
    over an ``EngineActor``; ``spawn(version)`` makes a new actor (at start and on restart)."""

    def __init__(self, *, engine_id: str, spawn: Callable[[int], Any], weights: Transport,
                 version: int, max_restarts: int, actor: Any = None,
                 episodes: Episodes | None = None,
                 out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES) -> None:
        """``actor``: one ``spawn(version)`` made already (None: spawn it now); ``episodes``:
        the mirror of its actor's histories (None: one of the default size, holders of its
        own); ``out_of_band_bytes``: prompts above it go by reference (as the actor's)."""
        import ray

        self.engine_id = engine_id
        self._spawn, self._weights, self._max_restarts = spawn, weights, max_restarts
        self.num_restarts, self._version, self._closed, self._restarting = 0, version, False, False
        self._death: str | None = None  # why the current actor stopped serving
        self._inflight: dict[str, object] = {}  # request id -> a token of its generate call
        self._episodes = episodes if episodes is not None else \
            Episodes(DEFAULT_EPISODE_CACHE_TOKENS)
        self._out_of_band_bytes = out_of_band_bytes
        self._peek_entries: tuple[tuple[str, int, int], ...] | None = None  # its tokens' wait
        self._before = Totals()  # counters of the actors this one replaced
        self._replacing = Replacement(engine_id=engine_id, spawn=spawn)
        self._delivered_tokens = 0  # tokens returned by the current actor's calls
        self._peeked = Peeked()  # in flight: its tokens at the last peek, its listener
        self._peek, self._peek_at = None, 0.0  # the peek in flight (Any), when it was sent
        self._stream_polls: asyncio.Task | None = None
        self.wire = WireMeter()  # the control plane's calls and bytes (all actors')
        self.weight_transport = weights.name  # ``ReportsSync``: the transport it gets
        self.actor = actor if actor is not None else spawn(version)
        self._cache = PrefixIndex()  # the actor's prefix cache as of the last poll
        self._pending: Any = self.actor.poll.remote()
        node = self.actor.node.remote()  # where Ray placed it (``Placed``)
        self.wire.call()
        self.wire.call()
        self._last = self._read(self._pending, wait=True)
        self._node: Node = ray.get(node)
        self._pending = None
        self._placed()

    # ---- the engine protocol -------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if request.on_tokens is None:
            return await self._call(request)
        self._peeked.listen(request.request_id, request.on_tokens)
        if self._stream_polls is None or self._stream_polls.done():
            self._stream_polls = asyncio.create_task(self._poll_streams())
        out = None
        try:
            out = await self._call(request)
            return out
        finally:
            self._peeked.end(request.request_id, [] if out is None else out.token_ids)

    async def _poll_streams(self) -> None:
        """Peek every STREAM_PEEK_S while a request streams (``peeks.py``)."""
        while self._peeked.streaming and self._death is None and not self._closed:
            self._poll()
            await asyncio.sleep(STREAM_PEEK_S / 2)

    async def _call(self, request: GenerateRequest) -> GenerateOutput:
        actor = self.actor
        if self._death is not None:
            return _aborted(request.request_id, self._death)
        mine = self._inflight[request.request_id] = object()
        try:
            out = await self._generate(actor, request)
        except (*_actor_errors(), *_lost_errors()) as e:  # its tokens at the last peek survive
            self._fault(actor, e)
            return _aborted(request.request_id, self._death or f"{self.engine_id}: {e}",
                            self._peeked.partial.get(request.request_id))
        except _task_errors() as e:  # the actor lives but the call raised: it stays UP, the
            cause = getattr(e, "cause", None) or e  # router's breaker judges it
            return _aborted(request.request_id, f"ray engine {self.engine_id} raised "
                            f"{type(cause).__name__}: {str(cause)[:300]}",
                            self._peeked.partial.get(request.request_id))
        finally:
            if self._inflight.get(request.request_id) is mine:
                del self._inflight[request.request_id]
                self._peeked.partial.pop(request.request_id, None)
        if actor is self.actor:
            self._delivered_tokens += len(out.token_ids)
        return out

    async def _generate(self, actor: Any, request: GenerateRequest) -> GenerateOutput:
        """``request`` on ``actor``: the tokens added since the episode's last call when the
        actor holds its history, else (or when it no longer does) the whole prompt."""
        for whole in (False, True):
            call, ids = self._episodes.plan(request, whole=whole)
            out = None
            try:
                prompt = self.wire.send(pack_ids(ids), self._out_of_band_bytes)
                ref = actor.generate.remote(call, prompt)
                self.wire.call(call, prompt)
                try:
                    reply = await ref
                except asyncio.CancelledError:
                    import ray

                    ray.cancel(ref)  # the actor's coroutine is cancelled: the engine interrupts it
                    raise
                self.wire.reply(reply)
                if reply is not None:
                    out = output(request.request_id, reply, await self.wire.receive(reply.tokens))
                    if call.base:
                        self.wire.reused_tokens += len(request.prompt_ids) - len(ids)
                    return out
                self.wire.episode_misses += 1
            finally:
                self._episodes.done(request, call, out)
        raise AssertionError(f"ray engine {self.engine_id}: a whole prompt found no history")

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        actor = self.actor
        if self._death is not None:
            return  # a dead engine has nothing to stop
        ids = None if request_ids is None else list(request_ids)
        self.wire.call(ids)
        try:
            await actor.interrupt.remote(ids)
        except _actor_errors() as e:
            self._fault(actor, e)

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """RuntimeError with the cause when the actor is dead or fails to install them; none
        while a replacement is on its way (it gets the version it is restarted at)."""
        actor = self.actor
        if self._death is not None:
            if self._restarting or self._may_restart():
                return
            raise RuntimeError(self._death)
        try:
            await self._weights.send(Payload.full(version, tensors), self._destination(actor))
        except (RuntimeError, *_actor_errors()) as e:  # a dead local engine raises RuntimeError
            self._fault(actor, e)
            raise RuntimeError(self._death or f"ray engine {self.engine_id}: {e}") from e
        self._version = version

    def stats(self) -> EngineStats:
        self._poll()
        last, n = self._last, len(self._inflight)
        running = min(n, last.num_running)
        health, reason = EngineHealth.UP, self._death
        if self._death is not None:
            health = EngineHealth.RECOVERING if self._restarting or self._may_restart() \
                else EngineHealth.DEAD  # RECOVERING while even its last restart runs
            waiting = self._replacing.waiting()
            reason = f"{reason}; {waiting}" if waiting else reason
        before = self._before  # wire's counters: the proxy's, across its actors
        return replace(
            last, engine_id=self.engine_id, version=self._version, num_running=running,
            num_waiting=n - running,
            generated_tokens=before.tokens + max(last.generated_tokens, self._delivered_tokens),
            busy_s=before.busy_s + last.busy_s,
            work={**{k: before.work.get(k, 0.0) + v for k, v in last.work.items()},
                  **self.wire.totals(), **self._sync_totals()},
            health=health, health_reason=reason)

    def live_actor(self) -> Any:
        """The actor while it serves (None once it died or was closed)."""
        self._poll()
        return None if self._death is not None or self._closed else self.actor

    def last_sync(self) -> SyncRecord | None:
        """``ReportsSync``: the delta sync's record of the last load (None: sent as given)."""
        from rollstream.sync.delta import DeltaSync

        weights = self._weights
        return weights.last.get(self.engine_id) if isinstance(weights, DeltaSync) else None

    def node(self) -> Node:
        """``Placed``: the node its actor runs on (asked when it was spawned)."""
        return self._node

    def _destination(self, actor: Any) -> Destination:
        return Destination(engine_id=self.engine_id, actor=actor, node_id=self._node.node_id)

    def _placed(self) -> None:  # the actor's node is known: its transport (auto picks by node)
        pick = getattr(self._weights, "name_for", None)  # a delta sync's, or auto's own
        if pick is not None:
            self.weight_transport = pick(self._destination(self.actor))

    def _sync_totals(self) -> dict[str, float]:
        """Weight loads by kind and their bytes, when the transport sends deltas."""
        from rollstream.sync.delta import DeltaSync

        return self._weights.totals(self.engine_id) if isinstance(self._weights,
                                                                  DeltaSync) else {}

    # ---- restarts and close --------------------------------------------------------------
    def needs_restart(self) -> bool:
        """The actor died (or its engine did) and its replacement is placed: restart it."""
        return self._may_restart() and self._replacing.placed(self.actor, self._version)

    def _may_restart(self) -> bool:
        """The actor died and another may replace it (RECOVERING)."""
        self._poll()
        return self._death is not None and not self._closed and \
            self.num_restarts < self._max_restarts

    async def restart(self, version: int, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """The placed replacement (:meth:`needs_restart`) serves ``version`` (its model
        folder's weights, then ``tensors`` unless None); UP when this returns."""
        import ray

        if not self.needs_restart():
            raise RuntimeError(f"ray engine {self.engine_id} cannot restart: "
                               f"{self._death or 'it is running'}")
        self.num_restarts, self._restarting = self.num_restarts + 1, True
        self._before.add(self._last, self._delivered_tokens)
        actor = self._replacing.take()
        try:
            self._node = await actor.node.remote()
            if tensors is not None:
                await self._weights.revive(Payload.full(version, tensors),
                                           self._destination(actor))
            self._last, cached = await actor.poll.remote()  # a new cache: starts with a clear
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        finally:
            self._restarting = False
        self.actor, self._pending, self._peek, self._delivered_tokens = actor, None, None, 0
        self._placed()
        self._peek_entries = None
        self._episodes.reset()  # the new actor holds no history
        self._cache.apply(cached)
        self._version, self._death = version, None
        log.warning("ray engine %s restarted at version %d (restart %d of %d)",
                    self.engine_id, version, self.num_restarts, self._max_restarts)

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """``HoldsPrefixes``: of ``prompt_ids``, the tokens its actor's prefix cache held at
        the last poll (one is asked for now)."""
        self._poll()
        return self._cache.held(prompt_ids)

    def end_episode(self, episode_id: str) -> None:
        """``KeepsEpisodes``: the actor holding the episode's history drops it next call."""
        self._episodes.end(episode_id)

    async def close(self) -> None:
        """Close the engine (pending requests ABORT), end its actor, free the weight transport
        (shared by the run's proxies: the run closes them all, no load follows)."""
        await self.leave()
        self._weights.close()

    async def leave(self) -> None:
        """``Joins``: close the engine and kill its actor (its CPUs go back to Ray); the
        transport stays open for the run's other engines."""
        import ray

        self._closed = True
        self._replacing.drop()
        if self._death is None:
            try:
                await self.actor.close.remote()
            except _actor_errors():
                pass  # it died meanwhile: nothing left to close
        self._death = self._death or f"ray engine {self.engine_id} closed"
        ray.kill(self.actor, no_restart=True)

    async def load_alone(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """``Joins``: ``version`` to this actor alone, outside the transport's rounds (as a
        replaced actor gets it), when it joins a live run."""
        if self._death is not None:
            raise RuntimeError(self._death)
        await self._weights.revive(Payload.full(version, tensors),
                                   self._destination(self.actor))
        self._version = version

    def sibling(self, engine_id: str, spawn: Callable[[int], Any], version: int) -> RayEngine:
        """A new engine actor (``spawn``) and its proxy, sharing this one's weight transport
        and record of episodes: one that joins the run."""
        return RayEngine(engine_id=engine_id, spawn=spawn, weights=self._weights,
                         version=version, max_restarts=self._max_restarts,
                         episodes=self._episodes.sharing(),
                         out_of_band_bytes=self._out_of_band_bytes)

    # ---- helpers -------------------------------------------------------------------------
    def _poll(self) -> None:
        """Take the actor's last stats reply and peek if they are in, and ask for the next
        ones (a peek at most every PEEK_S, while requests are in flight)."""
        import ray

        if self._death is not None or self._closed:
            return
        if self._peek is not None and ray.wait([self._peek], timeout=0)[0]:
            self._take_peek()
        every = STREAM_PEEK_S if self._peeked.streaming else PEEK_S
        if self._peek is None and self._inflight and \
                time.monotonic() - self._peek_at >= every and self._death is None:
            self._peek, self._peek_at = self.actor.peek.remote(), time.monotonic()
            self.wire.call()
        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return
            self._last = self._read(self._pending)
        if self._death is None:
            self._pending = self.actor.poll.remote()
            self.wire.call()

    def _take_peek(self) -> None:
        """A peek's reply, or the tokens it sent by reference (taken when they are here)."""
        import ray

        actor, ref, self._peek = self.actor, self._peek, None
        try:
            value = ray.get(ref, timeout=0)
        except (*_actor_errors(), *_lost_errors()) as e:
            self._fault(actor, e)
            return
        if self._peek_entries is None:  # the reply
            self.wire.reply(value)
            if is_ref(value.tokens):
                self._peek, self._peek_entries = value.tokens, value.entries
                return
            entries, tokens = value.entries, value.tokens
        else:
            self.wire.data_received(value.nbytes)
            entries, tokens, self._peek_entries = self._peek_entries, value, None
        self._peeked.merge(entries, tokens, self._inflight)

    def _read(self, ref: Any, *, wait: bool = False) -> EngineStats:
        """A poll's stats (a dead actor or engine is a fault; the last stats stay); its
        prefix-cache changes go into the mirror."""
        import ray

        actor = self.actor
        try:
            reply = ray.get(ref, timeout=None if wait else 0)
        except _actor_errors() as e:
            if wait:
                raise
            self._fault(actor, e)
            return self._last
        self.wire.reply(reply)
        st, cached = reply
        self._cache.apply(cached)
        if st.health is not EngineHealth.UP:
            self._fault(actor, RuntimeError(st.health_reason))
        return st

    def _fault(self, actor: Any, cause: BaseException) -> None:
        """The current actor stopped serving (a reply of a replaced actor changes nothing)."""
        if actor is self.actor and self._death is None:
            self._death = f"ray engine {self.engine_id} died: {cause}"
            self._pending = self._peek = self._peek_entries = None
            log.error("%s", self._death)


def build_ray_engines(model_path: Path, cfg: LocalEngineConfig, *, num_engines: int,
                      version: int, num_cpus: float,
                      weights: Transport | None = None,
                      units: ScaleUnits | None = None,
                      episode_cache_tokens: int = DEFAULT_EPISODE_CACHE_TOKENS,
                      out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES) -> list[RayEngine]:
    """``num_engines`` engine actors (all started before any is awaited) and their proxies,
    which share ``weights`` (None: the object store) and the record of which actor holds an
    episode's history; engine ``i`` (and its replacements) in ``units.engine(i)`` (None: where
    Ray places them). ``episode_cache_tokens``, ``out_of_band_bytes``: ``runtime.ray``'s."""
    from rollstream.sync.broadcast import Broadcast
    from rollstream.sync.delta import DeltaSync
    from rollstream.sync.object_store import ObjectStore

    weights = weights or ObjectStore()
    engines: list[RayEngine] = []
    plane = {"episode_cache_tokens": episode_cache_tokens, "out_of_band_bytes": out_of_band_bytes}
    spawns = {f"ray-{i}": _spawner(model_path, cfg, f"ray-{i}", num_cpus,
                                   units.engine(i) if units is not None else None, plane)
              for i in range(num_engines)}
    actors = {engine_id: spawn(version) for engine_id, spawn in spawns.items()}
    holders: dict[str, Episodes] = {}
    try:
        for engine_id, spawn in spawns.items():
            engines.append(RayEngine(engine_id=engine_id, spawn=spawn, weights=weights,
                                     version=version, max_restarts=cfg.max_restarts,
                                     actor=actors[engine_id],
                                     episodes=Episodes(episode_cache_tokens, holders),
                                     out_of_band_bytes=out_of_band_bytes))
    except BaseException:
        import ray

        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        raise
    group = weights.inner if isinstance(weights, DeltaSync) else weights
    if isinstance(group, Broadcast):  # the group: every engine whose actor serves
        group.members = lambda: {e.engine_id: a for e in engines
                                   if (a := e.live_actor()) is not None}
    return engines


def _spawner(model_path: Path, cfg: LocalEngineConfig, engine_id: str, num_cpus: float,
             strategy: Any, plane: dict[str, int]) -> Callable[[int], Any]:
    return lambda version: spawn_actor(model_path, cfg, engine_id=engine_id, version=version,
                                       num_cpus=num_cpus, strategy=strategy, **plane)


def build_run_engines(cfg: RunConfig, model_path: Path, *, version: int, units: ScaleUnits,
                      run_dir: Path) -> list[RayEngine]:
    """``engine.kind: local`` on Ray (engine/factory.py): the run's engine actors under its
    placement, with the weight transport and data plane ``runtime.ray`` sets."""
    from rollstream.runtime.placement import placed_engine
    from rollstream.runtime.ray.transport import build_transport

    ray = cfg.runtime.ray
    return build_ray_engines(model_path, placed_engine(cfg), num_engines=cfg.engine.num_engines,
                             version=version, num_cpus=ray.engine_num_cpus,
                             weights=build_transport(ray, cfg.engine.local.dtype), units=units,
                             episode_cache_tokens=ray.episode_cache_tokens,
                             out_of_band_bytes=ray.out_of_band_bytes)
