"""The guessing game's action and observation (the template's ``models.py``)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """A guess: the model's text."""

    message: str = Field(..., description="The guess")


class GuessObservation(Observation):
    """What the environment says about a guess."""

    hint: str = Field(default="", description="higher, lower or right")
