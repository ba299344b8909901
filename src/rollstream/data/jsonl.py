"""JSONL rows for :class:`~rollstream.data.dataset.DatasetSource`: one JSON object per line.

The file must be UTF-8 (a leading byte-order mark is allowed): another encoding is an error
naming the file and the byte offset of the first bad byte. A line that is not JSON, or not a
JSON object, is yielded as the reason it cannot be used (the source records it as rejected);
blank lines are skipped. Lines are numbered from 1.

Simplifications: the whole file is read into memory; lines are split on ``\\n`` only (JSON
escapes a newline inside a string, and a ``\\r`` before it is whitespace to the parser).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """(line number, the row object or why the line is not one) for each non-blank line."""
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, f"is not JSON: {e.msg}"
            continue
        yield lineno, row if isinstance(row, dict) else "is not a JSON object"


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = skip + e.start
        lineno = data.count(b"\n", 0, offset) + 1
        raise ValueError(
            f"{path} is not UTF-8: byte 0x{data[offset]:02x} at byte offset {offset} (line "
            f"{lineno}): {e.reason}; re-encode the file as UTF-8"
        ) from None
