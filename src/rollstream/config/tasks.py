"""The config of what a run trains on: task sources (generated families, datasets and agent
tasks, with their columns and rewards) and how agent episodes run. Part of the config tree of
``config/schema.py``, which imports these sections."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rollstream.config.section import Section

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
    """This source's target share of trained samples (weights are normalised over the
    sources): ``tasks.mix: quota`` keeps the trained mixture there, ``weighted`` draws this
    share of the groups (docs/data.md)."""
    max_oversample: float = Field(4.0, ge=1)
    """``tasks.mix: quota`` only: the correction may draw at most this many times the share of
    groups the weight gives (a source whose groups are mostly filtered needs more draws; one
    that never trains cannot take the whole rollout, its trained share falls short instead,
    as ``mixture_error_pp`` shows)."""
    max_in_flight: int | None = Field(None, ge=1)
    """Groups of this source generating at once (null = no cap): when it is reached, the next
    groups come from the other sources, or wait for one of this source's to finish."""
    max_in_flight_per_task: int | None = Field(None, ge=1)
    """Dataset kinds only: groups of one task (row) generating at once (null = no cap); a row
    at its cap is passed over until the cursor comes round again."""
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
    def source_name(self) -> str:
        """The name in task uids, metrics and reconfiguration keys: ``name``, else the kind."""
        return self.name or self.kind

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
            for key in ("path", "columns", "reward_kwargs", "max_in_flight_per_task"):
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


class ProxyConfig(Section):
    """Limits of the OpenAI-compatible agent proxy (``agent/proxy.py``): what one call and one
    session may cost it, whatever a harness sends."""

    max_request_bytes: int = Field(8 << 20, ge=1024)
    """Largest request body in bytes: a larger one is answered HTTP 413 before it is read
    whole or parsed."""
    max_session_calls: int = Field(1024, ge=1)
    """Calls one session (one episode's key) may make; later ones are refused (HTTP 400).
    Must exceed ``agent.max_turns``, so that a training episode ends by its turn budget."""
    max_session_history_bytes: int = Field(16 << 20, ge=1024)
    """Bytes of message text one session's samples may hold (what its calls added, counted
    as UTF-8); a call that would pass it is refused (HTTP 400)."""


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
    """Per tool call (the loop's, and those an SDK agent runs through its session): a call
    still running then ends with an error message to the model."""
    max_tool_concurrency: int | None = Field(None, ge=1)
    """Tool calls running at once per agent source, across its episodes (None = no bound)."""
    max_tool_output_chars: int = Field(16384, ge=1)
    """Characters of one tool call's output the model is shown; the rest is cut, with a note
    saying so, before it is tokenized (a program may print far more than a turn's budget)."""
    harness_workers: int = Field(0, ge=0, le=256)
    """Where the agents of ``harness: openai`` sources run: 0 = as coroutines in the run's
    process; N > 0 = in a pool of N long-lived worker processes, started at the first such
    episode and reused, one episode each at a time (so at most N of these episodes run at
    once). A worker that dies, or whose agent runs past ``max_wall_s``, is killed and
    replaced, failing only that episode's sample. Use them for agents that block or use CPU
    (they would stall the engine's process) or that must not share its interpreter."""
    proxy: ProxyConfig = ProxyConfig()
    """Limits of the proxy that ``harness: openai`` agents talk to (also ``rollstream
    proxy``'s)."""

    @model_validator(mode="after")
    def _calls_outlast_turns(self) -> AgentConfig:
        if self.proxy.max_session_calls <= self.max_turns:
            raise ValueError(
                f"agent.proxy.max_session_calls = {self.proxy.max_session_calls} must exceed "
                f"agent.max_turns = {self.max_turns}: a training episode's call after its "
                "last turn is how it learns the turn budget is spent")
        return self


class PassRateConfig(Section):
    """Pass-rate-aware task sampling (docs/data.md): tasks whose recent groups were all
    correct or all wrong are drawn less, down to a floor."""

    enabled: bool = False
    """Track pass rates online and draw tasks by how likely their next group is to have
    reward variance. Per task for a dataset; per difficulty bucket (the number of items) for
    a generated source; a source without buckets is drawn in order."""
    floor: float = Field(0.1, gt=0, le=1)
    """A task's (bucket's) draw weight is the chance its next group has reward variance
    (from a Beta posterior whose prior is fitted to its source), but at least this: whatever
    its groups did, it is drawn at least this share as often as a task sure to train, so
    nothing starves and a change of difficulty is seen."""
    half_life_groups: float = Field(8.0, gt=0)
    """A task's evidence halves every this many of its groups (recent groups count more)."""


class TasksConfig(Section):
    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    """Task sources, mixed by ``weight`` as ``mix`` says."""
    mix: Literal["quota", "weighted"] = "quota"
    """How the next group's source is chosen. ``quota``: keep the *trained* mixture at the
    weights, whatever each source's length and share of filtered groups (deficit-corrected
    with the rollout's feedback; docs/data.md). ``weighted``: draw a source with probability
    ∝ weight, seeded; the trained mixture drifts toward sources whose groups are filtered
    less."""
    pass_rate: PassRateConfig = PassRateConfig()
    """Pass-rate-aware sampling of the tasks within each source."""
    num_eval: int = Field(64, ge=0)
    """Held-out prompts scored at the start and the end of a run."""
    seed: int = 0
    """Seed of task generation (train and eval streams are disjoint)."""

    @model_validator(mode="after")
    def _fields_read(self) -> TasksConfig:
        default = SourceConfig.model_fields["max_oversample"].default
        for i, src in enumerate(self.sources):
            if self.mix == "weighted" and src.max_oversample != default:
                raise ValueError(f"tasks.sources.{i}.max_oversample = {src.max_oversample:g} "
                                 "is read only by tasks.mix = quota (drop it or use quota)")
        if not self.pass_rate.enabled and self.pass_rate != PassRateConfig():
            raise ValueError("tasks.pass_rate settings are read only with "
                             "tasks.pass_rate.enabled = true (set it or drop them)")
        return self
