"""``broadcast``: a version reaches engine actors over one gloo (or NCCL) group, in byte
buckets.

The group holds this process (rank 0) and every live engine actor; the state dict goes as
flat byte buckets of at most ``bucket_bytes``, one ``broadcast`` each, and each actor
rebuilds the tensors as views of its buckets. The round's :class:`BroadcastRound` (the
payload's header and the bucket plan) reaches each actor's ``install`` beside it.

The group is formed at the first sync and formed again when its members change (an actor died
or was replaced), under a new key prefix of one TCP store this process serves (bound to the
node's address: 127.0.0.1 for a local Ray). With ``runtime.ray.broadcast_backend: nccl`` the
group is NCCL's and the buckets are CUDA buffers (the driver's and each actor's current
device): the same bucket plan, packed and unpacked by the same code (``buckets.py``) on
another device. A round whose broadcast fails (a member died
during it; gloo notices within the group's timeout, ``GROUP_TIMEOUT_S``, so such a round
stalls up to that long) installs the version through the object store on the actors still
alive, and the next round forms a new group. Rounds never overlap (one lock on each side). A
replaced actor (``revive``) gets the current version through the object store: it is one
actor, once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rollstream.sync.buckets import Bucket, pack_bucket, plan_buckets, unpack_bucket
from rollstream.sync.object_store import ObjectStore
from rollstream.sync.protocol import Destination, Header, Payload, check

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
GROUP_TIMEOUT_S = 30.0  # a rendezvous or one bucket's broadcast waiting longer lost a member
DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # where a backend's buckets live


def make_group(store: Any, prefix: str, rank: int, world: int, host: str,
               timeout_s: float, backend: str = "gloo") -> Any:
    """A gloo (or NCCL) process group of ``world`` ranks (not torch.distributed's default
    group, so it lives beside any other), gloo's pairs on ``host``'s address; blocks until all
    ranks join."""
    import torch.distributed as dist

    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world, nccl)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, opts)


def join_group(store_host: str, store_port: int, prefix: str, rank: int, world: int,
               timeout_s: float, backend: str = "gloo") -> Any:
    """An actor's side of :func:`make_group` (blocking: run it off the event loop)."""
    import ray
    import torch.distributed as dist

    store = dist.TCPStore(store_host, store_port, world, False, timedelta(seconds=timeout_s))
    return make_group(store, prefix, rank, world, ray.util.get_node_ip_address(), timeout_s,
                      backend)


def send_buckets(group: Any, tensors: Mapping[str, torch.Tensor],
                 plan: tuple[Bucket, ...], device: str = "cpu") -> None:
    """Rank 0's side of a round: fill each bucket on ``device`` and broadcast it
    (blocking)."""
    import torch.distributed as dist

    for bucket in plan:
        group.broadcast([pack_bucket(tensors, bucket, device)], dist.BroadcastOptions()).wait()


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastRound:
    """:class:`~rollstream.sync.protocol.Delivery` of a broadcast: what the buckets of the
    round hold; ``open`` receives them (the actor's side of the round)."""

    header: Header
    plan: tuple[Bucket, ...]
    device: str = "cpu"  # where the buckets are received (the group's backend's device)

    def open(self, group: Any) -> Payload:
        check(self.header.protocol, self.header.kind)
        if group is None:
            raise RuntimeError("a broadcast round reached an actor that joined no group")
        return Payload(header=self.header,
                       tensors=receive_buckets(group, self.plan, self.device))


def receive_buckets(group: Any, plan: tuple[Bucket, ...],
                    device: str = "cpu") -> dict[str, torch.Tensor]:
    """An actor's side of a round: the tensors, as views of the received buckets."""
    import torch
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for bucket in plan:
        buf = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
        group.broadcast([buf], dist.BroadcastOptions()).wait()
        out.update(unpack_bucket(buf, bucket))
    return out


