"""The contract between the dispatcher and what runs a task's samples when that is more than
one engine request (an agent episode): a :class:`Harness` brings a sample to its end,
generating each model turn through :meth:`Dispatcher.episode_turn` (the dispatcher's gate,
routing, interrupts, retries and spans), which reports how the turn ended as a
:class:`TurnOutput`. Implementations: ``agent/harness.py`` and ``agent/proxy_harness.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rollstream.engine.protocol import FinishReason, SamplingParams
from rollstream.trajectory import Sample

if TYPE_CHECKING:
    from rollstream.rollout.dispatcher import Dispatcher


@dataclass(slots=True, kw_only=True, frozen=True)
class TurnOutput:
    """How one model turn ended (its tokens went into the sample or episode)."""

    finish_reason: FinishReason  # STOP | LENGTH; ABORT when out of time or the engine failed
    num_tokens: int  # the turn's tokens (a continued turn: with those it had before)
    num_interrupts: int = 0  # continuations after engine interrupts
    out_of_time: bool = False  # interrupted at the caller's deadline
    error: str | None = None  # the engine failed the turn (direct engine calls only)


class Harness(Protocol):
    """What runs the samples of tasks whose ``Task.harness`` names it (an agent loop)."""

    async def run(self, sample: Sample, dispatcher: Dispatcher, params: SamplingParams) -> None:
        """Bring ``sample`` to GENERATED or GRADED, or FAILED with a reason; or leave it where
        it is when its group is cancelled or no engine is alive (``generate_turn`` said None).
        Generate every model turn with ``dispatcher.episode_turn``."""
