"""The Ray errors an engine proxy tells apart (``engines.py``), imported only when asked: a
module that names them loads without Ray; and what a call that met one returns."""

from __future__ import annotations

from rollstream.engine.protocol import FinishReason, GenerateOutput


def aborted(request_id: str, error: str, partial: GenerateOutput | None = None) -> GenerateOutput:
    """ABORT with ``error`` and ``partial``'s tokens (none when None)."""
    return GenerateOutput(request_id=request_id, error=error, finish_reason=FinishReason.ABORT,
                          token_ids=list(partial.token_ids) if partial else [],
                          logprobs=list(partial.logprobs) if partial else [],
                          versions=list(partial.versions) if partial else [])


def actor_errors() -> tuple[type[BaseException], ...]:
    """The errors of a call whose actor died or is unreachable (ActorDiedError and
    ActorUnavailableError are RayActorErrors)."""
    from ray.exceptions import RayActorError

    return (RayActorError,)


def task_errors() -> tuple[type[BaseException], ...]:
    """The errors of a call that raised inside a live actor."""
    from ray.exceptions import RayTaskError

    return (RayTaskError,)


def lost_errors() -> tuple[type[BaseException], ...]:
    """The errors of fetching an object whose owner (the actor that sent it) died."""
    from ray.exceptions import ObjectLostError

    return (ObjectLostError,)
