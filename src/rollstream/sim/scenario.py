"""A simulation scenario: cluster, workload, cost profile and the modes to compare (YAML).

Frozen pydantic models that forbid unknown keys, a docstring under every field (as
``rollstream.config.schema``). :func:`load_scenario` reports a bad field by its path.
Each mode becomes a real :class:`rollstream.config.RunConfig` (:func:`run_config`), so the
rollout settings are validated by the same rules as a training run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.config import RolloutConfig, RunConfig, TrainConfig
from rollstream.config.early_stop import EarlyStopConfig
from rollstream.config.loader import ConfigError, read_yaml_mapping, validate_model
from rollstream.config.problems import validation_problems
from rollstream.config.schema import OnUpdate
from rollstream.config.staleness import StalenessConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ToolLatencyConfig(_Section):
    """A tool call's latency: heavy-tailed, set by its median and 99th percentile."""

    distribution: Literal["lognormal", "pareto"] = "lognormal"
    """``lognormal``: sigma = ln(p99 / median) / 2.326; ``pareto``: x_m and alpha such that
    the median and p99 are these (alpha = ln 50 / ln(p99 / median)): a heavier tail beyond
    the p99 than the log-normal's."""
    median_s: float = Field(0.05, gt=0)
    """Median seconds of a call (``bench agentic``'s assumed tool: 50 ms)."""
    p99_s: float = Field(2.0, gt=0)
    """99th-percentile seconds of a call (``bench agentic``: 2 s); above median_s."""

    @model_validator(mode="after")
    def _check(self) -> ToolLatencyConfig:
        if not self.p99_s > self.median_s:
            raise ValueError(f"p99_s ({self.p99_s:g}) must be above median_s "
                             f"({self.median_s:g}): a heavy tail")
        return self


class AgentWorkloadConfig(_Section):
    """Multi-turn episodes: model turns, each but the last followed by a tool call. Episodes
    run through the real agent harness and loop (``sim/agentic.py``)."""

    turns_median: float = Field(3.0, ge=1)
    """Median model turns per episode: LogNormal(ln turns_median, turns_sigma), rounded,
    within 1..max_turns (``bench agentic``: median 3, at most 12)."""
    turns_sigma: float = Field(0.8, ge=0)
    """Log-scale spread of the number of model turns."""
    max_turns: int = Field(12, ge=1)
    """At most this many model turns (agent.max_turns)."""
    max_turn_tokens: int = Field(4096, ge=1)
    """Cap on one model turn (agent.max_turn_tokens): a turn cut by it is the episode's
    (wrong) answer. workload.mean_response_tokens is the mean model turn under this cap."""
    tool_output_tokens: int = Field(256, ge=0)
    """Tokens of each tool result (appended to the episode as environment tokens)."""
    tool_latency: ToolLatencyConfig = ToolLatencyConfig()
    """Seconds from a tool call to its result, on the virtual clock."""
    tool_timeout_s: float = Field(600.0, gt=0)
    """agent.tool_timeout_s: a call still running then ends with an error message."""

    @model_validator(mode="after")
    def _check(self) -> AgentWorkloadConfig:
        if self.turns_median > self.max_turns:
            raise ValueError(f"turns_median ({self.turns_median:g}) must not exceed max_turns "
                             f"({self.max_turns}): most episodes would be cut to max_turns")
        return self


class WorkloadConfig(_Section):
    prompt_tokens: int = Field(512, ge=1)
    """Prompt length of every task, real tokens."""
    mean_response_tokens: float = Field(22386, gt=0)
    """Mean response length after the cap (Seer's Moonlight: 22,386)."""
    max_response_tokens: int = Field(65536, ge=1)
    """The sampling cap (max_new_tokens); a sample that reaches it is truncated and wrong."""
    sigma_prompt: float = Field(0.8, gt=0)
    """Log-scale spread of prompt difficulty (the median length of a prompt's samples)."""
    sigma_within: float = Field(0.6, ge=0)
    """Log-scale spread of lengths within a group; below sigma_prompt, lengths of a group are
    correlated. sqrt(sigma_prompt^2 + sigma_within^2) = 1 gives p99 about 10x the median."""
    pass_rate_mean: float = Field(0.4, gt=0, lt=1)
    """Mean of the per-prompt pass rate p ~ Beta (MiMo: 41%)."""
    pass_rate_concentration: float = Field(2.0, gt=0)
    """alpha + beta of that Beta: small values make many prompts all-right or all-wrong
    (zero-variance groups the rollout filters; 2.0 gives about 25% of groups of 8)."""
    length_drift_per_step: float = Field(0.0, gt=-1)
    """Growth of response lengths per trainer step: the policy at weight version v writes
    (1 + this) ** v times as long as at version 0 (the log-normal median moves; 0: no drift,
    negative: lengths shrink). Published runs grow (WORKLOADS.md; docs/simulator.md, "The
    workload")."""
    agent: AgentWorkloadConfig | None = None
    """Multi-turn episodes with tool calls instead of single responses (null: single-turn)."""

    @model_validator(mode="after")
    def _check(self) -> WorkloadConfig:
        cap, name = ((self.agent.max_turn_tokens, "agent.max_turn_tokens") if self.agent
                     else (self.max_response_tokens, "max_response_tokens"))
        if self.mean_response_tokens >= cap:
            raise ValueError(f"mean_response_tokens ({self.mean_response_tokens:g}) must be "
                             f"below {name} ({cap})")
        if self.agent is not None and self.agent.max_turn_tokens > self.max_response_tokens:
            raise ValueError(f"agent.max_turn_tokens ({self.agent.max_turn_tokens}) must not "
                             f"exceed max_response_tokens ({self.max_response_tokens}), the "
                             "episode's budget")
        return self


