"""The ledger: every sample reaches exactly one terminal status, recorded once.

Append-only JSONL (``ledger.jsonl`` in the run directory), flushed per line, so a crash at
any moment leaves a readable file and a resume knows what is done. The in-memory index
enforces exactly-once: recording a sample uid twice, or dispatching one again, is a bug and
raises. It holds the open samples and the newest ``RECENT`` (16,384) terminal ones, so its memory stays
flat over a long run; older uids cannot come back, because sample ids carry the admission
index of their group (or the evaluation round), which only grows (``durable.audit`` checks
the whole file).

Each line is a :class:`~rollstream.data.ledger_row.LedgerRow` (versioned; older lines still
read). An episode whose chat template rewrote earlier turns (``Sample.contexts``) is one line
still, with one row per turn-sample nested in it (``turn_samples``: :func:`turn_sample_rows`),
so it is recorded exactly once and its turn-samples with it. A ledger opened on an existing
file (a resumed run, after ``durable.resume`` reconciled it) knows every sample that file
records. :meth:`sync` flushes and fsyncs it and returns its line
count, which a checkpoint stores: the lines after it are what a resume reconciles.

Also tracks which dispatched samples are still open (``open``, then ``write``) so that, at
the end of a run, :meth:`unfinished` names every one that never reached a terminal status.
The ledger stores; it does not decide: statuses change in ``rollout.lifecycle``.

A replay (``rollout.replay``: a group trained again at a later step) is not a status: the
sample keeps its one terminal line, and :meth:`replayed` appends an event to
``replays.jsonl`` beside the ledger, one line per replayed sample the loss kept tokens of. Its line count is checkpointed with the ledger's, so a resume supersedes the
lost process's replays as it does its trained lines.
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from msgspec import UNSET

from rollstream.data.ledger_row import (
    FORMAT,
    EnvTurn,
    LedgerRow,
    PolicyTurn,
    TurnRow,
    decode_row,
    encode_row,
)
from rollstream.run_files import REPLAYS
from rollstream.trajectory import Sample, SampleStatus, SegmentKind, Turn

T = TypeVar("T")

RECENT = 1 << 14  # terminal sample uids kept in memory for the exactly-once check


class Ledger:
    def __init__(self, path: Path | None = None) -> None:
        self._terminal: OrderedDict[str, SampleStatus] = OrderedDict()  # the newest RECENT
        self._rows: dict[str, SampleStatus] = {}  # rejected dataset rows (few)
        self._open: dict[str, Sample] = {}
        self.counts: Counter[str] = Counter()
        self.num_lines = 0
        self.num_recorded = 0
        if path is not None and path.exists():
            for row in iter_ledger(path):
                if row.is_dataset_row:
                    self._rows[row.sample_uid] = SampleStatus.FAILED
                    self.counts["rejected_rows"] += 1
                else:
                    self._remember(row.sample_uid, row.status)
                    self.counts[row.status.value] += 1
                self.num_lines += 1
                self.num_recorded += 1
        self._fh: IO[str] | None = path.open("a", buffering=1) if path is not None else None
        self._replay_path = path.with_name(REPLAYS) if path is not None else None
        self._replay_fh: IO[str] | None = None  # opened at the first replay
        self.num_replay_lines = (sum(1 for _ in iter_jsonl(self._replay_path, parse_line))
                                 if self._replay_path is not None and self._replay_path.exists()
                                 else 0)
        if self.num_replay_lines:
            self.counts["replayed"] = self.num_replay_lines

    def open(self, sample: Sample) -> None:
        """A sample was dispatched; it must reach :meth:`write` before the run ends."""
        if sample.uid in self._terminal or sample.uid in self._open:
            raise AssertionError(f"sample {sample.uid} dispatched twice")
        self._open[sample.uid] = sample

    def write(self, sample: Sample, t_s: float | None = None) -> None:
        """Append ``sample``, whose status is terminal, to the file (exactly once).

        Only ``rollout.lifecycle.Lifecycle.move`` calls this, after setting the status."""
        status = sample.status
        assert status.is_terminal(), f"{status} is not terminal"
        if sample.uid in self._terminal:
            raise AssertionError(
                f"sample {sample.uid} already recorded as {self._terminal[sample.uid].value}; "
                f"cannot record it again as {status.value}"
            )
        self._remember(sample.uid, status)
        self.num_recorded += 1
        self._open.pop(sample.uid, None)
        self.counts[status.value] += 1
        if self._fh is not None:
            self._fh.write(encode_row(LedgerRow(
                format=FORMAT, sample_uid=sample.uid, task_uid=sample.task.uid,
                source=sample.task.source, status=status, reason=sample.failure,
                reward=sample.reward, num_tokens=sample.num_response_tokens,
                prompt_tokens=len(sample.task.prompt_ids), min_version=sample.min_version(),
                max_version=sample.max_version(), num_interrupts=sample.num_interrupts,
                finish_reason=sample.finish_reason,
                num_turns=sum(t.kind is SegmentKind.POLICY for t in sample.turns),
                turns=[turn_entry(t) for t in sample.turns],
                trained_at_step=sample.trained_at_step,
                min_trained_version=sample.min_trained_version,
                num_trained_tokens=sample.num_trained_tokens,
                trained_version_sum=sample.trained_version_sum, taken_at_step=sample.taken_at_step,
                restored_tokens=sample.num_restored_tokens, t_s=t_s,
                turn_samples=turn_sample_rows(sample) if sample.contexts else UNSET,
            )).decode())
            self.num_lines += 1

    def replayed(self, sample: Sample, step: int, *, num_tokens: int, min_version: int | None,
                 t_s: float | None = None) -> None:
        """``sample``, recorded terminal before, was trained again at ``step`` (a replay):
        ``num_tokens`` kept by the loss, the oldest of version ``min_version``."""
        if not sample.status.is_terminal():
            raise AssertionError(f"sample {sample.uid} replayed before its terminal record")
        self.counts["replayed"] += 1
        if self._replay_path is None:
            return
        if self._replay_fh is None:
            self._replay_fh = self._replay_path.open("a", buffering=1)
        self._replay_fh.write(json.dumps({
            "sample_uid": sample.uid, "task_uid": sample.task.uid, "source": sample.task.source,
            "event": "replayed", "replayed_at_step": step, "num_trained_tokens": num_tokens,
            "min_trained_version": min_version, "reward": sample.reward, "t_s": t_s,
        }) + "\n")
        self.num_replay_lines += 1

    def record_rejected(self, task_uid: str, source: str, reason: str) -> None:
        """A dataset row that could not become a task: written as a failed task, once."""
        uid = f"{task_uid}#row"
        if uid in self._rows:
            raise AssertionError(f"row {task_uid} already recorded")
        self._rows[uid] = SampleStatus.FAILED
        self.num_recorded += 1
        self.counts["rejected_rows"] += 1
        if self._fh is not None:
            self._fh.write(encode_row(LedgerRow(
                format=FORMAT, sample_uid=uid, task_uid=task_uid, source=source,
                status=SampleStatus.FAILED, reason=f"bad dataset row: {reason}",
                t_s=0.0)).decode())
            self.num_lines += 1

    def sync(self) -> int:
        """Flush and fsync the files; the number of lines the ledger holds."""
        for fh in (self._fh, self._replay_fh):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
        return self.num_lines

    def _remember(self, uid: str, status: SampleStatus) -> None:
        self._terminal[uid] = status
        if len(self._terminal) > RECENT:
            self._terminal.popitem(last=False)

    def status_of(self, uid: str) -> SampleStatus | None:
        """A rejected row's status, or a recent sample's (None: not recorded, or long ago)."""
        return self._rows.get(uid) or self._terminal.get(uid)

    def unfinished(self) -> list[Sample]:
        return list(self._open.values())


    def close(self) -> None:
        for fh in (self._fh, self._replay_fh):
            if fh is not None:
                fh.close()
        self._fh = self._replay_fh = None


def turn_sample_rows(sample: Sample) -> list[LedgerRow]:
    """The turn-samples of a terminal episode (``trajectory.turn_samples``), each as a row:
    ``<sample_uid>#t<k>``, its context (``prompt_tokens``), the tokens after it, the versions of
    its model's tokens and its model turns; status, reward and steps are the episode's."""
    rows = []
    for k, t in enumerate(sample.turn_samples()):
        segs = sample.segments[t.first:t.end]
        versions = [v for g in segs if g.kind is SegmentKind.POLICY for v in g.versions]
        rows.append(LedgerRow(
            format=FORMAT, sample_uid=f"{sample.uid}#t{k}", task_uid=sample.task.uid,
            source=sample.task.source, status=sample.status, reward=sample.reward,
            num_tokens=sum(len(g) for g in segs), prompt_tokens=len(t.prompt_ids),
            min_version=min(versions, default=None), max_version=max(versions, default=None),
            num_turns=sum(g.kind is SegmentKind.POLICY for g in segs),
            trained_at_step=sample.trained_at_step, taken_at_step=sample.taken_at_step))
    return rows


def turn_entry(turn: Turn) -> TurnRow:
    """A turn of an agent episode as its ledger line lists it: what a replay of the episode in
    the simulator needs (tokens; a model turn's seconds, an environment turn's tool wait) and
    what the harness spent beside (an environment turn's seconds beyond ``tool_s``; the gap
    to the next turn's ``started_s``). ``tool_s``: the longest call's seconds (a turn's calls
    run concurrently: the episode waited that long on its tools; 0 without a call)."""
    times = {"num_tokens": turn.num_tokens, "started_s": round(turn.started_s, 6),
             "duration_s": round(turn.duration_s, 6)}
    if turn.kind is SegmentKind.POLICY:  # tool calls: an SDK agent's after this turn
        return PolicyTurn(**times, finish_reason=turn.finish_reason,
                          num_interrupts=turn.num_interrupts,
                          num_tool_calls=len(turn.tool_calls))
    return EnvTurn(**times, num_tool_calls=len(turn.tool_calls),
                   tool_s=round(max((r.duration_s for r in turn.tool_results), default=0.0), 6))


def read_ledger(path: Path) -> list[LedgerRow]:
    """A ledger file's rows (:func:`iter_ledger`)."""
    return list(iter_ledger(path))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A file of JSON-object lines (``replays.jsonl``, ``metrics.jsonl``), read as the ledger
    is (:func:`iter_jsonl`)."""
    return list(iter_jsonl(path, parse_line))


def iter_ledger(path: Path) -> Iterator[LedgerRow]:
    """A ledger file's rows, streamed (:func:`iter_jsonl`, each line a
    :class:`~rollstream.data.ledger_row.LedgerRow`)."""
    return iter_jsonl(path, parse_row)


def iter_jsonl(path: Path, parse: Callable[[bytes], tuple[T | None, str]]) -> Iterator[T]:
    """A ledger-like file's lines parsed by ``parse`` (:func:`parse_row`; :func:`parse_line`,
    a JSON object, for ``replays.jsonl``), streamed. The last line may be torn (a crash
    mid-write) and is skipped; any other line ``parse`` refuses is a ValueError naming it: a
    lost line is a lost sample."""
    with path.open("rb") as f:
        bad: tuple[int, str] | None = None
        for lineno, raw in enumerate(f, start=1):
            if bad is not None:
                raise ValueError(f"{path} line {bad[0]}: {bad[1]}")
            row, why = parse(raw)
            if row is None:
                bad = (lineno, why)
                continue
            yield row


def parse_row(raw: bytes) -> tuple[LedgerRow | None, str]:
    """A ledger line's row, or (None, why it is not one)."""
    try:
        return decode_row(raw), ""
    except ValueError as e:
        return None, str(e)


def parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """A line's JSON object, or (None, why it is not one)."""
    try:
        row = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return None, f"not JSON ({e})"
    if not isinstance(row, dict):
        return None, f"not a JSON object ({type(row).__name__})"
    return row, ""
