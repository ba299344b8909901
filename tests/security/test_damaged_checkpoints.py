"""Damaged checkpoints are refused, never taken for absent, and checked whole before a resume
changes anything (docs/run-dir.md, "A damaged run folder on resume")."""

from __future__ import annotations

from pathlib import Path

import pytest

import rollstream
from rollstream.durable import checkpoint as durable
from tests.security.conftest import small, snapshot


def _resume(run_dir: Path, model: Path, *extra: str) -> dict:
    return rollstream.run(None, small(run_dir.parent, model, "resume=true", *extra))


def test_checkpoint_folders_none_of_which_is_whole_are_refused(run_copy: Path,
                                                               kit_model: Path) -> None:
    """With every state.json removed, a resume used to print "no checkpoint" and supersede
    the whole run; it is refused, naming each folder, and nothing changes."""
    for ckpt in durable.folder(run_copy).iterdir():
        (ckpt / durable.STATE).unlink()
    before = snapshot(run_copy)
    with pytest.raises(ValueError, match="none is whole") as err:
        _resume(run_copy, kit_model)
    for step in ("step_000001", "step_000002"):
        assert f"{step}/state.json is missing" in str(err.value)
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("damage", ["state", "trainer", "weights"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
        run_copy: Path, kit_model: Path, damage: str, caplog) -> None:
    """Garbage in the newest checkpoint's state.json, trainer.pt or weights: the resume warns,
    naming it and the file, and continues from the older whole one."""
    newest = durable.folder(run_copy) / "step_000002"
    file = {"state": newest / durable.STATE, "trainer": newest / durable.TRAINER,
            "weights": newest / durable.MODEL / "model.safetensors"}[damage]
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])  # truncated
    summary = _resume(run_copy, kit_model, "train.steps=3")
    warning = next(r.getMessage() for r in caplog.records
                   if r.levelname == "WARNING" and r.getMessage().startswith("resume:"))
    assert "skipped the damaged checkpoint step_000002" in warning and str(file) in warning
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 3


def test_the_chosen_checkpoint_is_checked_whole_before_the_ledger_changes(
        run_copy: Path, kit_model: Path) -> None:
    """Garbage trainer.pt and weights in every checkpoint used to give tracebacks after the
    ledger had been rewritten; the resume is refused naming the files, and the run folder
    is as it was."""
    for ckpt in durable.folder(run_copy).iterdir():
        (ckpt / durable.TRAINER).write_bytes(b"garbage" * 100)
        (ckpt / durable.MODEL / "model.safetensors").write_bytes(b"\0" * 64)
    before = snapshot(run_copy)
    with pytest.raises(ValueError) as err:
        _resume(run_copy, kit_model)
    message = str(err.value)
    for ckpt in ("step_000001", "step_000002"):
        assert f"{ckpt}/model/model.safetensors: not a whole safetensors file" in message
    assert snapshot(run_copy) == before
    for ckpt in durable.folder(run_copy).iterdir():  # the weights repaired: the trainer's
        (ckpt / durable.MODEL / "model.safetensors").write_bytes(
            (Path(kit_model) / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"step_000002/trainer.pt: not a whole torch archive"):
        _resume(run_copy, kit_model)
    assert snapshot(run_copy) == {**before, **{
        k: v for k, v in snapshot(run_copy).items() if k.endswith("model.safetensors")}}


def test_a_state_json_that_is_not_json_names_its_path(run_copy: Path) -> None:
    state = durable.folder(run_copy) / "step_000002" / durable.STATE
    state.write_text('{"format": 1,\n')
    skipped: list[str] = []
    assert durable.latest(run_copy, on_skip=lambda p, why: skipped.append(why)).step == 1
    assert len(skipped) == 1 and skipped[0].startswith(f"{state}: not valid JSON (Expecting")
