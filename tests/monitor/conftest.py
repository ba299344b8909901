"""Fixtures for the monitor tests: a synthesized run directory (see synth.py) and one real
run of a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.monitor.synth import synth_run

REAL_STEPS, REAL_EVAL_EVERY = 6, 2


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished synthetic run: 40 steps, 2 engines x 8 slots (read-only for tests)."""
    run_dir = tmp_path_factory.mktemp("runs") / "synth"
    synth_run(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def real_run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_run_cache: Path) -> Path:
    """A real `rollstream train` run (read-only for tests): the tiny run's model, async k=2,
    6 steps of 4 groups x 8, evaluated every 2 steps, with its report."""
    from rollstream.bench.tiny_run import tiny_run_config
    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    root = tmp_path_factory.mktemp("real-run")
    cfg = tiny_run_config("real", root, steps=REAL_STEPS, checkpoint_every=REAL_STEPS,
                          cache_dir=tiny_run_cache)
    cfg["eval"]["every"] = REAL_EVAL_EVERY
    cfg["monitor"]["report"] = True
    path = root / "config.json"
    path.write_text(json.dumps(cfg))
    run_training(load_config(path, []))
    return root / "real"
