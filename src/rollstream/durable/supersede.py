"""Rewrite a run file and set aside what it drops, as one step that a crash cannot split.

A resume rewrites ``ledger.jsonl`` (and ``replays.jsonl``, ``metrics.jsonl``,
``timeline.jsonl``) without the lines the lost process wrote after its checkpoint, and
appends those lines to ``<stream>.superseded.jsonl``. Two files cannot be replaced at once,
so :class:`Supersede` keeps a marker while the two change:

1. the new content is written to ``.<name>.reconcile`` beside the file and fsynced;
2. the marker ``.<name>.reconcile.json`` records the superseded file's size, atomically;
3. the superseded lines are appended to ``<stream>.superseded.jsonl`` and fsynced;
4. ``.<name>.reconcile`` is renamed over the file (the commit), then the marker is removed.

The next :class:`Supersede` of the same file (a resume after a crash in between) first
finishes or undoes the last one: with the marker and the new content still there, the rename
had not happened, so the superseded file is cut back to the recorded size and the step is
done again from the unchanged file; with the marker alone, the rename had happened and only
the marker is left to remove. Either way each line ends up exactly once, in one of the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO

from rollstream.durable.checkpoint import fsync_path


class Supersede:
    """``with Supersede(path, superseded) as s: s.new.write(...); s.commit(lines)``: the file
    at ``path`` becomes what was written to ``s.new``, and ``lines`` (bytes, each ending in a
    newline) are appended to ``superseded`` (module docstring). Leaving the block without
    :meth:`commit` (an error) changes nothing."""

    def __init__(self, path: Path, superseded: Path) -> None:
        self.path, self.superseded = path, superseded
        self._tmp, self._marker = _tmp(path), _marker(path)
        recover(path, superseded)
        self.new: IO[bytes] = self._tmp.open("wb")
        self._committed = False

    def __enter__(self) -> Supersede:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._committed:  # an error, perhaps after the append: undo as after a crash
            self.new.close()
            recover(self.path, self.superseded)

    def commit(self, lines: Iterable[bytes]) -> None:
        """Append ``lines`` to the superseded file and put the new content in place."""
        self.new.flush()
        os.fsync(self.new.fileno())
        self.new.close()
        lines = list(lines)
        if lines:
            size = self.superseded.stat().st_size if self.superseded.exists() else 0
            marker_tmp = self._marker.with_name(self._marker.name + ".tmp")
            marker_tmp.write_text(json.dumps({"superseded_bytes": size}))
            fsync_path(marker_tmp)
            marker_tmp.replace(self._marker)
            fsync_path(self.path.parent)
            with self.superseded.open("ab") as f:
                f.writelines(lines)
                f.flush()
                os.fsync(f.fileno())
        self._tmp.replace(self.path)  # the commit
        fsync_path(self.path.parent)
        self._marker.unlink(missing_ok=True)
        self._committed = True



def recover(path: Path, superseded: Path) -> None:
    """Finish or undo a :class:`Supersede` of ``path`` that a crash interrupted (module
    docstring); nothing to do after a whole one."""
    if not path.parent.is_dir():  # a resume of a run that never started
        return
    tmp, marker = _tmp(path), _marker(path)
    marker.with_name(marker.name + ".tmp").unlink(missing_ok=True)
    if marker.exists():
        if tmp.exists():  # not committed: take back what was appended
            size = int(json.loads(marker.read_text())["superseded_bytes"])
            if superseded.exists() and superseded.stat().st_size > size:
                os.truncate(superseded, size)
        marker.unlink()
    tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.reconcile")


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.reconcile.json")
