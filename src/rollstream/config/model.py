"""The ``model:`` section: a model folder to load, or the tiny model the kit builds and
warm-starts when there is none."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.config.section import Section


class TinyModelConfig(Section):
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture family written to config.json."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention when < num_heads)."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width."""
    max_position: int = Field(512, ge=16)
    """Maximum sequence length (prompt + response)."""
    seed: int = 0
    """Initialisation seed."""


class WarmStartConfig(Section):
    steps: int = Field(250, ge=0)
    """Supervised steps on noisy demonstrations before RL (0 = none). Cached by content hash."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm start."""
    tokens_per_step: int = Field(4096, ge=64)
    """Tokens per supervised step."""
    noise: float = Field(0.15, ge=0, le=1)
    """Probability that a demonstration step slips by one (keeps RL headroom)."""


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face causal-LM folder (Llama/Qwen2 family). When null, the tiny-model kit
    builds one (``tiny``), warm-starts it on the run's tasks and caches it under cache_dir."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the model the kit builds when ``path`` is null."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start applied to a kit-built model."""
    cache_dir: str = ".cache/rollstream"
    """Where built models and warm starts are cached."""
