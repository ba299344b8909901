"""The vLLM engine serves training only with processed logprobs (the tempered, top-k/top-p
truncated distribution each token was drawn from): the launch flag, the config check, and
the boot check against a scripted server (the process edge; no vLLM needed)."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.config.loader import ConfigError, validate
from rollstream.config.schema import VllmEngineConfig
from rollstream.engine.vllm import VllmEngine, VllmServer, VllmServerError
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.sync.shm import WeightStore
from tests.engine.helpers import make_tiny_model
from tests.vllm.fake_server import FakeVllm


def test_launch_asks_for_processed_logprobs_and_config_cannot_override(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden_size=128)
    argv = VllmServer(cfg=VllmEngineConfig(), model_path=path,
                      log_path=tmp_path / "log").argv(1234)
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    for args in (["--logprobs-mode", "raw_logprobs"], ["--logprobs-mode=raw_logprobs"]):
        with pytest.raises(ConfigError, match="extra_args may not set --logprobs-mode"):
            validate({"engine": {"vllm": {"extra_args": args}}})


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
async def test_engine_refuses_a_server_without_processed_logprobs(tmp_path, mode):
    fake = FakeVllm()
    fake.logprobs_mode = mode  # e.g. a server someone started without the flag
    fake.start()
    try:
        def build() -> VllmEngine:
            return VllmEngine(
                VllmServer(cfg=VllmEngineConfig(), attach_url=fake.url), engine_id="vllm-0",
                version=0, checkpoint=CheckpointSpec.from_folder(make_tiny_model(tmp_path / "m")),
                store=WeightStore(root=tmp_path / "w"), capacity=4, startup_timeout_s=5.0)

        if mode == "processed_logprobs":
            engine = await asyncio.to_thread(build)
            await engine.close()
        else:
            with pytest.raises(VllmServerError, match="raw_logprobs.*not processed_logprobs"):
                await asyncio.to_thread(build)
    finally:
        fake.stop()
