"""The engine actors' weight transport, chosen by ``runtime.ray.weight_sync`` (the transports
themselves are in ``rollstream.sync``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollstream.config.runtime import RayConfig
    from rollstream.sync.protocol import Transport


def build_transport(cfg: RayConfig, dtype: str) -> Transport:
    """The engine actors' weight transport, by ``runtime.ray.weight_sync``, sending deltas
    in the engines' ``dtype`` unless ``runtime.ray.delta`` is false."""
    from rollstream.sync.broadcast import Broadcast
    from rollstream.sync.delta import DeltaSync
    from rollstream.sync.object_store import ObjectStore
    from rollstream.sync.shm import SharedMemory

    inner: Transport
    match cfg.weight_sync:
        case "object_store":
            inner = ObjectStore()
        case "broadcast":
            inner = Broadcast(cfg.bucket_bytes, backend=cfg.broadcast_backend)
        case "shared_memory":
            inner = SharedMemory(cfg.bucket_bytes)
        case "auto":  # by node: shared memory on this one, the object store to the others
            from rollstream.runtime.nodes import this_node
            from rollstream.sync.per_node import PerNode

            inner = PerNode(near=SharedMemory(cfg.bucket_bytes), far=ObjectStore(),
                            here=this_node().node_id)
        case _:
            raise AssertionError(cfg.weight_sync)  # the config allows nothing else
    return DeltaSync(inner, dtype=dtype, name=inner.name) if cfg.delta else inner
