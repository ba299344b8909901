"""The benchmarks' runs start warm here (tests/warm.py): a smoke test of a benchmark checks
what it writes, not how long a ``rollstream train`` process takes to import torch."""

from __future__ import annotations

import pytest

from tests import warm


@pytest.fixture(autouse=True)
def _warm_bench_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollstream.bench import sampling

    monkeypatch.setattr(sampling, "start_train", warm.start_train)
