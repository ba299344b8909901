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
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from rollstream.data.ledger import REPLAYS
from rollstream.durable.checkpoint import Checkpoint

# what may differ between a checkpoint's config and the resuming one (dotted prefixes)
SAFE_CHANGES = ("resume", "run_root", "max_wall_s", "train.steps", "train.checkpoint_every",
                "train.keep_checkpoints", "train.fsdp.max_restarts", "eval", "monitor", "engine",
                "rollout.breaker", "runtime")
_STANDING = frozenset({"filtered", "failed", "dropped_stale"})


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
    resumed run skips them) and the number of superseded lines."""
    path = run_dir / "ledger.jsonl"
    if not path.exists():
        return set(), 0
    lines = path.read_text().splitlines()
    n_head = int(ckpt.state["rollout"]["ledger_lines"]) if ckpt is not None else 0
    head, tail = lines[:n_head], []
    for line in lines[n_head:]:
        try:
            tail.append(json.loads(line))
        except json.JSONDecodeError:  # the line a kill tore
            continue
    held = set(ckpt.state["rollout"]["held_groups"]) if ckpt is not None else set()
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in tail:
        by_group[_key(row["sample_uid"])].append(row)
    standing: set[str] = set()
    for gid, rows in by_group.items():
        retired_untrained = (gid not in held and len(rows) == group_size
                             and all(r["status"] in _STANDING and r.get("taken_at_step") is None
                                     for r in rows))
        if gid.endswith(_ROW) or retired_untrained:
            standing.add(gid)
    kept = [r for r in tail if _key(r["sample_uid"]) in standing]
    superseded = [r for r in tail if _key(r["sample_uid"]) not in standing]
    step = ckpt.step if ckpt is not None else 0
    if superseded:
        with (run_dir / "ledger.superseded.jsonl").open("a") as f:
            for r in superseded:
                f.write(json.dumps({**r, "superseded_at_resume_step": step}) + "\n")
    tmp = path.with_name(f".ledger.jsonl.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in head)
                   + "".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    n_replays = _reconcile_replays(run_dir, ckpt, step)
    return {g for g in standing if not g.endswith(_ROW)}, len(superseded) + n_replays


def _reconcile_replays(run_dir: Path, ckpt: Checkpoint | None, step: int) -> int:
    """Move the replay events past ``ckpt``'s count to ``replays.superseded.jsonl``."""
    path = run_dir / REPLAYS
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    n_head = int(ckpt.state["rollout"].get("replay_lines", 0)) if ckpt is not None else 0
    tail = []
    for line in lines[n_head:]:
        try:
            tail.append(json.loads(line))
        except json.JSONDecodeError:  # the line a kill tore
            continue
    if tail:
        with (run_dir / "replays.superseded.jsonl").open("a") as f:
            for r in tail:
                f.write(json.dumps({**r, "superseded_at_resume_step": step}) + "\n")
    tmp = path.with_name(f".{REPLAYS}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in lines[:n_head]))
    tmp.replace(path)
    return len(tail)


_ROW = "#row"  # a rejected dataset row's ledger uid ends so (Ledger.record_rejected)


def reconcile_logs(run_dir: Path, ckpt: Checkpoint | None) -> int:
    """Move what ``metrics.jsonl`` and ``timeline.jsonl`` hold past ``ckpt``'s sizes (all of
    it when None: the run starts at step 0) to ``<stream>.superseded.jsonl``; returns the
    lines moved. A checkpoint's own record (its ``checkpoint_step`` phase line) stands."""
    sizes = ckpt.state.get("logs") if ckpt is not None else {}
    if sizes is None:  # written before checkpoints stored them: leave the files as they are
        return 0
    step = ckpt.step if ckpt is not None else 0
    moved = 0
    for stream in ("metrics", "timeline"):
        path = run_dir / f"{stream}.jsonl"
        if not path.exists():
            continue
        data = path.read_bytes()
        size = int(sizes.get(stream, 0))
        if len(data) <= size:
            continue
        kept, superseded = [], []
        for line in data[size:].decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line a kill tore
                continue
            stands = (stream == "metrics" and row.get("kind") == "phase"
                      and row.get("checkpoint_step") is not None
                      and row["checkpoint_step"] <= step)
            (kept if stands else superseded).append(row)
        with (run_dir / f"{stream}.superseded.jsonl").open("a") as f:
            for r in superseded:
                f.write(json.dumps({**r, "superseded_at_resume_step": step}) + "\n")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data[:size] + b"".join(
            (json.dumps(r, separators=(",", ":")) + "\n").encode() for r in kept))
        tmp.replace(path)
        moved += len(superseded)
    return moved


def _key(sample_uid: str) -> str:
    return sample_uid if sample_uid.endswith(_ROW) else group_of(sample_uid)
