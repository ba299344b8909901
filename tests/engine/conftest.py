"""Fixtures for the engine tests: tiny random HF folders and a started engine per kind.

The ``engine`` fixture is generic over engine kinds: it builds the engine with
``build_engine`` from config and yields an :class:`EngineCase`; contract tests use only the
protocol through it. Add a kind to ``ENGINE_KINDS`` (with its config in ``_engine_config``) to
run the contract tests against it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest

from rollstream.config.schema import EngineConfig, LocalEngineConfig
from rollstream.engine import Engine, build_engine
from tests.engine.helpers import MAX_SEQ_LEN, MAX_SLOTS, VOCAB, make_tiny_model

# The ray kind (the local engine in a Ray actor, behind the runtime's proxy) runs the same
# tests from tests/runtime/test_ray_contract.py: a module of its own, so that its Ray is not
# up while the vLLM cases run (a busier machine stalls vLLM's API server mid-stream).
# ``local_moe`` is the local engine serving a tiny Qwen2-MoE folder (routed experts and a
# shared expert) instead of the dense Qwen2 one.
ENGINE_KINDS = ["local", "local_moe", pytest.param("vllm", marks=pytest.mark.vllm)]


class EngineCase(NamedTuple):
    engine: Engine
    model_path: Path
    kind: str
    max_seq_len: int
    vocab_size: int


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-moe"), arch="qwen2_moe", seed=3)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=1, rope_theta=500000.0
    )


def _engine_config(kind: str) -> EngineConfig:
    local = LocalEngineConfig(max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, threads=1, device="cpu")
    return EngineConfig(kind=kind, local=local)


@contextlib.asynccontextmanager
async def engine_case(kind: str, request: pytest.FixtureRequest,
                      tiny_model_dir: Path) -> AsyncIterator[EngineCase]:
    """A started engine of ``kind`` for one test, closed (or reset, when shared) after it."""
    if kind == "vllm":  # one server per session, a fresh client per test (tests/vllm)
        from tests.vllm.shared import vllm_case

        async with vllm_case(request) as fields:
            yield EngineCase(kind="vllm", **fields)
        return
    if kind == "ray":  # a local engine in a Ray actor, shared by the module
        from tests.engine.ray_shared import ray_case

        async with ray_case(request, tiny_model_dir, _engine_config("local").local) as eng:
            yield EngineCase(engine=eng, model_path=tiny_model_dir, kind="ray",
                             max_seq_len=MAX_SEQ_LEN, vocab_size=VOCAB)
        return
    path = tiny_model_dir
    if kind == "local_moe":
        path = request.getfixturevalue("tiny_moe_dir")
    eng = build_engine(_engine_config(kind.removesuffix("_moe")), path, engine_id=f"{kind}-0")
    try:
        yield EngineCase(engine=eng, model_path=path, kind=kind,
                         max_seq_len=MAX_SEQ_LEN, vocab_size=VOCAB)
    finally:
        await eng.close()


@pytest.fixture(params=ENGINE_KINDS)
async def engine(request: pytest.FixtureRequest, tiny_model_dir: Path):
    async with engine_case(request.param, request, tiny_model_dir) as case:
        yield case
