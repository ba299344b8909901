"""The config tree. Each component receives only its own section.

Every field has a default and a docstring (the text under it). Models are frozen and forbid
unknown keys; the loader turns validation errors into messages naming the field path, the
value and what is allowed. Derived runtime values are returned by builders, never written
back here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from rollstream.config.engine import (  # the whole tree stays importable from here
    EngineConfig,
    LocalEngineConfig,  # noqa: F401
    VllmEngineConfig,  # noqa: F401
)
from rollstream.config.model import (
    ModelConfig,
    TinyModelConfig,  # noqa: F401
    WarmStartConfig,  # noqa: F401
)
from rollstream.config.breaker import BreakerConfig
from rollstream.config.early_stop import EarlyStopConfig, check_early_stop
from rollstream.config.reconfigure import ReconfigureConfig, check_schedule
from rollstream.config.replay import ReplayConfig, check_replay
from rollstream.config.runtime import RuntimeConfig, check_runtime
from rollstream.config.section import Section
from rollstream.config.tasks import (  # the whole tree stays importable from here
    AgentConfig,
    ColumnsConfig,  # noqa: F401
    ProxyConfig,
    SourceConfig,  # noqa: F401
    TasksConfig,
)


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
_MODE_K = {"sync": 0, "one_step": 1}  # mode -> staleness bound; async: max_staleness


class RolloutConfig(Section):
    mode: Literal["sync", "one_step", "async"] = "async"
    """``sync``: generate a batch, train, repeat (on-policy). ``one_step``: rollout of step k+1
    overlaps training of step k. ``async``: continuous rollout bounded by max_staleness."""
    max_staleness: int = Field(2, ge=0)
    """``async`` only: the staleness bound k. Sizes admission (a group starts only while
    admitted <= (served version + k + 1) x groups_per_step) and, unless max_context_age or
    train.max_token_age says otherwise, is the largest (trainer step - policy version) of a
    trained token (older: the group is dropped stale). ``sync`` means 0 and ``one_step`` 1:
    setting another value with them is an error."""
    max_context_age: int | None = Field(None, ge=0)
    """Largest (trainer step - policy version) of *any* token a trained sample has seen,
    masked or not (>= the staleness bound k; null = 2k with ``train.max_token_age``, else k).
    Above k without max_token_age: k bounds admission only and long samples are trained
    whole up to this age (AReaL's semantics; the README's staleness table)."""
    on_update: OnUpdate = "interrupt"
    """What in-flight samples do when new weights load. Partial rollout: ``interrupt`` (abort
    at a token boundary and resume prompt + partial on the new weights) or ``continue`` (the
    request goes on in place; later tokens carry the new version; engine.local.kv_on_load
    says whether its cache is recomputed). ``drain``: in-flight samples finish on the old
    weights before the new ones load. Tokens always keep the version that sampled them."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
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
    """With ``dispatch: engine``: send a request to the engine that holds its prefix (the
    engine its episode's or partial sample's last request ran on, else the one its group's
    first sample went to) while that engine has a free sequence and at most 4 requests more
    than the least loaded; otherwise to the least loaded, re-pinning the group there. Pays on
    engines with a prefix cache (vLLM's automatic prefix caching); the embedded engine has
    none. docs/dispatch.md."""
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
        return _MODE_K.get(self.mode, self.max_staleness)


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


class ISCorrectionConfig(Section):
    level: Literal["token", "sequence"] = "token"
    """Importance ratio per token or per sequence (geometric mean)."""
    mode: Literal["none", "truncate", "mask"] = "truncate"
    """Truncated IS (cap the weight) or masked IS (drop tokens whose weight leaves bounds)."""
    cap: float = Field(2.0, gt=1)
    """Upper bound (truncate) or upper mask threshold (mask)."""
    lower: float = Field(0.5, gt=0, lt=1)
    """Lower mask threshold (mask mode)."""


class FsdpConfig(Section):
    world_size: int = Field(2, ge=1)
    """Trainer ranks: processes the controller starts (Ray actors in ``runtime.ray.scale_units``
    units on ``runtime.kind: ray``), each holding a shard of the policy and
    of AdamW's state and computing every ``world_size``-th micro-batch of a step (gloo on CPU,
    NCCL with ``device: cuda``). docs/distributed.md."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks compute: ``cpu`` (gloo) or ``cuda`` (rank r on GPU r, NCCL)."""
    max_restarts: int = Field(1, ge=0)
    """Times a run resumes from its newest durable checkpoint (``train.checkpoint_every``)
    after a rank process died (killed, crashed, out of memory): the step being computed is
    lost, every rank is started again and the run continues as ``resume=true`` would, in the
    same command. A rank that raised an error is not restarted (it would raise again)."""


