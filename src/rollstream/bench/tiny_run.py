"""The small real run that ``bench resume``, ``bench soak`` and the durability tests start as
``rollstream train`` subprocesses: the e2e test's warm-started tiny Qwen2 on tick (up to 6
items, 64 new tokens), async k=2 with partial rollout, 4 groups x 8 samples per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GROUP, GROUPS = 8, 4
EVAL_SAMPLES = 2


def tiny_run_config(name: str, run_root: Path, *, steps: int, checkpoint_every: int,
                    cache_dir: Path | None = None, max_wall_s: float | None = None,
                    rollout: dict[str, Any] | None = None, max_slots: int = 96) -> dict[str, Any]:
    """The run's config as a dict (write it as JSON: JSON is YAML). A small ``max_slots``
    makes the engine the bottleneck, so every checkpoint catches samples mid-generation."""
    cache = {} if cache_dir is None else {"cache_dir": str(cache_dir)}
    cfg: dict[str, Any] = {
        "name": name, "seed": 0, "run_root": str(run_root),
        "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 192,
                           "max_position": 128},
                  "warm_start": {"steps": 200, "lr": 5e-3, "tokens_per_step": 2048}, **cache},
        "tasks": {"sources": [{"kind": "tick", "max_items": 6}], "num_eval": 8},
        "engine": {"local": {"max_slots": max_slots, "max_seq_len": 128, "threads": 1}},
        "sampling": {"max_new_tokens": 64},
        "rollout": {"mode": "async", "staleness": {"max_staleness": 2}, "group_size": GROUP,
                    **(rollout or {})},
        "train": {"steps": steps, "groups_per_step": GROUPS,
                  "checkpoint_every": checkpoint_every, "lr": 3e-4, "threads": 1},
        "eval": {"samples_per_task": EVAL_SAMPLES},
        "monitor": {"progress": False, "report": False},
    }
    if max_wall_s is not None:
        cfg["max_wall_s"] = max_wall_s
    return cfg
