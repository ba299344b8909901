"""A kit model (char tokenizer, ChatML template) and an embedded engine on it, for the agent
tests that generate for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.config.schema import EngineConfig, LocalEngineConfig, TinyModelConfig
from rollstream.engine import build_engine
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, max_position=512, seed=3)
    return build_tiny_model(cfg, build_char_tokenizer(), tmp_path_factory.mktemp("agent-model"))


@pytest.fixture
async def engine(model_dir):
    cfg = EngineConfig(kind="local", local=LocalEngineConfig(max_slots=16, max_seq_len=512,
                                                             threads=1, device="cpu"))
    eng = build_engine(cfg, model_dir, engine_id="local-0")
    yield eng
    await eng.close()
