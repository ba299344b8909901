"""Reconfiguration at a step boundary: one owner applies every mid-run change of sampling,
staleness and mixture settings (docs/reconfigure.md).

The controller calls :meth:`Reconfigure.at_boundary` right after it publishes weight version
``v`` (before it awaits anything, so before any group is admitted under ``v``): the change
scheduled at ``at_step == v`` applies, then the watched file's content if it changed. The new
config is the old one with the changes, validated by the whole schema
(``config.schema.with_changes``); each component is handed its new values through its
own small method, and nobody re-reads the config:

    Dispatcher.set_params     sampling.temperature, sampling.max_new_tokens
    TaskMix.reweight          tasks.sources.<name>.weight / max_in_flight / max_in_flight_per_task
    Rollout.set_policy        rollout.staleness.max_staleness (admission capacity, buffer,
                              live groups)
    Trainer.follow_rollout    the staleness policy, response budget and default temperature

Each change is recorded as a ``reconfig`` metrics line (key -> new value, ``<key>.old`` -> the
old one) and a line of ``reconfig.jsonl``; a watched file that cannot apply is refused there
(``rejected``) and the run goes on. :meth:`state` goes into durable checkpoints: a resumed run
is built from the config with every applied change folded in (:func:`with_applied`), so it
continues exactly as the run that never stopped would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rollstream.config import ConfigError, RunConfig
from rollstream.config.loader import read_yaml_mapping
from rollstream.config.schema import with_changes
from rollstream.staleness import StalenessPolicy

if TYPE_CHECKING:
    from rollstream.config.schema import SourceConfig
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.rollout import Rollout
    from rollstream.runtime.controller import MetricsLike

log = logging.getLogger(__name__)


@runtime_checkable
class Reweighable(Protocol):
    """A task stream whose weights and caps can change (the data layer's ``TaskMix``)."""

    def reweight(self, sources: tuple[SourceConfig, ...]) -> None: ...


@runtime_checkable
class FollowsRollout(Protocol):
    """A trainer that is told the rollout's reconfigured settings."""

    def follow_rollout(self, *, staleness: StalenessPolicy, max_response_tokens: int,
                       temperature: float) -> None: ...


@dataclass(slots=True, kw_only=True, frozen=True)
class Change:
    key: str
    old: Any
    new: Any


def value_at(cfg: RunConfig, key: str) -> Any:
    """The value of a reconfigurable key in ``cfg``."""
    parts = key.split(".")
    if parts[:2] == ["tasks", "sources"]:
        source = next(s for s in cfg.tasks.sources if s.source_name == parts[2])
        return getattr(source, parts[3])
    node: Any = cfg
    for part in parts:
        node = getattr(node, part)
    return node


def with_applied(cfg: RunConfig, applied: list[dict[str, Any]]) -> RunConfig:
    """``cfg`` with the changes of :meth:`Reconfigure.state`'s ``applied`` folded in, in order
    (the config a resumed run continues with)."""
    for entry in applied:
        cfg = with_changes(cfg, entry["set"])
    return cfg


class Reconfigure:
    def __init__(self, cfg: RunConfig, *, dispatcher: Dispatcher, rollout: Rollout,
                 tasks: object, trainer: object, metrics: MetricsLike,
                 log_path: Path | None = None) -> None:
        self.cfg = cfg  # the config in force
        self.dispatcher, self.rollout, self.metrics = dispatcher, rollout, metrics
        self.tasks = tasks if isinstance(tasks, Reweighable) else None
        self.trainer = trainer if isinstance(trainer, FollowsRollout) else None
        self.log_path = log_path
        self.watch = Path(cfg.reconfigure.watch) if cfg.reconfigure.watch else None
        self.applied: list[dict[str, Any]] = []  # {"step", "source", "set"} in order
        self._watch_digest: str | None = None
        scheduled_sources = any(k.startswith("tasks.") for c in cfg.reconfigure.schedule
                                for k in c.set)
        if scheduled_sources and self.tasks is None:
            raise ValueError("reconfigure.schedule changes task sources, but this run's task "
                             "stream cannot be reweighted")

    async def at_boundary(self, version: int) -> None:
        """Apply what is due when weight version ``version`` is published (module docstring)."""
        due = [("schedule", c.set) for c in self.cfg.reconfigure.schedule
               if c.at_step == version]
        watched = self._read_watch(version)
        if watched is not None:
            due.append(("watch", watched))
        old = new = self.cfg
        for source, changes in due:
            try:
                candidate = with_changes(new, changes)
            except ValueError as e:  # a schedule was checked at load: only a watched file
                self._reject(version, source, changes, str(e))
                continue
            diffs = [Change(key=k, old=value_at(new, k), new=value_at(candidate, k))
                     for k in changes]
            diffs = [c for c in diffs if c.old != c.new]
            new = candidate
            if diffs:
                self._record(version, source, diffs)
        if new is not old:
            self.cfg = new
            await self._push(old, new, version)

    async def _push(self, old: RunConfig, new: RunConfig, version: int) -> None:
        """Hand each component its new values; the synchronous part runs before anything
        awaits, so no group is admitted between two components' changes."""
        sampling = {f: getattr(new.sampling, f) for f in ("temperature", "max_new_tokens")
                    if getattr(new.sampling, f) != getattr(old.sampling, f)}
        if sampling:
            self.dispatcher.set_params(replace(self.dispatcher.params, **sampling))
        if self.tasks is not None and new.tasks.sources != old.tasks.sources:
            self.tasks.reweight(new.tasks.sources)
        policy = new.rollout.staleness_policy()
        if self.trainer is not None:
            self.trainer.follow_rollout(staleness=policy,
                                        max_response_tokens=new.sampling.max_new_tokens,
                                        temperature=new.sampling.temperature)
        if policy != old.rollout.staleness_policy():
            await self.rollout.set_policy(policy, version)

    def _read_watch(self, version: int) -> dict[str, Any] | None:
        """The watched file's changes when its content is new since the last look."""
        if self.watch is None or not self.watch.is_file():
            return None
        raw = self.watch.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self._watch_digest:
            return None
        self._watch_digest = digest
        try:
            return read_yaml_mapping(self.watch, "reconfigure.watch")
        except ConfigError as e:
            self._reject(version, "watch", {}, str(e))
            return None

    def _record(self, version: int, source: str, diffs: list[Change]) -> None:
        self.applied.append({"step": version, "source": source,
                             "set": {c.key: c.new for c in diffs}})
        values: dict[str, Any] = {}
        for c in diffs:
            values[c.key], values[f"{c.key}.old"] = c.new, c.old
        self.metrics.record("reconfig", version, values)
        shown = ", ".join(f"{c.key} {c.old} -> {c.new}" for c in diffs)
        log.info(f"reconfigure at step {version} ({source}): {shown}")
        self._log({"step": version, "source": source,
                   "changes": [{"key": c.key, "old": c.old, "new": c.new} for c in diffs]})

    def _reject(self, version: int, source: str, changes: dict[str, Any], reason: str) -> None:
        log.warning(f"reconfigure at step {version} ({source}) refused: {reason}")
        self.metrics.record("reconfig", version, {"rejected": 1})
        self._log({"step": version, "source": source, "rejected": reason, "set": changes})

    def _log(self, line: dict[str, Any]) -> None:
        if self.log_path is not None:
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(line, default=str) + "\n")

    # ---- durable state -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The changes applied so far and the watched file's last content (JSON)."""
        return {"applied": [dict(a) for a in self.applied], "watch_digest": self._watch_digest}

    def restore(self, state: dict[str, Any], *, version: int) -> None:
        """Continue from :meth:`state` at weight version ``version`` (the run was built with
        :func:`with_applied`); the log keeps its lines up to that step: what the lost process
        did at later boundaries is done again, as its steps are."""
        self.applied = [dict(a) for a in state.get("applied", [])]
        self._watch_digest = state.get("watch_digest")
        if self.log_path is not None and self.log_path.exists():
            lines = [ln for ln in self.log_path.read_text().splitlines(keepends=True)
                     if ln.endswith("\n") and json.loads(ln)["step"] <= version]
            self.log_path.write_text("".join(lines))
