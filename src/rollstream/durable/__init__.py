"""Durable runs: checkpoints of everything in flight, and resume (docs/run-dir.md)."""
