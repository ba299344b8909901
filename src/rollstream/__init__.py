"""rollstream: asynchronous RL post-training for LLMs, built around rollout infrastructure."""

__version__ = "0.1.0"
