"""One local Ray and one engine actor per test module, shared by the engine contract tests'
``ray`` kind (starting Ray costs ~10 s here, an actor ~4 s: its process imports torch). Each
test gets a fresh proxy (:class:`RayEngine`, its own request table) over that actor, reset to
nothing in flight and the folder's own weights at version 0, as a newly built engine has.
The Ray stops when the module's tests are done, before other modules start Ray runs of
their own (a run joins a Ray this process started already)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollstream.config.schema import LocalEngineConfig

_state: dict = {}


def _start(request: pytest.FixtureRequest, model_path: Path, cfg: LocalEngineConfig) -> None:
    from safetensors.torch import load_file

    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.engines import build_ray_engines
    from rollstream.sync.object_store import ObjectStore

    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    request.node.getparent(pytest.Module).addfinalizer(_stop(cluster))
    owner = build_ray_engines(model_path, cfg, num_engines=1, version=0, num_cpus=1)[0]
    _state.update(owner=owner, weights=ObjectStore(),
                  original=load_file(model_path / "model.safetensors"))


def _stop(cluster):
    def stop() -> None:
        _state.clear()
        cluster.stop()
    return stop


@contextlib.asynccontextmanager
async def ray_case(request: pytest.FixtureRequest, model_path: Path,
                   cfg: LocalEngineConfig) -> AsyncIterator:
    """A fresh proxy over the session's engine actor, at version 0 with nothing in flight."""
    from rollstream.runtime.ray.engines import RayEngine

    if "owner" not in _state:
        _start(request, model_path, cfg)
    owner = _state["owner"]
    engine = RayEngine(engine_id="ray-0", spawn=owner._spawn, weights=_state["weights"],
                       version=0, max_restarts=0, actor=owner.actor)
    await engine.interrupt()
    await engine.load_weights(0, _state["original"])
    yield engine
    await engine.interrupt()  # the actor stays up for the next test
