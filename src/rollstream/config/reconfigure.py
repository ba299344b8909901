"""The config of reconfiguration at a step boundary (docs/reconfigure.md): which settings may
change while a run goes on, and the one rule that turns a config and a set of changes into
the config in force after them (:func:`with_changes`).

A change is checked by building the would-be config and validating it with the whole schema,
so a change that contradicts another setting (a staleness bound with ``mode: sync``, a
``max_token_age`` above the new bound) is the same error it would be in the file. The
``runtime.reconfigure`` module applies the changes; nothing here touches a component.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from rollstream.config.section import Section

if TYPE_CHECKING:
    from rollstream.config.schema import RunConfig

PLAIN_KEYS = ("sampling.temperature", "sampling.max_new_tokens", "rollout.max_staleness")
SOURCE_FIELDS = ("weight", "max_in_flight", "max_in_flight_per_task")
RECONFIGURABLE = (*PLAIN_KEYS, *(f"tasks.sources.<name>.{f}" for f in SOURCE_FIELDS))


class ScheduledChange(Section):
    at_step: int = Field(ge=1)
    """Apply when weight version ``at_step`` is published (after trainer step ``at_step - 1``):
    groups admitted from then on, the batches of steps ``at_step`` on in ``sync`` mode, use the
    new values; the staleness bound judges the batches of steps ``at_step`` on."""
    set: dict[str, Any] = Field(min_length=1)
    """Dotted key -> new value. Keys: ``sampling.temperature``, ``sampling.max_new_tokens``,
    ``rollout.max_staleness`` (``mode: async``), and ``tasks.sources.<name>.weight``,
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


def with_changes(cfg: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """``cfg`` with ``changes`` applied (its ``reconfigure`` section kept); ValueError naming
    the key when one is not reconfigurable, and the schema's problems when the result is not
    a valid config."""
    from pydantic import ValidationError

    from rollstream.config.loader import validation_problems
    from rollstream.config.schema import RunConfig

    names = [s.source_name for s in cfg.tasks.sources]
    data = cfg.model_dump(mode="json", exclude_unset=True, exclude={"reconfigure"})
    tasks = data.setdefault("tasks", {})
    # every source whole, so that its fields can be set by index (unset fields stay unset)
    tasks["sources"] = [s.model_dump(mode="json", exclude_unset=True) for s in cfg.tasks.sources]
    for key, value in changes.items():
        parts = str(key).split(".")
        if key in PLAIN_KEYS:
            data.setdefault(parts[0], {})[parts[1]] = value
        elif (len(parts) == 4 and parts[:2] == ["tasks", "sources"] and parts[2] in names
              and parts[3] in SOURCE_FIELDS):
            tasks["sources"][names.index(parts[2])][parts[3]] = value
        elif len(parts) == 4 and parts[:2] == ["tasks", "sources"] and parts[3] in SOURCE_FIELDS:
            raise ValueError(f"{key}: no task source is named {parts[2]!r} (sources: "
                             f"{', '.join(names)})")
        else:
            raise ValueError(f"{key} cannot change during a run; reconfigurable keys: "
                             f"{', '.join(RECONFIGURABLE)}")
    try:
        new = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError("; ".join(validation_problems(e, RunConfig))) from None
    _check_run_can_follow(cfg, new)
    return new.model_copy(update={"reconfigure": cfg.reconfigure})


def _check_run_can_follow(old: RunConfig, new: RunConfig) -> None:
    """Changes the schema allows that a running run cannot make."""
    k_old, k_new = old.rollout.staleness_bound, new.rollout.staleness_bound
    if (k_old == 0) != (k_new == 0):
        raise ValueError(
            f"rollout.max_staleness {k_old} -> {k_new}: a run does not switch between on-policy "
            "(bound 0) and off-policy (bound >= 1) training: the loss train.loss: auto means is "
            "chosen for one of them at the start")
    agents = [s.source_name for s in new.tasks.sources if s.kind == "tally"]
    if agents and old.sampling.max_new_tokens != new.sampling.max_new_tokens:
        raise ValueError(
            f"sampling.max_new_tokens cannot change during a run with agent sources "
            f"({', '.join(agents)}): an episode's token budget is fixed when its harness is "
            "built")


def check_schedule(cfg: RunConfig) -> None:
    """Every scheduled change applies before the run ends and leaves a valid config."""
    current = cfg
    for i, change in enumerate(cfg.reconfigure.schedule):
        where = f"reconfigure.schedule.{i} (at_step {change.at_step})"
        if change.at_step >= cfg.train.steps:
            raise ValueError(f"{where}: at_step must be below train.steps = {cfg.train.steps} "
                             "(a change at or after the last step is never applied)")
        try:
            current = with_changes(current, change.set)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
