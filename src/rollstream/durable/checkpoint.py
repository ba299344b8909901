"""Durable checkpoints: one folder holds all a run needs to go on, written atomically.

    {run_dir}/checkpoints/step_NNNNNN/    (NNNNNN = trainer steps done = weight version)
        model/       the policy as an HF folder (weights, config, tokenizer files)
        trainer.pt   optimizer state, RNG states (torch, Python)
        state.json   format, step, the config and its hash, the ledger's line count at the
                     snapshot, the data cursor, the rollout's snapshot (buffer, in-flight
                     samples at token granularity, samples waiting for a reward), run totals

A checkpoint is built in a hidden temporary folder beside the others and renamed into place
once every file is written and fsynced, so a crash leaves either the whole folder or none;
only then are the oldest beyond ``keep`` deleted.

:func:`latest` finds the newest whole one, and a damaged checkpoint is never taken for an
absent one: :meth:`Checkpoint.read` checks the whole folder before a resume changes anything
(``state.json`` a JSON object of this format whose step is the folder's, with the rollout
snapshot a resume restores; ``model/`` a loadable model folder, ``rollstream.models.folder``;
``trainer.pt`` a whole torch archive holding the optimizer and RNG states), each problem
named with its path. A damaged newest checkpoint is skipped for an older whole one (reported
to ``on_skip``); when every ``step_*`` folder is damaged, :func:`latest` raises, naming them.
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

from rollstream.run_files import RunFiles

FORMAT = 1
STATE = "state.json"
MODEL = "model"
TRAINER = "trainer.pt"
_PREFIX = "step_"


def folder(run_dir: Path) -> Path:
    """The run folder's durable checkpoints folder."""
    return RunFiles(run_dir).checkpoints


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
        """The checkpoint in folder ``path``, checked whole (module docstring); a
        :class:`DamagedCheckpoint` naming the file at fault otherwise."""
        from rollstream.models.folder import model_folder_problem

        state = _read_state(path)
        problem = model_folder_problem(path / MODEL)
        if problem is not None:
            raise DamagedCheckpoint(f"{path / MODEL}: {problem}")
        _check_trainer_file(path / TRAINER)
        return cls(path=path, state=state)


class DamagedCheckpoint(ValueError):
    """A checkpoint folder that cannot be resumed from; the message names the file."""


_ROLLOUT_KEYS = {"ledger_lines": int, "held_groups": list, "tasks": dict, "num_admitted": int,
                 "num_retired": int, "buffer": list, "live": list, "cancelled": dict,
                 "skip": list}  # what Rollout.restore and the ledger's reconcile read
_TRAINER_KEYS = ("optimizer", "torch_rng", "python_rng")  # Trainer.save_training_state's


def _read_state(path: Path) -> dict[str, Any]:
    file = path / STATE
    try:
        state = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise DamagedCheckpoint(f"{file}: not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{file}: expected a JSON object, got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise DamagedCheckpoint(f"{file}: format {state.get('format')!r}, this rollstream "
                                f"reads format {FORMAT}")
    if state.get("step") != _step_of(path):
        raise DamagedCheckpoint(f"{file}: step {state.get('step')!r}, but the folder is "
                                f"{path.name}")
    rollout = state.get("rollout")
    if not isinstance(state.get("config"), dict) or not isinstance(rollout, dict):
        raise DamagedCheckpoint(f"{file}: no config or rollout object")
    for key, kind in _ROLLOUT_KEYS.items():
        if not isinstance(rollout.get(key), kind) or isinstance(rollout.get(key), bool):
            raise DamagedCheckpoint(f"{file}: rollout.{key} is {rollout.get(key)!r}, expected "
                                    f"a {kind.__name__}")
    from rollstream.durable.state import group_from_dict

    for key in ("buffer", "live"):
        for i, group in enumerate(rollout[key]):
            try:
                group_from_dict(group)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise DamagedCheckpoint(f"{file}: rollout.{key}.{i} is not a saved group "
                                        f"({type(e).__name__}: {e})") from None
    return state


def _check_trainer_file(file: Path) -> None:
    """``file`` is a whole torch archive holding the trainer's state (its tensors mapped,
    not read: the pickle and the archive's directory are checked, bytes inside tensors not)."""
    import torch

    if not file.is_file():
        raise DamagedCheckpoint(f"{file} is missing")
    try:
        saved = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - fault boundary: any unreadable archive, named
        raise DamagedCheckpoint(f"{file}: not a whole torch archive ({type(e).__name__}: "
                                f"{e})") from None
    missing = [k for k in _TRAINER_KEYS if not isinstance(saved, dict) or k not in saved]
    if missing:
        raise DamagedCheckpoint(f"{file}: holds no {', '.join(missing)}")


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
    fsync_path(root)
    for stale in _folders(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(run_dir: Path, *,
           on_skip: Callable[[Path, str], Any] | None = None) -> Checkpoint | None:
    """The newest whole checkpoint of a run directory; None when it has no ``step_*``
    folder. A damaged newer one is skipped and passed to ``on_skip(path, why)``; when none
    is whole, a :class:`DamagedCheckpoint` names every folder and why."""
    damaged: list[tuple[Path, str]] = []
    for path in reversed(_folders(folder(run_dir))):
        try:
            ckpt = Checkpoint.read(path)
        except DamagedCheckpoint as e:
            damaged.append((path, str(e)))
            continue
        for skipped, why in damaged:
            if on_skip is not None:
                on_skip(skipped, why)
        return ckpt
    if damaged:
        raise DamagedCheckpoint(
            f"{folder(run_dir)} holds checkpoints but none is whole: "
            + "; ".join(why for _, why in damaged))
    return None


def steps(run_dir: Path) -> list[int]:
    """The steps of a run directory's checkpoint folders, oldest first (whole or not: reading
    one, :meth:`Checkpoint.read`, checks it)."""
    return [_step_of(p) for p in _folders(folder(run_dir))]


def at_step(run_dir: Path, step: int) -> Checkpoint:
    """Checkpoint ``step`` of a run directory (ValueError naming the steps there are; a
    damaged one is a :class:`DamagedCheckpoint` naming its file)."""
    if step not in (found := steps(run_dir)):
        raise ValueError(f"{run_dir} has no durable checkpoint of step {step}; it has: "
                         f"{found or 'none'}")
    return Checkpoint.read(folder(run_dir) / f"{_PREFIX}{step:06d}")


def _step_of(path: Path) -> int:
    return int(path.name[len(_PREFIX):])


def _folders(root: Path) -> list[Path]:
    """The ``step_NNNNNN`` folders under ``root``, oldest first (whole or not)."""
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir()
           if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit() and p.is_dir()]
    return sorted(out, key=_step_of)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
