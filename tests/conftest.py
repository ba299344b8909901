"""The tiny run's warm-started model, built once for the durability and Ray runtime tests
(its cache is keyed by the model and task settings, which the tests share)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_run_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-run-cache")
