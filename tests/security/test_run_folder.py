"""A run writes only inside ``run_root/name``, and nothing a run needs fails after its folder
was touched (an earlier run of that name keeps its files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import rollstream
from rollstream.config import ConfigError, load_config
from tests.security.conftest import small, snapshot

ESCAPES = ["..", ".", "../../x", "a/b", "/abs", "", "x" * 256, "a\0b"]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_name_that_is_not_one_folder_is_refused_naming_the_field(tmp_path: Path,
                                                                   name: str) -> None:
    """name=.. deleted checkpoints/ and summary.json of the folder above run_root, and
    name=../../x created a folder at the file-system root."""
    above = tmp_path / "above"
    (above / "checkpoints").mkdir(parents=True)
    (above / "summary.json").write_text("{}")
    tree = {"run_root": str(above / "runs"), "name": name}
    with pytest.raises(ConfigError, match=r"name = .*: must be one folder name"):
        rollstream.build_config(tree)
    with pytest.raises(ConfigError, match=r"name = .*: must be one folder name"):
        rollstream.run(tree, datasets={"qa": [{"prompt": "T100#01=", "answer": "100/01"}]})
    assert snapshot(tmp_path) == {"above/summary.json": b"{}"}
    assert sorted(p.name for p in above.iterdir()) == ["checkpoints", "summary.json"]


def test_names_of_one_folder_pass() -> None:
    for name in ("run", "tick-async_k2.v3", "...", "-x", "x" * 255):
        assert load_config(None, [f"name={name}"]).name == name


def test_a_dataset_no_prompt_of_which_fits_the_context_is_refused_first(
        tmp_path: Path, finished_run: Path, kit_model: Path) -> None:
    """It used to reset the run folder, generate 256 groups of failed samples and stop; the
    first 1,000 rows are tokenized before the folder is touched."""
    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"T1{i:080d}#01=", "answer": "1"}) + "\n"
                            for i in range(50)))
    run = tmp_path / "runs" / "r"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    overrides = small(tmp_path / "runs", kit_model,
                      f"tasks.sources=[{{kind: jsonl, path: '{rows}'}}]")
    with pytest.raises(ValueError, match=r"tasks.sources.0 \('jsonl'\): none of its first \d+ "
                                         r"training prompts fits the context: the shortest is "
                                         r"86 tokens and engine.local.max_seq_len = 64"):
        rollstream.run(None, overrides)
    assert snapshot(run) == before
