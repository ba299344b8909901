"""A task source read from a JSONL dataset file: one ``{"prompt": str, "answer": str}`` object
per line. An optional ``"id"`` (a non-empty string or an integer) names the row's task
``<source>/<id>``; a row without one is named by its line number, ``<source>/line<N>``. The
source's ``reward`` (``SourceConfig.reward``, default ``exact_match``) grades a response
against the row's ``answer``.

The file must be UTF-8 (a leading byte-order mark is allowed): another encoding is an error
naming the file and the byte offset of the first bad byte. Two usable rows that name the same
task (a duplicate id) are an error naming the file, both lines and the id: a task uid keys
the ledger, so a duplicate would make two prompts one task.

A row that cannot be used (not JSON, not an object, an id that is not a non-empty string or
an integer, missing or empty fields, a prompt the tokenizer cannot encode) is never dropped
silently: it is kept in ``rejected`` as (task uid, source, reason), the reason naming the file
and line, and the run writes it to the ledger as a failed task. A rejected row is always
named by its line number, so two rejected rows never share a uid whatever their ids; the
source goes on with the other rows.

Rows are split into train and eval by the same hash of the prompt text as the synthetic
sources; training cycles through the train rows in file order, held-out tasks come only from
the eval rows. A file with no eval rows has no held-out tasks (``num_tasks("eval") == 0``;
:class:`~rollstream.data.sources.TaskMix` warns).

Simplifications: the whole file is read into memory; lines are split on ``\\n`` only (JSON
escapes a newline inside a string, and a ``\\r`` before it is whitespace to the parser).
"""

from __future__ import annotations

import codecs
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.config.schema import SourceConfig
from rollstream.data.sources import (
    PromptTokenizer,
    Split,
    path_problem,
    reward_name,
    split_of,
)
from rollstream.trajectory import Task


@dataclass(slots=True, kw_only=True)
class JsonlSource:
    name: str
    cfg: SourceConfig
    tokenizer: PromptTokenizer
    seed: int
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    reward: str = field(init=False)  # SourceConfig.reward, else exact match against "answer"
    _rows: dict[str, list[Task]] = field(default_factory=dict)
    # task uid -> (line, row id or None, how the uid was made) of the row that took it
    _named_by: dict[str, tuple[int, str | int | None, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reward = reward_name(self.cfg)
        assert self.cfg.path is not None, "SourceConfig: kind jsonl requires path"
        problem = path_problem(self.cfg.path)
        if problem is not None:
            raise ValueError(f"tasks source {self.name!r}: {problem}")
        path = Path(self.cfg.path)
        self._rows = {"train": [], "eval": []}
        for lineno, line in enumerate(self._read_text(path).split("\n"), start=1):
            if line.strip():
                self._add(path, lineno, line)
        if not self._rows["train"]:
            raise ValueError(
                f"tasks source {self.name!r}: {path} has no usable training rows "
                f"({len(self._rows['eval'])} held out, {len(self.rejected)} rejected)"
            )

    def _read_text(self, path: Path) -> str:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(
                f"tasks source {self.name!r}: cannot read {path}: {e.strerror}"
            ) from None
        skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        try:
            return data[skip:].decode("utf-8")
        except UnicodeDecodeError as e:
            offset = skip + e.start
            lineno = data.count(b"\n", 0, offset) + 1
            raise ValueError(
                f"tasks source {self.name!r}: {path} is not UTF-8: byte 0x{data[offset]:02x} at "
                f"byte offset {offset} (line {lineno}): {e.reason}; re-encode the file as UTF-8"
            ) from None

    def _add(self, path: Path, lineno: int, line: str) -> None:
        where = f"{path} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return self._reject(path, lineno, f"{where} is not JSON: {e.msg}")
        if not isinstance(row, dict):
            return self._reject(path, lineno, f"{where} is not a JSON object")
        row_id = row.get("id")
        if "id" in row and not _is_row_id(row_id):
            return self._reject(path, lineno, f"{where}: 'id' must be a non-empty string or "
                                              f"an integer, got {row_id!r}")
        where += f" (id {row_id!r})" if "id" in row else ""
        prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not prompt or not isinstance(answer, str):
            return self._reject(path, lineno, f"{where}: needs a non-empty string 'prompt' and a "
                                              f"string 'answer', got keys {sorted(row)}")
        ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not ids:
            return self._reject(path, lineno, f"{where}: prompt encodes to no tokens")
        if "id" in row:
            uid = self._claim(path, lineno, f"{self.name}/{row_id}", row_id, f"id {row_id!r}")
        else:
            uid = self._claim(path, lineno, f"{self.name}/line{lineno}", None,
                              "no id, so named by its line number")
        self._rows[split_of(prompt)].append(
            Task(uid=uid, source=self.name, prompt_ids=ids, prompt_text=prompt, reference=answer)
        )

    def _reject(self, path: Path, lineno: int, reason: str) -> None:
        uid = self._claim(path, lineno, f"{self.name}/line{lineno}", None,
                          "rejected, so named by its line number")
        self.rejected.append((uid, self.name, reason))

    def _claim(self, path: Path, lineno: int, uid: str, row_id: str | int | None,
               how: str) -> str:
        """Give row ``lineno`` the task ``uid``; a uid another row already has is an error."""
        if uid in self._named_by:
            first, first_id, first_how = self._named_by[uid]
            if row_id is not None and first_id == row_id:
                what = f"duplicate row id {row_id!r} on lines {first} and {lineno}"
            else:  # e.g. ids 1 and "1", or id "line7" and an unnamed line 7
                what = (f"lines {first} and {lineno} both name task {uid!r} "
                        f"(line {first}: {first_how}; line {lineno}: {how})")
            raise ValueError(
                f"tasks source {self.name!r}: {path}: {what}; give each row a distinct 'id'"
            )
        self._named_by[uid] = (lineno, row_id, how)
        return uid

    def task(self, index: int, split: Split) -> Task:
        if split not in self._rows:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rows = self._rows[split]
        if not rows:  # only eval can be empty; held-out tasks never come from train rows
            raise ValueError(f"tasks source {self.name!r}: {self.cfg.path} has no held-out rows")
        return rows[index % len(rows)]

    def num_tasks(self, split: Split) -> int:
        return len(self._rows[split])

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        return task.reference


def _is_row_id(value: object) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, int) and not isinstance(value, bool)

