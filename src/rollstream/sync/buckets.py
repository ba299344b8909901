"""Tensors packed into buckets of a bounded size: the unit a broadcast sends and a
shared-memory file holds, so a sync's extra memory is one bucket however large the model."""

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
