"""The config tree. Each component receives only its own section.

Every field has a default and a docstring (the text under it). Models are frozen and forbid
unknown keys; the loader turns validation errors into messages naming the field path, the
value and what is allowed. Derived runtime values are returned by builders, never written
back here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from rollstream.config.engine import (  # the whole tree stays importable from here
    EngineConfig,
    LocalEngineConfig,  # noqa: F401
    VllmEngineConfig,  # noqa: F401
)
from rollstream.config.model import (
    LoraConfig,  # noqa: F401
    ModelConfig,
    TinyModelConfig,  # noqa: F401
    WarmStartConfig,  # noqa: F401
    check_lora,
)
from rollstream.config.breaker import BreakerConfig
from rollstream.config.early_stop import EarlyStopConfig, check_early_stop
from rollstream.config.problems import validation_problems
from rollstream.config.reconfigure import (
    PLAIN_KEYS,
    RECONFIGURABLE,
    SOURCE_FIELDS,
    ReconfigureConfig,
)
from rollstream.config.replay import ReplayConfig, check_replay
from rollstream.config.runtime import RuntimeConfig, check_runtime
from rollstream.config.section import Section
from rollstream.config.staleness import StalenessConfig, check_staleness, refuse_replaced_keys
from rollstream.config.tasks import (  # the whole tree stays importable from here
    AgentConfig,
    ColumnsConfig,  # noqa: F401
    ProxyConfig,
    SourceConfig,  # noqa: F401
    TasksConfig,
)
from rollstream.config.train import (  # the whole tree stays importable from here
    FsdpConfig,  # noqa: F401
    ISCorrectionConfig,  # noqa: F401
    TrainConfig,
    check_routing_replay,
    check_train,
)
from rollstream.staleness import StalenessPolicy


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Rollout temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k cut (0 = off)."""
    max_new_tokens: int = Field(240, ge=1)
    """Response length cap."""


OnUpdate = Literal["interrupt", "continue", "drain"]  # rollout.on_update, WeightSync's policy


