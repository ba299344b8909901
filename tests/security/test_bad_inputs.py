"""Everything a run needs is checked before its folder is touched, and bad input is a clear
error naming the file, module or line: a damaged model folder, a reward module that cannot
be imported, JSONL rows Python's parser refuses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rollstream
from rollstream.config.schema import SourceConfig
from rollstream.data.dataset import DatasetSource
from rollstream.models.tokenizer import build_char_tokenizer
from tests.security.conftest import small, snapshot

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(rollstream.__file__).resolve().parents[1]  # the code under test


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGE = {  # what is done to a copy of the model folder, and the file the error names
    "config.json not JSON": (lambda d: (d / "config.json").write_text('{"a": "\x01"}'),
                             "config.json: not valid JSON"),
    "truncated weights": (lambda d: _truncate(d / "model.safetensors"),
                          "model.safetensors: not a whole safetensors file"),
    "garbage weights": (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 4096),
                        "model.safetensors: not a whole safetensors file"),
    "no tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_model_folder_is_refused_before_the_run_folder_is_touched(
        tmp_path: Path, finished_run: Path, kit_model: Path, damage: str) -> None:
    """These failed only after the previous run of that name had been deleted, with messages
    naming no file (or, without tokenizer.json, a 5-token tokenizer was loaded)."""
    model = tmp_path / "model"
    shutil.copytree(kit_model, model)
    hurt, says = DAMAGE[damage]
    hurt(model)
    run = tmp_path / "runs" / "r"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    with pytest.raises(ValueError, match=rf"model.path '{model}': .*{says}"):
        rollstream.run(None, small(tmp_path / "runs", model))
    assert snapshot(run) == before


MODULES = {
    "syntax_error_reward": ("def score(task, text:\n    return 1.0\n",
                            r"module 'syntax_error_reward' has a syntax error: "
                            r".*syntax_error_reward.py line 1: '\(' was never closed"),
    "raising_reward": ("raise RuntimeError('needs a GPU')\ndef score(task, text): ...\n",
                       r"importing module 'raising_reward' raised RuntimeError: needs a GPU "
                       r"\(.*raising_reward.py line 1\)"),
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_reward_module_that_cannot_be_imported_is_a_clear_error(tmp_path: Path,
                                                                  module: str) -> None:
    """A SyntaxError or an exception at import used to end `rollstream train` with a
    traceback; it is an error naming the field and the module, exit status 2."""
    source, says = MODULES[module]
    (tmp_path / f"{module}.py").write_text(source)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"run_root": str(tmp_path / "runs"),
                                  "tasks": {"sources": [{"kind": "tick",
                                                         "reward": f"{module}:score"}]}}))
    done = subprocess.run([sys.executable, "-m", "rollstream", "train", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**_env(), "PYTHONPATH": f"{SRC}:{tmp_path}"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rollstream: tasks source 'tick' (its `reward`): reward "
                           f"'{module}:score': "), last
    assert re.search(says, last), last
    assert not (tmp_path / "runs").exists()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_jsonl_rows_the_parser_refuses_are_rejected_with_their_line(tmp_path: Path) -> None:
    """A 5,000-digit integer or nesting 100,000 deep failed the whole load (without file or
    line, or with RecursionError); each is one rejected row, named by file and line."""
    path = tmp_path / "rows.jsonl"
    good = [json.dumps({"prompt": f"T{100 + i}#01=", "answer": f"{100 + i}/01"})
            for i in range(8)]
    lines = [*good[:4], '{"prompt": "T1#01=", "answer": ' + "7" * 5000 + "}",
             '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
             '{"prompt": "T1#01=", "answer": "1", "x": ' + "[" * 65 + "]" * 65 + "}", *good[4:]]
    path.write_text("\n".join(lines) + "\n")
    source = DatasetSource(name="ds", cfg=SourceConfig(kind="jsonl", path=str(path)),
                           tokenizer=build_char_tokenizer(), seed=0)
    reasons = {uid: why for uid, _, why in source.rejected}
    assert sorted(reasons) == ["ds/line5", "ds/line6", "ds/line7"]
    assert reasons["ds/line5"].startswith(f"{path} line 5 is not usable JSON: Exceeds the limit")
    for line in (6, 7):
        assert reasons[f"ds/line{line}"] == (f"{path} line {line} is not usable JSON: nested "
                                             "more than 64 levels deep")
    assert source.num_tasks("train") + source.num_tasks("eval") == 8
