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
one engine was handed for it (the run's ``sync_bytes`` metric).

WeightSync talks to the engines and to a small :class:`Gate` (pause / resume / wait until
idle, which the dispatcher implements); it knows nothing else of the rollout. DEAD engines
are skipped (they serve nothing). It keeps the version the engines serve (its tensors), so
that :meth:`WeightSync.revive` restarts an engine whose loop died at that version, under the
same lock as the loads: a revived engine never serves a version the others have left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from rollstream.clock import Clock, WallClock
from rollstream.config.schema import OnUpdate
from rollstream.engine.protocol import Engine, Joins, Restartable
from rollstream.engine.states import EngineHealth
from rollstream.sync.protocol import Header, is_adapter

if TYPE_CHECKING:
    import torch

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
                await load(self.version, self._tensors)
            join(engine)

    async def release(self, engine: Engine, leave: Callable[[Engine], None]) -> None:
        """``leave`` takes ``engine`` out of the roster between two loads (none is
        half-done on it when it is closed)."""
        async with self._lock:
            leave(engine)

    async def revive(self, engine: Restartable) -> None:
        """Restart ``engine`` (its loop died) at the version the other engines serve."""
        async with self._lock:
            await engine.restart(self.version, self._tensors)

    @staticmethod
    async def _load(engine: Engine, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        try:
            await engine.load_weights(version, tensors)
        except Exception:
            if _serves(engine):
                raise  # a live engine that cannot load weights is a bug, not a fault


def _serves(engine: Engine) -> bool:
    """Loads go to engines that are not DEAD and not waiting for :meth:`WeightSync.revive`
    (a recovering vLLM engine takes the load and applies it when its server is back)."""
    if isinstance(engine, Restartable) and engine.needs_restart():
        return False
    return engine.stats().health is not EngineHealth.DEAD
