"""Durable checkpoints: one folder holds all a run needs to go on, written atomically.

    {run_dir}/checkpoints/step_NNNNNN/    (NNNNNN = trainer steps done = weight version)
        model/       the policy as an HF folder (weights, config, tokenizer files)
        trainer.pt   optimizer state, RNG states (torch, Python)
        state.json   format, step, the config and its hash, the ledger's line count at the
                     snapshot, the data cursor, the rollout's snapshot (buffer, in-flight
                     samples at token granularity, samples waiting for a reward), run totals

A checkpoint is built in a hidden temporary folder beside the others and renamed into place
once every file is written and fsynced, so a crash leaves either the whole folder or none;
only then are the oldest beyond ``keep`` deleted. :func:`latest` finds the newest whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
STATE = "state.json"
MODEL = "model"
TRAINER = "trainer.pt"
_PREFIX = "step_"


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(slots=True, frozen=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL

    @property
    def trainer_file(self) -> Path:
        return self.path / TRAINER

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        state = json.loads((path / STATE).read_text())
        if state.get("format") != FORMAT:
            raise ValueError(f"checkpoint {path}: format {state.get('format')!r}, this "
                             f"rollstream reads format {FORMAT}")
        return cls(path=path, state=state)


def write(run_dir: Path, step: int, state: dict[str, Any], *,
          save_model: Callable[[Path], Any], save_trainer: Callable[[Path], Any],
          keep: int) -> Path:
    """Write checkpoint ``step`` (``state`` is JSON-ready; ``save_model(dir)`` writes the HF
    folder, ``save_trainer(file)`` the trainer's state) and keep the newest ``keep``."""
    root = folder(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    for left in root.glob(f".{_PREFIX}*"):  # a killed writer's temporary folders
        shutil.rmtree(left, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    save_model(tmp / MODEL)
    save_trainer(tmp / TRAINER)
    (tmp / STATE).write_text(json.dumps({"format": FORMAT, "step": step, **state}))
    _fsync_tree(tmp)
    if final.exists():  # the same step again (a resumed run that stopped at once)
        old = root / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for stale in _complete(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Checkpoint | None:
    """The newest whole checkpoint of a run directory (None: there is none)."""
    found = _complete(folder(run_dir))
    return Checkpoint.read(found[-1]) if found else None


def steps(run_dir: Path) -> list[int]:
    """The steps of a run directory's whole checkpoints, oldest first."""
    return [int(p.name[len(_PREFIX):]) for p in _complete(folder(run_dir))]


def at_step(run_dir: Path, step: int) -> Checkpoint:
    """Checkpoint ``step`` of a run directory (ValueError naming the steps there are)."""
    if step not in steps(run_dir):
        raise ValueError(f"{run_dir} has no durable checkpoint of step {step}; it has: "
                         f"{steps(run_dir) or 'none'}")
    return Checkpoint.read(folder(run_dir) / f"{_PREFIX}{step:06d}")


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir()
           if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
           and (p / STATE).is_file()]
    return sorted(out, key=lambda p: int(p.name[len(_PREFIX):]))


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
