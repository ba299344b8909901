"""Engines that fail grey: UP by their health, yet every request fails at once.

The failing engine is the real vLLM adapter in front of a real HTTP server (the scripted
fake of tests/vllm/fake_server.py, the adapter's process edge) that answers every generate
request with HTTP 500 while its ``/health`` says 200; the healthy one is the real embedded
engine. Before the breaker, least-load routing sent the failing engine nearly every request
(it holds none: each fails at once) and the adapter reported its 500s as the request's fault,
so samples failed by the hundred and the run stopped as untrainable.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from rollstream.bench.tiny_run import GROUP, GROUPS, tiny_run_config
from rollstream.config import load_config
from rollstream.config.schema import EngineConfig, VllmEngineConfig
from rollstream.data.ledger import read_ledger
from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.vllm import VllmEngine, VllmServer, build_vllm_engine
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.sync.shm import WeightStore
from rollstream.models.warmstart import prepare_model
from rollstream.runtime import run as run_module
from rollstream.runtime.train import run_training
from tests.engine.helpers import make_tiny_model
from tests.vllm.fake_server import FakeVllm

STEPS = 6


@pytest.fixture
def failing_server():
    server = FakeVllm()
    server.generate_status = 500  # /health stays 200
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def grey_config(tmp_path_factory, tiny_run_cache: Path) -> Path:
    """The tiny run's config (the durability tests' model and tasks: their warm start is
    shared), with a quarantine short enough to be probed back several times."""
    root = tmp_path_factory.mktemp("grey")
    cfg = tiny_run_config("grey", root / "runs", steps=STEPS, checkpoint_every=0,
                          cache_dir=tiny_run_cache, max_slots=32,
                          rollout={"breaker": {"failures": 3, "quarantine_s": 0.5}})
    path = root / "config.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    loaded = load_config(path, [])
    prepare_model(loaded.model, loaded.tasks)  # the warm start, apart from the test's time
    return path


@pytest.mark.slow
def test_a_failing_engine_beside_a_healthy_one_trains_to_the_end_with_no_sample_failed(
        grey_config: Path, failing_server: FakeVllm, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The vLLM engine answers HTTP 500 to everything, first in the engine order (ties of
    least-load go to it), beside a healthy embedded engine: the run trains every step, no
    sample fails, the failing engine is quarantined and probed back (and quarantined again)."""
    run_cfg = load_config(grey_config, [])
    run_dir = Path(run_cfg.run_root) / run_cfg.name
    built: list = []

    def engines(cfg, weights, *, version, run_dir, training):  # failing, healthy
        from rollstream.engine.local import LocalEngine

        failing = build_vllm_engine(EngineConfig(kind="vllm", vllm=VllmEngineConfig(
            urls=(failing_server.url,), startup_timeout_s=30)), weights, engine_id="vllm-0",
            version=version)
        healthy = LocalEngine(weights, cfg.engine.local, engine_id="local-1", version=version,
                              training=training)
        built.extend([failing, healthy])
        return built, None

    monkeypatch.setattr(run_module, "build_engines", engines)
    with caplog.at_level(logging.WARNING, logger="rollstream.rollout.routing"):
        summary = run_training(run_cfg)

    assert summary["steps"] == STEPS
    rows = read_ledger(run_dir / "ledger.jsonl")
    failed = [r for r in rows if r.status == "failed"]
    assert not failed, failed[:3]
    assert sum(r.status == "trained" for r in rows) >= STEPS * GROUPS * GROUP // 2
    quarantines = [m for m in caplog.messages if m.startswith("engine vllm-0 quarantined")]
    assert quarantines and "HTTP 500" in quarantines[0], caplog.messages
    assert len(quarantines) >= 2, "probed back after quarantine_s, and quarantined again"
    spans = [json.loads(line) for line in
             (run_dir / "timeline.jsonl").read_text().splitlines()]
    on_failing = [s for s in spans if s["engine_id"] == "vllm-0"]
    assert on_failing and all(s["num_tokens"] == 0 for s in on_failing)
    assert len(on_failing) == failing_server.num_generate < len(spans) / 4, \
        (len(on_failing), len(spans))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("grey-model"))


