"""Fixtures for the monitor tests: a synthesized run directory (see synth.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.monitor.synth import synth_run


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished synthetic run: 40 steps, 2 engines x 8 slots (read-only for tests)."""
    run_dir = tmp_path_factory.mktemp("runs") / "synth"
    synth_run(run_dir)
    return run_dir
