"""A task source read from a JSONL dataset file: one ``{"prompt": str, "answer": str}`` per
line (an optional ``"id"`` names the row).

A malformed row (not JSON, missing or empty fields, a prompt the tokenizer cannot encode)
is never dropped silently: it is kept in ``rejected`` as (task uid, source, reason), the run
writes it to the ledger as a failed task, and the source goes on with the other rows. Rows
are split into train and eval by the same hash of the prompt text as the synthetic sources;
training cycles through the train rows in file order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.config.schema import SourceConfig
from rollstream.data.sources import PromptTokenizer, Split, split_of
from rollstream.trajectory import Task


@dataclass(slots=True, kw_only=True)
class JsonlSource:
    name: str
    cfg: SourceConfig
    tokenizer: PromptTokenizer
    seed: int
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    _rows: dict[str, list[Task]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cfg.path is None:
            raise ValueError(f"tasks source {self.name!r}: kind jsonl needs `path`")
        path = Path(self.cfg.path)
        if not path.is_file():
            raise ValueError(f"tasks source {self.name!r}: dataset file not found: {path}")
        self._rows = {"train": [], "eval": []}
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                self._add(lineno, line)
        if not self._rows["train"]:
            raise ValueError(f"tasks source {self.name!r}: {path} has no usable training rows "
                             f"({len(self.rejected)} rejected)")

    def _add(self, lineno: int, line: str) -> None:
        uid = f"{self.name}/line{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            self.rejected.append((uid, self.name, f"line {lineno} is not JSON: {e.msg}"))
            return
        if not isinstance(row, dict):
            self.rejected.append((uid, self.name, f"line {lineno} is not an object"))
            return
        if "id" in row:
            uid = f"{self.name}/{row['id']}"
        prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not prompt or not isinstance(answer, str):
            self.rejected.append(
                (uid, self.name, f"line {lineno}: needs a non-empty string 'prompt' and a string "
                                 f"'answer', got keys {sorted(row)}"))
            return
        ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not ids:
            self.rejected.append((uid, self.name, f"line {lineno}: prompt encodes to no tokens"))
            return
        split = split_of(prompt)
        self._rows[split].append(Task(uid=uid, source=self.name, prompt_ids=ids,
                                      prompt_text=prompt, reference=answer))

    def task(self, index: int, split: Split) -> Task:
        rows = self._rows[split] or self._rows["train"]
        return rows[index % len(rows)]

    def score(self, task: Task, response_text: str) -> float:
        from rollstream.reward.registry import get_reward

        return float(get_reward(self.cfg.verifier)(task, response_text))

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        return task.reference
