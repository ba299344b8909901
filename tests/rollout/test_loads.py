"""The load index picks what a scan of every engine would: the least loaded admitted engine,
ties to the first in order."""

from __future__ import annotations

import random

from rollstream.rollout.loads import LoadIndex


class _E:
    def __init__(self, i: int) -> None:
        self.i = i


def test_least_matches_a_scan_under_random_changes_and_refusals():
    rng = random.Random(0)
    engines = [_E(i) for i in range(13)]
    index: LoadIndex[_E] = LoadIndex(engines)
    load = [0] * len(engines)
    for _ in range(20_000):
        e = rng.choice(engines)
        if rng.random() < 0.55 or load[e.i] == 0:
            index.add(e, 1)
            load[e.i] += 1
        else:
            index.add(e, -1)
            load[e.i] -= 1
        refused = set(rng.sample(range(len(engines)), rng.randint(0, len(engines))))
        ok = [x for x in engines if x.i not in refused]
        want = min(ok, key=lambda x: load[x.i]) if ok else None
        assert index.least(lambda x: x.i not in refused) is want
        assert index[e] == load[e.i]
    assert len(index._heap) <= 4 * len(engines) + 64  # stale entries are compacted
