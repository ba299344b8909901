"""Nodes per role on a Ray cluster (``runtime.ray.nodes``): what a role's actors ask of a node.

A role's nodes are the ones started with the custom resource the config names for it
(``ray start --resources '{"rs_engines": 1}'``). Every bundle or actor of the role asks for
:data:`ROLE_SHARE` of that resource: Ray requires a resource only when a positive amount is
asked for, and so small a share makes it a mark of the node rather than a count (a node given
1 takes a thousand actors of the role; CPUs, not this, bound how many fit). Engines and fsdp
ranks ask through their scale units' bundles (``units.py``), engines that join a live run
and reward workers on their actors. Ray's custom resources are used rather than node labels
because every Ray the project supports (2.40 on) has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from rollstream.config.runtime import RAY_RESOURCES

if TYPE_CHECKING:
    from rollstream.config.runtime import RayNodesConfig

ROLE_SHARE = 0.001  # of a role's resource, per bundle or actor: a mark, not a count
Role = Literal["engines", "trainer", "rewards"]


def role_resources(nodes: RayNodesConfig, role: Role) -> dict[str, float]:
    """The custom resources an actor (or bundle) of ``role`` asks for: none when the role's
    node is not set."""
    name = getattr(nodes, role)
    return {} if name is None else {name: ROLE_SHARE}


def check_cluster_has(nodes: RayNodesConfig) -> None:
    """ValueError naming the setting when no live node of the cluster this process is
    connected to has a role's resource: Ray would wait for such a node forever (or until the
    scale units' reservation times out), so the run fails before any actor starts, and a run
    whose trainer node left does not restart its ranks (runtime/train.py)."""
    import ray

    have: dict[str, float] = {}
    for node in ray.nodes():  # the nodes Ray reports alive: one that left is not counted
        if node.get("Alive"):
            for key, amount in node.get("Resources", {}).items():
                have[key] = have.get(key, 0.0) + amount
    for role, name in nodes.roles().items():
        if have.get(name, 0) <= 0:
            custom = sorted(k for k in have
                            if not k.startswith("node:") and k not in RAY_RESOURCES)
            raise ValueError(
                f"runtime.ray.nodes.{role} = {name!r}: no node of the cluster has that "
                f"resource (its custom resources: {', '.join(custom) or 'none'}); start the "
                f"{role} nodes with ray start --resources '{{\"{name}\": 1}}'")
