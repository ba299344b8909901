"""Weight sync trainer -> engines, with its ordering contract.

Ordering contract
-----------------
1. The trainer finishes optimizer step ``v`` and calls :meth:`WeightSync.publish(v+1, tensors)`.
   ``publish`` copies the tensors (the trainer may start its next step at once) and returns;
   only the newest published version is ever applied (older unapplied ones are skipped).
2. The sync loop applies the newest version to every engine under one of three policies:
   * ``interrupt`` (partial rollout): close the dispatch gate, interrupt every in-flight
     request at its next token boundary (each returns its partial tokens, stamped with the
     versions that sampled them), load the weights, open the gate; the dispatcher resubmits
     prompt + partial, so later tokens carry ``v+1``;
   * ``continue`` (partial rollout, in place): load the weights between two decode steps
     while requests keep running; tokens after the boundary carry ``v+1``;
   * ``drain`` (no partial rollout): close the gate, wait until every in-flight request has
     finished on the old weights, load, open the gate.
3. Engines apply a load between two forward passes, so no forward pass mixes versions.
4. Only after every live engine serves ``v+1`` does ``on_applied(v+1)`` run (the admission
   capacity moves on); so a sample admitted under the capacity of ``v`` never sees ``v-1``.

Transport: ``Engine.load_weights`` gets the tensors in this process (the embedded engine
copies them into its own parameters); an engine whose weights live elsewhere moves them with
a transport of this package (the vLLM engine through ``vllm.py``, the Ray engine proxies
through ``object_store.py``, ``broadcast.py`` or ``shm.py``, as deltas where they can:
``delta.py``), each a ``Payload`` of the versioned protocol of ``protocol.py``.

Payload kinds: the tensors are a whole state dict, or a LoRA adapter alone (the ``adapter``
kind of ``protocol.py``, told apart by its names; a LoRA trainer publishes only its adapter):
the engine merges an adapter onto its base weights, so version ``v`` serves adapter ``v``.
:attr:`WeightSync.header` describes the version the engines serve and :attr:`num_bytes` what
one engine was handed for it (the run's ``sync_bytes`` metric). What each load moved to each
engine (:attr:`WeightSync.moved`: transport, kind, bytes and dtype of its last load, and its
totals; the dashboard's engine table and nodes view) is the engine's own account where its
weights travel over a transport (:class:`ReportsSync`: a delta, a cast to the engine's dtype),
else the tensors as handed over, :data:`IN_PROCESS`.

WeightSync talks to the engines and to a small :class:`Gate` (pause / resume / wait until
idle, which the dispatcher implements); it knows nothing else of the rollout. DEAD engines
are skipped (they serve nothing). It keeps the version the engines serve (its tensors), so
that :meth:`WeightSync.revive` restarts an engine whose loop died at that version, under the
same lock as the loads: a revived engine never serves a version the others have left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rollstream.clock import Clock, WallClock
from rollstream.config.schema import OnUpdate
from rollstream.engine.protocol import Engine, Joins, Restartable
from rollstream.engine.states import EngineHealth
from rollstream.sync.protocol import Header, SyncRecord, is_adapter

if TYPE_CHECKING:
    import torch

IN_PROCESS = "in_process"  # an engine handed the tensors in this process (the embedded one)


@runtime_checkable
class ReportsSync(Protocol):
    """An engine whose weights travel over a transport (engine actors, vLLM servers)."""

    weight_transport: str  # the transport's name (``Transport.name``)

    def last_sync(self) -> SyncRecord | None:
        """What its last load moved when the transport changed the tensors (a delta, a
        cast to the engine's dtype); None: the tensors as handed over."""


@dataclass(slots=True, kw_only=True)
class Moved:
    """What weight loads moved to one engine: its last load, and the totals so far."""

    last: SyncRecord
    total_bytes: int = 0
    loads: int = 0


def transport_of(engine: Engine) -> str:
    """The name of the transport that carries ``engine``'s weights."""
    return engine.weight_transport if isinstance(engine, ReportsSync) else IN_PROCESS


class Gate(Protocol):
    """What weight sync needs of the dispatcher."""

    def pause(self) -> None:
        """Submit no new request until resume()."""

    def resume(self) -> None: ...

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""


class WeightSync:
    def __init__(
        self,
        engines: list[Engine],
        gate: Gate,
        policy: OnUpdate,
        on_applied: Callable[[int, float], Awaitable[None] | None],
        *,
        version: int = 0,
        clock: Clock | None = None,
    ) -> None:
        """``version``: the one the engines serve at start (their model folder's weights);
        ``clock`` times each sync (``sync_s``)."""
        self.engines = engines  # the run's roster (runtime/fleet.py adds and removes)
        self.gate = gate
        self.policy = policy
        self.on_applied = on_applied
        self.version = version
        self.clock = clock or WallClock()
        self._tensors: dict[str, torch.Tensor] | None = None  # of `version`; None: the folder's
        self.header: Header | None = None  # of `version`'s tensors; None: the folder's
        self._lock = asyncio.Lock()  # one load or revival at a time
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.moved: dict[str, Moved] = {}  # engine id -> what its loads moved
        self._plain: SyncRecord | None = None  # the last version's tensors, as handed over

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._pending = (version, {k: v.detach().clone() for k, v in tensors.items()})
        self._idle.clear()
        self._wake.set()

    async def wait_applied(self) -> None:
        """Wait until every published version has been applied."""
        await self._idle.wait()

    async def run(self) -> None:
        """The sync loop (a named task of the controller)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending is None:
                continue
            version, tensors = self._pending
            self._pending = None
            t0 = self.clock.now()
            async with self._lock:
                engines = [e for e in self.engines if _serves(e)]
                try:
                    if self.policy != "continue":
                        self.gate.pause()
                    if self.policy == "interrupt":
                        await asyncio.gather(*(e.interrupt(None) for e in engines))
                    elif self.policy == "drain":
                        await self.gate.wait_idle()
                    await asyncio.gather(*(self._load(e, version, tensors) for e in engines))
                finally:
                    self.gate.resume()
                self._served(version, tensors)
            res = self.on_applied(version, self.clock.now() - t0)
            if res is not None:
                await res
            if self._pending is None:
                self._idle.set()

    async def install(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load ``version`` into every engine before the rollout starts (a resumed LoRA run's
        adapter: its engines start from the base folder), as the version they serve: no
        gate, no ``on_applied``; :meth:`revive` restarts an engine with it."""
        tensors = {k: v.detach().clone() for k, v in tensors.items()}
        async with self._lock:
            await asyncio.gather(*(self._load(e, version, tensors) for e in self.engines
                                   if _serves(e)))
            self._served(version, tensors)

    def _served(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version, self._tensors = version, tensors
        self.header = Header.describe(
            version, "adapter" if is_adapter(tensors) else "full", tensors)

    @property
    def num_bytes(self) -> int:
        """Bytes of the tensors each engine was handed for the version it serves (0 before
        the first sync)."""
        return sum(t.numel() * t.element_size() for t in (self._tensors or {}).values())

    async def admit(self, engine: Engine, join: Callable[[Engine], None]) -> None:
        """A new engine (started from the run's first weights, tagged with their version)
        loads the version the others serve, then ``join`` puts it in the roster; both under
        the lock of loads, so it joins serving the current version and every later load
        reaches it."""
        load = engine.load_alone if isinstance(engine, Joins) else engine.load_weights
        async with self._lock:
            if self._tensors is not None:
                t0 = time.perf_counter()
                await load(self.version, self._tensors)
                self._record(engine, self.version, self._tensors, t0)
            join(engine)

    async def release(self, engine: Engine, leave: Callable[[Engine], None]) -> None:
        """``leave`` takes ``engine`` out of the roster between two loads (none is
        half-done on it when it is closed)."""
        async with self._lock:
            leave(engine)

    async def revive(self, engine: Restartable) -> None:
        """Restart ``engine`` (its loop died) at the version the other engines serve."""
        async with self._lock:
            t0 = time.perf_counter()
            await engine.restart(self.version, self._tensors)
            if self._tensors is not None and isinstance(engine, Engine):
                self._record(engine, self.version, self._tensors, t0)

    async def _load(self, engine: Engine, version: int,
                    tensors: Mapping[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        try:
            await engine.load_weights(version, tensors)
        except Exception:
            if _serves(engine):
                raise  # a live engine that cannot load weights is a bug, not a fault
            return
        self._record(engine, version, tensors, t0)

    def _record(self, engine: Engine, version: int, tensors: Mapping[str, torch.Tensor],
                t0: float) -> None:
        """Note what ``engine``'s load of ``version`` moved (:attr:`moved`)."""
        rec = engine.last_sync() if isinstance(engine, ReportsSync) else None
        if rec is None or rec.version != version:
            plain = self._plain  # the tensors' bytes and dtype, counted once per version
            if plain is None or plain.version != version:
                plain = self._plain = SyncRecord.of(version, "", IN_PROCESS, tensors, 0.0)
            rec = replace(plain, engine_id=engine.engine_id, transport=transport_of(engine),
                          seconds=time.perf_counter() - t0)
        moved = self.moved.setdefault(engine.engine_id, Moved(last=rec))
        moved.last, moved.total_bytes, moved.loads = \
            rec, moved.total_bytes + rec.num_bytes, moved.loads + 1


def _serves(engine: Engine) -> bool:
    """Loads go to engines that are not DEAD and not waiting for :meth:`WeightSync.revive`
    (a recovering vLLM engine takes the load and applies it when its server is back)."""
    if isinstance(engine, Restartable) and engine.needs_restart():
        return False
    return engine.stats().health is not EngineHealth.DEAD
