"""``rollout.staleness``: the bounds on how old a trained token may be, and so the rule a long
sample that spans several weight versions follows (docs/staleness.md). The policy these
settings mean is :class:`rollstream.staleness.StalenessPolicy`, built once per run by
:meth:`RolloutConfig.staleness_policy`; this module only validates the numbers.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rollstream.config.section import Section

MODE_BOUND = {"sync": 0, "one_step": 1}  # rollout.mode -> the bound k it means; async: set


class StalenessConfig(Section):
    max_staleness: int = Field(2, ge=0)
    """The staleness bound k, read with ``rollout.mode: async`` (``sync`` means 0 and
    ``one_step`` 1: setting another value with them is an error). Sizes admission (a group
    starts only while admitted <= (served version + k + 1) x groups_per_step) and, unless
    max_context_age or max_token_age says otherwise, is the largest (trainer step - policy
    version) of a trained token (older: the group is dropped stale; the ``drop`` rule)."""
    max_token_age: int | None = Field(None, ge=0)
    """Mask out of the loss the tokens older than this (trainer step - policy version; <= k;
    null = off). Staleness then counts only the kept tokens: a sample resumed across many
    updates (partial rollout) trains on its recent tokens instead of being dropped stale
    (the ``mask`` rule)."""
    max_context_age: int | None = Field(None, ge=0)
    """Largest (trainer step - policy version) of *any* token a trained sample has seen,
    masked or not (>= k; null = 2k with max_token_age, else k). Above k without
    max_token_age: k bounds admission only and long samples are trained whole up to this age
    (the ``admission`` rule, AReaL's semantics)."""

    def bound(self, mode: str) -> int:
        """The staleness bound k ``rollout.mode`` means: sync 0, one_step 1, async the set one."""
        return MODE_BOUND.get(mode, self.max_staleness)


# the keys this block replaced: old dotted path -> new one
REPLACED_KEYS = {
    "rollout.max_staleness": "rollout.staleness.max_staleness",
    "rollout.max_context_age": "rollout.staleness.max_context_age",
    "train.max_token_age": "rollout.staleness.max_token_age",
}


def refuse_replaced_keys(section: str, data: Any) -> Any:
    """A ``before`` validator's body: a section's data that still sets a replaced key is an
    error naming the key that replaced it."""
    if isinstance(data, dict):
        for old, new in REPLACED_KEYS.items():
            where, _, key = old.partition(".")
            if where == section and key in data:
                raise ValueError(f"{key} was replaced by {new} (the staleness bounds live in "
                                 "one block, rollout.staleness); move the setting there")
    return data


def check_staleness(s: StalenessConfig, *, mode: str) -> None:
    """Bounds that contradict ``rollout.mode`` or each other."""
    if mode in MODE_BOUND and "max_staleness" in s.model_fields_set \
            and s.max_staleness != MODE_BOUND[mode]:
        raise ValueError(
            f"rollout.staleness.max_staleness = {s.max_staleness} contradicts rollout.mode = "
            f"{mode} (which means max_staleness {MODE_BOUND[mode]}); use mode: async to choose "
            "the bound")
    k, m = s.bound(mode), s.max_token_age
    if m is not None and m > k:
        raise ValueError(
            f"rollout.staleness.max_token_age = {m} exceeds the staleness bound {k} "
            f"(rollout.mode = {mode}, rollout.staleness.max_staleness = {s.max_staleness}): "
            "the loss would keep tokens older than the bound; use max_token_age <= "
            "max_staleness")
    if s.max_context_age is not None and s.max_context_age < k:
        raise ValueError(
            f"rollout.staleness.max_context_age = {s.max_context_age} is below the staleness "
            f"bound {k} (rollout.staleness.max_staleness / rollout.mode); use max_context_age "
            f">= {k}")
