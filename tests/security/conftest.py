"""Fixtures of the adversarial tests:

- the agent tests' kit model and embedded engine, and ``rollstream proxy`` on that model run
  as a separate process (so that its memory can be read from outside): the proxy tests reach
  it over real HTTP on 127.0.0.1;
- a finished tiny run (a random kit model, 2 steps, a checkpoint after each) that the run
  folder tests copy and then damage, and the settings that make such runs fast.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent.conftest import engine, model_dir  # noqa: F401 - the agent tests' fixtures

NUM_KEYS = 4
NAME = "r"


@dataclass(slots=True, frozen=True)
class ProxyProcess:
    pid: int
    base_url: str
    keys: tuple[str, ...]
    stderr: Path  # what the server wrote there (a traceback would be a bug)


@pytest.fixture(scope="package")
def cli_proxy(model_dir: Path, tmp_path_factory) -> Iterator[ProxyProcess]:  # noqa: F811
    """``rollstream proxy MODEL_DIR --sessions 4`` with its default limits."""
    err = tmp_path_factory.mktemp("proxy") / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "rollstream", "proxy", str(model_dir),
                                 "--sessions", str(NUM_KEYS)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        base_url = proc.stdout.readline().split()[1]
        keys = tuple(proc.stdout.readline().split()[1] for _ in range(NUM_KEYS))
        yield ProxyProcess(pid=proc.pid, base_url=base_url, keys=keys, stderr=err)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
