"""A task source read from a dataset as users have it: a JSONL file (``kind: jsonl``), a
Parquet file (``parquet``, e.g. verl's) or a Hugging Face ``datasets`` folder written by
``Dataset.save_to_disk`` (``hf_dataset``).

``SourceConfig.columns`` says which column holds what; a column is a dotted path into nested
fields (``reward_model.ground_truth``). The defaults read TRL's and verl's layouts without
conversion:

* the **prompt** (``prompt``): a string, tokenized as is, or chat messages (a list of
  ``{role, content}``), rendered with the model's chat template and its generation prompt
  (:meth:`~rollstream.agent.chat.ChatRenderer.text`); ``prompt_ids`` are that rendering;
* the **answer** (``task.reference``): the first of ``answer``, ``solution`` and
  ``reward_model.ground_truth`` the row has, unless ``columns.answer`` names one; a number
  becomes its text;
* the **id**: ``id`` when the row has one (a non-empty string or an integer) names the task
  ``<source>/<id>``; a row without is ``<source>/line<N>`` (JSONL, lines from 1) or
  ``<source>/row<N>`` (Parquet and ``datasets``, rows from 0 as ``dataset[i]``).

``SourceConfig.reward_kwargs`` columns go to ``task.extra`` (keyword = last path segment), and
from there to the reward as keyword arguments; they must be JSON values (checkpoints keep
them). A source with a ``harness`` runs each row as an episode: its prompt is the episode's
opening messages (a string is one user message) and the whole row is ``task.extra["row"]``,
from which the episode's environment (or the SDK agent) is built (``agent/episodes.py``).

A row that cannot be used (not JSON, a missing or mistyped column, malformed chat messages, a
prompt that encodes to no tokens or that the chat template cannot render) is never dropped
silently: it is kept in ``rejected`` as (task uid, source, reason), the reason naming the
file and line or row, and the run writes it to the ledger as a failed task. A rejected row is
always named by its position, so two rejected rows never share a uid whatever their ids; the
source goes on with the other rows. Two usable rows that name the same task (a duplicate id)
are an error naming the file, both positions and the id: a task uid keys the ledger, so a
duplicate would make two prompts one task. So is a file that cannot be read (not UTF-8, not
Parquet) and a dataset of chat messages for a tokenizer without a chat template.

Rows are split into train and eval by the same hash of the prompt text (the rendering, for
messages) as the synthetic sources; training cycles through the train rows in file order,
held-out tasks come only from the eval rows. A file with no eval rows has no held-out tasks
(``num_tasks("eval") == 0``; :class:`~rollstream.data.mix.TaskMix` warns).

Simplifications: the whole dataset is read into memory at start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.config.tasks import EPISODE_ROW, lookup
from rollstream.config.tasks import MISSING as _MISSING
from rollstream.data.sources import (
    FiniteSource,
    dataset_path,
    dataset_problem,
    reward_name,
    split_of,
)
from rollstream.trajectory import SINGLE_TURN, Task

ANSWER_COLUMNS = ("answer", "solution", "reward_model.ground_truth")  # columns.answer: null


@dataclass(slots=True, kw_only=True)
class DatasetSource(FiniteSource):
    # task uid -> (position, row id or None, how the uid was made) of the row that took it
    _named_by: dict[str, tuple[int, str | int | None, str]] = field(default_factory=dict)
    _unit: str = "line"  # what a position counts: JSONL lines, or table rows

    def __post_init__(self) -> None:
        self.reward = reward_name(self.cfg)  # its own, else exact match against the answer
        problem = dataset_problem(self.cfg)
        if problem is not None:
            raise ValueError(f"tasks source {self.name!r}: {problem}")
        path = dataset_path(self.cfg)
        try:
            for position, row in self._read(path):
                self._add(path, position, row)
        except ValueError as e:  # a file that cannot be read at all
            raise ValueError(f"tasks source {self.name!r}: {e}") from None
        if not self._rows["train"]:
            first = f"; the first rejected: {self.rejected[0][2]}" if self.rejected else ""
            raise ValueError(
                f"tasks source {self.name!r}: {path} has no usable training rows "
                f"({len(self._rows['eval'])} held out, {len(self.rejected)} rejected){first}"
            )

    def _read(self, path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
        if self.cfg.kind == "jsonl":
            from rollstream.data.jsonl import jsonl_rows

            return jsonl_rows(path)
        from rollstream.data.tables import parquet_rows, saved_dataset_rows

        self._unit = "row"
        return parquet_rows(path) if self.cfg.kind == "parquet" else saved_dataset_rows(path)

    def _add(self, path: Path, position: int, row: dict[str, Any] | str) -> None:
        where = f"{path} {self._unit} {position}"
        try:
            if isinstance(row, str):
                raise _Rejected(f"{where} {row}")
            row_id = self._row_id(where, row)
            if row_id is not None:
                where += f" (id {row_id!r})"
            text, ids = self._prompt(where, row)
            answer = self._answer(where, row)
            extra = self._extra(where, row)
        except _Rejected as e:
            return self._reject(path, position, str(e))
        if row_id is not None:
            uid = self._claim(path, position, f"{self.name}/{row_id}", row_id, f"id {row_id!r}")
        else:
            uid = self._claim(path, position, f"{self.name}/{self._unit}{position}", None,
                              f"no id, so named by its {self._unit} number")
        self._rows[split_of(text)].append(Task(uid=uid, source=self.name, prompt_ids=ids,
                                               prompt_text=text, reference=answer, extra=extra,
                                               harness=self.cfg.task_harness or SINGLE_TURN))

    def _row_id(self, where: str, row: dict[str, Any]) -> str | int | None:
        col = self.cfg.columns.id or "id"
        value = lookup(row, col)
        if value is _MISSING:
            if self.cfg.columns.id is not None:
                raise _Rejected(_missing(where, col, "columns.id", row))
            return None
        if not _is_row_id(value):
            raise _Rejected(f"{where}: {col!r} must be a non-empty string or an integer, got "
                            f"{_shown(value)}")
        return value  # type: ignore[no-any-return]

    def _prompt(self, where: str, row: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        """(prompt text, prompt ids): the string, or the messages rendered."""
        col = self.cfg.columns.prompt
        value = lookup(row, col)
        if value is _MISSING:
            raise _Rejected(_missing(where, col, "columns.prompt", row))
        if self.cfg.episodic and isinstance(value, str) and value:
            value = [{"role": "user", "content": value}]  # an episode opens with messages
        if isinstance(value, list) and value and all(_is_message(m) for m in value):
            text = self._render(where, value)
        elif isinstance(value, str) and value:
            text = value
        else:
            raise _Rejected(f"{where}: {col!r} must be a non-empty string or chat messages (a "
                            f"list of {{role, content}} with string values), got {_shown(value)}")
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise _Rejected(f"{where}: prompt encodes to no tokens")
        return text, ids

    def _render(self, where: str, messages: list[dict[str, Any]]) -> str:
        """The messages under the chat template, with its generation prompt."""
        from rollstream.agent.chat import ChatRenderer

        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{self.cfg.path}: column {self.cfg.columns.prompt!r} holds chat messages but "
                "the model's tokenizer has no chat template to render them with")
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            return ChatRenderer(self.tokenizer).text(msgs, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  (fault boundary: the template's error is the row's reason)
            raise _Rejected(f"{where}: the chat template cannot render its messages "
                            f"({type(e).__name__}: {e})") from None

    def _answer(self, where: str, row: dict[str, Any]) -> str:
        """The reference answer (a number as its text)."""
        col = self.cfg.columns.answer
        if col is not None:
            value = lookup(row, col)
            if value is _MISSING:
                raise _Rejected(_missing(where, col, "columns.answer", row))
        else:
            found = [(c, v) for c in ANSWER_COLUMNS if (v := lookup(row, c)) not in (_MISSING, None)]
            if not found:
                raise _Rejected(f"{where}: no answer column: looked for {list(ANSWER_COLUMNS)}, "
                                f"the row has {sorted(row)}; name it with columns.answer")
            col, value = found[0]
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Rejected(f"{where}: answer {col!r} must be a string or a number, got "
                        f"{_shown(value)}")

    def _extra(self, where: str, row: dict[str, Any]) -> dict[str, Any]:
        """The columns the reward receives as keyword arguments."""
        extra = {}
        for name, col in self.cfg.reward_kwarg_columns.items():
            value = lookup(row, col)
            if value is _MISSING:
                raise _Rejected(_missing(where, col, "reward_kwargs", row))
            _json(value, f"{where}: reward_kwargs column {col!r} is not a JSON value")
            extra[name] = value
        if self.cfg.episodic:  # its environment or agent is built from the whole row
            _json(row, f"{where}: the row of an episode is kept in checkpoints and must be JSON")
            extra[EPISODE_ROW] = row
        return extra

    def _reject(self, path: Path, position: int, reason: str) -> None:
        uid = self._claim(path, position, f"{self.name}/{self._unit}{position}", None,
                          f"rejected, so named by its {self._unit} number")
        self.rejected.append((uid, self.name, reason))

    def _claim(self, path: Path, position: int, uid: str, row_id: str | int | None,
               how: str) -> str:
        """Give the row at ``position`` the task ``uid``; a uid another row has is an error."""
        if uid in self._named_by:
            first, first_id, first_how = self._named_by[uid]
            unit = self._unit
            if row_id is not None and first_id == row_id:
                what = f"duplicate row id {row_id!r} on {unit}s {first} and {position}"
            else:  # e.g. ids 1 and "1", or id "line7" and an unnamed line 7
                what = (f"{unit}s {first} and {position} both name task {uid!r} "
                        f"({unit} {first}: {first_how}; {unit} {position}: {how})")
            raise ValueError(f"{path}: {what}; give each row a distinct id")
        self._named_by[uid] = (position, row_id, how)
        return uid


class _Rejected(Exception):
    """A row this source cannot use; the message is the ledger's reason."""


def _json(value: object, problem: str) -> None:
    """``value`` is a JSON value (checkpoints keep it); else the row is rejected with
    ``problem`` and why."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _Rejected(f"{problem} ({e})") from None


def _missing(where: str, col: str, field_name: str, row: dict[str, Any]) -> str:
    return (f"{where}: no column {col!r} ({field_name}); the row has columns "
            f"{sorted(row)}")


def _is_message(m: object) -> bool:
    return (isinstance(m, Mapping) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str))


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 120 else shown[:120] + "..."


def _is_row_id(value: object) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, int) and not isinstance(value, bool)
