"""Where each engine runs and what weight syncs moved to it, per node: the dashboard's
cluster view (``Fleet.table`` and ``Fleet.nodes``; docs/monitoring.md, "Cluster").

An engine's node is the one Ray reports for its actor (:class:`Placed`: the engine actors of
``runtime.kind: ray``) or for its server's (a vLLM engine on Ray, whose server an actor
launched: with ``weight_sync: auto`` on another node of this host); every other engine is
reported on the driver's node: the embedded runtime's, and a vLLM server this process
launched or attached by ``engine.vllm.urls`` (it reloads weights from this host's
``/dev/shm``, so runs on this host). Without Ray there is one node, named :data:`LOCAL`, with
no Ray address. The weights' side of a row (transport, bytes, dtype) is weight sync's record
(``WeightSync.moved``), so the bytes here are the ones the run's ``sync_bytes`` metric and the
delta sync's log count.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

LOCAL = "local"  # the node id of a run without Ray
ENGINE_KEYS = ("engine_id", "health", "version", "routing", "member")  # a node's engine rows


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    node_id: str  # Ray's node id (hex), or LOCAL
    address: str | None  # the node's IP address as Ray reports it (None without Ray)
    hostname: str


@runtime_checkable
class Placed(Protocol):
    """An engine that runs on a node of its own choosing (an engine actor)."""

    def node(self) -> Node: ...


def this_node() -> Node:
    """The node of this process: Ray's id and address when connected to Ray, else LOCAL."""
    import sys

    host = socket.gethostname()
    ray = sys.modules.get("ray")  # never import Ray for this: a run without it is LOCAL
    if ray is None or not ray.is_initialized():
        return Node(node_id=LOCAL, address=None, hostname=host)
    return Node(node_id=ray.get_runtime_context().get_node_id(),
                address=ray.util.get_node_ip_address(), hostname=host)


def engine_node(engine: object) -> Node:
    """``engine``'s node: its actor's, its server's actor's, or the driver's (this
    process's)."""
    if isinstance(engine, Placed):
        return engine.node()
    server = getattr(engine, "server", None)  # a vLLM engine's
    return server.node() if isinstance(server, Placed) else this_node()


def node_columns(node: Node | None) -> dict[str, Any]:
    """An engine row's node columns (None: not known yet, a joining engine)."""
    if node is None:
        return {"node_id": None, "node_address": None, "node_hostname": None}
    return {"node_id": node.node_id, "node_address": node.address,
            "node_hostname": node.hostname}


def nodes_view(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine table (``Fleet.table``'s rows) by node: each node's id, address and host,
    its engines (id, health, version, routing, membership), the transports and dtypes of
    their weight syncs, and the bytes moved to its engines: by the last sync (the newest
    version any of them loaded; an engine still at an older one adds nothing) and in total."""
    nodes: dict[str | None, dict[str, Any]] = {}
    for row in rows:
        node = nodes.setdefault(row["node_id"], {
            "node_id": row["node_id"], "address": row["node_address"],
            "hostname": row["node_hostname"], "engines": [], "transports": [], "dtypes": [],
            "sync_version": None, "sync_bytes_last": 0, "sync_bytes_total": 0})
        node["engines"].append({k: row[k] for k in ENGINE_KEYS})
        for key, col in (("transports", "transport"), ("dtypes", "sync_dtype")):
            if row[col] is not None and row[col] not in node[key]:
                node[key].append(row[col])
        node["sync_bytes_total"] += row["sync_bytes_total"]
    for node in nodes.values():
        mine = [r for r in rows if r["node_id"] == node["node_id"]
                and r["sync_version"] is not None]
        if mine:
            node["sync_version"] = last = max(r["sync_version"] for r in mine)
            node["sync_bytes_last"] = sum(r["sync_bytes_last"] for r in mine
                                          if r["sync_version"] == last)
    return list(nodes.values())
