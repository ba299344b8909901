"""A server that answers a step as its action asks: ``big`` (a hint of 64 kB), ``nan`` (a
reward that is not a number), ``nohint`` (an observation without the ``hint`` field),
``list`` (a hint that is a list), anything else a plain hint."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Observation, State

from tests.agent.openenv_pkg.models import GuessAction


class AnyObservation(Observation):
    hint: Any = None


class HostileEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> AnyObservation:
        return AnyObservation(hint="go", done=False, reward=0.0)

    def step(self, action: GuessAction, **kwargs: Any) -> AnyObservation:  # type: ignore[override]
        asked = action.message
        if asked == "big":
            return AnyObservation(hint="x" * 65536, done=False, reward=0.0)
        if asked == "nan":
            return AnyObservation(hint="nan", done=True, reward=float("nan"))
        if asked == "nohint":
            return AnyObservation(done=False, reward=0.0)
        if asked == "list":
            return AnyObservation(hint=[1, 2], done=False, reward=0.0)
        return AnyObservation(hint="plain", done=False, reward=0.5)

    @property
    def state(self) -> State:
        return self._state


app = create_app(HostileEnvironment, GuessAction, AnyObservation, env_name="hostile",
                 max_concurrent_envs=16)
