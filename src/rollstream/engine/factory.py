"""Every engine kind, in one place: the name ``engine.kind`` takes and what builds the kind,
in this process (:func:`build_engine`) and as the run's Ray actors (``runtime.kind: ray``,
``runtime/build.py``). A new kind is one entry in :data:`KINDS` (and its name in
``EngineConfig.kind``, which ``tests/engine/test_kinds.py`` keeps equal to the keys here).

Heavy imports (torch for ``local``, the HTTP client for ``vllm``, Ray) happen inside the
builders, so importing the factory stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollstream.config.schema import EngineConfig, LoraConfig
from rollstream.engine.protocol import Engine

Training = Callable[[], bool]  # whether a trainer step computes now


def _local(cfg: EngineConfig, model_path: Path, *, engine_id: str, version: int,
           training: Training | None = None, lora: LoraConfig | None = None) -> Engine:
    # the embedded engine merges any adapter it is handed: it needs no ``lora`` up front
    from rollstream.engine.local import LocalEngine

    return LocalEngine(model_path, cfg.local, engine_id=engine_id, version=version,
                       training=training)


def _vllm(cfg: EngineConfig, model_path: Path, *, engine_id: str, version: int,
          training: Training | None = None, lora: LoraConfig | None = None) -> Engine:
    # the vLLM server records no forward passes, so it has no use for ``training``
    from rollstream.engine.vllm import build_vllm_engine

    return build_vllm_engine(cfg, model_path, engine_id=engine_id, version=version, lora=lora)


@dataclass(slots=True, kw_only=True, frozen=True)
class EngineKind:
    build: Callable[..., Engine]
    """``(EngineConfig, model_path, *, engine_id, version, training, lora) -> Engine``: one
    started engine in this process (``training``: whether a trainer step computes now;
    ``lora``: the run's ``model.lora``, the adapters it will be handed)."""
    ray: str
    """``module:function`` of ``(RunConfig, model_path, *, version, units, run_dir) ->
    list[Engine]``: the run's engines as Ray actors in its scale units (imported only then)."""

    def ray_builder(self) -> Callable[..., list[Engine]]:
        module, _, name = self.ray.partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, EngineKind] = {
    "local": EngineKind(build=_local, ray="rollstream.runtime.ray.engines:build_run_engines"),
    "vllm": EngineKind(build=_vllm, ray="rollstream.runtime.ray.vllm:build_run_engines"),
}


def engine_kind(kind: str) -> EngineKind:
    """The registered kind ``kind``; ValueError naming the known ones otherwise."""
    if kind not in KINDS:
        raise ValueError(f"engine.kind must be one of {', '.join(map(repr, KINDS))}, "
                         f"got {kind!r}")
    return KINDS[kind]


def build_engine(
    cfg: EngineConfig, model_path: Path, *, engine_id: str = "local-0", version: int = 0,
    training: Training | None = None, lora: LoraConfig | None = None,
) -> Engine:
    """A started engine serving ``model_path`` with weights tagged ``version``.
    ``training``: whether a trainer step computes now (the local engine bins the passes that
    share the CPU with one apart: sim/calibrate.py); ``lora``: the run's ``model.lora``."""
    return engine_kind(cfg.kind).build(cfg, model_path, engine_id=engine_id, version=version,
                                       training=training, lora=lora)
