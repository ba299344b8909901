"""``object_store``: a version reaches engine actors through Ray's object store.

The payload is put once per version (``ray.put``); every destination's ``install`` gets the
reference, and Ray copies the tensors into each actor's process (across hosts, object store
to object store). It is also the other transports' fallback: the way a replaced actor gets
the current version, and the way a version goes when a broadcast group cannot form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollstream.sync.protocol import Destination, Payload

if TYPE_CHECKING:
    import torch


class ObjectStore:
    """:class:`~rollstream.sync.protocol.Transport` through the object store."""

    name = "object_store"

    def __init__(self) -> None:
        self._tensors: Mapping[str, torch.Tensor] | None = None  # held: `is` stays valid
        self._ref: Any = None

    def ref(self, payload: Payload) -> Any:
        """The object of ``payload``, put at its first send."""
        import ray

        if payload.tensors is not self._tensors:
            self._ref = ray.put(Payload(header=payload.header, tensors=dict(payload.tensors)))
            self._tensors = payload.tensors
        return self._ref

    async def send(self, payload: Payload, to: Destination) -> None:
        await to.actor.install.remote(self.ref(payload))

    async def revive(self, payload: Payload, to: Destination) -> None:
        await self.send(payload, to)

    def close(self) -> None:
        self._tensors = self._ref = None
