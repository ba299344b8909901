"""What crosses the boundary between the driver and one engine actor, on each plane: the
calls a :class:`~rollstream.runtime.ray.engines.RayEngine` makes (``generate``, ``interrupt``,
``poll``, ``peek``) and the pickled size of their arguments and replies (the **control
plane**, ``wire_*``), and the token payloads that went out of band through Ray's object store
(the **data plane**, ``data_*``: their packed bytes; ``dataplane.py``).

Ray pickles an actor call's arguments and its reply with pickle protocol 5 (cloudpickle,
which pickles an importable class by reference, as pickle does), so ``len(pickle.dumps(x,
protocol=5))`` is the payload each carries; an object reference in it counts as its 28-byte
id (Ray adds its owner's address, and its framing of each call: the task spec, gRPC headers;
``wire_calls`` counts the calls those apply to). A payload small enough to ride its call is
control-plane bytes. Weight loads are not counted (their tensors are ``sync_s``'s and
``bench weightsync``'s; they go by ``runtime.ray.weight_sync``). Pickling twice costs the
driver a few microseconds a call.

Also counted: ``episode_reused_tokens``, prompt tokens not sent because the actor held the
episode's history, and ``episode_misses``, calls sent again whole because it no longer did.

The totals are reported in the proxy's ``EngineStats.work`` (so in ``summary.json``'s
``engines``, as training-phase deltas); they belong to the proxy, so they keep counting
across actor restarts.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

from rollstream.runtime.ray.dataplane import Tokens, is_ref, offload

WIRE_KEYS = ("wire_calls", "wire_sent_bytes", "wire_received_bytes")
DATA_KEYS = ("data_objects", "data_sent_bytes", "data_received_bytes")
EPISODE_KEYS = ("episode_reused_tokens", "episode_misses")
METER_KEYS = WIRE_KEYS + DATA_KEYS + EPISODE_KEYS


class WireMeter:
    def __init__(self) -> None:
        self.calls = self.sent_bytes = self.received_bytes = 0
        self.data_objects = self.data_sent_bytes = self.data_received_bytes = 0
        self.reused_tokens = self.episode_misses = 0

    def call(self, *args: Any) -> None:
        """A call sent to the actor with these arguments."""
        self.calls += 1
        self.sent_bytes += sum(payload_bytes(a) for a in args)  # Ray pickles each alone

    def reply(self, value: Any) -> None:
        """The actor's reply to a call."""
        self.received_bytes += payload_bytes(value)

    def data_sent(self, num_bytes: int) -> None:
        """A payload put in the object store for the actor."""
        self.data_objects += 1
        self.data_sent_bytes += num_bytes

    def data_received(self, num_bytes: int) -> None:
        """A payload the actor put in the object store, fetched."""
        self.data_objects += 1
        self.data_received_bytes += num_bytes

    def send(self, blob: bytes, threshold: int) -> Any:
        """A payload for the actor: itself, or its reference when above ``threshold``."""
        sent = offload(blob, threshold)
        if sent is not blob:
            self.data_sent(len(blob))
        return sent

    async def receive(self, tokens: Any) -> Tokens:
        """A reply's tokens: themselves, or fetched by their reference."""
        if not is_ref(tokens):
            return tokens
        value = await tokens
        self.data_received(value.nbytes)
        return value

    def totals(self) -> dict[str, float]:
        values = (self.calls, self.sent_bytes, self.received_bytes, self.data_objects,
                  self.data_sent_bytes, self.data_received_bytes, self.reused_tokens,
                  self.episode_misses)
        return dict(zip(METER_KEYS, map(float, values), strict=True))


def payload_bytes(value: Any) -> int:
    """The bytes ``value`` pickles to, as Ray pickles an argument or a reply; an object
    reference in it (an argument, or a reply's ``tokens``) counted as its id (pickling a
    reference itself would register it with Ray)."""
    ref = _ref_type()
    if isinstance(value, ref):
        value = value.binary()
    elif isinstance(getattr(value, "tokens", None), ref):
        value = replace(value, tokens=value.tokens.binary())
    return len(pickle.dumps(value, protocol=5))


def _ref_type() -> type:
    from ray import ObjectRef

    return ObjectRef