async def _attached(server: FakeVllm, model_dir: Path, tmp_path: Path) -> VllmEngine:
    return await asyncio.to_thread(
        VllmEngine, VllmServer(cfg=VllmEngineConfig(), attach_url=server.url),
        engine_id="vllm-0", version=0, checkpoint=CheckpointSpec.from_folder(model_dir),
        store=WeightStore(root=tmp_path / "w"), capacity=4, startup_timeout_s=5.0,
        health_period_s=0.5)


@pytest.mark.parametrize("status, engine_fault", [(500, True), (503, True), (429, True),
                                                  (400, False), (422, False)])
async def test_the_vllm_adapter_tells_the_servers_fault_from_the_requests(
        failing_server: FakeVllm, model_dir: Path, tmp_path: Path, status: int,
        engine_fault: bool) -> None:
    """An HTTP 5xx (or 429) while /health answers is the engine's fault: ABORT with the answer
    (retried elsewhere), the engine UP; a 4xx is the request's: ERROR (the sample fails)."""
    failing_server.generate_status = status
    engine = await _attached(failing_server, model_dir, tmp_path)
    try:
        out = await engine.generate(GenerateRequest(request_id="r", prompt_ids=[1, 2, 3],
                                                    params=SamplingParams(max_new_tokens=4)))
        assert out.finish_reason is (FinishReason.ABORT if engine_fault else FinishReason.ERROR)
        assert out.engine_fault is engine_fault
        assert f"HTTP {status}" in (out.error or "") and out.token_ids == []
        assert engine.stats().health.value == "up" and engine.num_restarts == 0
    finally:
        await engine.close()


async def test_a_request_the_engine_failed_goes_on_another_engine_with_its_tokens(
        model_dir: Path, tmp_path: Path) -> None:
    """A stream that breaks after two tokens while the server stays healthy (the engine's
    fault): the sample keeps those tokens (with their logprobs and versions) and continues on
    the other engine, although the one that failed it is the least loaded and first in order
    (before, the retry went back to it)."""
    from rollstream.clock import WallClock
    from rollstream.config import RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import Group, SampleStatus, Task

    server = FakeVllm()
    server.start()
    flaky = await _attached(server, model_dir, tmp_path)
    healthy = await asyncio.to_thread(LocalEngine, model_dir, LocalEngineConfig(max_slots=4),
                                      engine_id="local-1")

    async def reward(task: Task, text: str) -> float:
        return 0.0

    graders = GraderPool(RewardConfig(), lambda task, r=get_reward(reward): r)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    dispatcher = Dispatcher(engines=[flaky, healthy], params=SamplingParams(max_new_tokens=8),
                            graders=graders, decode=lambda ids: "", clock=WallClock(),
                            lifecycle=Lifecycle(ledger, WallClock()))
    task = Task(uid="t/0", source="t", prompt_ids=(1, 2, 3), prompt_text="", reference="")
    sample = Group.new(task, 1, k=0).samples[0]
    dispatcher.lifecycle.open(sample)
    try:
        run = asyncio.create_task(dispatcher.run_sample(sample))
        wire = await server.stream_of(f"{sample.uid}@0")
        server.push(wire, [11, 12])
        await asyncio.sleep(0.2)
        server.cut(wire)
        await asyncio.wait_for(run, 30)
    finally:
        await flaky.close()
        await healthy.close()
        graders.close()
        server.stop()
    assert sample.status is SampleStatus.GENERATED and sample.engine_id == "local-1"
    assert sample.response_ids[:2] == [11, 12] and len(sample.response_ids) > 2
    assert sample.logprobs[:2] == [-0.11, -0.12] and sample.versions[:2] == [0, 0]
    assert sample.num_interrupts == 1 and dispatcher.stats.num_engine_failures == 1
    assert server.num_generate == 1  # the retry did not go back to the engine that failed it
