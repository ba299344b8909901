"""Inference engines behind one small protocol (see ``protocol.py``); ``build_engine`` picks
one from config. Importing this package does not import torch."""

from rollstream.engine.factory import build_engine
from rollstream.engine.protocol import (
    Closeable,
    Engine,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)
from rollstream.engine.states import EngineHealth, Routing

__all__ = [
    "Closeable",
    "Engine",
    "EngineHealth",
    "EngineStats",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "Routing",
    "SamplingParams",
    "build_engine",
]
