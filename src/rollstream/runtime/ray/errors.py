"""The Ray errors an engine proxy tells apart (``engines.py``), imported only when asked: a
module that names them loads without Ray."""

from __future__ import annotations


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
