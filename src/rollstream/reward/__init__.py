"""Reward functions and the async grader pool (DESIGN.md: a reward failure marks the sample,
never stalls the loop)."""

from rollstream.reward import builtins as _builtins  # noqa: F401  (registers the built-ins)
from rollstream.reward import code as _code  # noqa: F401  (registers ``code``)
from rollstream.reward import reasoning_gym as _rg  # noqa: F401  (registers ``reasoning_gym``)
from rollstream.reward.pool import GradeResult, GraderPool
from rollstream.reward.registry import (
    Response,
    Reward,
    RewardFn,
    build_resolver,
    decode_response,
    get_reward,
    group_reward,
    known_rewards,
    register_reward,
    reward_setup,
)

__all__ = [
    "GradeResult",
    "GraderPool",
    "Response",
    "Reward",
    "RewardFn",
    "build_resolver",
    "decode_response",
    "get_reward",
    "group_reward",
    "known_rewards",
    "register_reward",
    "reward_setup",
]
