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
4. Only after every engine serves ``v+1`` does ``on_applied(v+1)`` run (the admission
   capacity moves on); so a sample admitted under the capacity of ``v`` never sees ``v-1``.

Transport: in-process tensors handed to ``Engine.load_weights`` (the embedded engine copies
them into its own parameters; the vLLM engine writes them to shared memory and reloads).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Literal

from rollstream.rollout.dispatcher import Dispatcher

if TYPE_CHECKING:
    import torch

Policy = Literal["interrupt", "continue", "drain"]


class WeightSync:
    def __init__(
        self,
        dispatcher: Dispatcher,
        policy: Policy,
        on_applied: Callable[[int, float], Awaitable[None] | None],
    ) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.on_applied = on_applied
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.applied_version = 0
        self._prepare = {"interrupt": self._interrupt, "continue": self._nothing,
                         "drain": self._drain}[policy]

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
            t0 = time.perf_counter()
            gate = self.dispatcher.gate
            try:
                if self.policy != "continue":
                    gate.clear()
                await self._prepare()
                await asyncio.gather(
                    *(e.load_weights(version, tensors) for e in self.dispatcher.engines)
                )
            finally:
                gate.set()
            self.applied_version = version
            res = self.on_applied(version, time.perf_counter() - t0)
            if res is not None:
                await res
            if self._pending is None:
                self._idle.set()

    async def _interrupt(self) -> None:
        await self.dispatcher.interrupt(None)

    async def _nothing(self) -> None:
        return None

    async def _drain(self) -> None:
        await self.dispatcher.wait_idle()
