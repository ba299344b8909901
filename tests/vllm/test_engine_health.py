"""The vLLM engine's health and broken-stream versions, against a scripted fake server (the
process edge; no vLLM needed, so these run in ``make test-fast`` too). The real server's
faults are in test_faults.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from safetensors.torch import load_file

from rollstream.config.schema import VllmEngineConfig
from rollstream.engine import EngineHealth, FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.vllm import VllmEngine, VllmServer
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.sync.shm import WeightStore
from tests.engine.helpers import make_tiny_model
from tests.vllm.fake_server import FakeVllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fake-vllm-model"))


@pytest.fixture
def fake():
    server = FakeVllm()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def engine(fake, model_dir, tmp_path):
    server = VllmServer(cfg=VllmEngineConfig(), attach_url=fake.url)
    eng = await asyncio.to_thread(
        VllmEngine, server, engine_id="vllm-0", version=0,
        checkpoint=CheckpointSpec.from_folder(model_dir), store=WeightStore(root=tmp_path / "w"),
        capacity=4, startup_timeout_s=2.0, health_period_s=0.5)
    yield eng
    await eng.close()


def _req(rid: str, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt or [1, 2, 3],
                           params=SamplingParams(max_new_tokens=50))


async def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _lp(tokens: list[int]) -> list[float]:
    return [-t / 100 for t in tokens]


async def test_a_broken_stream_keeps_only_tokens_whose_version_is_certain(engine, fake,
                                                                          model_dir):
    """Reload to 1 while ``a`` runs, with ``b`` sent while the server is paused for it, then
    a reload to 2. ``a`` ends normally: the server's spans label all its tokens. ``b``'s
    stream breaks: it keeps the tokens received before the reload to 2 resumed (sampled by 1
    for certain) and drops the later one (sampled by 1 or 2: nobody knows)."""
    weights = load_file(model_dir / "model.safetensors")
    a = asyncio.create_task(engine.generate(_req("a")))
    wire_a = await fake.stream_of("a")
    fake.push(wire_a, [11, 12])
    await _until(lambda: engine.stats().generated_tokens == 2)

    fake.reloads_go.clear()
    load1 = asyncio.create_task(engine.load_weights(1, weights))
    await _until(lambda: fake.calls[-1:] == ["reload"])  # paused, reload held
    b = asyncio.create_task(engine.generate(_req("b")))
    wire_b = await fake.stream_of("b")
    fake.reloads_go.set()
    await load1
    assert fake.calls[-4:] == ["pause", "reload", "version 1", "resume"]

    fake.push(wire_a, [13])  # a token sampled before the pause or after the resume
    fake.push(wire_b, [21, 22])  # b was sent paused: sampled by 1
    await _until(lambda: engine.stats().generated_tokens == 5)
    await engine.load_weights(2, weights)
    fake.push(wire_b, [23])  # sampled by 1 or 2
    await _until(lambda: engine.stats().generated_tokens == 6)
    fake.cut(wire_b)
    fake.push(wire_a, [14], finish="length", spans=[(0, 0, 3), (1, 3, 4)])

    out_a, out_b = await asyncio.gather(a, b)
    assert out_a.finish_reason is FinishReason.LENGTH
    assert (out_a.token_ids, out_a.versions) == ([11, 12, 13, 14], [0, 0, 0, 1])
    assert out_b.finish_reason is FinishReason.ABORT and "broke" in out_b.error
    assert (out_b.token_ids, out_b.logprobs, out_b.versions) == ([21, 22], _lp([21, 22]), [1, 1])
    assert engine.stats().health is EngineHealth.UP


async def test_health_recovering_then_up_then_dead_after_a_failed_restart(engine, fake,
                                                                         model_dir):
    assert engine.stats().health is EngineHealth.UP and engine.stats().health_reason is None
    weights = load_file(model_dir / "model.safetensors")
    await engine.load_weights(3, weights)

    # the server dies mid-stream: the request returns its tokens, the engine restarts it
    c = asyncio.create_task(engine.generate(_req("c")))
    wire = await fake.stream_of("c")
    fake.push(wire, [5, 6])
    await _until(lambda: engine.stats().generated_tokens == 2)
    fake.healthy = False
    fake.cut(wire)
    out = await c
    assert out.finish_reason is FinishReason.ABORT and "vllm-0 died" in out.error
    assert (out.token_ids, out.versions) == ([5, 6], [3, 3])
    stats = engine.stats()
    assert stats.health is EngineHealth.RECOVERING and "vllm-0 died" in stats.health_reason
    d = asyncio.create_task(engine.generate(_req("d")))  # waits for the restart
    await asyncio.sleep(0.3)
    assert not d.done()
    fake.healthy = True
    wire = await fake.stream_of("d")
    fake.push(wire, [7], finish="length", spans=[(3, 0, 1)])
    out = await d
    assert out.finish_reason is FinishReason.LENGTH and out.versions == [3]
    assert fake.calls[-2:] == ["reload", "version 3"]  # the latest weights were restored
    assert engine.stats().health is EngineHealth.UP and engine.num_restarts == 1

    # it dies again and does not come back within the startup timeout: DEAD for good
    e = asyncio.create_task(engine.generate(_req("e")))
    wire = await fake.stream_of("e")
    fake.healthy = False
    fake.cut(wire)
    out = await e
    assert out.finish_reason is FinishReason.ABORT and not out.token_ids
    await _until(lambda: engine.stats().health is not EngineHealth.RECOVERING)
    stats = engine.stats()
    assert stats.health is EngineHealth.DEAD and "could not be restarted" in stats.health_reason
    late = await engine.generate(_req("late"))
    assert late.finish_reason is FinishReason.ABORT and late.error == stats.health_reason
    bad = await engine.generate(_req("bad", prompt=[1] * 200))  # longer than the context
    assert bad.finish_reason is FinishReason.ERROR  # the request's own fault stays an error
    await engine.interrupt()  # nothing to stop
    with pytest.raises(RuntimeError, match="could not be restarted"):
        await engine.load_weights(4, weights)

    await engine.close()
    stats = engine.stats()
    assert stats.health is EngineHealth.DEAD
    closed = await engine.generate(_req("closed"))
    assert closed.finish_reason is FinishReason.ABORT and closed.error == stats.health_reason
    await engine.interrupt()
