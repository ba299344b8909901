"""Guess the number the reset was given (the template's ``server/<name>_environment.py``).

A guess containing the target ends the episode with reward 1; a wrong one is answered with
``higher`` or ``lower`` (``no`` when the text holds no number) and reward 0, and the
episode ends after ``MAX_GUESSES`` of them. Every session is its own instance."""

from __future__ import annotations

import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from tests.agent.openenv_pkg.models import GuessAction, GuessObservation

MAX_GUESSES = 2


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              target: int = 7, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.target = int(target)
        return GuessObservation(hint="guess", done=False, reward=0.0)

    def step(self, action: GuessAction,  # type: ignore[override]
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if str(self.target) in action.message:
            return GuessObservation(hint="right", done=True, reward=1.0)
        found = re.search(r"-?\d+", action.message)
        hint = "no" if found is None else ("higher" if int(found[0]) < self.target else "lower")
        done = self._state.step_count >= MAX_GUESSES
        return GuessObservation(hint=hint, done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
