"""rollstream: asynchronous RL post-training for LLMs, built around rollout infrastructure.

The Python API (``rollstream.api``; docs/your-data.md): :func:`run`,
:func:`build_config`, :func:`load_config`, :class:`RunConfig`, :class:`RunStopped`,
:func:`register_reward`, :func:`group_reward`, :class:`Task`. They are imported on first use,
so that ``import rollstream`` stays light (reward worker processes import the package).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "run": "rollstream.api",
    "build_config": "rollstream.api",
    "load_config": "rollstream.config.loader",
    "ConfigError": "rollstream.config.loader",
    "RunConfig": "rollstream.config.schema",
    "RunStopped": "rollstream.runtime.train",
    "register_reward": "rollstream.reward.registry",
    "group_reward": "rollstream.reward.registry",
    "Task": "rollstream.trajectory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollstream' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
