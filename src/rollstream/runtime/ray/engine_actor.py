"""The engine actor's body: a local engine in its own process, made remote by
:func:`spawn_actor`; :class:`~rollstream.runtime.ray.engines.RayEngine` is its driver-side
proxy (engines.py has the picture). Its generate and peek calls take and return packed
tokens and keep episode histories (``dataplane.py``)."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config.runtime import DEFAULT_EPISODE_CACHE_TOKENS, DEFAULT_OUT_OF_BAND_BYTES
from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local.prefix import Change
from rollstream.engine.protocol import EngineStats, FinishReason, GenerateRequest
from rollstream.runtime.nodes import Node, this_node
from rollstream.runtime.ray.dataplane import (
    GenerateCall,
    GenerateReply,
    Histories,
    PeekCursor,
    PeekReply,
    offload,
    pack,
    unpack_ids,
)

if TYPE_CHECKING:
    import torch

    from rollstream.sync.protocol import Delivery


class EngineActor:
    """The actor body (made remote by :func:`spawn_actor`): a local engine in this process."""

    def __init__(self, model_path: str, cfg: LocalEngineConfig, engine_id: str,
                 version: int, episode_cache_tokens: int, out_of_band_bytes: int) -> None:
        from rollstream.engine.local import LocalEngine

        self.engine = LocalEngine(Path(model_path), cfg, engine_id=engine_id, version=version)
        self._group: Any = None  # the broadcast group it belongs to (weight_sync: broadcast)
        self._receiving = asyncio.Lock()  # one round's broadcasts at a time, in call order
        self._histories = Histories(episode_cache_tokens)
        self._peeked = PeekCursor()
        self._out_of_band_bytes = out_of_band_bytes

    async def generate(self, call: GenerateCall, prompt: bytes) -> GenerateReply | None:
        """One request: ``prompt`` (packed ids; Ray fetched them if they came by reference)
        after the history ``call.base``. None: this actor does not hold that history."""
        for episode_id in call.ended:
            self.engine.end_episode(episode_id)
        ids = self._histories.prompt(call, unpack_ids(prompt))
        if ids is None:
            return None
        out = await self.engine.generate(GenerateRequest(
            request_id=call.request_id, prompt_ids=ids, params=call.params,
            episode_id=call.episode_id))
        if out.finish_reason is not FinishReason.ERROR:
            self._histories.keep(call.stamp, ids + out.token_ids)
        tokens = pack(out.token_ids, out.logprobs, out.versions, out.routing)
        return GenerateReply(out.finish_reason, out.error,
                             offload(tokens, self._out_of_band_bytes))

    async def poll(self) -> tuple[EngineStats, tuple[Change, ...]]:
        """The engine's stats, and what its prefix cache inserted, evicted or dropped since
        the last poll (``PrefixIndex``: the proxy's mirror, so that the router weighs what
        this engine holds without a call; polls are one at a time, so none is lost)."""
        return self.engine.stats(), self._cache_changes()

    def _cache_changes(self) -> tuple[Change, ...]:
        """The prefix cache's changes since the last poll; a cache the engine built anew (a
        restart) starts with a clear and what it holds."""
        prefix = self.engine._runner.prefix  # the engine's own: its module is at its budget
        if not prefix.on:
            return ()
        out: list[Change] = []
        if prefix.changes is None:  # the first poll, or the first since a restart: a snapshot
            prefix.changes = deque()  # before it: a block it misses is logged
            out += [None, *((slot, b.key) for slot, b in list(prefix.blocks.items()))]
        while prefix.changes:
            out.append(prefix.changes.popleft())
        return tuple(out)

    async def interrupt(self, request_ids: Sequence[str] | None) -> None:
        await self.engine.interrupt(request_ids)

    async def join_weight_group(self, host: str, port: int, prefix: str, rank: int,
                                world: int, timeout_s: float, backend: str = "gloo") -> None:
        """Join the driver's broadcast group (``weight_sync: broadcast``, over ``backend``),
        leaving any older one."""
        from rollstream.sync.broadcast import join_group

        self._group = None
        self._group = await asyncio.to_thread(join_group, host, port, prefix, rank, world,
                                              timeout_s, backend)

    async def install(self, delivery: Delivery) -> None:
        """Install the version a weight transport delivered (``sync/``): the payload itself,
        a broadcast round's buckets or a shared-memory folder, opened off the loop; a delta
        is applied to the weights served (``sync/delta.py``: only to the version it names)."""
        from rollstream.sync.delta import receive
        from rollstream.sync.protocol import Payload

        async with self._receiving:
            if isinstance(delivery, Payload):  # it came whole: nothing to read, no thread hop
                payload = delivery.open()
            else:
                payload = await asyncio.to_thread(delivery.open, self._group)
            # loads come one at a time through here: the served weights are the base's
            tensors = receive(payload, held=self.engine.stats().version,
                              served=self.engine._weights.hf_views)
            await self.engine.load_weights(payload.version, tensors)

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the weights the engine serves, HF-named, read off the engine thread: for
        checks of weight sync while no load is pending (the local engine keeps its weights
        to itself; its module is at its size budget)."""
        return {k: v.clone() for k, v in self.engine._weights.hf_views.items()}

    async def node(self) -> Node:
        """The node this actor runs on, as Ray reports it."""
        return this_node()

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def cpu_affinity(self) -> dict[str, list[int]]:
        """The cores each thread of this process may run on, by thread name (placement)."""
        import threading

        return {t.name: sorted(os.sched_getaffinity(t.native_id))
                for t in threading.enumerate() if t.native_id is not None}

    async def peek(self) -> PeekReply:
        """The tokens the running requests sampled since the last peek."""
        entries, tokens = self._peeked.deltas(await self.engine.peek())
        return PeekReply(entries, offload(tokens, self._out_of_band_bytes))

    async def close(self) -> None:
        await self.engine.close()


def spawn_actor(model_path: Path, cfg: LocalEngineConfig, *, engine_id: str, version: int,
                num_cpus: float, strategy: Any = None,
                resources: dict[str, float] | None = None,
                episode_cache_tokens: int = DEFAULT_EPISODE_CACHE_TOKENS,
                out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES) -> Any:
    """An engine actor; ``strategy``: its Ray scheduling strategy (its scale unit's bundle,
    ``units.py``, which holds its node's resources too; None: where Ray places it, on a node
    with ``resources``: its role's, ``nodes.py``)."""
    import ray

    remote = ray.remote(EngineActor).options(num_cpus=num_cpus, max_concurrency=1000,
                                             scheduling_strategy=strategy,
                                             resources=resources or {})
    return remote.remote(str(model_path), cfg, engine_id, version, episode_cache_tokens,
                         out_of_band_bytes)
