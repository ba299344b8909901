"""What the weight-sync benchmarks share: the paths they time and the engine proxies over one
transport (``weightsync.py`` times whole versions, ``delta.py`` full against delta)."""

from __future__ import annotations

from typing import Any

PATHS = ("object_store", "broadcast", "shared_memory")


def proxies(owners: list, path: str, delta: bool, dtype: str) -> tuple[Any, list]:
    """A transport of ``path`` (``runtime.ray.delta`` = ``delta``, engines in ``dtype``)
    and new proxies over ``owners``' actors that share it."""
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.runtime.ray.transport import build_transport
    from rollstream.sync.broadcast import Broadcast
    from rollstream.sync.delta import DeltaSync

    transport = build_transport(RayConfig.model_validate({"weight_sync": path,
                                                          "delta": delta}), dtype)
    engines = [RayEngine(engine_id=o.engine_id, spawn=o._spawn, weights=transport,
                         version=0, max_restarts=0, actor=o.actor) for o in owners]
    inner = transport.inner if isinstance(transport, DeltaSync) else transport
    if isinstance(inner, Broadcast):
        inner.members = lambda: {e.engine_id: e.actor for e in engines}
    return transport, engines
