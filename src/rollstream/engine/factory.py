"""Pick the engine implementation named by ``EngineConfig.kind``.

Heavy imports (torch for ``local``, the HTTP client for ``vllm``) happen inside the branch,
so importing the factory stays light.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollstream.config.schema import EngineConfig
from rollstream.engine.protocol import Engine


def build_engine(
    cfg: EngineConfig, model_path: Path, *, engine_id: str = "local-0", version: int = 0,
    training: Callable[[], bool] | None = None,
) -> Engine:
    """A started engine serving ``model_path`` with weights tagged ``version``.
    ``training``: whether a trainer step computes now (the local engine bins the passes that
    share the CPU with one apart: sim/calibrate.py)."""
    if cfg.kind == "local":
        from rollstream.engine.local import LocalEngine

        return LocalEngine(model_path, cfg.local, engine_id=engine_id, version=version,
                           training=training)
    if cfg.kind == "vllm":
        from rollstream.engine.vllm import build_vllm_engine

        return build_vllm_engine(cfg, model_path, engine_id=engine_id, version=version)
    raise ValueError(f"engine.kind must be 'local' or 'vllm', got {cfg.kind!r}")