class TrainConfig(Section):
    steps: int = Field(60, ge=1)
    """Optimizer steps (each publishes a new weight version)."""
    groups_per_step: int = Field(16, ge=1)
    """Groups (prompts) per trainer step."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: ``grpo`` ((r - group mean) / group std), ``dr_grpo`` (r - group
    mean, no std; with Dr.GRPO's constant loss normaliser unless ``loss_agg`` says
    otherwise), ``rloo`` (r - mean of the other samples)."""
    advantage_std: Literal["sample", "population"] = "sample"
    """The group standard deviation of ``grpo``: ``sample`` (Bessel-corrected, divide by
    n - 1, as verl and TRL) or ``population`` (divide by n). Only ``grpo`` divides by a std:
    setting ``population`` with another advantage is an error."""
    failed_reward: Literal["exclude", "zero"] = "exclude"
    """A FAILED sample (engine error, reward error or timeout) in its group's baseline:
    ``exclude`` leaves it out (the baseline is the graded samples'), ``zero`` counts it as
    reward 0 (a failure lowers the baseline, so the group's successes weigh more). Either way
    the failed sample itself is never trained; the zero-variance filter uses the same
    baseline."""
    loss: Literal["auto", "ppo_clip", "decoupled_ppo"] = "auto"
    """Policy loss. ``ppo_clip`` clips the ratio to the behaviour policy (the engine's
    logprobs). ``decoupled_ppo`` (AReaL) clips against the proximal (pre-step) policy and
    weights by the behaviour->proximal importance ratio, truncated per ``is_correction``:
    with stale samples the behaviour policy is several versions old, and clipping against it
    would clip most stale tokens. ``auto`` = ``decoupled_ppo`` when the staleness bound is
    above 0 (``one_step``, ``async``), ``ppo_clip`` in ``sync`` mode."""
    loss_agg: Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                      "seq_mean_token_sum_norm"] = "auto"
    """How token losses add up to the step's loss (verl's names): ``token_mean`` (mean over
    every kept token), ``seq_mean_token_mean`` (mean over samples of each sample's token
    mean), ``seq_mean_token_sum`` (mean over samples of each sample's token sum),
    ``seq_mean_token_sum_norm`` (token sum / (samples x sampling.max_new_tokens): Dr.GRPO's
    constant normaliser). ``auto`` = ``seq_mean_token_sum_norm`` for ``advantage: dr_grpo``,
    else ``token_mean``; another value with ``dr_grpo`` is an error (Dr.GRPO is both)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO clip range."""
    is_correction: ISCorrectionConfig = ISCorrectionConfig()
    """Engine–trainer mismatch correction."""
    max_token_age: int | None = Field(None, ge=0)
    """Mask out tokens whose version is older than trainer step - this (None = off). Staleness
    then counts only the kept tokens: a sample resumed across many updates (partial rollout)
    trains on its recent tokens instead of being dropped stale."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the initial (reference) policy (0 = no reference model)."""
    lr: float = Field(2e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    updates_per_step: int = Field(2, ge=1)
    """Passes over each step's batch (each pass is one optimizer update)."""
    micro_batch_tokens: int = Field(8192, ge=16)
    """Tokens computed per micro-batch (rows x row width; short samples share rows, so
    padding stays small whatever the budget); micro-batches accumulate gradients."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. ``bfloat16``: mixed precision, the matmuls in bf16 under autocast,
    parameters, AdamW state and the logits (and on CPU attention) in float32
    (train/precision.py)."""
    compile: bool = False
    """Compile the policy's forward (and so its backward) with ``torch.compile`` (dynamic
    shapes; ``backend: local`` only). The first step pays the compile (tens of seconds on a
    CPU, less with inductor's on-disk cache warm); later steps run faster (docs/benchmarks.md
    has the measured step time and the break-even), so it pays on long runs only."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the trainer (0 = leave as is)."""
    cpu_affinity: tuple[NonNegativeInt, ...] = ()
    """CPU cores the trainer's calling thread is pinned to (Linux ``sched_setaffinity`` of
    that thread only; empty = leave as is). With ``backend: fsdp`` the cores the rank
    processes share out: each rank's compute thread is pinned to its own slice (ranks share
    cores round-robin when there are fewer cores than ranks), with as many torch threads as
    its slice has cores unless ``threads`` is set."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a durable checkpoint (``checkpoints/step_NNNNNN``: weights, optimizer, data
    cursor, buffer, in-flight partial samples; docs/run-dir.md) every N steps; one is also
    saved when the run ends or stops (0 = only then)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Durable checkpoints kept (the newest N; older ones are deleted once a newer is whole)."""
    backend: Literal["local", "fsdp"] = "local"
    """``local``: the trainer computes in the controller's process. ``fsdp``: PyTorch FSDP2
    over ``fsdp.world_size`` rank processes, micro-batches shared among them; the same loss,
    and the same update up to float rounding (docs/distributed.md)."""
    fsdp: FsdpConfig = FsdpConfig()
    """Settings of ``backend: fsdp`` (one set with ``backend: local`` is an error)."""


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
    """How agent episodes (sources of kind ``tally``) run: budgets, tool limits and where
    OpenAI-SDK agents run."""
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
        tiny, vllm = self.model.tiny, self.engine.vllm
        if self.model.path is None and self.engine.kind == "vllm" and \
                vllm.max_model_len > tiny.max_position:
            raise ValueError(
                f"engine.vllm.max_model_len = {vllm.max_model_len} exceeds model.tiny."
                f"max_position = {tiny.max_position} (the model's max_position_embeddings, "
                "which vLLM refuses to exceed); lower max_model_len or raise max_position"
            )
        _check_rollout(self.rollout, self.train)
        check_replay(self.rollout, self.train)
        check_early_stop(self.rollout)
        _check_train(self.train)
        check_runtime(self)
        if self.reward.name != "auto":
            for i, source in enumerate(self.tasks.sources):
                if source.reward is not None:
                    raise ValueError(
                        f"tasks.sources.{i}.reward = {source.reward!r} contradicts reward.name = "
                        f"{self.reward.name!r} (which grades every source): set reward.name: "
                        "auto to give sources their own rewards, or drop the source's reward"
                    )
        if not any(s.harness == "openai" for s in self.tasks.sources):
            if self.agent.harness_workers:
                raise ValueError(
                    f"agent.harness_workers = {self.agent.harness_workers} is read only by "
                    "sources with harness: openai (tasks.sources has none); drop it or set 0")
            if self.agent.proxy != ProxyConfig():
                raise ValueError(
                    "agent.proxy is read only by sources with harness: openai (tasks.sources "
                    "has none); drop it")
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature = 0 cannot train: greedy samples of a group are all the "
                "same, so no group has reward variance (use eval.temperature for greedy eval)"
            )
        check_schedule(self)
        return self


