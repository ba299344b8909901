"""JSONL rows for :class:`~rollstream.data.dataset.DatasetSource`: one JSON object per line.

The file must be UTF-8 (a leading byte-order mark is allowed): another encoding is an error
naming the file and the byte offset of the first bad byte. A line that is not JSON, or not a
JSON object, is yielded as the reason it cannot be used (the source records it as rejected);
so is one Python's parser refuses (an integer of more than 4,300 digits) or one nested more
than ``MAX_DEPTH`` levels; blank lines are skipped. Lines are numbered from 1.

Simplifications: the whole file is read into memory; lines are split on ``\\n`` only (JSON
escapes a newline inside a string, and a ``\\r`` before it is whitespace to the parser).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_DEPTH = 64  # lists and objects a row may nest (a row is data, not a program)
_TOO_DEEP = object()


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
        except ValueError as e:  # an integer past Python's 4,300-digit conversion limit
            yield lineno, f"is not usable JSON: {e}"
            continue
        except RecursionError:  # nested deeper than the parser's recursion limit
            row = _TOO_DEEP
        if row is _TOO_DEEP or _deeper_than(row, MAX_DEPTH):
            yield lineno, f"is not usable JSON: nested more than {MAX_DEPTH} levels deep"
            continue
        yield lineno, row if isinstance(row, dict) else "is not a JSON object"


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest in ``value`` more than ``limit`` levels (iteratively:
    later code that recurses, ``json.dumps`` of a checkpoint included, stays safe)."""
    todo = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            todo.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return False


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
