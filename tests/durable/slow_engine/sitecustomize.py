"""Imported at start-up by every Python process started with this folder on its PYTHONPATH
(the agent kill tests' ``rollstream train`` runs). In the one process whose environment sets
``ROLLSTREAM_TEST_ENGINE_STEP_SLEEP_S`` (popped here, so the run's reward and harness worker
processes import nothing for it), each step of the local engine's loop first sleeps that long,
so that generation, not training, sets the run's pace and every step's checkpoint finds
episodes between turns. Without it the tiny engine's one slot outran the trainer: on a quiet
machine six of nine checkpoints held only groups not started yet, and beside a busy second
test worker all nine did (2026-12-07, this suite's two-worker runs)."""

import os

_SLEEP_S = os.environ.pop("ROLLSTREAM_TEST_ENGINE_STEP_SLEEP_S", None)

if _SLEEP_S is not None:
    import time

    from rollstream.engine.local import engine as _engine

    _step = _engine.LocalEngine._step

    def _slow_step(self: _engine.LocalEngine) -> None:
        time.sleep(float(_SLEEP_S))
        _step(self)

    _engine.LocalEngine._step = _slow_step  # type: ignore[method-assign]
