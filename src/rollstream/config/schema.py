"""The config tree. Each component receives only its own section.

Every field has a default and a docstring (the text under it). Models are frozen and forbid
unknown keys; the loader turns validation errors into messages naming the field path, the
value and what is allowed. Derived runtime values are returned by builders, never written
back here.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TinyModelConfig(Section):
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture family written to config.json."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention when < num_heads)."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width."""
    max_position: int = Field(512, ge=16)
    """Maximum sequence length (prompt + response)."""
    seed: int = 0
    """Initialisation seed."""


class WarmStartConfig(Section):
    steps: int = Field(250, ge=0)
    """Supervised steps on noisy demonstrations before RL (0 = none). Cached by content hash."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm start."""
    tokens_per_step: int = Field(4096, ge=64)
    """Tokens per supervised step."""
    noise: float = Field(0.15, ge=0, le=1)
    """Probability that a demonstration step slips by one (keeps RL headroom)."""


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face causal-LM folder (Llama/Qwen2 family). When null, the tiny-model kit
    builds one (``tiny``), warm-starts it on the run's tasks and caches it under cache_dir."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the model the kit builds when ``path`` is null."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start applied to a kit-built model."""
    cache_dir: str = ".cache/rollstream"
    """Where built models and warm starts are cached."""


_DATASET_KINDS = ("jsonl", "parquet", "hf_dataset")  # the kinds that read a dataset at `path`
_COLUMN_PATH = r"^[^.\s]+(\.[^.\s]+)*$"  # dotted path into nested fields: reward_model.ground_truth
# keyword names a reward already receives from the response (rollstream.reward.registry)
_RESPONSE_KWARGS = ("finish_reason", "token_ids")


class ColumnsConfig(Section):
    """Which dataset columns mean what (dotted paths reach into nested fields, e.g.
    ``reward_model.ground_truth``)."""

    prompt: str = Field("prompt", pattern=_COLUMN_PATH)
    """The prompt: a string (tokenized as is) or chat messages, a list of ``{role, content}``
    (rendered with the model's chat template and its generation prompt, as TRL and verl do)."""
    answer: str | None = Field(None, pattern=_COLUMN_PATH)
    """The reference answer (``task.reference``; a number is turned into its text). Null =
    the first of ``answer``, ``solution``, ``reward_model.ground_truth`` (verl) that the row
    has."""
    id: str | None = Field(None, pattern=_COLUMN_PATH)
    """A row id naming the task ``<source>/<id>`` (a non-empty string or an integer). Null
    = ``id`` when the row has one; a row without an id is named by its line (JSONL) or row
    number."""


