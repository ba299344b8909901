"""Resume: is the config still the run's, and what of the ledger's tail stands.

A checkpoint stores the ledger's line count at its snapshot. The lines after it (the tail)
were written by a process whose later state is lost; each is judged by its group:

* a group the checkpoint holds (buffered or in flight) continues from the checkpoint, so its
  tail lines are superseded;
* a group trained, evaluated, or aborted after the checkpoint is redone (its trainer step's
  weights are lost, an evaluation is repeated with the weights it then runs on), so its tail
  lines are superseded too;
* a group admitted after the checkpoint and retired without training (every sample FILTERED,
  FAILED or DROPPED_STALE before any trainer step took it) **stands**: it is not redone, and
  the resumed run skips it when the data cursor reaches it again.

``ledger.jsonl`` is rewritten (atomically) as the head plus the standing lines, so it keeps
exactly one terminal line per sample; superseded lines go to ``ledger.superseded.jsonl`` with
the step the run resumed at, never dropped. Rejected dataset rows (``#row``) always stand.
Replay events (``replays.jsonl``, ``rollout.replay``) after the checkpoint's count belong to
steps that are redone: all of them move to ``replays.superseded.jsonl``; the replay pool and
its use counts come back from the checkpoint.

``metrics.jsonl`` and ``timeline.jsonl`` are reconciled the same way by the byte sizes the
checkpoint stored (:func:`reconcile_logs`): what the lost process measured after the
checkpoint (steps that are trained again, spans of tokens that were lost) moves to
``<stream>.superseded.jsonl``, except the record of the checkpoint itself, so each step is
recorded once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import msgspec

from rollstream.data.ledger import parse_line, parse_row
from rollstream.data.ledger_row import LedgerRow, encode_row
from rollstream.durable.checkpoint import Checkpoint
from rollstream.durable.supersede import Supersede, recover
from rollstream.run_files import RunFiles
from rollstream.trajectory import SampleStatus

# what may differ between a checkpoint's config and the resuming one (dotted prefixes)
SAFE_CHANGES = ("resume", "run_root", "max_wall_s", "train.steps", "train.checkpoint_every",
                "train.keep_checkpoints", "train.fsdp.max_restarts", "eval", "monitor", "engine",
                "rollout.breaker", "runtime")
_STANDING = frozenset({SampleStatus.FILTERED, SampleStatus.FAILED, SampleStatus.DROPPED_STALE})
T = TypeVar("T")


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted fields whose value differs, and that a resume may not change. A field added to
    the schema since the checkpoint counts at its default (the run had that behaviour)."""
    flat_a, flat_b = _flatten(_with_defaults(saved)), _flatten(new)
    changed = sorted(k for k in flat_a.keys() | flat_b.keys()
                     if flat_a.get(k, _MISSING) != flat_b.get(k, _MISSING))
    return [k for k in changed
            if not any(k == p or k.startswith(p + ".") for p in SAFE_CHANGES)]


