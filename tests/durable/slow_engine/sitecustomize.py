"""Imported at start-up by the agent kill tests' ``rollstream train`` runs (this folder is on
their PYTHONPATH): each step of the local engine's loop first sleeps ``STEP_SLEEP_S``, so that
generation, not training, sets the run's pace and every step's checkpoint finds episodes
between turns. Without it the tiny engine's one slot outran the trainer: on a quiet machine
six of nine checkpoints held only groups not started yet, and beside a busy second test worker
all nine did (2026-12-07, this suite's two-worker runs)."""

from rollstream.engine.local import engine as _engine

STEP_SLEEP_S = 0.003
_step = _engine.LocalEngine._step


def _slow_step(self: _engine.LocalEngine) -> None:
    import time

    time.sleep(STEP_SLEEP_S)
    _step(self)


_engine.LocalEngine._step = _slow_step  # type: ignore[method-assign]