class SourceConfig(Section):
    kind: Literal["tick", "digits", "math", "jsonl", "parquet", "hf_dataset", "tally"] = "tick"
    """Task family: ``tick`` (count up/down, long-tailed length), ``digits`` (count a
    fixed-width number down by 3, long-tailed), ``math`` (small arithmetic, graded by
    math-verify), ``tally`` (a multi-turn agent episode: sum a list with a calculator tool, one
    call per item; run by the agent loop with the ``agent`` settings; docs/agents.md); or a
    dataset at ``path``: ``jsonl`` (one JSON object per line), ``parquet`` (a Parquet file,
    e.g. verl's), ``hf_dataset`` (a folder written by Hugging Face ``datasets``'
    ``Dataset.save_to_disk``, one split)."""
    path: str | None = None
    """The dataset of a ``jsonl``, ``parquet`` (a file) or ``hf_dataset`` (a folder) source
    (``~`` is expanded)."""
    columns: ColumnsConfig = ColumnsConfig()
    """Which columns of a dataset source hold the prompt, the answer and the row id."""
    reward_kwargs: tuple[str, ...] = ()
    """Columns of a dataset source passed to its reward as keyword arguments, each named by
    its last path segment (``extra_info`` -> ``extra_info=...``, ``reward_model.style`` ->
    ``style=...``); values must be JSON values (a checkpoint keeps them). The reward's
    signature is checked against them when the run is built."""
    reward: str | None = Field(None, min_length=1)
    """The reward that grades this source's tasks: a registered reward name (``exact_match``,
    ``math``, ``math_answer``, or one registered with ``@register_reward``) or an import path
    ``module:function``. Null = the kind's own (math: ``math_answer``; the others:
    ``exact_match``). Only with ``reward.name: auto``; checked when the run is built."""
    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Source name used in task uids and metrics (null = the kind); unique within a mix."""
    weight: float = Field(1.0, gt=0)
    """Share of training tasks drawn from this source."""
    harness: Literal["agent", "openai"] | None = None
    """What runs an agent source's episodes (kind ``tally``): ``agent`` (the built-in agent
    loop, the default) or ``openai`` (the source's agent written with the ``openai`` SDK,
    talking to rollstream's OpenAI-compatible proxy on 127.0.0.1). Not for single-turn
    kinds."""
    max_items: int = Field(32, ge=1)
    """Upper bound on answer items (caps the long tail)."""
    pareto_alpha: float = Field(1.1, gt=0)
    """Shape of the Pareto distribution of the number of items (smaller = longer tail)."""

    @property
    def reads_dataset(self) -> bool:
        return self.kind in _DATASET_KINDS

    @property
    def reward_kwarg_columns(self) -> dict[str, str]:
        """Keyword name -> column path of ``reward_kwargs``."""
        return {c.rsplit(".", 1)[-1]: c for c in self.reward_kwargs}

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> SourceConfig:
        if self.harness is not None and self.kind != "tally":
            raise ValueError(f"`harness` is read only by agent sources (kind tally); kind "
                             f"{self.kind} is one request per sample (drop harness)")
        if self.reads_dataset and self.path is None:
            raise ValueError(f"kind {self.kind} needs `path` (its dataset)")
        if not self.reads_dataset:
            defaults = SourceConfig.model_fields
            for key in ("path", "columns", "reward_kwargs"):
                if getattr(self, key) != defaults[key].default:
                    raise ValueError(
                        f"`{key}` is read only by a jsonl, parquet or hf_dataset source; kind "
                        f"{self.kind} generates its tasks (drop {key} or use a dataset kind)")
        for col in self.reward_kwargs:
            if not re.fullmatch(_COLUMN_PATH, col):
                raise ValueError(f"reward_kwargs: {col!r} is not a column path (names joined "
                                 "by dots, e.g. extra_info or reward_model.style)")
        names = [c.rsplit(".", 1)[-1] for c in self.reward_kwargs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(f"reward_kwargs {list(self.reward_kwargs)} pass more than one "
                             f"column as keyword {clash}; a keyword is a column's last segment")
        taken = sorted(set(names) & set(_RESPONSE_KWARGS))
        if taken:
            raise ValueError(f"reward_kwargs: keyword {taken} is the response's, which a "
                             "reward receives by declaring it; drop it from reward_kwargs")
        return self


class AgentConfig(Section):
    max_turns: int = Field(32, ge=1)
    """Model turns of an agent episode (then it ends with ``max_turns``)."""
    max_turn_tokens: int = Field(64, ge=1)
    """Tokens of one model turn (a turn cut by it is closed by the chat template and the
    episode goes on). An episode's tokens in all (model and environment) are capped by
    ``sampling.max_new_tokens``."""
    max_wall_s: float | None = Field(None, gt=0)
    """Wall time of an episode (None = no limit); a turn or tool still running then is
    stopped and the episode ends with ``max_wall``."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Per tool call: a call still running then ends with an error message to the model."""
    max_tool_concurrency: int | None = Field(None, ge=1)
    """Tool calls running at once per agent source, across its episodes (None = no bound)."""


class TasksConfig(Section):
    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    """Task sources mixed by weight."""
    num_eval: int = Field(64, ge=0)
    """Held-out prompts scored at the start and the end of a run."""
    seed: int = 0
    """Seed of task generation (train and eval streams are disjoint)."""


class LocalEngineConfig(Section):
    max_slots: int = Field(64, ge=1)
    """Concurrent sequences (KV cache rows). Further requests queue, never crash."""
    max_seq_len: int = Field(512, ge=8)
    """KV cache length per slot (prompt + response)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the engine thread (0 = leave as is)."""
    cpu_affinity: tuple[NonNegativeInt, ...] = ()
    """CPU cores the engine's step thread is pinned to (Linux ``sched_setaffinity`` of that
    thread only; empty = leave as is)."""
    device: str = "auto"
    """``auto`` (cuda when present, else cpu), ``cpu`` or ``cuda``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights, activations and KV cache precision (float32 matches a float32 trainer)."""
    kv_on_load: Literal["recompute", "keep"] = "recompute"
    """After a weight load, in-flight rows ``recompute`` their KV cache with the new weights
    (tokens after the load are exactly the new policy's) or ``keep`` the old cache (no
    recompute; later tokens attend over keys/values of older weights, as in vLLM and
    PipelineRL; the trainer's importance weights see the difference as mismatch)."""
    max_prefill_tokens: int = Field(2048, ge=1)
    """Prompt tokens prefilled together in one step (at least one prompt is always admitted)."""
    fuse_prefill: bool = True
    """Prefill the prompts admitted in a step inside that step's decode forward pass (one
    pass whose matmuls cover both, as vLLM's chunked prefill; a prompt is not split across
    steps) instead of a separate prefill pass first."""
    max_restarts: int = Field(3, ge=0)
    """Times an engine whose step loop died is restarted (fresh cache and thread, the current
    weights) before it stays DEAD; its requests continue elsewhere meanwhile."""


class VllmEngineConfig(Section):
    urls: tuple[str, ...] = ()
    """Attach to running servers instead of launching (e.g. http://127.0.0.1:8000); engine
    ``i`` of ``engine.num_engines`` uses ``urls[i]``. Empty: each engine launches its own
    server on 127.0.0.1."""
    max_model_len: int = Field(512, ge=16)
    """vLLM --max-model-len (keep identical across runs to reuse the compile cache)."""
    kv_cache_bytes: int = Field(268435456, ge=1 << 20)
    """vLLM --kv-cache-memory-bytes."""
    enforce_eager: bool = True
    """Skip torch.compile (faster start on CPU)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for /health."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments for the server (not ``--logprobs-mode``: rollstream runs
    vLLM with ``processed_logprobs``, the logprobs of the distribution actually sampled)."""

    @model_validator(mode="after")
    def _keeps_processed_logprobs(self) -> VllmEngineConfig:
        if any(a.split("=", 1)[0] == "--logprobs-mode" for a in self.extra_args):
            raise ValueError(
                "extra_args may not set --logprobs-mode: rollstream runs vLLM with "
                "--logprobs-mode processed_logprobs (the logprobs of the tempered, top-k/top-p "
                "truncated distribution each token was sampled from, which training needs)")
        return self


class EngineConfig(Section):
    kind: Literal["local", "vllm"] = "local"
    """Which engine serves rollouts."""
    num_engines: int = Field(1, ge=1)
    """Engine replicas (local: in this process)."""
    local: LocalEngineConfig = LocalEngineConfig()
    """Settings of the embedded engine."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """Settings of the vLLM engine."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Rollout temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k cut (0 = off)."""
    max_new_tokens: int = Field(240, ge=1)
    """Response length cap."""


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
    partial_rollout: bool = True
    """On a weight update, interrupt in-flight samples and resume them on the new weights
    (keeping their tokens) instead of letting them finish on the old ones."""
    on_update: Literal["interrupt", "continue"] = "interrupt"
    """With partial_rollout: ``interrupt`` (abort at a token boundary and resubmit prompt +
    partial) or ``continue`` (keep the request, later tokens carry the new version). Setting
    it with ``partial_rollout: false`` is an error (in-flight samples drain instead)."""
    group_size: int = Field(8, ge=1)
    """Samples per task (the GRPO group)."""
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
    """Training precision."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the trainer (0 = leave as is)."""
    cpu_affinity: tuple[NonNegativeInt, ...] = ()
    """CPU cores the trainer's calling thread is pinned to (Linux ``sched_setaffinity`` of
    that thread only; empty = leave as is)."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a durable checkpoint (``checkpoints/step_NNNNNN``: weights, optimizer, data
    cursor, buffer, in-flight partial samples; docs/run-dir.md) every N steps; one is also
    saved when the run ends or stops (0 = only then)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Durable checkpoints kept (the newest N; older ones are deleted once a newer is whole)."""


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


class RunConfig(Section):
    name: str = "run"
    """Run name; the run directory is ``{run_root}/{name}``."""
    run_root: str = "runs"
    """Parent folder of run directories."""
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
    """How agent episodes (sources of kind ``tally``) run: budgets and tool limits."""
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    monitor: MonitorConfig = MonitorConfig()

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
        _check_train(self.train)
        if self.reward.name != "auto":
            for i, source in enumerate(self.tasks.sources):
                if source.reward is not None:
                    raise ValueError(
                        f"tasks.sources.{i}.reward = {source.reward!r} contradicts reward.name = "
                        f"{self.reward.name!r} (which grades every source): set reward.name: "
                        "auto to give sources their own rewards, or drop the source's reward"
                    )
        if self.sampling.temperature == 0:
            raise ValueError(
                "sampling.temperature = 0 cannot train: greedy samples of a group are all the "
                "same, so no group has reward variance (use eval.temperature for greedy eval)"
            )
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
    if "on_update" in set_ and not r.partial_rollout:
        raise ValueError(
            f"rollout.on_update = {r.on_update} contradicts rollout.partial_rollout = false "
            "(without partial rollout in-flight samples drain on the old weights); drop one"
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
