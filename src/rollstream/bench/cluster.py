"""A multi-node Ray cluster on this host for the benchmarks: ``ray.cluster_utils.Cluster``
(each node its own raylet and object store) on 127.0.0.1.

    with LocalCluster.start([NodeSpec(num_cpus=2, resources={"rs_head": 1}), ...]) as nodes:
        ... runtime.ray.address=nodes.address ...
        nodes.remove(2)           # node 2 leaves: its raylet and every process on it end

Every node is given its object store's size (``object_store_bytes``) and its custom
resources (what ``runtime.ray.nodes`` names per role); the first is the head (the driver's
node, dashboard off). The cluster's session folder lives under a short temporary path (Ray's
Unix sockets must fit ~100 characters). :meth:`LocalCluster.stop` ends the nodes it started
and this process's connection, and nothing else: never ``ray stop``, which would end every Ray
on the machine. Nodes on one host share ``/dev/shm``, the file system and the cores, so what
runs here measures processes and object stores, not a network.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from rollstream.config.runtime import MIN_OBJECT_STORE_BYTES


@dataclass(slots=True, kw_only=True, frozen=True)
class NodeSpec:
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)  # custom resources (roles)
    object_store_bytes: int = MIN_OBJECT_STORE_BYTES


@dataclass(slots=True, kw_only=True)
class LocalCluster:
    address: str  # the head's GCS: what runtime.ray.address names
    specs: list[NodeSpec]
    ids: list[str]  # node ids, in ``specs``' order (a removed node's id stays)
    cluster: Any  # the ray.cluster_utils.Cluster
    nodes: list[Any]  # its nodes, in ``specs``' order (None: removed)
    temp_dir: Path
    _flag: bool  # ray_constants.ENABLE_RAY_CLUSTER before the start, restored by stop

    @classmethod
    def start(cls, specs: Sequence[NodeSpec]) -> LocalCluster:
        """Start ``specs`` (the first is the head) and wait until every node is up."""
        from ray._private import ray_constants
        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        if not specs:
            raise ValueError("a cluster needs at least its head node")
        # as RayCluster.start: without it Ray advertises the head's GCS on the machine's
        # routable address, where nothing listens; a run that joins reads it too
        flag, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
        # Cluster.add_node records the head's address in Ray's default folder, whatever the
        # nodes' temp_dir: on a machine where no Ray ran yet that folder does not exist
        Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
        temp_dir = Path(tempfile.mkdtemp(prefix="rs-bc-"))
        cluster = Cluster(shutdown_at_exit=True)
        out = cls(address="", specs=list(specs), ids=[], cluster=cluster, nodes=[],
                  temp_dir=temp_dir, _flag=flag)
        try:
            for i, spec in enumerate(specs):
                out.nodes.append(out._add(spec, head=i == 0))
            cluster.wait_for_nodes()
        except BaseException:
            out.stop()
            raise
        out.address = cluster.address
        out.ids = [n.node_id for n in out.nodes]
        return out

    def _add(self, spec: NodeSpec, *, head: bool) -> Any:
        extra = {"include_dashboard": False} if head else {}
        return self.cluster.add_node(num_cpus=spec.num_cpus, resources=dict(spec.resources),
                                     object_store_memory=spec.object_store_bytes,
                                     node_ip_address="127.0.0.1", temp_dir=str(self.temp_dir),
                                     **extra)

    def remove(self, i: int) -> None:
        """Node ``i`` (not the head) leaves the cluster: its raylet and processes end."""
        if i == 0:
            raise ValueError("the head node holds the driver: it cannot be removed")
        if self.nodes[i] is not None:
            self.cluster.remove_node(self.nodes[i])
            self.nodes[i] = None  # gone: restore() may put a node of its spec back

    def shrink(self, n: int) -> None:
        """Back to the first ``n`` nodes: those past them that are still up leave, and all of
        them are forgotten (what a test that added nodes leaves for the next one)."""
        for i in range(max(n, 1), len(self.nodes)):
            self.remove(i)
        del self.specs[n:], self.nodes[n:], self.ids[n:]

    def restore(self, i: int) -> str:
        """A new node with node ``i``'s spec takes its place (and its index); its id."""
        self.nodes[i] = self._add(self.specs[i], head=False)
        self.cluster.wait_for_nodes()
        self.ids[i] = self.nodes[i].node_id
        return self.ids[i]

    def add(self, spec: NodeSpec) -> str:
        """A new node joins; its id."""
        node = self._add(spec, head=False)
        self.cluster.wait_for_nodes()
        self.specs.append(spec)
        self.nodes.append(node)
        self.ids.append(node.node_id)
        return node.node_id

    def stop(self) -> None:
        """This process leaves the cluster, the nodes it started end, their folder goes."""
        import ray
        from ray._private import ray_constants

        ray.shutdown()  # a run joined the cluster: this process is still connected
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        ray_constants.ENABLE_RAY_CLUSTER = self._flag

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
