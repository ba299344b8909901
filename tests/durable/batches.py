"""Fixed training batches shared by a test and the fresh process it starts."""

from __future__ import annotations

from tests.train.conftest import make_group


def batch(step: int):
    return [make_group(f"g{step}", [1, 2, 3 + step], [[4, 5, 6 + step], [8, 9]],
                       rewards=[1.0, 0.0], logprobs=[[-2.0] * 3, [-1.5] * 2]),
            make_group(f"h{step}", [11, 12], [[13 + step], [15, 16, 17, 18]],
                       rewards=[0.0, 1.0], logprobs=[[-1.0], [-2.5] * 4])]
