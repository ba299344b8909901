"""The embedded engine: compact Llama/Qwen2 model code, continuous batching, preallocated KV
cache, per-request seeded sampling, running on its own thread (see ``engine.py``)."""

from rollstream.engine.local.engine import LocalEngine

__all__ = ["LocalEngine"]
