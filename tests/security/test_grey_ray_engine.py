"""An engine actor of the Ray runtime whose calls raise while it lives: the proxy reports the
engine's fault (ABORT with the cause, as the protocol says, never an exception) and the
engine stays UP, so that the router's breaker, not the proxy, decides whether to route to it.
The actor is the real one (a local engine in its own process) with its generate call made to
raise once: the fault is at the process edge, everything around it real."""

from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine import EngineHealth, FinishReason, GenerateRequest, SamplingParams
from rollstream.runtime.ray.engine_actor import EngineActor
from tests.engine.helpers import make_tiny_model

pytestmark = pytest.mark.ray


class FlakyActor(EngineActor):
    """The engine actor, whose first generate call raises."""

    calls = 0

    async def generate(self, call, prompt):
        FlakyActor.calls += 1
        if FlakyActor.calls == 1:
            raise RuntimeError("injected: the actor's call raised")
        return await super().generate(call, prompt)


async def test_an_actor_whose_call_raises_is_an_engine_fault_and_stays_up(tmp_path: Path) -> None:
    import ray

    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.engines import RayEngine
    from rollstream.sync.object_store import ObjectStore

    model = make_tiny_model(tmp_path / "model")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need no tests/
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        def spawn(version: int):
            return ray.remote(FlakyActor).options(num_cpus=1, max_concurrency=100).remote(
                str(model), LocalEngineConfig(max_slots=4), "ray-0", version, 1 << 16, 1 << 20)

        engine = RayEngine(engine_id="ray-0", spawn=spawn, weights=ObjectStore(),
                           version=0, max_restarts=1)
        request = GenerateRequest(request_id="r0", prompt_ids=[1, 2, 3],
                                  params=SamplingParams(max_new_tokens=4, temperature=0))
        out = await engine.generate(request)
        assert out.finish_reason is FinishReason.ABORT and out.engine_fault
        assert "ray engine ray-0 raised RuntimeError" in out.error and "injected" in out.error
        assert engine.stats().health is EngineHealth.UP and not engine.needs_restart()
        again = await engine.generate(GenerateRequest(request_id="r1", prompt_ids=[1, 2, 3],
                                                      params=request.params))
        assert again.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert again.token_ids and engine.num_restarts == 0
        await engine.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        cluster.stop()
