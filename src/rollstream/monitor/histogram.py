"""Fixed-bucket histograms for `Metrics.observe`.

Bucket edges are chosen once per name (so lines from different steps add up and the
Prometheus histogram and the JSONL agree): integer buckets for ``staleness*``, powers of two
for lengths (``len*`` and names with ``tokens``), tenths of [0, 1] for ``pass*``, ``reward*``
and ``*rate*``, and a 1-2-5 ladder otherwise. A value ``v``
lands in the first bucket whose upper edge satisfies ``v <= edge`` (Prometheus ``le``
semantics); values above the last edge land in a final overflow bucket, so
``len(counts) == len(edges) + 1``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

STALENESS_EDGES: tuple[float, ...] = tuple(float(i) for i in range(17)) + (24.0, 32.0, 64.0)
LENGTH_EDGES: tuple[float, ...] = tuple(float(2**i) for i in range(17))
UNIT_EDGES: tuple[float, ...] = tuple(i / 10 for i in range(11))
DEFAULT_EDGES: tuple[float, ...] = tuple(
    m * 10.0**e for e in range(-3, 6) for m in (1.0, 2.0, 5.0)
)


def edges_for(name: str) -> tuple[float, ...]:
    """Upper bucket edges for a histogram name (the part before any ``/source`` suffix)."""
    base = name.split("/", 1)[0]
    if base.startswith("staleness"):
        return STALENESS_EDGES
    if base.startswith("len") or "tokens" in base:
        return LENGTH_EDGES
    if base.startswith(("pass", "reward")) or "rate" in base:
        return UNIT_EDGES
    return DEFAULT_EDGES


@dataclass(slots=True, kw_only=True)
class Hist:
    """Counts of observed values in fixed buckets, plus count/sum/min/max."""

    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    num_values: int = 0
    total: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.edges) + 1)
        assert len(self.counts) == len(self.edges) + 1, "counts need one overflow bucket"

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.num_values += 1
        self.total += value
        self.lo = min(self.lo, value)
        self.hi = max(self.hi, value)

    def merge(self, counts: list[int], num_values: int, total: float) -> None:
        """Add another histogram's bucket counts (same edges)."""
        assert len(counts) == len(self.counts), "histograms with different edges"
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.num_values += num_values
        self.total += total

    def to_json(self) -> dict[str, object]:
        """The ``hist`` line body: edges, counts (last = overflow), count, sum, min, max."""
        return {
            "edges": list(self.edges),
            "counts": list(self.counts),
            "count": self.num_values,
            "sum": self.total,
            "min": self.lo if self.num_values else None,
            "max": self.hi if self.num_values else None,
        }
