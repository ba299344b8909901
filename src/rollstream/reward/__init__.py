"""Reward functions and the async grader pool (DESIGN.md: a reward failure marks the sample,
never stalls the loop)."""

from rollstream.reward import builtins as _builtins  # noqa: F401  (registers the built-ins)
from rollstream.reward.pool import GradeResult, GraderPool
from rollstream.reward.registry import (
    RewardFn,
    get_reward,
    known_rewards,
    register_reward,
    resolver_for,
)

__all__ = [
    "GradeResult",
    "GraderPool",
    "RewardFn",
    "get_reward",
    "known_rewards",
    "register_reward",
    "resolver_for",
]
