"""What the control plane carries between the driver and one engine actor: the calls a
:class:`~rollstream.runtime.ray.engines.RayEngine` makes (``generate``, ``interrupt``,
``stats``, ``peek``) and the pickled size of their arguments and replies.

Ray pickles an actor call's arguments and its reply with pickle protocol 5 (cloudpickle,
which pickles an importable class by reference, as pickle does), so ``len(pickle.dumps(x,
protocol=5))`` is the payload each carries. Not counted: Ray's framing of each call (the
task spec, gRPC headers; ``wire_calls`` counts the calls it applies to) and weight loads
(their tensors are ``sync_s``'s and ``bench weightsync``'s; they go by
``runtime.ray.weight_sync``). There is no separate data plane yet (issue 13 item 5): token
arrays ride these calls, so what is counted here is everything a sample costs the actor
boundary besides weights. Pickling twice costs the driver a few microseconds a call.

The totals are reported in the proxy's ``EngineStats.work`` (so in ``summary.json``'s
``engines``, as training-phase deltas); they belong to the proxy, so they keep counting
across actor restarts.
"""

from __future__ import annotations

import pickle
from typing import Any

WIRE_KEYS = ("wire_calls", "wire_sent_bytes", "wire_received_bytes")


class WireMeter:
    def __init__(self) -> None:
        self.calls = self.sent_bytes = self.received_bytes = 0

    def call(self, *args: Any) -> None:
        """A call sent to the actor with these arguments."""
        self.calls += 1
        self.sent_bytes += sum(payload_bytes(a) for a in args)  # Ray pickles each alone

    def reply(self, value: Any) -> None:
        """The actor's reply to a call."""
        self.received_bytes += payload_bytes(value)

    def totals(self) -> dict[str, float]:
        return dict(zip(WIRE_KEYS, (float(self.calls), float(self.sent_bytes),
                                    float(self.received_bytes)), strict=True))


def payload_bytes(value: Any) -> int:
    """The bytes ``value`` pickles to, as Ray pickles an argument or a reply."""
    return len(pickle.dumps(value, protocol=5))
