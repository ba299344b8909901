"""Engine actors that join a live run (``runtime/fleet.py``; ``rollstream engines --add``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.runtime.ray.engine_actor import spawn_actor
from rollstream.runtime.ray.engines import RayEngine

if TYPE_CHECKING:
    from rollstream.config.schema import RunConfig


def join_run_engines(cfg: RunConfig, model_path: Path, *, version: int,
                     like: RayEngine) -> Callable[[int], RayEngine]:
    """What makes engine actor ``index`` that joins a live run, serving ``model_path`` tagged
    ``version`` as ``build_run_engines`` made the first ones, sharing ``like``'s (one of them)
    weight transport and record of episodes. Placed where Ray finds
    ``runtime.ray.engine_num_cpus`` (the run's scale units were reserved for its first engines)
    on a node of ``runtime.ray.nodes.engines`` where set, which go back to Ray when it leaves."""
    from rollstream.runtime.placement import placed_engine
    from rollstream.runtime.ray.nodes import role_resources

    ray = cfg.runtime.ray
    resources = role_resources(ray.nodes, "engines")
    engine_cfg = placed_engine(cfg)

    def make(index: int) -> RayEngine:
        engine_id = f"ray-{index}"

        def spawn(v: int) -> object:
            return spawn_actor(model_path, engine_cfg, engine_id=engine_id, version=v,
                               num_cpus=ray.engine_num_cpus, strategy=None,
                               resources=resources,
                               episode_cache_tokens=ray.episode_cache_tokens,
                               out_of_band_bytes=ray.out_of_band_bytes)
        return like.sibling(engine_id, spawn, version)
    return make
