"""``rollout.replay``: training again on informative groups already trained, while the
staleness policy still accepts them (docs/data.md, "Bounded replay")."""

from __future__ import annotations

from pydantic import Field

from rollstream.config.section import Section
from rollstream.staleness import StalenessPolicy


class ReplayConfig(Section):
    max_share: float = Field(0.0, ge=0, lt=1)
    """Largest share of a step's groups that may be replays (0 = off): groups trained at an
    earlier step whose rewards varied. A replay fills a batch only when too few fresh groups
    are ready, never in place of a ready one; ``floor(max_share x groups_per_step)`` groups
    at most, so a step always trains a fresh group (below 1)."""
    max_uses: int = Field(1, ge=1)
    """Times one group may be replayed (after its first training)."""


def check_replay(replay: ReplayConfig, policy: StalenessPolicy, *, mode: str,
                 groups_per_step: int) -> None:
    """Replay settings that contradict each other or the run's staleness policy."""
    if replay.max_share == 0:
        if replay.max_uses != ReplayConfig.model_fields["max_uses"].default:
            raise ValueError(
                f"rollout.replay.max_uses = {replay.max_uses} is read only with "
                "rollout.replay.max_share > 0 (it is 0: replay is off); drop it or set max_share"
            )
        return
    bound = policy.kept_bound
    if bound < 1:  # a group trained at step s holds tokens of version <= s: age >= 1 at s+1
        raise ValueError(
            f"rollout.replay.max_share = {replay.max_share} cannot apply: a replayed token is "
            f"at least 1 step old, and the staleness bound of trained tokens is {bound} "
            f"(rollout.mode = {mode}, rollout.staleness.max_token_age = "
            f"{policy.max_token_age}); use mode: async (max_staleness >= 1, max_token_age >= 1 "
            "when set) or max_share: 0"
        )
    if int(replay.max_share * groups_per_step) == 0:
        raise ValueError(
            f"rollout.replay.max_share = {replay.max_share} allows no replayed group in a step "
            f"of train.groups_per_step = {groups_per_step} groups (floor of their product is "
            f"0); use max_share >= {1 / groups_per_step:g} or max_share: 0"
        )
