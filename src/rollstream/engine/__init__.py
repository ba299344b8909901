"""Inference engines behind one small protocol (see ``protocol.py``); ``build_engine`` picks
one from config. Importing this package does not import torch."""

from rollstream.engine.factory import build_engine
from rollstream.engine.protocol import (
    Closeable,
    Engine,
    EngineHealth,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)

__all__ = [
    "Closeable",
    "Engine",
    "EngineHealth",
    "EngineStats",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "SamplingParams",
    "build_engine",
]