def _check_train(t: TrainConfig) -> None:
    """Training settings that contradict each other."""
    if t.advantage == "dr_grpo" and t.loss_agg not in ("auto", "seq_mean_token_sum_norm"):
        raise ValueError(
            f"train.loss_agg = {t.loss_agg} contradicts train.advantage = dr_grpo (Dr.GRPO is "
            "both its advantage and the constant normaliser samples x max_new_tokens, i.e. "
            "loss_agg seq_mean_token_sum_norm or auto); for another aggregation use "
            "advantage grpo or rloo"
        )
    if t.backend != "fsdp" and t.fsdp != FsdpConfig():
        changed = next(k for k, v in t.fsdp if v != FsdpConfig.model_fields[k].default)
        raise ValueError(
            f"train.fsdp.{changed} = {getattr(t.fsdp, changed)} is read only with "
            f"train.backend = fsdp (it is {t.backend}); set backend: fsdp or drop it"
        )
    if t.compile and t.backend != "local":
        raise ValueError(
            f"train.compile = true is implemented for train.backend = local only (it is "
            f"{t.backend}); drop one"
        )
    if t.advantage_std != "sample" and t.advantage != "grpo":
        raise ValueError(
            f"train.advantage_std = {t.advantage_std} has no effect with train.advantage = "
            f"{t.advantage} (only grpo divides by the group std); drop advantage_std"
        )


def _check_rollout(r: RolloutConfig, t: TrainConfig) -> None:
    """Rollout settings that contradict each other, or that cannot train."""
    set_ = r.model_fields_set
    if r.mode in _MODE_K and "max_staleness" in set_ and r.max_staleness != _MODE_K[r.mode]:
        raise ValueError(
            f"rollout.max_staleness = {r.max_staleness} contradicts rollout.mode = {r.mode} "
            f"(which means max_staleness {_MODE_K[r.mode]}); use mode: async to choose the bound"
        )
    if r.prefix_affinity and r.dispatch != "engine":
        raise ValueError(
            f"rollout.prefix_affinity = true contradicts rollout.dispatch = {r.dispatch} (the "
            "dispatch queue places requests by predicted load; affinity routes with dispatch: "
            "engine only); drop one"
        )
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
    k = r.staleness_bound
    m = t.max_token_age
    if m is not None and m > k:
        raise ValueError(
            f"train.max_token_age = {m} exceeds the staleness bound {k} (rollout.mode = "
            f"{r.mode}, rollout.max_staleness = {r.max_staleness}): the loss would keep tokens "
            "older than the bound; use max_token_age <= max_staleness"
        )
    if r.max_context_age is not None and r.max_context_age < k:
        raise ValueError(
            f"rollout.max_context_age = {r.max_context_age} is below the staleness bound "
            f"{k} (rollout.max_staleness / rollout.mode); use max_context_age >= {k}"
        )
    if r.group_size == 1 and r.filter_zero_variance:
        raise ValueError(
            "rollout.group_size = 1 with rollout.filter_zero_variance = true cannot train: a "
            "group of one has no reward variance, so every group is filtered"
        )
