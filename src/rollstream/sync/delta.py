"""Versioned delta sync: an engine that holds version ``v`` receives only what changed from
``v`` to the next version, taken in the engine's dtype, over any engine-actor transport.

:class:`DeltaSync` wraps the run's transport (``runtime.ray.delta: true``, the default). Per
version it casts the trainer's tensors once to the engine's dtype (what the engine stores:
a ``bfloat16`` engine rounds each value exactly as its own ``copy_`` would) and compares
them, bit for bit, with the previous version's. Per tensor the changed elements go as their flat
indices (``NAME.@idx``, int32) and new values (``NAME.@val``), or the whole tensor when that
is smaller; unchanged tensors do not go at all. The payload is a ``delta`` from ``base`` (the
previous version) when at most half of all elements changed; otherwise the version goes
``full``. With AdamW nearly every fp32 element moves each step, so an fp32 engine mostly
gets full versions; in ``bfloat16`` most small moves round to the same value.

Who gets what: a destination known to hold ``base`` (it installed it through this wrapper)
gets the delta; one on its first load, one that missed the previous version, and a replaced
actor (``revive``) get the full version in the engine's dtype. The receiver
(:func:`receive`, in the engine actor) applies a delta only to the version it names, and the
result is the full state dict the engine's ``load_weights`` checks and installs: the weights
after a delta equal a full sync's, bit for bit (``tests/sync/test_delta.py``).

Every send is logged with the transport, the payload's kind, its bytes and their dtype, and
kept in :attr:`DeltaSync.records` (``bench weightsync``'s delta rows read them); each
engine's totals (loads by kind, bytes) are in its ``EngineStats.work``, so in a run's
``summary.json``. vLLM's
reload takes whole weights (``vllm.py``): its engines always load ``full``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollstream.sync.protocol import (
    Destination,
    Header,
    Payload,
    SyncRecord,
    Transport,
    payload_bytes,
)

__all__ = ["DeltaSync", "SyncRecord", "apply", "encode", "payload_bytes", "receive"]

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
IDX, VAL = ".@idx", ".@val"  # suffixes of a sparse tensor's indices and values
MAX_CHANGED = 0.5  # above this share of changed elements a version goes full
TOTAL_KEYS = ("weight_loads_full", "weight_loads_delta", "weight_bytes")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its element size: equal bits, not equal values (-0.0, NaN)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()])


def encode(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
           version: int, base_version: int) -> Payload | None:
    """The ``delta`` payload that turns ``base`` into ``new`` (same names, shapes, dtypes),
    or None when more than :data:`MAX_CHANGED` of the elements changed (or the names,
    shapes or dtypes differ): then the version goes full."""
    import torch

    if base.keys() != new.keys():
        return None
    out: dict[str, torch.Tensor] = {}
    limit = MAX_CHANGED * sum(t.numel() for t in new.values())
    changed = 0
    for name, t in new.items():
        b = base[name]
        if b.shape != t.shape or b.dtype != t.dtype:
            return None
        mask = _bits(t) != _bits(b)
        k, n, size = int(torch.count_nonzero(mask)), t.numel(), t.element_size()
        changed += k
        if changed > limit:  # full: stop comparing
            return None
        if k == 0:
            continue
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        if k * (index_dtype.itemsize + size) >= n * size:  # sparse would cost more
            out[name] = t
        else:
            idx = mask.nonzero().squeeze(1)
            out[name + IDX] = idx.to(index_dtype)
            out[name + VAL] = t.reshape(-1)[idx]
    return Payload(header=Header.describe(version, "delta", out, base=base_version),
                   tensors=out)


def apply(payload: Payload, served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full state dict of ``payload.version``: ``served`` (the weights of its base, not
    modified) with the delta's tensors in place. ValueError for a name the engine does not
    serve or a dtype other than the served one."""
    import torch

    out = dict(served)
    tensors = payload.tensors
    for name, t in tensors.items():
        if name.endswith(IDX):
            continue
        target = name.removesuffix(VAL)
        cur = served.get(target)
        if cur is None:
            raise ValueError(f"delta v{payload.version}: weight {target} is not served here")
        if t.dtype != cur.dtype:
            raise ValueError(f"delta v{payload.version}: {target} comes as {t.dtype}, the "
                             f"engine serves {cur.dtype} (deltas are in the engine's dtype)")
        if name.endswith(VAL):
            whole = cur.clone(memory_format=torch.contiguous_format)
            whole.view(-1)[tensors[target + IDX].to(cur.device).long()] = t.to(cur.device)
            out[target] = whole
        else:
            out[target] = t
    return out


