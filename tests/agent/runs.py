"""The small agent run the end-to-end agent tests train: sync, 2 steps, groups of 2, on a
given model folder, one thread each for the engine and the trainer; what differs between
them is passed in (sources, group count, slots, tokens per turn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def two_step_run(tmp_path: Path, model: Path, name: str, sources: list[dict], *,
                 groups_per_step: int = 2, max_slots: int = 16, max_new_tokens: int = 40,
                 **tasks: Any) -> dict:
    """The run's config as a dict (``tasks``: other fields of its ``tasks`` section)."""
    return {
        "name": name, "run_root": str(tmp_path / "runs"), "seed": 0,
        "model": {"path": str(model)},
        "tasks": {"sources": sources, "num_eval": 0, **tasks},
        "agent": {"max_turns": 3, "max_turn_tokens": 6},
        "engine": {"local": {"max_slots": max_slots, "max_seq_len": 256, "threads": 1}},
        "sampling": {"max_new_tokens": max_new_tokens},
        "rollout": {"group_size": 2, "mode": "sync", "filter_zero_variance": False},
        "train": {"steps": 2, "groups_per_step": groups_per_step, "micro_batch_tokens": 1024,
                  "threads": 1},
        "monitor": {"progress": False, "report": False},
    }
