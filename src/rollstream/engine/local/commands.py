"""Messages from the local engine's callers to its engine thread, and the way results return.

Callers (any thread) put commands into the engine's inbox; the engine thread applies them
between two steps and answers through ``concurrent.futures.Future`` objects, which a caller's
event loop awaits with ``asyncio.wrap_future``. A future may already be done when the engine
answers (the caller cancelled it, or the engine answers twice while it dies): ``resolve`` and
``fail`` then do nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from dataclasses import dataclass

from rollstream.engine.local.scheduler import Sequence
from rollstream.engine.local.weights import Install
from rollstream.engine.protocol import FinishReason, GenerateOutput, GenerateRequest
from rollstream.trajectory import Routing


@dataclass(slots=True, kw_only=True)
class Submit:
    seq: Sequence


@dataclass(slots=True, kw_only=True)
class Interrupt:
    ids: frozenset[str] | None  # None = every request
    done: concurrent.futures.Future | None  # None: nobody waits (a cancelled generate)


@dataclass(slots=True, kw_only=True)
class Load:
    version: int
    pairs: list[Install]  # Weights.check's: tensors to copy, adapted weights to merge
    done: concurrent.futures.Future


@dataclass(slots=True, kw_only=True)
class Peek:
    done: concurrent.futures.Future  # -> list[GenerateOutput]: the running requests so far


@dataclass(slots=True, kw_only=True)
class Close:
    done: concurrent.futures.Future


@dataclass(slots=True, kw_only=True)
class EndEpisode:
    episode_id: str  # its blocks in the prefix cache go first when room is needed


Command = Submit | Interrupt | Load | Peek | Close | EndEpisode


def output(
    request_id: str,
    reason: FinishReason,
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    error: str | None = None,
    routing: Routing | None = None,
) -> GenerateOutput:
    return GenerateOutput(
        request_id=request_id,
        token_ids=tokens or [],
        logprobs=logprobs or [],
        versions=versions or [],
        finish_reason=reason,
        error=error,
        routing=routing,
    )


def resolve(future: concurrent.futures.Future, value: object) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)


def fail(future: concurrent.futures.Future, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(error)


def validate(request: GenerateRequest, vocab: int, max_seq_len: int) -> str | None:
    """Why the engine cannot serve ``request`` (None: it can)."""
    ids = request.prompt_ids
    if not ids:
        return "empty prompt"
    if len(ids) >= max_seq_len:
        return (
            f"prompt of {len(ids)} tokens does not fit the context: max_seq_len is "
            f"{max_seq_len} (prompt + at least one new token)"
        )
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        return f"prompt has token ids outside [0, {vocab}): {bad[:5]}"
    return None
