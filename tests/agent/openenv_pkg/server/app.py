"""The guessing game's server (the template's ``server/app.py``)."""

from __future__ import annotations

from openenv.core.env_server.http_server import create_app

from tests.agent.openenv_pkg.models import GuessAction, GuessObservation
from tests.agent.openenv_pkg.server.guess_environment import GuessEnvironment

app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=16)

# as the template makes it: one session at a time
single = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                    max_concurrent_envs=1)