_MISSING = object()


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` read by the current schema, so fields added since are at their defaults
    (list items too: ``tasks.sources``); as saved when the schema cannot read it."""
    from pydantic import ValidationError

    from rollstream.config.schema import RunConfig

    try:
        return RunConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        return saved


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def group_of(sample_uid: str) -> str:
    return sample_uid.rsplit("/", 1)[0]


def reconcile_ledger(run_dir: Path, ckpt: Checkpoint | None, *,
                     group_size: int) -> tuple[set[str], int]:
    """Rewrite ``run_dir/ledger.jsonl`` for a resume from ``ckpt`` (None: from step 0).

    Returns the standing group ids (admitted after the checkpoint, retired untrained: the
    resumed run skips them) and the number of superseded lines. The file is streamed: the
    checkpointed head is copied line by line, only the tail is held. A head line that is not
    a ledger entry, or a head shorter than the checkpoint counted, is a ValueError naming the
    line (skipping it would lose its sample); so is a bad tail line other than the last (the
    line a kill tore)."""
    files = RunFiles(run_dir)
    path, superseded_path = files.ledger, files.superseded("ledger")
    if not path.exists():
        recover(path, superseded_path)
        return set(), 0
    n_head = int(ckpt.state["rollout"]["ledger_lines"]) if ckpt is not None else 0
    with Supersede(path, superseded_path) as move:
        tail = _copy_head(path, n_head, ckpt, move.new, parse_row)
        held = set(ckpt.state["rollout"]["held_groups"]) if ckpt is not None else set()
        by_group: dict[str, list[LedgerRow]] = defaultdict(list)
        for _, row in tail:
            by_group[_key(row.sample_uid)].append(row)
        standing: set[str] = set()
        for gid, rows in by_group.items():
            retired_untrained = (gid not in held and len(rows) == group_size
                                 and all(r.status in _STANDING and r.taken_at_step is None
                                         for r in rows))
            if gid.endswith(_ROW) or retired_untrained:
                standing.add(gid)
        step = ckpt.step if ckpt is not None else 0
        moved = []
        for raw, row in tail:
            if _key(row.sample_uid) in standing:
                move.new.write(raw)
            else:
                moved.append(encode_row(msgspec.structs.replace(
                    row, superseded_at_resume_step=step)))
        move.commit(moved)
    n_replays = _reconcile_replays(run_dir, ckpt, step)
    return {g for g in standing if not g.endswith(_ROW)}, len(moved) + n_replays


def _copy_head(path: Path, n_head: int, ckpt: Checkpoint | None, out: IO[bytes],
               parse: Callable[[bytes], tuple[T | None, str]]) -> list[tuple[bytes, T]]:
    """Copy ``path``'s first ``n_head`` lines (each checked to be an entry: ``parse`` takes
    it) to ``out``; return the lines after them (raw, parsed), a torn last line left out."""
    tail: list[tuple[bytes, T]] = []
    bad: tuple[int, str] | None = None
    lineno = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if bad is not None:
                raise ValueError(f"{path} line {bad[0]}: {bad[1]}; only the last line may be "
                                 "torn (by a kill). Repair or remove that line to resume")
            row, why = parse(raw)
            raw = raw if raw.endswith(b"\n") else raw + b"\n"
            if lineno <= n_head:
                if row is None:
                    assert ckpt is not None
                    raise ValueError(
                        f"{path} line {lineno}: {why}, inside the {n_head} lines that "
                        f"checkpoint {ckpt.path} counts as done: resuming would lose that "
                        "sample. Restore the line from a copy of the run to resume")
                out.write(raw)
            elif row is None:
                bad = (lineno, why)
            else:
                tail.append((raw, row))
    if lineno < n_head:
        assert ckpt is not None
        raise ValueError(f"{path} has {lineno} lines, fewer than the {n_head} that checkpoint "
                         f"{ckpt.path} counts as done: the ledger lost lines since")
    return tail


def _parse_replay(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """A replay event: a JSON object with a string ``sample_uid``."""
    row, why = parse_line(raw)
    if row is not None and not isinstance(row.get("sample_uid"), str):
        return None, "not an entry (its sample_uid is not a string)"
    return row, why


def _superseded_line(row: dict[str, Any], step: int) -> bytes:
    return (json.dumps({**row, "superseded_at_resume_step": step}) + "\n").encode()


def _reconcile_replays(run_dir: Path, ckpt: Checkpoint | None, step: int) -> int:
    """Move the replay events past ``ckpt``'s count to ``replays.superseded.jsonl``."""
    files = RunFiles(run_dir)
    path, superseded_path = files.replays, files.superseded("replays")
    if not path.exists():
        recover(path, superseded_path)
        return 0
    n_head = int(ckpt.state["rollout"].get("replay_lines", 0)) if ckpt is not None else 0
    with Supersede(path, superseded_path) as move:
        tail = [row for _, row in _copy_head(path, n_head, ckpt, move.new, _parse_replay)]
        move.commit(_superseded_line(r, step) for r in tail)
    return len(tail)


_ROW = "#row"  # a rejected dataset row's ledger uid ends so (Ledger.record_rejected)


def reconcile_logs(run_dir: Path, ckpt: Checkpoint | None) -> int:
    """Move what ``metrics.jsonl`` and ``timeline.jsonl`` hold past ``ckpt``'s sizes (all of
    it when None: the run starts at step 0) to ``<stream>.superseded.jsonl``; returns the
    lines moved. A checkpoint's own record (its ``checkpoint_step`` phase line) stands. The
    head is copied in chunks; only the tail is read into memory."""
    sizes = ckpt.state.get("logs") if ckpt is not None else {}
    if sizes is None:  # written before checkpoints stored them: leave the files as they are
        return 0
    step = ckpt.step if ckpt is not None else 0
    moved = 0
    files = RunFiles(run_dir)
    for stream in ("metrics", "timeline"):
        path, superseded_path = files.stream(stream), files.superseded(stream)
        size = int(sizes.get(stream, 0))
        if not path.exists() or path.stat().st_size <= size:
            recover(path, superseded_path)
            continue
        with Supersede(path, superseded_path) as move, path.open("rb") as f:
            _copy_bytes(f, move.new, size)
            superseded = []
            for line in f.read().decode(errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):  # the line a kill tore
                    continue
                stands = (stream == "metrics" and isinstance(row, dict)
                          and row.get("kind") == "phase"
                          and row.get("checkpoint_step") is not None
                          and row["checkpoint_step"] <= step)
                if stands:
                    move.new.write((json.dumps(row, separators=(",", ":")) + "\n").encode())
                elif isinstance(row, dict):
                    superseded.append(_superseded_line(row, step))
            move.commit(superseded)
        moved += len(superseded)
    return moved


def _copy_bytes(src: IO[bytes], dst: IO[bytes], size: int, chunk: int = 1 << 20) -> None:
    """Copy the next ``size`` bytes of ``src`` to ``dst``, ``chunk`` at a time."""
    while size > 0:
        data = src.read(min(chunk, size))
        if not data:
            return
        dst.write(data)
        size -= len(data)


def _key(sample_uid: str) -> str:
    return sample_uid if sample_uid.endswith(_ROW) else group_of(sample_uid)
