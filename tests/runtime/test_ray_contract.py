"""The engine contract tests (tests/engine/test_contract.py) against the ``ray`` kind: the
local engine in a Ray actor, behind the runtime's proxy (one local Ray and one actor for the
module, tests/engine/ray_shared.py).

A module of its own so that its Ray runs only while these tests do: alongside the vLLM
cases of the contract module, the extra processes slowed vLLM's API server enough that two
mid-stream cases skipped in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import engine_case, tiny_model_dir  # noqa: F401 (a fixture)
from tests.engine.test_contract import *  # noqa: F403 (the contract's tests)

pytestmark = pytest.mark.ray


@pytest.fixture
async def engine(request: pytest.FixtureRequest, tiny_model_dir: Path):  # noqa: F811
    async with engine_case("ray", request, tiny_model_dir) as case:
        yield case
