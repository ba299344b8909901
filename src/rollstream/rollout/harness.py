"""The contract between the dispatcher and what runs a task's samples when that is more than
one engine request (an agent episode): a :class:`Harness` brings a sample to its end,
generating each model turn through :meth:`EpisodeHost.episode_turn` (the dispatcher's gate,
routing, interrupts, retries and spans), which reports how the turn ended as a
:class:`TurnOutput`. :class:`EpisodeHost` is what a harness may use of the dispatcher that
runs it (the :class:`~rollstream.rollout.dispatcher.Dispatcher` is one); this module sits
below the dispatcher, so the two do not import each other. Implementations:
``agent/harness.py`` (also the simulator's) and ``agent/proxy_harness.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rollstream.clock import Clock
from rollstream.engine.protocol import Engine, FinishReason, OnTokens, SamplingParams
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.trajectory import Sample


@dataclass(slots=True, kw_only=True, frozen=True)
class TurnOutput:
    """How one model turn ended (its tokens went into the sample or episode)."""

    finish_reason: FinishReason  # STOP | LENGTH; ABORT when out of time or the engine failed
    num_tokens: int  # the turn's tokens (a continued turn: with those it had before)
    num_interrupts: int = 0  # continuations after engine interrupts
    out_of_time: bool = False  # interrupted at the caller's deadline
    error: str | None = None  # the engine failed the turn (direct engine calls only)


class EpisodeHost(Protocol):
    """The dispatcher as a harness sees it."""

    @property
    def lifecycle(self) -> Lifecycle: ...  # moves the sample through its statuses

    @property
    def clock(self) -> Clock: ...

    @property
    def engines(self) -> Sequence[Engine]: ...

    @property
    def fatal(self) -> str | None: ...  # why nothing can be dispatched any more

    async def episode_turn(self, sample: Sample, params: SamplingParams, *,
                           deadline: float | None = None, on_tokens: OnTokens | None = None,
                           ) -> TurnOutput | None:
        """Generate one model turn of ``sample`` (None: cancelled, or no engine alive);
        ``on_tokens`` hears its tokens as they are sampled (a streamed reply)."""

    def finish(self, sample: Sample, finish_reason: str) -> None:
        """``sample``'s generation is over."""

    def cancelled(self, group_id: str) -> bool: ...


class Harness(Protocol):
    """What runs the samples of tasks whose ``Task.harness`` names it (an agent loop)."""

    async def run(self, sample: Sample, dispatcher: EpisodeHost, params: SamplingParams) -> None:
        """Bring ``sample`` to GENERATED or GRADED, or FAILED with a reason; or leave it where
        it is when its group is cancelled or no engine is alive (``generate_turn`` said None).
        Generate every model turn with ``dispatcher.episode_turn``."""
