"""Config: a YAML file plus ``key=value`` overrides become a typed, frozen tree."""

from rollstream.config.loader import ConfigError, apply_override, load_config, validate
from rollstream.config.schema import (
    EngineConfig,
    EvalConfig,
    ModelConfig,
    MonitorConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    SourceConfig,
    TasksConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError",
    "EngineConfig",
    "EvalConfig",
    "ModelConfig",
    "MonitorConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SourceConfig",
    "TasksConfig",
    "TrainConfig",
    "apply_override",
    "load_config",
    "validate",
]