class Broadcast:
    """:class:`~rollstream.sync.protocol.Transport` over one gloo (or NCCL) group of this
    process and the live engine actors (module docstring)."""

    name = "broadcast"

    def __init__(self, bucket_bytes: int, timeout_s: float = GROUP_TIMEOUT_S,
                 backend: str = "gloo") -> None:
        """``timeout_s``: how long a rendezvous or one bucket's broadcast waits for every
        member (a member that died mid-round stalls that round this long); ``backend``:
        ``gloo`` or ``nccl`` (``runtime.ray.broadcast_backend``)."""
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.backend, self.device = backend, DEVICES[backend]
        self.members: Callable[[], dict[str, Any]] = dict  # engine id -> live actor
        self.fallback = ObjectStore()
        self._group: Any = None
        self._group_actors: dict[str, Any] = {}
        self._generation = 0
        self._store: Any = None  # the TCP store of the groups' rendezvous (this side)
        self._round: tuple[Mapping[str, torch.Tensor], asyncio.Future] | None = None
        self._one_at_a_time = asyncio.Lock()  # rounds of different tensors never overlap

    async def send(self, payload: Payload, to: Destination) -> None:
        version = payload.version
        if self._round is None or self._round[0] is not payload.tensors:
            self._round = (payload.tensors, asyncio.ensure_future(self._broadcast(payload)))
        try:
            refs = await asyncio.shield(self._round[1])
        except Exception as e:  # noqa: BLE001 - fault boundary: the group could not form
            # (a member is gone); this version goes through the object store
            log.warning("weights v%d: no broadcast group (%s); through the object store",
                        version, e)
            refs = {}
        member, ref = refs.get(to.engine_id, (None, None))
        if member is to.actor:
            try:
                await ref
                return
            except Exception as e:  # noqa: BLE001 - fault boundary: this actor died, or a
                # peer did mid-broadcast; the object store tries it once more
                self._group = None
                log.warning("weights v%d to %s: broadcast failed (%s); through the object "
                            "store", version, to.engine_id, e)
        await self.fallback.send(payload, to)

    async def revive(self, payload: Payload, to: Destination) -> None:
        await self.fallback.send(payload, to)

    async def _broadcast(self, payload: Payload) -> dict[str, tuple[Any, Any]]:
        async with self._one_at_a_time:  # (weight sync sends one version at a time anyway)
            return await self._broadcast_now(payload)

    async def _broadcast_now(self, payload: Payload) -> dict[str, tuple[Any, Any]]:
        members = self.members()
        if self._group is None or members.keys() != self._group_actors.keys() or any(
                a is not self._group_actors[k] for k, a in members.items()):
            await self._form(members)
        delivery = self.round(payload)
        plan = delivery.plan
        refs = {k: (a, a.install.remote(delivery)) for k, a in members.items()}
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(send_buckets, self._group, payload.tensors, plan,
                                    self.device)
        except Exception as e:  # noqa: BLE001 - fault boundary: each receiver's call fails
            self._group = None  # too, and its load falls back to the object store
            log.warning("weights v%d: broadcast failed (%s)", payload.version, e)
        log.info("weights v%d: %d bytes in %d buckets broadcast to %d actors in %.3f s",
                 payload.version, sum(b.num_bytes for b in plan), len(plan), len(members),
                 time.perf_counter() - t0)
        return refs

    def round(self, payload: Payload) -> BroadcastRound:
        """What a round of ``payload`` tells each actor: its header, the bucket plan (the
        same whichever the backend) and the device the buckets are received on."""
        return BroadcastRound(header=payload.header, device=self.device,
                              plan=plan_buckets(payload.tensors, self.bucket_bytes))

    async def _form(self, members: dict[str, Any]) -> None:
        import ray
        import torch.distributed as dist

        self._group, self._group_actors = None, {}
        host = ray.util.get_node_ip_address()
        if self._store is None:
            sock = socket.socket()  # bound here: TCPStore itself would listen on every address
            sock.bind((host, 0))
            sock.listen()
            self._store = dist.TCPStore(host, sock.getsockname()[1], None, True,
                                        timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()  # the store owns the socket now and closes it when it goes
        self._generation += 1
        prefix, world, port = f"g{self._generation}", len(members) + 1, self._store.port
        joins = [asyncio.wrap_future(a.join_weight_group.remote(
            host, port, prefix, rank, world, self.timeout_s, self.backend).future())
            for rank, a in enumerate(members.values(), start=1)]
        driver = asyncio.ensure_future(asyncio.to_thread(
            make_group, self._store, prefix, 0, world, host, self.timeout_s, self.backend))
        driver.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if left
        # A member that died fails its join at once, while the driver's rendezvous would wait
        # for it until timeout_s: the first failure ends the attempt (that thread ends
        # at its timeout; the next attempt uses a new prefix).
        done, _ = await asyncio.wait([driver, *joins], return_when=asyncio.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        await asyncio.gather(driver, *joins)
        self._group, self._group_actors = driver.result(), dict(members)

    def close(self) -> None:
        self._group, self._group_actors, self._store, self._round = None, {}, None, None
        self.fallback.close()
