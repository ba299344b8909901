"""``rollout.early_stop``: cancel the rest of a group once its first graded samples make a
zero-variance outcome likely (docs/data.md, "Stopping likely zero-variance groups early")."""

from __future__ import annotations

from pydantic import Field

from rollstream.config.section import Section


class EarlyStopConfig(Section):
    after: int = Field(0, ge=0)
    """Graded samples of a group that must all agree (every reward 1, or every reward 0)
    before its other samples may be cancelled (0 = off; else 2 to group_size - 1). The
    group's samples run at once as always; when its first ``after`` graded ones agree and
    the others would agree too with probability above ``stop_above``, the others are
    interrupted and never resubmitted, and the group is FILTERED as zero variance. Sources
    graded by a group reward are never stopped so (their reward needs the whole group)."""
    stop_above: float = Field(0.9, gt=0, lt=1)
    """The chance that a group's ungraded samples would agree with its graded ones, above
    which they are cancelled; measured per source on witness groups, for each number of
    agreeing graded samples and each outcome (all passed, all failed)."""
    min_groups: int = Field(16, ge=1)
    """Witnesses measured for a case (source, outcome, number graded) before a group in
    that case may be stopped (until then such groups run on)."""
    witness_share: float = Field(0.1, gt=0, lt=1)
    """Share of groups never stopped, so that the chance above is measured in the order
    samples really finish (chosen by a hash of the group id)."""


def check_early_stop(es: EarlyStopConfig, *, group_size: int, filter_zero_variance: bool) -> None:
    """Settings that contradict each other or the rollout's."""
    if es.after == 0:
        changed = [k for k in ("stop_above", "min_groups", "witness_share")
                   if getattr(es, k) != EarlyStopConfig.model_fields[k].default]
        if changed:
            raise ValueError(f"rollout.early_stop.{changed[0]} is read only with "
                             "rollout.early_stop.after > 0 (it is 0: off); drop it or set after")
        return
    if not 2 <= es.after < group_size:
        raise ValueError(f"rollout.early_stop.after = {es.after} must be 0 (off) or from 2 to "
                         f"rollout.group_size - 1 = {group_size - 1}")
    if not filter_zero_variance:
        raise ValueError("rollout.early_stop.after > 0 cancels groups likely to have zero "
                         "reward variance, which rollout.filter_zero_variance: false trains: "
                         "set one of them back")
