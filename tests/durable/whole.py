"""Checkpoint files that are whole (a kit model folder, a trainer archive, a rollout snapshot)
for tests of what reads checkpoints: ``Checkpoint.read`` checks every file."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from rollstream.config.schema import TinyModelConfig
from rollstream.models.tiny import init_tiny_model, save_model_folder
from rollstream.models.tokenizer import build_char_tokenizer

# what Rollout.restore reads, at a run's start (nothing admitted, nothing held)
ROLLOUT: dict[str, Any] = {"ledger_lines": 0, "held_groups": [], "tasks": {},
                           "num_admitted": 0, "num_retired": 0, "buffer": [], "live": [],
                           "cancelled": {}, "skip": []}
TINY = TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2,
                       num_kv_heads=1, max_position=64)


def save_kit_model(path: Path) -> Path:
    """A random kit model (the char tokenizer, a one-layer Qwen2) saved at ``path``."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    return save_model_folder(init_tiny_model(TINY, tokenizer), tokenizer, path)


def model_saver(source: Path):
    """``save_model`` for ``durable.write``: a copy of the model folder ``source``."""
    return lambda path: shutil.copytree(source, path)


def save_trainer(path: Path) -> None:
    """``save_trainer`` for ``durable.write``: the keys a trainer's state holds."""
    torch.save({"optimizer": {"state": {}, "param_groups": []},
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, path)
