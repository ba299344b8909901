"""Host-side bookkeeping of the local engine: the FIFO waiting queue and the live rows.

Live sequences always occupy cache rows ``0..n-1`` (the runner's batch is a slice, never a
gather). When rows finish, ``release`` fills the holes below the new ``n`` with the last live
rows and returns the (src, dst) moves for the runner to copy: a few small copies per finish
instead of a gather per decode step.

Deliberately simplified: admission is FIFO with a prefill token budget; no priorities, no
preemption (a running sequence keeps its row until it finishes or is interrupted).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

from rollstream.engine.protocol import GenerateRequest


@dataclass(slots=True, kw_only=True)
class Sequence:
    request: GenerateRequest
    max_new_tokens: int  # clamped so that prompt + response fits the cache row
    seed_key: int  # the sampler's 32-bit key for this request's random stream
    future: concurrent.futures.Future
    version_marks: list[tuple[int, int]] = field(default_factory=list)  # (first token idx, version)
    streamed: int = 0  # tokens handed to ``request.on_tokens`` so far

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def mark_version(self, num_generated: int, version: int) -> None:
        """Tokens from index ``num_generated`` on are sampled by ``version``."""
        if self.version_marks and self.version_marks[-1][0] == num_generated:
            self.version_marks.pop()
        self.version_marks.append((num_generated, version))

    def versions(self, num_tokens: int) -> list[int]:
        out: list[int] = []
        ends = [start for start, _ in self.version_marks[1:]] + [num_tokens]
        for (start, version), end in zip(self.version_marks, ends, strict=True):
            out.extend([version] * (min(end, num_tokens) - start))
        return out


@dataclass(slots=True, kw_only=True)
class Scheduler:
    max_rows: int
    prefill_budget_tokens: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # index = cache row
    num_streaming: int = 0  # running sequences whose request streams (``on_tokens``)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Pop waiting sequences (FIFO) into free rows within the prefill token budget;
        always admits at least one when a row is free."""
        new: list[Sequence] = []
        budget = self.prefill_budget_tokens
        while self.waiting and len(self.running) + len(new) < self.max_rows:
            cost = self.waiting[0].prompt_len
            if new and cost > budget:
                break
            budget -= cost
            new.append(self.waiting.popleft())
        self.running.extend(new)
        self.num_streaming += sum(s.request.on_tokens is not None for s in new)
        return new

    def stream(self, read: Callable[[list[int], list[int]], list[tuple[list[int], Any]]],
               ) -> None:
        """Hand each running request that streams the tokens sampled since it last heard;
        ``read(rows, starts)``: the tokens of ``rows`` from those positions on (the
        runner's)."""
        if not self.num_streaming:
            return
        rows = [i for i, s in enumerate(self.running) if s.request.on_tokens is not None]
        seqs = [self.running[i] for i in rows]
        for seq, (tokens, _) in zip(seqs, read(rows, [s.prompt_len + s.streamed for s in seqs]),
                                    strict=True):
            if tokens:
                seq.streamed += len(tokens)
                try:
                    seq.request.on_tokens(tokens)
                except Exception:  # noqa: BLE001 - a listener's fault never stops the engine
                    log.exception("on_tokens of request %s raised", seq.request_id)

    def release(self, rows: list[int]) -> tuple[list[Sequence], list[int], list[int]]:
        """Remove the sequences at ``rows``; returns them and the row moves (src, dst) that
        keep the live rows packed at the front."""
        gone = set(rows)
        removed = [self.running[r] for r in rows]
        n_after = len(self.running) - len(gone)
        holes = sorted(r for r in gone if r < n_after)
        movers = [r for r in range(n_after, len(self.running)) if r not in gone]
        for src, dst in zip(movers, holes, strict=True):
            self.running[dst] = self.running[src]
        del self.running[n_after:]
        self.num_streaming -= sum(s.request.on_tokens is not None for s in removed)
        return removed, movers, holes

    def take_waiting(self, ids: frozenset[str] | None) -> list[Sequence]:
        """Remove and return waiting sequences whose id is in ``ids`` (None = all)."""
        taken = [s for s in self.waiting if ids is None or s.request_id in ids]
        if taken:
            keep = [s for s in self.waiting if not (ids is None or s.request_id in ids)]
            self.waiting = deque(keep)
        return taken
