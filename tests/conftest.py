"""The tiny run's warm-started model, built once for the durability and Ray runtime tests
(its cache is keyed by the model and task settings, which the tests share), and a random kit
model folder for tests that need a whole model folder but no trained one."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_run_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-run-cache")


@pytest.fixture(scope="session")
def kit_model(tmp_path_factory) -> Path:
    from tests.durable.whole import save_kit_model

    return save_kit_model(tmp_path_factory.mktemp("kit") / "model")
