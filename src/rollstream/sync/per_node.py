"""``runtime.ray.weight_sync: auto``: each engine actor's transport chosen by its node.

An actor on the driver's node reads a version from shared memory (written once under
/dev/shm for all of them, :mod:`.shm`); an actor on another node gets it through Ray's object
store (:mod:`.object_store`: put once, copied node to node by Ray), since that node's
``/dev/shm`` is not this one's. The choice is the destination's node id
(``Destination.node_id``, where Ray placed the actor) against this process's; a destination
whose node is not known goes the object store's way, which reaches any node. Nothing is
written to shared memory for a version no actor on this node takes.
"""

from __future__ import annotations

from rollstream.sync.protocol import Destination, Payload, Transport


class PerNode:
    """:class:`~rollstream.sync.protocol.Transport`: ``near`` to the destinations on node
    ``here``, ``far`` to the others (module docstring)."""

    name = "auto"

    def __init__(self, *, near: Transport, far: Transport, here: str) -> None:
        self.near, self.far, self.here = near, far, here

    def choose(self, to: Destination) -> Transport:
        return self.near if to.node_id is not None and to.node_id == self.here else self.far

    def name_for(self, to: Destination) -> str:
        """The transport ``to`` gets (its name, as the dashboard and the log say it)."""
        return self.choose(to).name

    async def send(self, payload: Payload, to: Destination) -> None:
        await self.choose(to).send(payload, to)

    async def revive(self, payload: Payload, to: Destination) -> None:
        await self.choose(to).revive(payload, to)

    def close(self) -> None:
        self.near.close()
        self.far.close()
