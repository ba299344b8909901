"""Fixtures for the engine tests: tiny random HF folders and a started engine per kind.

The ``engine`` fixture is generic over engine kinds: it builds the engine with
``build_engine`` from config and yields an :class:`EngineCase`; contract tests use only the
protocol through it. Add a kind to ``ENGINE_KINDS`` (with its config in ``_engine_config``) to
run the contract tests against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from rollstream.config.schema import EngineConfig, LocalEngineConfig
from rollstream.engine import Engine, build_engine
from tests.engine.helpers import MAX_SEQ_LEN, MAX_SLOTS, VOCAB, make_tiny_model

# ray: the local engine in a Ray actor, behind the runtime's proxy (tests/engine/ray_shared.py)
ENGINE_KINDS = ["local", pytest.param("vllm", marks=pytest.mark.vllm),
                pytest.param("ray", marks=pytest.mark.ray)]


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
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=1, rope_theta=500000.0
    )


def _engine_config(kind: str) -> EngineConfig:
    local = LocalEngineConfig(max_slots=MAX_SLOTS, max_seq_len=MAX_SEQ_LEN, threads=1, device="cpu")
    return EngineConfig(kind=kind, local=local)


@pytest.fixture(params=ENGINE_KINDS)
async def engine(request: pytest.FixtureRequest, tiny_model_dir: Path):
    if request.param == "vllm":  # one server per session, a fresh client per test (tests/vllm)
        from tests.vllm.shared import vllm_case

        async with vllm_case(request) as fields:
            yield EngineCase(kind="vllm", **fields)
        return
    if request.param == "ray":  # a local engine in a Ray actor, shared by the session
        from tests.engine.ray_shared import ray_case

        async with ray_case(request, tiny_model_dir, _engine_config("local").local) as eng:
            yield EngineCase(engine=eng, model_path=tiny_model_dir, kind="ray",
                             max_seq_len=MAX_SEQ_LEN, vocab_size=VOCAB)
        return
    eng = build_engine(_engine_config(request.param), tiny_model_dir,
                       engine_id=f"{request.param}-0")
    try:
        yield EngineCase(
            engine=eng,
            model_path=tiny_model_dir,
            kind=request.param,
            max_seq_len=MAX_SEQ_LEN,
            vocab_size=VOCAB,
        )
    finally:
        await eng.close()
