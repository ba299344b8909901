"""Host-side bookkeeping of the local engine: the FIFO waiting queue and the live rows.

Live sequences always occupy cache rows ``0..n-1`` (the runner's batch is a slice, never a
gather). When rows finish, ``release`` fills the holes below the new ``n`` with the last live
rows and returns the (src, dst) moves for the runner to copy: a few small copies per finish
instead of a gather per decode step.

With a prefix cache (``prefix.py``) a prompt costs the budget only its uncached tokens, and
a prompt whose next uncached block another prompt admitted in the same step computes waits
one step, to find it cached then (the samples of a group arrive together: the first
prefills the shared prompt, the others its cached copy; SGLang defers such requests alike).

Deliberately simplified: admission is FIFO with a prefill token budget; no priorities, no
preemption (a running sequence keeps its row until it finishes or is interrupted).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollstream.engine.protocol import GenerateRequest

if TYPE_CHECKING:
    from rollstream.engine.local.prefix import PrefixCache

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Sequence:
    request: GenerateRequest
    max_new_tokens: int  # clamped so that prompt + response fits the cache row
    seed_key: int  # the sampler's 32-bit key for this request's random stream
    future: concurrent.futures.Future
    version_marks: list[tuple[int, int]] = field(default_factory=list)  # (first token idx, version)
    streamed: int = 0  # tokens handed to ``request.on_tokens`` so far
    prefix: list[int] = field(default_factory=list)  # prefix cache blocks its prompt starts
    # with, held from admission until its prefill pass has stored its own blocks

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
    prefix: PrefixCache | None = None  # the runner's prefix cache (None: none)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Pop waiting sequences (FIFO) into free rows within the prefill token budget
        (uncached tokens), each holding its prefix cache hit; a sequence whose next block
        another one admitted now computes waits, in order (admission stops at ``max_rows`` such);
        always admits at least one when a row is free."""
        new: list[Sequence] = []
        deferred: list[Sequence] = []
        claimed: set[object] = set()  # next-block keys the admitted prompts compute
        budget, prefix = self.prefill_budget_tokens, self.prefix
        while self.waiting and len(self.running) + len(new) < self.max_rows:
            seq, hit, key = self.waiting[0], [], None
            if prefix is not None and prefix.on:
                hit = prefix.match(seq.request.prompt_ids)
                key = prefix.next_key(seq.request.prompt_ids, hit)
                if key is not None and key in claimed:
                    if len(deferred) == self.max_rows:  # enough scanned: the rest next step
                        break
                    deferred.append(self.waiting.popleft())
                    continue
            cost = seq.prompt_len - (len(hit) * prefix.block_tokens if hit else 0)
            if new and cost > budget:
                break
            budget -= cost
            claimed.add(key)
            new.append(self.waiting.popleft())
            if prefix is not None and prefix.on:
                prefix.acquire(hit, seq.prompt_len)
                seq.prefix = hit
        self.waiting.extendleft(reversed(deferred))
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

