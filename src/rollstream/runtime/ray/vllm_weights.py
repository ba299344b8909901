"""How a vLLM server that a Ray actor launched gets a version's weights, chosen by its node
(``runtime.ray.weight_sync: auto``, :class:`NodeWeights`):

    server on the driver's node   the driver writes the buckets to shared memory (the fast
                                  path, ``sync/shm.py``), the server's worker reloads them
    server on another node        the driver puts the payload in Ray's object store once;
                                  the server's actor (:class:`NodeStore`, on the server's
                                  node) takes it, Ray copying it node to node, and writes the
                                  buckets to its own node's shared memory for the reload

Either way the driver then asks the server to reload the folder (``sync/vllm.py``), whose
path is on the server's node. Nothing is written to the driver's shared memory for a server
on another node. The choice is made at each write, from the node the server's current actor
runs on (a restarted server may land elsewhere); the latest payload is kept (as an object
store reference) so that a server restarted on another node can be given it again.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import TYPE_CHECKING, Any

from rollstream.sync.shm import SHM_ROOT, WeightStore, WrittenWeights

if TYPE_CHECKING:
    from rollstream.sync.protocol import Payload

log = logging.getLogger(__name__)


class NodeStore:
    """The server actor's side: a :class:`WeightStore` in its node's shared memory."""

    def __init__(self) -> None:
        self.store = WeightStore(root=SHM_ROOT / "rollstream-vllm"
                                 / f"node-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def write(self, payload: Payload) -> WrittenWeights:
        return self.store.write(payload)

    def prune(self) -> None:
        self.store.prune()

    def clear(self) -> None:
        self.store.clear()


class NodeWeights:
    """What :class:`~rollstream.sync.vllm.VllmReload` and the engine ask of a weight store
    (``write``, ``prune``, ``latest``, ``clear``), for the server ``server`` (an
    ``ActorServer``) launched; ``local`` is the driver's own store (module docstring)."""

    def __init__(self, server: Any, local: WeightStore) -> None:
        self.server, self.local = server, local
        self.transport: str | None = None  # of the last write: shared_memory or object_store
        self._payload: Any = None  # the latest payload's object store reference
        self._written: tuple[Any, WrittenWeights] | None = None  # (by which actor, what)

    def write(self, payload: Payload) -> WrittenWeights:
        """Blocking (the reload runs it off the loop)."""
        import ray

        if self.server.near:
            self.transport, self._payload, self._written = "shared_memory", None, None
            return self.local.write(payload)
        self.local.clear()  # an older version this node held is of no use now
        self._payload = ray.put(payload)
        written = ray.get(self.server.actor.write_weights.remote(self._payload))
        self.transport, self._written = "object_store", (self.server.actor, written)
        log.info("vllm server on node %s: weights v%d (%d bytes) through the object store, "
                 "written on its node to %s", self.server.node_id, written.version,
                 written.num_bytes, written.path)
        return written

    def prune(self) -> None:
        if self._written is None:
            self.local.prune()
        else:
            self._written[0].prune_weights.remote()

    @property
    def latest(self) -> WrittenWeights | None:
        """The latest version, written where the server's current actor can read it (a
        server restarted by a new actor on another node is given it again)."""
        if self._written is None:
            return self.local.latest
        actor, written = self._written
        if actor is self.server.actor:
            return written
        import ray

        _forget(written)  # its actor is gone (a restart); blocking, as the restart is
        if self.server.near:
            self._written = None
            return self.local.write(ray.get(self._payload))
        written = ray.get(self.server.actor.write_weights.remote(self._payload))
        self._written = (self.server.actor, written)
        return written

    def clear(self) -> None:
        """The driver's copies, and the folder of a dead actor (a live one clears its own
        when it stops)."""
        self.local.clear()
        if self._written is not None:
            _forget(self._written[1])
        self._payload, self._written = None, None


def _forget(written: WrittenWeights) -> None:
    """Remove the node folder ``written`` lies in, if it is on this host: an actor killed with
    its node's processes (``ray.kill``, a lost node) cannot remove it itself. On a node of
    another host the path does not exist here (the folder names a pid and a random id)."""
    shutil.rmtree(written.path.parent, ignore_errors=True)
