"""The fsdp trainer's ranks as Ray actors: the :class:`~rollstream.train.fsdp.Ranks`
transport of ``runtime.kind: ray`` with ``train.backend: fsdp``.

    driver (FsdpTrainer)                      rank actor r (own process, in its scale unit)
    ----------------------------------        ---------------------------------------------
    RayRanks(...)  --- rank 0: open_store --> a TCPStore on rank 0's node address
                   --- every rank: start ---> start_rank: join the group, build RankTrainer
    RayRanks.call  --- every rank: call ----> run_command (rank 0 returns the result)

Each actor hosts the same :class:`~rollstream.train.fsdp.RankTrainer` as a spawned rank
process; only the transport differs. Rendezvous works across nodes: rank 0's actor serves
the process group's TCP store on its node's address (127.0.0.1 on a local Ray: the socket is
bound before the store takes it, since the store itself would listen on every address), and
gloo uses the network interface that holds each rank's node address.

Faults: a call whose actor died (``ray.kill``, its process killed, its node gone) raises
:class:`~rollstream.train.fsdp.TrainerRankDied` with Ray's account of the death and the node
the rank ran on; a rank that raised raises its traceback (after waiting ``DEATH_GRACE_S`` for a
peer's death that would explain it). Actors are not restarted by Ray (``max_restarts=0``): a
rank's shard cannot be rebuilt alone, so the run resumes from its checkpoint
(runtime/train.py), its new ranks placed where the run's scale units find room (another node
of ``runtime.ray.nodes.trainer`` when theirs left the cluster).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rollstream.train.fsdp import (
    DEATH_GRACE_S,
    RankTrainer,
    TrainerRankDied,
    rank_failed,
    run_command,
    start_rank,
)

if TYPE_CHECKING:
    from rollstream.runtime.ray.units import ScaleUnits

STORE_TIMEOUT_S = 300.0  # rendezvous: every rank builds its model before it joins


class RankActor:
    """The actor body (made remote by :class:`RayRanks`): one fsdp rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._store: Any = None
        self.trainer: RankTrainer | None = None

    def open_store(self) -> tuple[str, int]:
        """Rank 0: serve the group's TCP store on this node's address; (host, port)."""
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen()
        self._store = dist.TCPStore(host, sock.getsockname()[1], self.world_size, True,
                                    timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False,
                                    master_listen_fd=sock.fileno())
        sock.detach()  # the store owns the socket now
        return host, self._store.port

    def start(self, host: str, port: int, device: str, kwargs: dict[str, Any]) -> None:
        """Join the process group through rank 0's store and build this rank's trainer."""
        import ray
        import torch.distributed as dist

        _use_interface_of(ray.util.get_node_ip_address())
        store = self._store or dist.TCPStore(host, port, self.world_size, False,
                                             timedelta(seconds=STORE_TIMEOUT_S))
        self.trainer = start_rank(self.rank, self.world_size, device, kwargs, store=store)

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        assert self.trainer is not None, "call before start"
        return run_command(self.trainer, name, args)

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: its pid, placement group and node (placement checks)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": ctx.get_node_id(),
                "placement_group": ctx.get_placement_group_id()}


def _use_interface_of(address: str) -> None:
    """Have gloo listen on the interface holding ``address`` (the node's Ray address) rather
    than the one the host name resolves to (a local Ray's ranks stay on 127.0.0.1)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class RayRanks:
    """``world_size`` rank actors in the run's scale units (``units.rank(r)``; None: where
    Ray places them), each reserving ``num_cpus``, with every rank's trainer built."""

    def __init__(self, world_size: int, device: str, kwargs: dict[str, Any], *,
                 num_cpus: float, units: ScaleUnits | None = None) -> None:
        import ray

        assert device == "cpu", device  # cuda on ray is refused at load (config/runtime.py)
        remote = ray.remote(RankActor)
        self.actors = [remote.options(
            num_cpus=num_cpus, max_restarts=0,
            scheduling_strategy=units.rank(r) if units is not None else None,
        ).remote(r, world_size) for r in range(world_size)]
        self.nodes: list[str | None] = [None] * world_size  # each rank's node, once started
        try:
            host, port = self._gather([self.actors[0].open_store.remote()])
            self._gather([a.start.remote(host, port, device, kwargs) for a in self.actors])
            self.nodes = [p["node"] for p in ray.get([a.placement.remote()
                                                      for a in self.actors])]
        except BaseException:
            self.kill()
            raise

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        return self._gather([a.call.remote(name, args) for a in self.actors])

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def close(self) -> None:
        self.kill()  # a rank holds nothing that must be saved (checkpoints are explicit)

    def _gather(self, refs: list[Any]) -> Any:
        """Every ref's result (refs[i] is rank i's call); rank 0's result."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except RayActorError as e:
                raise TrainerRankDied(rank, None, _death(e, self.nodes[rank])) from e
            except RayTaskError as e:
                # after a peer's death a rank fails in its collective: the death is the cause
                self._raise_death(pending)
                raise rank_failed(rank, str(e)) from None
        return results[0]

    def _raise_death(self, pending: dict[Any, int]) -> None:
        """:class:`TrainerRankDied` if a pending call's actor died, waiting up to
        ``DEATH_GRACE_S`` for it to show."""
        import ray
        from ray.exceptions import RayActorError

        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                rank = pending[ref]
                raise TrainerRankDied(rank, None, _death(e, self.nodes[rank])) from e
            except Exception:  # noqa: BLE001 - another rank's error: the first one is reported
                pass


def _death(e: BaseException, node: str | None) -> str:
    """Ray's account of an actor's death, on one line, with the node it ran on (a node that
    left the cluster takes its ranks with it)."""
    text = " ".join(str(e).split())
    where = f" on node {node}" if node is not None else ""
    return f"its actor{where} died: {text[:300]}"