class RolloutConfig(Section):
    mode: Literal["sync", "one_step", "async"] = "async"
    """``sync``: generate a batch, train, repeat (on-policy). ``one_step``: rollout of step k+1
    overlaps training of step k. ``async``: continuous rollout bounded by
    ``staleness.max_staleness``."""
    staleness: StalenessConfig = StalenessConfig()
    """The staleness bounds (k, token age, context age) and so the rule long samples follow
    (drop, mask or admission; docs/staleness.md's table)."""
    on_update: OnUpdate = "interrupt"
    """What in-flight samples do when new weights load. Partial rollout: ``interrupt`` (abort
    at a token boundary and resume prompt + partial on the new weights) or ``continue`` (the
    request goes on in place; later tokens carry the new version; engine.local.kv_on_load
    says whether its cache is recomputed). ``drain``: in-flight samples finish on the old
    weights before the new ones load. Tokens always keep the version that sampled them."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        refuse_replaced_keys("rollout", data)
        if isinstance(data, dict) and "partial_rollout" in data:
            raise ValueError(
                "partial_rollout was replaced by on_update (allowed: interrupt, continue, "
                "drain): partial_rollout: false is on_update: drain; true is interrupt or "
                "continue")
        return data

    group_size: int = Field(8, ge=1)
    """Samples per task (the GRPO group)."""
    dispatch: Literal["engine", "fifo", "longest_first"] = "engine"
    """Where requests wait when the engines are full: ``engine`` (each request goes to the
    least-loaded engine at once and waits in its queue), or in the dispatcher, an engine
    taking at most its capacity, the next free slot on any engine going to the request that
    waited longest (``fifo``) or that has the most predicted tokens left (``longest_first``:
    lengths predicted from the source's recent lengths and the finished samples of the same
    group; ``len_pred_err`` in the metrics). docs/dispatch.md."""
    prefix_affinity: bool = False
    """Send a request to the engine that holds its prefix (the engine that holds most of an
    episode's or partial sample's next prompt, else the one its group's first sample went
    to; a group's first sample: the engine that holds most of its prompt, if any) while that
    engine has room: with ``dispatch: engine`` a free sequence and at most 4
    requests more than the least loaded, with a dispatch queue a free slot; otherwise to the
    engine dispatch picks, re-pinning the group there. Pays on engines with a prefix cache
    (the embedded engine's ``engine.local.prefix_cache_tokens``, vLLM's automatic prefix
    caching): a group's prompt is prefilled once. docs/dispatch.md."""
    concurrency: Literal["capacity", "adaptive"] = "capacity"
    """How many requests an engine holds with a dispatch queue (``dispatch`` fifo or
    longest_first): ``capacity`` (its concurrent sequences) or ``adaptive`` (a limit in
    [1, capacity], from max(4, capacity / 4), raised while each raise gains throughput and
    cut back when it does not, re-probed every few windows; ``concurrency_mean`` in the
    metrics). docs/dispatch.md."""
    concurrency_window_tokens: int = Field(4096, ge=1)
    """``adaptive``: generated tokens per engine per measurement window (one decision each;
    longer windows measure less noisily and adapt more slowly)."""
    concurrency_min_gain: float = Field(0.05, gt=0, lt=1)
    """``adaptive``: the throughput gain a raised limit must bring (and the loss a cut may
    cost) for the step to be kept, as a fraction (0.05 = 5%)."""
    breaker: BreakerConfig = BreakerConfig()
    """Quarantine of engines whose requests keep failing while they stay UP (grey failures;
    docs/dispatch.md)."""
    filter_zero_variance: bool = True
    """Mark groups whose rewards are all equal FILTERED (no learning signal)."""
    max_untrainable_streak: int = Field(256, ge=1)
    """Stop the run with a diagnostic (counts by reason, an example) when this many groups in
    a row end untrainable (filtered, failed, dropped stale): a run that cannot train must not
    spin forever."""
    min_trainable_share: float = Field(0.01, ge=0, lt=1)
    """Stop the run with a diagnostic when fewer than this share of the last
    ``trainable_share_window`` finished groups were trainable (0 = never)."""
    trainable_share_window: int = Field(1024, ge=1)
    """Finished groups over which ``min_trainable_share`` is judged."""
    replay: ReplayConfig = ReplayConfig()
    """Bounded replay of informative groups already trained (off by default; docs/data.md)."""
    early_stop: EarlyStopConfig = EarlyStopConfig()
    """Cancel the rest of a group once its first graded samples make zero reward variance
    likely (off by default; docs/data.md)."""

    @property
    def staleness_bound(self) -> int:
        """The staleness bound k the mode means: sync 0, one_step 1, async max_staleness."""
        return self.staleness.bound(self.mode)

    def staleness_policy(self) -> StalenessPolicy:
        """The policy these settings mean; a run builds it once and hands it to the rollout
        and the trainer."""
        s = self.staleness
        return StalenessPolicy.from_bounds(max_staleness=self.staleness_bound,
                                           max_token_age=s.max_token_age,
                                           max_context_age=s.max_context_age)


class RewardConfig(Section):
    name: str = "auto"
    """``auto``: each source's own reward (its ``reward``, else its kind's). Any other value
    grades every source with that reward: a registered name or an import path
    ``module:function``. An unknown name fails when the run is built, listing the known ones."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-call timeout, counted from when a worker starts the call; a reward still running
    then is killed (a sync reward with its worker process, which is replaced) and its sample
    is FAILED."""
    num_workers: int = Field(4, ge=1)
    """Worker processes for sync rewards, and the bound on reward calls running at once (async
    rewards included)."""


class EvalConfig(Section):
    every: int = Field(0, ge=0)
    """Score the held-out prompts every N steps (0 = only at the start and the end)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of evaluation."""
    samples_per_task: int = Field(4, ge=1)
    """Samples per held-out prompt (the reward is their mean)."""


class MonitorConfig(Section):
    progress: bool = True
    """Rich terminal progress."""
    dashboard: bool = False
    """Serve the live dashboard on 127.0.0.1."""
    dashboard_port: int = Field(0, ge=0, le=65535)
    """Dashboard port (0 = pick a free one)."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Expose Prometheus metrics on this port (None = off)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (under the run directory's ``tensorboard/``)."""
    trackers: tuple[Literal["wandb", "mlflow"], ...] = ()
    """External experiment trackers that also receive every recorded scalar (imported only
    when listed; a missing package is a warning)."""
    tracker_project: str = "rollstream"
    """wandb project / MLflow experiment name used by ``trackers``."""
    dashboard_poll_s: float = Field(2.0, gt=0)
    """How often the dashboard page polls for new data."""
    report: bool = True
    """Write the HTML report at the end of the run."""


_RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class RunConfig(Section):
    """A whole run's settings, validated and frozen: one section per component (every field
    in the config reference, and `rollstream config`)."""

    name: str = "run"
    """Run name; the run directory is ``{run_root}/{name}``. One path component: letters,
    digits, ``.``, ``_`` and ``-`` (at most 255), not ``.`` or ``..``, so a run writes and
    deletes only inside its own folder."""
    run_root: str = "runs"
    """Parent folder of run directories (``~`` is expanded)."""

    @field_validator("name")
    @classmethod
    def _one_component(cls, name: str) -> str:
        if not _RUN_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(
                "must be one folder name of letters, digits, '.', '_' and '-' (at most 255 "
                "characters; not '.' or '..'): the run directory is {run_root}/{name}")
        return name

    @property
    def run_dir(self) -> Path:
        """The run directory, ``{run_root}/{name}``."""
        return Path(self.run_root).expanduser() / self.name
    seed: int = 0
    """Global seed."""
    max_wall_s: float | None = Field(None, gt=0)
    """Stop training after this many seconds of this process (None = run all steps)."""
    resume: bool = False
    """Continue ``{run_root}/{name}`` from its newest durable checkpoint (the CLI's
    ``--resume``): no trained step is repeated, the data cursor, buffer and partial samples
    go on. Without a checkpoint the run starts at step 0 and the earlier ledger lines are
    moved to ``ledger.superseded.jsonl``."""
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    agent: AgentConfig = AgentConfig()
    """How agent episodes (sources with a ``harness``, and ``tally``) run: budgets, tool
    limits, the sandbox pool and where OpenAI-SDK agents run."""
    engine: EngineConfig = EngineConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    """Where engines run: in this process, or as Ray actors (docs/distributed.md)."""
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    monitor: MonitorConfig = MonitorConfig()
    reconfigure: ReconfigureConfig = ReconfigureConfig()
    """Changes of sampling, staleness and mixture settings at step boundaries, from a schedule
    or a watched file (docs/reconfigure.md)."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RunConfig:
        if self.model.path is None and self.model.tiny.num_heads % self.model.tiny.num_kv_heads:
            raise ValueError(
                "model.tiny.num_heads must be a multiple of model.tiny.num_kv_heads "
                f"(got {self.model.tiny.num_heads} and {self.model.tiny.num_kv_heads})"
            )
        if (self.model.path is None and self.model.tiny.arch != "qwen2_moe"
                and self.train.router_aux_loss_coef > 0):
            raise ValueError(
                "train.router_aux_loss_coef > 0 needs a mixture-of-experts model: "
                f"model.tiny.arch is {self.model.tiny.arch!r} (qwen2_moe has experts)")
        check_routing_replay(self.train, engine_kind=self.engine.kind,
                             lora=self.model.lora is not None,
                             experts=None if self.model.path else self.model.tiny.arch)
        tiny, vllm = self.model.tiny, self.engine.vllm
        if self.model.path is None and self.engine.kind == "vllm" and \
                vllm.max_model_len > tiny.max_position:
            raise ValueError(
                f"engine.vllm.max_model_len = {vllm.max_model_len} exceeds model.tiny."
                f"max_position = {tiny.max_position} (the model's max_position_embeddings, "
                "which vLLM refuses to exceed); lower max_model_len or raise max_position"
            )
        r = self.rollout
        _check_rollout(r)
        check_replay(r.replay, r.staleness_policy(), mode=r.mode,
                     groups_per_step=self.train.groups_per_step)
        check_early_stop(r.early_stop, group_size=r.group_size,
                         filter_zero_variance=r.filter_zero_variance)
        check_train(self.train)
        check_lora(self.model.lora, engine_kind=self.engine.kind, runtime_kind=self.runtime.kind,
                   train_backend=self.train.backend, train_compile=self.train.compile)
        check_runtime(self.runtime, engine=self.engine, train=self.train,
                      num_workers=self.reward.num_workers + self.agent.harness_workers)
        if self.reward.name != "auto":
            for i, source in enumerate(self.tasks.sources):
                if source.harness == "verifiers":
                    raise ValueError(
                        f"reward.name = {self.reward.name!r} grades every source, and "
                        f"tasks.sources.{i} is a verifiers environment's, which its rubric "
                        "grades: set reward.name: auto")
                if source.reward is not None:
                    raise ValueError(
                        f"tasks.sources.{i}.reward = {source.reward!r} contradicts reward.name = "
                        f"{self.reward.name!r} (which grades every source): set reward.name: "
                        "auto to give sources their own rewards, or drop the source's reward"
                    )
        if not any(s.task_harness == "openai" for s in self.tasks.sources):
            if self.agent.harness_workers:
                raise ValueError(
                    f"agent.harness_workers = {self.agent.harness_workers} is read only by "
                    "sources with harness: openai or verifiers (tasks.sources has none); drop "
                    "it or set 0")
            if self.agent.proxy != ProxyConfig():
                raise ValueError(
                    "agent.proxy is read only by sources with harness: openai or verifiers "
                    "(tasks.sources has none); drop it")
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature = 0 cannot train: greedy samples of a group are all the "
                "same, so no group has reward variance (use eval.temperature for greedy eval)"
            )
        check_schedule(self)
        return self


def _check_rollout(r: RolloutConfig) -> None:
    """Rollout settings that contradict each other, or that cannot train."""
    check_staleness(r.staleness, mode=r.mode)
    if r.concurrency == "adaptive" and r.dispatch == "engine":
        raise ValueError(
            "rollout.concurrency = adaptive contradicts rollout.dispatch = engine (requests go "
            "to the engines at once, so there is no limit to adapt); use dispatch: fifo or "
            "longest_first"
        )
    fields = RolloutConfig.model_fields
    tuning = [f for f in ("concurrency_window_tokens", "concurrency_min_gain")
              if getattr(r, f) != fields[f].default]
    if tuning and r.concurrency == "capacity":
        raise ValueError(
            f"rollout.{tuning[0]} = {getattr(r, tuning[0])} is read only with rollout.concurrency = adaptive "
            "(it is capacity); drop it or set concurrency: adaptive"
        )
    if r.group_size == 1 and r.filter_zero_variance:
        raise ValueError(
            "rollout.group_size = 1 with rollout.filter_zero_variance = true cannot train: a "
            "group of one has no reward variance, so every group is filtered"
        )


def with_changes(cfg: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """``cfg`` with ``changes`` applied (its ``reconfigure`` section kept); ValueError naming
    the key when one is not reconfigurable, and the schema's problems when the result is not
    a valid config."""
    names = [s.source_name for s in cfg.tasks.sources]
    data = cfg.model_dump(mode="json", exclude_unset=True, exclude={"reconfigure"})
    tasks = data.setdefault("tasks", {})
    # every source whole, so that its fields can be set by index (unset fields stay unset)
    tasks["sources"] = [s.model_dump(mode="json", exclude_unset=True) for s in cfg.tasks.sources]
    for key, value in changes.items():
        parts = str(key).split(".")
        if key in PLAIN_KEYS:
            node = data
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
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
            f"rollout.staleness.max_staleness {k_old} -> {k_new}: a run does not switch "
            "between on-policy (bound 0) and off-policy (bound >= 1) training: the loss "
            "train.loss: auto means is chosen for one of them at the start")
    agents = [s.source_name for s in new.tasks.sources if s.episodic]
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