class ModeConfig(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Row label in the comparison table."""
    mode: Literal["sync", "one_step", "async"] = "async"
    """rollout.mode of the run."""
    staleness: StalenessConfig | None = None
    """rollout.staleness: the bounds k (``max_staleness``, async only), ``max_token_age``
    (set: the ``mask`` rule, older tokens left out of the loss and of the trained tokens) and
    ``max_context_age`` (above k: the ``admission`` rule, samples trained whole up to this
    age); null: the library defaults."""
    on_update: OnUpdate | None = None
    """rollout.on_update: ``interrupt`` or ``continue`` (partial rollout) or ``drain`` on a
    weight update (null: the library default, interrupt)."""
    dispatch: Literal["engine", "fifo", "longest_first"] | None = None
    """rollout.dispatch: where requests wait when the engines are full, and in what order
    (null: the library default, ``engine``; docs/dispatch.md)."""
    early_stop: EarlyStopConfig | None = None
    """rollout.early_stop: cancel the rest of a group once its first graded samples make
    zero variance likely (null: off; docs/data.md)."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        if isinstance(data, dict):
            for key in ("max_staleness", "max_token_age", "max_context_age"):
                if key in data:
                    raise ValueError(f"{key} was replaced by staleness.{key} (a mode's "
                                     "staleness bounds live in one block, as in a run's "
                                     "rollout.staleness); move the setting there")
        return data


_K2 = StalenessConfig(max_staleness=2)


class Scenario(_Section):
    name: str = Field("scenario", min_length=1)
    """Shown in the table and the JSON."""
    seed: int = 0
    """Seeds the workload and the run (sample outcomes follow from it)."""
    profile: str = "gpu_h100_7b"
    """Cost profile: a built-in name (src/rollstream/sim/profiles) or a YAML path."""
    engines: int = Field(8, ge=1)
    """Number of simulated engines."""
    token_block: int = Field(1, ge=1)
    """Real tokens per simulated token (1: exact; at cluster scale e.g. 256, so the real
    components' per-token lists stay small; interrupts then lose up to a block)."""
    steps: int = Field(10, ge=1)
    """Trainer steps per mode."""
    groups_per_step: int = Field(16, ge=1)
    """Groups per trainer step (train.groups_per_step)."""
    group_size: int = Field(8, ge=1)
    """Samples per group (rollout.group_size)."""
    filter_zero_variance: bool = True
    """rollout.filter_zero_variance: groups whose rewards are all equal are filtered and
    replaced (the dynamic-sampling waste)."""
    trainer_devices: int = Field(8, ge=1)
    """Devices of the trainer (its step time divides by this)."""
    max_sim_s: float | None = Field(None, gt=0)
    """Stop a mode after this many simulated seconds (max_wall_s of the run; null: none)."""
    workload: WorkloadConfig = WorkloadConfig()
    """The task generator."""
    replay: str | None = None
    """A run directory whose recorded samples replace the generator: its ledger's training
    groups, in admission order, with their prompt and response lengths and answers, up to its
    ``sampling.max_new_tokens``; an agent run's episodes with their recorded turns, tool
    answers and tool waits, under its ``agent`` budgets (sim/replay.py; null: the generator,
    ``workload``)."""
    modes: tuple[ModeConfig, ...] = (
        ModeConfig(name="sync", mode="sync"),
        ModeConfig(name="one_step", mode="one_step", on_update="drain"),
        ModeConfig(name="async_k2_partial", mode="async", staleness=_K2),
        ModeConfig(name="async_k2_drain", mode="async", staleness=_K2, on_update="drain"),
    )
    """The modes to compare, in table order (the first is the baseline of the ratios)."""

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if not self.modes:
            raise ValueError("modes: at least one mode is needed")
        if self.replay is not None and "workload" in self.model_fields_set:
            raise ValueError("replay and workload are exclusive: a replay's samples are the "
                             "recorded run's; leave workload out or set replay: null")
        names = [m.name for m in self.modes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"modes: names must be unique, repeated: {dup}")
        for i, m in enumerate(self.modes):
            run_config(self, m, where=f"modes.{i} ({m.name})")
        return self


def run_config(sc: Scenario, mode: ModeConfig, *, where: str = "mode") -> RunConfig:
    """The RunConfig of one mode: the real config rules check the combination."""
    rollout = {"mode": mode.mode, "group_size": sc.group_size,
               "filter_zero_variance": sc.filter_zero_variance,
               # a long simulated run must not stop for a streak of filtered groups
               "max_untrainable_streak": 1 << 30, "min_trainable_share": 0.0}
    if mode.staleness is not None:
        rollout["staleness"] = mode.staleness
    if mode.on_update is not None:
        rollout["on_update"] = mode.on_update
    if mode.dispatch is not None:
        rollout["dispatch"] = mode.dispatch
    if mode.early_stop is not None:
        rollout["early_stop"] = mode.early_stop
    try:
        return RunConfig(name=sc.name, seed=sc.seed, max_wall_s=sc.max_sim_s,
                         rollout=RolloutConfig(**rollout),
                         train=TrainConfig(steps=sc.steps, groups_per_step=sc.groups_per_step))
    except ValidationError as e:
        raise ConfigError(f"{where}: " + "; ".join(validation_problems(e, RunConfig))) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML; a bad field is a ValueError naming its path."""
    return validate_model(Scenario, read_yaml_mapping(path, "scenario"), f"scenario {path}")