def receive(payload: Payload, *, held: int,
            served: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """What an engine at version ``held`` serving ``served`` installs of ``payload``: its
    tensors (full) or the delta applied (ValueError when ``held`` is not its base)."""
    if payload.header.kind != "delta":
        return payload.tensors
    if payload.header.base != held:
        raise ValueError(f"a delta from v{payload.header.base} to v{payload.version} reached "
                         f"an engine at v{held}; it needs the full version")
    return apply(payload, served)


@dataclass(slots=True, kw_only=True)
class _Version:
    source: Mapping[str, torch.Tensor]  # the trainer's tensors, by identity
    full: Payload  # in the engine's dtype
    delta: Payload | None  # from the version before, if small enough


class DeltaSync:
    """:class:`~rollstream.sync.protocol.Transport` that sends each engine a delta when it
    holds the previous version, the full version otherwise (module docstring)."""

    def __init__(self, inner: Transport, *, dtype: str, name: str) -> None:
        """``dtype``: the engines' (``engine.local.dtype``); ``name``: ``inner``'s, for the
        log and :attr:`records`."""
        self.inner, self.dtype, self.name = inner, dtype, name
        self.held: dict[str, int] = {}  # engine id -> the version it installed from here
        self.records: deque[SyncRecord] = deque(maxlen=1024)  # the latest sends (bounded)
        self.last: dict[str, SyncRecord] = {}  # engine id -> its latest send
        self._totals: dict[str, dict[str, float]] = {}  # engine id -> totals() of it
        self._current: _Version | None = None

    def _version(self, payload: Payload) -> _Version:
        """The full and delta payloads of ``payload``'s version, made at its first send."""
        import torch

        cur = self._current
        if cur is not None and cur.source is payload.tensors:
            return cur
        dtype = getattr(torch, self.dtype)
        cast = {k: t.detach().to("cpu", dtype).contiguous() for k, t in payload.tensors.items()}
        full = Payload.full(payload.version, cast)
        delta = None
        if cur is not None and cur.full.version < payload.version:
            delta = encode(cur.full.tensors, cast, version=payload.version,
                           base_version=cur.full.version)
        self._current = _Version(source=payload.tensors, full=full, delta=delta)
        return self._current

    def name_for(self, to: Destination) -> str:
        """The transport ``to`` gets: the inner one's choice where it chooses per destination
        (``auto``), else its name."""
        pick = getattr(self.inner, "name_for", None)
        return self.name if pick is None else pick(to)

    async def send(self, payload: Payload, to: Destination) -> None:
        v = self._version(payload)
        held = self.held.pop(to.engine_id, None)  # unknown until this send succeeds
        use = v.delta if v.delta is not None and v.delta.header.base == held else v.full
        await self._send(use, v.full, to, revive=False)

    async def revive(self, payload: Payload, to: Destination) -> None:
        v = self._version(payload)
        self.held.pop(to.engine_id, None)
        await self._send(v.full, v.full, to, revive=True)

    async def _send(self, payload: Payload, full: Payload, to: Destination, *,
                    revive: bool) -> None:
        t0 = time.perf_counter()
        await (self.inner.revive if revive else self.inner.send)(payload, to)
        self.held[to.engine_id] = payload.version
        record = SyncRecord(version=payload.version, engine_id=to.engine_id,
                            transport=self.name_for(to), kind=payload.header.kind,
                            num_bytes=payload_bytes(payload.tensors), dtype=self.dtype,
                            full_bytes=payload_bytes(full.tensors),
                            seconds=time.perf_counter() - t0)
        self.records.append(record)
        self.last[to.engine_id] = record
        totals = self._totals.setdefault(to.engine_id, dict.fromkeys(TOTAL_KEYS, 0.0))
        totals[f"weight_loads_{record.kind}"] += 1
        totals["weight_bytes"] += record.num_bytes
        since = f" from v{payload.header.base}" if payload.header.base is not None else ""
        log.info("weights v%d to %s over %s: %s%s, %d bytes of %s (full: %d), %.3f s",
                 record.version, record.engine_id, record.transport, record.kind, since,
                 record.num_bytes, record.dtype, record.full_bytes, record.seconds)

    def totals(self, engine_id: str) -> dict[str, float]:
        """What was sent to ``engine_id`` so far: loads by kind and tensor bytes (in the
        engines' dtype), reported in its ``EngineStats.work``."""
        return dict(self._totals.get(engine_id) or dict.fromkeys(TOTAL_KEYS, 0.0))

    def close(self) -> None:
        self.inner.close()
        self.held.clear()
        self._current = None
