"""Tensors packed into buckets of a bounded size: the unit a broadcast sends and a
shared-memory file holds, so a sync's extra memory is one bucket however large the model.

:func:`plan_buckets` decides where each tensor goes; :func:`pack_bucket` fills a bucket's
flat byte buffer on a device and :func:`unpack_bucket` gives its tensors back as views of it.
The plan does not depend on the device: a broadcast over gloo (CPU buffers) and over NCCL
(CUDA buffers) sends the same buckets, so the CPU tests of the plan and of packing hold for
both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 64  # each tensor starts at a multiple of this in its bucket (dtype views)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One tensor's place in a bucket."""

    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    num_bytes: int
    entries: tuple[Entry, ...]


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Tensors in order, packed into buckets of at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own)."""
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if entries and size + n > bucket_bytes:
            buckets.append(Bucket(num_bytes=size, entries=tuple(entries)))
            entries, size = [], 0
        entries.append(Entry(name=name, dtype=t.dtype, shape=tuple(t.shape), offset=size,
                             num_bytes=n))
        size += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    if entries:
        buckets.append(Bucket(num_bytes=size, entries=tuple(entries)))
    return tuple(buckets)


def pack_bucket(tensors: Mapping[str, torch.Tensor], bucket: Bucket,
                device: str = "cpu") -> torch.Tensor:
    """``bucket``'s flat byte buffer on ``device``, each of its tensors copied in at its
    offset (the gaps that align them are left unset: no reader looks at them)."""
    import torch

    buf = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
    for e in bucket.entries:
        t = tensors[e.name].detach().to(device).contiguous().reshape(-1)
        buf[e.offset:e.offset + e.num_bytes].copy_(t.view(torch.uint8))
    return buf


def unpack_bucket(buf: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The tensors of a filled bucket, as views of ``buf`` (on its device)."""
    import math

    out = {}
    for e in bucket.entries:
        flat = buf[e.offset:e.offset + e.num_bytes].view(e.dtype)
        assert flat.numel() == math.prod(e.shape), e
        out[e.name] = flat.view(e.shape)
    return out
