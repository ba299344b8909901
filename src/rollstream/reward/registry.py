"""Reward functions by name.

A reward is a plain typed callable ``(task, response_text) -> float``, sync or ``async``.
Register one with ``@register_reward("name")`` or pass the object itself wherever a reward is
expected; :func:`get_reward` accepts both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, Union

from rollstream.trajectory import Task

SyncRewardFn = Callable[[Task, str], float]
AsyncRewardFn = Callable[[Task, str], Awaitable[float]]
RewardFn = Union[SyncRewardFn, AsyncRewardFn]

F = TypeVar("F", bound=Callable[..., object])

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[F], F]:
    """Decorator registering a reward function under ``name`` (names are unique)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {fn!r}")
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = fn  # type: ignore[assignment]
        return fn

    return decorate


def get_reward(spec: str | RewardFn) -> RewardFn:
    """The reward registered as ``spec``, or ``spec`` itself when it is a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a reward is a registered name or a callable, got {spec!r}")
    try:
        return _REGISTRY[spec]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown reward {spec!r}; known rewards: {known}") from None


def known_rewards() -> list[str]:
    return sorted(_REGISTRY)


def resolver_for(name: str, auto: Callable[[Task], RewardFn]) -> Callable[[Task], RewardFn]:
    """The pool's resolver for ``RewardConfig.name``: ``auto`` (each source's own verifier,
    e.g. ``TaskSource.score``) or one registered reward for every task. Unknown names fail
    here, at build time."""
    if name == "auto":
        return auto
    fn = get_reward(name)
    return lambda task: fn
