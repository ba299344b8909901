"""Fixtures for the vLLM engine tests: the session's shared server (see shared.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm import shared


@pytest.fixture
async def vllm_engine(request: pytest.FixtureRequest):
    """The engine that launched the session's server, at version 0 with nothing in flight."""
    engine = shared.owner(request)
    await shared.reset(engine)
    return engine


@pytest.fixture
def vllm_model_path(vllm_engine) -> Path:
    return shared.model_path()
