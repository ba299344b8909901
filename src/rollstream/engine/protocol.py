"""The engine contract: token in, token out, interruptible, versioned.

Every engine (the embedded ``local`` engine, a real ``vllm`` server, the simulator's fake)
implements :class:`Engine`. The rollout layer talks to engines only through it.

Semantics every implementation honours (the contract tests in tests/engine check them):

* ``generate`` takes prompt token ids and returns sampled token ids, the behaviour-policy
  logprob of each, and the weight version that sampled each token. No text, no re-tokenizing.
  The logprob is taken under the distribution the token was drawn from: ``logits / T``
  truncated by top-k then top-p and renormalised (T = 0: ``log_softmax(logits)``).
* A mixture-of-experts model's routing (``GenerateOutput.routing``, engines that record
  it: the local one) holds the experts of every token of prompt + output as last computed
  (the last token's marked not computed); it is what ``train.routing_replay`` replays.
* ``interrupt(ids)`` (``None`` = every in-flight request) stops those requests at the next
  token boundary; their ``generate`` calls return at once with ``finish_reason=ABORT`` and the
  tokens produced so far. Resubmitting ``prompt + partial`` with ``max_new_tokens`` reduced by
  ``len(partial)`` continues the sample; under greedy decoding the concatenated stream equals
  the uninterrupted one.
* ``load_weights(version, tensors)`` installs new weights between two forward passes: no
  forward pass mixes versions; tokens sampled after it carry ``version``. In-flight requests
  are continued in place (callers that want interrupt-and-resume call ``interrupt`` first).
* Bad input (prompt longer than the context, invalid sampling params) fails that request
  with ``finish_reason=ERROR`` and a message; the engine keeps serving the others.

Health (``EngineStats.health``, why in ``health_reason``; the states are defined in
``states.py``, with the router's):

* ``UP``: route requests here.
* ``RECOVERING``: route nothing to it until it is UP again.
* ``DEAD``: it will never serve again. A dead engine never raises from ``generate``:
  in-flight and later requests return ``finish_reason=ABORT`` with the tokens produced so far
  (logprobs and versions exact; a later request has none) and ``error`` naming the engine and
  the cause, so the caller can resubmit ``prompt + partial`` elsewhere. ``interrupt`` on a
  dead engine does nothing; ``load_weights`` raises RuntimeError with the cause.

Whose fault a failed request is, which decides whether it is tried again: ``ERROR`` is the
request's own (a prompt longer than the context, invalid parameters, an HTTP 4xx): it fails
the sample. ``ABORT`` with ``error`` set is the engine's (it died, its stream broke, it
answered HTTP 5xx, its actor raised), whatever its health says: the caller keeps the tokens
and resubmits ``prompt + partial``, on another engine (``GenerateOutput.engine_fault``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rollstream.engine.states import EngineHealth
from rollstream.trajectory import Routing

if TYPE_CHECKING:  # keep torch out of light imports
    import torch


@dataclass(slots=True, kw_only=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # per-request seed; None = engine's generator

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was sampled (it is included in token_ids)
    LENGTH = "length"  # max_new_tokens or the context limit reached
    ABORT = "abort"  # interrupted; token_ids holds the partial output
    ERROR = "error"  # the request failed; see GenerateOutput.error


OnTokens = Callable[[list[int]], None]  # GenerateRequest.on_tokens


@dataclass(slots=True, kw_only=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # the episode it continues: requests of one episode (a sample's turns, its resubmissions
    # after an interrupt) share it, each prompt extending the last prompt and its output (but
    # after a chat template rewrote earlier turns: trajectory.Context); an engine may keep
    # the history and move only what was added (KeepsEpisodes). None: alone
    episode_id: str | None = None
    # hears the token ids sampled since it last heard, as they are sampled (a reply streamed
    # to an agent), from the engine's own thread: it must be quick and thread-safe. Engines
    # that stream (local, vllm) call it; others do not (the output has every token anyway)
    on_tokens: OnTokens | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True, kw_only=True)
class GenerateOutput:
    request_id: str
    token_ids: list[int]  # [T]
    logprobs: list[float]  # [T] under the distribution sampled: logits / T, top-k/top-p cut
    versions: list[int]  # [T] weight version that sampled each token
    finish_reason: FinishReason
    error: str | None = None
    # mixture-of-experts models, engines that record it: the experts of every token of
    # prompt_ids + token_ids as last computed (the last token's: Routing.none)
    routing: Routing | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"request {self.request_id}: token_ids/logprobs/versions lengths "
                f"{n}/{len(self.logprobs)}/{len(self.versions)} differ"
            )

    @property
    def engine_fault(self) -> bool:
        """The engine, not the request, cut it short (ABORT with an error): resubmit the
        prompt and these tokens, on another engine."""
        return self.finish_reason is FinishReason.ABORT and self.error is not None


@dataclass(slots=True, kw_only=True)
class EngineStats:
    engine_id: str
    version: int
    num_running: int
    num_waiting: int
    capacity: int  # concurrent sequences the engine can hold
    generated_tokens: int  # total since start
    busy_s: float  # seconds spent in forward passes since start
    health: EngineHealth = EngineHealth.UP
    health_reason: str | None = None  # why it is not UP
    # where busy_s went, totals since start (engines that can tell; names in WORK_KEYS)
    work: dict[str, float] = field(default_factory=dict)


# EngineStats.work: prefill passes of admitted requests (a resumed one re-prefills the partial
# tokens its engine's prefix cache does not hold), prefills fused into a decode step (their time is in decode_s), cache
# recomputes after weight loads, regroupings of the rows by length (runner.sort_rows),
# decode steps; and what their attention read: the cache positions the decoded rows hold,
# the positions chunked attention read (one chunk reads its longest row's length for every
# row), and the chunks; the prefix cache's (local engine, engine/local/prefix.py): prompt
# tokens looked up, found cached (not prefilled: the *_prefill_tokens above count only the
# computed ones; hit rate = hit / query), stored, evicted, dropped by weight loads, and the
# seconds its copies took (part of the prefill and decode seconds)
WORK_KEYS = ("prefill_count", "prefill_tokens", "prefill_s", "fused_prefill_count",
             "fused_prefill_tokens", "recompute_count", "recompute_tokens", "recompute_s",
             "sort_count", "sort_s", "decode_count", "decode_s", "attention_positions",
             "attention_work", "attention_chunks", "prefix_query_tokens", "prefix_hit_tokens",
             "prefix_inserted_tokens", "prefix_evicted_tokens", "prefix_dropped_tokens",
             "prefix_copy_s")


@runtime_checkable
class Engine(Protocol):
    engine_id: str

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None: ...

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class Closeable(Protocol):
    async def close(self) -> None: ...


@runtime_checkable
class KeepsEpisodes(Protocol):
    """An engine that keeps an episode's history between its requests
    (``GenerateRequest.episode_id``), so that a request continuing it moves only the tokens
    added since (an engine actor of the Ray runtime) or computes only those (the local
    engine's prefix cache keeps its finished turns). Correctness never depends on it: a
    history it no longer holds is sent whole or computed again."""

    def end_episode(self, episode_id: str) -> None:
        """The episode sends no more requests: drop what was kept of it."""


@runtime_checkable
class HoldsPrefixes(Protocol):
    """An engine that can say how much of a prompt it holds cached now (the local engine's
    prefix cache), so that the router sends an episode's next turn, or a resumed sample, where
    most of it is cached (``rollout/routing.py``). Asked from the caller's thread; a hint,
    never needed for correctness (a prefix evicted meanwhile is computed again)."""

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """The tokens at the start of ``prompt_ids`` whose keys and values the engine holds:
        what a request with this prompt would not prefill."""


@runtime_checkable
class Restartable(Protocol):
    """An engine the rollout restarts when its serving loop died (the local engine, an engine
    actor of the Ray runtime; a vLLM engine restarts its server itself)."""

    def needs_restart(self) -> bool:
        """It stopped serving, may be restarted, and is RECOVERING meanwhile."""

    async def restart(self, version: int, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Serve again at ``version`` with these weights (None: its own initial ones)."""


@runtime_checkable
class Joins(Protocol):
    """An engine that shares run-wide parts with the others (an engine actor of the Ray
    runtime: the weight transport whose rounds reach every actor), so it joins and leaves a
    live run its own way (``runtime/fleet.py``)."""

    async def load_alone(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load ``version`` by itself, outside the rounds that reach the run's engines."""

    async def leave(self) -> None:
        """Close this engine alone (what it shares with the others stays open)."""
