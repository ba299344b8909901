"""A finished tiny run (a random kit model, 2 steps, a checkpoint after each) that the
adversarial tests copy and then damage, and the settings that make such runs fast."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NAME = "r"


def small(run_root: Path, model: Path, *extra: str) -> list[str]:
    """Overrides of a run of ``model`` (a random kit model: nothing is learned, so groups
    train with zero advantage instead of being filtered) that takes seconds."""
    return [f"run_root={run_root}", f"name={NAME}", f"model.path={model}",
            "tasks.sources=[{kind: tick, max_items: 2}]", "tasks.num_eval=2",
            "engine.local.max_slots=8", "engine.local.max_seq_len=64",
            "engine.local.threads=1", "sampling.max_new_tokens=8", "rollout.group_size=2",
            "rollout.filter_zero_variance=false", "train.groups_per_step=2", "train.steps=2",
            "train.checkpoint_every=1", "train.threads=1", "eval.samples_per_task=1",
            "reward.num_workers=1", "monitor.progress=false", "monitor.report=false", *extra]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, kit_model: Path) -> Path:
    """The run folder of a finished 2-step run (checkpoints step_000001 and step_000002)."""
    import rollstream

    root = tmp_path_factory.mktemp("finished")
    rollstream.run(None, small(root, kit_model))
    return root / NAME


@pytest.fixture()
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of :func:`finished_run` to damage, at ``tmp_path/runs/r``."""
    dst = tmp_path / "runs" / NAME
    shutil.copytree(finished_run, dst)
    return dst


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> content): what must stay as it was."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}
