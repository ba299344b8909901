"""The sample state machine: the one function through which every status changes.

    PENDING ──> RUNNING ──> GENERATED ──> GRADED ──> TRAINED
                 │  ^                        (any live status) ──> FILTERED | DROPPED_STALE
                 v  │                                              | FAILED | EVALUATED
             INTERRUPTED                                           | ABORTED

:meth:`Lifecycle.move` checks each transition against this table, sets the status (and the
reason of a terminal one), and hands a terminal sample to the ledger, which writes it exactly
once (a second terminal status raises). Nobody else assigns ``Sample.status``: the dispatcher,
the rollout's group life and the evaluation all call ``move``.
"""

from __future__ import annotations

from rollstream.clock import Clock
from rollstream.data.ledger import Ledger
from rollstream.trajectory import Sample, SampleStatus

S = SampleStatus
_TERMINAL = frozenset(s for s in SampleStatus if s.is_terminal())
_NEXT: dict[SampleStatus, frozenset[SampleStatus]] = {
    S.PENDING: frozenset({S.RUNNING}) | _TERMINAL,
    S.RUNNING: frozenset({S.INTERRUPTED, S.GENERATED}) | _TERMINAL,
    S.INTERRUPTED: frozenset({S.RUNNING, S.GENERATED}) | _TERMINAL,
    S.GENERATED: frozenset({S.GRADED}) | _TERMINAL,
    S.GRADED: _TERMINAL,
}


class Lifecycle:
    def __init__(self, ledger: Ledger, clock: Clock) -> None:
        self.ledger = ledger
        self.clock = clock

    def open(self, sample: Sample) -> None:
        """``sample`` is dispatched: it must reach a terminal status before the run ends."""
        self.ledger.open(sample)

    def move(self, sample: Sample, status: SampleStatus, reason: str | None = None) -> None:
        """Move ``sample`` to ``status``; terminal statuses are written to the ledger once."""
        allowed = _NEXT.get(sample.status, frozenset())
        if status not in allowed:
            raise AssertionError(
                f"sample {sample.uid}: {sample.status.value} -> {status.value} is not a "
                "lifecycle transition")
        sample.status = status
        if status in _TERMINAL:
            sample.failure = reason
            self.ledger.write(sample, self.clock.now())
        else:
            assert reason is None, "only terminal statuses carry a reason"

    def replayed(self, sample: Sample, step: int, *, num_tokens: int,
                 min_version: int | None) -> None:
        """``sample`` (terminal) trained again at ``step``: an event, not a status."""
        self.ledger.replayed(sample, step, num_tokens=num_tokens, min_version=min_version,
                             t_s=self.clock.now())
