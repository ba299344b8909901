"""The config of an OpenEnv environment that a source's episodes run in (``SourceConfig.openenv``,
``agent/openenv_env.py``): its server (launched by the run or given by URL), how the model's
text becomes an action and an observation becomes text, and the limits on what the server
sends."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.section import Section

_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # module:attribute
_KEY = r"^[A-Za-z_][\w]*$"


class OpenEnvConfig(Section):
    """An OpenEnv environment (the ``openenv-core`` package, the ``openenv`` extra), driven
    through OpenEnv's client: one session per episode (``reset``, then a ``step`` per model
    turn, over its WebSocket). Exactly one of ``app`` and ``url``."""

    app: str | None = Field(None, pattern=_IMPORT_PATH)
    """The server's ASGI app, an import path ``module:name`` (what OpenEnv's template makes
    with ``create_app``, e.g. ``my_env.server.app:app``): the run launches it with uvicorn in
    a process of its own on 127.0.0.1 (a free port) at the source's first episode, and stops
    it when the run closes."""
    url: str | None = Field(None, pattern=r"^(https?|wss?)://[^\s/]+(/\S*)?$")
    """A running OpenEnv server (``http://host:port``): attached, never started or stopped."""
    action_field: str = Field("message", pattern=_KEY)
    """The action's field that receives the model's turn (its text, without the end-of-turn
    token): the step's action is ``{action_field: text}``."""
    observation_field: str | None = Field(None, pattern=_KEY)
    """The observation's field shown to the model after each step (a string, or a number,
    shown as text); null = the whole observation as compact JSON. It is appended as a user
    message."""
    reset_columns: tuple[str, ...] = ()
    """Top-level columns of the row passed to the environment's ``reset`` as keyword
    arguments (e.g. ``seed``); a row without one fails its episode, naming the column."""
    reward: Literal["sum", "last"] = "sum"
    """The episode's reward, from the rewards of its steps (a step without one counts 0):
    their ``sum``, or the ``last`` step's. An episode that ends before the environment says
    ``done`` (a turn or token budget) has no environment reward."""
    max_sessions: int | None = Field(None, ge=1)
    """Sessions open on the server at once (its ``max_concurrent_envs``; OpenEnv's template
    serves one): an episode past it waits at its reset for one to end. Null = no cap (the
    server refuses a session past its own, failing that episode)."""
    max_message_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Largest message the server may send (bytes): a larger one fails the episode."""
    timeout_s: float = Field(30.0, gt=0)
    """Connecting, and each reply to a reset or step: a server slower than this fails the
    episode."""
    start_timeout_s: float = Field(60.0, gt=0)
    """``app``: how long the launched server may take to answer ``/health``."""

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.app is None) == (self.url is None):
            raise ValueError("name exactly one of `app` (an OpenEnv server app the run "
                             "launches, module:name) and `url` (a running server)")
        bad = [c for c in self.reset_columns if not re.fullmatch(_KEY, c)]
        if bad:
            raise ValueError(f"reset_columns: {bad} are not column names (top-level keys of "
                             "the row, letters, digits and _)")
        if len(set(self.reset_columns)) != len(self.reset_columns):
            raise ValueError(f"reset_columns {list(self.reset_columns)} names a column twice")
        return self
