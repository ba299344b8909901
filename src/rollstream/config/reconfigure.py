"""The config of reconfiguration at a step boundary (docs/reconfigure.md): which settings may
change while a run goes on, and the one rule that turns a config and a set of changes into
the config in force after them (``schema.with_changes``, beside the tree it validates).

A change is checked by building the would-be config and validating it with the whole schema,
so a change that contradicts another setting (a staleness bound with ``mode: sync``, a
``max_token_age`` above the new bound) is the same error it would be in the file. The
``runtime.reconfigure`` module applies the changes; nothing here touches a component.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rollstream.config.section import Section

PLAIN_KEYS = ("sampling.temperature", "sampling.max_new_tokens",
              "rollout.staleness.max_staleness")
SOURCE_FIELDS = ("weight", "max_in_flight", "max_in_flight_per_task")
RECONFIGURABLE = (*PLAIN_KEYS, *(f"tasks.sources.<name>.{f}" for f in SOURCE_FIELDS))


class ScheduledChange(Section):
    at_step: int = Field(ge=1)
    """Apply when weight version ``at_step`` is published (after trainer step ``at_step - 1``):
    groups admitted from then on, the batches of steps ``at_step`` on in ``sync`` mode, use the
    new values; the staleness bound judges the batches of steps ``at_step`` on."""
    set: dict[str, Any] = Field(min_length=1)
    """Dotted key -> new value. Keys: ``sampling.temperature``, ``sampling.max_new_tokens``,
    ``rollout.staleness.max_staleness`` (``mode: async``), and ``tasks.sources.<name>.weight``,
    ``.max_in_flight``, ``.max_in_flight_per_task`` (``<name>``: the source's name)."""


class ReconfigureConfig(Section):
    """Settings that change during the run, at step boundaries (docs/reconfigure.md)."""

    schedule: tuple[ScheduledChange, ...] = ()
    """Changes at given steps, ``at_step`` increasing, each below ``train.steps``. Checked at
    load: each key must be reconfigurable and the config after each change valid."""
    watch: str | None = None
    """A YAML file of ``key: value`` lines (the keys of ``schedule``'s ``set``) read at every
    step boundary; when its content changed it is applied there (after that boundary's
    scheduled change). A missing file is no change; a bad one is refused with its reason
    in the log, ``reconfig.jsonl`` and the metrics, and the run goes on."""

    @model_validator(mode="after")
    def _steps_increase(self) -> ReconfigureConfig:
        steps = [c.at_step for c in self.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"schedule: at_step values must increase, one change "
                             f"per step (got {steps}); merge changes of one step into one set")
        return self
